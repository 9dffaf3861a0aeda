"""Ahead-of-time split-KV tables for the ragged decode kernel (Tangram's AOT load balancing).

Decode work of KV head ``h`` is proportional to its kept length, i.e. to its head group's ratio
``r_g`` times the context. The ratios are static (the budget profile), so the split-KV partition
is computed once at start-up and the decode kernel only reads it: no per-step planning, no host
sync (Tangram arXiv 2606.06302, "Ahead-of-time load balancing"; docs/design.md §3.3). The
table is the paper's plan (``TANGRAM_DECODE_PLAN=table``); ``lengths`` keeps only its CTA
budget and fits the split to the real lengths in the kernel, and ``batch`` (serving's default)
does the same with a wider row budget and a chunk floor from the whole batch (both below).

Per layer ``l`` and batch bucket the table holds::

    splits[l, h]          int32 [num_layers, num_kv_heads]  KV splits of head h (>= 1)
    cta_head[l, c]        int32 [num_layers, max_ctas]      KV head of CTA c of one request row
    cta_split[l, c]       int32 [num_layers, max_ctas]      split of CTA c, in [0, splits[l, h])
    num_ctas[l]           python int                        CTAs per request row at layer l

The stage-1 grid of a decode launch is ``(batch_size, num_ctas[l])``: program ``(b, c)`` runs
split ``cta_split[l, c]`` of head ``cta_head[l, c]`` for batch entry ``b``. Every (head, split)
pair of a layer appears exactly once. CTAs are ordered by decreasing per-CTA work (largest group
ratio first), so the heaviest CTAs are dispatched first (longest-processing-time order) and the
tail of the launch is made of short CTAs.

Rule for the total CTA count (one batch bucket ``B``, ``S`` SMs, ``W = sum_h r_h`` of the layer,
``c`` CTAs per SM: :data:`CTAS_PER_SM` unless ``TANGRAM_DECODE_CTAS_PER_SM`` sets another)::

    target  = max(num_kv_heads, ceil(c * S / B))                 CTAs per request row
    scale   = min(target / W, max_splits_per_head / max_h r_h)
    splits_h = clamp(round(r_h * scale), 1, max_splits_per_head)   (AOT: proportional to r_h)
    splits_h = clamp(round(sum_h aot_splits_h / num_kv_heads), 1, max_splits_per_head)  (uniform)

So a launch has about ``c * S`` CTAs whatever the batch (enough to fill every SM a few
times over; fewer at tiny batches, where the cap on the longest head binds), and each AOT CTA
covers about the same number of kept tokens. The uniform baseline gets the SAME number of CTAs
per row, split evenly over the heads (FlashDecoding's static split at equal resources), so its
longest CTA is ``max_h r_h / mean_h r_h`` times the AOT one. At large batches ``target`` falls
to ``num_kv_heads``; proportional splitting still gives the long heads more splits, so no CTA is
a straggler several times longer than the others.

Tables are built for a set of batch-size buckets (powers of two up to ``max_batch_size``); a
launch for batch ``bs`` uses the smallest bucket ``>= bs`` (a host-side lookup on a python int,
so CUDA-graph capture per batch size sees a fixed table).

Length-fitted plan (``TANGRAM_DECODE_PLAN=lengths``; ``decode_attention.py``, ``plan="lengths"``)
---------------------------------------------------------------------------------------------

The table is balanced only when every group's kept length is its ratio times the context. Segments
kept whole (short turns, the decode tail) give every group of a row about the same length, and
then a low-ratio head with few splits is the straggler. So the length-fitted plan fits the
split of each head to the row's real lengths every step, inside the kernel; only the CTA budget
is ahead of time. Per request row, ``L_h = group_len[row, group_of_head[h]]``::

    N        = target (above)                   CTA budget per row (per bucket, AOT)
    cap      = min(max_splits_per_head, N)      splits of one head (and the scratch's split dim)
    total    = sum_h L_h
    chunk    = BLOCK_N * max(1, ceil(max(ceil(total / N), ceil(max_h L_h / cap)) / BLOCK_N))
    splits_h = max(1, ceil(L_h / chunk))
    chunk_h  = BLOCK_N * ceil(ceil(L_h / splits_h) / BLOCK_N)      (<= chunk: even within a head)
    CTA c of the row -> head h with E_{h-1} <= c < E_h (E_h = splits_0 + ... + splits_h),
                        split c - E_{h-1}: tokens [split * chunk_h, min(L_h, (split + 1) * chunk_h))

(FlashDecoding's fixed chunk per CTA, as FlashInfer's decode planner sizes its chunks from the
batch's lengths, moved from the host into the kernel.) Every CTA covers at most ``chunk`` tokens,
about ``total / N``, whatever the mix of lengths, and no split is empty:
``(splits_h - 1) * chunk_h <= (splits_h - 1) * chunk < L_h``. The bound that sizes the static
grid: since ``ceil(L / chunk) <= floor(L / chunk) + 1`` and ``chunk >= total / N``,
``sum_h splits_h <= floor(total / chunk) + H_kv <= N + H_kv``; since ``chunk >= max_h L_h / cap``,
``splits_h <= cap``. So the stage-1 grid is ``(bs, min(N + H_kv, H_kv * cap))`` per bucket and
CTAs past a row's ``sum_h splits_h`` exit at once. :func:`fitted_splits` and
:func:`fitted_cta_spans` are the numpy twins of the kernel's helper (tests, balance report).

Batch-balanced plan (``TANGRAM_DECODE_PLAN=batch``)
--------------------------------------------------

The length-fitted plan balances the CTAs of one row; at large batches its budget ``N`` falls to
about one or two CTAs per head, so the longest row of a chat batch (a few thousand tokens among
rows of a few hundred) walks its whole length in one or two CTAs while the rest of the launch
has finished. The batch-balanced plan runs the same in-kernel split with a wider row budget and
a chunk floor shared by the launch::

    R        = max(N, BATCH_ROW_SPLITS * H_kv)     CTA budget per row (per bucket, AOT)
    cap_R    = min(max_splits_per_head, R)
    floor_l  = ceil(sum over the batch's rows and KV heads of L / (c * S))   (host)
    chunk    = BLOCK_N * max(1, ceil(max(ceil(total / R), ceil(max_h L_h / cap_R), floor_l)
                                     / BLOCK_N))

The floor is the chunk that spreads the layer's whole batch over the CTAs one launch aims for
(FlashInfer's decode planner and SGLang's ``get_num_kv_splits`` size their chunks from the
batch, not the row): a row no longer than the floor keeps one CTA per head, a long row splits
into up to ``R`` CTAs. The host computes the floor of every layer from the lengths the
scheduler advanced (no device read) and uploads it with the step's plan; the grid bound is the
length-fitted one with ``R``: ``(bs, min(R + H_kv, H_kv * cap_R))``.

This module is CPU-only numpy at build time; :meth:`SplitTable.to` moves the tensors to the device
once. It owns only the partition; the kernel that reads it is ``decode_attention.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from tangram_sglang.config import DEFAULT_DECODE_CTAS_PER_SM
from tangram_sglang.errors import ConfigError, KernelError
from tangram_sglang.grouping import HeadGrouping

# CTAs per SM a decode launch aims for. The kernel holds 3 CTAs per SM at head_dim 128 (160-166
# registers per thread), so a launch is several waves of 3 x SMs CTAs. Measured on an H100
# (benchmarks/RESULTS.md, issue 18: bench.kernels, batch plan, 8/23 equal rows of 16k and 64
# skewed rows of 4k/16k at kept 1.0 and 0.25): 12 was within 1.1% of the fastest value tried
# (3, 8, 12, 28; 3 on the equal rows only) in each of the six shapes, 13-14% faster than 8 (the
# earlier value) at 8 and 23 rows of 16k, and up to 5% faster than 28 at 64 skewed rows. The fp32
# partial output (GQA * D * 4 bytes per CTA) stays a few percent of the KV bytes a CTA reads. A
# server may set another with TANGRAM_DECODE_CTAS_PER_SM (config.decode_ctas_per_sm).
CTAS_PER_SM = DEFAULT_DECODE_CTAS_PER_SM
# Upper bound on the splits of one KV head; also the split dimension of the stage-1 scratch.
MAX_SPLITS_PER_HEAD = 64
# The batch-balanced plan's CTA budget per request row, per KV head: a long row among short
# ones may take up to this many splits per head on average (SGLang's Triton decode caps a
# request at 8 splits, ``--triton-attention-num-kv-splits``), whatever the bucket.
BATCH_ROW_SPLITS = 8


@dataclass(frozen=True, slots=True)
class LayerSplits:
    """The split table of one layer for one batch bucket (device tensors, read per layer).

    Attributes:
        splits: int32 ``[num_kv_heads]``: splits of each KV head (>= 1).
        cta_head: int32 ``[num_ctas]``: KV head of each CTA of a request row.
        cta_split: int32 ``[num_ctas]``: split index of each CTA.
        num_ctas: CTAs per request row (python int, the stage-1 grid's second dimension).
        max_splits: the largest entry of ``splits`` (python int; sizes the scratch).
        cta_budget: ``N``, the length-fitted plan's CTA budget per request row.
        split_cap: the length-fitted plan's cap on one head's splits (``min(max_splits_per_head,
            N)``; the scratch's split dimension must hold it).
        fitted_ctas: the length-fitted plan's CTAs per request row (its stage-1 grid's second
            dimension): ``min(N + num_kv_heads, num_kv_heads * split_cap)``.
        batch_budget, batch_cap, batch_ctas: the batch-balanced plan's CTA budget per row
            (``R``), cap on one head's splits and CTAs per row (grid), the same rule with ``R``.
        launch_ctas: the CTAs a whole launch aims for (``ctas_per_sm * num_sms``), the
            denominator of the batch-balanced plan's chunk floor (:func:`batch_chunk_floor`).
    """

    splits: torch.Tensor
    cta_head: torch.Tensor
    cta_split: torch.Tensor
    num_ctas: int
    max_splits: int
    cta_budget: int
    split_cap: int
    fitted_ctas: int
    batch_budget: int
    batch_cap: int
    batch_ctas: int
    launch_ctas: int


@dataclass(frozen=True, slots=True)
class SplitTable:
    """Split tables of every layer for one batch bucket. Build with :func:`build_split_table`.

    Attributes:
        batch_size: the bucket's batch size (launches with ``bs <= batch_size`` may use it).
        splits: int32 ``[num_layers, num_kv_heads]``.
        cta_head: int32 ``[num_layers, max_ctas]`` (entries past ``num_ctas[l]`` are -1).
        cta_split: int32 ``[num_layers, max_ctas]`` (entries past ``num_ctas[l]`` are -1).
        num_ctas: CTAs per request row of each layer.
        layer_max_splits: largest split count of each layer (host ints: no device read).
        uniform: True for the uniform-split baseline table.
        cta_budget: ``N`` of the length-fitted plan (CTAs per request row, the target rule).
        split_cap: the length-fitted plan's cap on one head's splits.
        launch_ctas: CTAs one launch aims for, ``ctas_per_sm * num_sms`` (the batch-balanced
            plan's chunk floor divides the batch's kept tokens by it).
        split_limit: the cap on one head's splits the table was built with (``max_splits``
            of :func:`build_split_table`); bounds every plan's splits.
    """

    batch_size: int
    splits: torch.Tensor
    cta_head: torch.Tensor
    cta_split: torch.Tensor
    num_ctas: tuple[int, ...]
    layer_max_splits: tuple[int, ...]
    uniform: bool
    cta_budget: int
    split_cap: int
    launch_ctas: int
    split_limit: int = MAX_SPLITS_PER_HEAD

    @property
    def max_splits(self) -> int:
        """Largest split count of any head of any layer under the static table."""
        return max(self.layer_max_splits)

    @property
    def scratch_splits(self) -> int:
        """Split dimension the stage-1 scratch needs for every plan (table, lengths, batch)."""
        return max(self.max_splits, self.split_cap, self.batch_cap)

    @property
    def fitted_ctas(self) -> int:
        """The length-fitted plan's CTAs per request row (see the module docstring's bound)."""
        num_kv_heads = self.splits.shape[1]
        return min(self.cta_budget + num_kv_heads, num_kv_heads * self.split_cap)

    @property
    def batch_budget(self) -> int:
        """``R``, the batch-balanced plan's CTA budget per request row:
        ``max(N, BATCH_ROW_SPLITS * num_kv_heads)``."""
        return max(self.cta_budget, BATCH_ROW_SPLITS * int(self.splits.shape[1]))

    @property
    def batch_cap(self) -> int:
        """The batch-balanced plan's cap on one head's splits: ``min(split_limit, R)``."""
        return min(self.split_limit, self.batch_budget)

    @property
    def batch_ctas(self) -> int:
        """The batch-balanced plan's CTAs per request row (its stage-1 grid's second dimension):
        ``min(R + num_kv_heads, num_kv_heads * batch_cap)``, the length-fitted bound with ``R``."""
        num_kv_heads = int(self.splits.shape[1])
        return min(self.batch_budget + num_kv_heads, num_kv_heads * self.batch_cap)

    def layer(self, layer: int) -> LayerSplits:
        """The per-layer view the decode launcher takes (views, no copy, no device read).

        Build the views once (``[table.layer(l) for l in range(num_layers)]``) at start-up and
        reuse them every step.
        """
        num_ctas = self.num_ctas[layer]
        return LayerSplits(
            splits=self.splits[layer],
            cta_head=self.cta_head[layer, :num_ctas],
            cta_split=self.cta_split[layer, :num_ctas],
            num_ctas=num_ctas,
            max_splits=self.layer_max_splits[layer],
            cta_budget=self.cta_budget,
            split_cap=self.split_cap,
            fitted_ctas=self.fitted_ctas,
            batch_budget=self.batch_budget,
            batch_cap=self.batch_cap,
            batch_ctas=self.batch_ctas,
            launch_ctas=self.launch_ctas,
        )

    def to(self, device: torch.device | str) -> SplitTable:
        """The same table with its tensors on ``device`` (done once at start-up)."""
        return SplitTable(
            batch_size=self.batch_size,
            splits=self.splits.to(device),
            cta_head=self.cta_head.to(device),
            cta_split=self.cta_split.to(device),
            num_ctas=self.num_ctas,
            layer_max_splits=self.layer_max_splits,
            uniform=self.uniform,
            cta_budget=self.cta_budget,
            split_cap=self.split_cap,
            launch_ctas=self.launch_ctas,
            split_limit=self.split_limit,
        )


@dataclass(frozen=True, slots=True)
class SplitTables:
    """Split tables for a set of batch buckets; :meth:`for_batch` picks one per launch."""

    tables: tuple[SplitTable, ...]  # ascending batch_size

    @property
    def max_splits(self) -> int:
        """Largest split count over every bucket (sizes a scratch shared by all buckets)."""
        return max(t.max_splits for t in self.tables)

    @property
    def scratch_splits(self) -> int:
        """Split dimension of a stage-1 scratch shared by every bucket, for every plan."""
        return max(t.scratch_splits for t in self.tables)

    def for_batch(self, batch_size: int) -> SplitTable:
        """The table of the smallest bucket ``>= batch_size`` (the largest one beyond it)."""
        for table in self.tables:
            if table.batch_size >= batch_size:
                return table
        return self.tables[-1]

    def to(self, device: torch.device | str) -> SplitTables:
        """Every bucket's tensors on ``device``."""
        return SplitTables(tuple(t.to(device) for t in self.tables))


def head_ratios(grouping: HeadGrouping, group_ratios: np.ndarray) -> np.ndarray:
    """float64 ``[num_layers, num_kv_heads]``: each KV head's group ratio (its decode work)."""
    group_ratios = np.asarray(group_ratios, dtype=np.float64)
    if group_ratios.shape != (grouping.num_head_groups,):
        raise ConfigError(
            f"group_ratios has shape {list(group_ratios.shape)} but the grouping has "
            f"{grouping.num_head_groups} head groups; pass BudgetProfile.group_ratios"
        )
    return group_ratios[grouping.cluster_of]


def layer_splits(
    ratios: np.ndarray, target_ctas: int, uniform: bool, max_splits: int = MAX_SPLITS_PER_HEAD
) -> np.ndarray:
    """Splits of each KV head of one layer (the documented rule; see the module docstring).

    Args:
        ratios: float ``[num_kv_heads]``, each head's group ratio in (0, 1].
        target_ctas: wanted CTAs per request row (>= 1).
        uniform: the uniform baseline instead of AOT: every head gets the AOT table's mean
            split count (same CTAs per row, split evenly).
        max_splits: cap on one head's splits.

    Returns:
        int64 ``[num_kv_heads]`` in ``[1, max_splits]``.
    """
    ratios = np.asarray(ratios, dtype=np.float64)
    scale = min(target_ctas / ratios.sum(), max_splits / ratios.max())
    aot = np.clip(np.rint(ratios * scale), 1, max_splits).astype(np.int64)
    if not uniform:
        return aot
    per_head = min(max(round(aot.sum() / ratios.size), 1), max_splits)
    return np.full(ratios.size, per_head, dtype=np.int64)


def cta_map(splits: np.ndarray, ratios: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Static CTA -> (kv_head, split) map of one layer, heaviest CTAs first.

    Args:
        splits: int ``[num_kv_heads]`` (>= 1).
        ratios: float ``[num_kv_heads]``: per-head work per unit of context.

    Returns:
        ``(cta_head, cta_split)``, int64 ``[sum(splits)]`` each, sorted by decreasing per-CTA
        work ``ratios[h] / splits[h]`` (ties by head, then split).
    """
    heads = np.repeat(np.arange(splits.size), splits)
    split_idx = np.concatenate([np.arange(n) for n in splits])
    work = ratios[heads] / splits[heads]
    order = np.lexsort((split_idx, heads, -work))
    return heads[order], split_idx[order]


def fitted_splits(
    lens: np.ndarray, cta_budget: int, split_cap: int, block_n: int, floor: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Numpy twin of the decode kernel's length-fitted plan (the module docstring's rule).

    Args:
        lens: int ``[..., num_kv_heads]``: kept tokens of each KV head's group, per row.
        cta_budget: ``N`` (CTAs per row, >= 1). split_cap: cap on one head's splits (>= 1).
        block_n: the kernel's tokens per inner block (``decode_attention.BLOCK_N``).
        floor: the batch-balanced plan's chunk floor (:func:`batch_chunk_floor`; tokens, >= 0;
            0 = the length-fitted plan); the batch-balanced plan passes ``R`` and its cap as
            ``cta_budget`` and ``split_cap``.

    Returns:
        ``(splits, head_chunk)``, int64 ``[..., num_kv_heads]`` each: each head's splits, in
        ``[1, split_cap]``, and tokens per split (``chunk_h``, a multiple of ``block_n``, at most
        the row's ``chunk``).
    """
    lens = np.asarray(lens, dtype=np.int64)
    total, longest = lens.sum(axis=-1), lens.max(axis=-1)
    chunk = np.maximum(-(-total // cta_budget), -(-longest // split_cap))
    chunk = np.maximum(chunk, int(floor))
    chunk = np.maximum(-(-chunk // block_n), 1) * block_n
    splits = np.maximum(-(-lens // chunk[..., None]), 1)
    per_split = -(-lens // splits)
    head_chunk = -(-per_split // block_n) * block_n
    return splits, head_chunk


def fitted_cta_spans(
    lens: np.ndarray,
    cta_budget: int,
    split_cap: int,
    block_n: int,
    num_ctas: int,
    floor: int = 0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What each CTA of one row does under the length-fitted plan (the kernel's lookup, in numpy).

    Args:
        lens: int ``[num_kv_heads]``: one row's kept tokens per KV head.
        cta_budget, split_cap, block_n, floor: as :func:`fitted_splits`.
        num_ctas: the launch's CTAs per row (``LayerSplits.fitted_ctas``, or ``batch_ctas``).

    Returns:
        ``(head, start, end)``, int64 ``[num_ctas]`` each: CTA ``c`` attends tokens
        ``[start, end)`` of KV head ``head`` (``head = -1``: idle, the CTA exits at once).
    """
    lens = np.asarray(lens, dtype=np.int64)
    splits, head_chunk = fitted_splits(lens, cta_budget, split_cap, block_n, floor)
    ends = np.cumsum(splits)
    c = np.arange(num_ctas)
    head = (ends[None, :] <= c[:, None]).sum(axis=1)
    busy = c < ends[-1]
    head_c = np.minimum(head, lens.size - 1)
    split = c - (ends[head_c] - splits[head_c])
    start = np.where(busy, split * head_chunk[head_c], 0)
    end = np.where(busy, np.minimum(lens[head_c], start + head_chunk[head_c]), 0)
    return np.where(busy, head, -1), start, end


def batch_chunk_floor(lens: np.ndarray, launch_ctas: int) -> int:
    """The batch-balanced plan's chunk floor of one layer's launch (tokens per CTA, host).

    ``ceil(sum(lens) / launch_ctas)``: the chunk that spreads the whole batch's kept tokens of
    the layer over the CTAs one launch aims for (``SplitTable.launch_ctas``), as SGLang's Triton
    decode sizes its chunk from the batch's longest and shortest requests and FlashInfer's
    decode planner from the batch's total. No row then splits finer than the batch as a whole,
    and a long row among short ones splits as finely as its row budget allows.

    Args:
        lens: int ``[bs, num_kv_heads]``: the batch's kept tokens per row and KV head (>= 0).
        launch_ctas: CTAs per launch (>= 1).

    Returns:
        The floor (python int, 0 for an empty batch).

    Raises:
        KernelError: ``launch_ctas`` not a whole number >= 1, or ``lens`` not a 2-D array of
            whole numbers >= 0.
    """
    check_launch_ctas(launch_ctas)
    lens = np.asarray(lens)
    if lens.ndim != 2 or not np.issubdtype(lens.dtype, np.integer) or (lens < 0).any():
        raise KernelError(
            f"lens must be whole numbers >= 0 of shape [bs, num_kv_heads], got dtype "
            f"{lens.dtype} and shape {list(lens.shape)}"
        )
    return -(-int(lens.astype(np.int64).sum(dtype=object)) // int(launch_ctas))


def check_launch_ctas(launch_ctas) -> None:
    """Raises KernelError unless ``launch_ctas`` is a whole number >= 1 (no bool)."""
    ok = isinstance(launch_ctas, (int, np.integer)) and not isinstance(
        launch_ctas, (bool, np.bool_)
    )
    if not ok or launch_ctas < 1:
        raise KernelError(f"launch_ctas={launch_ctas!r} must be a whole number >= 1")


def build_split_table(
    grouping: HeadGrouping,
    group_ratios: np.ndarray,
    num_sms: int,
    batch_size: int,
    uniform: bool = False,
    max_splits: int = MAX_SPLITS_PER_HEAD,
    ctas_per_sm: int = CTAS_PER_SM,
) -> SplitTable:
    """Build the split tables of every layer for one batch bucket. Runs once at start-up.

    Args:
        grouping: the profile's head grouping (``cluster_of`` maps heads to groups).
        group_ratios: float ``[num_head_groups]`` (``BudgetProfile.group_ratios``).
        num_sms: the device's SM count (``get_device_properties(d).multi_processor_count``).
        batch_size: the bucket's batch size (requests per decode launch).
        uniform: build the uniform-split baseline instead of the AOT table.
        max_splits: cap on one head's splits (sizes the scratch).
        ctas_per_sm: CTAs per SM a launch aims for (:data:`CTAS_PER_SM`; a server reads
            ``TANGRAM_DECODE_CTAS_PER_SM``, :func:`tangram_sglang.config.decode_ctas_per_sm`).

    Returns:
        A :class:`SplitTable` with int32 CPU tensors (call ``.to(device)`` once).

    Raises:
        ConfigError: ``num_sms``, ``batch_size``, ``max_splits`` or ``ctas_per_sm`` not a whole
            number >= 1, or ratio shape mismatch.

    Source: Tangram arXiv 2606.06302, AOT load balancing; the CTA-count rule in this module's
    docstring.
    """
    for name, value in (
        ("num_sms", num_sms),
        ("batch_size", batch_size),
        ("max_splits", max_splits),
        ("ctas_per_sm", ctas_per_sm),
    ):
        if isinstance(value, bool) or int(value) != value or int(value) < 1:
            raise ConfigError(f"{name}={value!r} must be a whole number >= 1")
    ratios = head_ratios(grouping, group_ratios)
    if not ((ratios > 0) & (ratios <= 1)).all():
        raise ConfigError("group_ratios must lie in (0, 1]; pass BudgetProfile.group_ratios")
    num_layers, num_kv_heads = ratios.shape
    target = max(num_kv_heads, math.ceil(int(ctas_per_sm) * num_sms / batch_size))
    splits = np.stack([layer_splits(r, target, uniform, max_splits) for r in ratios])
    maps = [cta_map(splits[layer], ratios[layer]) for layer in range(num_layers)]
    num_ctas = tuple(int(s.sum()) for s in splits)
    cta_head = np.full((num_layers, max(num_ctas)), -1, dtype=np.int64)
    cta_split = np.full_like(cta_head, -1)
    for layer, (heads, split_idx) in enumerate(maps):
        cta_head[layer, : heads.size] = heads
        cta_split[layer, : split_idx.size] = split_idx
    return SplitTable(
        batch_size=int(batch_size),
        splits=torch.from_numpy(splits.astype(np.int32)),
        cta_head=torch.from_numpy(cta_head.astype(np.int32)),
        cta_split=torch.from_numpy(cta_split.astype(np.int32)),
        num_ctas=num_ctas,
        layer_max_splits=tuple(int(s.max()) for s in splits),
        uniform=uniform,
        cta_budget=target,
        split_cap=min(int(max_splits), target),
        launch_ctas=int(ctas_per_sm) * int(num_sms),
        split_limit=int(max_splits),
    )


def build_split_tables(
    grouping: HeadGrouping,
    group_ratios: np.ndarray,
    num_sms: int,
    max_batch_size: int,
    uniform: bool = False,
    max_splits: int = MAX_SPLITS_PER_HEAD,
    ctas_per_sm: int = CTAS_PER_SM,
) -> SplitTables:
    """Tables for the batch buckets 1, 2, 4, ... up to ``max_batch_size`` (included).

    Runs once at start-up; see :func:`build_split_table` for the arguments and errors.
    """
    if int(max_batch_size) < 1:
        raise ConfigError(f"max_batch_size={max_batch_size} must be >= 1")
    buckets = sorted({min(1 << i, max_batch_size) for i in range(max_batch_size.bit_length() + 1)})
    return SplitTables(
        tuple(
            build_split_table(grouping, group_ratios, num_sms, bs, uniform, max_splits, ctas_per_sm)
            for bs in buckets
        )
    )
