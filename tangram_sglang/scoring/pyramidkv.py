"""PyramidKV: SnapKV scores with a per-layer budget that shrinks linearly with depth.

Lower layers attend broadly and get more tokens, upper layers fewer; every head of a layer keeps
the same count. In Tangram the schedule is a static profile (one ratio per layer, the same for its
heads); :func:`pyramid_layer_budget` reproduces kvpress's formula exactly for the cross-check.

Source: PyramidKV (Cai et al. 2024, arXiv 2406.02069) §3; kvpress 0.5.5
``presses/pyramidkv_press.py`` (``beta`` = 20, from KVCache-Factory).
"""

from __future__ import annotations

from dataclasses import dataclass

from tangram_sglang.errors import ConfigError
from tangram_sglang.scoring.base import register_scorer
from tangram_sglang.scoring.snapkv import SnapKVScorer

BETA = 20  # PyramidKV / kvpress default: the top layer keeps 1/beta of the mean non-window part


@dataclass(frozen=True, slots=True)
class PyramidKVScorer(SnapKVScorer):
    """SnapKV scores; the per-layer budgets come from :func:`pyramid_layer_budget`."""

    beta: int = BETA
    name: str = "pyramidkv"


def pyramid_layer_budget(
    layer: int, num_layers: int, num_tokens: int, ratio: float, obs_window: int, beta: int = BETA
) -> int:
    """Tokens every head of ``layer`` keeps of a ``num_tokens`` prefill (kvpress formula).

    Args:
        layer: layer index in ``[0, num_layers)``.
        num_layers: layers of the model.
        num_tokens: prefill length n (tokens).
        ratio: mean kept fraction (kvpress ``1 - compression_ratio``).
        obs_window: SnapKV observation window (tokens).
        beta: pyramid steepness (>= 1).

    Returns:
        The layer's kept count (tokens, >= 1); falls back to ``round(n * ratio)`` when the
        pyramid does not fit (short inputs), as kvpress does.

    Raises:
        ConfigError: beta < 1 or layer out of range.
    """
    if beta < 1 or not 0 <= layer < num_layers:
        raise ConfigError(f"beta={beta} must be >= 1 and layer={layer} in [0, {num_layers})")
    max_capacity = obs_window + num_tokens * ratio
    min_num = (max_capacity - obs_window) / beta
    max_num = (max_capacity - obs_window) * 2 - min_num
    if max_num >= num_tokens - obs_window:
        max_num = num_tokens - obs_window
        min_num = (max_capacity - obs_window) * 2 - max_num
    if not (num_tokens >= max_num >= min_num >= obs_window):
        return max(1, round(num_tokens * ratio))
    steps = (max_num - min_num) / (num_layers - 1) if num_layers > 1 else 0.0
    return round(max_num - layer * steps)


register_scorer("pyramidkv", PyramidKVScorer)
