"""Radix reuse of compressed history on the real ``--tangram`` server (CPU, SmolLM2, 0.5 profile).

One server (a small pool: ``--max-total-tokens 2048``; ``--tangram-min-compress-tokens 0``, so
the short prompts here are compressed segments):

* turn 2 of a chat reports ``cached_tokens`` = turn 1's prompt + its decode-tail tokens (T with
  overlap scheduling, T - 1 without: ``SGLangServer.kv_tail_tokens``)
  (the whole compressed history, matched as whole segments, never recomputed);
* a fork (two different turn 2s after one turn 1) shares turn 1's pages: the tree and the pool
  grow by the fork's own pages only (a short turn-2 prompt kept whole is matched to the token by
  a request that repeats it); replaying turn 2a after the fork gives the same tokens
  (the shared pages were read, never written: copy-on-write tails);
* an aborted request (``/abort_request``) and a streaming client that disconnects mid-way end
  with every page accounted for: after ``/flush_cache`` free pages equal the start value;
* 8 conversations x 4 turns at once all complete, later turns reuse history, no decode step
  ever lacked a page (Budget Reservation: admitted requests finish without retraction); a long
  prompt then makes the tree evict (pages freed exactly once: the pool returns to its start
  value after a flush).

The ratio-1.0 oracle (reused turns token-identical to stock SGLang) is in
``test_tangram_serving.py``.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tangram_sglang.serving import SGLangServer

pytestmark = pytest.mark.e2e

PROFILE_05 = "calibration/smollm2/ada-snapkv-r0.5.json"
MAX_TOTAL_TOKENS = 2048  # logical token slots: 8 short chats fit, one long prompt then evicts
FACT = "My name is Ada and I live in Lyon, near the river, with two cats and a piano. " * 3


@pytest.fixture(scope="module")
def server(servers) -> SGLangServer:
    """The session's server of this configuration (``conftest.py``); module fixtures use it."""
    args = [
        "--tangram",
        "--tangram-profile",
        PROFILE_05,
        "--max-total-tokens",
        str(MAX_TOTAL_TOKENS),
        "--tangram-min-compress-tokens",
        "0",
    ]
    return servers.get(args, "tangram-r0.5-radix")


def chat(server: SGLangServer, messages: list[dict], max_tokens: int = 12) -> tuple[str, dict]:
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
    body = resp.json()
    return body["choices"][0]["message"]["content"], body["usage"]


def cached_tokens(usage: dict) -> int:
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def pool(server: SGLangServer) -> dict:
    return server.server_info()["internal_states"][0]["tangram_pool"]


def flush(server: SGLangServer) -> None:
    resp = server.flush_cache()
    assert resp.status_code == 200, resp.text


def wait_idle(server: SGLangServer, timeout_s: float = 300.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = pool(server)
        if state["active_rows"] == 0:
            return state
        time.sleep(0.5)
    raise AssertionError(f"server still has active rows after {timeout_s} s: {state}")


def assert_pages_return(server: SGLangServer) -> None:
    wait_idle(server)
    assert pool(server)["radix"]["tokens_protected"] == 0  # no node left locked
    flush(server)
    state = pool(server)
    assert state["radix"]["pages_held"] == 0 and state["pages_used"] == 0
    assert state["pages_free"] == state["pages_free_at_start"]


@pytest.fixture(scope="module")
def turn1(server):
    """Turn 1 from an empty tree: (messages incl. the reply, usage, tree pages it left)."""
    flush(server)
    messages = [{"role": "user", "content": FACT + "What is the capital of France?"}]
    reply, usage = chat(server, messages)
    held = pool(server)["radix"]["pages_held"]
    return [*messages, {"role": "assistant", "content": reply}], usage, held


def test_turn2_reports_cached_tokens_covering_turn1(server, turn1):
    messages, usage1, held1 = turn1
    assert held1 > 0
    _, usage2 = chat(server, [*messages, {"role": "user", "content": "What is my name?"}])
    # turn 1's prompt segment + its decode tail
    tail = server.kv_tail_tokens(usage1["completion_tokens"])
    assert cached_tokens(usage2) == usage1["prompt_tokens"] + tail
    assert usage2["prompt_tokens"] > cached_tokens(usage2)


def test_fork_shares_turn1_pages_and_leaves_them_intact(server, turn1):
    messages, usage1, _ = turn1
    ask_a = [*messages, {"role": "user", "content": "What is my name?"}]
    ask_b = [*messages, {"role": "user", "content": "Do I have a dog or cats?"}]
    reply_a, usage_a = chat(server, ask_a)
    before = pool(server)
    reply_b, usage_b = chat(server, ask_b)
    after = pool(server)
    history = usage1["prompt_tokens"] + server.kv_tail_tokens(usage1["completion_tokens"])
    # Both reuse turn 1 whole. Turn 2a's short prompt segment is kept whole, so a request that
    # repeats it matches it to the token, as stock SGLang does (the segment is split there).
    assert cached_tokens(usage_a) >= history and cached_tokens(usage_b) >= history
    record = after["last_release"]
    own = record["pages"]  # pages fork b's row owned (its segments only)
    assert 0 < own < turn1[2]
    # fork b read turn 1's pages from the tree; its record compares all of them with full KV
    assert record["borrowed_pages"] > 0
    whole = (own + record["borrowed_pages"]) * after["bytes_per_page"]
    assert record["held_fraction"] == pytest.approx(whole / record["full_kv_bytes"])
    assert after["radix"]["pages_held"] - before["radix"]["pages_held"] == own
    assert after["pages_used"] - before["pages_used"] == own
    replay_a, usage_replay = chat(server, ask_a)  # same compressed state as the first 2a
    # 2a's own short prompt segment is in the tree now, kept whole (its ~15 new tokens fit in
    # the profile's sink + window): the repeat matches all but the last prompt token (SGLang
    # leaves one to compute), whether or not an earlier test sent 2a
    assert replay_a == reply_a
    assert cached_tokens(usage_replay) == usage_replay["prompt_tokens"] - 1
    assert reply_b != reply_a


def test_abort_and_client_disconnect_leave_no_pages_behind(server, turn1):
    payload = {
        "text": FACT + "Tell me a long story about Lyon.",
        "sampling_params": {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True},
    }
    url = f"{server.base_url}/generate"
    with requests.post(url, json={**payload, "stream": True}, stream=True, timeout=900) as resp:
        for i, _ in enumerate(resp.iter_lines()):
            if i >= 3:
                break  # the client goes away mid-generation
    rid = "radix-e2e-abort"
    result: dict = {}

    def send() -> None:
        result["resp"] = requests.post(url, json={**payload, "rid": rid}, timeout=900)

    worker = threading.Thread(target=send)
    worker.start()
    deadline = time.monotonic() + 120
    while pool(server)["active_rows"] == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    abort = requests.post(f"{server.base_url}/abort_request", json={"rid": rid}, timeout=60)
    assert abort.status_code == 200, abort.text
    worker.join(timeout=600)
    body = result["resp"].json()
    assert len(body.get("output_ids", [])) < 400 or "abort" in str(body).lower()
    assert_pages_return(server)


def test_eight_conversations_four_turns_at_once_evict_and_return_pages(server):
    flush(server)

    def conversation(i: int) -> list[int]:
        messages, cached = [], []
        for turn in range(4):
            text = f"Conversation {i}, turn {turn}: what is {i} plus {turn}? Answer briefly."
            messages.append({"role": "user", "content": text})
            reply, usage = chat(server, messages, max_tokens=8)
            messages.append({"role": "assistant", "content": reply})
            cached.append(cached_tokens(usage))
        return cached

    with ThreadPoolExecutor(8) as executor:
        cached = list(executor.map(conversation, range(8)))
    assert len(cached) == 8 and all(len(c) == 4 for c in cached)
    assert sum(c[t] > 0 for c in cached for t in (1, 2, 3)) >= 12  # most later turns reuse
    wait_idle(server)  # retractions, if the pool ran dry, re-ran requests: all answered
    chat(server, [{"role": "user", "content": FACT * 20 + "Summarise."}], max_tokens=2)
    assert pool(server)["radix"]["pages_evicted"] > 0  # the long prompt made the tree evict
    assert_pages_return(server)
