"""Triton split-KV decode attention over ragged per-group page lists.

Algorithm (FlashDecoding split-KV; the CTA budget is fixed ahead of time, the split is fitted to
the real lengths):

* Stage 1, grid ``(bs, num_ctas)``. Program ``(b, c)`` maps CTA ``c`` of its request row to a
  (KV head, split) and processes the split's tokens of that head's group. Three plans, chosen
  by the launcher's ``plan`` (constexprs of the kernels; serving's default is ``"batch"``,
  ``config.decode_plan``):

  - ``"lengths"``: :func:`_fitted_chunk` reads the row's kept lengths
    ``L_h = group_len[row, group_of_head[h]]`` of every KV head and gives every CTA at most one
    chunk of about ``sum_h L_h / N`` tokens (``N``: the bucket's CTA budget per row); CTA ``c``
    finds its head by a prefix sum of the heads' split counts. A grid of
    ``num_ctas = min(N + H_kv, H_kv * cap)`` always suffices; CTAs past the row's split count
    exit at once. Rule, bound and sources: ``split_table.py``'s docstring.
  - ``"batch"``: the ``"lengths"`` rule with the table's wider row budget (``batch_budget``,
    ``batch_cap``) and a chunk floor from the whole batch (``chunk_floor``, computed on the
    host from the scheduler's lengths), so a long row among short ones splits as finely as the
    batch as a whole (``split_table.py``'s docstring).
  - ``"table"`` (the launcher's default argument; the paper's plan): the static AOT table
    (``cta_head[c]``, ``cta_split[c]``, ``splits[head]``; splits proportional to the group
    ratios); balanced when the lengths follow the ratios. Also the uniform baseline's plan.

  Either way split ``s`` of a head with ``L`` kept tokens and ``n`` splits covers tokens
  ``[s * chunk, min(L, (s + 1) * chunk))``, ``chunk = roundup(ceil(L / n), BLOCK_N)``.

  All GQA query heads of the KV head are one ``[GQA_PAD, D]`` tile, so each K/V block is read
  once for the whole GQA group. Online softmax in fp32 gives a normalised partial output and its
  LSE per (b, query head, split).
* Stage 2, grid ``(bs, num_qo_heads)``: merge the head's split partials by log-sum-exp into
  ``out``; under ``"lengths"`` and ``"batch"`` it recomputes the split count with the same
  helpers (:func:`_row_chunk`, :func:`_fitted_num_splits`), so the stages never disagree.

Only ``group_len`` (device), static per-bucket numbers and (``"batch"``) the floor the host
uploads with the step's plan drive the launch: no host sync, no allocation (``out`` and the two
scratch tensors come from the caller), so a decode step can be captured in a CUDA graph and
replayed with new lengths. Empty groups (``L = 0``) give
zeros; an empty split writes ``lse = -inf``.

Sources: Dao et al., "Flash-Decoding for long-context inference" (2023); SGLang 0.5.17
``kernels/ops/attention/decode_attention.py`` (grouped stage 1 + stage 2); FlashInfer's decode
planner (fixed chunk per CTA sized from the batch's lengths); Tangram arXiv 2606.06302 (AOT load
balancing); docs/contracts.md (decode calling convention).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tangram_sglang.config import DECODE_PLANS as PLANS
from tangram_sglang.errors import KernelError
from tangram_sglang.kernels import _checks
from tangram_sglang.kernels._triton_common import (
    LOG2E,
    attend_paged,
    dot_precision,
    interpreted,
)
from tangram_sglang.kernels.split_table import LayerSplits

# Tokens per inner-loop block. 32 (as SGLang's grouped decode kernel) keeps the K and V tiles,
# the gathered page offsets and the fp32 accumulator in registers without spills: ptxas for
# sm_90a reports 128 registers at head_dim 64 and 160 (plans "lengths", "batch") / 166 ("table") at
# 128 (BLOCK_N = 64: 226 and 255 with spills), i.e. 3-4 CTAs of 4 warps per SM.
BLOCK_N = 32
# tl.dot needs M >= 16: the GQA query heads of a KV head are padded to at least 16 rows.
MIN_GQA_PAD = 16
NUM_WARPS = 4
NUM_STAGES = 2


@triton.jit
def _fitted_chunk(
    gl_row_ptr,
    group_of_head_ptr,
    cta_budget,
    split_cap,
    floor,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Tokens per CTA of one request row under the fitted plans (a multiple of BLOCK_N).

    ``gl_row_ptr``: the row's ``group_len`` entries. ``chunk = BLOCK_N * max(1, ceil(max(
    ceil(total / cta_budget), ceil(longest / split_cap), floor) / BLOCK_N))`` over the KV heads'
    kept lengths (``floor``: 0 under ``"lengths"``, the launch's chunk floor under ``"batch"``);
    ``split_table.fitted_splits`` is the numpy twin. Scalar loads in an unrolled loop: no
    block-wide reduction, so the attention loop keeps its registers (ptxas, sm_90a).
    """
    total = 0
    longest = 0
    for h in tl.static_range(NUM_KV_HEADS):
        length = tl.load(gl_row_ptr + tl.load(group_of_head_ptr + h))
        total += length
        longest = tl.maximum(longest, length)
    chunk = tl.maximum(tl.cdiv(total, cta_budget), tl.cdiv(longest, split_cap))
    chunk = tl.maximum(chunk, floor)
    return tl.maximum(tl.cdiv(chunk, BLOCK_N), 1) * BLOCK_N


@triton.jit
def _chunk_floor(chunk_floor_ptr, BATCH_FLOOR: tl.constexpr):
    """The launch's chunk floor: ``chunk_floor[0]`` under ``"batch"``, else 0 (no load)."""
    if BATCH_FLOOR:
        return tl.load(chunk_floor_ptr)
    else:
        return 0


@triton.jit
def _row_chunk(
    group_len_ptr,
    row,
    stride_gl_row,
    group_of_head_ptr,
    cta_budget,
    split_cap,
    chunk_floor_ptr,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BATCH_FLOOR: tl.constexpr,
):
    """``(row's group_len pointer, its chunk)`` under the fitted plans: the one computation
    both stages make, so they never disagree on a row's splits."""
    gl_row_ptr = group_len_ptr + row * stride_gl_row
    floor = _chunk_floor(chunk_floor_ptr, BATCH_FLOOR)
    chunk = _fitted_chunk(
        gl_row_ptr, group_of_head_ptr, cta_budget, split_cap, floor, NUM_KV_HEADS, BLOCK_N
    )
    return gl_row_ptr, chunk


@triton.jit
def _fitted_num_splits(length, chunk):
    """Splits of a KV head with ``length`` kept tokens under the row's ``chunk`` (>= 1)."""
    return tl.maximum(tl.cdiv(length, chunk), 1)


@triton.jit(do_not_specialize=["cta_budget", "split_cap"])
def _decode_stage1(
    q_ptr,
    k_pool_ptr,
    v_pool_ptr,
    page_table_ptr,
    group_len_ptr,
    req_rows_ptr,
    group_of_head_ptr,
    column_of_head_ptr,
    splits_ptr,
    cta_head_ptr,
    cta_split_ptr,
    mid_o_ptr,
    mid_lse_ptr,
    chunk_floor_ptr,
    sm_scale_log2,
    cta_budget,
    split_cap,
    stride_q_b,
    stride_q_h,
    stride_pool_page,
    stride_pool_col,
    stride_pool_slot,
    stride_pt_row,
    stride_pt_group,
    stride_gl_row,
    stride_mo_b,
    stride_mo_h,
    stride_mo_s,
    stride_ml_b,
    stride_ml_h,
    GQA_SIZE: tl.constexpr,
    GQA_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    FIT_LENGTHS: tl.constexpr,
    BATCH_FLOOR: tl.constexpr,
):
    """One (batch entry, CTA): one split of one KV head (the module docstring's plans)."""
    b = tl.program_id(0)
    c = tl.program_id(1)
    row = tl.load(req_rows_ptr + b).to(tl.int64)
    if FIT_LENGTHS:
        gl_row_ptr, row_chunk = _row_chunk(
            group_len_ptr,
            row,
            stride_gl_row,
            group_of_head_ptr,
            cta_budget,
            split_cap,
            chunk_floor_ptr,
            NUM_KV_HEADS,
            BLOCK_N,
            BATCH_FLOOR,
        )
        # CTA c -> the head h with E_{h-1} <= c < E_h (E: inclusive prefix sum of the splits).
        head = 0
        split = 0
        num_splits = 1
        seq_len = 0
        prefix = 0
        for h in tl.static_range(NUM_KV_HEADS):
            length = tl.load(gl_row_ptr + tl.load(group_of_head_ptr + h))
            num = _fitted_num_splits(length, row_chunk)
            inside = (c >= prefix) & (c < prefix + num)
            head = tl.where(inside, h, head)
            split = tl.where(inside, c - prefix, split)
            num_splits = tl.where(inside, num, num_splits)
            seq_len = tl.where(inside, length, seq_len)
            prefix += num
        if c >= prefix:
            return  # past the row's splits: an idle CTA
        group = tl.load(group_of_head_ptr + head)
    else:
        head = tl.load(cta_head_ptr + c)
        split = tl.load(cta_split_ptr + c)
        num_splits = tl.load(splits_ptr + head)
        group = tl.load(group_of_head_ptr + head)
        seq_len = tl.load(group_len_ptr + row * stride_gl_row + group)
    # The head's tokens spread evenly over its splits (<= row_chunk under "lengths").
    chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    column = tl.load(column_of_head_ptr + head)
    start = split * chunk
    end = tl.minimum(seq_len, start + chunk)

    offs_g = tl.arange(0, GQA_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    q_heads = head * GQA_SIZE + offs_g
    mask_g = offs_g < GQA_SIZE
    q_off = b.to(tl.int64) * stride_q_b + q_heads[:, None] * stride_q_h + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=mask_g[:, None], other=0.0)

    page_row_ptr = page_table_ptr + row * stride_pt_row + group * stride_pt_group
    col_offset = column.to(tl.int64) * stride_pool_col
    m_i = tl.full([GQA_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GQA_PAD], dtype=tl.float32)
    acc = tl.zeros([GQA_PAD, HEAD_DIM], dtype=tl.float32)
    m_i, l_i, acc = attend_paged(
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
        BLOCK_N,
        HEAD_DIM,
        PAGE_SIZE,
        DOT_PRECISION,
        UPCAST_DOT,
    )

    # Normalise this split's output; an empty split writes zeros with lse = -inf (weight 0).
    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    mo_off = (
        b.to(tl.int64) * stride_mo_b
        + q_heads[:, None] * stride_mo_h
        + split * stride_mo_s
        + offs_d[None, :]
    )
    tl.store(mid_o_ptr + mo_off, out, mask=mask_g[:, None])
    ml_off = b.to(tl.int64) * stride_ml_b + q_heads * stride_ml_h + split
    tl.store(mid_lse_ptr + ml_off, lse, mask=mask_g)


@triton.jit(do_not_specialize=["cta_budget", "split_cap"])
def _decode_stage2(
    mid_o_ptr,
    mid_lse_ptr,
    splits_ptr,
    group_len_ptr,
    req_rows_ptr,
    group_of_head_ptr,
    out_ptr,
    chunk_floor_ptr,
    cta_budget,
    split_cap,
    stride_gl_row,
    stride_mo_b,
    stride_mo_h,
    stride_mo_s,
    stride_ml_b,
    stride_ml_h,
    stride_out_b,
    stride_out_h,
    GQA_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FIT_LENGTHS: tl.constexpr,
    BATCH_FLOOR: tl.constexpr,
):
    """One (batch entry, query head): LSE-merge the head's split partials into ``out``."""
    b = tl.program_id(0)
    qh = tl.program_id(1)
    if FIT_LENGTHS:
        row = tl.load(req_rows_ptr + b).to(tl.int64)
        gl_row_ptr, chunk = _row_chunk(
            group_len_ptr,
            row,
            stride_gl_row,
            group_of_head_ptr,
            cta_budget,
            split_cap,
            chunk_floor_ptr,
            NUM_KV_HEADS,
            BLOCK_N,
            BATCH_FLOOR,
        )
        length = tl.load(gl_row_ptr + tl.load(group_of_head_ptr + qh // GQA_SIZE))
        num_splits = _fitted_num_splits(length, chunk)
    else:
        num_splits = tl.load(splits_ptr + qh // GQA_SIZE)
    offs_d = tl.arange(0, HEAD_DIM)
    mo_base = mid_o_ptr + b.to(tl.int64) * stride_mo_b + qh * stride_mo_h
    ml_base = mid_lse_ptr + b.to(tl.int64) * stride_ml_b + qh * stride_ml_h
    m = float("-inf")
    denom = 0.0
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for s in range(0, num_splits):
        lse_s = tl.load(ml_base + s)
        o_s = tl.load(mo_base + s * stride_mo_s + offs_d)
        # Same online rescaling as stage 1, with one "score" (the split's lse) per split.
        m_new = tl.maximum(m, lse_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        weight = tl.exp2(lse_s - m_safe)
        denom = denom * alpha + weight
        acc = acc * alpha + weight * o_s
        m = m_new
    out = acc / tl.where(denom > 0.0, denom, 1.0)
    out_off = b.to(tl.int64) * stride_out_b + qh * stride_out_h + offs_d
    tl.store(out_ptr + out_off, out.to(out_ptr.dtype.element_ty))


def decode_scratch(
    max_batch_size: int, num_qo_heads: int, max_splits: int, head_dim: int, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate the stage-1 scratch once (start-up), sized for the largest batch and split count.

    Returns:
        ``(mid_o float32 [max_batch_size, num_qo_heads, max_splits, head_dim],
        mid_lse float32 [max_batch_size, num_qo_heads, max_splits])``.
    """
    mid_o = torch.empty(
        max_batch_size, num_qo_heads, max_splits, head_dim, dtype=torch.float32, device=device
    )
    mid_lse = torch.empty(
        max_batch_size, num_qo_heads, max_splits, dtype=torch.float32, device=device
    )
    return mid_o, mid_lse


def _check_decode_args(
    q,
    k_pool,
    v_pool,
    page_table,
    group_len,
    req_rows,
    group_of_head,
    column_of_head,
    table,
    out,
    mid_o,
    mid_lse,
    plan,
    chunk_floor,
) -> tuple[int, int, int]:
    """Launcher checks (host metadata only); returns (bs, num_qo_heads, gqa_size)."""
    if plan not in PLANS:
        raise KernelError(f"plan={plan!r} must be one of {', '.join(map(repr, PLANS))}")
    if plan == "batch":
        if chunk_floor is None:
            raise KernelError(
                "plan='batch' needs chunk_floor, an int32 [1] tensor on q's device holding "
                "split_table.batch_chunk_floor(lens, table.launch_ctas) of this launch"
            )
        _checks.check_tensor("chunk_floor", chunk_floor, (1,), (torch.int32,), q.device)
    bs, num_qo_heads = _checks.check_query(q, k_pool)
    device = q.device
    _checks.check_pools(k_pool, v_pool, device)
    num_kv_heads = _checks.num_kv_heads_of(group_of_head, device)
    gqa = _checks.gqa_size_of(num_qo_heads, num_kv_heads)
    _checks.check_paging(
        page_table, group_len, req_rows, group_of_head, column_of_head, bs, num_kv_heads, device
    )
    if not isinstance(table, LayerSplits):
        raise KernelError("table must be a LayerSplits (SplitTable.layer(l)) of this layer")
    _checks.check_tensor("table.splits", table.splits, (num_kv_heads,), (torch.int32,), device)
    shape = (table.num_ctas,)
    _checks.check_tensor("table.cta_head", table.cta_head, shape, (torch.int32,), device)
    _checks.check_tensor("table.cta_split", table.cta_split, shape, (torch.int32,), device)
    head_dim = k_pool.shape[3]
    _checks.check_tensor("out", out, (bs, num_qo_heads, head_dim), (q.dtype,), device)
    _checks.check_tensor(
        "mid_o", mid_o, (None, num_qo_heads, None, head_dim), (torch.float32,), device
    )
    need_splits = {"lengths": table.split_cap, "batch": table.batch_cap}.get(plan, table.max_splits)
    if mid_o.shape[0] < bs or mid_o.shape[2] < need_splits:
        raise KernelError(
            f"mid_o has shape {list(mid_o.shape)} but this launch needs batch >= {bs} and "
            f"splits >= {need_splits} (plan={plan!r}); size it with "
            "decode_scratch(max_batch_size, ..., SplitTables.scratch_splits, ...)"
        )
    _checks.check_tensor("mid_lse", mid_lse, tuple(mid_o.shape[:3]), (torch.float32,), device)
    return bs, num_qo_heads, gqa


def ragged_decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    page_table: torch.Tensor,
    group_len: torch.Tensor,
    req_rows: torch.Tensor,
    group_of_head: torch.Tensor,
    column_of_head: torch.Tensor,
    table: LayerSplits,
    sm_scale: float,
    out: torch.Tensor,
    mid_o: torch.Tensor,
    mid_lse: torch.Tensor,
    plan: str = "table",
    chunk_floor: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of one layer over ragged per-group page lists (per layer, per step).

    Args:
        q: ``[bs, num_qo_heads, D]`` bf16/fp16/fp32 (the pools' dtype), last dim contiguous.
        k_pool, v_pool: ``[num_pages, H_p, page_size, D]``, same dtype and strides; D a power of
            two in [16, 256] (64 and 128 tested), page_size a power of two (1..64 tested).
        page_table: int32 ``[max_rows, num_head_groups, max_pages_per_group]``.
        group_len: int32 ``[max_rows, num_head_groups]``: kept tokens INCLUDING the token being
            decoded (its K/V already written).
        req_rows: int32 ``[bs]``: page-table row of each batch entry (req_pool_idx).
        group_of_head, column_of_head: int32 ``[H_kv]``: this layer's head -> (group, column).
        table: this layer's split table for the batch bucket (``SplitTables.for_batch(bs)
            .layer(l)``), tensors on q's device: its CTA budget and split cap under
            ``plan="lengths"``, its static map under ``plan="table"`` (the uniform baseline
            passes a uniform table with ``plan="table"``).
        sm_scale: softmax scale (usually ``D ** -0.5``).
        out: ``[bs, num_qo_heads, D]`` in q's dtype, written in place (every element).
        mid_o: float32 ``[>= bs, num_qo_heads, >= S, D]`` scratch; ``S = table.split_cap``
            (``"lengths"``), ``table.batch_cap`` (``"batch"``) or ``table.max_splits``
            (``"table"``); ``SplitTables.scratch_splits`` fits all three.
        mid_lse: float32 ``[mid_o.shape[0], num_qo_heads, mid_o.shape[2]]`` scratch.
        plan: ``"table"`` (the static AOT split table, default), ``"lengths"`` (split fitted
            to the row's kept lengths in the kernel) or ``"batch"`` (fitted with the table's
            wider row budget ``batch_budget`` and a chunk floor); see the module docstring.
        chunk_floor: int32 ``[1]`` on q's device, plan ``"batch"`` only (ignored otherwise):
            the launch's chunk floor in tokens, ``split_table.batch_chunk_floor(lens,
            table.launch_ctas)`` of this batch's kept lengths at this layer. Read on the device,
            so a CUDA graph replays with the floor of each step.

    Returns:
        ``out``. A KV head whose group has 0 kept tokens gives zeros (never NaN).

    Raises:
        KernelError: a shape, dtype, device or stride does not match the above, an unknown
            ``plan``, or ``plan="batch"`` without ``chunk_floor``.

    Source: this module's docstring.
    """
    bs, num_qo_heads, gqa = _check_decode_args(
        q,
        k_pool,
        v_pool,
        page_table,
        group_len,
        req_rows,
        group_of_head,
        column_of_head,
        table,
        out,
        mid_o,
        mid_lse,
        plan,
        chunk_floor,
    )
    _checks.check_sm_scale(sm_scale)
    if bs == 0:
        return out
    head_dim, page_size = k_pool.shape[3], k_pool.shape[2]
    num_kv_heads = group_of_head.shape[0]
    batch = plan == "batch"
    plan_consts = {
        "NUM_KV_HEADS": num_kv_heads,
        "FIT_LENGTHS": plan != "table",
        "BATCH_FLOOR": batch,
    }
    if batch:
        budget, cap, ctas, floor = (
            table.batch_budget,
            table.batch_cap,
            table.batch_ctas,
            chunk_floor,
        )
    else:
        budget, cap, floor = table.cta_budget, table.split_cap, table.splits  # floor: unread
        ctas = table.fitted_ctas if plan == "lengths" else table.num_ctas
    _decode_stage1[(bs, ctas)](
        q,
        k_pool,
        v_pool,
        page_table,
        group_len,
        req_rows,
        group_of_head,
        column_of_head,
        table.splits,
        table.cta_head,
        table.cta_split,
        mid_o,
        mid_lse,
        floor,
        sm_scale * LOG2E,
        budget,
        cap,
        q.stride(0),
        q.stride(1),
        k_pool.stride(0),
        k_pool.stride(1),
        k_pool.stride(2),
        page_table.stride(0),
        page_table.stride(1),
        group_len.stride(0),
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        GQA_SIZE=gqa,
        GQA_PAD=max(MIN_GQA_PAD, triton.next_power_of_2(gqa)),
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        BLOCK_N=BLOCK_N,
        DOT_PRECISION=dot_precision(q.dtype),
        UPCAST_DOT=interpreted(),
        **plan_consts,
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    _decode_stage2[(bs, num_qo_heads)](
        mid_o,
        mid_lse,
        table.splits,
        group_len,
        req_rows,
        group_of_head,
        out,
        floor,
        budget,
        cap,
        group_len.stride(0),
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        out.stride(0),
        out.stride(1),
        GQA_SIZE=gqa,
        HEAD_DIM=head_dim,
        BLOCK_N=BLOCK_N,
        **plan_consts,
        num_warps=NUM_WARPS,
    )
    return out


__all__ = ["PLANS", "decode_scratch", "ragged_decode_attention"]
