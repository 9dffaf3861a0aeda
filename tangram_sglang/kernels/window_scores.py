"""Triton observation-window scores of a padded bucket of segments, in one launch per layer.

The SnapKV-family selection (``backend.compress``) scores each segment's context tokens by the
mean attention its last ``w`` queries (the observation window) pay them. Done with torch ops on
a padded bucket, that is about 20 launches per layer (gathers of the window queries and of every
key, float32 copies, a product, the LSE subtraction, masks, exp, a weighted sum), plus a float32
copy of every key of the bucket; the selection is host-bound on an H200 (benchmarks/RESULTS.md,
issue 18). This kernel computes the same ``[b, H_q, N]`` scores in one launch, reading the keys
and queries in place through the bucket's index tensors.

For bucket row ``r``, query head ``h`` (KV head ``h // gqa``), padded position ``p``::

    logit[j]     = sm_scale * q[queries[r, j], h] . k[tokens[r, p], h // gqa]
    out[r, h, p] = sum_j scale[r, j] * exp(logit[j] - lse[queries[r, j], h])   if context[r, p]
                 = 0                                                             otherwise

with ``scale[r, j] = 1 / w_r`` on the row's window query slots and 0 elsewhere (a slot with
scale 0 contributes exactly 0, even where its logit would overflow). ``lse`` is the extend
kernel's log-sum-exp over history + segment, so each term is the softmax probability the
prefill itself computed (SnapKV, arXiv 2404.14469, §4, with the LSE normaliser of
``scoring.snapkv.window_attention``).

Grid ``(b, cdiv(N, BLOCK_N), H_q)``: each program holds ``BLOCK_N`` keys and loops over the
window in blocks of ``BLOCK_W`` queries; logits are never written to memory.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tangram_sglang.errors import KernelError
from tangram_sglang.kernels import _checks

BLOCK_N = 64  # keys per program
NUM_WARPS = 4


@triton.jit
def _key_block(
    k_ptr,
    tokens_ptr,
    scored_ptr,
    stride_k_t,
    stride_k_h,
    row,
    block,
    kv_head,
    N,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """A row's BLOCK_N padded positions: (offsets, in the row, scored, float32 keys [BLOCK_N, D]
    gathered through ``tokens``, 0 where not scored)."""
    offs_n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    in_row = offs_n < N
    scored = tl.load(scored_ptr + row * N + offs_n, mask=in_row, other=0) != 0
    token = tl.load(tokens_ptr + row * N + offs_n, mask=in_row, other=0)
    offs_d = tl.arange(0, HEAD_DIM)
    keys = tl.load(
        k_ptr + token[:, None] * stride_k_t + kv_head * stride_k_h + offs_d[None, :],
        mask=scored[:, None],
        other=0.0,
    ).to(tl.float32)
    return offs_n, in_row, scored, keys


@triton.jit(do_not_specialize=["N", "W"])
def _window_scores_kernel(
    q_ptr,
    k_ptr,
    lse_ptr,
    tokens_ptr,
    queries_ptr,
    query_scale_ptr,
    context_ptr,
    out_ptr,
    stride_q_t,
    stride_q_h,
    stride_k_t,
    stride_k_h,
    stride_lse_t,
    sm_scale,
    N,
    W,
    NUM_QO_HEADS: tl.constexpr,
    GQA: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """One (bucket row, block of BLOCK_N padded positions, query head)."""
    row = tl.program_id(0)
    block = tl.program_id(1)
    head = tl.program_id(2)
    offs_n, in_row, context, keys = _key_block(
        k_ptr,
        tokens_ptr,
        context_ptr,
        stride_k_t,
        stride_k_h,
        row,
        block,
        head // GQA,
        N,
        HEAD_DIM,
        BLOCK_N,
    )
    offs_d = tl.arange(0, HEAD_DIM)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for first in range(0, W, BLOCK_W):
        offs_w = first + tl.arange(0, BLOCK_W)
        in_window = offs_w < W
        query = tl.load(queries_ptr + row * W + offs_w, mask=in_window, other=0)
        scale = tl.load(query_scale_ptr + row * W + offs_w, mask=in_window, other=0.0)
        used = scale > 0
        q = tl.load(
            q_ptr + query[:, None] * stride_q_t + head * stride_q_h + offs_d[None, :],
            mask=used[:, None],
            other=0.0,
        ).to(tl.float32)  # [BLOCK_W, D]
        lse = tl.load(lse_ptr + query * stride_lse_t + head, mask=used, other=0.0)
        logits = tl.dot(q, tl.trans(keys), input_precision="ieee") * sm_scale
        probs = tl.where(used[:, None], tl.exp(logits - lse[:, None]), 0.0)
        acc += tl.sum(probs * scale[:, None], axis=0)
    acc = tl.where(context, acc, 0.0)
    tl.store(out_ptr + (row * NUM_QO_HEADS + head) * N + offs_n, acc, mask=in_row)


def supported(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether :func:`window_scores` takes these shapes: a head dim that is a power of two
    >= 16 (``tl.dot``), query heads a multiple of KV heads, a CUDA device or the interpreter."""
    dim = q.shape[-1]
    return (
        (q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")
        and dim >= 16
        and dim & (dim - 1) == 0
        and k.shape[-1] == dim
        and q.shape[1] % k.shape[1] == 0
    )


def _check_bucket(
    caller: str,
    q: torch.Tensor,
    k: torch.Tensor,
    lse: torch.Tensor,
    tokens: torch.Tensor,
    queries: torch.Tensor,
    scored: tuple[str, torch.Tensor],
) -> None:
    """Host checks shared by the launchers: q/k/lse of the batch, the bucket's int64 ``tokens``
    ``[b, N]`` and ``queries`` ``[b, W]``, and its bool ``[b, N]`` mask of scored positions.

    Raises:
        KernelError: naming the argument (and ``caller``) that does not fit.
    """
    device = q.device
    num_tokens, num_qo_heads, dim = q.shape
    num_kv_heads = k.shape[1]
    if not supported(q, k):
        raise KernelError(
            f"{caller}: head_dim {dim} must be a power of two >= 16, H_q {num_qo_heads} a "
            f"multiple of H_kv {num_kv_heads}, on CUDA (or TRITON_INTERPRET=1); use the torch path"
        )
    bsz, length = tokens.shape
    _checks.check_tensor("q", q, (None, num_qo_heads, dim), _checks.KV_DTYPES, device)
    _checks.check_tensor("k", k, (num_tokens, num_kv_heads, dim), (q.dtype,), device)
    _checks.check_tensor("lse", lse, (num_tokens, num_qo_heads), (torch.float32,), device)
    _checks.check_tensor("tokens", tokens, (bsz, length), (torch.int64,), device)
    _checks.check_tensor("queries", queries, (bsz, None), (torch.int64,), device)
    _checks.check_tensor(scored[0], scored[1], (bsz, length), (torch.bool,), device)


def window_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    lse: torch.Tensor,
    tokens: torch.Tensor,
    queries: torch.Tensor,
    query_scale: torch.Tensor,
    context: torch.Tensor,
    sm_scale: float,
) -> torch.Tensor:
    """Mean observation-window attention per context token of a padded bucket (module docstring).

    Args:
        q: ``[num_tokens, H_q, D]`` the batch's new queries (post-RoPE; bf16, fp16 or fp32).
        k: ``[num_tokens, H_kv, D]`` the batch's new keys (post-RoPE), same dtype.
        lse: float32 ``[num_tokens, H_q]`` extend-attention log-sum-exp (natural log).
        tokens: int64 ``[b, N]`` batch token index of each padded position (any value where
            ``context`` is False).
        queries: int64 ``[b, W]`` batch token index of each window query slot.
        query_scale: float32 ``[b, W]``: ``1 / w_r`` on the row's window slots, 0 elsewhere.
        context: bool ``[b, N]``: the position is a context token of the row (scored).
        sm_scale: softmax scale of the layer.

    Returns:
        float32 ``[b, H_q, N]``: the scores, 0 off context.

    Raises:
        KernelError: shapes, dtypes or devices that do not fit (host checks, no sync).
    """
    _check_bucket("window_scores", q, k, lse, tokens, queries, ("context", context))
    _checks.check_tensor("query_scale", query_scale, queries.shape, (torch.float32,), q.device)
    bsz, length = tokens.shape
    width = queries.shape[1]
    num_qo_heads = q.shape[1]
    out = torch.empty(bsz, num_qo_heads, length, dtype=torch.float32, device=q.device)
    if bsz == 0 or length == 0 or width == 0:
        return out.zero_()
    block_w = max(16, min(64, triton.next_power_of_2(width)))
    grid = (bsz, triton.cdiv(length, BLOCK_N), num_qo_heads)
    _window_scores_kernel[grid](
        q,
        k,
        lse,
        tokens.contiguous(),
        queries.contiguous(),
        query_scale.contiguous(),
        context.contiguous().view(torch.uint8),
        out,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        lse.stride(0),
        float(sm_scale),
        length,
        width,
        NUM_QO_HEADS=num_qo_heads,
        GQA=num_qo_heads // k.shape[1],
        HEAD_DIM=q.shape[2],
        BLOCK_N=BLOCK_N,
        BLOCK_W=block_w,
        num_warps=NUM_WARPS,
    )
    return out


@triton.jit(do_not_specialize=["N", "M", "band"])
def _query_max_kernel(
    q_ptr,
    k_ptr,
    lse_ptr,
    tokens_ptr,
    queries_ptr,
    query_pos_ptr,
    key_valid_ptr,
    out_ptr,
    stride_q_t,
    stride_q_h,
    stride_k_t,
    stride_k_h,
    stride_lse_t,
    sm_scale,
    N,
    M,
    band,
    NUM_QO_HEADS: tl.constexpr,
    GQA: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """One (bucket row, block of BLOCK_N padded positions, query head): max over queries."""
    row = tl.program_id(0)
    block = tl.program_id(1)
    head = tl.program_id(2)
    offs_n, in_row, valid, keys = _key_block(
        k_ptr,
        tokens_ptr,
        key_valid_ptr,
        stride_k_t,
        stride_k_h,
        row,
        block,
        head // GQA,
        N,
        HEAD_DIM,
        BLOCK_N,
    )
    offs_d = tl.arange(0, HEAD_DIM)
    best = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
    # slot j sits at position <= N - M + j (right-aligned slots): slots before
    # block * BLOCK_N + band - (N - M) count none of this block's keys
    skip = tl.maximum(block * BLOCK_N + band - (N - M), 0)
    for first in range(skip // BLOCK_M * BLOCK_M, M, BLOCK_M):
        offs_m = first + tl.arange(0, BLOCK_M)
        position = tl.load(query_pos_ptr + row * M + offs_m, mask=offs_m < M, other=-1)
        used = position >= 0
        query = tl.load(queries_ptr + row * M + offs_m, mask=used, other=0)
        q = tl.load(
            q_ptr + query[:, None] * stride_q_t + head * stride_q_h + offs_d[None, :],
            mask=used[:, None],
            other=0.0,
        ).to(tl.float32)  # [BLOCK_M, D]
        lse = tl.load(lse_ptr + query * stride_lse_t + head, mask=used, other=0.0)
        logits = tl.dot(q * sm_scale, tl.trans(keys), input_precision="ieee") - lse[:, None]
        counted = used[:, None] & ((position[:, None] - offs_n[None, :]) >= band)
        logits = tl.where(counted, logits, float("-inf"))
        best = tl.maximum(best, tl.max(logits, axis=0), propagate_nan=tl.PropagateNan.ALL)
    out = tl.where(valid, tl.exp(best), 0.0)
    tl.store(out_ptr + (row * NUM_QO_HEADS + head) * N + offs_n, out, mask=in_row)


def query_max_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    lse: torch.Tensor,
    tokens: torch.Tensor,
    queries: torch.Tensor,
    query_pos: torch.Tensor,
    key_valid: torch.Tensor,
    sm_scale: float,
    band: int,
) -> torch.Tensor:
    """KVzip-lite's per-token score of a padded bucket: the largest attention any later query pays.

    For bucket row ``r``, query head ``h`` and padded position ``p`` of a real token::

        out[r, h, p] = exp(max_j (sm_scale * q[queries[r, j], h] . k[tokens[r, p], h // gqa]
                                  - lse[queries[r, j], h]))
                       over the query slots j with query_pos[r, j] - p >= band

    and 0 where no slot counts or ``p`` is padding. Equals ``scoring.kvzip_lite.KVzipLiteScorer``
    before its pooling and GQA reduction (source: KVzip, arXiv 2505.23416, §3.2).

    Args:
        q: ``[num_tokens, H_q, D]`` the batch's new queries (post-RoPE).
        k: ``[num_tokens, H_kv, D]`` the batch's new keys (post-RoPE), same dtype.
        lse: float32 ``[num_tokens, H_q]`` extend-attention log-sum-exp.
        tokens: int64 ``[b, N]`` batch token index of each padded position.
        queries: int64 ``[b, M]`` batch token index of each scored query slot.
        query_pos: int64 ``[b, M]`` padded position of each slot's query (-1: unused slot),
            at most ``N - M + j`` in slot j (slots right-aligned, ascending, as
            ``backend.compress._make_query_bucket`` builds them: the kernel skips the slots that
            bound says count none of a key block; not checked, it would need a sync).
        key_valid: bool ``[b, N]``: the position holds a token of the row's segment.
        sm_scale: softmax scale of the layer.
        band: a query counts for a key only ``band`` or more positions later (tokens).

    Returns:
        float32 ``[b, H_q, N]`` in [0, 1].

    Raises:
        KernelError: shapes, dtypes or devices that do not fit (host checks, no sync).
    """
    _check_bucket("query_max_scores", q, k, lse, tokens, queries, ("key_valid", key_valid))
    _checks.check_tensor("query_pos", query_pos, queries.shape, (torch.int64,), q.device)
    bsz, length = tokens.shape
    slots = queries.shape[1]
    num_qo_heads = q.shape[1]
    out = torch.empty(bsz, num_qo_heads, length, dtype=torch.float32, device=q.device)
    if bsz == 0 or length == 0:
        return out
    if slots == 0:
        return out.zero_()
    grid = (bsz, triton.cdiv(length, BLOCK_N), num_qo_heads)
    _query_max_kernel[grid](
        q,
        k,
        lse,
        tokens.contiguous(),
        queries.contiguous(),
        query_pos.contiguous(),
        key_valid.contiguous().view(torch.uint8),
        out,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        lse.stride(0),
        float(sm_scale),
        length,
        slots,
        int(band),
        NUM_QO_HEADS=num_qo_heads,
        GQA=num_qo_heads // k.shape[1],
        HEAD_DIM=q.shape[2],
        BLOCK_N=BLOCK_N,
        BLOCK_M=max(16, min(32, triton.next_power_of_2(slots))),
        num_warps=NUM_WARPS,
    )
    return out
