"""The batched kept-token selection equals the per-request, per-k_g oracle (backend.compress)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tangram_sglang.backend.compress import (
    batch_kept_indices,
    kept_from_ranks,
    reference_kept_indices,
)
from tangram_sglang.scoring.select import priority_key, select_kept
from tangram_sglang.scoring.snapkv import SnapKVScorer

GQA, H_KV, D = 2, 3, 8


def _batch(lengths, seed):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(total, GQA * H_KV, D, generator=gen)
    k = torch.randn(total, H_KV, D, generator=gen)
    lse = torch.randn(total, GQA * H_KV, generator=gen).abs() + 3.0
    bounds = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    return q, k, lse, bounds


@pytest.mark.parametrize(
    "lengths",
    [[40], [40, 40, 40], [40, 17, 17, 5, 40], [3, 0, 30], [64, 64, 9]],
)
@pytest.mark.parametrize("kernel_size", [1, 5])
def test_batched_selection_equals_the_reference(lengths, kernel_size):
    rng = np.random.default_rng(sum(lengths) + kernel_size)
    scorer = SnapKVScorer(obs_window=4, kernel_size=kernel_size)
    q, k, lse, bounds = _batch(lengths, kernel_size)
    kept = [[int(rng.integers(1, n + 1)) if n else 1 for _ in range(H_KV)] for n in lengths]
    kept[0][0] = lengths[0]  # one head keeps the whole segment
    want = reference_kept_indices(scorer, q, k, lse, bounds, kept, 0.3, 2, 3)
    got = batch_kept_indices(scorer, q, k, lse, bounds, kept, 0.3, 2, 3)
    dev = batch_kept_indices(
        scorer, q, k, lse, bounds, kept, 0.3, 2, 3, torch.tensor(kept, dtype=torch.int64)
    )
    assert got.shape == want.shape == (len(lengths), H_KV, max(max(r) for r in kept))
    assert torch.equal(got, want) and torch.equal(dev, want)


def test_whole_segment_kept_by_every_head_skips_scoring():
    scorer = SnapKVScorer(obs_window=4, kernel_size=1)
    q, k, lse, bounds = _batch([6, 10], 0)
    out = batch_kept_indices(scorer, q, k, lse, bounds, [[6, 6, 6], [2, 10, 4]], 0.3, 1, 1)
    assert out[0, :, :6].tolist() == [list(range(6))] * 3 and out[0, :, 6:].abs().sum() == 0
    assert out[1, 1].tolist() == list(range(10))
    assert out[1, 0, 2:].abs().sum() == 0  # 0-padded past k


def test_kept_from_ranks_matches_select_kept_with_ties_and_nan():
    scores = torch.tensor(
        [[1.0, 3.0, 3.0, float("nan"), 0.5, 3.0, 2.0, 2.0], [0.0] * 8, [5, 4, 3, 2, 1, 0, -1, -2]]
    )
    key = priority_key(scores, 1, 1)
    kept = torch.tensor([3, 5, 2])
    out = kept_from_ranks(key, kept, 5)
    for h, kh in enumerate(kept.tolist()):
        assert out[h, :kh].tolist() == select_kept(scores[h : h + 1], kh, 1, 1)[0].tolist()
        assert out[h, kh:].abs().sum() == 0


def test_extend_metadata_builds_every_layers_kept_counts_once():
    from tangram_sglang.backend import metadata as md

    kept = np.array([[5, 2, 7], [3, 1, 4]])  # [bs, G]
    group_of_head = np.array([[0, 2, 2], [1, 0, 1]])  # [L, H_kv]
    meta = md.extend_metadata([3, 4], [9, 6], kept, "cpu", group_of_head)
    assert meta.host_rows == (3, 4)
    for lid in range(2):
        host, dev = meta.layer_kept(lid, group_of_head[lid])
        assert host.tolist() == kept[:, group_of_head[lid]].tolist() == dev.tolist()
    plain = md.extend_metadata([3, 4], [9, 6], kept, "cpu")
    host, dev = plain.layer_kept(1, group_of_head[1])
    assert dev is None and host.tolist() == [[2, 5, 2], [1, 3, 1]]


@pytest.mark.parametrize("bad", [0, 7], ids=["zero", "above-n"])
def test_kept_counts_outside_one_to_n_raise(bad):
    from tangram_sglang.errors import KernelError

    scorer = SnapKVScorer(obs_window=4, kernel_size=1)
    q, k, lse, bounds = _batch([6, 6], 0)
    with pytest.raises(KernelError, match=r"\[1, n=6\]"):
        batch_kept_indices(scorer, q, k, lse, bounds, [[2, 3, 4], [2, bad, 4]], 0.3, 1, 1)
