"""``TangramState.allocate_extend``: a batch of new rows in one pass leaves exactly the state
that row-by-row admission, allocation and commit leave (pages, holders, tables, grants, tree).
"""

from __future__ import annotations

import numpy as np
import pytest

from tangram_sglang.bench import turn_host
from tangram_sglang.mem.manager import TangramMemory


def _snapshot(world: turn_host.TurnWorld) -> list:
    """Everything a batch may change, as comparable plain values."""
    mem, state = world.state.memory, world.state
    mem.run_copies()
    mem.table.flush()
    arrays = (
        mem.allocator.free_pages.numpy(),
        mem.allocator.ref_count.numpy(),
        mem.row_refs,
        mem.page_group,
        mem.page_fill,
        mem.table.pages,
        mem.table.num_pages,
        mem.table.lens,
        mem.table.own_start,
        mem.table.page_table.numpy(),
        mem.table.group_len.numpy(),
        mem.active,
        mem.ready,
        state.logical_tokens,
    )
    grants = {
        row: (r.reserved_pages, r.used_pages, r.overflow_pages)
        for row, r in mem.ledger.by_row.items()
    }
    plans = {row: (n, s.tolist(), k.tolist()) for row, (n, s, k) in state.extend_plans.items()}
    return [
        *(a.tolist() for a in arrays),
        mem.peak_used_pages,
        mem.ledger.outstanding_pages(),
        grants,
        plans,
        world.tree.stats(),
    ]


def _play(one_pass: bool, monkeypatch, plan_rows: bool, num_pages: int, fresh=False) -> list:
    """Three rounds of four chats (``fresh``: new ones each round, the old ones left to
    evict); a snapshot after each round's extend batch and finish."""
    rng = np.random.default_rng(7)
    world = turn_host.build_world(5, 1024, num_pages)
    calls = []
    original = TangramMemory._plan_new_rows

    def plan_new_rows(self, *args):
        got = original(self, *args) if one_pass else None
        calls.append(got is not None)
        return got

    monkeypatch.setattr(TangramMemory, "_plan_new_rows", plan_new_rows)
    if plan_rows:  # as the server: each new row's prompt is recorded before its batch
        allocate = world.state.allocate_extend

        def planned(rows, extend_lens, prefix_lens, *rest):
            for row, n, p in zip(rows, extend_lens, prefix_lens, strict=True):
                world.state.plan_row(row, n + p, 0)
            return allocate(rows, extend_lens, prefix_lens, *rest)

        monkeypatch.setattr(world.state, "allocate_extend", planned)
    snapshots = []
    convs = [rng.integers(100, 30000, 300).tolist() for _ in range(4)]
    for _ in range(3):
        _, convs = turn_host.play_round(world, convs, 5, rng)
        snapshots.append(_snapshot(world))
        convs = [c + rng.integers(100, 30000, 37).tolist() for c in convs]
        if fresh:
            convs = [rng.integers(100, 30000, 300).tolist() for _ in range(4)]
    world.state.memory.check_invariants()
    assert world.tree.evictable_pages() == world.tree.evictable_pages_scan()
    return snapshots, calls


@pytest.mark.parametrize("plan_rows", [False, True], ids=["no-plan", "planned"])
def test_one_pass_batch_equals_row_by_row(monkeypatch, plan_rows):
    fast, calls = _play(True, monkeypatch, plan_rows, 20_000)
    assert all(calls)  # every batch took the one-pass path
    slow, _ = _play(False, monkeypatch, plan_rows, 20_000)
    assert fast == slow


def test_a_batch_that_must_evict_goes_row_by_row(monkeypatch):
    # a pool too small for a round of new chats on top of the cached ones: later batches evict
    fast, calls = _play(True, monkeypatch, False, 3_000, fresh=True)
    assert not all(calls)
    slow, _ = _play(False, monkeypatch, False, 3_000, fresh=True)
    assert fast == slow
