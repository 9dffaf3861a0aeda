"""Which new tokens each KV head keeps: the scorer + top-``k_g`` step of a prefill/extend segment.

Runs per layer inside ``TangramAttnBackend.forward_extend``, after the extend attention (whose
``lse`` normalises the observation-window scores over history + segment) and before the kept-KV
write. Pure torch, no sglang import: the backend hands plain tensors in and writes the result
with the kv-write kernel. Per request and KV head h of the layer the head keeps
``k_g = kept_len(n, group_ratio[g])`` tokens (g = its head group), its OWN top ``k_g`` by score.

Source: Tangram arXiv 2606.06302 (Budget Reservation: prefill keeps only the kept K/V);
notes/INTERFACES.md (scorer interface, kept-KV write); SnapKV (arXiv 2404.14469) §4.
"""

from __future__ import annotations

import torch

from tangram_sglang.scoring.base import Scorer
from tangram_sglang.scoring.select import select_kept


def segment_kept_indices(
    scorer: Scorer,
    q_seg: torch.Tensor,
    k_seg: torch.Tensor,
    lse_seg: torch.Tensor,
    kept_per_head: list[int],
    sm_scale: float,
    sink_tokens: int,
    recent_window: int,
) -> torch.Tensor:
    """Kept token indices of one request's segment, per KV head of one layer (per layer).

    Args:
        scorer: the profile's scorer (its ``obs_window`` = w).
        q_seg: ``[n, num_qo_heads, D]`` the segment's queries (post-RoPE).
        k_seg: ``[n, H_kv, D]`` the segment's keys (post-RoPE, transient).
        lse_seg: float32 ``[n, num_qo_heads]`` extend-attention normaliser (history + segment).
        kept_per_head: ``H_kv`` ints, ``k_g`` of each head's group (tokens, 1 <= k <= n).
        sm_scale: softmax scale of the layer.
        sink_tokens, recent_window: the profile's always-kept tokens.

    Returns:
        int64 ``[H_kv, max(kept_per_head)]``: head h's kept indices (ascending) in its first
        ``kept_per_head[h]`` entries, 0-padded after (the kv-write reads only the counted ones).

    Source: notes/INTERFACES.md (``Scorer.score``, ``select_kept``).
    """
    n, num_kv_heads = k_seg.shape[0], k_seg.shape[1]
    max_k = max(kept_per_head)
    out = torch.zeros(num_kv_heads, max_k, dtype=torch.int64, device=k_seg.device)
    if min(kept_per_head) == n:  # every head keeps the whole segment: no scoring needed
        out[:] = torch.arange(n, device=k_seg.device)
        return out
    w = min(scorer.obs_window, n)
    scores = scorer.score(
        q_seg[n - w :].transpose(0, 1), k_seg.transpose(0, 1), sm_scale,
        lse_obs=lse_seg[n - w :].transpose(0, 1),
    )  # fmt: skip
    for k in sorted(set(kept_per_head)):
        heads = [h for h, kh in enumerate(kept_per_head) if kh == k]
        idx = torch.tensor(heads, device=k_seg.device)
        out[idx, :k] = select_kept(scores[idx], k, sink_tokens, recent_window)
    return out


def batch_kept_indices(
    scorer: Scorer,
    q: torch.Tensor,
    k_new: torch.Tensor,
    lse: torch.Tensor,
    bounds: list[int],
    kept_per_head: list[list[int]],
    sm_scale: float,
    sink_tokens: int,
    recent_window: int,
) -> torch.Tensor:
    """:func:`segment_kept_indices` for every request of an extend batch (per layer).

    Args:
        q: ``[num_tokens, num_qo_heads, D]``; k_new: ``[num_tokens, H_kv, D]``;
            lse: float32 ``[num_tokens, num_qo_heads]``.
        bounds: host copy of ``qo_indptr`` (``bs + 1`` ints, tokens).
        kept_per_head: per request, ``H_kv`` kept lengths (tokens).
        sm_scale, sink_tokens, recent_window: as :func:`segment_kept_indices`.

    Returns:
        int64 ``[bs, H_kv, max_k]`` (``kept_idx`` of the kv-write kernel), 0-padded.
    """
    bs, num_kv_heads = len(bounds) - 1, k_new.shape[1]
    max_k = max((max(ks) for ks in kept_per_head), default=1)
    out = torch.zeros(bs, num_kv_heads, max(max_k, 1), dtype=torch.int64, device=k_new.device)
    for i in range(bs):
        start, end = bounds[i], bounds[i + 1]
        if end == start:
            continue
        sel = segment_kept_indices(
            scorer, q[start:end], k_new[start:end], lse[start:end], kept_per_head[i],
            sm_scale, sink_tokens, recent_window,
        )  # fmt: skip
        out[i, :, : sel.shape[1]] = sel
    return out
