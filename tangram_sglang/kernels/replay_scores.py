"""Triton KVzip scores of one replayed segment: the largest probability any replay query pays.

KVzip (Kim et al. 2025, arXiv 2505.23416, §3.2) scores each key of a segment by the largest
softmax probability any query of the segment's replay (the repeat prompt and the segment read
again) pays it. Done with torch ops (``scoring.kvzip.KVzipScorer.score``), that is a float32
product of every replay query with every segment key, ``H_q * m * n`` logits written to memory
and read back three times (the LSE subtraction, the max, the exp), on CUDA cores: on an H100 the
torch path took about three fifths of a 16k-token prefill (benchmarks/RESULTS.md, issue 20).
This kernel computes the same ``[H_q, n]`` maxima the way flash attention computes a row of
attention: each program holds a block of keys and streams the replay queries through tensor
cores (``_triton_common.mma``: bfloat16/float16 products with float32 accumulation, as the
extend attention kernel computes these logits; exact float32 products for float32 inputs);
logits never reach memory. A NaN anywhere in a key's products makes its score NaN, as in the
torch scorer.

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
from tangram_sglang.kernels._triton_common import dot_precision, interpreted, mma

BLOCK_N = 128  # keys per program
BLOCK_M = 64  # replay queries per step of a program's loop
NUM_WARPS = 8
NUM_STAGES = 2
# the largest head dim: a program's keys and two stages of queries stay within an H100's
# shared memory up to 128 float32 (or 256 16-bit) lanes; larger heads take the torch scorer
MAX_HEAD_DIM = 128


@triton.jit
def _max_keep_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


# the lengths change with every segment: no compile per length class (==1, % 16) mid-serving
# M, N: per segment; lse_ptr: a slice of the batch's LSE at a row offset, whose 16-byte
# alignment follows the offset's parity when H_q is odd (read with stride H_q, so no
# vectorised load is lost)
@triton.jit(do_not_specialize=["M", "N"], do_not_specialize_on_alignment=["lse_ptr"])
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
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """One (block of BLOCK_N segment keys, query head): the max over all replay queries."""
    block = tl.program_id(0)
    head = tl.program_id(1)
    offs_n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    in_seg = offs_n < N
    offs_d = tl.arange(0, HEAD_DIM)
    # int64 token offsets: a long replay's m * stride passes 2^31 elements
    keys = tl.load(
        k_ptr
        + (head // GQA) * stride_k_h
        + offs_n.to(tl.int64)[:, None] * stride_k_t
        + offs_d[None, :],
        mask=in_seg[:, None],
        other=0.0,
    )  # [BLOCK_N, D], the inputs' dtype
    best = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
    for first in range(0, M, BLOCK_M):
        offs_m = first + tl.arange(0, BLOCK_M)
        in_replay = offs_m < M
        q = tl.load(
            q_ptr + head * stride_q_h + offs_m.to(tl.int64)[:, None] * stride_q_t + offs_d[None, :],
            mask=in_replay[:, None],
            other=0.0,
        )  # [BLOCK_M, D]
        lse = tl.load(
            lse_ptr + head * stride_lse_h + offs_m.to(tl.int64) * stride_lse_t,
            mask=in_replay,
            other=0.0,
        )
        # float32 [BLOCK_M, BLOCK_N]
        logits = mma(q, tl.trans(keys), DOT_PRECISION, UPCAST_DOT) * sm_scale - lse[:, None]
        logits = tl.where(in_replay[:, None], logits, float("-inf"))
        best = _max_keep_nan(best, tl.reduce(logits, 0, _max_keep_nan))
    tl.store(out_ptr + head * N + offs_n, tl.exp(best), mask=in_seg)


def supported(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether :func:`replay_max_scores` takes these ``[H, tokens, D]`` tensors: a head dim that
    is a power of two in [16, :data:`MAX_HEAD_DIM`] (``tl.dot``, shared memory), at least one KV
    head and query heads a multiple of them, a CUDA device or the interpreter
    (``TRITON_INTERPRET=1``)."""
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)):
        return False
    if q.dim() != 3 or k.dim() != 3:
        return False
    dim = q.shape[-1]
    return (
        (q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")
        and 16 <= dim <= MAX_HEAD_DIM
        and dim & (dim - 1) == 0
        and k.shape[-1] == dim
        and k.shape[0] >= 1
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
        float32 ``[H_q, n]`` in [0, 1] (the max before KVzip's GQA reduction); zeros when
        ``m == 0`` and an empty ``[H_q, 0]`` when ``n == 0``. Equal to
        ``scoring.kvzip.KVzipScorer.score`` before ``reduce_gqa``, up to the dot products'
        precision (16-bit inputs: their own dtype with float32 accumulation).

    Raises:
        KernelError: shapes, dtypes, devices or a softmax scale that do not fit (host checks,
            no sync).
    """
    if not supported(q, k):
        shapes = [list(getattr(t, "shape", [type(t).__name__])) for t in (q, k)]
        raise KernelError(
            f"replay_max_scores: q {shapes[0]} must be a tensor [H_q, m, D] and k {shapes[1]} "
            f"a tensor [H_kv, n, D] with the same D, a power of two in [16, {MAX_HEAD_DIM}], and "
            "H_q a multiple of H_kv >= 1, on CUDA (or TRITON_INTERPRET=1); use "
            "scoring.kvzip.KVzipScorer.score"
        )
    _checks.check_sm_scale(sm_scale)
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
        DOT_PRECISION=dot_precision(q.dtype),
        UPCAST_DOT=interpreted(),
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    return out
