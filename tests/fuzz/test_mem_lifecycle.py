"""Hypothesis lifecycles of TangramMemory: admit, prefill, decode, share, finish, abort, evict.

The test plays the radix tree's part with plain records (``Node``): a finished request's pages
become a node, later requests borrow a node's chain as their prefix, eviction is leaf-first and
skips nodes that running requests lock. After every step:
  - each page's holder count == rows listing it + nodes owning it (no page has two owners
    except through the counts);
  - kept lengths never exceed pages * page_size, and every row's tokens read back in order
    through its page table (COW copies carry the shared tail);
  - a request that ran to max_new_tokens used exactly the pages it reserved;
  - a request admitted with its prompt only (the serving policy, docs/admission.md) decodes past
    its grant from unreserved free pages; when they run out ``can_decode`` says False,
    ``alloc_decode`` changes nothing, and retracting (aborting) a growing row frees its pages.
At teardown everything is finished or aborted and evicted: free pages return to the start value.
"""

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from factories import make_profile
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tangram_sglang.errors import PoolError
from tangram_sglang.mem.kv_pool import KVPool
from tangram_sglang.mem.manager import PrefixMatch, TangramMemory

PAGE, NUM_PAGES, ROWS, WIDTH = 4, 48, 4, 24
RATIOS = [[1.0, 0.7, 0.3, 0.05], [0.5, 0.5, 0.2, 0.1]]


@dataclass(eq=False)
class Node:
    table: list[np.ndarray]  # dense page list per group of the chain ending here
    tokens: list[list[float]]  # expected kept values per group (the chain's content)
    own: list[np.ndarray]  # pages this node holds
    parent: "Node | None"
    locks: int = 0
    children: int = 0


@dataclass
class Running:
    rid: str
    max_new: int
    tokens: list[list[float]]
    node: Node | None
    decoded: int = 0
    grows: bool = False  # admitted with its prompt only: the decode tail grows by pages
    detached: list[np.ndarray] = field(default_factory=list)


class Lifecycle(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        prof = make_profile(
            RATIOS, heads_per_group=2, scope="global", sink_tokens=1, recent_window=2, head_dim=1
        )
        pool = KVPool.create(NUM_PAGES, 2, PAGE, 1, torch.float64)
        self.mem = TangramMemory(prof, PAGE, NUM_PAGES, ROWS, WIDTH, pool, debug=True)
        self.groups = self.mem.num_head_groups
        self.start_free = self.mem.allocator.num_free()
        self.rows: dict[int, Running] = {}
        self.nodes: list[Node] = []
        self.counter = 0.0

    # ---- helpers --------------------------------------------------------------------------
    def write(self, row: int, g: int, positions: range) -> None:
        for t in positions:
            self.counter += 1
            page = self.mem.table.pages[row, g, t // PAGE]
            self.mem.kv_pool.k_pool[page, :, t % PAGE, 0] = self.counter
            self.rows[row].tokens[g].append(self.counter)

    def free_row(self) -> int | None:
        return next((r for r in range(ROWS) if r not in self.rows), None)

    # ---- rules ----------------------------------------------------------------------------
    @precondition(lambda self: len(self.rows) < ROWS)
    @rule(
        n=st.integers(0, 14),
        max_new=st.integers(0, 20),
        share=st.integers(-1, 5),
        grows=st.booleans(),
    )
    def admit_and_prefill(self, n, max_new, share, grows):
        row = self.free_row()
        node = self.nodes[share] if 0 <= share < len(self.nodes) else None
        prefix = None
        if node is not None:
            lens = np.array([len(t) for t in node.tokens])
            prefix = PrefixMatch([p.copy() for p in node.table], lens)
        tail = 0 if grows else None  # prompt-only reservation, or the whole T - 1 tail
        fits = self.mem.can_admit(n, max_new, prefix, decode_tokens=tail)
        res = self.mem.admit(row, f"r{row}", n, max_new, prefix, decode_tokens=tail)
        assert (res is not None) == fits
        if res is None:
            return
        if node is not None:
            node.locks += 1
        tokens = [list(t) for t in node.tokens] if node else [[] for _ in range(self.groups)]
        self.rows[row] = Running(f"r{row}", max_new, tokens, node, grows=grows)
        plan = self.mem.alloc_extend(row, n)
        for g in range(self.groups):
            start, kept = int(plan.start_len[g]), int(plan.kept_len[g])
            self.write(row, g, range(start, start + kept))
        self.mem.commit_extend(row)

    @precondition(lambda self: any(r.max_new == 0 for r in self.rows.values()))
    @rule(data=st.data(), n=st.integers(0, 9), max_new=st.integers(0, 4))
    def next_chunk(self, data, n, max_new):
        """Chunked prefill: a row admitted with max_new_tokens=0 gets another segment."""
        row = data.draw(st.sampled_from(sorted(r for r, x in self.rows.items() if x.max_new == 0)))
        if self.mem.admit_chunk(row, n, max_new) is None:
            return
        self.rows[row].max_new = max_new
        plan = self.mem.alloc_extend(row, n)
        for g in range(self.groups):
            start, kept = int(plan.start_len[g]), int(plan.kept_len[g])
            self.write(row, g, range(start, start + kept))
        self.mem.commit_extend(row)

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def decode(self, data):
        for _ in range(data.draw(st.integers(1, 16))):  # several steps: tails reach a dry pool
            rows = [r for r, run in self.rows.items() if run.decoded < run.max_new - 1]
            if not rows:
                return
            batch = data.draw(st.lists(st.sampled_from(rows), min_size=1, unique=True))
            if not self.decode_step(data, batch):
                return

    def decode_step(self, data, batch: list[int]) -> bool:
        """One decode step of ``batch``; False when the pool ran dry (a row was retracted)."""
        granted = [r for r in batch if not self.rows[r].detached and not self.rows[r].grows]
        assert self.mem.can_decode(granted)  # full reservations: their growth never fails
        if not self.mem.can_decode(batch):  # growing tails / detached rows: beyond the grant
            free_before = self.mem.allocator.free_pages.tolist()
            with pytest.raises(PoolError, match="out of pages"):
                self.mem.alloc_decode(batch)
            assert self.mem.allocator.free_pages.tolist() == free_before
            growing = [r for r in batch if self.rows[r].grows or self.rows[r].detached]
            self.retract(data.draw(st.sampled_from(growing)))  # as SGLang's retract_decode
            return False
        self.mem.alloc_decode(batch)
        for r in batch:
            self.rows[r].decoded += 1
            for g in range(self.groups):
                n = len(self.rows[r].tokens[g])
                self.counter += 1
                page = self.mem.table.pages[r, g, n // PAGE]
                self.mem.kv_pool.k_pool[page, :, n % PAGE, 0] = self.counter
                self.rows[r].tokens[g].append(self.counter)
        return True

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def finish(self, data):
        row = data.draw(st.sampled_from(sorted(self.rows)))
        run = self.rows.pop(row)
        res = self.mem.ledger.by_row[row]
        if run.decoded == max(run.max_new - 1, 0) and not run.detached and not run.grows:
            assert res.used_pages == res.reserved_pages and res.overflow_pages == 0
        table = [self.mem.group_pages(row, g) for g in range(self.groups)]
        segments = self.mem.finish(row)
        own = [
            np.concatenate([s.pages[g] for s in segments] + [np.zeros(0, np.int64)])
            for g in range(self.groups)
        ]
        own = [np.concatenate([own[g]] + [d[g] for d in run.detached]) for g in range(self.groups)]
        if run.node is not None:
            run.node.locks -= 1
            run.node.children += 1
        self.nodes.append(Node(table, run.tokens, own, run.node))

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def abort(self, data):
        self.retract(data.draw(st.sampled_from(sorted(self.rows))))

    def retract(self, row: int) -> None:
        """Abort or retract ``row``: its own pages are freed, its grant returns."""
        run = self.rows.pop(row)
        free_before = self.mem.allocator.num_free()
        own = self.mem.row_usage(row).own_pages
        self.mem.abort(row)
        assert self.mem.allocator.num_free() == free_before + own
        if run.node is not None:
            run.node.locks -= 1
        for pages in run.detached:  # detached pages were handed to us: free them
            for ids in pages:
                self.mem.free_pages(ids, owner="test")

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def detach(self, data):
        row = data.draw(st.sampled_from(sorted(self.rows)))
        segments = self.mem.detach_segments(row)
        self.rows[row].detached.append(
            [
                np.concatenate([s.pages[g] for s in segments] + [np.zeros(0, np.int64)])
                for g in range(self.groups)
            ]
        )

    @rule(data=st.data())
    def evict(self, data):
        leaves = [n for n in self.nodes if n.locks == 0 and n.children == 0]
        if not leaves:
            return
        node = data.draw(st.sampled_from(leaves))
        self.evict_node(node)

    def evict_node(self, node: Node) -> None:
        self.nodes.remove(node)
        for ids in node.own:
            self.mem.free_pages(ids[::-1].copy(), owner="node")
        if node.parent is not None:
            node.parent.children -= 1

    # ---- invariants -----------------------------------------------------------------------
    @invariant()
    def holders_match_owners(self):
        expected = np.zeros(NUM_PAGES, np.int64)
        for row, run in self.rows.items():
            for g in range(self.groups):
                np.add.at(expected, self.mem.group_pages(row, g), 1)
            for pages in run.detached:  # handed to us, we hold one reference each
                for ids in pages:
                    np.add.at(expected, ids, 1)
        for node in self.nodes:
            for ids in node.own:
                np.add.at(expected, ids, 1)
        assert (self.mem.allocator.ref_count.numpy() == expected).all()

    @invariant()
    def lengths_fit_pages_and_tokens_read_back(self):
        lens = self.mem.table.group_len.numpy()
        n_pages = (self.mem.table.page_table > 0).sum(-1).numpy()
        assert (lens <= n_pages * PAGE).all()
        for row, run in self.rows.items():
            for g in range(self.groups):
                assert lens[row, g] == len(run.tokens[g])
                k, _ = self.mem.kv_pool.gather(
                    torch.from_numpy(self.mem.group_pages(row, g)), 0, len(run.tokens[g])
                )
                assert k[:, 0].tolist() == run.tokens[g]

    def teardown(self):
        for row in list(self.rows):
            run = self.rows.pop(row)
            self.mem.abort(row)
            for pages in run.detached:
                for ids in pages:
                    self.mem.free_pages(ids, owner="test")
        while self.nodes:
            self.evict_node(next(n for n in self.nodes if n.children == 0))
        assert self.mem.allocator.num_free() == self.start_free
        assert self.mem.stats().reserved_pages == 0
        self.mem.check_invariants()


Lifecycle.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestMemLifecycle = Lifecycle.TestCase
