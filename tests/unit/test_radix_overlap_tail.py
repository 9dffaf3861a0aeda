"""A reply is cached when SGLang allocated one more decode step than the request committed.

Under overlap scheduling the scheduler prepares decode step N+1 (``alloc_for_decode``: Tangram
allocates its pages and advances the tail) before it reads step N's result and sees the request
finish; ``cache_finished_req`` then gets ``kv_len_to_handle`` (SGLang's
``effective_kv_committed_len``) one token short of the row's tail. On the real tree + state +
SGLang slot pools of ``radix_world``: the next turn must match the prompt AND the reply, the
over-allocated token's pages go back to the pool, and every page returns once evicted.
"""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import torch
from radix_world import build_tree
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey

PROMPT = list(range(100, 124))  # 24 tokens: compressed
REPLY = [7, 8, 11, 12, 13]  # decode tail (kept whole)


def _finish_after_an_extra_decode_step(tree, state, req_pool, slots, extra: bool) -> None:
    row = req_pool.free_slots.pop(0)
    req_pool.req_to_token[row, : len(PROMPT)] = slots.alloc(len(PROMPT)).to(torch.int32)
    tree.inc_lock_ref(tree.root_node)
    state.host_prefix_nodes = {row: tree.root_node}
    state.allocate_extend([row], [len(PROMPT)], [0])
    req = SimpleNamespace(
        req_pool_idx=row,
        last_node=tree.root_node,
        cache_protected_len=0,
        origin_input_ids=array("q", PROMPT),
        output_ids=array("q"),
        extra_key=None,
        priority=0,
    )
    for token in REPLY:
        seq = len(PROMPT) + len(req.output_ids)
        req_pool.req_to_token[row, seq] = int(slots.alloc(1)[0])
        req.output_ids.append(token)
        state.allocate_decode([row], [seq + 1])
    req.output_ids.append(9)  # the last sampled token: the request ends with it
    if extra:  # overlap: step N+1 (the KV of token 9) was scheduled before the finish was seen
        seq = len(PROMPT) + len(REPLY)
        req_pool.req_to_token[row, seq] = int(slots.alloc(1)[0])
        state.allocate_decode([row], [seq + 1])
    tree.cache_finished_req(req, True, kv_len_to_handle=len(PROMPT) + len(REPLY))
    req_pool.free_slots.append(row)


def test_the_reply_is_cached_when_the_next_step_was_already_allocated():
    held = {}
    for extra in (False, True):
        tree, state, req_pool, slots = build_tree()
        start_free = state.memory.allocator.num_free()
        _finish_after_an_extra_decode_step(tree, state, req_pool, slots, extra)
        key = RadixKey(array("q", [*PROMPT, *REPLY, 50, 51]), None)
        matched = len(tree.match_prefix(MatchPrefixParams(key=key)).device_indices)
        assert matched == len(PROMPT) + len(REPLY), f"extra step {extra}: matched {matched}"
        held[extra] = tree.stats()["pages_held"]
        assert state.memory.allocator.num_used() == held[extra]  # nothing left outside the tree
        tree.evict_pages(10**6)
        assert state.memory.allocator.num_free() == start_free
        state.memory.check_invariants()
    assert held[True] == held[False]  # the extra token's pages went back to the pool
