"""Fit static per-head budgets from observed retention, and measure how stable they are.

``r = clip(mean + alpha * std, floor, 1)`` per (layer, kv_head) over the samples (Tangram arXiv
2606.06302, Budget Reservation: alpha = 2 over 50 pilot samples). The stability report gives the
figures the paper's premise rests on: how input-invariant the head ranking is (Spearman rank
correlation of each sample against the mean of the others; mean and min), how narrow each head's
band is (share of heads with std < 0.05), what the profile keeps at the calibration lengths
compared with the target, and how much the head-group map pads (share of allocated slots no head
needs) for H_p in {1, 2, 4, 8} in both scopes.

This module is numpy/scipy only; it never runs a model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.stats import spearmanr

from tangram_sglang.errors import ConfigError, ProfileError
from tangram_sglang.grouping import SCOPES, HeadGrouping
from tangram_sglang.profile import kept_len

WASTE_HEADS_PER_GROUP = (1, 2, 4, 8)
STD_NARROW = 0.05  # a head whose retention std is below this has a "narrow band" (Tangram code)


@dataclass(frozen=True, slots=True)
class Fit:
    """Result of :func:`fit_ratios`; float64 ``[num_layers, num_kv_heads]`` arrays."""

    mean: np.ndarray
    std: np.ndarray
    ratio: np.ndarray


def fit_ratios(retention: np.ndarray, alpha: float = 2.0, floor: float = 0.01) -> Fit:
    """Per-head static ratio ``clip(mean + alpha * std, floor, 1)``.

    Args:
        retention: float ``[num_samples, num_layers, num_kv_heads]`` observed retention in [0, 1].
        alpha: safety coefficient (paper: 2).
        floor: smallest ratio (in (0, 1]); a profile ratio must be > 0.

    Raises:
        ConfigError: empty input, NaN, or floor outside (0, 1].
    """
    retention = np.asarray(retention, dtype=np.float64)
    if retention.ndim != 3 or retention.shape[0] < 1:
        raise ConfigError(f"retention must be [num_samples>=1, L, H_kv], got {retention.shape}")
    if not np.isfinite(retention).all():
        raise ConfigError("retention holds NaN/inf; a sample's observation failed")
    if not 0.0 < floor <= 1.0 or not math.isfinite(alpha):
        raise ConfigError(f"floor={floor} must be in (0, 1] and alpha={alpha} finite")
    mean = retention.mean(axis=0)
    std = retention.std(axis=0, ddof=1) if retention.shape[0] > 1 else np.zeros_like(mean)
    return Fit(mean, std, np.clip(mean + alpha * std, floor, 1.0))


def rank_stability(retention: np.ndarray) -> tuple[float, float]:
    """(mean, min) Spearman rho between each sample's head ranking and the others' mean.

    Returns NaN when fewer than 2 samples or a constant ranking (uniform allocation).
    """
    retention = np.asarray(retention, dtype=np.float64)
    num_samples = retention.shape[0]
    if num_samples < 2:
        return math.nan, math.nan
    flat = retention.reshape(num_samples, -1)
    total = flat.sum(axis=0)
    rhos = []
    for i in range(num_samples):
        others = (total - flat[i]) / (num_samples - 1)
        if np.ptp(flat[i]) == 0 or np.ptp(others) == 0:
            return math.nan, math.nan
        rhos.append(spearmanr(flat[i], others).statistic)
    return float(np.mean(rhos)), float(np.min(rhos))


def padding_waste(ratio: np.ndarray, heads_per_group: int, scope: str) -> float | None:
    """Share of the slots a head-group map allocates that no head needs (long-segment limit).

    A group allocates ``H_p * max(member ratios)`` per token; its heads need the sum of their
    ratios; the empty columns of a partial last group count as waste.

    Returns:
        waste in [0, 1), or None when the map cannot be built (H_p not dividing H_kv for
        ``per_layer``).
    """
    try:
        grouping = HeadGrouping.build(ratio, heads_per_group, scope)
    except ProfileError:
        return None
    allocated = heads_per_group * grouping.group_ratios(ratio).sum()
    return max(0.0, float(1.0 - ratio.sum() / allocated))


def expected_kept_fraction(
    ratio: np.ndarray, grouping: HeadGrouping | None, lengths: list[int], sink: int, window: int
) -> float:
    """Kept share of the full KV at the given segment lengths (per head, or per group if given).

    Args:
        ratio: float ``[num_layers, num_kv_heads]``.
        grouping: when given, every head keeps its group's length (the allocation).
        lengths: segment lengths n (tokens), e.g. the calibration samples'.
        sink: sink tokens; window: recent window (tokens).
    """
    per_head = ratio if grouping is None else grouping.group_ratios(ratio)[grouping.cluster_of]
    flat = per_head.ravel()
    kept = sum(sum(kept_len(n, float(r), sink, window) for r in flat) for n in lengths)
    return kept / (flat.size * sum(lengths))


def stability_report(
    retention: np.ndarray,
    fit: Fit,
    lengths: list[int],
    target_ratio: float,
    sink: int,
    window: int,
    grouping: HeadGrouping,
) -> dict[str, object]:
    """All calibration figures, JSON-ready (stored in the profile's provenance).

    Args:
        retention: float ``[num_samples, num_layers, num_kv_heads]``.
        fit: the fitted ratios.
        lengths: the samples' token counts.
        target_ratio: the calibration target.
        sink: sink tokens; window: recent window (tokens).
        grouping: the profile's head-group map.
    """
    rho_mean, rho_min = rank_stability(retention)
    half = max(1, retention.shape[0] // 2)
    waste = {
        scope: {str(hp): padding_waste(fit.ratio, hp, scope) for hp in WASTE_HEADS_PER_GROUP}
        for scope in SCOPES
    }
    target_kept = sum(kept_len(n, target_ratio, sink, window) for n in lengths) / sum(lengths)
    return {
        "spearman_mean": _json_float(rho_mean),
        "spearman_min": _json_float(rho_min),
        "frac_std_below_0.05": float((fit.std < STD_NARROW).mean()),
        "mean_observed_retention": float(retention.mean()),
        "mean_ratio": float(fit.ratio.mean()),
        "target_kept_fraction": target_kept,
        "expected_kept_fraction_heads": expected_kept_fraction(
            fit.ratio, None, lengths, sink, window
        ),
        "expected_kept_fraction_groups": expected_kept_fraction(
            fit.ratio, grouping, lengths, sink, window
        ),
        "padding_waste": waste,
        "split_half_mean": [
            retention[:half].mean(axis=0).round(5).tolist(),
            retention[half:].mean(axis=0).round(5).tolist() if retention.shape[0] > 1 else None,
        ],
    }


def _json_float(x: float) -> float | None:
    return None if math.isnan(x) else float(x)
