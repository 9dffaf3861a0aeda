"""Shared kernel-test helpers: device, tolerances, a random ragged paged layer, dense oracle."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Relative-error bars of docs/design.md §6 (vs a float64 oracle); fp16 shares bf16's bar.
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}


@dataclass
class PagedLayer:
    """One layer's KV state in the pool layout of docs/contracts.md, plus the dense oracle.

    ``dense_k[r][h]`` / ``dense_v[r][h]``: float64 ``[group_len[r, group_of_head[h]], D]``, the
    kept tokens of row r, KV head h, in logical order (exactly what the pool holds).
    """

    k_pool: torch.Tensor
    v_pool: torch.Tensor
    page_table: torch.Tensor
    group_len: torch.Tensor
    group_of_head: torch.Tensor
    column_of_head: torch.Tensor
    dense_k: list[list[torch.Tensor]]
    dense_v: list[list[torch.Tensor]]
    free_pages: list[int]  # page ids never handed out (for reserving extra pages in tests)

    def paging(self, req_rows: torch.Tensor) -> tuple:
        """The kernels' paging arguments in their order: pools, page table, lengths, rows, heads."""
        return (
            self.k_pool,
            self.v_pool,
            self.page_table,
            self.group_len,
            req_rows,
            self.group_of_head,
            self.column_of_head,
        )


def head_slots(num_kv_heads: int, num_groups: int, heads_per_group: int, rng) -> tuple:
    """Distinct random (group, column) slots for the layer's heads (groups may be shared)."""
    slots = rng.choice(num_groups * heads_per_group, size=num_kv_heads, replace=False)
    return slots // heads_per_group, slots % heads_per_group


def make_paged_layer(
    lens: np.ndarray,
    num_kv_heads: int,
    heads_per_group: int,
    page_size: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int,
    spare_pages: int = 0,
    max_pages: int | None = None,
) -> PagedLayer:
    """Random ragged layer: ``lens [rows, num_groups]`` kept tokens, pages in random order.

    Unused page-table entries are 0; the pool is filled with finite random values everywhere
    (so padding slots hold garbage that must be masked, never zeros).
    """
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    rows, num_groups = lens.shape
    need = -(-lens // page_size)
    max_pages = max_pages or max(1, int(need.max()) + 1)
    num_pages = 1 + int(need.sum()) + spare_pages
    order = rng.permutation(np.arange(1, num_pages))
    pool_shape = (num_pages, heads_per_group, page_size, head_dim)
    k_pool = torch.randn(pool_shape, generator=gen).to(dtype)
    v_pool = torch.randn(pool_shape, generator=gen).to(dtype)
    page_table = torch.zeros(rows, num_groups, max_pages, dtype=torch.int32)
    taken = 0
    for r in range(rows):
        for g in range(num_groups):
            num = int(need[r, g])
            page_table[r, g, :num] = torch.from_numpy(order[taken : taken + num].astype(np.int32))
            taken += num
    groups, cols = head_slots(num_kv_heads, num_groups, heads_per_group, rng)
    dense_k, dense_v = [], []
    for r in range(rows):
        dense_k.append([])
        dense_v.append([])
        for h in range(num_kv_heads):
            n = int(lens[r, groups[h]])
            t = torch.arange(n)
            pages = page_table[r, groups[h], t // page_size].long()
            dense_k[r].append(k_pool[pages, cols[h], t % page_size].double())
            dense_v[r].append(v_pool[pages, cols[h], t % page_size].double())
    return PagedLayer(
        k_pool=k_pool.to(DEVICE),
        v_pool=v_pool.to(DEVICE),
        page_table=page_table.to(DEVICE),
        group_len=torch.tensor(lens, dtype=torch.int32, device=DEVICE),
        group_of_head=torch.tensor(groups, dtype=torch.int32, device=DEVICE),
        column_of_head=torch.tensor(cols, dtype=torch.int32, device=DEVICE),
        dense_k=dense_k,
        dense_v=dense_v,
        free_pages=[int(p) for p in order[taken:]],
    )


def dense_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, sm_scale: float):
    """float64 softmax attention ``q [M, D]`` over ``keys/values [N, D]``; (out, lse)."""
    if keys.shape[0] == 0:
        return torch.zeros_like(q, dtype=torch.float64), torch.full(
            (q.shape[0],), float("-inf"), dtype=torch.float64
        )
    scores = q.double() @ keys.double().T * sm_scale
    lse = torch.logsumexp(scores, dim=-1)
    return torch.softmax(scores, dim=-1) @ values.double(), lse


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64 (0 when both are 0)."""
    got, want = got.double().cpu(), want.double().cpu()
    denom = want.norm().item()
    return (got - want).norm().item() / denom if denom else (got - want).norm().item()


def random_lens(rows: int, num_groups: int, max_len: int, page_size: int, seed: int) -> np.ndarray:
    """Ragged lengths with the edge cases: a 0, a 1, and values off page boundaries."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(0, max_len + 1, size=(rows, num_groups))
    flat = lens.reshape(-1)
    flat[0] = 0
    if flat.size > 1:
        flat[1] = 1
    if flat.size > 2:
        flat[2] = page_size + 1 if page_size + 1 <= max_len else max_len
    return lens


def extend_inputs(dtype, page_size, head_dim, extend_lens, gqa=2, num_kv_heads=2, seed=0):
    """A random paged layer of 3 rows (histories 0-45 tokens, some 0) and an extend batch of
    ``extend_lens`` new tokens at rows 2, 0, 1: ``(layer, q, k_new, v_new, qo_indptr, paging)``."""
    lens = random_lens(3, 3, 45, page_size, seed)
    layer = make_paged_layer(lens, num_kv_heads, 2, page_size, head_dim, dtype, seed)
    req_rows = torch.tensor([2, 0, 1][: len(extend_lens)], dtype=torch.int32, device=DEVICE)
    qo_indptr = torch.tensor(np.cumsum([0, *extend_lens]), dtype=torch.int32, device=DEVICE)
    n = sum(extend_lens)
    q = torch.randn(n, num_kv_heads * gqa, head_dim, device=DEVICE).to(dtype)
    k_new = torch.randn(n, num_kv_heads, head_dim, device=DEVICE).to(dtype)
    v_new = torch.randn(n, num_kv_heads, head_dim, device=DEVICE).to(dtype)
    paging = layer.paging(req_rows)
    return layer, q, k_new, v_new, qo_indptr, paging
