"""Top-k token selection per KV head, with sinks and the recent window always kept.

Runs per layer at prefill after a scorer: every head of a head group keeps the same number of
tokens ``k_g`` (the group's :func:`tangram_sglang.profile.kept_len`), each its OWN top-``k_g``.
Ties are broken deterministically: protected tokens (sinks, then the recent window) first, then
by score, then by lower token index. NaN scores rank last. A head never keeps 0 tokens.
"""

from __future__ import annotations

import torch

from tangram_sglang.errors import ConfigError, KernelError


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


def window_union(
    primary: torch.Tensor,
    window: torch.Tensor,
    window_share: float,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fuse a scorer's own scores with the observation window's, budget-independently.

    Every caller of the ``window_share`` option goes through here: ``KVzipLiteScorer.score``
    and ``KVzipGateScorer.union_scores`` (the HF side: calibration's observer, the eval
    harness's twins) and each serving path of ``backend.compress`` (runs, padded buckets, the
    scoring kernels' buckets), so the served selection is the HF side's.

    Per KV head, ``r1`` and ``r2`` are each token's 0-based rank under ``primary`` and under
    ``window`` (0 = best; stable: ties go to the lower token index; NaN and -inf rank after
    every other real token, tied with each other; positions outside ``valid`` after all of
    them), ``n`` the head's real tokens, and with ``s = window_share``, ``c = s / (1 - s)``:

        p1 = 1 - r1 / n,   p2 = 1 - r2 / n          (rank fractions in (0, 1], 1 = best)
        p2' = 1 - (1 - p2) / c
        fused = max(p1, p2') = 1 - min(r1, r2 / c) / n

    ``fused >= 1 - t`` holds for the primary's top fraction ``t`` and the window's top
    fraction ``c * t``, so a head's top-``k`` by ``fused`` is the union of the primary's top
    ``t`` and the window's top ``c t`` with ``t`` set by ``k``: the window gets about ``s`` of
    the budget (less their overlap), and the fusion never reads ``k``. (Written as
    ``p2' = 1 - (1 - p2) * c`` the window would get ``1 - s`` of it and ``s = 0`` would tie
    every token: the division is the form that gives the window its share.) Protected tokens
    (sinks, recent window) and pads are the caller's: its priority keys put them first and
    last after this call, as without the option.

    Args:
        primary: float ``[..., H_kv, n]`` the scorer's own scores (higher = keep), any float
            dtype and device.
        window: float, the same shape: SnapKV's observation-window scores of the same tokens
            (``scoring.snapkv.with_window``; the window's own tokens at its top).
        window_share: ``s``, 0 or in ``[0.001, 0.99]`` (``check_window_share``); 0 returns
            ``primary`` as float32 (the option off: callers skip the call then, so their path
            is unchanged).
        valid: optional bool, broadcastable to ``primary`` (``[..., 1, n]``): the positions
            that hold a token (False at a padded bucket's pads); None = every position.

    Returns:
        float32 ``[..., H_kv, n]``: ``fused`` at every real token, in ``[1 / n, 1]`` (``min``
        is at most ``r1 <= n - 1``); any value at positions outside ``valid``, whose keys the
        caller fixes.

    Raises:
        KernelError: ``primary`` and ``window`` of different shapes (a caller's bug).

    Source: rank fusion of two selections (a union of top fractions, as SnapKV's window and
    KVzip's reconstruction scores each keep what the other misses: docs/scorers.md, "Window
    share"); ranks rather than scores because the two scales differ per head and layer.
    """
    if primary.shape != window.shape:
        raise KernelError(
            f"window_union: primary {list(primary.shape)} and window {list(window.shape)} "
            "scores must have the same shape"
        )
    if window_share == 0:
        return primary.float()
    n = primary.shape[-1]
    count = n if valid is None else valid.sum(dim=-1, keepdim=True, dtype=torch.float32)
    # both rankings in one sort (the serving path is host-bound: launches, not sizes, count)
    r1, r2 = _ranks(torch.stack([primary.float(), window.float()]), valid).float().unbind(0)
    per_rank = (1.0 - window_share) / window_share  # 1 / c
    return 1.0 - torch.minimum(r1, r2 * per_rank) / count


def _ranks(scores: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """int64 ``[..., n]``: each position's 0-based place in the stable descending order of
    ``scores`` along the last axis (:func:`window_union`'s ``r``): NaN and -inf at the float32
    minimum (after every other real token, tied), positions outside ``valid`` (broadcast from
    the right) at -inf (after them all)."""
    low = torch.finfo(torch.float32).min
    key = torch.nan_to_num(scores.float(), nan=low, posinf=float("inf"), neginf=low)
    if valid is not None:
        key = key.masked_fill_(~valid, float("-inf"))
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    places = torch.arange(key.shape[-1], device=key.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, places)
