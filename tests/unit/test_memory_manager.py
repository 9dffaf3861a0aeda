"""TangramMemory: admission contract, bad input leaves no trace, hand-overs, accounting."""

import numpy as np
import pytest
import torch
from factories import make_memory, make_profile

from tangram_sglang.errors import PoolError
from tangram_sglang.mem.manager import PrefixMatch, TangramMemory
from tangram_sglang.mem.reservation import RequestTooLargeError


def snapshot(mem):
    return (
        mem.stats(),
        mem.allocator.free_pages.tolist(),
        mem.allocator.ref_count.tolist(),
        mem.table.page_table.clone(),
        mem.table.group_len.clone(),
        list(mem.rids),
    )


def assert_unchanged(mem, before):
    after = snapshot(mem)
    assert after[0] == before[0] and after[1:3] == before[1:3] and after[5] == before[5]
    assert torch.equal(after[3], before[3]) and torch.equal(after[4], before[4])


def prefill(mem, row, rid, n, max_new):
    assert mem.admit(row, rid, n, max_new) is not None
    mem.alloc_extend(row, n)
    mem.commit_extend(row)


def test_can_admit_has_no_side_effects_and_admit_reserves_exactly():
    mem = make_memory()
    before = snapshot(mem)
    assert mem.can_admit(10, 3) and mem.footprint(10, 3) == 5
    assert_unchanged(mem, before)
    res = mem.admit(0, "a", 10, 3)
    assert (res.reserved_pages, res.used_pages) == (5, 0)
    assert mem.stats().reserved_pages == 5 and mem.stats().free_pages == 15


def test_request_larger_than_pool_rejected_with_nothing_allocated():
    mem = make_memory(max_pages=16)
    before = snapshot(mem)
    assert mem.footprint(40, 1) == 15 and mem.can_admit(40, 1)  # exactly the whole pool
    assert not mem.can_admit(44, 1, evictable_pages=100)
    with pytest.raises(RequestTooLargeError, match=r"request 'huge' \(row 1\) needs 17 pages"):
        mem.admit(1, "huge", 44, 1)
    assert_unchanged(mem, before)


def test_does_not_fit_now_returns_none_and_evictable_pages_count():
    mem = make_memory()
    prefill(mem, 0, "a", 20, 1)  # 5 + 3 pages
    segs = mem.finish(0)  # a radix node now holds 8 pages
    before = snapshot(mem)
    assert not mem.can_admit(24, 1)  # needs 9 pages, 7 free
    assert mem.can_admit(24, 1, evictable_pages=8)
    assert mem.pages_to_evict(9) == 2
    assert mem.admit(1, "b", 24, 1) is None
    assert_unchanged(mem, before)
    mem.free_pages(np.concatenate([segs[0].pages[g][::-1] for g in (0, 1)]))  # evict, tail first
    assert mem.admit(1, "b", 24, 1) is not None


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda m: m.admit(0, "dup", 1, 1), r"row 0 is still used by request 'a'"),
        (lambda m: m.admit(9, "x", 1, 1), r"request 'x': row 9 is outside"),
        (
            lambda m: m.alloc_extend(0, 9),
            r"request 'a' \(row 0\) asks for 3 pages but has 0 of its 2",
        ),
        (lambda m: m.alloc_extend(3, 1), r"row 3 has no admitted request"),
        (lambda m: m.commit_extend(0), r"row 0 has no allocated extend"),
        (lambda m: m.group_pages(0, 2), r"request 'a' \(row 0\): group 2 is outside"),
        (lambda m: m.free_pages(m.group_pages(0, 0)), r"pages \[1\] are not held outside"),
        (lambda m: m.free_pages(np.array([7])), r"pages \[7\] are not held outside"),
        (lambda m: m.free_pages(np.array([0])), r"out of \[1, 16\)"),
        (lambda m: m.free_pages(np.array([1.5])), r"page ids must be integers"),
        (lambda m: m.alloc_decode([0, 0]), r"repeat a row"),
        (
            lambda m: m.admit(1, "p", 1, 1, PrefixMatch([np.array([1])], np.array([4]))),
            r"prefix has 1 page lists",
        ),
        (
            lambda m: m.admit(
                1, "p", 1, 1, PrefixMatch([np.array([1]), np.array([9])], np.array([4, 1]))
            ),
            r"request 'p' \(row 1\), group 1: prefix pages must be held",
        ),
        (
            lambda m: m.admit(
                1, "q", 1, 1, PrefixMatch([np.array([1]), np.array([], np.int64)], np.array([4, 1]))
            ),
            r"request 'q' \(row 1\), group 1: prefix length 1 needs 1 pages, got 0",
        ),
        (
            lambda m: m.admit(
                1, "o", 1, 1, PrefixMatch([np.array([1]), np.array([99])], np.array([4, 1]))
            ),
            r"request 'o' \(row 1\), group 1: prefix pages must be held",
        ),
        (
            lambda m: m.admit(1, "w", 1, 40, decode_tokens=40),
            r"request 'w' \(row 1\), group 0: 41 kept tokens need 11 pages > max_pages",
        ),
    ],
    ids=[
        "row-in-use",
        "row-out-of-range",
        "extend-beyond-reservation",
        "inactive-row",
        "commit-without-alloc",
        "group-out-of-range",
        "free-row-owned-page",
        "double-free",
        "free-padding",
        "free-float-ids",
        "repeated-decode-row",
        "prefix-group-count",
        "prefix-free-page",
        "prefix-page-count",
        "prefix-page-out-of-range",
        "table-too-narrow",
    ],
)
def test_broken_contracts_raise_and_change_nothing(call, match):
    mem = make_memory()
    prefill(mem, 0, "a", 2, 2)  # holds pages 1, 2; 1 decode token reserved, 0 pages left
    before = snapshot(mem)
    with pytest.raises(PoolError, match=match):
        call(mem)
    assert_unchanged(mem, before)


def test_out_of_pages_mid_decode_is_reported_before_any_write():
    mem = make_memory(num_pages=5)  # 4 usable pages
    for row in (0, 1):  # overcommit: reserve no decode tail (SGLang's new_token_ratio)
        assert mem.admit(row, f"r{row}", 4, 10, decode_tokens=0) is not None
        mem.alloc_extend(row, 4)
        mem.commit_extend(row)
    assert mem.decode_pages_needed([0, 1]) == 2  # group 0 full in both rows
    assert not mem.can_decode([0, 1])
    before = snapshot(mem)
    with pytest.raises(PoolError, match="out of pages"):
        mem.alloc_decode([0, 1])
    assert_unchanged(mem, before)
    usage = mem.row_usage(1)
    assert (usage.own_pages, usage.borrowed_pages, usage.remaining_pages) == (2, 0, 0)
    mem.retract(1)  # SGLang retracts a request, then the step fits
    assert mem.can_decode([0]) and mem.alloc_decode([0]) == 1
    assert mem.stats().overflow_pages == 1


def test_finish_before_commit_raises_and_abort_with_pending_frees_all():
    mem = make_memory()
    mem.admit(0, "a", 10, 1)
    mem.alloc_extend(0, 10)
    with pytest.raises(PoolError, match="not committed"):
        mem.finish(0)
    assert mem.abort(0) == 5
    assert mem.stats().free_pages == 15 and mem.stats().reserved_pages == 0
    assert mem.allocator.free_pages.tolist()[-5:] == [3, 2, 1, 5, 4]  # tail first per group


def test_abort_releases_borrowed_prefix_without_freeing_it():
    mem = make_memory()
    prefill(mem, 0, "a", 8, 1)
    segs = mem.finish(0)
    node = [ids for s in segs for ids in s.pages]
    prefix = PrefixMatch([segs[0].pages[0], segs[0].pages[1]], np.array([8, 4]))
    assert mem.admit(1, "b", 4, 1, prefix) is not None
    mem.alloc_extend(1, 4)
    assert mem.abort(1) == 2  # only b's own pages return
    assert mem.allocator.ref_count[[1, 2, 3]].tolist() == [1, 1, 1]
    for ids in node:
        mem.free_pages(ids)
    assert mem.stats().used_pages == 0


def test_stats_account_pages_bytes_fragmentation_and_peak():
    mem = make_memory()
    prefill(mem, 0, "a", 10, 2)  # group 0: 10 tokens in 3 pages; group 1: 5 in 2
    mem.alloc_decode([0])
    st = mem.stats()
    assert (st.used_pages, st.free_pages, st.pages_per_group) == (5, 10, (3, 2))
    assert st.bytes_held == 5 * mem.bytes_per_page == 5 * 2 * 2 * 4 * 8 * 4
    assert st.allocated_slots == 5 * 2 * 4
    assert st.unused_slots == 40 - 2 * (11 + 6)  # tails of both groups' last pages
    assert st.fragmentation_fraction == pytest.approx(6 / 40)
    assert (st.granted_pages, st.granted_used_pages, st.num_active_rows) == (5, 5, 1)
    mem.abort(0)
    st = mem.stats()
    assert st.used_pages == 0 and st.peak_used_pages == 5 and st.to_dict()["peak_used_pages"] == 5


def test_partial_global_group_counts_spare_columns_as_unused():
    prof = make_profile([[1.0, 1.0, 1.0]], heads_per_group=2, scope="global")
    mem = TangramMemory(prof, 4, 8, 2, 4, debug=True)  # accounting only, no K/V storage
    prefill(mem, 0, "a", 4, 1)
    st = mem.stats()
    assert st.allocated_slots == 2 * 2 * 4 and st.unused_slots == 4  # group 1 has one member


def test_create_sizes_pool_and_table_from_bytes():
    prof = make_profile([[1.0, 1.0, 0.5, 0.5]], 2, "per_layer")
    page = 2 * 2 * 4 * 8 * 2  # K+V, H_p, page_size, D, bf16
    mem = TangramMemory.create(prof, 20 * page, page_size=4, max_rows=3, max_context_tokens=30)
    assert mem.allocator.num_pages == 20 and mem.kv_pool.k_pool.shape == (20, 2, 4, 8)
    assert mem.table.page_table.shape == (3, 2, 8) and mem.bytes_per_page == page
    bare = TangramMemory.create(prof, 20 * page, page_size=4, allocate_storage=False)
    assert bare.kv_pool is None and bare.footprint(10, 1) == 5


def test_empty_decode_batch_is_a_no_op():
    mem = make_memory()
    assert mem.can_decode([]) and mem.alloc_decode([]) == 0
    assert mem.stats().used_pages == 0


def test_alloc_extend_rejects_a_negative_or_fractional_length_and_keeps_the_row_usable():
    mem = make_memory()
    assert mem.admit(0, "a", 4, 1) is not None
    for bad in (-1, 2.5):  # -1 used to return an empty plan and block the row's real extend
        with pytest.raises(PoolError, match=f"extend_len={bad!r} must be an integer >= 0"):
            mem.alloc_extend(0, bad)
        assert mem.pending[0] is None
    assert mem.alloc_extend(0, 4).num_new_pages == 2


@pytest.mark.parametrize("row", [1.5, True], ids=["float", "bool"])
def test_non_integer_row_is_a_pool_error(row):
    mem = make_memory()
    before = snapshot(mem)
    with pytest.raises(PoolError, match="is outside"):
        mem.admit(row, "a", 4, 1)
    assert_unchanged(mem, before)


def test_two_rows_copying_one_borrowed_page_in_one_decode_step_drop_both_references():
    """A decode step where two rows copy the same borrowed partial page (copy-on-write) drops
    both rows' references on it: ``row_refs`` counts each occurrence, so the page's only
    holder left is its outside owner (the radix node), who can then free it."""
    profile = make_profile([[1.0, 0.5]], 1, "per_layer", head_dim=1)
    mem = TangramMemory(profile, 4, 16, 4, 4, None, debug=False)
    tail = mem.allocator.alloc(1).numpy().astype(np.int64)  # an outside owner's partial page
    prefix = PrefixMatch(pages=[tail, np.zeros(0, np.int64)], lens=np.array([1, 0]))
    for row in (1, 2):  # both borrow it and extend by nothing
        mem.admit(row, f"r{row}", 0, 0, prefix=prefix)
        mem.alloc_extend(row, 0)
        mem.commit_extend(row)
    mem.alloc_decode(np.array([1, 2]))  # each copies the shared page before writing its token
    assert int(mem.row_refs[tail[0]]) == 0
    assert int(mem.allocator.ref_count[tail[0]]) == 1
    mem.check_invariants()
    mem.free_pages(tail)  # the owner lets go: the page is free again
    assert int(mem.allocator.ref_count[tail[0]]) == 0
