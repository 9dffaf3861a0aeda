"""Triton KVzip replay scores (``kernels.replay_scores``) against the torch scorer.

On CPU the kernel runs through ``TRITON_INTERPRET=1`` (tests/kernels/conftest.py); on a GPU the
same tests run compiled, and the GPU-only case checks bfloat16 inputs at Llama-3.1-8B's head
shapes through the backend's dispatch (``backend.replay.replay_token_scores``). The oracle is
``scoring.kvzip.KVzipScorer.score`` (float32 torch ops).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tangram_sglang.backend.replay import replay_layout, replay_token_scores
from tangram_sglang.errors import KernelError
from tangram_sglang.kernels.replay_scores import replay_max_scores
from tangram_sglang.scoring.kvzip import KVzipScorer
from tangram_sglang.scoring.snapkv import reduce_gqa

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _replay(m, n, h_kv, group, dim, seed, dtype=torch.float32):
    """A flat batch of one row in the logical order (segment, then replay): views as the
    backend passes them, and the replay queries' LSE over the segment and the replay."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n + m, h_kv * group, dim, generator=gen)
    k = torch.randn(n + m, h_kv, dim, generator=gen)
    # each replay query's LSE over all keys it sees (the segment and the replay up to it)
    logits = torch.einsum("thd,shd->hts", q, k.repeat_interleave(group, dim=1)) * dim**-0.5
    causal = torch.ones(n + m, n + m).tril().bool()
    lse = logits.masked_fill(~causal, float("-inf")).logsumexp(-1).T.contiguous()  # [T, H_q]
    q, k, lse = q.to(DEVICE, dtype), k.to(DEVICE, dtype), lse.to(DEVICE)
    return (
        q[n:].transpose(0, 1),  # [H_q, m, D], strided
        k[:n].transpose(0, 1),  # [H_kv, n, D]
        lse[n:].T,  # [H_q, m], strided
    )


TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}


# (130, 257): several blocks of queries and of keys, both ragged (BLOCK_M 64, BLOCK_N 128)
@pytest.mark.parametrize(
    ("m", "n", "group"), [(1, 1, 1), (70, 100, 2), (130, 257, 2), (200, 64, 4), (64, 128, 1)]
)
def test_replay_max_scores_equal_the_torch_scorer(m, n, group):
    q, k, lse = _replay(m, n, 2, group, 16, seed=m + n)
    got = replay_max_scores(q, k, lse, 16**-0.5)
    assert got.shape == (2 * group, n) and got.dtype == torch.float32
    for how in ("max", "mean"):
        want = KVzipScorer(gqa_reduce=how).score(q, k, 16**-0.5, lse)
        torch.testing.assert_close(reduce_gqa(got, 2, how), want, rtol=1e-4, atol=1e-6)
    assert ((got >= 0) & (got <= 1 + 1e-5)).all()  # probabilities of the prefill's softmax


@pytest.mark.parametrize(
    ("dtype", "dim"), [(torch.float32, 128), (torch.bfloat16, 64), (torch.float16, 128)]
)
def test_replay_max_scores_at_model_head_dims_and_dtypes(dtype, dim):
    """The torch scorer on the same (rounded) inputs; 16-bit products are the kernel's own."""
    q, k, lse = _replay(70, 130, 2, 2, dim, seed=dim, dtype=dtype)
    got = replay_max_scores(q, k, lse, dim**-0.5)
    want = KVzipScorer().score(q, k, dim**-0.5, lse)
    torch.testing.assert_close(reduce_gqa(got, 2, "max"), want, rtol=TOL[dtype], atol=1e-6)


def test_replay_max_scores_keep_nan_as_the_torch_scorer_does():
    """Compiled, ``tl.maximum`` drops NaN unless told otherwise (the interpreter's numpy keeps
    it either way, so this case tells the two apart on a GPU only)."""
    q, k, lse = _replay(70, 130, 2, 2, 16, seed=3)
    q = q.clone()
    q[1, 5, 0] = float("nan")  # one replay query of query head 1 (KV head 0)
    got = replay_max_scores(q, k, lse, 0.25)
    want = KVzipScorer(gqa_reduce="max").score(q, k, 0.25, lse)
    assert got[1].isnan().all() and not got[[0, 2, 3]].isnan().any()
    assert torch.equal(reduce_gqa(got, 2, "max").isnan(), want.isnan())


def test_replay_max_scores_of_empty_sides():
    q, k, lse = _replay(5, 3, 2, 2, 16, seed=0)
    empty = replay_max_scores(q, k[:, :0], lse, 0.25)
    assert empty.shape == (4, 0)
    no_replay = replay_max_scores(q[:, :0], k, lse[:, :0], 0.25)
    assert no_replay.shape == (4, 3) and (no_replay == 0).all()


def test_replay_max_scores_refuse_bad_inputs():
    q, k, lse = _replay(5, 3, 2, 2, 16, seed=0)
    with pytest.raises(KernelError, match="power of two"):
        replay_max_scores(q[..., :12], k[..., :12], lse, 0.25)
    with pytest.raises(KernelError, match="the same D"):
        replay_max_scores(q, k[..., :8].repeat(1, 1, 4), lse, 0.25)
    with pytest.raises(KernelError, match=r"q \['list'\] must be a tensor"):
        replay_max_scores(q.tolist(), k, lse, 0.25)
    with pytest.raises(KernelError, match="H_q a multiple of"):
        replay_max_scores(q[:3], k, lse[:3], 0.25)
    with pytest.raises(KernelError, match="lse has dtype"):
        replay_max_scores(q, k, lse.double(), 0.25)
    with pytest.raises(KernelError, match="lse"):
        replay_max_scores(q, k, lse[:, :4], 0.25)
    with pytest.raises(KernelError, match="k has dtype"):
        replay_max_scores(q, k.double(), lse, 0.25)
    with pytest.raises(KernelError, match="sm_scale"):
        replay_max_scores(q, k, lse, float("nan"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("gqa_reduce", ["max", "mean"])
def test_backend_scores_bf16_replay_like_the_float32_scorer(gqa_reduce):
    """Llama-3.1-8B heads (32 query, 8 KV, D 128), bfloat16, two replayed rows of a batch: the
    kernel path's kept sets match the float32 torch scorer's (the selection is what matters)."""
    flat, replay = np.array([1100, 300, 700]), np.array([600, 0, 380])
    layout = replay_layout(flat, replay, "cuda")
    gen = torch.Generator().manual_seed(0)
    total = int(flat.sum())
    q = torch.randn(total, 32, 128, generator=gen).cuda().bfloat16()
    k = torch.randn(total, 8, 128, generator=gen).cuda().bfloat16()
    lse = (torch.randn(total, 32, generator=gen).abs() + 6.0).cuda()
    scorer = KVzipScorer(gqa_reduce=gqa_reduce)
    got = replay_token_scores(scorer, q, k, lse, layout, 128**-0.5)
    for (start, n, m), cols in (
        ((0, 500, 600), slice(0, 500)),
        ((1400, 320, 380), slice(800, 1120)),
    ):
        want = scorer.score(
            q[start + n : start + n + m].float().transpose(0, 1),
            k[start : start + n].float().transpose(0, 1),
            128**-0.5,
            lse[start + n : start + n + m].T,
        )
        torch.testing.assert_close(got[:, cols], want, rtol=0.05, atol=1e-6)
        kept = n // 4
        same = [
            len(
                set(got[h, cols].topk(kept).indices.tolist())
                & set(want[h].topk(kept).indices.tolist())
            )
            for h in range(8)
        ]
        assert min(same) >= 0.95 * kept, same
