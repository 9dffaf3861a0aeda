"""KVzip-replay: query-agnostic scores from the segment's own queries, moved to the replay.

KVzip (Kim et al. 2025, arXiv 2505.23416) scores a context by a second forward: the model reads
"repeat the previous context" and then the context again, and each KV pair of the context scores
the largest attention any of those replay queries (and any query head of its GQA group) pays
it. The replay of token ``i`` sits ``n + c`` positions after the original (``n`` context tokens,
``c`` tokens of the repeat prompt) and sees the whole context, so a token needed anywhere to
reproduce the context scores high, whatever question comes later.

KVzip-replay keeps that geometry without the second forward. It takes the segment's own
post-RoPE queries, rotates each by ``n + c`` more positions (RoPE rotations compose:
``R(i + s) = R(s) R(i)``), so its offset to every key of the segment is positive, as for the
replay, and scores token ``j`` by ``max_i softmax_j(q_i' . k_j * scale)`` over every key of
the segment (no causal mask), max over the query heads of its KV head. What differs from the
replay is the query content (a query computed before the rest of the segment was read).

``eval.scorer_recall`` measures how much of KVzip's own kept set each scorer keeps
(benchmarks/RESULTS.md, issue 20); this one keeps more of it than ``kvzip-lite`` (the segment's
own queries, causal, unshifted) and the SnapKV family.

Cost per layer and segment of ``n`` tokens: ``H_q * m * n * D`` multiply-adds with ``m =
min(n, max_queries)`` evenly spaced queries, in blocks of :attr:`query_block` queries.

The rotation needs the model's RoPE frequencies, which a profile does not hold: the server binds
them from its rotary embedding at start-up and calibration from the HF model
(:func:`bind_rope`); an unbound scorer refuses to score.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from tangram_sglang.errors import ConfigError
from tangram_sglang.host_copy import host_to_device
from tangram_sglang.scoring.base import register_scorer
from tangram_sglang.scoring.kvzip_lite import (
    ALL_QUERIES,
    DEFAULT_MAX_QUERIES,
    DEFAULT_QUERY_BLOCK,
    check_heads,
    check_int_options,
    evenly_spaced_slots,
)
from tangram_sglang.scoring.snapkv import SnapKVScorer, check_window_options, reduce_gqa

DEFAULT_GAP_TOKENS = 8  # tokens of KVzip's repeat prompt between the context and its replay


@dataclass(frozen=True, slots=True, eq=False)
class RopeShift:
    """Rotate post-RoPE vectors by more positions: RoPE with the model's frequencies.

    Attributes:
        inv_freq: float32 ``[rotary_dim / 2]`` angle per position of each frequency (radians;
            scaled frequencies, e.g. Llama-3's, are what the model uses).
        neox: rotate halves (``[x1, x2]``: Llama, Qwen2, HF ``rotate_half``) when True, else
            interleaved pairs (GPT-J).
    """

    inv_freq: torch.Tensor
    neox: bool = True
    _on_device: dict = field(default_factory=dict, repr=False)  # device -> float64 inv_freq

    @classmethod
    def from_cos_sin_row(cls, row: torch.Tensor, neox: bool) -> RopeShift:
        """From position 1 of a ``cos | sin`` table (SGLang's ``cos_sin_cache[1]``).

        Each frequency below pi rad per position (RoPE's are at most 1) is recovered exactly by
        ``atan2(sin, cos)``; a scale on the table (YaRN's) does not change the angle.
        """
        cos, sin = row.float().chunk(2, dim=-1)
        return cls(torch.atan2(sin, cos).cpu(), bool(neox))

    @classmethod
    def standard(cls, head_dim: int, theta: float = 10000.0) -> RopeShift:
        """Unscaled RoPE over the whole head: ``inv_freq_i = theta ** (-2i / head_dim)``
        (RoFormer, Su et al. 2021); for benchmarks on synthetic profiles, which have no model."""
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
        return cls((float(theta) ** -exponents).float(), neox=True)

    def rotate(self, x: torch.Tensor, shift: int) -> torch.Tensor:
        """``x`` ``[..., D]`` (post-RoPE) rotated by ``shift`` more positions; float32.

        Dimensions past ``rotary_dim`` (partial rotary) are returned unchanged.
        """
        half = self.inv_freq.numel()
        freq = self._on_device.get(x.device)
        if freq is None:  # one copy per device, not one per call (a host copy would sync)
            freq = self._on_device.setdefault(x.device, self.inv_freq.to(x.device, torch.float64))
        angle = freq * float(shift)
        cos, sin = torch.cos(angle).float(), torch.sin(angle).float()
        x = x.float()
        rot, rest = x[..., : 2 * half], x[..., 2 * half :]
        if self.neox:
            x1, x2 = rot[..., :half], rot[..., half:]
            out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
        return torch.cat([out, rest], dim=-1)


@dataclass(frozen=True, slots=True)
class ReplayScorer:
    """Query-agnostic scorer: the segment's own queries at KVzip's replay positions.

    Attributes:
        obs_window: queries handed to :meth:`score`; :data:`ALL_QUERIES` = every query.
        max_queries: score with at most this many queries, evenly spaced, the last included
            (0 = every one).
        gap_tokens: ``c``: the replay of token i sits at ``n + c + i`` (tokens, >= 0).
        kernel_size: 1-D pooling kernel over tokens (odd, 1 = none).
        pooling: ``"max"`` or ``"avg"``.
        gqa_reduce: ``"max"`` (KVzip) or ``"mean"`` over the query heads of a KV head.
        query_block: queries per matmul block (memory only).
        rope: the model's :class:`RopeShift`, bound at start-up (:func:`bind_rope`); not a
            profile option.
    """

    obs_window: int = ALL_QUERIES
    max_queries: int = DEFAULT_MAX_QUERIES
    gap_tokens: int = DEFAULT_GAP_TOKENS
    kernel_size: int = 1
    pooling: str = "max"
    gqa_reduce: str = "max"
    query_block: int = DEFAULT_QUERY_BLOCK
    rope: RopeShift | None = field(default=None, compare=False, metadata={"runtime": True})
    name: str = "kvzip-replay"

    def __post_init__(self) -> None:
        ints = ("obs_window", "max_queries", "gap_tokens", "kernel_size", "query_block")
        check_int_options(self, ints)
        check_window_options(self.obs_window, self.kernel_size, self.pooling, self.gqa_reduce)
        if self.max_queries < 0 or self.gap_tokens < 0 or self.query_block < 1:
            raise ConfigError(
                f"max_queries={self.max_queries} and gap_tokens={self.gap_tokens} must be >= 0 "
                f"and query_block={self.query_block} >= 1"
            )

    def score(
        self,
        q_obs: torch.Tensor,
        k_seg: torch.Tensor,
        sm_scale: float,
        lse_obs: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Max replay attention each token of the segment receives, per KV head.

        Args:
            q_obs: ``[..., num_qo_heads, w, D]`` post-RoPE queries of the segment's last ``w``
                tokens (``w = n``: every query).
            k_seg: ``[..., num_kv_heads, n, D]`` post-RoPE keys of the segment.
            sm_scale: softmax scale.
            lse_obs: unused: the replay's softmax runs over the segment's keys.

        Returns:
            float32 ``[..., num_kv_heads, n]`` in [0, 1].

        Raises:
            ConfigError: no RoPE bound (:func:`bind_rope`), or head counts and dims that do not
                fit together.
        """
        if self.rope is None:
            raise ConfigError(
                "scorer kvzip-replay has no RoPE frequencies: the server binds them from the "
                "model's rotary embedding (models with RoPE only); use --tangram-scorer "
                "kvzip-lite for a model without one"
            )
        check_heads(q_obs, k_seg)
        num_qo_heads, num_kv_heads = q_obs.shape[-3], k_seg.shape[-3]
        dim, n = k_seg.shape[-1], k_seg.shape[-2]
        w = min(q_obs.shape[-2], n)
        offset = q_obs.shape[-2] - w
        slots = [offset + i for i in evenly_spaced_slots(w, self.max_queries)]
        if len(slots) < q_obs.shape[-2]:  # a subset: one gather (a full set is used as it is)
            q_obs = q_obs.index_select(-2, host_to_device(slots, q_obs.device))
        # every chosen query moved to its replay position at once: n + c positions later
        queries = self.rope.rotate(q_obs, n + self.gap_tokens) * sm_scale
        lead = q_obs.shape[:-3]
        group = num_qo_heads // num_kv_heads
        keys_t = k_seg.float().transpose(-1, -2)  # [..., H_kv, D, n]
        best = torch.zeros(*lead, num_qo_heads, n, device=k_seg.device)
        for first in range(0, len(slots), self.query_block):
            block = slots[first : first + self.query_block]
            q = queries[..., first : first + len(block), :]
            q = q.reshape(*lead, num_kv_heads, group * len(block), dim)  # GQA folded in
            probs = torch.softmax(torch.matmul(q, keys_t), dim=-1)
            probs = probs.view(*lead, num_qo_heads, len(block), n)
            best = torch.maximum(best, probs.amax(dim=-2))
        pooled = SnapKVScorer(kernel_size=self.kernel_size, pooling=self.pooling).pool(best)
        return reduce_gqa(pooled, num_kv_heads, self.gqa_reduce)


def needs_rope(scorer: Any) -> bool:
    """Whether ``scorer`` has a ``rope`` option left unbound."""
    return "rope" in getattr(type(scorer), "__dataclass_fields__", {}) and scorer.rope is None


def bind_rope(scorer: Any, rope: RopeShift) -> Any:
    """``scorer`` with ``rope`` bound when it takes one (:func:`needs_rope`); else unchanged."""
    return dataclasses.replace(scorer, rope=rope) if needs_rope(scorer) else scorer


def rope_from_hf(model: Any) -> RopeShift:
    """The RoPE of an HF Llama/Qwen2-family model (``model.model.rotary_emb.inv_freq``).

    Raises:
        ConfigError: the model has no ``rotary_emb`` with ``inv_freq``.
    """
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    inv_freq = getattr(rotary, "inv_freq", None)
    if inv_freq is None:
        raise ConfigError(
            f"{type(model).__name__}: no model.rotary_emb.inv_freq; scorer kvzip-replay needs a "
            "RoPE model (use --scorer kvzip-lite)"
        )
    return RopeShift(inv_freq.detach().float().cpu(), neox=True)


def check_rope_span(rope: RopeShift, head_dim: int) -> None:
    """Refuse frequencies that are not a RoPE's: each in [0, 1] rad per position (``base **
    (-2i / d)`` and its scaled variants) and at most ``head_dim / 2`` of them.

    Raises:
        ConfigError: naming the first bad frequency or the sizes.
    """
    freq = rope.inv_freq
    bad = ~torch.isfinite(freq) | (freq < 0) | (freq > 1.0 + 1e-6)
    if bool(bad.any()) or 2 * freq.numel() > head_dim:
        first = freq[bad][0].item() if bool(bad.any()) else None
        raise ConfigError(
            f"RoPE frequencies ({freq.numel()} for head_dim {head_dim}, first bad: {first}) "
            "are not a rotary embedding's; scorer kvzip-replay cannot use them (use kvzip-lite)"
        )


register_scorer("kvzip-replay", ReplayScorer)
