"""The torch reference (CPU serving path and oracle) against float64 dense attention.

Dense attention runs over the unpaged kept tokens of each (row, KV head), so these tests pin the
page layout of docs/contracts.md as well as the arithmetic.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_cases import DEVICE, dense_attention, make_paged_layer, random_lens, rel_err

from tangram_sglang.errors import KernelError
from tangram_sglang.kernels.reference import (
    decode_reference,
    extend_reference,
    kv_write_reference,
)

HEAD_DIM = 64


@pytest.mark.parametrize("page_size", [1, 4, 16], ids=lambda p: f"page{p}")
@pytest.mark.parametrize("heads_per_group", [1, 2], ids=lambda h: f"hp{h}")
def test_decode_reference_matches_dense(page_size: int, heads_per_group: int) -> None:
    num_kv_heads, gqa, rows = 3, 3, 5
    lens = random_lens(rows, 4, 37, page_size, seed=page_size)
    layer = make_paged_layer(
        lens,
        num_kv_heads,
        heads_per_group,
        page_size,
        HEAD_DIM,
        torch.float32,
        seed=7 * page_size + heads_per_group,
    )
    req_rows = torch.tensor([4, 0, 2, 1], dtype=torch.int32, device=DEVICE)
    q = torch.randn(4, num_kv_heads * gqa, HEAD_DIM, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    decode_reference(q, *layer.paging(req_rows), HEAD_DIM**-0.5, out=out)
    assert not out.isnan().any()
    for b, row in enumerate(req_rows.tolist()):
        for h in range(num_kv_heads):
            want, _ = dense_attention(
                q[b, h * gqa : (h + 1) * gqa].cpu(),
                layer.dense_k[row][h],
                layer.dense_v[row][h],
                HEAD_DIM**-0.5,
            )
            assert rel_err(out[b, h * gqa : (h + 1) * gqa], want) < 1e-5


@pytest.mark.parametrize("page_size", [1, 16], ids=lambda p: f"page{p}")
def test_extend_reference_matches_dense(page_size: int) -> None:
    num_kv_heads, gqa = 2, 2
    lens = random_lens(3, 3, 29, page_size, seed=3)
    layer = make_paged_layer(lens, num_kv_heads, 1, page_size, HEAD_DIM, torch.float32, seed=11)
    req_rows = torch.tensor([2, 0, 1], dtype=torch.int32, device=DEVICE)
    extend_lens = [5, 1, 19]
    qo_indptr = torch.tensor(np.cumsum([0, *extend_lens]), dtype=torch.int32, device=DEVICE)
    n = sum(extend_lens)
    q = torch.randn(n, num_kv_heads * gqa, HEAD_DIM, device=DEVICE)
    k_new = torch.randn(n, num_kv_heads, HEAD_DIM, device=DEVICE)
    v_new = torch.randn(n, num_kv_heads, HEAD_DIM, device=DEVICE)
    out, lse = (
        torch.full_like(q, float("nan")),
        torch.full(q.shape[:2], float("nan"), device=DEVICE),
    )
    extend_reference(
        q,
        k_new,
        v_new,
        qo_indptr,
        layer.k_pool,
        layer.v_pool,
        layer.page_table,
        layer.group_len,
        req_rows,
        layer.group_of_head,
        layer.column_of_head,
        HEAD_DIM**-0.5,
        out=out,
        lse=lse,
    )
    assert not out.isnan().any() and not lse.isnan().any()
    for b, row in enumerate(req_rows.tolist()):
        start = int(qo_indptr[b])
        for i in range(extend_lens[b]):
            for h in range(num_kv_heads):
                keys = torch.cat(
                    [layer.dense_k[row][h], k_new[start : start + i + 1, h].double().cpu()]
                )
                vals = torch.cat(
                    [layer.dense_v[row][h], v_new[start : start + i + 1, h].double().cpu()]
                )
                heads = slice(h * gqa, (h + 1) * gqa)
                want, want_lse = dense_attention(
                    q[start + i, heads].cpu(), keys, vals, HEAD_DIM**-0.5
                )
                assert rel_err(out[start + i, heads], want) < 1e-5
                assert rel_err(lse[start + i, heads], want_lse) < 1e-5


def test_kv_write_reference_places_selected_tokens() -> None:
    page_size, num_kv_heads = 4, 3
    lens = np.array([[5, 0], [3, 7], [0, 1]])
    kept = np.array([[2, 3], [4, 1]])  # kept tokens per (request, group)
    layer = make_paged_layer(
        lens,
        num_kv_heads,
        2,
        page_size,
        HEAD_DIM,
        torch.float32,
        seed=5,
        spare_pages=8,
        max_pages=6,
    )
    req_rows = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    for i, row in enumerate(req_rows.tolist()):  # reserve pages for [len, len + kept)
        for g in range(2):
            first = -(-int(lens[row, g]) // page_size)
            last = -(-int(lens[row, g] + kept[i, g]) // page_size)
            for p in range(first, last):
                layer.page_table[row, g, p] = layer.free_pages.pop()
    extend_lens = [6, 5]
    qo_indptr = torch.tensor([0, 6, 11], dtype=torch.int32, device=DEVICE)
    k_new = torch.randn(11, num_kv_heads, HEAD_DIM, device=DEVICE)
    v_new = torch.randn(11, num_kv_heads, HEAD_DIM, device=DEVICE)
    kept_idx = torch.zeros(2, num_kv_heads, 4, dtype=torch.int64, device=DEVICE)
    groups = layer.group_of_head.long()
    for i in range(2):
        for h in range(num_kv_heads):
            k = int(kept[i, groups[h]])
            kept_idx[i, h, :k] = torch.randperm(extend_lens[i])[:k].sort().values.to(DEVICE)
    kept_count = torch.tensor(kept, dtype=torch.int32, device=DEVICE)
    kv_write_reference(
        k_new,
        v_new,
        qo_indptr,
        kept_idx,
        kept_count,
        layer.k_pool,
        layer.v_pool,
        layer.page_table,
        layer.group_len,
        req_rows,
        layer.group_of_head,
        layer.column_of_head,
    )
    for i, row in enumerate(req_rows.tolist()):
        for h in range(num_kv_heads):
            g, col = int(groups[h]), int(layer.column_of_head[h])
            for j in range(int(kept[i, g])):
                t = int(lens[row, g]) + j
                page = int(layer.page_table[row, g, t // page_size])
                src = int(qo_indptr[i]) + int(kept_idx[i, h, j])
                assert torch.equal(layer.k_pool[page, col, t % page_size], k_new[src, h])
                assert torch.equal(layer.v_pool[page, col, t % page_size], v_new[src, h])
            # history untouched
            t = torch.arange(int(lens[row, g]), device=DEVICE)
            pages = layer.page_table[row, g, t // page_size].long()
            assert torch.equal(
                layer.k_pool[pages, col, t % page_size].double().cpu(), layer.dense_k[row][h]
            )


def test_reference_rejects_bad_shapes() -> None:
    layer = make_paged_layer(np.array([[3]]), 1, 1, 4, HEAD_DIM, torch.float32, seed=1)
    q = torch.randn(1, 3, HEAD_DIM, device=DEVICE)
    rows = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(KernelError, match="req_rows"):
        decode_reference(
            q,
            layer.k_pool,
            layer.v_pool,
            layer.page_table,
            layer.group_len,
            rows.long(),
            layer.group_of_head,
            layer.column_of_head,
            1.0,
        )
    with pytest.raises(KernelError, match="q has dtype"):
        decode_reference(
            q.double(),
            layer.k_pool,
            layer.v_pool,
            layer.page_table,
            layer.group_len,
            rows,
            layer.group_of_head,
            layer.column_of_head,
            1.0,
        )
