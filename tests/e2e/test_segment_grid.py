"""Grid segmentation on the real ``--tangram`` server (CPU, SmolLM2, 0.5 profile).

One server with ``TANGRAM_GRID_SEGMENTS=1`` and ``--chunked-prefill-size 64`` (prompt segments
cut at absolute multiples of 64 tokens, the tree caches whole cells and, after them, the tail
kept whole inside its cell;
``--tangram-min-compress-tokens 0``, so every cell is a compressed segment):

* hot equals cold: a 4-turn chat at temperature 0 gives the same tokens and the same logprobs
  turn by turn whether the server cached the earlier turns (hot) or was flushed just before the
  turn (cold); hot turns reuse whole cells and the previous turn's tail in its cell
  (``test_grid_tail.py`` checks the tail on short chats);
* a shared document is prefilled once: a second conversation on the same document (another
  question) reuses every whole cell of it, and the tree holds one copy of those cells;
* concurrent clients on one document: the cells of the first client's chunked prefill are
  inserted while it runs, so the others match them instead of prefilling their own copy.

Without the grid (segments cut where the radix match ends) the hot/cold test fails: the hot
server compressed turn 1's prompt on its own, the cold one compressed it with the later turns.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tangram_sglang.serving import SGLangServer

pytestmark = pytest.mark.e2e

PROFILE_05 = "calibration/smollm2/ada-snapkv-r0.5.json"
GRID = 64  # --chunked-prefill-size = the segment grid (tokens)
DOCUMENT = (
    "The lighthouse keeper of Port Avel kept a logbook. On Monday the ferry was late because "
    "of fog. On Tuesday a fishing boat named Marguerite lost its net near the northern rocks. "
    "On Wednesday the keeper repainted the lamp room green and fed the two cats, Pepper and "
    "Salt. On Thursday a storm broke three windows of the harbour office. On Friday the mayor "
    "visited and promised a new radio. On Saturday the keeper's niece Lena arrived by train "
    "with a basket of apples. On Sunday nobody sailed."
)
QUESTIONS = (
    "What colour was the lamp room painted?",
    "Who arrived on Saturday, and how?",
    "What broke on Thursday?",
    "Name the two cats.",
)


@pytest.fixture(scope="module")
def server(servers) -> SGLangServer:
    """The session's grid server (``conftest.py``)."""
    args = [
        "--tangram",
        "--tangram-profile",
        PROFILE_05,
        "--chunked-prefill-size",
        str(GRID),
        "--tangram-min-compress-tokens",
        "0",
        "--enable-metrics",
    ]
    return servers.get(args, "tangram-r0.5-grid", env={"TANGRAM_GRID_SEGMENTS": "1"})


def chat(server: SGLangServer, messages: list[dict], max_tokens: int = 10) -> dict:
    resp = requests.post(
        f"{server.base_url}/v1/chat/completions",
        json={
            "model": "default",
            "temperature": 0,
            "max_tokens": max_tokens,
            "logprobs": True,
            "top_logprobs": 1,
            "messages": messages,
        },
        timeout=900,
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    choice = body["choices"][0]
    return {
        "text": choice["message"]["content"],
        "logprobs": [t["logprob"] for t in choice["logprobs"]["content"]],
        "cached": (body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0),
        "prompt": body["usage"]["prompt_tokens"],
    }


def flush(server: SGLangServer) -> None:
    resp = server.flush_cache()
    assert resp.status_code == 200, resp.text


def radix(server: SGLangServer) -> dict:
    return server.server_info()["internal_states"][0]["tangram_pool"]["radix"]


def test_a_chat_gives_the_same_tokens_and_logprobs_hot_and_cold(server):
    flush(server)
    assert radix(server)["segment_grid"] == GRID
    messages, hot = [], []
    for i, question in enumerate(QUESTIONS):
        content = f"{DOCUMENT}\n\n{question}" if i == 0 else question
        messages.append({"role": "user", "content": content})
        hot.append((list(messages), chat(server, messages)))
        messages.append({"role": "assistant", "content": hot[-1][1]["text"]})
    reused = [h["cached"] for _, h in hot[1:]]
    assert all(c >= GRID for c in reused), reused  # whole cells (and the tail in its cell)
    for turn, (history, h) in enumerate(hot, start=1):
        flush(server)
        cold = chat(server, history)
        assert cold["cached"] == 0
        assert cold["text"] == h["text"], f"turn {turn}: hot {h['text']!r}, cold {cold['text']!r}"
        assert cold["logprobs"] == pytest.approx(h["logprobs"], abs=1e-5), f"turn {turn}"


def test_a_shared_document_is_prefilled_and_held_once(server, smollm2_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    convs = [[{"role": "user", "content": f"{DOCUMENT}\n\n{q}"}] for q in QUESTIONS[:2]]
    ids = [tokenizer.apply_chat_template(c, add_generation_prompt=True)["input_ids"] for c in convs]
    common = next(i for i, (a, b) in enumerate(zip(*ids, strict=False)) if a != b)
    flush(server)
    first = chat(server, convs[0])
    after_one = radix(server)
    second = chat(server, convs[1])
    after_two = radix(server)
    assert first["prompt"] == len(ids[0]) and first["cached"] == 0
    # Every whole cell of the shared part comes from the tree; in the cell the questions differ
    # in, the first chat's tail (kept whole) is shared to the token when the second prompt ends
    # inside that cell, else that cell is prefilled again from its start.
    start = common // GRID * GRID
    expected = common if len(ids[1]) < start + GRID else start
    assert second["cached"] == expected > 0, (common, second)
    assert after_one["grid_cells"] == len(ids[0]) // GRID
    new_cells = len(ids[1]) // GRID - common // GRID
    assert after_two["grid_cells"] == after_one["grid_cells"] + new_cells, after_two
    pool = server.server_info()["internal_states"][0]["tangram_pool"]
    assert pool["pages_used"] == after_two["pages_held"]  # idle: the pool holds the tree only


def test_concurrent_clients_on_one_document_prefill_it_once(server, smollm2_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    convs = [[{"role": "user", "content": f"{DOCUMENT}\n\n{q}"}] for q in QUESTIONS]
    ids = [tokenizer.apply_chat_template(c, add_generation_prompt=True)["input_ids"] for c in convs]
    common = min(
        next(i for i, (a, b) in enumerate(zip(ids[0], other, strict=False)) if a != b)
        for other in ids[1:]
    )
    cells = common // GRID
    assert cells >= 2
    flush(server)
    inserts = radix(server)["in_flight_inserts"]
    with ThreadPoolExecutor(len(convs)) as pool:
        replies = list(pool.map(lambda c: chat(server, c), convs))
    cached = sorted(r["cached"] for r in replies)
    # One client prefills the document; every other matches its cells (inserted while the
    # first was still prefilling, since the others were scheduled before it finished).
    assert cached[0] == 0 and cached[1:] == [cells * GRID] * (len(convs) - 1), cached
    stats = radix(server)
    assert stats["in_flight_inserts"] > inserts
    extra = sum(len(i) // GRID - cells for i in ids)
    assert stats["grid_cells"] == cells + extra, stats  # the document's cells are held once
    pool = server.server_info()["internal_states"][0]["tangram_pool"]
    assert pool["pages_used"] == stats["pages_held"]
    metrics = requests.get(f"{server.base_url}/metrics", timeout=60).text
    held = [ln for ln in metrics.splitlines() if ln.startswith("tangram:radix_pages_held")]
    assert held and float(held[0].rsplit(" ", 1)[1]) > 0, held  # as of the last batch
