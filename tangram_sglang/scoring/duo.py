"""DuoAttention-style split: retrieval heads keep everything, streaming heads keep sink + window.

DuoAttention learns one gate per KV head offline and serves retrieval heads with the full KV and
streaming heads with only attention sinks and recent tokens. Without its training data we use
the calibration-free proxy that the gate approximates: a head's *non-local attention mass* (the
share of the window queries' attention that lands outside the sinks and the recent window, from
the SnapKV scores). At calibration the heads with the largest mass become retrieval heads until
the target ratio is met (:func:`retrieval_heads`); the profile then holds ratio ~1 for them and
~0 for the others. Inside a budget, tokens are ranked by the SnapKV score.

Source: DuoAttention (Xiao et al. 2024, arXiv 2410.10819) §3; StreamingLLM sinks
(arXiv 2309.17453).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tangram_sglang.errors import ConfigError
from tangram_sglang.scoring.base import register_scorer
from tangram_sglang.scoring.snapkv import SnapKVScorer


@dataclass(frozen=True, slots=True)
class DuoScorer(SnapKVScorer):
    """SnapKV token scores; head classes from :func:`nonlocal_mass` + :func:`retrieval_heads`."""

    name: str = "duo"


def nonlocal_mass(
    scores: torch.Tensor, sink_tokens: int, recent_window: int, obs_window: int
) -> torch.Tensor:
    """Per KV head, the window's attention mass outside sinks, recent window and obs window.

    Args:
        scores: float ``[..., num_kv_heads, n]`` SnapKV scores (mean attention per token; the
            last ``obs_window`` entries are padding and are excluded).
        sink_tokens: always-kept first tokens.
        recent_window: always-kept last tokens.
        obs_window: the scorer's observation window.

    Returns:
        float32 ``[..., num_kv_heads]`` in [0, 1] (approximately; pooling smooths the edges).
    """
    n = scores.shape[-1]
    end = n - max(recent_window, obs_window)
    if end <= sink_tokens:
        return torch.zeros(scores.shape[:-1], dtype=torch.float32, device=scores.device)
    return scores[..., sink_tokens:end].float().sum(dim=-1)


def retrieval_heads(mass: torch.Tensor, ratio: float) -> torch.Tensor:
    """bool ``[num_layers, num_kv_heads]``: the ``ceil(ratio * L * H_kv)`` heads with most mass.

    Raises:
        ConfigError: ratio outside (0, 1].
    """
    if not 0.0 < ratio <= 1.0:
        raise ConfigError(f"ratio={ratio} must be in (0, 1]")
    flat = mass.reshape(-1)
    count = math.ceil(ratio * flat.numel() - 1e-9)
    order = torch.sort(flat, descending=True, stable=True).indices[:count]
    return torch.zeros_like(flat, dtype=torch.bool).scatter(0, order, True).reshape(mass.shape)


register_scorer("duo", DuoScorer)
