"""Synthetic budget profiles for tests and capacity reports (no model, no calibration run).

``make_profile`` wraps a given ratio matrix; ``skewed_profile`` draws a realistic skewed one
until calibrated profiles ship under ``calibration/``. Shape of the draw, per KV head:

    m_h = target * exp(N(0, sigma^2) - sigma^2 / 2)    mean observed retention (mean = target)
    m_h = max(m_h, dense_floor)   for the first ``dense_layers`` layers (they attend broadly)
    r_h = clip(m_h + alpha * spread * m_h, floor, 1)   calibrated ratio, mean + alpha * std

so most heads keep little, a long tail of heads keeps a lot, and the mean kept fraction is above
the target (mean + 2 std), as AdaKV / HeadKV report for real models (Tangram arXiv 2606.06302,
Budget Reservation: per-head budgets are skewed and input-invariant).
"""

from __future__ import annotations

import numpy as np

from tangram_sglang.grouping import HeadGrouping
from tangram_sglang.profile import BudgetProfile, ModelIdentity

# (num_layers, num_kv_heads, num_qo_heads, head_dim) of models people serve.
GEOMETRIES = {
    "llama3-8b": (32, 8, 32, 128),
    "qwen2.5-0.5b": (24, 2, 14, 64),
    "smollm2": (30, 3, 9, 64),
}


def make_profile(
    ratio: np.ndarray | list[list[float]],
    heads_per_group: int = 1,
    scope: str = "per_layer",
    sink_tokens: int = 0,
    recent_window: int = 0,
    head_dim: int = 8,
    gqa_size: int = 1,
    architecture: str = "synthetic",
) -> BudgetProfile:
    """A profile with the given ``ratio [num_layers, num_kv_heads]`` and budget-aware grouping.

    Args:
        ratio: kept fraction per (layer, KV head), each in (0, 1].
        heads_per_group: H_p, KV heads sharing one page table.
        scope: ``"per_layer"`` or ``"global"`` head groups.
        sink_tokens: always-kept first tokens of each segment.
        recent_window: always-kept last tokens of each segment.
        head_dim: D of the synthetic model.
        gqa_size: query heads per KV head.
        architecture: the model identity's architecture name.

    Returns:
        The profile; its target ratio is the mean of ``ratio``.
    """
    ratio = np.asarray(ratio, dtype=np.float64)
    num_layers, num_kv_heads = ratio.shape
    model = ModelIdentity(architecture, num_layers, num_kv_heads, num_kv_heads * gqa_size, head_dim)
    grouping = HeadGrouping.build(ratio, heads_per_group, scope)
    return BudgetProfile(
        model=model,
        scorer="ada-snapkv",
        target_ratio=float(ratio.mean()),
        ratio=ratio,
        sink_tokens=sink_tokens,
        recent_window=recent_window,
        grouping=grouping,
        provenance={"source": "synthetic"},
    )


def skewed_profile(
    geometry: str = "llama3-8b",
    target_ratio: float = 0.25,
    heads_per_group: int = 4,
    scope: str = "global",
    sink_tokens: int = 4,
    recent_window: int = 64,
    seed: int = 0,
    sigma: float = 0.9,
    spread: float = 0.25,
    alpha: float = 2.0,
    dense_layers: int = 2,
    dense_floor: float = 0.6,
    floor: float = 0.02,
) -> BudgetProfile:
    """A seeded synthetic profile with a skewed (log-normal) per-head ratio distribution."""
    num_layers, num_kv_heads, num_qo_heads, head_dim = GEOMETRIES[geometry]
    rng = np.random.default_rng(seed)
    mean = target_ratio * np.exp(rng.normal(0.0, sigma, (num_layers, num_kv_heads)) - sigma**2 / 2)
    mean[:dense_layers] = np.maximum(mean[:dense_layers], dense_floor)
    ratio = np.clip(mean * (1.0 + alpha * spread), floor, 1.0)
    profile = make_profile(
        ratio,
        heads_per_group,
        scope,
        sink_tokens,
        recent_window,
        head_dim,
        num_qo_heads // num_kv_heads,
        f"synthetic-{geometry}",
    )
    provenance = {
        "source": "synthetic skewed",
        "geometry": geometry,
        "seed": seed,
        "sigma": sigma,
        "spread": spread,
        "alpha": alpha,
    }
    return BudgetProfile(
        **{n: getattr(profile, n) for n in BudgetProfile.__dataclass_fields__}
        | {"target_ratio": target_ratio, "provenance": provenance}
    )
