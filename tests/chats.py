"""Greedy chats against a real server, shared by the e2e tests that compare two servers' tokens.

``tests/`` is on ``sys.path`` through ``tests/conftest.py``.
"""

from __future__ import annotations

import requests

from tangram_sglang.serving import SGLangServer


def chat(server: SGLangServer, messages: list[dict], max_tokens: int) -> str:
    """One greedy ``/v1/chat/completions`` turn of exactly ``max_tokens`` tokens (EOS ignored);
    its text."""
    resp = requests.post(
        f"{server.base_url}/v1/chat/completions",
        json={
            "model": "default",
            "temperature": 0,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "messages": messages,
        },
        timeout=900,
    )
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["message"]["content"]


def conversation(
    server: SGLangServer, opening: str, follow_ups: tuple[str, ...], max_tokens: int
) -> list[str]:
    """``opening`` then each follow-up as user turns; each answer is part of the next prompt
    (the server reuses the history through its radix tree). The answers, in order."""
    messages = [{"role": "user", "content": opening}]
    answers = []
    for follow_up in (None, *follow_ups):
        if follow_up is not None:
            messages.append({"role": "user", "content": follow_up})
        answers.append(chat(server, messages, max_tokens))
        messages.append({"role": "assistant", "content": answers[-1]})
    return answers
