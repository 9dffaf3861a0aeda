"""Triton observation-window scores (``kernels.window_scores``) against the torch bucket path.

On CPU the kernel runs through ``TRITON_INTERPRET=1`` (tests/kernels/conftest.py); on a GPU the
same tests run compiled. The oracle is ``backend.compress``'s torch path and
``reference_kept_indices`` (one scorer call per request).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tangram_sglang.backend import compress
from tangram_sglang.backend.compress import batch_kept_indices, reference_kept_indices
from tangram_sglang.errors import KernelError
from tangram_sglang.kernels.window_scores import query_max_scores, window_scores
from tangram_sglang.scoring import get_scorer
from tangram_sglang.scoring.kvzip_lite import KVzipLiteScorer

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GQA, H_KV, D = 2, 2, 16


def _batch(lengths, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(total, GQA * H_KV, D, generator=gen).to(DEVICE, dtype)
    k = torch.randn(total, H_KV, D, generator=gen).to(DEVICE, dtype)
    lse = (torch.randn(total, GQA * H_KV, generator=gen).abs() + 3.0).to(DEVICE)
    bounds = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    return q, k, lse, bounds


def _bucket(lengths, window):
    lengths = np.asarray(lengths, np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    size = int(compress._bucket_sizes(lengths).max())
    rows = np.arange(lengths.size)
    return compress._make_bucket(rows, size, starts, lengths, (window, 2, 4), torch.device(DEVICE))


@pytest.mark.parametrize("lengths", [[70], [70, 100, 33, 128], [20, 5, 90], [300, 64, 65]])
@pytest.mark.parametrize("window", [8, 32, 100])  # 100: several blocks of window queries
def test_window_scores_equal_the_torch_bucket_path(lengths, window):
    q, k, lse, _ = _batch(lengths, window)
    b = _bucket(lengths, window)
    got = window_scores(q, k, lse, b.tokens, b.queries, b.query_scale, b.context, 0.3)
    # the torch path's attention, as compress._window_bucket_scores computes it before pooling
    bsz, width, length = b.queries.shape[0], b.window, b.length
    q_obs = q[b.queries].float().permute(0, 2, 1, 3).reshape(bsz, H_KV, -1, D)
    logits = torch.matmul(q_obs, k[b.tokens].float().permute(0, 2, 3, 1)) * 0.3
    logits = logits.view(bsz, GQA * H_KV, width, length)
    lse_obs = torch.where(b.query_valid, lse[b.queries].float().transpose(1, 2), 0.0)
    probs = (logits - lse_obs.unsqueeze(-1)).masked_fill(b.masked, float("-inf")).exp()
    want = torch.matmul(b.query_scale.view(bsz, 1, 1, width), probs).squeeze(2)
    want = torch.where(b.context.unsqueeze(1), want, 0.0)
    assert got.shape == want.shape == (bsz, GQA * H_KV, length)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert (got[~b.context.unsqueeze(1).expand_as(got)] == 0).all()


@pytest.mark.parametrize("scorer_name", ["snapkv", "ada-snapkv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selection_with_the_kernel_equals_the_reference(scorer_name, dtype):
    """The whole batched selection through the kernel keeps the reference's tokens."""
    _assert_kernel_selection(
        get_scorer(scorer_name), [70, 200, 33, 130, 0, 257, 90, 64], dtype, 7, 1
    )


def _assert_kernel_selection(scorer, lengths, dtype, data_seed, rng_seed, sink=4, recent=8):
    """The batched selection through the kernels keeps the reference's tokens."""
    q, k, lse, bounds = _batch(lengths, data_seed, dtype)
    rng = np.random.default_rng(rng_seed)
    kept = [[int(rng.integers(1, n + 1)) if n else 1 for _ in range(H_KV)] for n in lengths]
    want = reference_kept_indices(scorer, q, k, lse, bounds, kept, 0.3, sink, recent)
    compress._PLANS.clear()
    got = batch_kept_indices(scorer, q, k, lse, bounds, kept, 0.3, sink, recent, window_kernel=True)
    assert torch.equal(got, want)


def test_a_window_slot_with_scale_zero_adds_nothing_even_where_exp_overflows():
    lengths = [40, 10]
    q, k, lse, _ = _batch(lengths, 3)
    b = _bucket(lengths, 32)  # row 1 has 10 tokens: 22 of its 32 slots unused (scale 0)
    lse_bad = lse.clone()
    lse_bad[0] = -1e4  # token 0 is the index of row 1's unused slots: exp would overflow
    got = window_scores(q, k, lse_bad, b.tokens, b.queries, b.query_scale, b.context, 0.3)
    assert torch.isfinite(got).all()


def test_bad_shapes_are_named():
    q, k, lse, _ = _batch([40], 0)
    b = _bucket([40], 8)
    with pytest.raises(KernelError, match="lse"):
        window_scores(q, k, lse[:, :1], b.tokens, b.queries, b.query_scale, b.context, 0.3)
    with pytest.raises(KernelError, match="head_dim"):
        window_scores(
            q[..., :12], k[..., :12], lse, b.tokens, b.queries, b.query_scale, b.context, 0.3
        )
    with pytest.raises(KernelError, match="context"):
        window_scores(q, k, lse, b.tokens, b.queries, b.query_scale, b.context.int(), 0.3)


@pytest.mark.parametrize(
    "scorer",
    [
        KVzipLiteScorer(max_queries=24, local_band=8),
        KVzipLiteScorer(max_queries=0, local_band=0, kernel_size=3, pooling="max"),
        KVzipLiteScorer(
            max_queries=16, local_band=4, kernel_size=5, pooling="avg", gqa_reduce="mean"
        ),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kvzip_lite_selection_with_the_kernel_equals_the_reference(scorer, dtype):
    """Mixed lengths (one under the band, one under the slot bound) in query-max buckets."""
    _assert_kernel_selection(scorer, [70, 200, 6, 33, 0, 130, 64], dtype, 11, 2, sink=2, recent=5)
    plans = list(compress._PLANS.values())
    assert plans and all(b.query_pos is not None for p in plans for b in p.buckets)


def test_query_max_scores_equal_the_scorer_on_one_segment():
    n = 90
    q, k, lse, _ = _batch([n], 5)
    scorer = KVzipLiteScorer(max_queries=20, local_band=6)
    lengths = np.array([n])
    bucket = compress._make_query_bucket(
        np.array([0]), 128, np.array([0]), lengths, scorer, (1 << 30, 2, 4), torch.device(DEVICE)
    )
    got = query_max_scores(
        q, k, lse, bucket.tokens, bucket.queries, bucket.query_pos, bucket.key_valid, 0.3, 6
    )
    assert got.shape == (1, GQA * H_KV, 128)
    assert (got[..., : 128 - n] == 0).all()  # padding
    # the scorer without its GQA reduction: one query head per KV head (gqa 1)
    one = KVzipLiteScorer(max_queries=20, local_band=6, gqa_reduce="max")
    for head in range(GQA * H_KV):
        kv = head // GQA
        want = one.score(
            q[:, head : head + 1].transpose(0, 1)[None],
            k[:, kv : kv + 1].transpose(0, 1)[None],
            0.3,
            lse_obs=lse[:, head : head + 1].transpose(0, 1)[None],
        )[0, 0]
        torch.testing.assert_close(got[0, head, 128 - n :], want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    ("max_queries", "band", "earliest_wins"),
    [(0, 0, False), (0, 8, False), (24, 4, False), (0, 19, True), (0, 51, True)],
)
def test_query_max_scores_equal_the_torch_path_on_a_mixed_bucket(max_queries, band, earliest_wins):
    """Every value of a mixed bucket of several key blocks (the kernel skips the slots that
    count none of a block; the torch path skips the keys no block of slots counts).

    ``earliest_wins``: near-zero queries and an LSE falling with the query's position, so the
    largest score of every key comes from the EARLIEST query that counts it, the one a skip
    bound one slot too eager would drop (band 19: a key block starts on a slot-block edge)."""
    lengths = [300, 70, 200, 33, 257]
    q, k, lse, bounds = _batch(lengths, 7)
    if earliest_wins:
        q = q * 0.01
        pos = torch.cat([torch.arange(n, dtype=torch.float32) for n in lengths]).to(DEVICE)
        lse = (0.1 * pos - 20.0).unsqueeze(1).expand_as(lse).contiguous()
    scorer = KVzipLiteScorer(max_queries=max_queries, local_band=band)
    starts = np.asarray(bounds[:-1])
    bucket = compress._make_query_bucket(
        np.arange(len(lengths)),
        512,
        starts,
        np.asarray(lengths),
        scorer,
        (1 << 30, 2, 4),
        torch.device(DEVICE),
    )
    got = query_max_scores(
        q, k, lse, bucket.tokens, bucket.queries, bucket.query_pos, bucket.key_valid, 0.3, band
    )
    want = compress._query_max_attention(q, k, lse, bucket, 0.3, band)
    assert got.shape == want.shape == (len(lengths), GQA * H_KV, 512)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    real = bucket.key_valid.unsqueeze(1).expand_as(want)
    assert (want[real] > 0).float().mean() > 0.5  # most real tokens are counted by some query


def test_window_scores_at_llama_head_shapes():
    """head_dim 128 and GQA 4 (the served 8B shapes), bfloat16, against the torch path."""
    gen = torch.Generator().manual_seed(9)
    lengths, hq, hkv, dim = [150, 90, 200], 8, 2, 128
    total = sum(lengths)
    q = torch.randn(total, hq, dim, generator=gen).to(DEVICE, torch.bfloat16)
    k = torch.randn(total, hkv, dim, generator=gen).to(DEVICE, torch.bfloat16)
    lse = (torch.randn(total, hq, generator=gen).abs() + 6.0).to(DEVICE)
    b = _bucket(lengths, 32)
    got = window_scores(q, k, lse, b.tokens, b.queries, b.query_scale, b.context, 0.088)
    want = compress._window_attention(q, k, lse, b, 0.088)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
