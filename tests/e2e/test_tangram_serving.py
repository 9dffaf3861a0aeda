"""The real ``python -m sglang.launch_server --tangram`` on CPU: compressed KV, served end to end.

* A profile with every ratio 1.0 keeps every token: greedy tokens of a 3-turn chat equal stock
  SGLang's (docs/design.md §7, the first correctness invariant), and the pool holds no more KV
  bytes than full KV for the chat's tokens plus one partial page per head group.
* A tiny pool (``--max-total-tokens 1024``) and 16 concurrent short requests: SGLang's token
  estimate admits more than the pages hold (short segments keep everything, pages pad), so
  admission and decode answer in pages (``docs/admission.md``); every request completes, pages
  return.
* The shipped 0.5 profile (chunked prefill of 128 tokens and ``--tangram-min-compress-tokens
  0``, so every chunk is a compressed segment) answers, holds exactly the pages Budget
  Reservation predicts, and fewer bytes than full KV; a fact given in turn 1 (in the
  compressed middle of a chunk) is recalled in turn 3 from the reused compressed history, and
  every turn's row (turns 2-3 extend a matched
  compressed prefix) owns exactly the pages the kept-length formula gives; a request larger
  than the whole pool is refused (HTTP 400) while the server stays up; free pages return to
  their start value once every request has ended.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests
from factories import ratio_one_profile
from recall_chat import KEYWORD, recall_chat

from tangram_sglang.backend.state import chunked_footprint_pages
from tangram_sglang.integration.metrics import GAUGES
from tangram_sglang.mem.reservation import group_pages_needed
from tangram_sglang.profile import BudgetProfile
from tangram_sglang.serving import SGLangServer

pytestmark = pytest.mark.e2e

PROFILE_05 = "calibration/smollm2/ada-snapkv-r0.5.json"
CHUNK_TOKENS = 128  # --chunked-prefill-size of the 0.5 server
MAX_TOTAL_TOKENS = 4096  # --max-total-tokens of the 0.5 server (logical token slots)
TURNS = (
    "My name is Ada and I live in Lyon. What is the capital of France?",
    "And what is the capital of Italy?",
    "What is my name, and which city do I live in?",
)


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


def greedy_chat(
    base_url: str,
    tokenizer,
    turns,
    max_new_tokens: int = 24,
    cached: list | None = None,
    metas: list | None = None,
) -> list[list[int]]:
    """Token ids of each greedy reply; each turn sends the whole history (chat template).

    ``cached`` (if given) receives each turn's ``meta_info.cached_tokens`` (radix reuse);
    ``metas`` each turn's whole ``meta_info``.
    """
    messages, outputs = [], []
    for user in turns:
        messages.append({"role": "user", "content": user})
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        resp = generate(base_url, ids, max_new_tokens)
        outputs.append(resp["output_ids"])
        if cached is not None:
            cached.append(resp["meta_info"]["cached_tokens"])
        if metas is not None:
            metas.append(resp["meta_info"])
        reply = tokenizer.decode(resp["output_ids"], skip_special_tokens=True)
        messages.append({"role": "assistant", "content": reply})
    return outputs


def generate(base_url: str, input_ids: list[int], max_new_tokens: int) -> dict:
    params = {"temperature": 0, "max_new_tokens": max_new_tokens}
    resp = requests.post(
        f"{base_url}/generate",
        json={"input_ids": input_ids, "sampling_params": params},
        timeout=600,
    )
    return resp.json()


def pool_state(server: SGLangServer) -> dict:
    return server.server_info()["internal_states"][0]["tangram_pool"]


def test_ratio_one_profile_is_token_identical_to_stock(
    smollm2_path, tokenizer, tmp_path, stock_server, servers
):
    expected = greedy_chat(stock_server.base_url, tokenizer, TURNS)
    profile = ratio_one_profile(tmp_path / "ratio1.json", smollm2_path)
    server = servers.get(["--tangram", "--tangram-profile", profile], "tangram-r1")
    flush_radix(server)  # the session's server may hold earlier chats
    adopted = pool_state(server)["radix"]["pages_copy_adopted"]
    cached, metas = [], []
    got = greedy_chat(server.base_url, tokenizer, TURNS, cached=cached, metas=metas)
    summary, held = server.server_info()["tangram"], pool_state(server)
    flush_radix(server)
    pool = pool_state(server)
    assert got == expected
    assert all(c > 0 for c in cached[1:]), cached  # turns 2, 3 extend the reused history
    assert pool["pages_free"] == pool["pages_free_at_start"]
    # Never more KV than full KV for the same tokens, up to page rounding: the tree holds one
    # chain of the chat's KV tokens (kv_tail_tokens of the last turn); every head keeps each of
    # them once, in G * H_p page columns (padded_kept_ratio = G * H_p / (L * H_kv) at ratio 1),
    # plus at most one partial page per head group. Turn boundaries add nothing: each turn's
    # copy of the partial tail page was adopted by the chain (no duplicate).
    tokens = metas[-1]["prompt_tokens"] + server.kv_tail_tokens(metas[-1]["completion_tokens"])
    full = tokens * held["full_kv_bytes_per_token"]
    rounding = summary["num_head_groups"] * held["bytes_per_page"]
    assert held["bytes_held"] <= full * summary["padded_kept_ratio"] + rounding
    assert held["radix"]["pages_copy_adopted"] > adopted


@pytest.fixture
def server05(servers) -> SGLangServer:
    """The session's 0.5-profile server with 128-token chunks and metrics (``conftest.py``)."""
    args = [
        "--tangram",
        "--tangram-profile",
        PROFILE_05,
        "--chunked-prefill-size",
        str(CHUNK_TOKENS),
        "--max-total-tokens",
        str(MAX_TOTAL_TOKENS),
        "--tangram-min-compress-tokens",
        "0",
        "--enable-metrics",
    ]
    return servers.get(args, "tangram-r0.5-chunk128")


def test_compressed_server_reports_its_pool(server05):
    info = server05.server_info()
    summary = info["tangram"]
    assert summary["scorer"] == "ada-snapkv"
    assert info["attention_backend"] == "tangram"
    # radix reuse of compressed history is on by default, through the tangram cache backend
    assert info["disable_radix_cache"] is False and info["radix_cache_backend"] == "tangram"
    pool = summary["pool_at_start"]
    assert pool["pages_total"] > 0 and pool["pages_used"] == 0
    # The pool takes the bytes SGLang gives the KV cache, sized in Tangram's cell.
    cell = pool["full_kv_bytes_per_token"] * summary["padded_kept_ratio"]
    assert pool["pool_bytes"] == pytest.approx(MAX_TOTAL_TOKENS * cell, rel=0.01)


def test_compressed_server_answers(server05):
    resp = requests.post(
        f"{server05.base_url}/v1/chat/completions",
        json={
            "model": "default",
            "temperature": 0,
            "max_tokens": 24,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
        },
        timeout=600,
    ).json()
    assert "Paris" in resp["choices"][0]["message"]["content"]


def test_fact_from_turn1_is_recalled_in_turn3_with_exact_pages_per_turn(server05):
    """The recall probe (stock SGLang recalls it too: ``test_stock_server.py``) at ratio 0.5.

    Per turn the finished row's own pages follow the formula: the matched prefix's per-group
    kept lengths (the chain of earlier chunks and decode tails), plus ``k_g`` of each 128-token
    chunk of the extend, plus the decode tail (``kv_tail_tokens``), in pages past the shared
    prefix pages (a partial shared last page is copied: copy-on-write). The tree keeps every
    row's pages and the chain adopts each copy (freeing the original), so pages used = the sum
    over turns minus the adopted copies. Each turn enters the tree after its answer was
    streamed (the result step's ``deferred_finishes`` scope, hooked on the real scheduler).
    """
    flush_radix(server05)  # turn 1 starts from an empty tree
    radix_before = pool_state(server05)["radix"]
    adopted_before = radix_before["pages_copy_adopted"]
    profile = BudgetProfile.load(PROFILE_05)
    page = server05.server_info()["tangram"]["page_size"]
    lens_at = {0: np.zeros(profile.grouping.num_head_groups, np.int64)}  # chain depth -> lens
    owned, checked = 0, []

    def check_pages(turn) -> None:
        nonlocal owned
        assert turn.cached_tokens in lens_at, (turn.cached_tokens, sorted(lens_at))
        depth, prefix = turn.cached_tokens, lens_at[turn.cached_tokens]
        lens, left = prefix.copy(), turn.prompt_tokens - depth
        while left > 0:  # each chunk of the extend is a segment
            chunk = min(left, CHUNK_TOKENS)
            lens, depth, left = lens + profile.group_kept_lens(chunk), depth + chunk, left - chunk
            lens_at[depth] = lens
        tail = server05.kv_tail_tokens(turn.completion_tokens)
        lens, depth = lens + tail, depth + tail
        lens_at[depth] = lens
        want = int(group_pages_needed(prefix, prefix > 0, lens - prefix, page).sum())
        pool = pool_state(server05)
        record = pool["last_release"]
        assert record["logical_tokens"] == depth
        assert record["pages"] == want  # exact to the page
        owned += want
        # copies the chain took (their originals were freed)
        adopted = pool["radix"]["pages_copy_adopted"] - adopted_before
        assert pool["pages_used"] == pool["radix"]["pages_held"] == owned - adopted
        checked.append(want)

    turns = recall_chat(server05.base_url, on_turn=check_pages)
    replies = [t.reply for t in turns]
    assert len(checked) == 3
    deferred = pool_state(server05)["radix"]["deferred_finishes"]
    assert deferred - radix_before["deferred_finishes"] == 3
    assert KEYWORD not in turns[0].reply  # the fact is only in turn 1's prompt
    assert turns[0].prompt_tokens > CHUNK_TOKENS  # the fact lies in a full, compressed chunk
    assert turns[1].cached_tokens > 0 and turns[2].cached_tokens > 0  # compressed history reused
    history = turns[1].prompt_tokens + server05.kv_tail_tokens(turns[1].completion_tokens)
    assert turns[2].cached_tokens == history
    assert KEYWORD in turns[2].reply, replies


def test_long_prompt_holds_the_reserved_pages_and_fewer_bytes(server05, tokenizer):
    notes = "Lyon is a city in France on the Rhone. " * 60
    messages = [{"role": "user", "content": notes + "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    resp = generate(server05.base_url, ids, 16)
    assert "Paris" in tokenizer.decode(resp["output_ids"])
    pool = pool_state(server05)
    record = pool["last_release"]
    num_out = len(resp["output_ids"])
    tail = server05.kv_tail_tokens(num_out)  # decoded tokens fed back (K/V written)
    assert record["logical_tokens"] == len(ids) + tail
    profile = BudgetProfile.load(PROFILE_05)
    want = chunked_footprint_pages(profile, 16, len(ids), tail + 1, CHUNK_TOKENS)
    assert record["pages"] == want  # exact to the page
    assert record["bytes_held"] == want * pool["bytes_per_page"]
    full = record["logical_tokens"] * pool["full_kv_bytes_per_token"]
    assert record["full_kv_bytes"] == full
    # 128-token segments keep sink + window (36 tokens) each, so above the long-prompt ratio.
    assert record["held_fraction"] == pytest.approx(want * pool["bytes_per_page"] / full)
    assert record["held_fraction"] < 0.85


def test_request_larger_than_the_pool_is_refused_and_the_server_stays_up(server05):
    resp = requests.post(
        f"{server05.base_url}/generate",
        json={
            "input_ids": [1000 + i % 500 for i in range(MAX_TOTAL_TOKENS - 200)],
            "sampling_params": {"temperature": 0, "max_new_tokens": 8},
        },
        timeout=600,
    )
    assert resp.status_code == 400, resp.text
    assert "but the whole pool holds" in resp.text
    # SGLang caps max_new_tokens to its token pool (to 198 here); the message names the ask.
    resp = requests.post(
        f"{server05.base_url}/generate",
        json={
            "input_ids": [1000 + i % 500 for i in range(MAX_TOTAL_TOKENS - 200)],
            "sampling_params": {"temperature": 0, "max_new_tokens": 4000},
        },
        timeout=600,
    )
    assert resp.status_code == 400, resp.text
    assert "max_tokens 4000, capped to" in resp.text
    ok = generate(server05.base_url, [1, 2, 3, 4], 4)
    assert len(ok["output_ids"]) == 4


def flush_radix(server: SGLangServer) -> None:
    """``/flush_cache``: the radix tree frees the pages of finished turns (idle server)."""
    resp = server.flush_cache()
    assert resp.status_code == 200, resp.text


def test_free_pages_return_to_the_start_value(server05):
    flush_radix(server05)
    pool = pool_state(server05)
    assert pool["requests_released"] >= 3
    assert pool["active_rows"] == 0
    assert pool["pages_used"] == 0
    assert pool["pages_free"] == pool["pages_free_at_start"]


def test_pool_numbers_reach_metrics_and_the_step_log(server05):
    generate(server05.base_url, [1, 2, 3, 4], 4)  # a prefill log line + a log_stats call
    text = requests.get(f"{server05.base_url}/metrics", timeout=60).text
    gauges = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("tangram:")
    }
    assert set(gauges) == set(GAUGES)
    pool = pool_state(server05)
    assert gauges["tangram:pages_total"] == pool["pages_total"]
    assert gauges["tangram:pages_used"] + gauges["tangram:pages_free"] == pool["pages_total"]
    saved = gauges["tangram:full_kv_bytes"] - gauges["tangram:kv_bytes_held"]
    assert gauges["tangram:kv_bytes_saved"] == saved
    assert 0.0 <= gauges["tangram:fragmentation"] <= 1.0
    assert 0 <= gauges["tangram:radix_pages_held"] <= gauges["tangram:pages_used"]
    # Pages held by running requests or the radix tree are priced at full KV for the same tokens.
    assert (gauges["tangram:full_kv_bytes"] > 0) == (gauges["tangram:kv_bytes_held"] > 0)
    total = pool["pages_total"]
    line = rf"Prefill batch.*tangram pages: \d+/{total} \(\d+ reserved\), KV [\d.]+ MiB vs full"
    assert re.search(line, server05.log_path.read_text())


def test_tiny_pool_many_short_requests_complete_and_pages_return(servers):
    args = ["--tangram", "--tangram-profile", PROFILE_05, "--max-total-tokens", "1024"]
    server = servers.get(args, "tangram-r0.5-tiny")

    def one(i: int) -> requests.Response:
        return requests.post(
            f"{server.base_url}/generate",
            json={
                "text": f"Fact number {i}: the capital of France is",
                "sampling_params": {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True},
            },
            timeout=600,
        )

    with ThreadPoolExecutor(16) as executor:
        responses = list(executor.map(one, range(16)))
    flush_radix(server)
    pool = pool_state(server)
    assert [r.status_code for r in responses] == [200] * 16
    assert all(len(r.json()["output_ids"]) == 24 for r in responses)
    # 16 x (prompt + 23 decode tokens) needs ~16 x 69 pages > the pool: pages capped the batch.
    assert pool["peak_pages_used"] <= pool["pages_total"] < 16 * 69
    assert pool["requests_released"] >= 16
    # Decode tails grow by pages (docs/admission.md): if the pool ran dry, SGLang retracted and
    # re-ran requests as stock does; every one still completed.
    assert pool["pages_free"] == pool["pages_free_at_start"] and pool["active_rows"] == 0
