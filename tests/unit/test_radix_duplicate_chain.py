"""A segment hung under a duplicate node must continue THAT node's compressed layout.

Two requests with the same prompt but different chunking (one chunked 6+6, one 12 in one go)
compress it differently (per-group kept lengths differ). When the second to finish finds the
prompt's node already cached, its own prompt pages are freed as a duplicate; its decode tail
was compressed on top of ITS layout, so hanging the tail under the other request's node would
make the chain read pages of one layout with the lengths of the other (stale slots, no error).
Equal per-group lengths are not enough either: chunkings 4 + 8 and 8 + 4 of one prompt end with
the same kept lengths but keep different tokens, so the node fingerprint is the chain (segment
boundaries), not the lengths.
"""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import numpy as np
import torch
from radix_world import PAGE, build_tree

from tangram_sglang.radix.cache import value_of
from tangram_sglang.radix.segment import chain_prefix

PROMPT = [1, 2, 3] * 4  # 12 tokens


def prefill(tree, state, req_pool, slots, chunks: list[int]) -> SimpleNamespace:
    """A request from an empty prefix, prefilled in ``chunks`` (tokens each)."""
    row = req_pool.free_slots.pop(0)
    req_pool.req_to_token[row, : len(PROMPT)] = slots.alloc(len(PROMPT)).to(torch.int32)
    tree.inc_lock_ref(tree.root_node)
    done = 0
    for n in chunks:
        state.allocate_extend([row], [n], [done])
        done += n
    return SimpleNamespace(
        req_pool_idx=row,
        last_node=tree.root_node,
        cache_protected_len=0,
        origin_input_ids=array("q", PROMPT),
        output_ids=array("q"),
        extra_key=None,
        priority=0,
    )


def decode(state, req_pool, slots, req, tokens: list[int]) -> None:
    for token in tokens:
        seq = len(req.origin_input_ids) + len(req.output_ids)
        req_pool.req_to_token[req.req_pool_idx, seq] = int(slots.alloc(1)[0])
        req.output_ids.append(token)
        state.allocate_decode([req.req_pool_idx], [seq + 1])


def finish(tree, req_pool, req, kv_len: int) -> None:
    req.output_ids.append(9)  # the last sampled token (no KV)
    tree.cache_finished_req(req, True, kv_len_to_handle=kv_len)
    req_pool.free_slots.append(req.req_pool_idx)


def chains(tree):
    for node in tree._boundaries.values():
        chain = []
        while node is not tree.root_node:
            chain.append(value_of(node))
            node = value_of(node).start_node
        yield chain[::-1]


def test_tail_under_a_differently_compressed_duplicate_is_not_cached():
    tree, state, req_pool, slots = build_tree()
    start_free = state.memory.allocator.num_free()
    chunked = prefill(tree, state, req_pool, slots, [6, 6])
    whole = prefill(tree, state, req_pool, slots, [12])
    decode(state, req_pool, slots, chunked, [2, 3, 1, 2, 3])
    finish(tree, req_pool, whole, len(PROMPT))
    finish(tree, req_pool, chunked, len(PROMPT) + 5)
    for chain in chains(tree):
        for parent, child in zip(chain, chain[1:], strict=False):
            assert np.array_equal(parent.group_lens, child.segment.start_len), (
                f"segment at depth {child.start_depth} was compressed on lengths "
                f"{child.segment.start_len.tolist()} but hangs under {parent.group_lens.tolist()}"
            )
        match = chain_prefix(chain, state.memory.num_head_groups, PAGE)
        assert np.array_equal(match.lens, chain[-1].group_lens)
    tree.reset()
    assert state.memory.allocator.num_free() == start_free
    state.memory.check_invariants()


def test_tail_under_an_identically_compressed_duplicate_is_cached():
    tree, state, req_pool, slots = build_tree()
    first = prefill(tree, state, req_pool, slots, [12])
    second = prefill(tree, state, req_pool, slots, [12])
    decode(state, req_pool, slots, second, [2, 3, 1])
    finish(tree, req_pool, first, len(PROMPT))
    finish(tree, req_pool, second, len(PROMPT) + 3)
    depths = sorted(chain[-1].end_depth for chain in chains(tree))
    assert depths == [12, 15]  # the tail continues the shared prompt node
    assert tree.num_duplicate_pages > 0


def test_tail_under_an_equally_long_but_differently_chunked_duplicate_is_not_cached():
    tree, state, req_pool, slots = build_tree()
    start_free = state.memory.allocator.num_free()
    first = prefill(tree, state, req_pool, slots, [4, 8])
    second = prefill(tree, state, req_pool, slots, [8, 4])
    decode(state, req_pool, slots, second, [2, 3, 1, 2, 3])
    finish(tree, req_pool, first, len(PROMPT))
    end_lens = next(c[-1].group_lens for c in chains(tree) if c[-1].end_depth == len(PROMPT))
    finish(tree, req_pool, second, len(PROMPT) + 5)
    # the case this test is about: both chunkings end the prompt with equal kept lengths
    kept = state.profile.group_kept_lens
    assert np.array_equal(end_lens, np.add(kept(8), kept(4)))
    layouts = {((0, 4), (4, 12)), ((0, 8), (8, 12), (12, 17))}  # each request's own chain
    for chain in chains(tree):
        depths = tuple((v.start_depth, v.end_depth) for v in chain)
        assert any(depths == layout[: len(depths)] for layout in layouts), (
            f"a chain mixes two requests' chunkings: {depths}"
        )
    boundaries = sorted(chain[-1].end_depth for chain in chains(tree))
    assert boundaries == [4, 8, 12]  # the second request's tail could not hang under node 12
    tree.reset()
    assert state.memory.allocator.num_free() == start_free
    state.memory.check_invariants()
