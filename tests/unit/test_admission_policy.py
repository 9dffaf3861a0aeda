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
    assert "--chunked-prefill-size" not in alone  # one chunk already: no chunk size helps
    none_left = state.never_fits_message(PrefillAsk(200, 200, 0), 0, 8)
    assert "max_tokens 8; the prompt leaves no token" in none_left and "capped" not in none_left


def test_never_fits_names_the_chunk_size_that_makes_a_chunked_prompt_fit():
    """A prompt whose later chunks (counted uncompressed) overflow the pool, but which fits as
    one compressed chunk: the refusal names the ``--chunked-prefill-size`` that admits it."""
    state = make_state(num_pages=17)
    prompt = next(
        n
        for n in range(8, 400, 8)
        if not state.fits_pool(PrefillAsk(n, 16, 0)) and state.fits_pool(PrefillAsk(n, n, 0))
    )
    message = state.never_fits_message(PrefillAsk(prompt, 16, 0), 1, 1)
    assert f"raise --chunked-prefill-size to {prompt} or more" in message
    assert f"the {prompt - 16} prompt tokens after its first 16-token chunk" in message
    too_long = PrefillAsk(4000, 16, 0)  # too long even as one chunk: no chunk size helps
    assert not state.fits_pool(PrefillAsk(4000, 4000, 0))
    assert "--chunked-prefill-size" not in state.never_fits_message(too_long, 1, 1)


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


def _admit_round(requests, monkeypatch, chunk: int = 0):
    """Offer ``requests`` (prompt ids, max_new_tokens) to one real ``PrefillAdder`` round
    through Tangram's ``add_one_req``, on the real radix tree; stop at the first non-CONTINUE.

    Returns ``(state, adder, results, prices)``: ``prices`` counts ``request_pages`` calls.
    """
    from array import array

    import radix_world
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder
    from sglang.srt.runtime_context import get_context
    from sglang.srt.sampling.sampling_params import SamplingParams

    from tangram_sglang.integration.sglang_adapters import add_one_req

    monkeypatch.setattr(radix_world, "SLOTS", 10_000)  # SGLang's token budget never binds
    tree, state, _, slots = radix_world.build_tree(chunk_tokens=chunk)
    price, prices = state.request_pages, []
    state.request_pages = lambda ask: prices.append(ask) or price(ask)
    results = []
    with get_context().override_server_args():
        adder = PrefillAdder(1, tree, slots, None, 1.0, 10**6, chunk or None)
        for i, (prompt, max_new) in enumerate(requests):
            req = Req(f"r{i}", "", array("q", prompt), SamplingParams(max_new_tokens=max_new))
            req.init_next_round_input(tree)
            result = add_one_req(
                PrefillAdder.add_one_req,
                adder,
                req,
                has_chunked_req=False,
                truncation_align_size=None,
            )
            results.append(result)
            if result != AddReqResult.CONTINUE:
                break
    return state, adder, results, prices


def test_a_round_admits_until_the_picks_and_the_candidate_pass_the_free_pages(monkeypatch):
    """The real round: each candidate is priced with every earlier pick; the first NO_TOKEN
    comes exactly when their pages pass the free pages, and each pick is priced once, when it
    joins the round (not again by every later candidate: n(n+1)/2 prices)."""
    from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS, AddReqResult

    from tangram_sglang.integration.sglang_adapters import round_picks

    rng = np.random.default_rng(1)
    requests = [
        (rng.integers(1, 50, int(rng.integers(4, 30))).tolist(), int(rng.integers(2, 30)))
        for _ in range(40)
    ]
    state, adder, results, prices = _admit_round(requests, monkeypatch)
    assert results[-1] == AddReqResult.NO_TOKEN  # the pool filled up before the 40th request
    picked = len(results) - 1
    assert len(adder.can_run_list) == picked >= 2
    free = state.memory.ledger.unreserved_free()
    need = [
        state.request_pages(
            PrefillAsk(len(p), len(p), admission_decode_tokens(t, int(CLIP_MAX_NEW_TOKENS)))
        )
        for p, t in requests[: picked + 1]
    ]
    assert sum(need[:picked]) <= free < sum(need)  # the candidate alone tips it over
    priced = len(prices)
    picks = round_picks(state, adder)
    assert picks.new_pages == sum(need[:picked]) and picks.priced == picked
    assert len(prices) == priced  # each pick was priced once, when it joined the round
    assert not state.refused  # an idle pool with picks waits; it does not refuse
