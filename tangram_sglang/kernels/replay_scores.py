"""Triton KVzip scores of one replayed segment: the largest probability any replay query pays.

KVzip (Kim et al. 2025, arXiv 2505.23416, §3.2) scores each key of a segment by the largest
softmax probability any query of the segment's replay (the repeat prompt and the segment read
again) pays it. Done with torch ops (``scoring.kvzip.KVzipScorer.score``), that is a float32
product of every replay query with every segment key, ``H_q * m * n`` logits written to memory
and read back three times (the LSE subtraction, the max, the exp), on CUDA cores: on an H100 the
torch path took about four fifths of a 16k-token prefill (benchmarks/RESULTS.md, issue 20). This
kernel computes the same ``[H_q, n]`` maxima the way flash attention computes a row of attention:
each program holds a block of keys in registers and streams the replay queries through tensor
cores (``tl.dot`` in the inputs' dtype, float32 accumulation, as the extend attention kernel
itself computes these logits); logits never reach memory.

For query head ``h`` (KV head ``h // gqa``) and segment key ``j``::

    out[h, j] = exp(max_u (sm_scale * q[h, u] . k[h // gqa, j] - lse[h, u]))

over every replay query ``u`` (all of them follow the segment, so none is masked). ``lse`` is
the extend kernel's log-sum-exp of each replay query over everything it attends to, so each term
is a probability of the prefill's own softmax.

Grid ``(cdiv(n, BLOCK_N), H_q)``: each program holds ``BLOCK_N`` keys of one KV head and loops
over the ``m`` replay queries of one query head in blocks of ``BLOCK_M``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tangram_sglang.errors import KernelError
from tangram_sglang.kernels import _checks

BLOCK_N = 128  # keys per program
BLOCK_M = 64  # replay queries per step of a program's loop
NUM_WARPS = 8
NUM_STAGES = 2


@triton.jit
def _replay_max_kernel(
    q_ptr,
    k_ptr,
    lse_ptr,
    out_ptr,
    stride_q_h,
    stride_q_t,
    stride_k_h,
    stride_k_t,
    stride_lse_h,
    stride_lse_t,
    sm_scale,
    M,
    N,
    GQA: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """One (block of BLOCK_N segment keys, query head): the max over all replay queries."""
    block = tl.program_id(0)
    head = tl.program_id(1)
    offs_n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    in_seg = offs_n < N
    offs_d = tl.arange(0, HEAD_DIM)
    keys = tl.load(
        k_ptr + (head // GQA) * stride_k_h + offs_n[:, None] * stride_k_t + offs_d[None, :],
        mask=in_seg[:, None],
        other=0.0,
    )  # [BLOCK_N, D], the inputs' dtype
    best = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
    for first in range(0, M, BLOCK_M):
        offs_m = first + tl.arange(0, BLOCK_M)
        in_replay = offs_m < M
        q = tl.load(
            q_ptr + head * stride_q_h + offs_m[:, None] * stride_q_t + offs_d[None, :],
            mask=in_replay[:, None],
            other=0.0,
        )  # [BLOCK_M, D]
        lse = tl.load(
            lse_ptr + head * stride_lse_h + offs_m * stride_lse_t, mask=in_replay, other=0.0
        )
        logits = tl.dot(q, tl.trans(keys)) * sm_scale - lse[:, None]  # float32 [BLOCK_M, BLOCK_N]
        logits = tl.where(in_replay[:, None], logits, float("-inf"))
        best = tl.maximum(best, tl.max(logits, axis=0))
    tl.store(out_ptr + head * N + offs_n, tl.exp(best), mask=in_seg)


def supported(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether :func:`replay_max_scores` takes these ``[H, tokens, D]`` tensors: a head dim that
    is a power of two >= 16 (``tl.dot``), query heads a multiple of KV heads, a CUDA device or
    the interpreter (``TRITON_INTERPRET=1``)."""
    dim = q.shape[-1]
    return (
        (q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")
        and q.dim() == 3
        and k.dim() == 3
        and dim >= 16
        and dim & (dim - 1) == 0
        and k.shape[-1] == dim
        and q.shape[0] % k.shape[0] == 0
    )


def replay_max_scores(
    q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, sm_scale: float
) -> torch.Tensor:
    """KVzip's per-query-head score of one segment's keys from its replay (module docstring).

    Args:
        q: ``[H_q, m, D]`` post-RoPE queries of the replay tokens (float16, bfloat16 or float32;
            any strides with a contiguous last dim, e.g. a transposed slice of the batch's
            ``[T, H_q, D]`` queries).
        k: ``[H_kv, n, D]`` post-RoPE keys of the segment, ``q``'s dtype (same stride rule).
        lse: float32 ``[H_q, m]``: each replay query's natural-log LSE over everything it
            attends to (the extend kernel's).
        sm_scale: softmax scale of the layer.

    Returns:
        float32 ``[H_q, n]`` in [0, 1] (the max before KVzip's GQA reduction). Equal to
        ``scoring.kvzip.KVzipScorer.score`` before ``reduce_gqa``, up to the dot products'
        precision (the inputs' dtype, float32 accumulation).

    Raises:
        KernelError: shapes, dtypes or devices that do not fit (host checks, no sync).
    """
    if not supported(q, k):
        raise KernelError(
            f"replay_max_scores: q {list(q.shape)} must be [H_q, m, D] and k {list(k.shape)} "
            "[H_kv, n, D] with D a power of two >= 16 and H_q a multiple of H_kv, on CUDA (or "
            "TRITON_INTERPRET=1); use scoring.kvzip.KVzipScorer.score"
        )
    num_qo_heads, m, dim = q.shape
    num_kv_heads, n = k.shape[0], k.shape[1]
    _checks.check_tensor("q", q, (num_qo_heads, m, dim), _checks.KV_DTYPES, q.device)
    _checks.check_tensor("k", k, (num_kv_heads, n, dim), (q.dtype,), q.device)
    _checks.check_tensor(
        "lse", lse, (num_qo_heads, m), (torch.float32,), q.device, last_dim_contiguous=False
    )
    out = torch.empty(num_qo_heads, n, dtype=torch.float32, device=q.device)
    if n == 0:
        return out
    if m == 0:
        return out.zero_()
    grid = (triton.cdiv(n, BLOCK_N), num_qo_heads)
    _replay_max_kernel[grid](
        q,
        k,
        lse,
        out,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        lse.stride(0),
        lse.stride(1),
        float(sm_scale),
        m,
        n,
        GQA=num_qo_heads // num_kv_heads,
        HEAD_DIM=dim,
        BLOCK_N=BLOCK_N,
        BLOCK_M=BLOCK_M,
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    return out
