"""A small real radix world for CPU tests: ``TangramRadixCache`` over ``TangramState`` and
SGLang's own ``ReqToTokenPool`` / ``TokenToKVPoolAllocator`` (no server, nothing mocked).

Shared by ``tests/fuzz/test_radix_tree.py`` and ``tests/unit/test_radix_duplicate_chain.py``
(``tests/`` is on ``sys.path`` through the root ``conftest.py``).
"""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import torch
from factories import make_profile
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixKey

from tangram_sglang.backend.state import TangramState
from tangram_sglang.mem.kv_pool import KVPool
from tangram_sglang.mem.manager import TangramMemory
from tangram_sglang.radix.cache import TangramRadixCache

# tokens per page, pages, request rows, pages per group of a row, SGLang token slots
PAGE, NUM_PAGES, ROWS, WIDTH, SLOTS = 4, 64, 4, 16, 96
RATIOS = [[1.0, 0.5, 0.25, 0.25]]  # one layer, four KV heads -> two head groups of two


def build_tree(
    chunk_tokens: int = 0, min_compress_tokens: int = 0
) -> tuple[TangramRadixCache, TangramState, ReqToTokenPool, TokenToKVPoolAllocator]:
    """A fresh tree, its Tangram state (debug pool checks on), row pool and slot allocator.

    ``chunk_tokens``: the state's chunked-prefill size (the segment grid when
    ``TANGRAM_GRID_SEGMENTS=1`` is set in the environment); ``min_compress_tokens``: segments
    shorter than this are kept whole.
    """
    prof = make_profile(
        RATIOS, heads_per_group=2, scope="global", sink_tokens=1, recent_window=2, head_dim=1
    )
    prof = prof.with_min_compress_tokens(min_compress_tokens)
    pool = KVPool.create(NUM_PAGES, 2, PAGE, 1, torch.float32)
    memory = TangramMemory(prof, PAGE, NUM_PAGES, ROWS + 1, WIDTH, pool, debug=True)
    state = TangramState(
        memory, full_kv_bytes_per_token=32, device="cpu", chunk_tokens=chunk_tokens
    )
    req_pool = ReqToTokenPool(ROWS, WIDTH * PAGE, "cpu", False)
    req_pool.tangram_state = state
    slots = TokenToKVPoolAllocator(SLOTS, torch.float32, "cpu", None, False)
    params = CacheInitParams(
        disable=False, req_to_token_pool=req_pool, token_to_kv_pool_allocator=slots, page_size=1
    )
    return TangramRadixCache(params), state, req_pool, slots


def run_request(
    tree, state, req_pool, slots, prompt, outputs, chunk: int, ends: list[int] | None = None
) -> tuple[int, list]:
    """Play one request the way SGLang's scheduler and the backend do, on the real tree.

    Match ``prompt`` (all but its last token, as SGLang does), prefill the rest in
    ``chunk``-token chunks (or up to each of ``ends``, absolute token positions, then in
    ``chunk``-token chunks: a scheduler that cut some chunks short), decode ``outputs``, finish
    and insert. Returns the matched tokens and the chunks as ``(start, end)`` depths.
    """
    req, matched, chunks = start_request(tree, state, req_pool, slots, prompt, outputs, chunk, ends)
    finish_request(tree, state, req_pool, req, len(outputs))
    return matched, chunks


def start_request(
    tree, state, req_pool, slots, prompt, outputs, chunk: int, ends: list[int] | None = None
) -> tuple[SimpleNamespace, int, list]:
    """:func:`run_request` up to its finish: returns ``(req, matched tokens, chunks)``."""
    key = RadixKey(array("q", prompt), None, limit=len(prompt) - 1)  # as SGLang's key
    match = tree.match_prefix(MatchPrefixParams(key=key))
    node, done = match.last_device_node, len(match.device_indices)
    row = req_pool.free_slots.pop(0)
    req_pool.req_to_token[row, :done] = match.device_indices.to(torch.int32)
    req_pool.req_to_token[row, done : len(prompt)] = slots.alloc(len(prompt) - done).to(torch.int32)
    tree.inc_lock_ref(node)
    state.host_prefix_nodes = {row: node}
    chunks = []
    while done < len(prompt):
        n = min(chunk, len(prompt) - done)  # SGLang's chunks
        later = [e for e in ends or () if e > done]
        n = min(later[0], len(prompt)) - done if later else n
        state.allocate_extend([row], [n], [done])
        chunks.append((done, done + n))
        done += n
    req = SimpleNamespace(
        req_pool_idx=row,
        last_node=node,
        cache_protected_len=len(match.device_indices),
        origin_input_ids=array("q", prompt),
        output_ids=array("q"),
        extra_key=None,
        priority=0,
    )
    for token in outputs:
        seq = len(prompt) + len(req.output_ids)
        req_pool.req_to_token[row, seq] = int(slots.alloc(1)[0])
        req.output_ids.append(token)
        state.allocate_decode([row], [seq + 1])
    return req, len(match.device_indices), chunks


def finish_request(tree, state, req_pool, req: SimpleNamespace, num_outputs: int) -> None:
    """SGLang's ``release_kv_cache`` of a request :func:`start_request` ran: the tree's
    ``cache_finished_req``, then ``ReqToTokenPool.free`` (its Tangram hook first)."""
    row = req.req_pool_idx
    req.output_ids.append(9)  # the last sampled token (no KV)
    tree.cache_finished_req(req, True, kv_len_to_handle=len(req.origin_input_ids) + num_outputs)
    state.release(row)  # the ReqToTokenPool.free hook (release_tangram_row)
    req_pool.free_slots.append(row)
