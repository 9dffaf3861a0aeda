"""Tangram never holds more KV than full KV for the same tokens, up to page rounding.

The exact bound, per request row and head group g (``ps`` = page size, ``n`` = the tokens the
row added, ``L_g`` / ``P_g`` = the group's kept length now / of the borrowed prefix):

* kept tokens never exceed the segment: ``k_g(n) <= n`` (profile.kept_len), so ``L_g - P_g <= n``;
* a row's table is dense: ``pages_g = ceil(L_g / ps)``, so a row with no borrowed prefix holds
  at most ONE partial page per head group: ``pages_g <= ceil(n / ps)``;
* a row that continues a borrowed prefix whose last page is partial copies that page first
  (copy-on-write): its own pages are ``ceil(L_g / ps) - floor(P_g / ps) <= ceil(n / ps) + 1``,
  i.e. at most one partial page at each end of its own range.

In slots ((token, KV head) cells), with ``G * H_p`` page columns (``= L * H_kv`` when H_p divides
the head count; more for a partial last group):
``held_slots <= n * G * H_p + (pages of rounding) * H_p * ps``, full KV = ``n * L * H_kv``.

Segments shorter than ``min_compress_tokens`` are kept whole (kept = n, never scored): the
footprint admission reserves, the pages allocation takes and the scorer's kept counts all come
from ``profile.group_kept_lens``, so they agree.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram_sglang.backend.compress import batch_kept_indices
from tangram_sglang.bench.synthetic import make_profile
from tangram_sglang.mem.manager import PrefixMatch, TangramMemory

PS, H_P = 4, 2
RATIOS = [[1.0, 0.6, 0.3, 0.05], [0.5, 0.4, 0.2, 0.1], [0.9, 0.2, 0.15, 0.1]]  # 3 layers x 4


def memory(min_compress_tokens: int) -> TangramMemory:
    prof = make_profile(RATIOS, H_P, "global", sink_tokens=2, recent_window=3)
    prof = prof.with_min_compress_tokens(min_compress_tokens)
    return TangramMemory(prof, PS, 2048, 2, 256, None, "cpu", debug=True)


def run_row(mem: TangramMemory, row: int, chunks: list[int], decode: int, prefix=None):
    """Admit, prefill ``chunks`` (one segment each), decode ``decode`` tokens; check the grant."""
    res = mem.admit(row, f"r{row}", chunks[0], 0 if len(chunks) > 1 else decode + 1, prefix)
    assert res is not None
    for i, n in enumerate(chunks):
        if i:
            last = i == len(chunks) - 1
            assert mem.admit_chunk(row, n, decode + 1 if last else 0) is not None
        mem.alloc_extend(row, n)
        mem.commit_extend(row)
    for _ in range(decode):
        mem.alloc_decode([row])
    usage = mem.row_usage(row)
    assert usage.used_pages == usage.reserved_pages and usage.overflow_pages == 0  # one formula


def check_bound(mem: TangramMemory, row: int, tokens: int, prefix_lens: np.ndarray) -> None:
    lens = mem.table.lens[row]
    own = mem.table.num_pages[row] - mem.table.own_start[row]
    assert (lens - prefix_lens <= tokens).all()  # no head keeps more than its tokens
    assert (mem.table.num_pages[row] == -(-lens // PS)).all()  # dense
    ceil_n = -(-tokens // PS)
    partial_prefix = (prefix_lens % PS != 0) & (lens > prefix_lens)
    assert (own <= ceil_n + partial_prefix).all()  # one partial page per end of the own range
    groups, cols = mem.num_head_groups, mem.num_head_groups * H_P
    layers_x_kv = np.asarray(RATIOS).size
    held_slots = int(own.sum()) * H_P * PS
    rounding = groups + int(partial_prefix.sum())  # partial pages allowed
    assert held_slots <= tokens * cols + rounding * H_P * PS
    assert cols >= layers_x_kv  # page columns: L * H_kv plus a partial group's empty ones


@settings(max_examples=60, deadline=None)
@given(
    chunks=st.lists(st.integers(1, 60), min_size=1, max_size=4),
    decode=st.integers(0, 9),
    second=st.lists(st.integers(1, 40), min_size=1, max_size=2),
    floor=st.sampled_from([0, 8, 32, 1000]),
)
def test_rows_hold_at_most_full_kv_plus_one_partial_page_per_group(chunks, decode, second, floor):
    mem = memory(floor)
    run_row(mem, 0, chunks, decode)
    check_bound(mem, 0, sum(chunks) + decode, np.zeros(mem.num_head_groups, np.int64))
    # The next turn continues the finished row's history as a borrowed prefix (copy-on-write).
    lens = mem.table.lens[0].copy()
    table = [mem.group_pages(0, g) for g in range(mem.num_head_groups)]
    segments = mem.finish(0)
    run_row(mem, 1, second, 2, PrefixMatch(table, lens))
    check_bound(mem, 1, sum(second) + 2, lens)
    mem.abort(1)
    mem.free_pages(np.concatenate([p for s in segments for p in s.pages]), "test")
    assert mem.allocator.num_used() == 0


def test_short_segments_are_kept_whole_and_never_scored():
    mem = memory(32)
    kept = np.array([mem.profile.group_kept_lens(n) for n in (31, 32)])
    assert (kept[0] == 31).all() and (kept[1] < 32).any()

    class NoScorer:
        name, obs_window = "none", 4

        def score(self, *args, **kwargs):
            raise AssertionError("a segment under min_compress_tokens was scored")

    q, k = torch.randn(31 + 20, 2, 8), torch.randn(31 + 20, 2, 8)
    lse = torch.zeros(31 + 20, 2)
    per_head = [[31, 31], [20, 20]]  # both segments under the floor: every head keeps all
    out = batch_kept_indices(NoScorer(), q, k, lse, [0, 31, 51], per_head, 0.3, 2, 3)
    assert out[0, :, :31].tolist() == [list(range(31))] * 2
    assert out[1, :, :20].tolist() == [list(range(20))] * 2


@pytest.mark.parametrize("floor", [0, 64])
def test_footprint_equals_the_pages_taken(floor):
    """Admission's footprint and allocation use the same kept lengths (threshold included)."""
    mem = memory(floor)
    for row, n in enumerate((40, 100)):
        need = mem.footprint(n, 5)
        run_row(mem, row, [n], 4)
        assert mem.row_usage(row).used_pages == need


def test_kv_held_bench_plays_rounds_through_the_real_memory():
    from tangram_sglang.bench.kv_held import kv_held

    prof = make_profile(RATIOS, H_P, "global", sink_tokens=2, recent_window=3)
    rounds = [((10, 5), (7, 3), (20, 4))] * 2
    got = kv_held(prof.with_min_compress_tokens(16), rounds, page_size=PS)
    assert got["segments"] == 6 and got["scored_segments"] == 2  # only the 21-token rounds
    assert got["tokens"] == 2 * (10 + 4 + 8 + 2 + 21 + 3)
    assert got["held_over_full"] >= got["dense_over_full"]
