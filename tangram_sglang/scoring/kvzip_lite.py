"""KVzip-lite: query-agnostic scores from the attention every later query of the segment pays.

SnapKV-family scorers rank a segment's tokens by the attention of its LAST ``w`` queries, so the
kept history serves the question at the end of the segment and little else: in a conversation the
questions about a turn arrive in later turns. KVzip (Kim et al. 2025, arXiv 2505.23416) makes the
score query-agnostic by asking the model to *reconstruct* the context (an extra forward of
"Repeat the previous context." + the context) and scoring each KV pair by the largest attention it
receives from any reconstruction query and any query head of its GQA group. That extra forward
doubles the prefill and cannot run inside an attention backend, which sees one forward.

KVzip-lite scores in the same pass, with the segment's own queries in place of the replay: token
j's score is the largest attention it receives from any query ``i >= j + local_band`` of the
segment (optionally a bounded, evenly spaced subset of them, :attr:`max_queries`), max over the
query heads of its KV head. A token that some later part of the segment needed keeps a high
score wherever that part sits, so the selection no longer depends on where the segment ends.
``local_band`` leaves out the queries right after a token (previous-token heads attend there
whatever the content), which the reconstruction pass does not see either.

Cost per layer and segment of ``n`` tokens: ``H_q * m * n * D`` multiply-adds with ``m =
min(n, max_queries)`` queries (SnapKV: ``m = w``), in blocks of :attr:`query_block` queries so the
temporary stays ``H_q * query_block * n`` floats. With ``max_queries`` bounded, the cost is linear
in n like SnapKV's; unbounded it is quadratic (the prefill's own attention cost, without ``V``).

Softmax normaliser: with ``lse_obs`` (the extend kernel's log-sum-exp over history + segment) a
probability is ``exp(logit - lse)``, as the prefill computed it; without it (calibration on HF
models, unit tests) the softmax runs over the segment's keys up to the query (causal), which for
a first segment is the same thing.

Source: KVzip (arXiv 2505.23416) §3.2 (max over reconstruction queries and the GQA group);
kvpress 0.5.5 ``presses/kvzip_press.py`` (``score_kvzip``: ``amax`` over group and queries), the
oracle of ``tests/unit/test_kvzip_lite.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tangram_sglang.errors import ConfigError
from tangram_sglang.scoring.base import register_scorer
from tangram_sglang.scoring.snapkv import GQA_REDUCTIONS, POOLINGS, SnapKVScorer, reduce_gqa

ALL_QUERIES = 1 << 30  # obs_window meaning "every query of the segment" (queries)
DEFAULT_MAX_QUERIES = 1024  # queries scored per segment at most (evenly spaced; 0 = all)
DEFAULT_LOCAL_BAND = 32  # a query i counts for token j only when i - j >= this (tokens)
DEFAULT_QUERY_BLOCK = 256  # queries per matmul block (bounds the temporary)


@dataclass(frozen=True, slots=True)
class KVzipLiteScorer:
    """Query-agnostic scorer: max attention from the segment's own later queries (same pass).

    Attributes:
        obs_window: queries handed to :meth:`score` (the segment's last ``obs_window``); the
            default :data:`ALL_QUERIES` means every query of the segment.
        max_queries: score with at most this many of them, evenly spaced and always including
            the last (0 = every one). Bounds the cost to ``H_q * max_queries * n * D``.
        local_band: query i counts for token j only when ``i - j >= local_band`` (tokens, >= 0;
            0 counts the token's own query).
        kernel_size: 1-D pooling kernel over tokens (odd, 1 = none), as SnapKV's.
        pooling: ``"max"`` or ``"avg"`` for that pooling.
        gqa_reduce: ``"max"`` (KVzip) or ``"mean"`` over the query heads of a KV head.
        query_block: queries per matmul block (>= 1); memory, not results.
    """

    obs_window: int = ALL_QUERIES
    max_queries: int = DEFAULT_MAX_QUERIES
    local_band: int = DEFAULT_LOCAL_BAND
    kernel_size: int = 1
    pooling: str = "max"
    gqa_reduce: str = "max"
    query_block: int = DEFAULT_QUERY_BLOCK
    name: str = "kvzip-lite"

    def __post_init__(self) -> None:
        if self.obs_window < 1:
            raise ConfigError(f"obs_window={self.obs_window} must be >= 1 (queries)")
        if self.max_queries < 0 or self.local_band < 0 or self.query_block < 1:
            raise ConfigError(
                f"max_queries={self.max_queries} and local_band={self.local_band} must be >= 0 "
                f"and query_block={self.query_block} >= 1"
            )
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ConfigError(f"kernel_size={self.kernel_size} must be odd and >= 1")
        if self.pooling not in POOLINGS:
            raise ConfigError(f"pooling={self.pooling!r} is unknown; use one of {POOLINGS}")
        if self.gqa_reduce not in GQA_REDUCTIONS:
            raise ConfigError(
                f"gqa_reduce={self.gqa_reduce!r} is unknown; use one of {GQA_REDUCTIONS}"
            )

    def query_slots(self, w: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """int64 ``[m]``: which of the ``w`` queries are scored (ascending, the last included).

        ``m = w`` when ``max_queries`` is 0 or >= w, else ``max_queries`` evenly spaced slots.
        """
        if self.max_queries == 0 or self.max_queries >= w:
            return torch.arange(w, device=device)
        step = w / self.max_queries
        slots = torch.arange(self.max_queries, device=device, dtype=torch.float64)
        return (w - 1 - torch.floor(slots * step)).long().flip(0)

    def score(
        self,
        q_obs: torch.Tensor,
        k_seg: torch.Tensor,
        sm_scale: float,
        lse_obs: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Max attention each token receives from the segment's later queries, per KV head.

        Args:
            q_obs: ``[..., num_qo_heads, w, D]`` post-RoPE queries of the segment's last ``w``
                tokens (``w = n``: every query; query i sits at token ``n - w + i``).
            k_seg: ``[..., num_kv_heads, n, D]`` post-RoPE keys of the segment.
            sm_scale: softmax scale.
            lse_obs: optional float32 ``[..., num_qo_heads, w]`` log-sum-exp of each query over
                history + segment (the extend kernel's); None = softmax over the segment.

        Returns:
            float32 ``[..., num_kv_heads, n]`` in [0, 1]: 0 for tokens no scored query reaches
            (the last ``local_band`` tokens; sinks and the recent window are kept anyway).

        Raises:
            ConfigError: head counts or head dims that do not fit together.
        """
        num_qo_heads, num_kv_heads = q_obs.shape[-3], k_seg.shape[-3]
        dim = k_seg.shape[-1]
        if num_qo_heads % num_kv_heads or q_obs.shape[-1] != dim:
            raise ConfigError(
                f"q_obs {list(q_obs.shape)} and k_seg {list(k_seg.shape)} do not fit: "
                "num_qo_heads must be a multiple of num_kv_heads and head_dim must match"
            )
        n = k_seg.shape[-2]
        w = min(q_obs.shape[-2], n)
        lead = q_obs.shape[:-3]
        gqa = num_qo_heads // num_kv_heads
        device = k_seg.device
        slots = self.query_slots(w, device)
        offset = q_obs.shape[-2] - w  # q_obs may hold more queries than the segment has keys
        keys_t = k_seg.float().transpose(-1, -2)  # [..., H_kv, D, n]
        key_pos = torch.arange(n, device=device)
        best = torch.zeros(*lead, num_qo_heads, n, dtype=torch.float32, device=device)
        for first in range(0, slots.numel(), self.query_block):
            block = slots[first : first + self.query_block]
            m = block.numel()
            q = q_obs[..., offset + block, :]
            q = q.float().reshape(*lead, num_kv_heads, gqa * m, dim)
            logits = torch.matmul(q, keys_t).mul_(sm_scale).view(*lead, num_qo_heads, m, n)
            q_pos = (n - w + block).view(m, 1)
            future = key_pos.view(1, n) > q_pos  # [m, n]
            logits.masked_fill_(future, float("-inf"))
            if lse_obs is None:
                probs = torch.softmax(logits, dim=-1)
            else:
                lse = lse_obs[..., offset + block].float().unsqueeze(-1)
                probs = logits.sub_(lse).exp_()
            if self.local_band:
                near = (q_pos - key_pos.view(1, n)) < self.local_band  # [m, n]
                probs.masked_fill_(near, 0.0)
            best = torch.maximum(best, probs.amax(dim=-2))
        pooled = SnapKVScorer(kernel_size=self.kernel_size, pooling=self.pooling).pool(best)
        return reduce_gqa(pooled, num_kv_heads, self.gqa_reduce)


register_scorer("kvzip-lite", KVzipLiteScorer)
