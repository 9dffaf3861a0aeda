"""Hypothesis lifecycles: ``TangramMemory.admit_extend_new`` against the row-by-row calls.

``TangramState.allocate_extend`` admits a batch of new rows in one pass when the row-by-row
path (``admit``, ``alloc_extend``, ``commit_extend`` per row) could neither fail, evict nor
wait. Two copies of one random world play the same operations, one through the batch path
(falling back row by row where it declines) and one row by row only; after every operation the
whole state must be equal: the free ring and its head, holder counts, ``row_refs``, page groups
and fills, host and device page tables, open segments, grants, and the K/V contents after the
staged copy-on-write copies ran. The worlds cover what the tree-level test
(``tests/unit/test_allocate_batch.py``) does not: two rows of one batch borrowing one partial
page, zero-length segments, repeated or busy rows, negative inputs, nearly full pools, the
segment grid, decode copies, aborts and finishes between batches. A declined batch must leave
the state as it found it, and the batch path must never raise.
"""

from __future__ import annotations

import numpy as np
import torch
from factories import make_profile
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tangram_sglang.errors import PoolError
from tangram_sglang.mem.kv_pool import KVPool
from tangram_sglang.mem.manager import TangramMemory
from tangram_sglang.mem.prefix import PrefixMatch

PAGE = 4
RATIOS = [[1.0, 0.5, 0.25, 0.3, 0.7, 1.0]]  # 6 KV heads, 2 per group: 3 head groups
ROWS = 6


def _memory(num_pages: int, width: int, seed: int, grid: int) -> TangramMemory:
    """A non-debug memory with deferred uploads and copies, as the server runs it."""
    profile = make_profile(RATIOS, 2, "global", sink_tokens=1, recent_window=1, head_dim=1)
    profile = profile.with_min_compress_tokens(3)
    pool = KVPool.create(num_pages, 2, PAGE, 1, torch.float32)
    gen = torch.Generator().manual_seed(seed)
    pool.k_pool.copy_(torch.rand(pool.k_pool.shape, generator=gen))
    pool.v_pool.copy_(torch.rand(pool.v_pool.shape, generator=gen))
    memory = TangramMemory(profile, PAGE, num_pages, ROWS, width, pool, debug=False)
    memory.table.deferred = True
    memory.defer_copies = True
    memory.segment_grid = grid
    return memory


def _state(memory: TangramMemory) -> dict:
    """Everything an admission, allocation or copy may change, as plain values."""
    memory.run_copies()
    memory.table.flush()
    t, a = memory.table, memory.allocator
    segments = [
        [
            (
                s.kind,
                s.num_tokens,
                s.start_len.tolist(),
                None if s.kept_len is None else s.kept_len.tolist(),
                s.first_page_index.tolist(),
            )
            for s in t.segments[row]
        ]
        for row in range(t.max_rows)
    ]
    pending = [
        None if p is None else (p.start_len.tolist(), p.kept_len.tolist()) for p in memory.pending
    ]
    return {
        "free": a.free_pages.tolist(),
        "head": a.head,
        "ref_count": a.ref_count.tolist(),
        "row_refs": memory.row_refs.tolist(),
        "page_group": memory.page_group.tolist(),
        "page_fill": memory.page_fill.tolist(),
        "peak": memory.peak_used_pages,
        "rids": list(memory.rids),
        "active": memory.active.tolist(),
        "ready": memory.ready.tolist(),
        "pending": pending,
        "pages": t.pages.tolist(),
        "num_pages": t.num_pages.tolist(),
        "lens": t.lens.tolist(),
        "own_start": t.own_start.tolist(),
        "in_tail": t.in_tail.tolist(),
        "tail_tokens": t.tail_tokens.tolist(),
        "segments": segments,
        "page_table": t.page_table.tolist(),
        "group_len": t.group_len.tolist(),
        "grants": [
            (row, g.rid, g.reserved_pages, g.used_pages, g.overflow_pages)
            for row, g in memory.ledger.by_row.items()
        ],
        "outstanding": memory.ledger.outstanding_pages(),
        "k": memory.kv_pool.k_pool.flatten().tolist(),
        "v": memory.kv_pool.v_pool.flatten().tolist(),
    }


def _changed(a: dict, b: dict) -> list[str]:
    return [key for key in a if a[key] != b[key]]


class World:
    """A memory plus the tree's part: prefixes whose pages an outside holder keeps."""

    def __init__(self, spec: dict) -> None:
        self.memory = _memory(spec["num_pages"], spec["width"], spec["seed"], spec["grid"])
        self.prefixes: list[PrefixMatch] = []
        memory = self.memory
        for lens in spec["prefix_lens"]:
            lens = np.asarray(lens, np.int64)[: memory.num_head_groups]
            pages = []
            for g in range(memory.num_head_groups):
                got = memory.allocator.alloc(-(-int(lens[g]) // PAGE))
                if got is None:
                    return
                ids = got.numpy().astype(np.int64)
                memory.page_group[ids] = g
                pages.append(ids)
            self.prefixes.append(PrefixMatch(pages=pages, lens=lens))

    def prefix(self, k: int | None) -> PrefixMatch | None:
        if k is None or not self.prefixes:
            return None
        return self.prefixes[k % len(self.prefixes)]


def _row_by_row(memory, rows, rids, lens, starts, prefixes, later) -> None:
    """What ``TangramState.allocate_extend`` does for new rows when the batch path declines."""
    for row, rid, n, start, prefix, tail in zip(
        rows, rids, lens, starts, prefixes, later, strict=True
    ):
        if (
            memory.admit(row, rid, n, 0, prefix=prefix, decode_tokens=tail, start_token=start)
            is None
        ):
            raise PoolError("does not fit")
        memory.alloc_extend(row, n, start_token=start)
        memory.commit_extend(row)


def _extend_batch(world: World, batch: tuple, use_batch: bool) -> tuple:
    memory = world.memory
    rows, lens, starts, prefix_ids, later = batch
    prefixes = [world.prefix(k) for k in prefix_ids]
    rids = [f"row{row}" for row in rows]
    if use_batch:
        before = _state(memory)
        got = memory.admit_extend_new(rows, rids, lens, starts, prefixes, later)
        if got is not None:
            return ("ok",)
        assert not _changed(before, _state(memory)), "a declined batch changed the state"
    try:
        _row_by_row(memory, rows, rids, lens, starts, prefixes, later)
    except (PoolError, ValueError, IndexError) as exc:
        return (type(exc).__name__, str(exc))
    return ("ok",)


def _play(world: World, ops: list, use_batch: bool) -> list:
    memory, out = world.memory, []
    for op in ops:
        running = [i for i, rid in enumerate(memory.rids) if rid is not None]
        settled = [i for i in running if memory.pending[i] is None]
        if op[0] == "batch":
            out.append(_extend_batch(world, op[1], use_batch))
        elif op[0] == "abort" and running:
            memory.abort(running[op[1] % len(running)])
        elif op[0] == "decode" and settled:
            try:
                memory.alloc_decode(np.array(settled, np.int64))
            except PoolError as exc:
                out.append(("decode", str(exc)))
        elif op[0] == "finish" and settled:
            segments = memory.finish(settled[op[1] % len(settled)])
            ids = [p for s in segments for p in s.pages if p.size]
            if ids:
                memory.free_pages(np.concatenate(ids))  # the tree evicts them at once
        out.append(_state(memory))
    memory.check_invariants()
    return out


def _batch(rows_st, value_min: int) -> st.SearchStrategy:
    return st.tuples(
        rows_st,
        st.lists(st.integers(value_min, 22), min_size=5, max_size=5),  # extend lengths
        st.lists(st.integers(value_min, 40), min_size=5, max_size=5),  # start tokens
        st.lists(st.one_of(st.none(), st.integers(0, 5)), min_size=5, max_size=5),  # prefix
        st.lists(st.integers(0, 9), min_size=5, max_size=5),  # decode tokens reserved
    ).map(lambda b: (b[0], *(values[: len(b[0])] for values in b[1:])))


_any_batch = _batch(st.lists(st.integers(0, ROWS - 1), max_size=5), -1)
_good_batch = _batch(st.lists(st.integers(0, ROWS - 1), min_size=1, max_size=5, unique=True), 0)
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("batch"), _any_batch),
        st.tuples(st.just("batch"), _good_batch),
        st.tuples(st.just("batch"), _good_batch),
        st.tuples(st.just("abort"), st.integers(0, 10)),
        st.tuples(st.just("decode")),
        st.tuples(st.just("finish"), st.integers(0, 10)),
    ),
    min_size=1,
    max_size=12,
)
_worlds = st.fixed_dictionaries(
    {
        "num_pages": st.integers(8, 120),
        "width": st.integers(3, 16),
        "seed": st.integers(0, 3),
        "grid": st.sampled_from([0, 0, 8]),
        "prefix_lens": st.lists(st.lists(st.integers(0, 14), min_size=3, max_size=3), max_size=4),
    }
)


@settings(
    max_examples=300,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(spec=_worlds, ops=_ops)
def test_batch_path_leaves_the_row_by_row_state(spec: dict, ops: list) -> None:
    batched = _play(World(spec), ops, use_batch=True)
    row_by_row = _play(World(spec), ops, use_batch=False)
    for i, (a, b) in enumerate(zip(batched, row_by_row, strict=True)):
        if isinstance(a, dict):
            assert not _changed(a, b), (i, _changed(a, b), ops)
        else:
            assert a == b, (i, a, b, ops)
