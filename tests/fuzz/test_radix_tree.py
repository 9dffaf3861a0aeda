"""Hypothesis lifecycles of the real TangramRadixCache over a real TangramState (CPU, no model).

SGLang's own ``ReqToTokenPool`` and ``TokenToKVPoolAllocator`` hold the logical token slots; the
test plays the scheduler's part (match, lock, slot allocation, finish/abort) and the backend's
(``TangramState.allocate_extend`` / ``allocate_decode``) for requests whose tokens extend earlier
conversations (so matches, forks, duplicates and node splits happen). After every step:
  - pages: used pages == the pages tree nodes hold or running rows read (none is lost; a row
    may read a page no node holds any more: an in-flight cell the tree dropped as a duplicate;
    ``TANGRAM_DEBUG``-style invariants run inside TangramMemory);
  - token slots: free + evictable + protected + slots owned by running rows == all slots
    (SGLang's idle self-check relies on this);
  - every boundary node's chain builds a PrefixMatch whose lengths match its pages;
  - a new request's cached prefix ends on a boundary node: a whole segment, or the first
    tokens of a segment kept whole (split there), never inside a compressed one;
  - the tree's running page count equals a scan (a page held by several nodes counts once).
At teardown all requests end and the tree is flushed: free pages and slots return to the start.
``GridRadixLifecycle`` plays the same under grid segmentation, with each whole cell of a chunked
prefill inserted while its row runs (in-flight nodes locked by the row).
"""

from __future__ import annotations

import os
from array import array
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from radix_world import PAGE, ROWS, SLOTS, WIDTH, build_tree
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from tangram_sglang.config import GRID_ENV
from tangram_sglang.errors import PoolError
from tangram_sglang.radix.cache import node_depth, value_of
from tangram_sglang.radix.segment import chain_prefix, is_cell_piece, is_grid_cell


@dataclass
class Running:
    req: SimpleNamespace  # the scheduler's Req fields the tree reads
    prefix_len: int  # matched tokens (tokens)
    decoded: int = 0  # decode-tail tokens written (tokens)


class RadixLifecycle(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.tree, self.state, self.req_pool, self.slots = build_tree()
        self.memory = self.state.memory
        self.start_free = self.memory.allocator.num_free()
        self.running: dict[int, Running] = {}
        self.histories: list[list[int]] = [[]]  # token ids of finished requests (KV-covered)
        self.next_rid = 0

    # ---- helpers -------------------------------------------------------------------------------
    def alloc_slots(self, n: int):
        short = n - self.slots.available_size()
        if short > 0:
            self.tree.evict(EvictParams(num_tokens=short))
        return self.slots.alloc(n)

    def end(self, row: int, insert: bool) -> None:
        run = self.running.pop(row)
        kv_len = len(run.req.origin_input_ids) + run.decoded
        self.tree.cache_finished_req(run.req, insert, kv_len_to_handle=kv_len)
        self.state.release(row)  # SGLang's ReqToTokenPool.free hook (a no-op after finish)
        self.req_pool.free_slots.append(row)
        if insert:
            self.histories.append(list((run.req.origin_input_ids + run.req.output_ids)[:kv_len]))

    # ---- rules ---------------------------------------------------------------------------------
    @precondition(lambda self: len(self.running) < ROWS)
    @rule(
        base=st.integers(0, 50),
        drop=st.integers(0, 6),
        new=st.lists(st.integers(1, 3), min_size=1, max_size=10),
    )
    def start(self, base, drop, new):
        history = self.histories[base % len(self.histories)]
        # A conversation that shares only the first tokens of an earlier one (``drop`` > 0)
        # ends its match inside a segment: kept whole, the segment is split there.
        ids = array("q", history[: max(len(history) - drop, 0)] + new)
        key = RadixKey(ids, None, limit=len(ids) - 1)
        match = self.tree.match_prefix(MatchPrefixParams(key=key))
        node, p = match.last_device_node, len(match.device_indices)
        assert node_depth(node) == p and (p == 0 or value_of(node) is not None)
        self.tree.inc_lock_ref(node)
        row, n = self.req_pool.free_slots.pop(0), len(ids) - p
        fresh = self.alloc_slots(n)
        req = SimpleNamespace(
            req_pool_idx=row,
            last_node=node,
            cache_protected_len=p,
            origin_input_ids=ids,
            output_ids=array("q"),
            extra_key=None,
            priority=0,
        )
        if fresh is None:
            self.tree.dec_lock_ref(node)
            self.req_pool.free_slots.append(row)
            return
        self.req_pool.req_to_token[row, :p] = match.device_indices.to(torch.int32)
        self.req_pool.req_to_token[row, p : p + n] = fresh.to(torch.int32)
        self.running[row] = Running(req, p)
        if p:  # the node the scheduler holds (req.last_node) names the same prefix, no slot read
            by_node, by_slot = self.tree.prefix_for(row, p, node), self.tree.prefix_for(row, p)
            assert np.array_equal(by_node.lens, by_slot.lens)
            assert all(map(np.array_equal, by_node.pages, by_slot.pages))
        try:
            self.prefill(req, n, p)
        except PoolError:  # pages short even after eviction: the request ends (abort)
            self.end(row, insert=False)

    def prefill(self, req: SimpleNamespace, n: int, p: int) -> None:
        """Extend the row by its ``n`` new tokens after a ``p``-token match (one segment)."""
        row = req.req_pool_idx
        self.state.allocate_extend([row], [n], [p])

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, ROWS), token=st.integers(1, 3))
    def decode(self, pick, token):
        row = sorted(self.running)[pick % len(self.running)]
        run = self.running[row]
        seq = len(run.req.origin_input_ids) + run.decoded
        slot = self.alloc_slots(1) if seq < WIDTH * PAGE - 1 else None
        if slot is None:
            return
        self.req_pool.req_to_token[row, seq] = int(slot[0])
        run.req.output_ids.append(token)
        try:
            self.state.allocate_decode([row], [seq + 1])
        except PoolError:  # out of pages: retract (abort) the request
            run.req.output_ids.pop()
            self.slots.free(slot)
            self.end(row, insert=False)
            return
        run.decoded += 1

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, ROWS), insert=st.booleans(), last=st.integers(1, 3))
    def finish(self, pick, insert, last):
        row = sorted(self.running)[pick % len(self.running)]
        self.running[row].req.output_ids.append(last)  # the last sampled token: no KV
        self.end(row, insert)

    @precondition(lambda self: self.running)
    @rule(
        picks=st.lists(st.integers(0, ROWS), min_size=1, max_size=ROWS),
        insert=st.booleans(),
        evict=st.sampled_from(["none", "pages", "tokens"]),
    )
    def finish_step(self, picks, insert, evict):
        """Several requests finish in one result step (``deferred_finishes``): each keeps
        its pages until the step closes, unless an eviction inside it (of pages, or SGLang's
        of token slots) inserts them first."""
        rows = sorted(self.running)
        ended = list(dict.fromkeys(rows[p % len(rows)] for p in picks))
        with self.tree.deferred_finishes():
            for row in ended:
                self.running[row].req.output_ids.append(1)  # the last sampled token: no KV
                self.end(row, insert)
            if insert:
                assert len(self.tree._pending) == len(ended)
                assert all(self.memory.rids[row] is not None for row in ended)
            if evict == "pages":
                self.tree.evict_pages(1)
            elif evict == "tokens":
                self.tree.evict(EvictParams(num_tokens=1))
            if evict != "none":
                assert not self.tree._pending
        assert not self.tree._pending and not self.state.finishing_rows

    @rule(num_pages=st.integers(1, 24))
    def evict_pages(self, num_pages):
        evictable = self.tree.evictable_pages()
        freed = self.tree.evict_pages(num_pages)
        assert freed >= min(num_pages, evictable) or not self.tree.evictable_leaves

    @rule(num_tokens=st.integers(1, 30))
    def evict_tokens(self, num_tokens):
        self.tree.evict(EvictParams(num_tokens=num_tokens))

    @precondition(lambda self: not self.running)
    @rule()
    def flush(self):
        self.tree.reset()
        self.slots.clear()
        assert self.memory.allocator.num_free() == self.start_free

    # ---- invariants ----------------------------------------------------------------------------
    @invariant()
    def every_used_page_has_a_holder(self):
        """Used pages are exactly those a tree node holds or a running row reads: a row's own
        pages, its matched prefix, and cells it hung on the tree in flight that the tree then
        dropped as duplicates (the row keeps its reference until it ends)."""
        used = self.memory.allocator.num_usable_pages - self.memory.allocator.num_free()
        held = set()
        for node in self.tree._boundaries.values():
            for ids in value_of(node).segment.pages:
                held.update(ids.tolist())
        assert len(held) == self.tree.stats()["pages_held"]
        read = set()
        for row in self.running:
            for g in range(self.memory.num_head_groups):
                read.update(self.memory.group_pages(row, g).tolist())
        owned = set()
        for row in self.running:  # a row's own pages are no node's and no other row's
            own = set(self.memory._entries(row, own=True).tolist())
            assert len(own) == self.memory.row_usage(row).own_pages
            assert not own & held and not own & owned
            owned |= own
        assert used == len(held | read)
        scan = sum(value_of(n).num_pages for n in self.tree._boundaries.values())
        assert self.tree.held_pages == scan  # the running count, each shared page once

    @invariant()
    def evictable_pages_kept_up_to_date(self):
        """The O(path) count equals a scan of the tree, with and without an excluded path."""
        assert self.tree.evictable_pages() == self.tree.evictable_pages_scan()
        for node in list(self.tree._boundaries.values())[:4]:
            assert self.tree.evictable_pages(node) == self.tree.evictable_pages_scan(node)

    @invariant()
    def token_slots_add_up(self):
        own = sum(
            len(r.req.origin_input_ids) - r.req.cache_protected_len + r.decoded
            for r in self.running.values()
        )
        total = (
            self.slots.available_size()
            + self.tree.evictable_size()
            + self.tree.protected_size()
            + own
        )
        assert total == SLOTS

    @invariant()
    def chains_build(self):
        for node in self.tree._boundaries.values():
            chain = []
            while node is not self.tree.root_node:
                chain.append(value_of(node))
                node = value_of(node).start_node
            match = chain_prefix(chain[::-1], self.memory.num_head_groups, PAGE)
            assert np.array_equal(match.lens, chain[0].group_lens)

    def teardown(self):
        for row in list(self.running):
            self.end(row, insert=False)
        self.tree.reset()
        assert self.memory.allocator.num_free() == self.start_free
        assert self.memory.stats().reserved_pages == 0
        self.memory.check_invariants()


class GridRadixLifecycle(RadixLifecycle):
    """The same lifecycle under grid segmentation (``TANGRAM_GRID_SEGMENTS=1``, grid 4).

    Prompts are prefilled in grid chunks and each whole cell is inserted while the row runs
    (``cache_unfinished_req``), so evictions, aborts and decodes also meet in-flight nodes.
    """

    def __init__(self):
        super().__init__()
        old = os.environ.get(GRID_ENV)
        os.environ[GRID_ENV] = "1"
        try:
            self.tree, self.state, self.req_pool, self.slots = build_tree(chunk_tokens=GRID)
        finally:
            if old is None:
                os.environ.pop(GRID_ENV)
            else:
                os.environ[GRID_ENV] = old
        self.memory = self.state.memory
        self.start_free = self.memory.allocator.num_free()
        assert self.tree.grid == GRID

    @invariant()
    def chains_are_cells_then_whole_pieces(self):
        """Every chain is whole cells from the root, then pieces kept whole inside one cell:
        what a cold server keeps for the same tokens."""
        for node in self.tree._boundaries.values():
            value = value_of(node)
            lo, hi, seg = value.start_depth, value.end_depth, value.segment
            parent = value_of(value.start_node)  # None: the root
            after_cell = parent is None or is_grid_cell(
                parent.segment.kind, parent.start_depth, parent.end_depth, GRID
            )
            if is_grid_cell(seg.kind, lo, hi, GRID):
                assert after_cell, (lo, hi)
            else:
                assert is_cell_piece(seg, lo, hi, GRID), (lo, hi, seg.kept_len)
                assert after_cell or parent.start_depth // GRID == lo // GRID, (lo, hi)

    def prefill(self, req: SimpleNamespace, n: int, p: int) -> None:
        # A match ends on the grid, or inside a cell the prompt ends in (its tail kept whole).
        assert p % GRID == 0 or p + n < (p // GRID + 1) * GRID, (p, n)
        row, done = req.req_pool_idx, p
        while done < p + n:
            step = min(GRID - done % GRID, p + n - done)
            self.state.allocate_extend([row], [step], [done])
            done += step
            if done < p + n:  # SGLang stashes a chunked request before its next chunk
                req.extend_range = SimpleNamespace(end=done)
                self.tree.cache_unfinished_req(req, chunked=True)


GRID = 4  # tokens per grid cell (= chunk size) of GridRadixLifecycle

for machine in (RadixLifecycle, GridRadixLifecycle):
    machine.TestCase.settings = settings(
        max_examples=40,
        stateful_step_count=30,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
TestRadixLifecycle = RadixLifecycle.TestCase
TestGridRadixLifecycle = GridRadixLifecycle.TestCase
