"""Triton extend attention: new tokens over their head's compressed history + causal new tokens.

At prefill/extend time the new tokens' K/V are transient (never written to the pool uncompressed,
docs/design.md §3.1). A query of request i, query head qh (KV head ``h = qh // gqa_size``) attends

* to every kept history token of its head: tokens ``[0, group_len[row, g])`` of group
  ``g = group_of_head[h]``, column ``column_of_head[h]``, through the ragged page table;
* causally to the request's new tokens: new token j is visible to new token i iff ``j <= i``.

Grid ``(bs, num_qo_heads, cdiv(max_extend_len, BLOCK_M))``: one program owns ``BLOCK_M`` queries
of one request and query head, sweeps the history pages, then the new tokens up to its last
query, with an fp32 online softmax. It writes the output and the natural-log LSE of every query
(history + new keys), which the scorer uses to normalise observation-window scores without a
second pass over the history (docs/contracts.md, Scorer interface).

Sources: FlashAttention-2 forward (Dao 2023) as in the Triton fused-attention tutorial; SGLang
0.5.17 ``kernels/ops/attention/extend_attention.py`` (prefix pages + causal extend tokens).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tangram_sglang.errors import KernelError
from tangram_sglang.kernels import _checks
from tangram_sglang.kernels._triton_common import (
    LN2,
    LOG2E,
    attend_paged,
    dot_precision,
    interpreted,
    mma,
    online_softmax_step,
)

# (BLOCK_M queries, BLOCK_N keys, warps) per head_dim, chosen from ptxas -v for sm_90a in bf16:
# no register spills (a flash-attention loop sits at the 255-register cap at these tiles; the
# Triton fused-attention tutorial uses the same shapes on Hopper).
TILES_BY_HEAD_DIM = {
    16: (64, 64, 4),
    32: (64, 64, 4),
    64: (64, 64, 4),
    128: (128, 64, 8),
    256: (64, 32, 8),
}
NUM_STAGES = 2


@triton.jit
def _extend_kernel(
    q_ptr,
    k_new_ptr,
    v_new_ptr,
    qo_indptr_ptr,
    k_pool_ptr,
    v_pool_ptr,
    page_table_ptr,
    group_len_ptr,
    req_rows_ptr,
    group_of_head_ptr,
    column_of_head_ptr,
    out_ptr,
    lse_ptr,
    sm_scale_log2,
    stride_q_t,
    stride_q_h,
    stride_kn_t,
    stride_kn_h,
    stride_pool_page,
    stride_pool_col,
    stride_pool_slot,
    stride_pt_row,
    stride_pt_group,
    stride_gl_row,
    stride_out_t,
    stride_out_h,
    stride_lse_t,
    GQA_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    NEW_TOKENS: tl.constexpr,
):
    """One (request, query head, block of BLOCK_M new tokens)."""
    b = tl.program_id(0)
    qh = tl.program_id(1)
    m_block = tl.program_id(2)
    tok_start = tl.load(qo_indptr_ptr + b)
    num_new = tl.load(qo_indptr_ptr + b + 1) - tok_start
    if m_block * BLOCK_M >= num_new:
        return
    head = qh // GQA_SIZE
    group = tl.load(group_of_head_ptr + head)
    column = tl.load(column_of_head_ptr + head)
    row = tl.load(req_rows_ptr + b).to(tl.int64)
    hist_len = tl.load(group_len_ptr + row * stride_gl_row + group)

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_m = offs_m < num_new
    tok_m = (tok_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + tok_m[:, None] * stride_q_t + qh * stride_q_h + offs_d[None, :],
        mask=mask_m[:, None],
        other=0.0,
    )
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # Phase 1: compressed history, every token visible to every query (ragged pages).
    page_row_ptr = page_table_ptr + row * stride_pt_row + group * stride_pt_group
    col_offset = column.to(tl.int64) * stride_pool_col
    m_i, l_i, acc = attend_paged(
        q,
        m_i,
        l_i,
        acc,
        page_row_ptr,
        col_offset,
        0,
        hist_len,
        k_pool_ptr,
        v_pool_ptr,
        stride_pool_page,
        stride_pool_slot,
        sm_scale_log2,
        BLOCK_N,
        HEAD_DIM,
        PAGE_SIZE,
        DOT_PRECISION,
        UPCAST_DOT,
    )

    # Phase 2: transient new tokens, causal (key j visible to query i iff j <= i); keys past
    # this block's last query are never visible, so the sweep stops there. Skipped without
    # NEW_TOKENS (history only).
    if NEW_TOKENS:
        new_end = tl.minimum(num_new, (m_block + 1) * BLOCK_M)
        kn_base = k_new_ptr + head * stride_kn_h
        vn_base = v_new_ptr + head * stride_kn_h
        for j0 in range(0, new_end, BLOCK_N):
            offs_j = j0 + offs_n
            mask_j = offs_j < num_new
            tok_j = (tok_start + offs_j).to(tl.int64)
            kv_off = tok_j[:, None] * stride_kn_t + offs_d[None, :]
            k = tl.load(kn_base + kv_off, mask=mask_j[:, None], other=0.0)
            v = tl.load(vn_base + kv_off, mask=mask_j[:, None], other=0.0)
            qk = mma(q, tl.trans(k), DOT_PRECISION, UPCAST_DOT) * sm_scale_log2
            visible = (offs_j[None, :] <= offs_m[:, None]) & mask_j[None, :]
            qk = tl.where(visible, qk, float("-inf"))
            m_i, l_i, acc = online_softmax_step(qk, v, m_i, l_i, acc, DOT_PRECISION, UPCAST_DOT)

    # With the new tokens every valid query sees at least itself, so l_i > 0; history only, a
    # query of a request without history sees nothing: output 0, LSE -inf (m_i). Padding rows
    # are not stored.
    safe_l = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / safe_l[:, None]
    lse = (m_i + tl.log2(safe_l)) * LN2  # log2-domain LSE -> natural log
    tl.store(
        out_ptr + tok_m[:, None] * stride_out_t + qh * stride_out_h + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=mask_m[:, None],
    )
    tl.store(lse_ptr + tok_m * stride_lse_t + qh, lse, mask=mask_m)


def _check_extend_launch(*args) -> tuple[int, int, int, int]:
    """Every check of :func:`ragged_extend_attention` (its arguments, ``q`` to ``lse``, in
    order); returns (N, H_q, H_kv, bs)."""
    q, k_new, v_new = args[:3]
    sm_scale, out, lse = args[11:14]
    dims = _checks.check_extend_args(*args[:11])
    _checks.check_sm_scale(sm_scale)
    _checks.check_tensor("out", out, tuple(q.shape), (q.dtype,), q.device)
    _checks.check_tensor("lse", lse, tuple(dims[:2]), (torch.float32,), q.device)
    if k_new.stride() != v_new.stride():
        raise KernelError(
            f"k_new strides {k_new.stride()} differ from v_new strides {v_new.stride()}; pass "
            "both with the same layout (e.g. .contiguous())"
        )
    return dims


def ragged_extend_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    qo_indptr: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    page_table: torch.Tensor,
    group_len: torch.Tensor,
    req_rows: torch.Tensor,
    group_of_head: torch.Tensor,
    column_of_head: torch.Tensor,
    sm_scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    max_extend_len: int | None = None,
    new_tokens: bool = True,
    checked: _checks.CheckedLayouts | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Extend attention of one layer (per layer, per extend batch).

    Args:
        q: ``[num_tokens, num_qo_heads, D]`` new tokens' queries (post-RoPE), the pools' dtype.
        k_new, v_new: ``[num_tokens, H_kv, D]`` transient K/V of the new tokens (post-RoPE).
        qo_indptr: int32 ``[bs + 1]``: request i owns tokens ``qo_indptr[i]:qo_indptr[i + 1]``.
        k_pool, v_pool: ``[num_pages, H_p, page_size, D]`` (see ``ragged_decode_attention``).
        page_table: int32 ``[max_rows, num_head_groups, max_pages_per_group]``.
        group_len: int32 ``[max_rows, num_head_groups]``: kept HISTORY tokens (before this
            segment; 0 without history).
        req_rows: int32 ``[bs]``; group_of_head, column_of_head: int32 ``[H_kv]``.
        sm_scale: softmax scale.
        out: ``[num_tokens, num_qo_heads, D]`` in q's dtype, written in place.
        lse: float32 ``[num_tokens, num_qo_heads]``, natural-log normaliser, written in place.
        max_extend_len: the largest ``qo_indptr[i + 1] - qo_indptr[i]`` (tokens); read from
            ``qo_indptr`` (one host sync) when None.
        new_tokens: attend to the causal new tokens too (default); False = the history only
            (``kernels.new_token_attention.split_extend`` adds the new tokens' part by LSE):
            a query without history then gets output 0 and LSE ``-inf``.
        checked: layouts already checked (``_checks.CheckedLayouts``): the checks run once per
            layout, e.g. on the first layer of a batch only; None checks every call.

    Returns:
        ``(out, lse)``: every token of every request written.

    Raises:
        KernelError: a shape, dtype, device or stride does not match the above.

    Source: this module's docstring; docs/contracts.md (extend).
    """
    args = (q, k_new, v_new, qo_indptr, k_pool, v_pool, page_table, group_len, req_rows)
    args += (group_of_head, column_of_head, sm_scale, out, lse)
    num_tokens, num_qo_heads, num_kv_heads, bs = _checks.run_once(
        checked, _check_extend_launch, args
    )
    if max_extend_len is None:
        max_extend_len = int((qo_indptr[1:] - qo_indptr[:-1]).max()) if bs else 0
    if bs == 0 or max_extend_len <= 0:
        return out, lse
    head_dim, page_size = k_pool.shape[3], k_pool.shape[2]
    block_m, block_n, num_warps = TILES_BY_HEAD_DIM[head_dim]
    grid = (bs, num_qo_heads, triton.cdiv(max_extend_len, block_m))
    _extend_kernel[grid](
        q,
        k_new,
        v_new,
        qo_indptr,
        k_pool,
        v_pool,
        page_table,
        group_len,
        req_rows,
        group_of_head,
        column_of_head,
        out,
        lse,
        sm_scale * LOG2E,
        q.stride(0),
        q.stride(1),
        k_new.stride(0),
        k_new.stride(1),
        k_pool.stride(0),
        k_pool.stride(1),
        k_pool.stride(2),
        page_table.stride(0),
        page_table.stride(1),
        group_len.stride(0),
        out.stride(0),
        out.stride(1),
        lse.stride(0),
        GQA_SIZE=num_qo_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(q.dtype),
        UPCAST_DOT=interpreted(),
        NEW_TOKENS=bool(new_tokens),
        num_warps=num_warps,
        num_stages=NUM_STAGES,
    )
    return out, lse
