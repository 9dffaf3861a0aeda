"""Tiny test factories shared by every test folder: profiles, page pools, memory managers.

The one home for the builders tests need (import them: ``from factories import make_profile``;
``tests/`` is on ``sys.path`` through ``tests/conftest.py``). Sizes are small on purpose (a few
pages of a few tokens, 1-4 KV heads of dimension 8), so a test can assert exact page ids.

* :func:`make_profile`: a budget profile wrapping a given ratio matrix (no model, no calibration).
* :func:`random_profile`: a seeded profile for a given model geometry (ratios in [0.1, 0.6]).
* :func:`make_pool`, :func:`make_memory`, :func:`make_ledger`: the page pool, the memory manager
  (one layer, four KV heads: group 0 keeps everything, group 1 half) and the reservation ledger.
* :func:`ratio_one_profile`: a keep-everything profile for a real model folder (end-to-end tests
  compare it token for token with stock SGLang).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from tangram_sglang.bench.synthetic import make_profile  # the one copy (also the benchmarks')
from tangram_sglang.grouping import HeadGrouping
from tangram_sglang.mem.kv_pool import KVPool
from tangram_sglang.mem.manager import TangramMemory
from tangram_sglang.mem.page_allocator import PageAllocator
from tangram_sglang.mem.reservation import ReservationLedger
from tangram_sglang.profile import BudgetProfile, ModelIdentity

MEMORY_RATIOS = [[1.0, 1.0, 0.5, 0.5]]  # make_memory's profile: 1 layer x 4 KV heads


def random_profile(
    model: ModelIdentity,
    target: float = 0.25,
    seed: int = 0,
    heads_per_group: int | None = None,
    scorer: str = "ada-snapkv",
    sink_tokens: int = 4,
    recent_window: int = 8,
) -> BudgetProfile:
    """A seeded profile for ``model``: ratios uniform in [0.1, 0.6], ``global`` head groups.

    Args:
        model: the geometry (and identity) the profile is for.
        target: the profile's ``target_ratio`` field.
        seed: numpy seed of the ratio draw.
        heads_per_group: H_p (default: ``model.num_kv_heads``).
        scorer: the profile's scorer name.
        sink_tokens: always-kept first tokens.
        recent_window: always-kept last tokens.
    """
    ratio = np.random.default_rng(seed).uniform(0.1, 0.6, (model.num_layers, model.num_kv_heads))
    grouping = HeadGrouping.build(ratio, heads_per_group or model.num_kv_heads, "global")
    return BudgetProfile(
        model=model,
        scorer=scorer,
        target_ratio=target,
        ratio=ratio,
        sink_tokens=sink_tokens,
        recent_window=recent_window,
        grouping=grouping,
    )


def make_pool(
    num_pages: int = 16,
    page_size: int = 4,
    heads_per_group: int = 2,
    head_dim: int = 8,
    dtype: torch.dtype = torch.float32,
) -> KVPool:
    """A K/V page pool ``[num_pages, heads_per_group, page_size, head_dim]`` (page 0 = padding)."""
    return KVPool.create(num_pages, heads_per_group, page_size, head_dim, dtype)


def make_memory(
    num_pages: int = 16,
    page_size: int = 4,
    heads_per_group: int = 2,
    max_rows: int = 4,
    max_pages: int = 8,
) -> TangramMemory:
    """A memory manager over :data:`MEMORY_RATIOS` with pool checks on (``debug=True``).

    With the defaults: one layer, four KV heads, H_p = 2, so group 0 (ratio 1.0) keeps every
    token and group 1 (ratio 0.5) keeps ``ceil(n / 2)``; no sink or window; 4-token pages; 15
    usable pages; 4 request rows of at most 8 pages per group.
    """
    prof = make_profile(MEMORY_RATIOS, heads_per_group, "per_layer")
    pool = make_pool(num_pages, page_size, heads_per_group)
    return TangramMemory(prof, page_size, num_pages, max_rows, max_pages, pool, debug=True)


def make_ledger(num_pages: int = 16) -> ReservationLedger:
    """A reservation ledger over a fresh page allocator of ``num_pages`` (checks on)."""
    return ReservationLedger(PageAllocator(num_pages, debug=True))


def ratio_one_profile(path: Path | str, model_path: Path | str) -> str:
    """Save a profile keeping every token (ratio 1.0, H_p 4, global groups) for ``model_path``'s
    geometry at ``path``; returns the path as a string."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    model = ModelIdentity.from_hf_config(config)
    ratio = np.ones((model.num_layers, model.num_kv_heads))
    BudgetProfile(
        model=model,
        scorer="ada-snapkv",
        target_ratio=1.0,
        ratio=ratio,
        sink_tokens=4,
        recent_window=32,
        grouping=HeadGrouping.build(ratio, 4, "global"),
    ).save(path)
    return str(path)


def extend_batch(
    lengths: list[int], seed: int, num_kv_heads: int, gqa: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """A random extend batch of requests of ``lengths`` new tokens, as the attention backend
    hands it to the selection: float32 ``q [T, gqa * H_kv, D]``, ``k`` and ``v [T, H_kv, D]``,
    ``lse [T, gqa * H_kv]`` (positive, about 3-6) and ``bounds`` (``qo_indptr``, ``bs + 1``
    ints), ``T = sum(lengths)``."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(total, gqa * num_kv_heads, head_dim, generator=gen)
    k = torch.randn(total, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(total, num_kv_heads, head_dim, generator=gen)
    lse = torch.randn(total, gqa * num_kv_heads, generator=gen).abs() + 3.0
    bounds = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    return q, k, v, lse, bounds
