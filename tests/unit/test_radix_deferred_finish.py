"""Finished requests inserted after their result step (``TangramRadixCache.deferred_finishes``).

The scheduler runs each result step inside the scope (an AROUND hook on
``Scheduler.process_batch_result``), so a finished turn's answer is streamed before the tree
work. These tests play the step on the real tree, state and SGLang pools (``radix_world``):
the records keep their rows' pages until the scope closes, anything that reads the tree or
the pool inserts them first, and the tree ends exactly as if each request had been inserted
at once.
"""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import numpy as np
import pytest
from radix_world import build_tree, finish_request, start_request
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from tangram_sglang.errors import PoolError
from tangram_sglang.integration.sglang_adapters import defer_finishes, plan_rows

CHUNK = 8
FIRST = [list(range(10, 22)), list(range(40, 50))]  # two conversations' first prompts
OUT = [5, 6, 7]


def _world_state(world) -> tuple:
    """What a later request sees: tree stats, free pages, free and evictable token slots."""
    tree, state, req_pool, slots = world
    stats = tree.stats()
    stats.pop("deferred_finishes")
    return (
        stats,
        state.memory.allocator.num_free(),
        slots.available_size(),
        int(tree.evictable_size_),
        int(tree.protected_size_),
    )


def _two_turns(world, deferred: bool) -> list[int]:
    """Both conversations' first turns finish in one step; then each sends a second turn.

    Returns the tokens each second turn matched.
    """
    tree, state, req_pool, slots = world
    reqs = [start_request(*world, prompt, OUT, CHUNK)[0] for prompt in FIRST]
    if deferred:
        with tree.deferred_finishes():
            for req in reqs:
                finish_request(tree, state, req_pool, req, len(OUT))
    else:
        for req in reqs:
            finish_request(tree, state, req_pool, req, len(OUT))
    matched = []
    for prompt in FIRST:
        second = prompt + OUT + [90, 91, 92, 93, 94]
        req, hit, _ = start_request(*world, second, [3], CHUNK)
        finish_request(tree, state, req_pool, req, 1)
        matched.append(hit)
    return matched


def test_deferred_finishes_leave_the_tree_as_immediate_ones():
    at_once, deferred = build_tree(), build_tree()
    assert _two_turns(at_once, False) == _two_turns(deferred, True)
    assert _world_state(at_once) == _world_state(deferred)
    assert deferred[0].stats()["deferred_finishes"] == len(FIRST)
    assert at_once[0].stats()["deferred_finishes"] == 0


def test_a_recorded_row_keeps_its_pages_until_the_scope_closes():
    tree, state, req_pool, slots = world = build_tree()
    req = start_request(*world, FIRST[0], OUT, CHUNK)[0]
    row, free_before = req.req_pool_idx, state.memory.allocator.num_free()
    with tree.deferred_finishes():
        finish_request(tree, state, req_pool, req, len(OUT))
        # SGLang's ReqToTokenPool.free hook ran (state.release): the row is still held
        assert state.memory.rids[row] is not None and row in state.finishing_rows
        assert state.memory.allocator.num_free() == free_before
        assert tree.held_pages == 0
    assert state.memory.rids[row] is None and not state.finishing_rows
    assert tree.held_pages > 0  # the row's pages passed to the tree
    assert state.memory.allocator.num_free() == free_before  # passed, not freed


def test_a_match_inside_the_scope_sees_the_finished_request():
    tree, state, req_pool, slots = world = build_tree()
    req = start_request(*world, FIRST[0], OUT, CHUNK)[0]
    with tree.deferred_finishes():
        finish_request(tree, state, req_pool, req, len(OUT))
        second = array("q", FIRST[0] + OUT + [90, 91])
        key = RadixKey(second, None, limit=len(second) - 1)
        match = tree.match_prefix(MatchPrefixParams(key=key))
        assert len(match.device_indices) > 0  # the record was inserted before the match
        assert not tree._pending


def test_a_new_request_on_the_recorded_row_inserts_the_record_first():
    """The row returns to SGLang's free list at once; ``plan_rows`` (the
    ``ReqToTokenPool.alloc`` hook) inserts the record before planning the row again."""
    tree, state, req_pool, slots = world = build_tree()
    req = start_request(*world, FIRST[0], OUT, CHUNK)[0]
    row = req.req_pool_idx
    with tree.deferred_finishes():
        finish_request(tree, state, req_pool, req, len(OUT))
        assert row in req_pool.free_slots
        new = type(req)(req_pool_idx=row, origin_input_ids=[1, 2, 3], output_ids=[])
        plan_rows(req_pool, [new])
        assert not tree._pending and row not in state.finishing_rows
        assert row in state.plans  # planned for the new request
    assert tree.held_pages > 0


def test_an_abort_inside_the_scope_inserts_earlier_records_first():
    tree, state, req_pool, slots = world = build_tree()
    done = start_request(*world, FIRST[0], OUT, CHUNK)[0]
    aborted = start_request(*world, FIRST[1], OUT, CHUNK)[0]
    with tree.deferred_finishes():
        finish_request(tree, state, req_pool, done, len(OUT))
        assert tree._pending
        aborted.output_ids.append(9)
        tree.cache_finished_req(aborted, False, kv_len_to_handle=len(FIRST[1]) + len(OUT))
        assert not tree._pending  # the finished one went in first, in SGLang's order
        assert state.memory.rids[aborted.req_pool_idx] is None
        req_pool.free_slots.append(aborted.req_pool_idx)


def test_the_scope_inserts_its_records_when_the_step_raises():
    tree, state, req_pool, slots = world = build_tree()
    req = start_request(*world, FIRST[0], OUT, CHUNK)[0]
    with pytest.raises(RuntimeError, match="step failed"), tree.deferred_finishes():
        finish_request(tree, state, req_pool, req, len(OUT))
        raise RuntimeError("step failed")
    assert not tree._pending and tree.held_pages > 0


def test_nested_scopes_insert_when_the_outermost_closes():
    tree, state, req_pool, slots = world = build_tree()
    req = start_request(*world, FIRST[0], OUT, CHUNK)[0]
    with tree.deferred_finishes():
        with tree.deferred_finishes():
            finish_request(tree, state, req_pool, req, len(OUT))
        assert len(tree._pending) == 1
    assert not tree._pending


def test_the_result_step_hook_runs_the_step_inside_the_scope():
    """``defer_finishes`` (the AROUND body on ``Scheduler.process_batch_result``) opens the
    scope on the scheduler's tree; a tree without one runs the step as it is."""
    world = build_tree()
    tree, state, req_pool, _ = world
    req = start_request(*world, FIRST[0], OUT, CHUNK)[0]
    seen = []

    def step(scheduler, batch, result):
        finish_request(scheduler.tree_cache, state, req_pool, req, len(OUT))
        seen.append((len(scheduler.tree_cache._pending), batch, result))
        return "done"

    scheduler = type("Scheduler", (), {"tree_cache": tree})()
    assert defer_finishes(step, scheduler, "batch", result="result") == "done"
    assert seen == [(1, "batch", "result")] and not tree._pending
    plain = type("Scheduler", (), {"tree_cache": object()})()
    assert defer_finishes(lambda s, b: b, plain, 7) == 7


def test_hold_for_finish_refuses_a_free_row():
    tree, state, req_pool, slots = build_tree()
    with pytest.raises(PoolError, match="holds no request"):
        state.hold_for_finish(1)


def test_pages_in_use_match_between_immediate_and_deferred_after_eviction():
    """Evicting inside the scope inserts the records first, then evicts them like any node."""
    tree, state, req_pool, slots = world = build_tree()
    reqs = [start_request(*world, prompt, OUT, CHUNK)[0] for prompt in FIRST]
    start_free = None
    with tree.deferred_finishes():
        for req in reqs:
            finish_request(tree, state, req_pool, req, len(OUT))
        freed = tree.evict_pages(10_000)
        assert not tree._pending and freed > 0
        start_free = state.memory.allocator.num_free()
    assert tree.held_pages == 0
    assert start_free == state.memory.allocator.num_free()
    assert np.all(state.memory.row_refs == 0)


def test_a_failed_step_inserts_its_records_and_keeps_its_own_error(monkeypatch, caplog):
    """The records of a step that raised still go in; if that fails too, it is logged and
    the step's own error is the one that propagates."""
    tree, state, req_pool, slots = world = build_tree()
    reqs = [start_request(*world, prompt, OUT, CHUNK)[0] for prompt in FIRST]
    with pytest.raises(ValueError, match="the step's error"), tree.deferred_finishes():
        finish_request(tree, state, req_pool, reqs[0], len(OUT))
        monkeypatch.setattr(tree, "_finish", _raise_pool_error)
        raise ValueError("the step's error")
    assert "not inserted after a failed step" in caplog.text
    monkeypatch.undo()
    # a finish outside any scope inserts the left-over records first, in order
    finish_request(tree, state, req_pool, reqs[1], len(OUT))
    assert tree.stats()["deferred_finishes"] == 0  # the first record was dropped (failed)
    assert state.memory.rids[reqs[1].req_pool_idx] is None


def _raise_pool_error(finish):
    raise PoolError("insert failed")


def test_records_left_by_a_failed_flush_go_in_before_a_later_finish(monkeypatch):
    tree, state, req_pool, slots = world = build_tree()
    reqs = [start_request(*world, prompt, OUT, CHUNK)[0] for prompt in FIRST]
    real = tree._finish
    calls = []

    def first_fails(finish):
        calls.append(finish.row)
        if len(calls) == 1:
            raise PoolError("insert failed")
        real(finish)

    monkeypatch.setattr(tree, "_finish", first_fails)
    with pytest.raises(PoolError, match="insert failed"), tree.deferred_finishes():
        for req in reqs:
            finish_request(tree, state, req_pool, req, len(OUT))
    assert [f.row for f in tree._pending] == [reqs[1].req_pool_idx]
    third = start_request(*world, [70, 71, 72, 73, 74, 75], [1], CHUNK)[0]
    finish_request(tree, state, req_pool, third, 1)  # outside any scope: the record first
    assert calls == [reqs[0].req_pool_idx, reqs[1].req_pool_idx, third.req_pool_idx]
    assert not tree._pending and not (state.finishing_rows - {reqs[0].req_pool_idx})


def test_a_chunk_without_the_grid_leaves_the_records_recorded():
    """``cache_unfinished_req`` off the grid keeps the chunk in its row (no tree change), so a
    prefill step's finished requests stay deferred past it."""
    tree, state, req_pool, slots = world = build_tree()
    done = start_request(*world, FIRST[0], OUT, CHUNK)[0]
    running = start_request(*world, FIRST[1], [], CHUNK)[0]
    running.extend_range = SimpleNamespace(start=0, end=len(FIRST[1]))
    with tree.deferred_finishes():
        finish_request(tree, state, req_pool, done, len(OUT))
        tree.cache_unfinished_req(running, chunked=True)
        assert len(tree._pending) == 1
    assert not tree._pending


def test_a_row_whose_deferred_finish_failed_is_released_like_any_other(monkeypatch):
    """A record whose finish fails in the memory manager is dropped; its row is no longer
    held (``finishing_rows``), so releasing it frees its pages as an abort does."""
    tree, state, req_pool, slots = world = build_tree()
    free_at_start = state.memory.allocator.num_free()
    req = start_request(*world, FIRST[0], OUT, CHUNK)[0]
    row = req.req_pool_idx

    def fails(row):
        raise PoolError("finish failed")

    monkeypatch.setattr(state.memory, "finish", fails)
    with pytest.raises(PoolError, match="finish failed"), tree.deferred_finishes():
        finish_request(tree, state, req_pool, req, len(OUT))
    monkeypatch.undo()
    assert row not in state.finishing_rows and not tree._pending
    assert state.release(row) is not None  # SGLang's hook on the row's next owner frees it
    assert state.memory.allocator.num_free() == free_at_start
