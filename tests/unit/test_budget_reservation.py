"""Budget Reservation through TangramState: plan, reserve the whole footprint, trim, never overflow.

docs/design.md §3.1: a request's pages (segment, later prefill chunks, ``T - 1`` decode tail) are
reserved when it is admitted, so its later chunks and decode steps never wait for a page.
Later chunks are reserved uncompressed (SGLang sizes them when it schedules them); the grant is
trimmed to the exact tail after the last chunk.
"""

from __future__ import annotations

from test_backend_metadata import PAGE, make_state

from tangram_sglang.backend.state import chunked_footprint_pages


def test_unchunked_request_reserves_exactly_its_footprint_and_never_overflows():
    state = make_state()
    ledger = state.memory.ledger
    state.plan_row(1, prompt_tokens=9, decode_tokens=5)
    state.begin_extend([1], [9], [0])
    state.commit_extend([1])
    res = ledger.by_row[1]
    assert res.reserved_pages == chunked_footprint_pages(state.profile, PAGE, 9, 6, 0)
    for step in range(5):
        state.begin_decode([1], [10 + step])
    assert res.used_pages == res.reserved_pages and res.overflow_pages == 0
    assert ledger.outstanding_pages() == 0


def test_chunked_request_reserves_an_upper_bound_then_trims_to_the_exact_tail():
    state = make_state()
    ledger, start = state.memory.ledger, state.memory.allocator.num_free()
    state.plan_row(1, prompt_tokens=14, decode_tokens=3)
    assert state.reservation_pages(14, 9, 3) == state.memory.footprint(9, 0, decode_tokens=8)
    state.begin_extend([1], [9], [0])
    state.commit_extend([1])
    granted = ledger.by_row[1].reserved_pages
    assert granted == state.reservation_pages(14, 9, 3)
    free_before = ledger.unreserved_free()
    state.begin_extend([1], [5], [9])  # taken from the grant: no admit_chunk
    state.commit_extend([1])  # last chunk: trim to the 3-token tail
    res = ledger.by_row[1]
    assert res.reserved_pages <= granted and ledger.unreserved_free() >= free_before
    for step in range(3):
        state.begin_decode([1], [15 + step])
    assert res.overflow_pages == 0 and res.remaining_pages == 0
    assert start - state.memory.allocator.num_free() == chunked_footprint_pages(
        state.profile, PAGE, 14, 4, 9
    )
    state.release(1)
    assert state.memory.allocator.num_free() == start and ledger.outstanding_pages() == 0
    assert 1 not in state.plans


def test_admission_gate_counts_whole_reservations_and_evictable_pages():
    state = make_state(num_pages=17)  # 16 usable pages
    one = state.reservation_pages(8, 8, 4)
    assert state.can_admit_prefills([(8, 8, 4)] * (16 // one)) is True
    assert state.can_admit_prefills([(8, 8, 4)] * (16 // one + 1)) is False
    assert state.can_admit_prefills([(8, 8, 4)] * (16 // one + 1), evictable_pages=one) is True
    assert state.can_admit_prefills([(8, 8, 4)], num_prefixed=16) is False  # COW pages count


def test_admitted_requests_finish_without_page_retraction():
    state = make_state(num_pages=17)
    rows = []
    for row in range(1, 4):
        if not state.can_admit_prefills([(6, 6, 7)]):
            break
        state.plan_row(row, 6, 7)
        state.begin_extend([row], [6], [0])
        state.commit_extend([row])
        rows.append(row)
    assert len(rows) >= 2
    for step in range(7):
        assert state.can_decode(rows)
        state.begin_decode(rows, [7 + step] * len(rows))
    assert all(state.memory.ledger.by_row[r].overflow_pages == 0 for r in rows)
