"""Overlap scheduling under ``--tangram`` (CPU, SmolLM2, real servers): same tokens as without.

SGLang's overlap scheduler plans batch i+1 before it has processed batch i's results, so a
request finished in batch i still decodes one more token in batch i+1 while the scheduler
releases its row and pages; the backend then plans from host copies only and releases rows on
the host (the next owner's upload overwrites the device row in stream order).

* Identity: greedy outputs of several concurrent multi-turn chats (turns 2+ reuse the compressed
  history through the radix tree) are token-identical with and without overlap
  (``--disable-overlap-schedule``), at ratio 1.0 and with the shipped 0.25 profile, while other
  conversations are aborted mid-generation (client disconnects) next to them.
* Row reuse: many short requests (1-3 new tokens) take and release request rows while long
  requests decode next to them; every output equals the same request run alone, and once idle
  and flushed the pool has all its pages back.

Servers come from the session's pool (``tests/e2e/conftest.py``): one per (ratio, overlap) pair.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import chats
import pytest
import requests
from chats import chat
from factories import ratio_one_profile

from tangram_sglang.serving import SGLangServer

pytestmark = pytest.mark.e2e

PROFILE_025 = "calibration/smollm2/ada-snapkv-r0.25.json"
# One segment per prompt, whatever the batch: chunk boundaries set by the scheduler's token
# budget would depend on which requests share a batch, and so would the compressed segments.
CHUNK_TOKENS = 4096
# Follow-up turns stay below 36 tokens, which the 0.25 profile keeps whole: with overlap a
# finished turn's decode tail holds one more token (the extra step), so the next turn's new
# segment starts one token later than without; a segment kept whole makes that harmless.
TOPICS = ("rivers of Europe", "the history of tea", "how bridges stand", "birds that migrate")
FOLLOW_UPS = ("Tell me one more detail.", "Summarise that in one sentence.")
SHARED_FACT = "My name is Ada and I live in Lyon, near the river, with two cats and a piano. " * 4


@pytest.fixture(scope="module")
def profiles(tmp_path_factory, smollm2_path) -> dict[str, str]:
    one = ratio_one_profile(tmp_path_factory.mktemp("overlap") / "ratio1.json", smollm2_path)
    return {"1.0": one, "0.25": PROFILE_025}


@pytest.fixture
def overlap_servers(servers, profiles):
    """``get(ratio, overlap)``: the session's server for that pair (``conftest.ServerPool``)."""

    def get(ratio: str, overlap: bool) -> SGLangServer:
        args = [
            "--tangram",
            "--tangram-profile",
            profiles[ratio],
            "--chunked-prefill-size",
            str(CHUNK_TOKENS),
        ]
        if not overlap:
            args.append("--disable-overlap-schedule")
        srv = servers.get(args, f"overlap-{ratio}-{'on' if overlap else 'off'}")
        assert overlap_enabled(srv) == overlap, "the server's overlap setting"
        return srv

    return get


def overlap_enabled(server: SGLangServer) -> bool:
    return not server.server_info()["disable_overlap_schedule"]


def abandoned_stream(server: SGLangServer, messages: list[dict], chunks: int = 3) -> None:
    """A streaming chat the client drops after ``chunks`` chunks (SGLang aborts it)."""
    with requests.post(
        f"{server.base_url}/v1/chat/completions",
        json={
            "model": "default",
            "temperature": 0,
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
            "messages": messages,
        },
        stream=True,
        timeout=900,
    ) as resp:
        assert resp.status_code == 200, resp.text
        for i, _ in enumerate(resp.iter_lines()):
            if i >= chunks:
                break


def conversation(server: SGLangServer, topic: str, max_tokens: int) -> list[str]:
    """Three turns; each turn's answer is part of the next prompt (radix reuse)."""
    return chats.conversation(
        server, f"{SHARED_FACT} Tell me about {topic}.", FOLLOW_UPS, max_tokens
    )


def victim(server: SGLangServer, index: int, stop: threading.Event) -> int:
    """Turns that are aborted mid-generation, until ``stop``; returns how many."""
    messages = [{"role": "user", "content": f"{SHARED_FACT} Write a long story number {index}."}]
    aborted = 0
    while not stop.is_set():
        abandoned_stream(server, messages, chunks=2 + aborted % 3)
        aborted += 1
        messages += [
            {"role": "assistant", "content": "I will stop here."},
            {"role": "user", "content": "Go on, differently."},
        ]
    return aborted


def chats_with_aborts(server: SGLangServer, max_tokens: int = 10) -> list[list[str]]:
    """Every topic's conversation at once, next to two conversations that keep being aborted."""
    stop = threading.Event()
    with ThreadPoolExecutor(len(TOPICS) + 2) as pool:
        victims = [pool.submit(victim, server, i, stop) for i in range(2)]
        chats = [pool.submit(conversation, server, t, max_tokens) for t in TOPICS]
        answers = [f.result() for f in chats]
        stop.set()
        assert all(v.result() >= 1 for v in victims), "no request was aborted"
    return answers


def wait_idle_and_flush(server: SGLangServer, timeout_s: float = 300.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        state = server.server_info()["internal_states"][0]["tangram_pool"]
        if state["active_rows"] == 0:
            break
        assert time.monotonic() < deadline, f"rows still active after {timeout_s} s: {state}"
        time.sleep(0.5)
    resp = server.flush_cache()
    assert resp.status_code == 200, resp.text
    return server.server_info()["internal_states"][0]["tangram_pool"]


@pytest.mark.parametrize("ratio", ["1.0", "0.25"])
def test_overlap_gives_the_same_tokens_over_multi_turn_chats_with_aborts(overlap_servers, ratio):
    servers = overlap_servers
    with_overlap = chats_with_aborts(servers(ratio, True))
    without = chats_with_aborts(servers(ratio, False))
    for topic, a, b in zip(TOPICS, with_overlap, without, strict=True):
        assert a == b, f"{topic} (ratio {ratio}): overlap {a} != no overlap {b}"
    assert all(all(turn.strip() for turn in answers) for answers in with_overlap)
    for overlap in (True, False):
        pool = wait_idle_and_flush(servers(ratio, overlap))
        assert pool["pages_free"] == pool["pages_free_at_start"], pool


def test_rows_reused_by_short_requests_do_not_disturb_running_decodes(overlap_servers):
    server = overlap_servers("0.25", True)
    longs = [
        [{"role": "user", "content": f"{SHARED_FACT} Explain {t} in detail."}] for t in TOPICS[:2]
    ]
    shorts = [
        [{"role": "user", "content": f"Say a word about {t} ({i})."}]
        for i in range(4)
        for t in TOPICS
    ]
    short_tokens = [1 + i % 3 for i in range(len(shorts))]
    alone_long = [chat(server, m, 32) for m in longs]
    alone_short = [chat(server, m, n) for m, n in zip(shorts, short_tokens, strict=True)]
    wait_idle_and_flush(server)
    with ThreadPoolExecutor(8) as pool:
        running = [pool.submit(chat, server, m, 32) for m in longs]
        time.sleep(0.5)  # the long requests are decoding when the short ones come and go
        churn = [pool.submit(chat, server, m, n) for m, n in zip(shorts, short_tokens, strict=True)]
        together_short = [f.result() for f in churn]
        together_long = [f.result() for f in running]
    assert together_long == alone_long
    assert together_short == alone_short
    pool_state = wait_idle_and_flush(server)
    assert pool_state["pages_free"] == pool_state["pages_free_at_start"], pool_state
    assert pool_state["requests_released"] >= 2 * (len(longs) + len(shorts))
