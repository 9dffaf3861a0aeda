"""Admission of the real ``--tangram`` server on CPU: every request is answered or queued.

One server (the embedded SmolLM2, the shipped 0.25 profile, ``--max-total-tokens 1024``: a
481-page pool, about 330 decode tokens for one request) takes every bad request of
``docs/admission.md``; after each one a normal chat must still be answered in its usual time:

* a chat without ``max_tokens`` is served (T lowered to what the pool holds), also
  ``bench.multiturn --no-max-tokens``'s ``/generate`` requests (``min_new_tokens`` lowered with T);
* ``max_tokens`` the pool can never hold: HTTP 400 at once (OpenAI error object naming
  ``max_tokens`` and the pool size), also for ``/generate`` with ``max_new_tokens`` 6000 and a
  4-token request sent right behind it (served);
* a turn-2 request whose cached history + ``max_tokens`` passes the whole-pool check from an
  empty table but not with its own prefix pages and copy-on-write pages: HTTP 400 naming the
  cached tokens;
* two requests that each fit the pool but not together (long prompts): the second waits in
  the queue and is served;
* ids outside the vocabulary, ``top_logprobs_num`` above it, a regex / JSON-schema request on
  CPU (xgrammar): HTTP 400 (each crashes stock SGLang 0.5.17's scheduler);
* at the end every page is back (``pages_free == pages_free_at_start``).

Start-up refusals (``--tp-size 2``, which does not divide SmolLM2's 3 KV heads;
``--kv-cache-dtype fp8_e5m2``; a truncated profile) stop the server with one line and no
traceback.
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import requests

from tangram_sglang.errors import TangramError
from tangram_sglang.mem.reservation import group_pages_needed
from tangram_sglang.profile import BudgetProfile
from tangram_sglang.serving import SGLangServer

pytestmark = pytest.mark.e2e

PROFILE = "calibration/smollm2/ada-snapkv-r0.25.json"
MAX_TOTAL_TOKENS = 1024
CHUNK = 256  # --chunked-prefill-size: every prompt here is one segment
PAGE = 16
QUICK_S = 60.0  # a refusal or a normal chat on this 2-core box, with margin


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    args = [
        "--tangram",
        "--tangram-profile",
        PROFILE,
        "--max-total-tokens",
        str(MAX_TOTAL_TOKENS),
        "--chunked-prefill-size",
        str(CHUNK),
    ]
    log = tmp_path_factory.mktemp("admission") / "server.log"
    with SGLangServer(smollm2_path, args=args, log_path=log, startup_timeout_s=900) as srv:
        yield srv


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


def chat(server, messages, timeout=600, **fields) -> requests.Response:
    body = {"model": "default", "temperature": 0, "messages": messages, **fields}
    return requests.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=timeout)


def generate(server, input_ids, timeout=600, **params) -> requests.Response:
    body = {"input_ids": input_ids, "sampling_params": {"temperature": 0, **params}}
    return requests.post(f"{server.base_url}/generate", json=body, timeout=timeout)


def assert_serves_a_normal_chat(server) -> None:
    """The server still answers a short chat in its usual time, and reports healthy."""
    start = time.monotonic()
    resp = chat(
        server,
        [{"role": "user", "content": "What is the capital of France?"}],
        timeout=QUICK_S,
        max_tokens=16,
    )
    assert resp.status_code == 200, resp.text
    assert "Paris" in resp.json()["choices"][0]["message"]["content"]
    assert time.monotonic() - start < QUICK_S
    assert requests.get(f"{server.base_url}/health", timeout=QUICK_S).status_code == 200


def server_profile(server) -> BudgetProfile:
    """The shipped profile as the server applies it (its ``--tangram-min-compress-tokens``)."""
    short = server.server_info().get("tangram_min_compress_tokens") or 0
    return BudgetProfile.load(PROFILE).with_min_compress_tokens(int(short))


def pool(server) -> dict:
    return server.server_info()["internal_states"][0]["tangram_pool"]


def timed(fn, *args, **kwargs) -> tuple[requests.Response, float]:
    start = time.monotonic()
    resp = fn(*args, **kwargs)
    return resp, time.monotonic() - start


def test_chat_without_max_tokens_is_served(server):
    resp, seconds = timed(chat, server, [{"role": "user", "content": "What is 2 + 2?"}])
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert seconds < 300
    assert_serves_a_normal_chat(server)


def test_a_chat_without_max_tokens_runs_to_its_cap_and_is_answered(server):
    """No max_tokens and no EOS: T is lowered to what the pool holds, and the request runs to
    exactly that many tokens (its last decode step included) and is answered."""
    server.flush_cache().raise_for_status()
    log_start = len(server.log_path.read_text())
    resp = chat(server, [{"role": "user", "content": "Count to ten."}], ignore_eos=True)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["choices"][0]["finish_reason"] == "length", body
    capped = re.search(r"capped to (\d+) so that it fits", server.log_path.read_text()[log_start:])
    assert capped is not None
    assert body["usage"]["completion_tokens"] == int(capped.group(1))
    assert_serves_a_normal_chat(server)


def test_bench_no_max_tokens_requests_end_at_their_length_or_the_cap(server, smollm2_path):
    """``bench.multiturn --no-max-tokens``: ``max_new_tokens`` null reaches the server unset; a
    request ends at exactly its drawn length (min_new_tokens, then the biased stop id) below
    the cap Tangram gives it (what the pool holds), and one drawn longer ends at the cap: its
    min_new_tokens is lowered with it (not a 400, and not an output held past the cap)."""
    from tangram_sglang.bench.multiturn_client import model_eos_ids, sampling_params

    server.flush_cache().raise_for_status()
    ids = list(range(1000, 1040))
    for length in (1, 150, 5000):
        log_start = len(server.log_path.read_text())
        params = sampling_params(64, 49152, True, length, model_eos_ids(smollm2_path))
        body = {"input_ids": ids, "sampling_params": params}
        resp = requests.post(f"{server.base_url}/generate", json=body, timeout=600)
        assert resp.status_code == 200, resp.text
        meta = resp.json()["meta_info"]
        # unset: T = SGLang's pool bound, lowered to what fits on arrival, and again at
        # admission when the cached prefix's pages are counted (the last cap holds)
        deadline = time.monotonic() + QUICK_S  # the scheduler's log line may trail the answer
        while not (
            caps := re.findall(r"capped to (\d+) so", server.log_path.read_text()[log_start:])
        ):
            assert time.monotonic() < deadline, "no 'capped to' line for a request without T"
            time.sleep(0.5)
        cap = int(caps[-1])
        if length < cap:
            assert meta["finish_reason"]["type"] == "stop", meta
            assert meta["completion_tokens"] == length, meta
        else:
            assert meta["finish_reason"]["type"] == "length", meta
            assert meta["completion_tokens"] == cap, meta
    assert_serves_a_normal_chat(server)


def test_max_tokens_the_pool_never_holds_gets_an_openai_400_at_once(server):
    total = pool(server)["pages_total"]
    resp, seconds = timed(
        chat, server, [{"role": "user", "content": "Tell me a story."}], max_tokens=900
    )
    assert resp.status_code == 400, resp.text
    error = resp.json()
    assert error["object"] == "error" and error["code"] == 400, error
    assert (
        "max_tokens 900" in error["message"]
        and f"whole pool holds {total} pages" in (error["message"])
    )
    assert "at most max_tokens" in error["message"]
    assert seconds < QUICK_S
    assert_serves_a_normal_chat(server)


def test_generate_6000_tokens_is_refused_and_the_request_behind_it_served(server):
    with ThreadPoolExecutor(2) as pool_:
        big = pool_.submit(timed, generate, server, [1, 2, 3, 4], max_new_tokens=6000)
        time.sleep(0.2)
        small = pool_.submit(generate, server, [5, 6, 7, 8], max_new_tokens=4)
        (resp, seconds), after = big.result(), small.result()
    assert resp.status_code == 400, resp.text
    assert "max_tokens 6000, capped to" in resp.json()["error"]["message"]
    assert seconds < QUICK_S
    assert after.status_code == 200 and len(after.json()["output_ids"]) == 4
    assert_serves_a_normal_chat(server)


def scratch_fit_max_tokens(profile: BudgetProfile, prompt_len: int, pool_pages: int) -> int:
    """Largest max_tokens whose pages from an EMPTY table (one segment + T-token tail) fit.

    The tail counts T tokens: under overlap scheduling (SGLang's default) a finished request
    runs one more decode step, which writes its last sampled token too."""
    kept = np.asarray(profile.group_kept_lens(prompt_len), np.int64)
    zeros = np.zeros_like(kept)
    best = 0
    for t in range(1, pool_pages * PAGE):
        if group_pages_needed(zeros, zeros.astype(bool), kept + t, PAGE).sum() > pool_pages:
            break
        best = t
    return best


def test_turn_two_whose_cached_history_never_fits_gets_a_400(server, tokenizer):
    """Turn 1 (73 tokens, 16 out) is cached; turn 2 asks for the most max_tokens an empty table
    would hold: its own prefix path + copy-on-write pages make it never fit."""
    server.flush_cache().raise_for_status()
    turn1 = [int(i) for i in np.random.default_rng(0).integers(1000, 9000, 73)]
    first = generate(server, turn1, max_new_tokens=16, ignore_eos=True)
    assert first.status_code == 200, first.text
    turn2 = turn1 + first.json()["output_ids"] + [1000 + i for i in range(11)]
    total = pool(server)["pages_total"]
    asked = scratch_fit_max_tokens(server_profile(server), len(turn2), total)
    resp, seconds = timed(generate, server, turn2, max_new_tokens=asked)
    assert resp.status_code == 400, resp.text
    message = resp.json()["error"]["message"]
    assert f"max_tokens {asked}" in message and "cached" in message, message
    assert seconds < QUICK_S
    assert_serves_a_normal_chat(server)


def upper_bound_pages(profile: BudgetProfile, prompt_len: int, tail: int) -> int:
    """Pages admission counts for a new prompt: first chunk compressed, the rest not, + tail."""
    first = min(prompt_len, CHUNK)
    add = np.asarray(profile.group_kept_lens(first), np.int64) + (prompt_len - first) + tail
    zeros = np.zeros_like(add)
    return int(group_pages_needed(zeros, zeros.astype(bool), add, PAGE).sum())


def test_two_requests_that_fit_only_one_at_a_time_are_both_served(server):
    """Each prompt needs most of the pool (its later chunks counted uncompressed until they are
    compressed): the second waits in the queue and is served after the first."""
    server.flush_cache().raise_for_status()
    total = pool(server)["pages_total"]
    prompt_len, new_tokens = 440, 4
    need = upper_bound_pages(server_profile(server), prompt_len, new_tokens)
    assert need <= total < 2 * need

    def one(i: int) -> requests.Response:
        ids = [2000 + (7919 * (i * prompt_len + k)) % 40000 for k in range(prompt_len)]
        return generate(server, ids, max_new_tokens=new_tokens, ignore_eos=True)

    log_start = len(server.log_path.read_text())
    with ThreadPoolExecutor(2) as executor:
        responses = list(executor.map(one, range(2)))
    assert [r.status_code for r in responses] == [200, 200], [r.text for r in responses]
    assert all(len(r.json()["output_ids"]) == new_tokens for r in responses)
    assert "#queue-req: 1" in server.log_path.read_text()[log_start:]  # the second one waited
    assert_serves_a_normal_chat(server)


@pytest.mark.parametrize("bad", [-1, 49152, 10**9], ids=["minus1", "vocab", "1e9"])
def test_token_ids_outside_the_vocabulary_get_a_400(server, bad):
    resp = generate(server, [1, 2, bad, 4], timeout=QUICK_S, max_new_tokens=4)
    assert resp.status_code == 400, resp.text
    assert "[0, 49152)" in resp.json()["error"]["message"]
    assert_serves_a_normal_chat(server)


def test_an_empty_batch_prompt_gets_a_400(server):
    body = {"input_ids": [[]], "sampling_params": {"max_new_tokens": 2}}
    resp = requests.post(f"{server.base_url}/generate", json=body, timeout=QUICK_S)
    assert resp.status_code == 400, resp.text
    assert "prompt is empty" in resp.text
    assert_serves_a_normal_chat(server)


def test_stop_token_ids_outside_the_vocabulary_get_a_400(server):
    params = {"max_new_tokens": 4, "min_new_tokens": 2, "stop_token_ids": [10**9]}
    body = {"input_ids": [1, 2, 3], "sampling_params": params}
    resp = requests.post(f"{server.base_url}/generate", json=body, timeout=QUICK_S)
    assert resp.status_code == 400, resp.text
    assert "stop_token_ids[0] = 1000000000" in resp.json()["error"]["message"]
    assert_serves_a_normal_chat(server)


def test_top_logprobs_above_the_vocabulary_get_a_400(server):
    body = {
        "input_ids": [1, 2, 3],
        "return_logprob": True,
        "top_logprobs_num": 10**6,
        "sampling_params": {"max_new_tokens": 2},
    }
    resp = requests.post(f"{server.base_url}/generate", json=body, timeout=QUICK_S)
    assert resp.status_code == 400, resp.text
    assert "top_logprobs 1000000" in resp.json()["error"]["message"]
    resp = chat(
        server,
        [{"role": "user", "content": "Hi"}],
        timeout=QUICK_S,
        max_tokens=2,
        logprobs=True,
        top_logprobs=10**6,
    )
    assert resp.status_code == 400, resp.text
    assert_serves_a_normal_chat(server)


def test_grammar_constrained_requests_on_cpu_get_a_400(server):
    resp = generate(server, [1, 2, 3], timeout=QUICK_S, max_new_tokens=4, regex="[0-9]+")
    assert resp.status_code == 400, resp.text
    assert "needs a GPU" in resp.json()["error"]["message"]
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    resp = chat(
        server,
        [{"role": "user", "content": "Capital of France as JSON"}],
        timeout=QUICK_S,
        max_tokens=8,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
    )
    assert resp.status_code == 400, resp.text
    assert resp.json()["object"] == "error" and "needs a GPU" in resp.json()["message"]
    assert_serves_a_normal_chat(server)


def test_every_page_returns_after_the_bad_requests(server):
    server.flush_cache().raise_for_status()
    state = pool(server)
    assert state["active_rows"] == 0 and state["pages_used"] == 0
    assert state["pages_free"] == state["pages_free_at_start"]


def start_fails(smollm2_path, args, log_path) -> str:
    server = SGLangServer(smollm2_path, args=args, log_path=log_path, startup_timeout_s=300)
    with pytest.raises(TangramError, match="exited with code 1"):
        server.start()
    server.stop()
    return server.log_path.read_text()


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (["--tp-size", "2"], "ConfigError: --tp-size 2 cannot be combined with --tangram"),
        (
            ["--kv-cache-dtype", "fp8_e5m2"],
            "ConfigError: --kv-cache-dtype 'fp8_e5m2' cannot be combined with --tangram",
        ),
        ([], "ProfileError: "),
    ],
    ids=["tp2", "fp8", "truncated-profile"],
)
def test_start_up_refusals_print_one_line(smollm2_path, tmp_path, flags, line):
    profile = PROFILE
    if not flags:  # a truncated copy of the shipped profile
        text = Path(PROFILE).read_text()
        (tmp_path / "cut.json").write_text(text[: len(text) // 2])
        profile = str(tmp_path / "cut.json")
    log = start_fails(
        smollm2_path,
        ["--tangram", "--tangram-profile", profile, *flags],
        tmp_path / "server.log",
    )
    assert line in log, log[-2000:]
    assert "Traceback" not in log, log[-4000:]
    assert log.lower().count("drop --kv-cache-dtype") <= 1
