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

NOTES = (  # filler after the fact: pushes it out of the recent window of turn 1's chunks
    "Here are my travel notes. Paris is the capital of France and sits on the Seine; its museums "
    "include the Louvre and the Musee d'Orsay. Lyon, the third largest French city, is known for "
    "its food and lies where the Rhone meets the Saone. Marseille is an old port on the "
    "Mediterranean. Rome is the capital of Italy; the Colosseum and the Forum stand in its "
    "centre, and the Vatican lies within the city. Milan is the business capital of northern "
    "Italy, with its cathedral and its fashion houses. Naples, further south, faces Mount "
    "Vesuvius and is said to be the home of pizza. Madrid is the capital of Spain, high on the "
    "central plateau, with the Prado museum. Barcelona, on the coast of Catalonia, is famous for "
    "the buildings of Gaudi. Lisbon is the capital of Portugal, built on hills above the Tagus "
    "river, with yellow trams and tiled facades. Berlin is the capital of Germany and Vienna the "
    "capital of Austria, on the Danube. "
)
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
        resp = requests.post(f"{base_url}/v1/chat/completions", json={
            "model": "default", "temperature": 0, "max_tokens": MAX_TOKENS, "messages": messages,
        }, timeout=900)  # fmt: skip
        assert resp.status_code == 200, resp.text
        body = resp.json()
        reply, usage = body["choices"][0]["message"]["content"], body["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        out.append(Turn(reply, usage["prompt_tokens"], usage["completion_tokens"], cached))
        on_turn(out[-1])
        messages.append({"role": "assistant", "content": reply})
    return out
