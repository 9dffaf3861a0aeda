"""Per-request kept counts at a profile's head-group granularity, inside the profile's total.

A Tangram profile gives every head group ``g`` a static kept length ``k_g(n)`` for a segment of
``n`` tokens (``BudgetProfile.group_kept_array``); the heads of a group share their pages, so
they keep the same count. KVzip and Ada-SnapKV instead split a request's budget by the request's
own scores. :func:`group_allocation` is the allocation a Tangram server could make without
changing its memory footprint: the request keeps the profile's total number of KV entries
(``sum_g |g| * k_g(n)``, what admission reserves), and the groups trade entries inside that
total by the request's scores, every head of a group keeping the same count.

The accuracy harness uses it (``eval.systems``: ``kvzip-group-alloc``, ``kvzip-head-alloc``,
``kvzip-lite-group-alloc``, ``kvzip-lite-head-alloc``) to tell how much of the gap between a
static profile and a per-request method the allocation alone closes, before the server is asked
to do it.

Rule. Every head keeps its sinks and recent window (``p = min(n, sink + window)`` entries: the
floor of every group). The rest of the total, ``R = total - p * num_heads``, goes in the order of
a group's marginal value: the ``t``-th best unprotected score of the group, averaged over its
heads (``m_g[t]``, non-increasing in ``t``), costs ``|g|`` entries. The ``(g, t)`` pairs are
taken in descending ``m_g[t]`` up to the first that does not fit in ``R`` (so each group takes a
prefix of its ranks). With groups of one size (the shipped Qwen2.5 profiles; ``per_head``) that
maximises the kept score mass; with mixed sizes it is the fractional knapsack's greedy, within
``max |g| - 1`` entries of its optimum. Scores must be comparable across layers, as KVzip's
are (it ranks every layer and head in one competition; KVzip, arXiv 2505.23416) and as the
``kvzip-lite`` profiles were calibrated (``calibrate.observe``: allocation ``global``).
"""

from __future__ import annotations

import numpy as np

from tangram_sglang.errors import TangramError
from tangram_sglang.profile import BudgetProfile


def group_allocation(
    scores: np.ndarray, profile: BudgetProfile, per_head: bool = False, per_layer: bool = False
) -> np.ndarray:
    """Kept entries per KV head of one request's segment, group by group, by its own scores.

    Args:
        scores: float ``[num_layers, num_kv_heads, n]``: the request's score of every (layer,
            KV head, token) of the segment (higher = keep), comparable across layers.
        profile: the budgets: its grouping (``cluster_of``), ``group_kept_array(n)`` (the
            total to keep) and its sinks and recent window (always kept).
        per_head: split the same total head by head instead (every head its own group: what
            pages of one KV head each would allow; KVzip's own granularity).
        per_layer: with ``per_head``, split each layer's own total among that layer's heads
            only (the layer keeps what the static profile gives it): the split a server can
            make while it writes each layer's K/V in that layer's forward, before later layers
            have scored.

    Returns:
        int64 ``[num_layers, num_kv_heads]``: each head's kept count, equal within a group,
        between ``min(n, sink + window)`` and ``n``; the sum is at most the profile's total for
        ``n`` tokens (per layer with ``per_layer``) and at least that total minus
        ``max |g| - 1`` (``kept_len`` never falls below the floor).

    Raises:
        TangramError: ``scores`` is not 3-D, its head layout is not the profile's, or it has no
            tokens (:func:`check_scores`); ``per_layer`` without ``per_head`` (a group of a
            ``global`` profile spans layers).
    """
    scores = check_scores(scores, profile).astype(np.float64)
    cluster = np.asarray(profile.grouping.cluster_of, dtype=np.int64)
    n = scores.shape[2]
    static = profile.group_kept_array(n).astype(np.int64)[cluster]  # [L, H]
    if per_layer:
        if not per_head:
            raise TangramError(
                "group_allocation: per_layer=True needs per_head=True (a head group of a "
                "global profile spans layers, so it has no per-layer share)"
            )
        heads = np.arange(cluster.shape[1]).reshape(1, -1)
        return np.concatenate(
            [
                _compete(scores[layer : layer + 1], heads, int(static[layer].sum()), profile)
                for layer in range(scores.shape[0])
            ]
        )
    if per_head:
        cluster = np.arange(cluster.size).reshape(cluster.shape)
    return _compete(scores, cluster, int(static.sum()), profile)


def _compete(
    scores: np.ndarray, cluster: np.ndarray, total: int, profile: BudgetProfile
) -> np.ndarray:
    """The module docstring's rule: ``total`` entries among the groups ``cluster`` (int
    ``[L, H]``) of ``scores`` (float64 ``[L, H, n]``), each group a prefix of its ranks.
    Returns int64 ``[L, H]``."""
    n = scores.shape[2]
    num_groups = int(cluster.max()) + 1
    size = np.bincount(cluster.ravel(), minlength=num_groups)
    protected = np.zeros(n, dtype=bool)
    protected[: profile.sink_tokens] = True
    protected[max(0, n - profile.recent_window) :] = True
    floor = int(protected.sum())
    room = total - floor * int(size.sum())
    kept = np.full(num_groups, floor, dtype=np.int64)
    if room > 0 and floor < n:
        # each head's unprotected scores, best first; a group's marginal: their mean per rank
        ranked = -np.sort(-scores[:, :, ~protected], axis=-1)  # [L, H, n - floor]
        marginal = np.zeros((num_groups, n - floor))
        np.add.at(marginal, cluster.ravel(), ranked.reshape(-1, n - floor))
        marginal /= size[:, None]
        order = np.argsort(-marginal, axis=None, kind="stable")  # (g, t) pairs, best first
        cost = np.cumsum(size[order // (n - floor)])
        taken = order[cost <= room] // (n - floor)
        kept += np.bincount(taken, minlength=num_groups)
    return kept[cluster]


def check_scores(scores: np.ndarray, profile: BudgetProfile) -> np.ndarray:
    """``scores`` as a numpy array, checked to be ``[num_layers, num_kv_heads, n]`` with the
    profile's ``[num_layers, num_kv_heads]`` (its ``grouping.cluster_of``) and ``n >= 1``.

    Raises:
        TangramError: another number of dims, another head layout, or no tokens.
    """
    scores = np.asarray(scores)
    layout = np.shape(profile.grouping.cluster_of)
    if scores.ndim != 3:
        raise TangramError(
            f"scores have {scores.ndim} dims (shape {scores.shape}); they must be 3-D: "
            f"[layers, kv_heads, n] with [layers, kv_heads] = {layout}, the profile's grouping"
        )
    if scores.shape[:2] != layout or scores.shape[2] < 1:
        raise TangramError(
            f"scores shape {scores.shape} must be [layers, kv_heads, n >= 1] with "
            f"[layers, kv_heads] = {layout}, the profile's grouping"
        )
    return scores
