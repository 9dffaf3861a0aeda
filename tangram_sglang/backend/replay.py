"""The replay pass inside an extend batch: token layout, positions and scores (``kvzip``).

Under a replay scorer (``scoring.kvzip``) the scheduler adds, to each row whose segment is
compressed, ``m`` replay tokens (KVzip's repeat prompt, then the segment's ids again;
``integration.replay``). SGLang samples each row's next token from the row's last token in the
flat batch, so the replay tokens come *first* in the row and the segment last::

    flat row i (what the model runs):   [ replay_0 .. replay_{m-1} | seg_0 .. seg_{n-1} ]
    logical row i (what attention sees): [ seg_0 .. seg_{n-1} | replay_0 .. replay_{m-1} ]
    positions:                            prefix + 0 .. prefix + n + m - 1 (logical order)

The attention backend gathers q, k and v into the logical order (:attr:`ReplayLayout.to_logical`),
so one causal extend gives the segment exactly its attention without replay (it precedes the
replay) and each replay query its attention over the history, the segment and the replay before
it, as in KVzip's second forward. It then scores the segment's keys by the replay queries
(:func:`replay_token_scores`), keeps each head's top ``k_g`` segment tokens, writes only their
K/V, and gathers the output back into the flat order (:attr:`ReplayLayout.to_flat`). A row
without replay (``m = 0``: kept whole) is the same in both orders.

Source: KVzip (arXiv 2505.23416) §3; kvpress 0.5.5 ``KVzipPress`` (prompts, chunked replay).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import numpy as np
import torch

from tangram_sglang.errors import KernelError
from tangram_sglang.host_copy import host_to_device
from tangram_sglang.kernels.replay_scores import replay_max_scores
from tangram_sglang.kernels.replay_scores import supported as replay_kernel_supported
from tangram_sglang.scoring.kvzip import KVzipScorer
from tangram_sglang.scoring.snapkv import reduce_gqa

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ReplayLayout:
    """How one extend batch's replay tokens sit among its segments (module docstring).

    Attributes:
        to_logical: int64 ``[T]`` device: logical token ``j`` is flat token ``to_logical[j]``.
        to_flat: int64 ``[T]`` device: flat token ``t`` is logical token ``to_flat[t]``.
        segment_tokens: int64 ``[S]`` device: the logical indices of the segments' tokens, in
            order (``S`` = the batch's segment tokens).
        segment_bounds: host ``bs + 1`` ints: each row's segment in the segment-only order.
        segment_indptr: int32 ``[bs + 1]`` device copy of ``segment_bounds``.
        replayed: host ``(batch index, logical start, n, m, segment start)`` of each row with
            replay.
    """

    to_logical: torch.Tensor
    to_flat: torch.Tensor
    segment_tokens: torch.Tensor
    segment_bounds: list[int]
    segment_indptr: torch.Tensor
    replayed: tuple[tuple[int, int, int, int, int], ...]


def row_offsets(lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int64 ``(row start, index within the row)`` of every token of rows ``lens`` long, laid
    one after another (each ``[sum(lens)]``)."""
    lens = np.asarray(lens, np.int64)
    start = np.repeat(np.cumsum(lens) - lens, lens)
    return start, np.arange(int(lens.sum()), dtype=np.int64) - start


def check_replay_lens(flat_lens: np.ndarray, replay_lens: np.ndarray) -> None:
    """Each row's replay fits in its flat length and leaves a segment.

    Raises:
        KernelError: different sizes, a negative replay, or a replayed row with no segment.
    """
    if flat_lens.shape != replay_lens.shape:
        raise KernelError(
            f"replay: {replay_lens.size} replay lengths for {flat_lens.size} rows; the "
            "scheduler's replay record does not match the batch"
        )
    bad = (replay_lens < 0) | ((replay_lens > 0) & (replay_lens >= flat_lens))
    if bad.any():
        i = int(np.nonzero(bad)[0][0])
        raise KernelError(
            f"replay: row {i} has {int(replay_lens[i])} replay tokens of {int(flat_lens[i])} "
            "in the batch; a replay needs a segment after it"
        )


def check_every_compressed_row_replays(
    segment_lens: list[int], kept_lens: np.ndarray, replay_lens: np.ndarray | None
) -> None:
    """Under a replay scorer, every row whose segment is compressed (some head group keeps
    fewer than its ``n`` tokens) runs a replay.

    Args:
        segment_lens: ``bs`` segment lengths (tokens).
        kept_lens: int ``[bs, G]`` kept tokens per head group (the scheduler's allocation).
        replay_lens: int ``[bs]`` replay tokens per row, or None (no row replays).

    Raises:
        KernelError: naming the first compressed row without replay (the scheduler's replay
            hook did not run for this batch).
    """
    seg = np.asarray(segment_lens, np.int64)
    compressed = (np.asarray(kept_lens, np.int64) < seg[:, None]).any(axis=1)
    missing = compressed if replay_lens is None else compressed & (replay_lens == 0)
    if missing.any():
        i = int(np.nonzero(missing)[0][0])
        raise KernelError(
            f"Tangram backend: request {i} of the batch compresses its {int(seg[i])}-token "
            "segment without a replay; the kvzip scorer needs the replay tokens the plugin's "
            "ScheduleBatch.prepare_for_extend hook adds (start the server with --tangram)"
        )


def replay_positions(
    prefix_lens: np.ndarray,
    flat_lens: np.ndarray,
    replay_lens: np.ndarray,
    max_positions: int | None = None,
) -> np.ndarray:
    """int64 ``[T]`` RoPE position of every flat token (module docstring's layout).

    Args:
        prefix_lens: int ``[bs]`` tokens before each row's segment (cached or earlier chunks).
        flat_lens: int ``[bs]`` tokens each row runs (segment + replay).
        replay_lens: int ``[bs]`` replay tokens of each row (0 = none).
        max_positions: rows of the model's RoPE table (positions ``0 .. max_positions - 1``);
            a replay that would run past it starts earlier, so that its last token sits at
            ``max_positions - 1`` (its offset to the segment shrinks; none below position 0).
            None = no limit.

    Raises:
        KernelError: see :func:`check_replay_lens`.
    """
    prefix = np.asarray(prefix_lens, np.int64)
    flat = np.asarray(flat_lens, np.int64)
    replay = np.asarray(replay_lens, np.int64)
    check_replay_lens(flat, replay)
    seg = flat - replay
    first = prefix + seg  # the first replay token's position
    if max_positions is not None:
        first = np.clip(np.minimum(first, int(max_positions) - replay), 0, None)
    _, t = row_offsets(flat)  # index within the flat row
    m = np.repeat(replay, flat)
    positions = np.where(t < m, np.repeat(first, flat) + t, np.repeat(prefix, flat) + t - m)
    if max_positions is not None:
        positions = np.minimum(positions, int(max_positions) - 1)
    return positions


def replay_layout(
    flat_lens: np.ndarray, replay_lens: np.ndarray, device: torch.device | str
) -> ReplayLayout:
    """The gather indices of one extend batch with replay (module docstring's layout).

    Args:
        flat_lens: int ``[bs]`` tokens each row runs (segment + replay).
        replay_lens: int ``[bs]`` replay tokens of each row (0 = none).
        device: where the indices go (one non-blocking copy each).

    Raises:
        KernelError: see :func:`check_replay_lens`.
    """
    flat = np.asarray(flat_lens, np.int64)
    replay = np.asarray(replay_lens, np.int64)
    check_replay_lens(flat, replay)
    seg = flat - replay
    row_start = np.cumsum(flat) - flat
    start, j = row_offsets(flat)  # j: index within the row
    m, n = np.repeat(replay, flat), np.repeat(seg, flat)
    to_logical = start + np.where(j < n, m + j, j - n)  # logical j reads this flat token
    to_flat = start + np.where(j < m, n + j, j - m)  # flat j sits at this logical index
    segment_tokens = start[j < n] + j[j < n]
    bounds = np.concatenate([[0], np.cumsum(seg)])
    replayed = tuple(
        (i, int(row_start[i]), int(seg[i]), int(replay[i]), int(bounds[i]))
        for i in np.nonzero(replay > 0)[0].tolist()
    )
    return ReplayLayout(
        to_logical=host_to_device(to_logical, device),
        to_flat=host_to_device(to_flat, device),
        segment_tokens=host_to_device(segment_tokens, device),
        segment_bounds=bounds.tolist(),
        segment_indptr=host_to_device(bounds.astype(np.int32), device),
        replayed=replayed,
    )


def replay_token_scores(
    scorer,
    q: torch.Tensor,
    k: torch.Tensor,
    lse: torch.Tensor,
    layout: ReplayLayout,
    sm_scale: float,
) -> torch.Tensor:
    """float32 ``[H_kv, S]`` scores of every segment token of the batch, from its replay.

    On CUDA the KVzip scorer's maxima come from ``kernels.replay_scores.replay_max_scores`` (one
    launch per replayed row and layer, tensor-core dot products); elsewhere, for a head shape
    the kernel does not take (logged once, about 15x slower) and for any other replay scorer,
    from ``scorer.score`` (torch ops, float32).

    Args:
        scorer: a replay scorer (``scoring.kvzip.KVzipScorer``).
        q: ``[T, H_q, D]`` post-RoPE queries in the logical order.
        k: ``[T, H_kv, D]`` post-RoPE keys in the logical order.
        lse: float32 ``[T, H_q]`` natural-log LSE of each query over everything it attends to.
        layout: the batch's :class:`ReplayLayout`.
        sm_scale: softmax scale.

    Returns:
        Scores in the segment-only order (:attr:`ReplayLayout.segment_bounds`); columns of rows
        without replay are 0 (those rows are kept whole and not read).
    """
    total = layout.segment_bounds[-1]
    out = torch.zeros(k.shape[1], total, dtype=torch.float32, device=k.device)
    kernel = type(scorer) is KVzipScorer and q.is_cuda
    for _, start, n, m, seg_start in layout.replayed:
        q_rep = q[start + n : start + n + m].transpose(0, 1)  # [H_q, m, D]
        k_seg = k[start : start + n].transpose(0, 1)  # [H_kv, n, D]
        lse_rep = lse[start + n : start + n + m].transpose(0, 1)  # [H_q, m]
        if kernel and replay_kernel_supported(q_rep, k_seg):
            best = replay_max_scores(q_rep, k_seg, lse_rep, sm_scale)  # [H_q, n]
            scores = reduce_gqa(best, k_seg.shape[0], scorer.gqa_reduce)
        else:
            if kernel:
                _log_torch_scores(tuple(q_rep.shape[::2]), tuple(k_seg.shape[::2]))
            scores = scorer.score(q_rep, k_seg, sm_scale, lse_rep)
        out[:, seg_start : seg_start + n] = scores
    return out


@functools.cache
def _log_torch_scores(q_heads_dim: tuple[int, int], k_heads_dim: tuple[int, int]) -> None:
    """Say once per head shape that the replay scores take the torch scorer on a GPU."""
    logger.warning(
        "kvzip: [query heads, head_dim] %s and [KV heads, head_dim] %s do not fit the replay "
        "score kernel (kernels.replay_scores.supported); scoring with torch ops, about 15x "
        "slower per layer",
        list(q_heads_dim),
        list(k_heads_dim),
    )
