"""Triton kept-KV write: each head's selected new tokens -> its group's reserved pages.

After the scorer picks every KV head's top-``k_g`` tokens of a segment, one launch per layer
gathers them from the transient ``k_new``/``v_new`` and writes them densely, in selection order,
to group tokens ``[start_g, start_g + k_g)`` with ``start_g = group_len[row, g]`` (the length
before the segment), i.e. slot ``t % page_size`` of page ``page_table[row, g, t // page_size]``,
column ``column_of_head[h]`` (docs/contracts.md: kept-KV write; docs/design.md §3.1). Uncompressed
K/V never touch the pool. The same kernel appends a decode token (``kept_idx = 0``, count 1).

Grid ``(bs, H_kv, cdiv(max_k, BLOCK_K))``; each program copies ``BLOCK_K`` tokens x ``D`` of K and
of V. ``group_len`` is read, never updated: the caller advances it once per segment after every
layer has written (global-scope groups span layers).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tangram_sglang.errors import KernelError
from tangram_sglang.kernels import _checks

# Tokens per program: 16 tokens x 128 dims x 2 bytes = 4 KB of K plus 4 KB of V in flight;
# ptxas (sm_90a, bf16) reports 114 registers at head_dim 128 (206 with 32 tokens).
BLOCK_K = 16
NUM_WARPS = 4


@triton.jit(do_not_specialize=["stride_ki_b", "stride_ki_h"])
def _kv_write_kernel(
    k_new_ptr,
    v_new_ptr,
    qo_indptr_ptr,
    kept_idx_ptr,
    kept_count_ptr,
    k_pool_ptr,
    v_pool_ptr,
    page_table_ptr,
    group_len_ptr,
    req_rows_ptr,
    group_of_head_ptr,
    column_of_head_ptr,
    stride_kn_t,
    stride_kn_h,
    stride_ki_b,
    stride_ki_h,
    stride_kc_b,
    stride_pool_page,
    stride_pool_col,
    stride_pool_slot,
    stride_pt_row,
    stride_pt_group,
    stride_gl_row,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One (request, KV head, block of BLOCK_K kept tokens)."""
    b = tl.program_id(0)
    head = tl.program_id(1)
    k_block = tl.program_id(2)
    group = tl.load(group_of_head_ptr + head)
    column = tl.load(column_of_head_ptr + head)
    row = tl.load(req_rows_ptr + b).to(tl.int64)
    count = tl.load(kept_count_ptr + b * stride_kc_b + group)
    offs_k = k_block * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_k = offs_k < count
    if k_block * BLOCK_K >= count:
        return
    offs_d = tl.arange(0, HEAD_DIM)
    # Source: the request's new token kept_idx[b, head, j] (index into this request's tokens).
    sel = tl.load(
        kept_idx_ptr + b.to(tl.int64) * stride_ki_b + head * stride_ki_h + offs_k,
        mask=mask_k,
        other=0,
    )
    src_tok = (tl.load(qo_indptr_ptr + b) + sel).to(tl.int64)
    src_off = src_tok[:, None] * stride_kn_t + head * stride_kn_h + offs_d[None, :]
    # Destination: group token start_g + j through the page table (int64 offsets).
    dst_tok = tl.load(group_len_ptr + row * stride_gl_row + group) + offs_k
    page_row_ptr = page_table_ptr + row * stride_pt_row + group * stride_pt_group
    page = tl.load(page_row_ptr + dst_tok // PAGE_SIZE, mask=mask_k, other=0).to(tl.int64)
    dst_row = (
        page * stride_pool_page
        + column.to(tl.int64) * stride_pool_col
        + (dst_tok % PAGE_SIZE).to(tl.int64) * stride_pool_slot
    )
    dst_off = dst_row[:, None] + offs_d[None, :]
    k = tl.load(k_new_ptr + src_off, mask=mask_k[:, None])
    tl.store(k_pool_ptr + dst_off, k, mask=mask_k[:, None])
    v = tl.load(v_new_ptr + src_off, mask=mask_k[:, None])
    tl.store(v_pool_ptr + dst_off, v, mask=mask_k[:, None])


def _check_kv_write_launch(*args) -> int:
    """Every check of :func:`write_kept_kv` (its arguments, in order); returns max_k."""
    k_new, v_new = args[0], args[1]
    max_k = _checks.check_kv_write_args(*args)
    if k_new.stride() != v_new.stride():
        raise KernelError(
            f"k_new strides {k_new.stride()} differ from v_new strides {v_new.stride()}; pass "
            "both with the same layout"
        )
    return max_k


def write_kept_kv(
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    qo_indptr: torch.Tensor,
    kept_idx: torch.Tensor,
    kept_count: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    page_table: torch.Tensor,
    group_len: torch.Tensor,
    req_rows: torch.Tensor,
    group_of_head: torch.Tensor,
    column_of_head: torch.Tensor,
    checked: _checks.CheckedLayouts | None = None,
) -> None:
    """Write the kept K/V of one layer into the reserved pages (one launch, per layer).

    Args:
        k_new, v_new: ``[num_tokens, H_kv, D]`` transient K/V (post-RoPE), the pools' dtype.
        qo_indptr: int32 ``[bs + 1]``: request i owns new tokens ``qo_indptr[i]:qo_indptr[i+1]``.
        kept_idx: int32/int64 ``[bs, H_kv, max_k]``: per (request, KV head) the selected token
            indices into that request's new tokens (``select_kept`` output, padded).
        kept_count: int32 ``[bs, num_head_groups]``: tokens each group keeps (k_g, <= max_k).
        k_pool, v_pool: ``[num_pages, H_p, page_size, D]``, written in place.
        page_table: int32 ``[max_rows, num_head_groups, max_pages_per_group]``, holding the
            reserved pages for ``[group_len, group_len + k_g)``.
        group_len: int32 ``[max_rows, num_head_groups]``: length BEFORE the segment (not updated).
        req_rows: int32 ``[bs]``; group_of_head, column_of_head: int32 ``[H_kv]``.
        checked: layouts already checked (``_checks.CheckedLayouts``): the checks run once per
            layout, e.g. on the first layer of a batch only; None checks every call.

    Raises:
        KernelError: a shape, dtype, device or stride does not match the above.

    Ownership: writes only the reserved slots of ``page_table[req_rows]``; pages stay owned by
    the request's page table.

    Source: this module's docstring.
    """
    args = (k_new, v_new, qo_indptr, kept_idx, kept_count, k_pool, v_pool, page_table)
    args += (group_len, req_rows, group_of_head, column_of_head)
    max_k = _checks.run_once(checked, _check_kv_write_launch, args)
    bs, num_kv_heads = kept_idx.shape[0], kept_idx.shape[1]
    if bs == 0 or max_k == 0:
        return
    grid = (bs, num_kv_heads, triton.cdiv(max_k, BLOCK_K))
    _kv_write_kernel[grid](
        k_new,
        v_new,
        qo_indptr,
        kept_idx,
        kept_count,
        k_pool,
        v_pool,
        page_table,
        group_len,
        req_rows,
        group_of_head,
        column_of_head,
        k_new.stride(0),
        k_new.stride(1),
        kept_idx.stride(0),
        kept_idx.stride(1),
        kept_count.stride(0),
        k_pool.stride(0),
        k_pool.stride(1),
        k_pool.stride(2),
        page_table.stride(0),
        page_table.stride(1),
        group_len.stride(0),
        HEAD_DIM=k_pool.shape[3],
        PAGE_SIZE=k_pool.shape[2],
        BLOCK_K=BLOCK_K,
        num_warps=NUM_WARPS,
    )
