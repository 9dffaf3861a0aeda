"""A 3-turn chat whose turn 3 asks for a fact given only in turn 1 (the recall probe).

Shared by the e2e tests of stock SGLang (full KV recalls) and of the ``--tangram`` 0.5 server
(the compressed history recalls). ``tests/`` is on ``sys.path`` through ``tests/conftest.py``.

The layout was chosen on the real SmolLM2-135M-Instruct (greedy, fp32, chat template, 24 new
tokens per turn): the fact opens a 256-token turn 1 (so it lies in the compressed middle of the
first 128-token prefill chunk, outside the 4 sink and 32 recent-window tokens), turn 2 is
unrelated, turn 3 asks for it. Full KV (transformers and stock SGLang) and the shipped 0.5
profile answer "Your dog is called Max." (measured 2026-11-30); the 0.25 profile does not (it
answers coherently, "Your dog is a pet..."). Short one-line facts ("My cat is called Luna.
Please remember it.") are not recalled by this model even with full KV, so they are no probe.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import requests

from tangram_sglang.demo import NOTES

# The demo's travel notes, after the fact: they push it out of the recent window of turn 1's
# chunks.
FACT_TURNS = (
    "My dog is called Max. " + NOTES + "What is the capital of France?",
    "What is the capital of Italy?",
    "What is my dog called?",
)
KEYWORD = "Max"  # in the turn-3 reply when the fact was recalled
MAX_TOKENS = 24  # new tokens per turn


@dataclass(frozen=True, slots=True)
class Turn:
    """One turn as the OpenAI chat API answered it (token counts from ``usage``)."""

    reply: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from the radix cache


def recall_chat(
    base_url: str, turns: tuple[str, ...] = FACT_TURNS, on_turn: Callable[[Turn], None] = print
) -> list[Turn]:
    """Greedy chat through ``/v1/chat/completions``; each turn sends the whole history.

    ``on_turn`` sees each turn as soon as it is answered (e.g. to read the pool after it).
    """
    messages, out = [], []
    for user in turns:
        messages.append({"role": "user", "content": user})
        resp = requests.post(
            f"{base_url}/v1/chat/completions",
            json={
                "model": "default",
                "temperature": 0,
                "max_tokens": MAX_TOKENS,
                "messages": messages,
            },
            timeout=900,
        )
        assert resp.status_code == 200, resp.text
        body = resp.json()
        reply, usage = body["choices"][0]["message"]["content"], body["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        out.append(Turn(reply, usage["prompt_tokens"], usage["completion_tokens"], cached))
        on_turn(out[-1])
        messages.append({"role": "assistant", "content": reply})
    return out
