"""A conversation's tail under the segment grid, on the real ``--tangram`` server (CPU, SmolLM2).

The grid server of ``test_segment_grid.py`` (``TANGRAM_GRID_SEGMENTS=1``,
``--chunked-prefill-size 64``, every whole cell compressed). After a chat's last whole cell the
tokens (the prompt's partial chunk, the reply) are kept whole and cached inside their cell:

* a short chat whose prompts stay inside one cell reuses the previous prompt and reply on every
  turn (``cached_tokens`` covers the previous prompt, as stock SGLang's radix cache does), and
  gives the same tokens and logprobs as a flushed server;
* a turn whose prompt fills the cell is cut back to the cell's start (``cached_tokens`` = that
  multiple of 64), so the cell is compressed whole as a cold server compresses it, and again
  gives the same tokens and logprobs hot and flushed.
"""

from __future__ import annotations

import pytest
from test_segment_grid import GRID, chat, flush, radix, server  # noqa: F401 (fixture)

pytestmark = pytest.mark.e2e

SYSTEM = {"role": "system", "content": "Be brief."}
REPLY = 4  # max_tokens of every turn (turns 1-3 of the short chat stay under 64 tokens)
QUESTIONS = (
    "A red fruit?",
    "A yellow one?",
    "A green one?",
    "Now list four countries of Europe that border the sea, each with its capital city and "
    "the name of one river that flows through it, please.",
)


def test_a_short_chat_reuses_its_tail_and_a_full_cell_is_cut_back(server):  # noqa: F811
    flush(server)
    messages, hot = [SYSTEM], []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        hot.append((list(messages), chat(server, messages, max_tokens=REPLY)))
        messages.append({"role": "assistant", "content": hot[-1][1]["text"]})
    prompts = [h["prompt"] for _, h in hot]
    cached = [h["cached"] for _, h in hot]
    # The scenario: turns 1-3 inside the first cell, turn 4 past it.
    assert prompts[2] < GRID <= prompts[3], prompts
    assert cached[0] == 0
    for turn in (1, 2):  # turns 2 and 3: the previous prompt and (part of) its reply
        assert prompts[turn - 1] <= cached[turn] < prompts[turn], (turn, prompts, cached)
    assert cached[3] == 0, cached  # the prompt fills cell [0, 64): cut back to its start
    stats = radix(server)
    assert stats["grid_cells"] == 1 and stats["segments"] > 1, stats  # the cell + tail pieces
    for turn, (history, h) in enumerate(hot, start=1):
        flush(server)
        cold = chat(server, history, max_tokens=REPLY)
        assert cold["cached"] == 0
        assert cold["text"] == h["text"], f"turn {turn}: hot {h['text']!r}, cold {cold['text']!r}"
        assert cold["logprobs"] == pytest.approx(h["logprobs"], abs=1e-5), f"turn {turn}"


def test_a_chat_past_its_first_cell_reuses_whole_cells_and_its_tail(server):  # noqa: F811
    """A longer chat: the match keeps the tail inside the current cell, then is cut back to
    the cell's start (a multiple of 64, not 0) when a prompt fills it; every turn gives the
    same tokens and logprobs hot and flushed."""
    flush(server)
    messages = [SYSTEM]
    turns = []
    words = " ".join(f"w{i}" for i in range(40))
    for question in (f"Repeat nothing. {words}", "Say ok.", "Say yes.", *QUESTIONS[3:]):
        messages.append({"role": "user", "content": question})
        turns.append((list(messages), chat(server, messages, max_tokens=REPLY)))
        messages.append({"role": "assistant", "content": turns[-1][1]["text"]})
    prompts = [h["prompt"] for _, h in turns]
    cached = [h["cached"] for _, h in turns]
    cell = prompts[0] // GRID * GRID
    assert cell >= GRID and prompts[2] < cell + GRID <= prompts[3], prompts
    for turn in (1, 2):
        assert prompts[turn - 1] <= cached[turn] < prompts[turn], (turn, prompts, cached)
    assert cached[3] == cell, (prompts, cached)
    # Turns 2 and 3 reuse a tail kept whole on top of compressed cells, turn 4 compresses the
    # cell it fills: each gives what a flushed server gives.
    for turn, (history, hot) in enumerate(turns[1:], start=2):
        flush(server)
        cold = chat(server, history, max_tokens=REPLY)
        assert cold["cached"] == 0
        assert cold["text"] == hot["text"], (
            f"turn {turn}: hot {hot['text']!r}, cold {cold['text']!r}"
        )
        assert cold["logprobs"] == pytest.approx(hot["logprobs"], abs=1e-5), f"turn {turn}"
