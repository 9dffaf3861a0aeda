"""A small real radix world for CPU tests: ``TangramRadixCache`` over ``TangramState`` and
SGLang's own ``ReqToTokenPool`` / ``TokenToKVPoolAllocator`` (no server, nothing mocked).

Shared by ``tests/fuzz/test_radix_tree.py`` and ``tests/unit/test_radix_duplicate_chain.py``
(``tests/`` is on ``sys.path`` through the root ``conftest.py``).
"""

from __future__ import annotations

import torch
from factories import make_profile
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

from tangram_sglang.backend.state import TangramState
from tangram_sglang.mem.kv_pool import KVPool
from tangram_sglang.mem.manager import TangramMemory
from tangram_sglang.radix.cache import TangramRadixCache

# tokens per page, pages, request rows, pages per group of a row, SGLang token slots
PAGE, NUM_PAGES, ROWS, WIDTH, SLOTS = 4, 64, 4, 16, 96
RATIOS = [[1.0, 0.5, 0.25, 0.25]]  # one layer, four KV heads -> two head groups of two


def build_tree(
    chunk_tokens: int = 0,
) -> tuple[TangramRadixCache, TangramState, ReqToTokenPool, TokenToKVPoolAllocator]:
    """A fresh tree, its Tangram state (debug pool checks on), row pool and slot allocator.

    ``chunk_tokens``: the state's chunked-prefill size (the segment grid when
    ``TANGRAM_GRID_SEGMENTS=1`` is set in the environment).
    """
    prof = make_profile(
        RATIOS, heads_per_group=2, scope="global", sink_tokens=1, recent_window=2, head_dim=1
    )
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
