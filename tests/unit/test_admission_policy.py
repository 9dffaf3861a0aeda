"""The admission formula and policy of ``docs/admission.md``, without a server.

* one formula: ``request_pages`` is what ``allocate_extend`` reserves (with and without a matched
  prefix), and the same function decides "can never fit" (``fits_pool``) and "fits now"
  (``can_admit``): on an idle pool a request fits now exactly when it fits the pool;
* ``max_decode_tokens`` is the largest tail that fits; the refusal names max_tokens and the pool;
* admission counts SGLang's token estimate in pages: ``min(T - out, clip)`` for new requests,
  times ``new_token_ratio`` for running ones (exact per head group from their tables);
* the edge checks refuse ids outside the vocabulary and grammar requests on a CPU server;
* an uncaught TangramError prints one line (start-up refusals).
"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from test_backend_metadata import PAGE, make_state

from tangram_sglang.backend.state import PrefillAsk
from tangram_sglang.integration.edge_checks import check_grammar, check_token_ids
from tangram_sglang.mem.prefix import PrefixMatch
from tangram_sglang.mem.reservation import admission_decode_tokens


def test_request_pages_is_what_allocate_extend_reserves():
    state = make_state()
    for prompt, first in [(9, 9), (14, 9), (3, 3), (30, 8)]:
        row = 1
        state.plan_row(row, prompt)
        state.allocate_extend([row], [first], [0])
        assert state.memory.ledger.by_row[row].reserved_pages == state.request_pages(
            PrefillAsk(prompt, first, 0)
        )
        state.release(row)


def test_request_pages_with_a_prefix_counts_the_copy_on_write_pages():
    state = make_state()
    state.allocate_extend([1], [9], [0])
    lens = state.memory.table.lens[1].copy()  # partial last pages: 9 and 7 kept tokens
    pages = [state.memory.group_pages(1, g) for g in range(state.memory.num_head_groups)]
    match = PrefixMatch([p.copy() for p in pages], lens)
    ask = PrefillAsk(5, 5, 3, prefix_lens=lens)
    assert state.request_pages(ask) == state.memory.footprint(5, 0, match, decode_tokens=3)
    add = np.asarray(state.profile.group_kept_lens(5)) + 3
    cow = int((lens % PAGE != 0).sum())
    assert cow > 0
    plain = int((-(-(lens + add) // PAGE) - -(-lens // PAGE)).sum())
    assert state.request_pages(ask) == plain + cow  # one copy-on-write page per partial tail


def test_never_fits_and_fits_now_are_one_formula():
    state = make_state(num_pages=17)  # 16 usable pages, idle
    for prompt in (1, 4, 9, 20):
        for tail in range(0, 40, 3):
            ask = PrefillAsk(prompt, prompt, tail)
            assert state.is_idle()
            assert state.can_admit([ask]) == state.fits_pool(ask), (prompt, tail)


def test_max_decode_tokens_is_the_largest_tail_that_fits():
    state = make_state(num_pages=17)
    ask = PrefillAsk(9, 9, 0)
    best = state.max_decode_tokens(ask)
    assert state.fits_pool(ask.with_decode(best)) and not state.fits_pool(ask.with_decode(best + 1))
    assert state.max_decode_tokens(PrefillAsk(200, 200, 0)) == -1  # the prompt alone is too big
    message = state.never_fits_message(ask.with_decode(100), 101, 101)
    assert "max_tokens 101" in message and "whole pool holds 16 pages" in message
    assert f"at most max_tokens {best} fits" in message  # T tokens written (overlap)
    capped = state.never_fits_message(ask.with_decode(100), 101, 5000)
    assert "max_tokens 5000, capped to 101 by the server" in capped
    alone = state.never_fits_message(PrefillAsk(200, 200, 7), 8, None)
    assert "max_tokens not set" in alone and "the prompt alone does not fit" in alone


def test_admission_counts_running_tails_times_the_ratio_exactly_per_group():
    state = make_state(num_pages=33)  # 32 usable pages
    state.plan_row(1, 6)
    state.allocate_extend([1], [6], [0])
    lens = state.memory.table.lens[1]
    for tokens in (1, 5, 17):
        want = int((-(-(lens + tokens) // PAGE) - -(-lens // PAGE)).sum())
        assert state.decode_headroom_pages([1], [tokens]) == want
    assert state.decode_headroom_pages([2], [9]) == 0  # a row without pages
    new = PrefillAsk(8, 8, 8)
    free = state.memory.ledger.unreserved_free()
    head = state.decode_headroom_pages([1], [admission_decode_tokens(60, 4096, 0.7)])
    assert state.can_admit([new], head) == (state.request_pages(new) + head <= free)
    assert not state.is_idle()


@pytest.mark.parametrize(
    ("left", "clip", "ratio", "want"),
    [
        (100, 4096, 1.0, 100),
        (10**6, 4096, 1.0, 4096),
        (100, 4096, 0.7, 70),
        (3, 4096, 0.5, 2),
        (0, 4096, 0.7, 0),
        (-5, 4096, 1.0, 0),
        (10**6, 4096, 0.1, 410),
    ],
)
def test_admission_decode_tokens_is_sglangs_clipped_estimate(left, clip, ratio, want):
    assert admission_decode_tokens(left, clip, ratio) == want


def test_token_ids_outside_the_vocabulary_are_refused():
    check_token_ids([0, 5, 49151], 49152)
    for bad in (-1, 49152, 10**9, 1.5, True):
        with pytest.raises(ValueError, match=r"must be integers in \[0, 49152\)"):
            check_token_ids([1, bad], 49152)
    with pytest.raises(ValueError, match=r"^stop_token_ids\[0\] = -3 is not a token id"):
        check_token_ids([-3], 49152, field="stop_token_ids")


def test_grammar_requests_are_refused_on_a_cpu_server_with_xgrammar():
    cpu = SimpleNamespace(device="cpu", grammar_backend="xgrammar")
    check_grammar({"max_new_tokens": 3}, cpu)
    with pytest.raises(ValueError, match="regex; OpenAI response_format.*needs a GPU"):
        check_grammar({"regex": "[0-9]+"}, cpu)
    check_grammar({"regex": "[0-9]+"}, SimpleNamespace(device="cuda", grammar_backend="xgrammar"))
    check_grammar({"regex": "[0-9]+"}, SimpleNamespace(device="cpu", grammar_backend="outlines"))


def test_an_uncaught_tangram_error_prints_one_line():
    code = (
        "from tangram_sglang.integration.plugin import install_excepthook\n"
        "from tangram_sglang.errors import ConfigError\n"
        "install_excepthook(); install_excepthook()\n"
        "raise ConfigError('--tp-size 2 cannot be combined with --tangram')\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert run.stderr.strip().splitlines()[-1] == (
        "ConfigError: --tp-size 2 cannot be combined with --tangram"
    )
    assert "Traceback" not in run.stderr
    other = subprocess.run(
        [sys.executable, "-c", code.replace("ConfigError('", "KeyError('")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert other.returncode == 1 and "Traceback" in other.stderr


def test_pages_return_after_prompt_only_admission_and_growing_tails():
    state = make_state(num_pages=33)
    start = state.memory.allocator.num_free()
    rng = np.random.default_rng(0)
    for row in (1, 2, 3):
        state.plan_row(row, 5 + row)
        state.allocate_extend([row], [5 + row], [0])
    rows, step = [1, 2, 3], 0
    while rows:
        if not state.can_decode(rows):  # dry: SGLang retracts the last one
            state.release(rows.pop())
            continue
        state.allocate_decode(rows, [20 + step] * len(rows))
        step += 1
        if rng.random() < 0.2:
            state.release(rows.pop(0))  # a request finishes
    assert state.memory.allocator.num_free() == start
    assert state.memory.ledger.outstanding_pages() == 0


def _sglang_req(rid: str, prompt_tokens: int, chunk: int, max_new_tokens: int):
    """A real SGLang ``Req`` as the adder holds it after picking it: no prefix, first chunk set."""
    from array import array

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req(
        rid,
        "",
        array("q", range(1, prompt_tokens + 1)),
        SamplingParams(max_new_tokens=max_new_tokens),
    )
    req.init_next_round_input(None)
    req.set_extend_range(0, chunk)
    return req


def test_a_round_prices_each_picked_request_once_and_sums_as_the_formula_does(monkeypatch):
    from tangram_sglang.integration.sglang_adapters import round_picks

    state = make_state(num_pages=512)
    calls = []
    price = state.request_pages
    monkeypatch.setattr(state, "request_pages", lambda ask: calls.append(ask) or price(ask))
    adder = SimpleNamespace(can_run_list=[])  # what round_picks reads of SGLang's PrefillAdder
    reqs = [_sglang_req(f"r{i}", 5 + 3 * i, min(5 + 3 * i, 16), 4 + i) for i in range(12)]
    sums = []
    for req in reqs:  # the adder appends each request it admits; the next candidate reads
        sums.append(round_picks(state, adder).new_pages)
        adder.can_run_list.append(req)
    picks = round_picks(state, adder)
    assert len(calls) == len(reqs)  # each picked request priced once (was once per candidate)
    assert picks.new_requests == len(reqs) and picks.continuing == []
    want = [
        price(
            PrefillAsk(
                len(r.full_untruncated_fill_ids),
                r.extend_range.length,
                admission_decode_tokens(r.sampling_params.max_new_tokens, 4096),
            )
        )
        for r in reqs
    ]
    assert sums == [sum(want[:i]) for i in range(len(reqs))]
    assert picks.new_pages == sum(want)
