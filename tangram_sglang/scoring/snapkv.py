"""SnapKV: score tokens by the attention they get from the segment's last ``w`` queries.

Follows NVIDIA kvpress 0.5.5 ``SnapKVPress.score`` so that selections match it token for token:
softmax of the window queries over the segment's keys (causal inside the window), mean over the
window queries, 1-D pooling (kernel ``kernel_size``, zero padding, default average like kvpress;
``pooling="max"`` gives the original SnapKV code's max-pool), mean over the GQA query heads of a
KV head (``gqa_reduce="max"`` gives the Tangram code's max-reduce), and the window tokens
themselves scored above every other token (kvpress: ``max + 1``).

Source: SnapKV (Li et al. 2024, arXiv 2404.14469) §4; kvpress ``presses/snapkv_press.py``.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tangram_sglang.errors import ConfigError
from tangram_sglang.scoring.base import register_scorer
from tangram_sglang.scoring.select import window_union

POOLINGS = ("avg", "max")
GQA_REDUCTIONS = ("mean", "max")


# The largest integer option (queries, tokens): torch's and the kernels' int32 index range.
MAX_INT_OPTION = 2**31 - 1


def check_int_option(name: str, value: object) -> None:
    """``value`` of option ``name`` is a plain int (not a bool) in ``[0, MAX_INT_OPTION]``.

    Raises:
        ConfigError: naming the option, where it comes from and the range.
    """
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(
            f"{name}={value!r} must be an integer (a profile's provenance.scorer_options.{name} "
            "or a calibrate flag)"
        )
    if not 0 <= value <= MAX_INT_OPTION:
        raise ConfigError(f"{name}={value} is out of range; use 0 to {MAX_INT_OPTION}")


def check_window_options(obs_window: int, kernel_size: int, pooling: str, gqa_reduce: str) -> None:
    """Validate the options every window scorer shares (SnapKV family, kvzip-lite).

    Raises:
        ConfigError: a non-integer or out-of-range ``obs_window`` / ``kernel_size``
            (:func:`check_int_option`), ``obs_window < 1``, an even or non-positive
            ``kernel_size``, or an unknown ``pooling`` / ``gqa_reduce`` (the message names the
            field and the allowed values).
    """
    check_int_option("obs_window", obs_window)
    check_int_option("kernel_size", kernel_size)
    if obs_window < 1:
        raise ConfigError(f"obs_window={obs_window} must be >= 1 (queries)")
    if kernel_size < 1 or kernel_size % 2 == 0:
        raise ConfigError(f"kernel_size={kernel_size} must be odd and >= 1")
    if pooling not in POOLINGS:
        raise ConfigError(f"pooling={pooling!r} is unknown; use one of {POOLINGS}")
    if gqa_reduce not in GQA_REDUCTIONS:
        raise ConfigError(f"gqa_reduce={gqa_reduce!r} is unknown; use one of {GQA_REDUCTIONS}")


@dataclass(frozen=True, slots=True)
class SnapKVScorer:
    """SnapKV scorer (uniform budgets: every head keeps its own top-k).

    Attributes:
        obs_window: observation window w (queries); kvpress default 64, SnapKV code 32.
        kernel_size: pooling kernel (tokens, odd, >= 1); 1 disables pooling.
        pooling: ``"avg"`` (kvpress) or ``"max"`` (SnapKV reference code).
        gqa_reduce: ``"mean"`` (kvpress) or ``"max"`` (Tangram code) over a KV head's query heads.
    """

    obs_window: int = 32
    kernel_size: int = 5
    pooling: str = "avg"
    gqa_reduce: str = "mean"
    name: str = "snapkv"

    def __post_init__(self) -> None:
        check_window_options(self.obs_window, self.kernel_size, self.pooling, self.gqa_reduce)

    def score(
        self,
        q_obs: torch.Tensor,
        k_seg: torch.Tensor,
        sm_scale: float,
        lse_obs: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """See :meth:`tangram_sglang.scoring.base.Scorer.score`; float32 ``[num_kv_heads, n]``."""
        probs = window_attention(q_obs, k_seg, sm_scale, lse_obs)  # [..., Hq, w, n]
        n, w = k_seg.shape[-2], probs.shape[-2]
        ctx = n - w
        if ctx <= 0:  # the whole segment is inside the window: every token ties (all kept first)
            return torch.zeros(k_seg.shape[:-1], dtype=torch.float32, device=k_seg.device)
        per_query_head = probs[..., :ctx].mean(dim=-2)  # [..., Hq, ctx]
        pooled = self.pool(per_query_head)
        scores = reduce_gqa(pooled, k_seg.shape[-3], self.gqa_reduce)  # [..., H_kv, ctx]
        top = scores.amax(dim=(-2, -1), keepdim=True) + 1.0  # kvpress: window = max + 1
        return torch.cat([scores, top.expand(*scores.shape[:-1], w)], dim=-1)

    def pool(self, x: torch.Tensor) -> torch.Tensor:
        """1-D pooling of ``[..., n]`` scores over the token axis (zero padding at both ends).

        ``kernel_size`` 1 returns ``x``; avg pooling counts the padding in the mean
        (``F.avg_pool1d`` default, as kvpress), max pooling ignores it.
        """
        if self.kernel_size == 1:
            return x
        flat = x.reshape(-1, 1, x.shape[-1])
        pad = self.kernel_size // 2
        if self.pooling == "avg":  # zero padding counted in the mean, as F.avg_pool1d default
            out = F.avg_pool1d(flat, self.kernel_size, stride=1, padding=pad)
        else:
            out = F.max_pool1d(flat, self.kernel_size, stride=1, padding=pad)
        return out.reshape(x.shape)


def window_attention(
    q_obs: torch.Tensor, k_seg: torch.Tensor, sm_scale: float, lse_obs: torch.Tensor | None
) -> torch.Tensor:
    """Softmax attention of the window queries over the segment, causal inside the window.

    Args:
        q_obs: ``[..., num_qo_heads, w, D]`` post-RoPE queries of the segment's last w tokens.
        k_seg: ``[..., num_kv_heads, n, D]`` post-RoPE keys; ``num_qo_heads`` must be a multiple.
        sm_scale: softmax scale.
        lse_obs: optional float32 ``[..., num_qo_heads, w]`` normaliser (natural log) over
            history + segment; when given, probabilities are ``exp(logit - lse)``.

    Returns:
        float32 ``[..., num_qo_heads, w', n]`` with ``w' = min(w, n)`` (the last w' queries).

    Raises:
        ConfigError: head counts or head dims that do not fit together.
    """
    num_qo_heads, num_kv_heads = q_obs.shape[-3], k_seg.shape[-3]
    if num_qo_heads % num_kv_heads or q_obs.shape[-1] != k_seg.shape[-1]:
        raise ConfigError(
            f"q_obs {list(q_obs.shape)} and k_seg {list(k_seg.shape)} do not fit: num_qo_heads "
            "must be a multiple of num_kv_heads and head_dim must match"
        )
    n = k_seg.shape[-2]
    w = min(q_obs.shape[-2], n)
    gqa = num_qo_heads // num_kv_heads
    lead = q_obs.shape[:-3]
    # Query heads h*gqa ... (h+1)*gqa-1 read KV head h: fold them into the query axis instead of
    # repeating K (one [gqa*w, n] product per KV head; K is never copied gqa times).
    q = q_obs[..., -w:, :].float().reshape(*lead, num_kv_heads, gqa * w, q_obs.shape[-1])
    logits = torch.matmul(q, k_seg.float().transpose(-1, -2)) * sm_scale  # [..., H_kv, gqa*w, n]
    logits = logits.reshape(*lead, num_qo_heads, w, n)  # [..., Hq, w, n]
    # Query i of the window sits at token n - w + i and sees tokens <= n - w + i.
    future = torch.triu(torch.ones(w, n, dtype=torch.bool, device=q.device), diagonal=n - w + 1)
    logits = logits.masked_fill(future, float("-inf"))
    if lse_obs is None:
        return torch.softmax(logits, dim=-1)
    return torch.exp(logits - lse_obs[..., -w:].float().unsqueeze(-1))


def reduce_gqa(x: torch.Tensor, num_kv_heads: int, how: str) -> torch.Tensor:
    """Reduce ``[..., num_qo_heads, n]`` to ``[..., num_kv_heads, n]`` over each GQA group.

    Query heads ``h * gqa_size ... (h + 1) * gqa_size - 1`` belong to KV head h (HF repeat_kv).
    """
    gqa_size = x.shape[-2] // num_kv_heads
    grouped = x.reshape(*x.shape[:-2], num_kv_heads, gqa_size, x.shape[-1])
    return grouped.mean(dim=-2) if how == "mean" else grouped.amax(dim=-2)


register_scorer("snapkv", SnapKVScorer)


# The observation window of the ``window_share`` option (kvzip-lite, kvzip-gate): SnapKV as the
# shipped SnapKV-family profiles run it (the segment's last 32 queries, avg-pool kernel 5, mean
# over a KV head's query heads), so the window keeps what ``snapkv`` would.
WINDOW_SCORER = SnapKVScorer()


MIN_WINDOW_SHARE = 1e-3  # smallest non-zero window_share (a fraction of each head's budget)
MAX_WINDOW_SHARE = 0.99  # largest: nearer 1 the fused float32 scores collapse into ties


def check_window_share(value: object) -> None:
    """``window_share`` is 0 (off) or a number in ``[MIN_WINDOW_SHARE, MAX_WINDOW_SHARE]``.

    A share below :data:`MIN_WINDOW_SHARE` would scale the window's ranks by ``(1 - s) / s``
    past float32's range (NaN at rank 0) and gives the window no token anyway; one nearer 1
    than :data:`MAX_WINDOW_SHARE` scales them so little that the fused float32 scores tie.

    Raises:
        ConfigError: naming the field, where it is set and the fix.
    """
    number = isinstance(value, numbers.Real) and not isinstance(value, bool)
    # NaN fails both range tests
    if not number or not (value == 0 or MIN_WINDOW_SHARE <= value <= MAX_WINDOW_SHARE):
        raise ConfigError(
            f"window_share={value!r} must be 0 (off) or a number in "
            f"[{MIN_WINDOW_SHARE}, {MAX_WINDOW_SHARE}]: "
            "the share of each KV head's budget for the observation window's top tokens "
            "(e.g. 0.25); fix provenance.scorer_options.window_share in the profile"
        )


def window_share_of(scorer: object) -> float:
    """The scorer's ``window_share`` (0.0 for a scorer without the option)."""
    return float(getattr(scorer, "window_share", 0.0) or 0.0)


def with_window(
    primary: torch.Tensor,
    window_share: float,
    q_obs: torch.Tensor,
    k_seg: torch.Tensor,
    sm_scale: float,
    lse_obs: torch.Tensor | None = None,
) -> torch.Tensor:
    """``primary`` fused with :data:`WINDOW_SCORER`'s scores of the same segment
    (``scoring.select.window_union``): the per-segment form of the ``window_share`` option.

    Args:
        primary: float ``[..., H_kv, n]`` the scorer's own scores of the segment.
        window_share: 0 (``primary`` as float32, nothing else computed) or in ``[0.001, 0.99]``.
        q_obs: ``[..., H_q, w, D]`` the segment's last ``w`` post-RoPE queries, ``w`` at least
            the window's 32 or the whole segment (their last 32 are the window).
        k_seg: ``[..., H_kv, n, D]`` the segment's post-RoPE keys.
        sm_scale: softmax scale.
        lse_obs: optional float32 ``[..., H_q, w]`` normaliser of those queries (history +
            segment); None = softmax over the segment.

    Returns:
        float32 ``[..., H_kv, n]`` (``window_union``'s fused rank score).
    """
    if not window_share:
        return primary.float()
    w = min(WINDOW_SCORER.obs_window, q_obs.shape[-2])
    lse = None if lse_obs is None else lse_obs[..., -w:]
    window = WINDOW_SCORER.score(q_obs[..., -w:, :], k_seg, sm_scale, lse)
    return window_union(primary, window, window_share)
