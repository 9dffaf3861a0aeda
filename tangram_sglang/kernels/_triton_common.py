"""Triton helpers shared by the decode and extend kernels: paged loads and one online-softmax step.

Scores are kept in the log2 domain (``qk * sm_scale * log2(e)``) so every exponential is an
``exp2``; the launchers convert the resulting LSE back to natural log where they return it.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # log2(e): scores * sm_scale * LOG2E live in the exp2 domain
# ln(2): converts a log2-domain LSE back to natural log (a constexpr: read inside kernels)
LN2 = tl.constexpr(0.6931471805599453)


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: exact fp32 products for fp32 inputs (tf32 would miss 1e-4)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def interpreted() -> bool:
    """True under ``TRITON_INTERPRET=1`` (CPU tests).

    Triton 3.6's interpreter computes ``tl.dot`` on bf16/fp16 operands wrongly (errors ~1e10 on
    a 16x16 product), so under the interpreter the kernels upcast dot operands to fp32 after the
    same bf16/fp16 rounding the GPU path does; compiled kernels use the native 16-bit dot.
    """
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def mma(a, b, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """``a @ b`` accumulated in fp32 (``UPCAST_DOT``: fp32 operands, see :func:`interpreted`)."""
    if UPCAST_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def paged_offsets(
    page_row_ptr,
    offs_t,
    mask_t,
    col_offset,
    stride_pool_page,
    stride_pool_slot,
    PAGE_SIZE: tl.constexpr,
):
    """int64 element offsets of tokens ``offs_t`` of one (row, group, column) in a pool.

    ``page_row_ptr`` points at ``page_table[row, group, 0]``; masked tokens read page 0 (padding).
    Offsets are int64: ``page * stride_pool_page`` passes 2^31 on pools of a few GB.
    """
    page = tl.load(page_row_ptr + offs_t // PAGE_SIZE, mask=mask_t, other=0).to(tl.int64)
    return (
        page * stride_pool_page + col_offset + (offs_t % PAGE_SIZE).to(tl.int64) * stride_pool_slot
    )


@triton.jit
def online_softmax_step(
    qk, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr
):
    """Fold one block of scores ``qk [M, N]`` (log2 domain, masked = -inf) and ``v [N, D]``.

    State per query row: running max ``m_i [M]``, running sum ``l_i [M]`` of exp2(score - m_i),
    and the unnormalised output ``acc [M, D]`` (fp32). Returns the updated state.
    """
    # 1. New running max; rows that have seen no visible key yet stay at -inf.
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    # 2. Subtract a finite max: for an all-masked row use 0, so exp2(-inf - 0) = 0, never NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    # 3. Rescale the old sum and accumulator to the new max (alpha = 0 on the first block).
    alpha = tl.exp2(m_i - m_safe)
    # 4. Probabilities of this block, relative to the new max.
    p = tl.exp2(qk - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    # 5. Accumulate P @ V in fp32 (P cast to V's dtype for the tensor-core dot).
    acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, DOT_PRECISION, UPCAST_DOT)
    return m_new, l_i, acc


@triton.jit
def attend_paged(
    q,
    m_i,
    l_i,
    acc,
    page_row_ptr,
    col_offset,
    start,
    end,
    k_pool_ptr,
    v_pool_ptr,
    stride_pool_page,
    stride_pool_slot,
    sm_scale_log2,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """Fold tokens ``[start, end)`` of one (row, group, column)'s pages into the softmax state.

    ``q [M, HEAD_DIM]`` attends to every token of the range (no causal mask): the decode split
    of a KV head and the extend's compressed history both use this loop. Returns the updated
    ``(m_i, l_i, acc)`` of :func:`online_softmax_step`.
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for tok0 in range(start, end, BLOCK_N):
        offs_t = tok0 + offs_n
        mask_t = offs_t < end
        kv_off = paged_offsets(
            page_row_ptr, offs_t, mask_t, col_offset, stride_pool_page, stride_pool_slot, PAGE_SIZE
        )
        k = tl.load(k_pool_ptr + kv_off[:, None] + offs_d[None, :], mask=mask_t[:, None], other=0.0)
        v = tl.load(v_pool_ptr + kv_off[:, None] + offs_d[None, :], mask=mask_t[:, None], other=0.0)
        # Scores in the log2 domain; tokens past the range's end are masked to -inf.
        qk = mma(q, tl.trans(k), DOT_PRECISION, UPCAST_DOT) * sm_scale_log2
        qk = tl.where(mask_t[None, :], qk, float("-inf"))
        m_i, l_i, acc = online_softmax_step(qk, v, m_i, l_i, acc, DOT_PRECISION, UPCAST_DOT)
    return m_i, l_i, acc
