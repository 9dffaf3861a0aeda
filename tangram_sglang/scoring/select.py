"""Top-k token selection per KV head, with sinks and the recent window always kept.

Runs per layer at prefill after a scorer: every head of a head group keeps the same number of
tokens ``k_g`` (the group's :func:`tangram_sglang.profile.kept_len`), each its OWN top-``k_g``.
Ties are broken deterministically: protected tokens (sinks, then the recent window) first, then
by score, then by lower token index. NaN scores rank last. A head never keeps 0 tokens.
"""

from __future__ import annotations

import torch

from tangram_sglang.errors import ConfigError


def protected_mask(
    num_tokens: int, sink_tokens: int, recent_window: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """bool ``[num_tokens]``: True for the first ``sink_tokens`` and last ``recent_window`` tokens.

    Args:
        num_tokens: segment length n (tokens).
        sink_tokens: always-kept first tokens (tokens, >= 0).
        recent_window: always-kept last tokens (tokens, >= 0).
        device: where to build the mask.
    """
    pos = torch.arange(num_tokens, device=device)
    return (pos < sink_tokens) | (pos >= num_tokens - recent_window)


def priority_key(
    scores: torch.Tensor,
    sink_tokens: int,
    recent_window: int,
    protected: torch.Tensor | None = None,
) -> torch.Tensor:
    """float32 copy of ``scores`` with protected tokens at +inf and NaN at -inf.

    Args:
        scores: shape ``[..., num_kv_heads, n]``, any float dtype.
        sink_tokens: always-kept first tokens.
        recent_window: always-kept last tokens.
        protected: :func:`protected_mask` of these sizes, if the caller holds it already (bool
            ``[n]`` on ``scores``' device); None: built here.
    """
    key = torch.nan_to_num(scores.float(), nan=float("-inf"))
    if protected is None:
        protected = protected_mask(scores.shape[-1], sink_tokens, recent_window, scores.device)
    return key.masked_fill_(protected, float("inf"))


def select_kept(scores: torch.Tensor, k: int, sink_tokens: int, recent_window: int) -> torch.Tensor:
    """Indices of the ``k`` tokens each KV head keeps, sorted ascending.

    Runs per layer at prefill (and in calibration).

    Args:
        scores: float ``[num_kv_heads, n]`` (optionally with leading batch dims
            ``[..., num_kv_heads, n]``), from :meth:`Scorer.score`; any device.
        k: tokens to keep per head (``1 <= k <= n``), normally ``profile.kept_len(n, ...)``.
        sink_tokens: the first ``sink_tokens`` tokens are kept whatever their score.
        recent_window: the last ``recent_window`` tokens are kept whatever their score.

    Returns:
        int64 ``[..., num_kv_heads, k]``, strictly increasing along the last dim. When ``k`` is
        smaller than the protected set, sinks come first, then the oldest window tokens.

    Raises:
        ConfigError: ``k`` outside ``[1, n]`` or negative sink/window sizes.

    Source: SnapKV (Li et al. 2024, arXiv 2404.14469) top-k selection; sinks from StreamingLLM
    (Xiao et al. 2023, arXiv 2309.17453); docs/design.md §7 (sinks and window survive ties).
    """
    n = scores.shape[-1]
    if not 1 <= k <= n:
        raise ConfigError(f"select_kept: k={k} must be in [1, n={n}]; no head may keep 0 tokens")
    if sink_tokens < 0 or recent_window < 0:
        raise ConfigError(
            f"select_kept: sink_tokens={sink_tokens} and recent_window={recent_window} must be >= 0"
        )
    key = priority_key(scores, sink_tokens, recent_window)
    # Stable descending sort: equal keys keep index order, so ties break towards lower indices.
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    return torch.sort(order[..., :k], dim=-1).values
