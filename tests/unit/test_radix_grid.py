"""Grid segmentation (``TANGRAM_GRID_SEGMENTS=1``): segments cut at absolute multiples of the
chunk size; whole cells are compressed, everything else is kept whole, so a match never changes
what a request keeps.

On the real tree + state + SGLang slot pools of ``radix_world`` (no server): a finished request
leaves its whole cells and its tail pieces kept whole inside one cell in the tree (a piece that
reaches into the next cell is freed and counted); a later request whose prompt ends inside that
cell continues from the tail, one whose prompt fills the cell is cut back to the cell's start,
continues chunking on the grid and leaves the same cells as a cold request over the same
prompt. The same tokens and logprobs,
hot and cold, on the real server: ``tests/e2e/test_segment_grid.py``.
"""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest
import torch
from factories import make_profile
from radix_world import build_tree, run_request

from tangram_sglang.config import GRID_ENV, segment_grid
from tangram_sglang.errors import ConfigError, PoolError
from tangram_sglang.integration.sglang_adapters import _align_to_grid
from tangram_sglang.mem.reservation import segment_kept_lens
from tangram_sglang.radix.cache import value_of
from tangram_sglang.radix.segment import is_grid_cell

GRID = 4  # tokens per cell = the chunked-prefill size of the world


def test_the_grid_is_the_chunk_size_when_switched_on():
    assert segment_grid(128, {}) == 0
    assert segment_grid(128, {GRID_ENV: "0"}) == 0
    assert segment_grid(128, {GRID_ENV: "1"}) == 128
    with pytest.raises(ConfigError, match="--chunked-prefill-size"):
        segment_grid(-1, {GRID_ENV: "1"})
    with pytest.raises(ConfigError, match=GRID_ENV):
        segment_grid(128, {GRID_ENV: "maybe"})


def test_kept_lengths_compress_whole_cells_and_keep_the_rest_whole():
    prof = make_profile(
        [[1.0, 0.5, 0.25, 0.25]], heads_per_group=2, scope="global", sink_tokens=1, recent_window=2
    )
    compressed = prof.group_kept_array(64)
    assert compressed.tolist() == [64, 19]  # group 1 keeps 1 + 2 + ceil(0.25 * 61)
    for start, n in ((0, 64), (64, 10), (7, 64), (0, 10), (100, 3)):  # grid off: k_g(n) only
        assert segment_kept_lens(prof, start, n).tolist() == prof.group_kept_array(n).tolist()
    assert segment_kept_lens(prof, 128, 64, 64).tolist() == compressed.tolist()  # a whole cell
    assert segment_kept_lens(prof, 128, 10, 64).tolist() == [10, 10]  # a prompt's last chunk
    assert segment_kept_lens(prof, 70, 58, 64).tolist() == [58, 58]  # continues inside a cell
    assert segment_kept_lens(prof, 70, 64, 64).tolist() == [64, 64]  # a cell's length, off grid
    assert segment_kept_lens(prof, 64, 0, 64).tolist() == [0, 0]
    with pytest.raises(PoolError, match="start_token=-1"):
        segment_kept_lens(prof, -1, 4, 64)


def test_only_whole_prefill_cells_are_grid_cells():
    assert is_grid_cell("extend", 8, 12, 4)
    assert not is_grid_cell("extend", 8, 10, 4)  # a prompt's last, partial chunk
    assert not is_grid_cell("extend", 6, 10, 4)  # off the grid
    assert not is_grid_cell("decode", 8, 12, 4)  # a decode tail that happens to fill a cell


def test_truncation_is_aligned_to_the_grid_by_position_or_keyword():
    assert _align_to_grid(0, (False, None), {}) == ((False, None), {})
    assert _align_to_grid(64, (False, None), {}) == ((False, 64), {})
    assert _align_to_grid(64, (), {"has_chunked_req": True, "truncation_align_size": 96}) == (
        (),
        {"has_chunked_req": True, "truncation_align_size": 192},
    )


def _cells(tree) -> list[tuple[int, int, tuple[int, ...]]]:
    return sorted(
        (v.start_depth, v.end_depth, tuple(v.group_lens.tolist()))
        for v in (value_of(n) for n in tree._boundaries.values())
    )


def test_hot_and_cold_requests_cut_the_same_cells(monkeypatch):
    monkeypatch.setenv(GRID_ENV, "1")
    tree, state, req_pool, slots = build_tree(chunk_tokens=GRID)
    assert tree.grid == GRID and state.segment_grid == GRID
    start_free = state.memory.allocator.num_free()
    turn1 = [5, 6, 7, 8, 1, 2, 3, 4, 9, 9]  # 10 tokens: cells [0, 4), [4, 8); [8, 10) partial
    cached, chunks = run_request(tree, state, req_pool, slots, turn1, [11, 12, 13], GRID)
    assert cached == 0 and chunks == [(0, 4), (4, 8), (8, 10)]
    # The partial chunk is kept whole and cached; the decode tail [10, 13) reaches into the
    # next cell and is freed.
    assert _cells(tree)[2] == (8, 10, (10, 10))  # (4-token cells keep 1 + 2 + 1)
    assert [c[:2] for c in _cells(tree)] == [(0, 4), (4, 8), (8, 10)]
    assert tree.stats()["pages_off_grid_freed"] > 0
    turn2 = [*turn1, 11, 12, 13, 21, 22, 23, 24]  # 17 tokens: the reply, then a new question
    cached, chunks = run_request(tree, state, req_pool, slots, turn2, [31], GRID)
    assert cached == 8  # cut back to the cell start: the prompt fills the cell [8, 12)
    assert chunks == [(8, 12), (12, 16), (16, 17)]
    hot = [c for c in _cells(tree) if c[:2] != (8, 10)]  # turn 1's tail, a branch of its own
    assert [c[:2] for c in hot] == [(0, 4), (4, 8), (8, 12), (12, 16), (16, 17), (17, 18)]
    tree.reset()
    assert state.memory.allocator.num_free() == start_free
    cached, chunks = run_request(tree, state, req_pool, slots, turn2, [31], GRID)
    assert cached == 0 and [c[1] for c in chunks] == [4, 8, 12, 16, 17]
    assert _cells(tree) == hot  # the same cells, kept lengths included
    tree.reset()
    assert state.memory.allocator.num_free() == start_free
    state.memory.check_invariants()


def test_a_chat_inside_one_cell_reuses_its_whole_history(monkeypatch):
    """Turns shorter than a cell continue from the previous turn's prompt and reply (kept
    whole); a turn whose prompt fills the cell is cut back to the cell start and keeps what a
    cold server keeps."""
    monkeypatch.setenv(GRID_ENV, "1")
    cell = 16
    tree, state, req_pool, slots = build_tree(chunk_tokens=cell)
    start_free = state.memory.allocator.num_free()
    turn1 = [5, 6, 7, 8, 1]
    assert run_request(tree, state, req_pool, slots, turn1, [11, 12], cell) == (0, [(0, 5)])
    turn2 = [*turn1, 11, 12, 21, 22, 23]  # 10 tokens, inside the cell [0, 16)
    cached, chunks = run_request(tree, state, req_pool, slots, turn2, [31, 32], cell)
    assert cached == 7 and chunks == [(7, 10)]  # turn 1's prompt and reply, then the question
    turn3 = [*turn2, 31, 32, 41]  # 13 tokens
    cached, chunks = run_request(tree, state, req_pool, slots, turn3, [51], cell)
    assert cached == 12 and chunks == [(12, 13)]
    whole = [v for v in map(value_of, tree._boundaries.values())]
    assert all((v.segment.kept_len == v.segment.num_tokens).all() for v in whole)
    # Another chat sharing turn 1's first 3 tokens: the whole segment [0, 5) is split there.
    cached, _ = run_request(tree, state, req_pool, slots, [5, 6, 7, 9, 9], [3], cell)
    assert cached == 3 and tree.stats()["whole_segments_split"] == 1
    turn4 = [*turn3, 51, *range(60, 66)]  # 20 tokens: fills the cell [0, 16)
    cached, chunks = run_request(tree, state, req_pool, slots, turn4, [71], cell)
    assert cached == 0 and chunks == [(0, 16), (16, 20)]  # cut back to the cell start (root)
    hot = [v for v in map(value_of, tree._boundaries.values()) if v.end_depth >= cell]
    hot = sorted((v.start_depth, v.end_depth, tuple(v.group_lens.tolist())) for v in hot)
    assert hot[0] == (0, 16, (16, 7))  # the cell compressed: group 1 keeps 1 + 2 + ceil(13/4)
    tree.reset()
    assert run_request(tree, state, req_pool, slots, turn4, [71], cell)[1] == chunks
    assert _cells(tree) == hot  # cold: the same cells, kept lengths included
    tree.reset()
    assert state.memory.allocator.num_free() == start_free
    state.memory.check_invariants()


def test_a_shared_prefix_is_held_once(monkeypatch):
    monkeypatch.setenv(GRID_ENV, "1")
    tree, state, req_pool, slots = build_tree(chunk_tokens=GRID)
    document = [40, 41, 42, 43, 44, 45, 46, 47, 48]  # 9 tokens: two whole cells
    run_request(tree, state, req_pool, slots, [*document, 1, 2], [3], GRID)
    held = tree.stats()["pages_held"]
    cached, _ = run_request(tree, state, req_pool, slots, [*document, 7, 7, 7], [3], GRID)
    assert cached == 8
    stats = tree.stats()
    # [0, 4), [4, 8) once; the first chat's tail pieces [8, 11), [11, 12); the second chat's
    # cell [8, 12) (its prompt fills the cell: no split of [8, 11)) and tail piece [12, 13)
    assert stats["segments"] == 6
    new = [v for v in map(value_of, tree._boundaries.values()) if v.end_depth in (12, 13)]
    new = [v for v in new if (v.start_depth, v.end_depth) in ((8, 12), (12, 13))]
    assert len(new) == 2 and stats["pages_held"] == held + sum(v.num_pages for v in new)
    assert state.memory.allocator.num_used() == stats["pages_held"]  # one copy in the pool


def test_cells_of_a_running_chunked_prefill_are_matched_by_a_later_request(monkeypatch):
    monkeypatch.setenv(GRID_ENV, "1")
    tree, state, req_pool, slots = build_tree(chunk_tokens=GRID)
    start_free = state.memory.allocator.num_free()
    document = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49]  # 10 tokens: cells [0, 4), [4, 8)
    row = req_pool.free_slots.pop(0)
    req_pool.req_to_token[row, : len(document)] = slots.alloc(len(document)).to(torch.int32)
    tree.inc_lock_ref(tree.root_node)
    running = SimpleNamespace(
        req_pool_idx=row,
        last_node=tree.root_node,
        cache_protected_len=0,
        origin_input_ids=array("q", document),
        output_ids=array("q"),
        extra_key=None,
        priority=0,
        prefix_indices=None,
        extend_range=None,
    )
    for done in (0, 4):  # two chunks, each inserted before the next is scheduled
        state.allocate_extend([row], [GRID], [done])
        running.extend_range = SimpleNamespace(end=done + GRID)
        tree.cache_unfinished_req(running, chunked=True)
        assert running.cache_protected_len == done + GRID == len(running.prefix_indices)
    assert tree.stats()["in_flight_inserts"] == 2
    assert [c[:2] for c in _cells(tree)] == [(0, 4), (4, 8)]
    assert tree.evictable_pages() == 0  # locked by the running row
    # Another client on the same document, while the first is still prefilling: it matches
    # both cells instead of prefilling them again.
    cached, chunks = run_request(tree, state, req_pool, slots, [*document, 7, 7], [3], GRID)
    assert cached == 8 and chunks == [(8, 12)]
    state.allocate_extend([row], [2], [8])  # the first client's last chunk, then its reply
    req_pool.req_to_token[row, len(document)] = int(slots.alloc(1)[0])
    running.output_ids.append(5)
    state.allocate_decode([row], [len(document) + 1])
    running.output_ids.append(9)
    tree.cache_finished_req(running, True, kv_len_to_handle=len(document) + 1)
    req_pool.free_slots.append(row)
    # [0, 4), [4, 8) once; the second client's [8, 12) and its reply [12, 13); the first
    # client's last chunk [8, 10) and its reply [10, 11), kept whole inside the cell
    assert tree.stats()["segments"] == 6
    assert state.memory.allocator.num_used() == tree.stats()["pages_held"]
    assert tree.evictable_pages() == tree.evictable_pages_scan() == tree.stats()["pages_held"]
    tree.reset()
    assert state.memory.allocator.num_free() == start_free
    state.memory.check_invariants()


def test_a_continuing_chunk_cut_by_a_full_token_pool_ends_on_the_grid(monkeypatch):
    """SGLang's ``add_chunked_req`` cuts by free tokens alone; the hook moves it to the grid."""
    from sglang.srt.managers.schedule_batch import Range
    from sglang.srt.managers.schedule_policy import PrefillAdder
    from sglang.srt.runtime_context import get_context

    from tangram_sglang.integration.sglang_adapters import align_chunked_req, grid_chunk_end

    assert grid_chunk_end(4, 10, 20, 4) == 8  # cut inside cell [8, 12): back to 8
    assert grid_chunk_end(4, 7, 20, 4) == 7  # less than one cell fits: unchanged
    assert grid_chunk_end(4, 20, 20, 4) == 20  # the prompt's end
    assert grid_chunk_end(4, 10, 20, 0) == 10  # grid off
    prompt = list(range(100, 120))
    for grid_on, expected in ((True, (4, 8)), (False, (4, 10))):
        monkeypatch.setenv(GRID_ENV, "1" if grid_on else "0")
        tree, state, req_pool, slots = build_tree(chunk_tokens=GRID)
        # the Req fields add_chunked_req reads (a real Req needs a running server's context)
        req = SimpleNamespace(
            full_untruncated_fill_ids=array("q", prompt),
            prefix_indices=torch.arange(4),  # the first cell was prefilled
            sampling_params=SimpleNamespace(max_new_tokens=4),
            retracted_stain=False,
            extend_range=Range(4, 20),
        )
        req.set_extend_range = lambda start, end, r=req: setattr(
            r, "extend_range", Range(start, end)
        )
        with get_context().override_server_args():  # the scheduler's published settings
            adder = PrefillAdder(1, tree, slots, None, 1.0, 10**6, 3 * GRID)
            adder.rem_total_token_offset = slots.available_size() - 6  # room for 6 more tokens
            truncated = adder.add_chunked_req(req)
        assert truncated is req  # SGLang cut it at 10 (or at 8 where the hook is installed)
        align_chunked_req(truncated, adder, req)  # idempotent
        assert (req.extend_range.start, req.extend_range.end) == expected


def test_cells_after_a_row_that_left_the_grid_are_not_cached(monkeypatch):
    """A continuing chunk cut short of a cell (a nearly full token pool, less than one cell
    left) leaves the row's history off the grid: its pieces ``[4, 6)``, ``[6, 8)`` are kept whole
    where a cold server compresses the cell ``[4, 8)``. The pieces are a valid tail (a prompt
    ending inside ``[4, 8)`` keeps them whole cold too), but the cells the row computes after
    them are not what a cold server computes, so they are not cached and never matched."""
    monkeypatch.setenv(GRID_ENV, "1")
    tree, state, req_pool, slots = build_tree(chunk_tokens=GRID)
    start_free = state.memory.allocator.num_free()
    prompt = list(range(40, 53))  # 13 tokens
    _, chunks = run_request(tree, state, req_pool, slots, prompt, [3], GRID, ends=[4, 6, 8])
    assert chunks == [(0, 4), (4, 6), (6, 8), (8, 12), (12, 13)]
    assert [c[:2] for c in _cells(tree)] == [(0, 4), (4, 6), (6, 8)]
    assert tree.stats()["grid_cells"] == 1
    cached, chunks = run_request(tree, state, req_pool, slots, [*prompt, 1], [3], GRID)
    assert cached == 4 and chunks == [(4, 8), (8, 12), (12, 14)]  # as a cold server cuts it
    tree.reset()
    assert state.memory.allocator.num_free() == start_free
    state.memory.check_invariants()


def test_footprint_prices_a_segment_as_admit_reserves_it(monkeypatch):
    """``TangramMemory.footprint`` / ``can_admit`` follow the grid's kept-length rule with the
    segment's start token, as ``admit`` does: a 16-token segment at token 6 is off the grid and
    kept whole, at token 16 it is a whole cell and compressed."""
    monkeypatch.setenv(GRID_ENV, "1")
    cell = 16
    _, state, _, _ = build_tree(chunk_tokens=cell)
    memory = state.memory
    for start in (6, cell):
        need = memory.footprint(cell, 1, start_token=start)
        assert memory.admit(0, "r", cell, 1, start_token=start).reserved_pages == need, start
        memory.abort(0)
    # whole: 4 + 4 pages of 4 tokens; a cell: 16 + 7 tokens (group 1 keeps 1 + 2 + ceil(13/4))
    assert memory.footprint(cell, 1, start_token=6) == 8
    assert memory.footprint(cell, 1, start_token=cell) == 6
    assert memory.can_admit(cell, 1, start_token=6)
