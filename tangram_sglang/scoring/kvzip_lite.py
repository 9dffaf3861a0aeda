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
(The serving path scores a batch of mixed lengths in padded buckets, ``backend.compress``,
whose slot blocks are bounded by its ``MAX_QUERY_BLOCK_FLOATS`` instead of ``query_block``.)

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

import numpy as np
import torch

from tangram_sglang.errors import ConfigError
from tangram_sglang.host_copy import host_to_device
from tangram_sglang.scoring.base import register_scorer
from tangram_sglang.scoring.snapkv import (
    WINDOW_SCORER,
    SnapKVScorer,
    check_int_option,
    check_window_options,
    check_window_share,
    reduce_gqa,
    with_window,
)

ALL_QUERIES = 1 << 30  # obs_window meaning "every query of the segment" (queries)
DEFAULT_MAX_QUERIES = 1024  # queries scored per segment at most (evenly spaced; 0 = all)
DEFAULT_LOCAL_BAND = 32  # a query i counts for token j only when i - j >= this (tokens)
DEFAULT_QUERY_BLOCK = 256  # queries per matmul block (bounds the temporary)


def check_int_options(scorer: object, names: tuple[str, ...]) -> None:
    """Each option in ``names`` is a plain int (not a bool) in range (:func:`check_int_option`).

    Raises:
        ConfigError: naming the option and where it comes from.
    """
    for name in names:
        check_int_option(name, getattr(scorer, name))


def check_heads(q_obs: torch.Tensor, k_seg: torch.Tensor) -> None:
    """``q_obs`` ``[..., H_q, w, D]`` and ``k_seg`` ``[..., H_kv, n, D]`` fit (GQA, same D).

    Raises:
        ConfigError: naming both shapes.
    """
    if q_obs.shape[-3] % k_seg.shape[-3] or q_obs.shape[-1] != k_seg.shape[-1]:
        raise ConfigError(
            f"q_obs {list(q_obs.shape)} and k_seg {list(k_seg.shape)} do not fit: "
            "num_qo_heads must be a multiple of num_kv_heads and head_dim must match"
        )


def evenly_spaced_slots(w: int, max_queries: int) -> list[int]:
    """Which of ``w`` queries are scored (host ints, ascending, the last included).

    All ``w`` when ``max_queries`` is 0 or >= w, else ``max_queries`` evenly spaced slots
    (:func:`slot_table` for one row).
    """
    if max_queries == 0 or max_queries >= w:
        return list(range(w))
    count, table = slot_table(np.array([w], np.int64), max_queries)
    return table[0, table.shape[1] - int(count[0]) :].tolist()


def slot_table(w: np.ndarray, max_queries: int) -> tuple[np.ndarray, np.ndarray]:
    """The scored queries of many rows at once, right-aligned: host arrays.

    Row r scores ``count[r] = min(w[r], max_queries)`` of its ``w[r]`` queries (every one when
    ``max_queries`` is 0): all of them when ``count == w``, else
    ``w - 1 - floor(i * (w / max_queries))`` for ``i`` in ``[0, max_queries)`` with the quotient
    in float64 (evenly spaced, the last included; the float rounding is part of the rule: the
    profiles were calibrated with it), ascending.

    Args:
        w: int ``[b]`` queries per row (>= 0; a row of 0 scores none).
        max_queries: the scorer's bound (>= 0; 0 = none).

    Returns:
        ``(count, table)``: int64 ``[b]`` and int64 ``[b, max(count)]``: row r's scored query
        indices (within its ``w``) ascending in its last ``count[r]`` columns, -1 before.

    Raises:
        ConfigError: a negative ``max_queries`` or ``w``.
    """
    w = np.array(w, np.int64).reshape(-1)
    if max_queries < 0 or (w < 0).any():
        raise ConfigError(f"slot_table: max_queries={max_queries} and every w must be >= 0")
    count = w.copy() if max_queries == 0 else np.minimum(w, max_queries)
    width = int(count.max()) if count.size else 0
    t = np.arange(width)[None, :] - (width - count)[:, None]  # t-th scored query of the row
    step = (w / max(max_queries, 1))[:, None]  # float64, as i * (w / max_queries) one by one
    spread = (w - 1)[:, None] - np.floor(((count - 1)[:, None] - t) * step)
    table = np.where((count == w)[:, None], t, spread).astype(np.int64)
    return count, np.where(t >= 0, table, -1)


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
        query_block: queries per matmul block (>= 1) of :meth:`score`; memory, not results
            (the padded batches of ``backend.compress`` bound their blocks by size instead).
        window_share: 0 (off) or in ``[0.001, 0.99]``; above 0 each head keeps the union of
            its top tokens by
            these scores and by SnapKV's observation window (the segment's last 32 queries),
            the window getting about this share of the head's budget
            (``scoring.select.window_union``; docs/scorers.md, "Window share"). 0: off.
    """

    obs_window: int = ALL_QUERIES
    max_queries: int = DEFAULT_MAX_QUERIES
    local_band: int = DEFAULT_LOCAL_BAND
    kernel_size: int = 1
    pooling: str = "max"
    gqa_reduce: str = "max"
    query_block: int = DEFAULT_QUERY_BLOCK
    window_share: float = 0.0
    name: str = "kvzip-lite"

    def __post_init__(self) -> None:
        ints = ("obs_window", "max_queries", "local_band", "kernel_size", "query_block")
        check_int_options(self, ints)
        check_window_options(self.obs_window, self.kernel_size, self.pooling, self.gqa_reduce)
        if self.max_queries < 0 or self.local_band < 0 or self.query_block < 1:
            raise ConfigError(
                f"max_queries={self.max_queries} and local_band={self.local_band} must be >= 0 "
                f"and query_block={self.query_block} >= 1"
            )
        check_window_share(self.window_share)
        if self.window_share and self.obs_window < WINDOW_SCORER.obs_window:
            raise ConfigError(
                f"kvzip-lite: window_share={self.window_share} reads the segment's last "
                f"{WINDOW_SCORER.obs_window} queries, but obs_window={self.obs_window} hands "
                f"fewer; raise obs_window to >= {WINDOW_SCORER.obs_window} or set window_share 0"
            )

    def query_slots(self, w: int) -> list[int]:
        """Which of the ``w`` queries are scored: :func:`evenly_spaced_slots`."""
        return evenly_spaced_slots(w, self.max_queries)

    def score(
        self,
        q_obs: torch.Tensor,
        k_seg: torch.Tensor,
        sm_scale: float,
        lse_obs: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Max attention each token receives from the segment's later queries, per KV head.

        Computed as ``exp(max_i(logit_ij - lse_i))`` (exp is monotonic, so the max is taken on
        logits and only ``[H_q, n]`` values are exponentiated). Per block of queries at
        positions ``p_0 < ... < p_last``, keys ``j <= p_0 - band`` are visible to every query of
        the block (no mask) and keys past ``p_last - band`` to none (not computed): only the
        columns in between are masked. No host synchronisation (positions are host ints).

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
            With :attr:`window_share` above 0, the fused rank score of
            ``scoring.select.window_union`` instead (these scores and the window's of the
            last 32 of ``q_obs``), also in (0, 1].

        Raises:
            ConfigError: head counts or head dims that do not fit together.
        """
        check_heads(q_obs, k_seg)
        num_qo_heads, num_kv_heads = q_obs.shape[-3], k_seg.shape[-3]
        dim = k_seg.shape[-1]
        n = k_seg.shape[-2]
        w = min(q_obs.shape[-2], n)
        lead = q_obs.shape[:-3]
        device = k_seg.device
        slots = self.query_slots(w)
        offset = q_obs.shape[-2] - w  # q_obs may hold more queries than the segment has keys
        band = self.local_band
        keys_t = k_seg.float().transpose(-1, -2)  # [..., H_kv, D, n]
        best = torch.full((*lead, num_qo_heads, n), float("-inf"), device=device)
        for first in range(0, len(slots), self.query_block):
            block = slots[first : first + self.query_block]
            pos = [n - w + i for i in block]  # token position of each query
            hi = min(n, pos[-1] - band + 1)  # keys >= hi: no query of the block counts them
            if hi <= 0:
                continue
            idx = host_to_device([offset + i for i in block], device)
            q = q_obs.index_select(-2, idx).float()  # [..., Hq, m, D]
            lse = self._lse(q, keys_t, sm_scale, pos) if lse_obs is None else None
            if lse is None:
                lse = lse_obs.index_select(-1, idx).float()  # type: ignore[union-attr]
            # (q * scale) . k - lse as ONE product: q gets a -lse column, k a row of ones.
            q_aug = torch.cat([q * sm_scale, -lse.unsqueeze(-1)], dim=-1)
            q_aug = q_aug.reshape(*lead, num_kv_heads, -1, dim + 1)  # GQA folded into queries
            k_aug = torch.cat([keys_t[..., :hi], keys_t.new_ones(*keys_t.shape[:-2], 1, hi)], -2)
            logits = torch.matmul(q_aug, k_aug).view(*lead, num_qo_heads, len(block), hi)
            lo = max(0, pos[0] - band + 1)  # keys < lo: every query of the block counts them
            if lo < hi:
                q_pos = host_to_device(pos, device).view(-1, 1)
                key_pos = torch.arange(lo, hi, device=device).view(1, -1)
                logits[..., lo:hi].masked_fill_(q_pos - key_pos < band, float("-inf"))
            best[..., :hi] = torch.maximum(best[..., :hi], logits.amax(dim=-2))
        probs = best.exp_()  # exp(-inf) = 0 for tokens no query counts
        pooled = SnapKVScorer(kernel_size=self.kernel_size, pooling=self.pooling).pool(probs)
        scores = reduce_gqa(pooled, num_kv_heads, self.gqa_reduce)
        if not self.window_share:
            return scores
        return with_window(scores, self.window_share, q_obs, k_seg, sm_scale, lse_obs)

    @staticmethod
    def _lse(q: torch.Tensor, keys_t: torch.Tensor, sm_scale: float, pos: list[int]):
        """float32 ``[..., Hq, m]``: each query's log-sum-exp over the segment's keys up to its
        own position (the causal softmax normaliser when the extend kernel's is not given)."""
        num_qo_heads, m, dim = q.shape[-3], q.shape[-2], q.shape[-1]
        num_kv_heads, end = keys_t.shape[-3], pos[-1] + 1
        folded = (q * sm_scale).reshape(*q.shape[:-3], num_kv_heads, -1, dim)
        logits = torch.matmul(folded, keys_t[..., :end]).view(*q.shape[:-3], num_qo_heads, m, end)
        q_pos = host_to_device(pos, q.device).view(-1, 1)
        future = torch.arange(end, device=q.device).view(1, -1) > q_pos
        return torch.logsumexp(logits.masked_fill_(future, float("-inf")), dim=-1)


register_scorer("kvzip-lite", KVzipLiteScorer)
