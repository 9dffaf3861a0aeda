"""Ada-SnapKV: SnapKV scores with adaptive (cross-head) budget allocation inside a layer.

AdaKV gives a layer a total budget of ``num_kv_heads * k`` tokens and lets heads compete for it:
the layer keeps its top ``num_kv_heads * k`` (head, token) pairs, after a safeguard reserves each
head's own top ``max(1, int(alpha_safeguard * k))`` tokens. kvpress ``AdaKVPress`` implements it by
masking (it frees no memory). In Tangram the allocation runs only at calibration, per request, to
observe each head's retention; the server then uses the static per-head profile budgets and this
scorer's :meth:`score` (identical to SnapKV's) to pick each head's own top-``k_g``.

Source: Ada-KV (Feng et al. 2024, arXiv 2407.11550) Alg. 1; kvpress 0.5.5
``presses/adakv_press.py`` (alpha_safeguard 0.2); Tangram arXiv 2606.06302 §Budget Reservation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tangram_sglang.errors import ConfigError
from tangram_sglang.scoring.base import register_scorer
from tangram_sglang.scoring.select import priority_key
from tangram_sglang.scoring.snapkv import SnapKVScorer

ALPHA_SAFEGUARD = 0.2  # kvpress AdaKVPress default: every head keeps >= 20% of the mean budget


@dataclass(frozen=True, slots=True)
class AdaSnapKVScorer(SnapKVScorer):
    """SnapKV scores; budgets from :func:`adaptive_select` at calibration, static when serving."""

    alpha_safeguard: float = ALPHA_SAFEGUARD
    name: str = "ada-snapkv"


def adaptive_select(
    scores: torch.Tensor,
    budget_per_head: int,
    alpha_safeguard: float = ALPHA_SAFEGUARD,
    sink_tokens: int = 0,
    recent_window: int = 0,
) -> torch.Tensor:
    """AdaKV allocation: the layer's top ``H_kv * budget_per_head`` (head, token) pairs.

    Runs at calibration, once per layer per sample.

    Args:
        scores: float ``[..., num_kv_heads, n]`` from a scorer (one layer).
        budget_per_head: mean tokens per head k (``1 <= k <= n``); the layer keeps ``H_kv * k``.
        alpha_safeguard: each head first keeps its own top ``max(1, int(alpha * k))`` tokens.
        sink_tokens: first tokens of every head always kept (count inside the budget).
        recent_window: last tokens of every head always kept (count inside the budget).

    Returns:
        bool ``[..., num_kv_heads, n]``: the kept (head, token) pairs; every head keeps >= 1.

    Raises:
        ConfigError: budget outside ``[1, n]`` or alpha outside [0, 1].
    """
    num_kv_heads, n = scores.shape[-2], scores.shape[-1]
    if not 1 <= budget_per_head <= n:
        raise ConfigError(f"budget_per_head={budget_per_head} must be in [1, n={n}]")
    if not 0.0 <= alpha_safeguard <= 1.0:
        raise ConfigError(f"alpha_safeguard={alpha_safeguard} must be in [0, 1]")
    key = priority_key(scores, sink_tokens, recent_window)
    n_safe = int(budget_per_head * alpha_safeguard)
    n_safe = max(1, n_safe) if alpha_safeguard > 0 else 0
    if n_safe:
        safe = torch.sort(key, dim=-1, descending=True, stable=True).indices[..., :n_safe]
        key = key.scatter(-1, safe, float("inf"))
    flat = key.reshape(*key.shape[:-2], num_kv_heads * n)
    order = torch.sort(flat, dim=-1, descending=True, stable=True).indices
    kept = order[..., : num_kv_heads * budget_per_head]
    mask = torch.zeros_like(flat, dtype=torch.bool).scatter(-1, kept, True)
    return mask.reshape(key.shape)


register_scorer("ada-snapkv", AdaSnapKVScorer)
