"""``eval.allocation.group_allocation``: a request's kept counts, group by group, inside the
profile's total (what a Tangram server could trade without changing its footprint)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram_sglang.errors import TangramError
from tangram_sglang.eval.allocation import group_allocation
from tangram_sglang.eval.systems import profile_kept_counts
from tangram_sglang.profile import BudgetProfile

PROFILE = BudgetProfile.load("calibration/qwen2.5-0.5b/kvzip-lite-r0.5.json")
CLUSTER = np.asarray(PROFILE.grouping.cluster_of)
SIZE = np.bincount(CLUSTER.ravel())


def _static(n: int) -> np.ndarray:
    return PROFILE.group_kept_array(n).astype(np.int64)[CLUSTER]


def _random_scores(n: int, seed: int, scale: float) -> np.ndarray:
    """Scores ``[layers, kv_heads, n]``: uniform per token, times a log-normal level per head."""
    rng = np.random.default_rng(seed)
    levels = np.exp(scale * rng.standard_normal(CLUSTER.shape))
    return rng.random((*CLUSTER.shape, n)) * levels[..., None]


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 600), seed=st.integers(0, 2**32 - 1), scale=st.floats(0.0, 4.0))
def test_counts_stay_inside_the_profiles_total_and_floor(n, seed, scale):
    scores = _random_scores(n, seed, scale)
    kept = group_allocation(scores, PROFILE)
    floor = min(n, PROFILE.sink_tokens + PROFILE.recent_window)
    assert kept.shape == CLUSTER.shape and kept.dtype == np.int64
    assert kept.min() >= floor and kept.max() <= n
    for g in range(SIZE.size):  # the heads of a group share their pages: one count
        assert len(set(kept[g == CLUSTER].tolist())) == 1
    total = int(_static(n).sum())  # kept_len never falls below the floor
    assert total - (SIZE.max() - 1) <= kept.sum() <= total


def test_the_groups_a_request_attends_to_take_the_memory():
    n = 512
    rng = np.random.default_rng(0)
    scores = rng.random((*CLUSTER.shape, n)) * 1e-3
    rich = int(CLUSTER[3, 0])  # a group of a middle layer: its heads score high on every token
    scores[rich == CLUSTER] += 1.0
    kept, static = group_allocation(scores, PROFILE), _static(n)
    assert (kept[rich == CLUSTER] == n).all() and (static[rich == CLUSTER] < n).all()
    rest = int(static.sum()) - n * int(SIZE[rich])  # the other groups share what is left
    assert rest - SIZE.max() < kept[rich != CLUSTER].sum() <= rest
    # scores equal across groups and tokens: no group's marginal beats another's, the order
    # (stable) then fills groups in index order, within the same total
    flat = group_allocation(np.ones((*CLUSTER.shape, n)), PROFILE)
    assert abs(int(flat.sum()) - int(static.sum())) < SIZE.max()


def test_scores_of_another_head_layout_are_refused():
    with pytest.raises(TangramError, match=r"scores shape .* \[layers, kv_heads, n >= 1\]"):
        group_allocation(np.zeros((CLUSTER.shape[0], CLUSTER.shape[1] + 1, 8)), PROFILE)
    with pytest.raises(TangramError, match="scores have 2 dims .* they must be 3-D"):
        group_allocation(np.zeros(CLUSTER.shape), PROFILE)
    with pytest.raises(TangramError, match="they must be 3-D"):
        profile_kept_counts(PROFILE, np.zeros(CLUSTER.shape), "static")


def test_per_head_splits_the_same_total_head_by_head():
    n = 300
    rng = np.random.default_rng(1)
    scores = rng.random((*CLUSTER.shape, n)) ** (1 + 4 * rng.random((*CLUSTER.shape, 1)))
    kept = group_allocation(scores, PROFILE, per_head=True)
    total = int(_static(n).sum())
    assert kept.sum() == total  # one head per group: every entry of the total is placed
    paired = [len(set(kept[g == CLUSTER].tolist())) for g in range(SIZE.size)]
    assert max(paired) > 1  # heads that share a group's pages in the profile now differ


def _unprotected(scores: np.ndarray, profile: BudgetProfile) -> np.ndarray:
    n = scores.shape[-1]
    keep = np.ones(n, dtype=bool)
    keep[: profile.sink_tokens] = False
    keep[max(0, n - profile.recent_window) :] = False
    return scores[..., keep]


def test_groups_of_mixed_sizes_take_their_ranks_by_mean_marginal():
    """SmolLM2's profile has groups of 4 and of 2 heads: a group's rank costs |g| entries and
    is worth the MEAN of its heads' scores at that rank; the taken ranks are the best by it."""
    profile = BudgetProfile.load("calibration/smollm2/kvzip-lite-r0.5.json")
    cluster = np.asarray(profile.grouping.cluster_of)
    size = np.bincount(cluster.ravel())
    assert len(set(size.tolist())) > 1
    n = 200
    rng = np.random.default_rng(7)
    scores = rng.random((*cluster.shape, n)) ** (1 + 3 * rng.random((*cluster.shape, 1)))
    kept = group_allocation(scores, profile)
    floor = profile.sink_tokens + profile.recent_window
    ranked = -np.sort(-_unprotected(scores, profile), axis=-1)
    taken, left = [], []
    for g in range(size.size):
        heads = ranked[cluster == g]  # [|g|, n - floor]
        k = int(kept[cluster == g][0]) - floor
        means = heads.mean(axis=0)
        taken += means[:k].tolist()
        left += means[k:].tolist()
    assert min(taken) > max(left)


def test_per_head_keeps_the_global_best_unprotected_entries():
    n = 160
    rng = np.random.default_rng(3)
    scores = rng.random((*CLUSTER.shape, n))
    kept = group_allocation(scores, PROFILE, per_head=True)
    floor = PROFILE.sink_tokens + PROFILE.recent_window
    free = _unprotected(scores, PROFILE)
    room = int(_static(n).sum()) - floor * CLUSTER.size
    cut = -np.sort(-free.ravel())[room - 1]  # the room-th best unprotected score of all heads
    assert ((free >= cut).sum(axis=-1) + floor == kept).all()


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 600), seed=st.integers(0, 2**32 - 1), scale=st.floats(0.0, 4.0))
def test_a_per_layer_split_keeps_each_layers_own_total(n, seed, scale):
    scores = _random_scores(n, seed, scale)
    kept = group_allocation(scores, PROFILE, per_head=True, per_layer=True)
    floor = min(n, PROFILE.sink_tokens + PROFILE.recent_window)
    assert kept.shape == CLUSTER.shape and kept.min() >= floor and kept.max() <= n
    # every layer keeps exactly what the static profile gives it (heads of one size: no slack)
    assert kept.sum(axis=1).tolist() == _static(n).sum(axis=1).tolist()


def test_a_per_layer_split_moves_entries_inside_a_layer_only():
    n = 512
    scores = np.full((*CLUSTER.shape, n), 1e-3)
    scores[3, 0] += 1.0  # one head of layer 3 scores high on every token
    kept, static = group_allocation(scores, PROFILE, True, True), _static(n)
    assert kept[3, 0] == n and static[3, 0] < n
    others = [layer for layer in range(CLUSTER.shape[0]) if layer != 3]
    assert kept[others].sum(axis=1).tolist() == static[others].sum(axis=1).tolist()
    assert kept[3].sum() == static[3].sum()  # layer 3's other heads gave the entries up
    with pytest.raises(TangramError, match="per_layer=True needs per_head=True"):
        group_allocation(scores, PROFILE, per_layer=True)
