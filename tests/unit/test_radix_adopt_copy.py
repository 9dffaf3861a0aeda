"""A turn boundary costs no duplicate page: the parent chain adopts the child's tail copy.

Turn 2 of a chat continues turn 1's compressed history; where turn 1's last page in a head
group is partial, turn 2's row copies it (copy-on-write) and appends. When turn 2 finishes and
no one else holds the original, turn 1's node takes the copy (its first slots are turn 1's
tokens, bit for bit) and the original is freed: the tree then holds exactly
``ceil(kept / page_size)`` pages per group of the chain, as a dense row would, and both chains
still read back their own tokens. A sibling that arrives while the original is shared keeps
its own copy.
"""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import numpy as np
import torch
from radix_world import PAGE, build_tree
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from tangram_sglang.radix.cache import value_of
from tangram_sglang.radix.segment import chain_prefix


class World:
    def __init__(self):
        self.tree, self.state, self.req_pool, self.slots = build_tree()
        self.mem = self.state.memory
        self.value = 0.0

    def write(self, row: int, start, stop) -> None:
        """Distinct K values into the row's new slots (what the forward's kv write does)."""
        for g in range(self.mem.num_head_groups):
            for t in range(int(start[g]), int(stop[g])):
                self.value += 1
                page = self.mem.table.pages[row, g, t // PAGE]
                self.mem.kv_pool.k_pool[page, :, t % PAGE, 0] = self.value

    def turn(self, tokens: list[int], decode: int) -> tuple[SimpleNamespace, list]:
        """Match, prefill the rest, decode, finish; returns the request and its K per group."""
        ids = array("q", tokens)
        match = self.tree.match_prefix(MatchPrefixParams(key=RadixKey(ids, None)))
        node, p = match.last_device_node, len(match.device_indices)
        self.tree.inc_lock_ref(node)
        row, n = self.req_pool.free_slots.pop(0), len(ids) - p
        self.req_pool.req_to_token[row, :p] = match.device_indices.to(torch.int32)
        self.req_pool.req_to_token[row, p : p + n] = self.slots.alloc(n).to(torch.int32)
        self.state.allocate_extend([row], [n], [p])
        before = self.mem.table.lens[row].copy()
        self.write(row, before, self.mem.table.lens[row])
        req = SimpleNamespace(
            req_pool_idx=row,
            last_node=node,
            cache_protected_len=p,
            origin_input_ids=ids,
            output_ids=array("q"),
            extra_key=None,
            priority=0,
        )
        for i in range(decode):
            seq = len(ids) + i
            self.req_pool.req_to_token[row, seq] = int(self.slots.alloc(1)[0])
            req.output_ids.append(5)
            before = self.mem.table.lens[row].copy()
            self.state.allocate_decode([row], [seq + 1])
            self.write(row, before, self.mem.table.lens[row])
        content = self.read(row)
        req.output_ids.append(9)  # the last sampled token (no KV)
        self.tree.cache_finished_req(req, True, kv_len_to_handle=len(ids) + decode)
        self.req_pool.free_slots.append(row)
        return req, content

    def read(self, row: int) -> list[list[float]]:
        mem = self.mem
        return [
            mem.kv_pool.gather(
                torch.from_numpy(mem.group_pages(row, g)), 0, int(mem.table.lens[row, g])
            )[0].tolist()
            for g in range(mem.num_head_groups)
        ]

    def chain_content(self, node) -> list[list[float]]:
        chain = []
        while node is not self.tree.root_node:
            chain.append(value_of(node))
            node = value_of(node).start_node
        match = chain_prefix(chain[::-1], self.mem.num_head_groups, PAGE)
        return [
            self.mem.kv_pool.gather(torch.from_numpy(match.pages[g]), 0, int(match.lens[g]))[
                0
            ].tolist()
            for g in range(self.mem.num_head_groups)
        ]

    def node_of(self, tokens: list[int]):
        ids = array("q", tokens)
        return self.tree.match_prefix(MatchPrefixParams(key=RadixKey(ids, None))).last_device_node


def dense_pages(world: World) -> int:
    """Pages a tree without duplicates holds: per leaf chain, ceil(kept / page) per group."""
    leaves = [n for n in world.tree._boundaries.values() if not n.children]
    total = 0
    for leaf in leaves:
        total += int((-(-value_of(leaf).group_lens // PAGE)).sum())
    return total


def test_turn_two_tail_copy_is_adopted_and_both_chains_read_back():
    w = World()
    first = [1, 2, 3, 4, 5, 6, 7]  # 7 prompt tokens + 2 decode: partial last pages
    _, content1 = w.turn(first, 2)
    second = first + [5, 5] + [8, 8, 8]  # turn 1's KV tokens + 3 new ones
    _, content2 = w.turn(second, 1)
    assert w.tree.num_adopted_pages > 0
    used = w.mem.allocator.num_used()
    assert used == w.tree.stats()["pages_held"] == dense_pages(w)  # no duplicate page
    assert w.chain_content(w.node_of(first + [5, 5])) == content1
    assert w.chain_content(w.node_of(second + [5])) == content2
    w.tree.reset()
    assert w.mem.allocator.num_used() == 0


def test_sibling_arriving_while_the_tail_is_shared_keeps_its_own_copy():
    w = World()
    first = [1, 2, 3, 4, 5, 6, 7]
    _, content1 = w.turn(first, 2)
    _, content_a = w.turn(first + [5, 5] + [8, 8, 8], 1)
    adopted = w.tree.num_adopted_pages
    _, content_b = w.turn(first + [5, 5] + [6, 6], 1)  # a fork from turn 1
    assert w.tree.num_adopted_pages == adopted  # the tail is held by turn 1 and turn 2a
    assert w.chain_content(w.node_of(first + [5, 5])) == content1
    assert w.chain_content(w.node_of(first + [5, 5, 8, 8, 8, 5])) == content_a
    assert w.chain_content(w.node_of(first + [5, 5, 6, 6, 5])) == content_b
    used = w.mem.allocator.num_used()
    assert used == w.tree.stats()["pages_held"] == w.tree.evictable_pages()
    freed = w.tree.evict_pages(used)
    assert freed == used and w.mem.allocator.num_used() == 0
    assert np.all(w.mem.allocator.ref_count.numpy() == 0)


def test_segment_pages_lists_are_views_of_its_flat_layout():
    """``SegmentPages.pages[g]`` are views of ``flat``: a page replaced in place (as an adopted
    copy is) is what ``chain_prefix`` lays out from ``flat`` afterwards."""
    from tangram_sglang.mem.page_table import SegmentPages

    lists = [np.array([5, 6]), np.zeros(0, np.int64), np.array([9])]
    seg = SegmentPages("extend", 3, np.zeros(3, np.int64), np.array([2, 0, 1]), np.zeros(3), lists)
    assert seg.flat.tolist() == [5, 6, 9] and seg.num_pages == 3
    assert seg.group_of_page.tolist() == [0, 0, 2]
    assert seg.index_in_group.tolist() == [0, 1, 0]
    lists[0][0] = 7  # the caller's arrays are not the segment's
    assert seg.pages[0].tolist() == [5, 6]
    seg.pages[2][-1] = 11
    assert seg.flat.tolist() == [5, 6, 11]
    value = SimpleNamespace(segment=seg, start_depth=0, group_lens=np.array([PAGE + 1, 0, 1]))
    prefix = chain_prefix([value], 3, PAGE)
    assert [p.tolist() for p in prefix.pages] == [[5, 6], [], [11]]


def test_a_segment_taken_from_the_table_is_laid_out_as_one_built_from_lists():
    """``take_segments`` builds each segment from one gather (``SegmentPages.from_table``):
    the same fields as a segment built from its per-group lists, ``pages[g]`` views of
    ``flat`` as there."""
    tree, state, req_pool, slots = build_tree()
    row = req_pool.free_slots[0]
    state.plan_row(row, 30, 0)
    state.allocate_extend([row], [30], [0])
    state.allocate_decode([row], [31])
    own = state.memory.table.take_segments(row)
    assert len(own) == 2  # the extend and its decode tail
    for seg in own:
        again = type(seg)(
            seg.kind,
            seg.num_tokens,
            seg.start_len,
            seg.kept_len,
            seg.first_page_index,
            [p.copy() for p in seg.pages],
        )
        for name in ("flat", "page_counts", "group_of_page", "index_in_group"):
            assert np.array_equal(getattr(seg, name), getattr(again, name)), name
        assert seg.num_pages == again.num_pages
        assert all(np.array_equal(a, b) for a, b in zip(seg.pages, again.pages, strict=True))
        if seg.num_pages:
            g = int(seg.group_of_page[-1])
            seg.pages[g][-1] = 99
            assert seg.flat[-1] == 99  # a view, as in a segment built from lists
