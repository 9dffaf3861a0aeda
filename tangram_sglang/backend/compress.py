"""Which new tokens each KV head keeps: the scorer + top-``k_g`` step of a prefill/extend segment.

Runs per layer inside ``TangramAttnBackend.forward_extend``, after the extend attention (whose
``lse`` normalises the observation-window scores over history + segment) and before the kept-KV
write. Pure torch, no sglang import: the backend hands plain tensors in and writes the result
with the kv-write kernel. Per request and KV head h of the layer the head keeps
``k_g = kept_len(n, group_ratio[g])`` tokens (g = its head group), its OWN top ``k_g`` by score.

Cost (per layer; measured on the H200, benchmarks/RESULTS.md issue 7): consecutive requests of
equal segment length are scored and selected as one batch, every head of a request with one
stable sort whatever its ``k_g``, with no host synchronisation (the kept counts come in as a
device tensor built once per batch): about 15 launches per run of equal-length requests,
instead of ~100 launches and one blocking host-to-device copy per distinct ``k_g`` per request.

Source: Tangram arXiv 2606.06302 (Budget Reservation: prefill keeps only the kept K/V);
docs/contracts.md (scorer interface, kept-KV write); SnapKV (arXiv 2404.14469) §4.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tangram_sglang.errors import KernelError
from tangram_sglang.scoring.base import Scorer
from tangram_sglang.scoring.select import priority_key, select_kept


def kept_from_ranks(key: torch.Tensor, kept: torch.Tensor, max_k: int) -> torch.Tensor:
    """Each row's top ``kept[row]`` entries of ``key``, as ascending indices, 0-padded.

    Equal to ``select_kept`` row by row (stable descending sort: ties go to lower indices), but
    one sort for every row whatever its count, and no host synchronisation.

    Args:
        key: float32 ``[..., n]`` priority keys (``scoring.select.priority_key``).
        kept: int64 ``[...]`` tokens to keep per row (``1 <= kept <= n``), same device.
        max_k: host int, ``>= kept.max()`` (the output width).

    Returns:
        int64 ``[..., max_k]``: row r's kept indices ascending in its first ``kept[r]`` entries,
        0 after.
    """
    n = key.shape[-1]
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    ranks = torch.empty_like(order).scatter_(
        -1, order, torch.arange(n, device=key.device).expand_as(order)
    )
    keep = ranks < kept.unsqueeze(-1)  # [..., n]
    slot = torch.cumsum(keep, dim=-1) - 1  # output position of each kept token
    slot = torch.where(keep, slot, max_k)  # dropped tokens -> a spare column, cut below
    out = torch.zeros(*key.shape[:-1], max_k + 1, dtype=torch.int64, device=key.device)
    out.scatter_(-1, slot, torch.arange(n, device=key.device).expand_as(slot))
    return out[..., :max_k]


def _runs(lengths: Sequence[int]) -> list[tuple[int, int]]:
    """``[(first, end), ...]``: maximal runs of consecutive equal lengths (requests)."""
    runs, first = [], 0
    for i in range(1, len(lengths) + 1):
        if i == len(lengths) or lengths[i] != lengths[first]:
            runs.append((first, i))
            first = i
    return runs


def _score_run(
    scorer: Scorer, q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, start: int, m: int,
    n: int, sm_scale: float,
) -> torch.Tensor:  # fmt: skip
    """float32 ``[m, H_kv, n]`` scores of ``m`` consecutive requests of ``n`` new tokens each."""
    w = min(scorer.obs_window, n)
    end = start + m * n
    q_run = q[start:end].view(m, n, q.shape[1], q.shape[2])
    k_run = k[start:end].view(m, n, k.shape[1], k.shape[2])
    lse_run = lse[start:end].view(m, n, lse.shape[1])
    return scorer.score(
        q_run[:, n - w :].transpose(1, 2), k_run.transpose(1, 2), sm_scale,
        lse_obs=lse_run[:, n - w :].transpose(1, 2),
    )  # fmt: skip


def batch_kept_indices(
    scorer: Scorer,
    q: torch.Tensor,
    k_new: torch.Tensor,
    lse: torch.Tensor,
    bounds: list[int],
    kept_per_head: Sequence[Sequence[int]] | np.ndarray,
    sm_scale: float,
    sink_tokens: int,
    recent_window: int,
    kept_per_head_dev: torch.Tensor | None = None,
) -> torch.Tensor:
    """Kept token indices of every request of an extend batch, per KV head (per layer).

    Args:
        scorer: the profile's scorer (its ``obs_window`` = w).
        q: ``[num_tokens, num_qo_heads, D]`` new tokens' queries (post-RoPE).
        k_new: ``[num_tokens, H_kv, D]`` new tokens' keys (post-RoPE, transient).
        lse: float32 ``[num_tokens, num_qo_heads]`` extend-attention normaliser (history + new).
        bounds: host copy of ``qo_indptr`` (``bs + 1`` ints, tokens).
        kept_per_head: host ``[bs, H_kv]`` ints: ``k_g`` of each request's KV heads (tokens,
            ``1 <= k <= n`` for a non-empty segment).
        sm_scale: softmax scale of the layer.
        sink_tokens, recent_window: the profile's always-kept tokens.
        kept_per_head_dev: the same counts as int64 on ``q``'s device (the backend builds it
            once per batch); None = copied here (one host-to-device copy).

    Returns:
        int64 ``[bs, H_kv, max_k]`` (``kept_idx`` of the kv-write kernel): head h of request i
        keeps tokens ``out[i, h, :k]`` (ascending, indices into the request's new tokens), 0
        after. Identical to ``select_kept`` on each request's scores.

    Raises:
        KernelError: a count outside ``[1, n]`` for a non-empty segment (host check).

    Source: docs/contracts.md (``Scorer.score``, ``select_kept``).
    """
    kept_host = np.asarray(kept_per_head, np.int64).reshape(len(bounds) - 1, k_new.shape[1])
    bs, num_kv_heads = kept_host.shape
    max_k = int(kept_host.max()) if kept_host.size else 1
    device = k_new.device
    out = torch.zeros(bs, num_kv_heads, max(max_k, 1), dtype=torch.int64, device=device)
    if kept_per_head_dev is None:
        kept_per_head_dev = torch.from_numpy(kept_host).to(device)
    lengths = np.diff(np.asarray(bounds, np.int64)).tolist()
    for first, end in _runs(lengths):
        n = lengths[first]
        if n == 0:
            continue
        run_k = kept_host[first:end]
        run_max = int(run_k.max())
        if int(run_k.min()) < 1 or run_max > n:  # host check: select_kept's contract, no sync
            raise KernelError(
                f"batch_kept_indices: kept_per_head of requests {first}..{end - 1} must lie in "
                f"[1, n={n}] (no head keeps 0 tokens), got {run_k.min()}..{run_max}"
            )
        if int(run_k.min()) == n:  # every head keeps the whole segment: no scoring needed
            out[first:end, :, :n] = torch.arange(n, device=device)
            continue
        scores = _score_run(scorer, q, k_new, lse, bounds[first], end - first, n, sm_scale)
        key = priority_key(scores, sink_tokens, recent_window)
        out[first:end, :, :run_max] = kept_from_ranks(key, kept_per_head_dev[first:end], run_max)
    return out


def reference_kept_indices(
    scorer: Scorer,
    q: torch.Tensor,
    k_new: torch.Tensor,
    lse: torch.Tensor,
    bounds: list[int],
    kept_per_head: Sequence[Sequence[int]] | np.ndarray,
    sm_scale: float,
    sink_tokens: int,
    recent_window: int,
) -> torch.Tensor:
    """:func:`batch_kept_indices` one request and one distinct ``k_g`` at a time (the oracle).

    The straightforward form (the backend's path before the batched one): per request, the
    scorer on its segment, then :func:`~tangram_sglang.scoring.select.select_kept` for the
    heads of each distinct ``k_g``. Tests and ``bench.prefill_profile`` compare against it.
    Arguments and result as :func:`batch_kept_indices`.
    """
    kept_host = np.asarray(kept_per_head, np.int64).reshape(len(bounds) - 1, k_new.shape[1])
    bs, num_kv_heads = kept_host.shape
    max_k = int(kept_host.max()) if kept_host.size else 1
    out = torch.zeros(bs, num_kv_heads, max(max_k, 1), dtype=torch.int64, device=k_new.device)
    for i in range(bs):
        start, end = bounds[i], bounds[i + 1]
        n = end - start
        if n == 0:
            continue
        if int(kept_host[i].min()) == n:
            out[i, :, :n] = torch.arange(n, device=k_new.device)
            continue
        w = min(scorer.obs_window, n)
        scores = scorer.score(
            q[end - w : end].transpose(0, 1), k_new[start:end].transpose(0, 1), sm_scale,
            lse_obs=lse[end - w : end].transpose(0, 1),
        )  # fmt: skip
        for k in sorted(set(kept_host[i].tolist())):
            heads = [h for h in range(num_kv_heads) if kept_host[i, h] == k]
            idx = torch.tensor(heads, device=k_new.device)
            out[i, idx, :k] = select_kept(scores[idx], k, sink_tokens, recent_window)
    return out
