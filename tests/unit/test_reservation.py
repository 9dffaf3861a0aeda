"""Budget Reservation: pages_needed exact to the page at segment edges; the ledger's contract."""

import itertools
import math

import numpy as np
import pytest
from factories import make_ledger, make_profile

from tangram_sglang.errors import PoolError
from tangram_sglang.mem.reservation import (
    RequestTooLargeError,
    decode_tail_tokens,
    group_pages_needed,
    pages_needed,
)
from tangram_sglang.profile import kept_len

PAGE = 4


def profile_of(ratios, sink=2, window=3):
    return make_profile([ratios], heads_per_group=1, sink_tokens=sink, recent_window=window)


def simulate_pages(length: int, shared: bool, add: int) -> int:
    """Brute force: append ``add`` tokens one at a time to a page list, counting new pages."""
    slots_left = (-length) % PAGE  # free slots in the last page
    own_last = not shared
    new = 0
    for _ in range(add):
        if slots_left == 0:
            new, slots_left, own_last = new + 1, PAGE, True
        elif not own_last:
            new, own_last = new + 1, True  # copy the shared partial page first
        slots_left -= 1
    return new


@pytest.mark.parametrize(
    ("n", "expected_kept"),
    [
        (0, [0, 0, 0]),
        (1, [1, 1, 1]),  # n == 1
        (4, [4, 4, 4]),  # n < sink + window: everything kept
        (5, [5, 5, 5]),  # n == sink + window
        (25, [25, 15, 6]),  # ratio 1.0 / 0.5 / tiny (ceil of a tiny share is 1 token)
    ],
    ids=["n0", "n1", "n-below-sink-window", "n-equals-sink-window", "n25"],
)
def test_footprint_at_segment_edges(n, expected_kept):
    prof = profile_of([1.0, 0.5, 1e-6])
    assert prof.group_kept_lens(n) == expected_kept
    expected = sum(math.ceil(k / PAGE) for k in expected_kept)
    assert pages_needed(prof, PAGE, n, max_new_tokens=1) == expected
    assert pages_needed(prof, PAGE, n, max_new_tokens=0) == expected


@pytest.mark.parametrize("max_new", [0, 1, 2, 5, 9], ids=lambda t: f"T{t}")
def test_decode_tail_is_t_minus_one_tokens_per_group(max_new):
    prof = profile_of([1.0, 0.25])
    tail = decode_tail_tokens(max_new)
    assert tail == max(max_new - 1, 0)
    expected = sum(math.ceil((k + tail) / PAGE) for k in prof.group_kept_lens(10))
    assert pages_needed(prof, PAGE, 10, max_new) == expected


def test_ratio_one_profile_needs_full_kv_pages():
    prof = profile_of([1.0, 1.0, 1.0], sink=0, window=0)
    assert pages_needed(prof, PAGE, 4097, 1) == 3 * math.ceil(4097 / PAGE)


@pytest.mark.parametrize(
    ("length", "shared", "add", "expected"),
    [
        (5, True, 3, 1),  # partial shared tail: copy it, then 3 fit in the copy
        (5, True, 4, 2),  # copy + one more page
        (5, False, 3, 0),  # own partial tail takes 3 more
        (4, True, 1, 1),  # aligned shared tail: no copy, one fresh page
        (5, True, 0, 0),  # nothing appended: no copy
        (0, False, 0, 0),
        (0, True, 9, 3),  # empty group: never a copy
    ],
    ids=[
        "cow",
        "cow-plus-page",
        "own-tail",
        "aligned-shared",
        "no-append",
        "empty",
        "empty-shared",
    ],
)
def test_group_pages_needed_cow_cases(length, shared, add, expected):
    got = group_pages_needed(np.array([length]), np.array([shared]), np.array([add]), PAGE)
    assert got.tolist() == [expected]


def test_group_pages_needed_matches_brute_force():
    cases = list(itertools.product(range(0, 13), (False, True), range(0, 14)))
    lens, shared, add = (np.array(c) for c in zip(*cases, strict=True))
    got = group_pages_needed(lens, shared, add, PAGE)
    want = [simulate_pages(int(a), bool(b), int(c)) for a, b, c in cases]
    assert got.tolist() == want


def test_pages_needed_with_prefix_uses_kept_len_per_group():
    prof = profile_of([1.0, 0.3])
    lens, shared = np.array([6, 3]), np.array([True, True])
    kept = [kept_len(20, r, 2, 3) for r in (1.0, 0.3)]
    expected = sum(simulate_pages(int(lens[g]), True, kept[g] + 4) for g in range(2))
    assert pages_needed(prof, PAGE, 20, 5, lens, shared) == expected


def test_can_reserve_has_no_side_effects_and_counts_evictable():
    ledger = make_ledger()
    assert ledger.can_reserve(15) and not ledger.can_reserve(16)
    ledger.reserve(0, "a", 10)
    assert not ledger.can_reserve(6)
    assert ledger.can_reserve(6, evictable_pages=1)
    assert not ledger.can_reserve(16, evictable_pages=100)  # never fits the pool
    assert ledger.outstanding_pages() == 10 and ledger.unreserved_free() == 5


def test_reserve_does_not_fit_now_returns_none_and_changes_nothing():
    ledger = make_ledger()
    ledger.reserve(0, "a", 12)
    assert ledger.reserve(1, "b", 4) is None
    assert 1 not in ledger.by_row and ledger.outstanding_pages() == 12


def test_reserve_larger_than_pool_raises_naming_request():
    ledger = make_ledger()
    with pytest.raises(RequestTooLargeError, match=r"request 'big' \(row 2\) needs 16 pages"):
        ledger.reserve(2, "big", 16)
    assert ledger.by_row == {} and ledger.outstanding_pages() == 0


def test_take_within_grant_then_extend_beyond_raises():
    ledger = make_ledger()
    ledger.reserve(0, "a", 3)
    ledger.take(0, 2, allow_overflow=False)
    with pytest.raises(PoolError, match="has 1 of its 3 reserved left"):
        ledger.take(0, 2, allow_overflow=False)
    res = ledger.by_row[0]
    assert (res.used_pages, res.remaining_pages, ledger.outstanding_pages()) == (2, 1, 1)


def test_decode_overflow_draws_unreserved_pages_only():
    ledger = make_ledger(num_pages=6)  # 5 usable
    ledger.reserve(0, "a", 1)
    ledger.reserve(1, "b", 3)
    ledger.take(0, 2, allow_overflow=True)  # 1 from the grant, 1 overflow
    assert ledger.by_row[0].overflow_pages == 1
    ledger.allocator.alloc(2)
    with pytest.raises(PoolError, match="unreserved pages are free"):
        ledger.take(0, 1, allow_overflow=True)  # the only free pages are b's grant


def test_release_returns_unused_grant():
    ledger = make_ledger()
    ledger.reserve(0, "a", 5)
    ledger.take(0, 2, allow_overflow=False)
    res = ledger.release(0)
    assert res.remaining_pages == 3 and ledger.outstanding_pages() == 0
