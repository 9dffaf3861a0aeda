"""Reservation through TangramState: the prompt is reserved, the decode tail grows by pages.

``docs/admission.md``: admission reserves ``request_pages`` with no decode tail (the first chunk
compressed, later chunks uncompressed), trimmed to the exact pages after the last chunk, so a
chunked prefill never waits for a page; each decode step takes its pages from the unreserved
free pages; when they run out ``can_decode`` says False (SGLang retracts), and releasing a row
gives every page back.
"""

from __future__ import annotations

from test_backend_metadata import PAGE, make_state

from tangram_sglang.backend.state import PrefillAsk, chunked_footprint_pages


def test_unchunked_request_reserves_its_prompt_and_decodes_past_the_grant():
    state = make_state()
    ledger, start = state.memory.ledger, state.memory.allocator.num_free()
    state.plan_row(1, prompt_tokens=9)
    state.allocate_extend([1], [9], [0])
    assert ledger.by_row[1].reserved_pages == state.request_pages(PrefillAsk(9, 9, 0))
    assert ledger.outstanding_pages() == 0  # nothing held back for the tail
    for step in range(5):
        state.allocate_decode([1], [10 + step])
    res = ledger.by_row[1]
    assert res.used_pages == res.reserved_pages and res.overflow_pages > 0
    used = start - state.memory.allocator.num_free()
    assert used == chunked_footprint_pages(state.profile, PAGE, 9, 6, 0)  # exact to the page
    state.release(1)
    assert state.memory.allocator.num_free() == start and ledger.outstanding_pages() == 0


def test_chunked_request_reserves_an_upper_bound_then_trims_to_the_exact_prompt():
    state = make_state()
    ledger, start = state.memory.ledger, state.memory.allocator.num_free()
    state.plan_row(1, prompt_tokens=14)
    upper = state.request_pages(PrefillAsk(14, 9, 0))
    assert upper == state.memory.footprint(9, 0, decode_tokens=5)  # 5 tokens uncompressed
    state.allocate_extend([1], [9], [0])
    assert ledger.by_row[1].reserved_pages == upper
    state.allocate_extend([1], [5], [9])  # taken from the grant: no admit_chunk
    res = ledger.by_row[1]
    assert res.remaining_pages == 0 and ledger.outstanding_pages() == 0
    for step in range(3):
        state.allocate_decode([1], [15 + step])
    assert start - state.memory.allocator.num_free() == chunked_footprint_pages(
        state.profile, PAGE, 14, 4, 9
    )
    state.release(1)
    assert state.memory.allocator.num_free() == start and ledger.outstanding_pages() == 0
    assert 1 not in state.plans


def test_a_dry_pool_fails_the_decode_check_and_retraction_gives_every_page_back():
    state = make_state(num_pages=9)  # 8 usable pages, 2 head groups, 4-token pages
    start = state.memory.allocator.num_free()
    for row in (1, 2):
        state.plan_row(row, 4)
        state.allocate_extend([row], [4], [0])
    steps = 0
    while state.can_decode([1, 2]):
        state.allocate_decode([1, 2], [5 + steps] * 2)
        steps += 1
    assert state.memory.allocator.num_free() < 2  # dry: exact pages, not fragmentation
    state.release(2)  # what SGLang's retract_decode does through ReqToTokenPool.free
    assert state.can_decode([1])
    state.release(1)
    assert state.memory.allocator.num_free() == start
    assert state.memory.ledger.outstanding_pages() == 0
