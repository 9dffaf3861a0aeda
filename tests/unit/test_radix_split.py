"""A segment kept whole is shared to the token: a match that ends inside it splits it.

On the real tree + state + SGLang slot pools of ``radix_world`` (segments under 16 tokens kept
whole, as ``--tangram-min-compress-tokens`` does for a system prompt): a second conversation
that shares the first 6 of another's 10 prompt tokens matches those 6, its prefix is the first
pages of the other's segment (no copy), the pool holds one copy, and every page returns once
both are evicted. A compressed segment is never split (its first tokens' kept set depends on the
tokens after them).
"""

from __future__ import annotations

import numpy as np
import torch
from radix_world import PAGE, build_tree, run_request

from tangram_sglang.radix.cache import SLOT_ATTR, value_of

SYSTEM = [40, 41, 42, 43, 44, 45]  # the shared first tokens


def test_a_whole_segment_is_split_where_a_second_conversation_leaves_it():
    tree, state, req_pool, slots = build_tree(min_compress_tokens=16)
    start_free = state.memory.allocator.num_free()
    run_request(tree, state, req_pool, slots, [*SYSTEM, 1, 2, 3, 4], [5, 6], chunk=16)
    held = tree.stats()["pages_held"]
    (first,) = [value_of(n) for n in tree._boundaries.values() if value_of(n).start_depth == 0]
    cached, _ = run_request(tree, state, req_pool, slots, [*SYSTEM, 7, 7, 7], [5], chunk=16)
    assert cached == len(SYSTEM) and tree.stats()["whole_segments_split"] == 1
    split = next(value_of(n) for n in tree._boundaries.values() if value_of(n).end_depth == 6)
    assert split.start_node is tree.root_node and np.all(split.group_lens == 6)
    for g, ids in enumerate(split.segment.pages):  # the first pages of the longer segment
        assert np.array_equal(ids, first.segment.pages[g][: -(-6 // PAGE)])
    stats = tree.stats()
    assert state.memory.allocator.num_used() == stats["pages_held"]  # one copy in the pool
    assert stats["pages_held"] > held  # plus the second conversation's own pages only
    assert tree.evictable_pages() == tree.evictable_pages_scan()
    tree.evict_pages(10**6)
    assert tree.stats()["pages_held"] == 0
    assert state.memory.allocator.num_free() == start_free
    state.memory.check_invariants()


def test_a_compressed_segment_is_not_split():
    tree, state, req_pool, slots = build_tree(min_compress_tokens=0)
    run_request(tree, state, req_pool, slots, [*SYSTEM, 1, 2, 3, 4], [5], chunk=16)
    cached, _ = run_request(tree, state, req_pool, slots, [*SYSTEM, 7, 7, 7], [5], chunk=16)
    assert cached == 0 and tree.stats()["whole_segments_split"] == 0
    tree.reset()
    assert torch.all(torch.as_tensor(state.memory.allocator.ref_count[1:]) == 0)


def test_inserts_read_no_slot_and_the_slot_fallback_finds_the_node():
    """Attaching and splitting segments reads no KV slot from the device (they run while the
    next batch is in flight); ``prefix_for`` without a node reads the slots once, on demand."""
    tree, state, req_pool, slots = build_tree(min_compress_tokens=16)
    run_request(tree, state, req_pool, slots, [*SYSTEM, 1, 2, 3, 4], [5, 6], chunk=16)
    run_request(tree, state, req_pool, slots, [*SYSTEM, 7, 7, 7], [5], chunk=16)
    nodes = list(tree._boundaries.values())
    assert len(nodes) >= 3 and all(getattr(n, SLOT_ATTR, None) is None for n in nodes)
    split = next(n for n in nodes if value_of(n).end_depth == len(SYSTEM))
    row = req_pool.free_slots[0]
    req_pool.req_to_token[row, : len(SYSTEM)] = torch.cat([n.value for n in path_to(split)])
    by_slot, by_node = tree.prefix_for(row, len(SYSTEM)), tree.prefix_for(row, len(SYSTEM), split)
    assert np.array_equal(by_slot.lens, by_node.lens)
    assert all(map(np.array_equal, by_slot.pages, by_node.pages))
    assert all(isinstance(getattr(n, SLOT_ATTR), int) for n in nodes)


def path_to(node):
    """The tree nodes from the root's child down to ``node`` (their values are its slots)."""
    path = []
    while node.parent is not None:
        path.append(node)
        node = node.parent
    return path[::-1]
