"""TangramState: one server's pool, side tables and per-request bookkeeping (no sglang import).

The one scheduler-side KV manager (shaped like vLLM v1's ``KVCacheManager``: pages to allocate
/ allocate / free). Built once at start-up by the attention backend (from the pool the KV-cache
hook allocated) and shared with the scheduler hooks, which call it at the seams SGLang itself
uses for memory. It drives :class:`~tangram_sglang.mem.manager.TangramMemory`; the attention
backend only reads what it allocated::

    admission:     request_pages / can_admit      (PrefillAdder; the one footprint formula)
    extend batch:  allocate_extend(rows)  -> admit / admit_chunk + alloc_extend + commit:
                   group_len += k_g at schedule time (alloc_for_extend); the forward reads the
                   lengths before the segment from the plan (extend_plan_for)
    decode check:  can_decode(rows)               (check_decode_mem: False -> SGLang retracts)
    decode batch:  allocate_decode(rows)  -> alloc_decode (alloc_for_decode; group_len
                   includes the new token)
    row finished:  finish_row(row)        -> the row's segments (the radix tree takes them)
    row freed:     release(row)           -> every page of the row back to the free list

Rows are SGLang's ``req_pool_idx``. With a radix tree attached (``state.radix``, set by
``radix.cache.TangramRadixCache``) a new row whose ``prefix_len > 0`` starts from the tree's
compressed prefix (``radix.prefix_for``) and page shortfalls evict tree nodes
(``radix.evict_pages``); without one every request starts from an empty table.

Admission policy (``docs/admission.md``; the SGLang side is ``integration.sglang_adapters``).
One formula, :meth:`TangramState.request_pages`, prices a request in pages beyond its matched
prefix: per head group g with prefix kept length ``L_g`` and ``a_g = k_g(first chunk) + (prompt
left - first chunk) + d`` appended tokens, ``sum_g ceil((L_g + a_g)/P) - ceil(L_g/P)`` plus one
copy-on-write page per group whose shared prefix tail page is partial. It decides everything:

* can never fit: ``prefix path pages + request_pages(d = T) > pool pages`` (T =
  ``max_new_tokens``): HTTP 400, or, when the client set no ``max_tokens``, T is lowered to the
  largest value that fits (:meth:`max_decode_tokens`), as SGLang caps it to its token pool;
* fits now: ``sum over new requests of request_pages(d = min(T - out, clip)) + sum over running
  rows of append_need(ceil(min(T_r - out_r, clip) x new_token_ratio)) <= unreserved free pages +
  evictable radix pages`` (clip = SGLang's ``SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION``, 4096), the
  page form of SGLang's ``PrefillAdder`` token check; otherwise the request waits in the queue;
  on an idle pool (no row holds pages) a request that does not fit now never will: HTTP 400.

The ledger reserves only the prompt at admission (``request_pages`` with d = 0: the first chunk
compressed, later chunks uncompressed, trimmed to the exact pages after the last chunk), so a
chunked prefill never waits for a page. The decode tail is not reserved: it grows by pages from
the unreserved free pages, one page per head group whose last page is full. When the pool runs
dry, SGLang's ``check_decode_mem`` says False and ``retract_decode`` retracts requests as stock
does (their pages come back through ``ReqToTokenPool.free``). Pages are exact per head group, so
a request is never retracted for page fragmentation: only when the free pages do not cover the
next step.

Source: Tangram arXiv 2606.06302 (Budget Reservation, Ragged Paging); docs/contracts.md;
SGLang 0.5.17 ``schedule_policy.PrefillAdder`` (``rem_total_tokens``, ``new_token_ratio``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from tangram_sglang.config import segment_grid
from tangram_sglang.errors import KernelError, PoolError
from tangram_sglang.mem.manager import TangramMemory
from tangram_sglang.mem.page_table import SegmentPages
from tangram_sglang.mem.prefix import PrefixMatch
from tangram_sglang.mem.reservation import (
    decode_tail_tokens,
    group_pages_needed,
    segment_kept_lens,
)
from tangram_sglang.profile import BudgetProfile
from tangram_sglang.scoring.base import Scorer, get_scorer, profile_options
from tangram_sglang.scoring.kvzip_gate import is_token_scorer

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RowRecord:
    """What one finished (or aborted) request row held, for logs and ``/server_info``."""

    row: int  # req_pool_idx
    logical_tokens: int  # tokens SGLang counted for the request (prompt + decoded)
    pages: int  # pages the row itself held when it was released
    # pages the row read but the radix tree holds: the matched prefix, plus, under the segment
    # grid, the request's own earlier chunks already inserted mid-prefill
    borrowed_pages: int
    bytes_per_page: int  # K and V of one page (bytes)
    full_kv_bytes: int  # what SGLang's uniform per-token pool would hold for all its tokens

    @property
    def bytes_held(self) -> int:
        """Bytes of the row's own pages (K and V)."""
        return self.pages * self.bytes_per_page

    @property
    def held_fraction(self) -> float:
        """The bytes of every page the request read (its own and the borrowed prefix's) over
        ``full_kv_bytes``, so a request that reused a cached prefix is compared with full KV
        of the same tokens (0.0 without tokens)."""
        whole = (self.pages + self.borrowed_pages) * self.bytes_per_page
        return whole / self.full_kv_bytes if self.full_kv_bytes else 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of the fields plus ``bytes_held`` and ``held_fraction``."""
        return {
            "row": self.row,
            "logical_tokens": self.logical_tokens,
            "pages": self.pages,
            "borrowed_pages": self.borrowed_pages,
            "bytes_held": self.bytes_held,
            "full_kv_bytes": self.full_kv_bytes,
            "held_fraction": self.held_fraction,
        }


def build_scorer(profile: BudgetProfile) -> Scorer:
    """The profile's scorer with the options it was calibrated with (``provenance``).

    Raises:
        ConfigError: unknown scorer, an option name the scorer does not know or one placed
            directly under ``provenance`` (``scoring.base.profile_options``), a bad option value,
            or a token scorer (``kvzip-gate``) whose weights are missing or fit another model
            than the profile's.
    """
    scorer = get_scorer(profile.scorer, **profile_options(profile.scorer, profile.provenance))
    if is_token_scorer(scorer):
        m = profile.model
        scorer.check_model(m.num_layers, m.num_kv_heads, m.head_dim)
    return scorer


def layer_maps(profile: BudgetProfile, device: torch.device | str) -> tuple[torch.Tensor, ...]:
    """int32 ``[num_layers, H_kv]`` group_of_head and column_of_head on ``device`` (start-up)."""
    grouping = profile.grouping
    return tuple(
        torch.as_tensor(m, dtype=torch.int32, device=device).contiguous()
        for m in (grouping.cluster_of, grouping.column_of)
    )


def chunked_footprint_pages(
    profile: BudgetProfile,
    page_size: int,
    prompt_len: int,
    max_new_tokens: int,
    chunk_tokens: int,
    grid: int = 0,
) -> int:
    """Pages a request needs from an empty table: prefill chunks + ``T - 1`` decode tokens.

    Each chunk of a chunked prefill is a segment (its own kept lengths,
    ``mem.reservation.segment_kept_lens``); a group's chunks and decode tail are dense in one
    page list, so its pages are ``ceil(sum of its tokens / page_size)``.

    Args:
        profile: the budget profile.
        page_size: tokens per page.
        prompt_len: prompt tokens (all prefilled: no radix reuse in this version).
        max_new_tokens: T (tokens).
        chunk_tokens: SGLang's chunked-prefill size (tokens); <= 0 = the prompt is one segment.
        grid: segment-grid cell (tokens, = ``chunk_tokens`` under ``TANGRAM_GRID_SEGMENTS=1``):
            the last, partial chunk is then kept whole; 0 = grid off.

    Returns:
        Pages (exact, the same rounding as ``mem.reservation.group_pages_needed``).
    """
    chunk = prompt_len if chunk_tokens <= 0 else int(chunk_tokens)
    total = np.zeros(profile.grouping.num_head_groups, np.int64)
    for start in range(0, prompt_len, max(chunk, 1)):
        total += segment_kept_lens(profile, start, min(chunk, prompt_len - start), grid)
    total += decode_tail_tokens(max_new_tokens)
    zeros = np.zeros_like(total)
    return int(group_pages_needed(zeros, zeros.astype(bool), total, page_size).sum())


@dataclass(frozen=True, slots=True)
class PrefillAsk:
    """One new request as admission counts it (tokens; :meth:`TangramState.request_pages`).

    Attributes:
        prompt_tokens: tokens still to prefill, after the matched prefix.
        first_chunk: tokens of its first prefill chunk (the rest is counted uncompressed).
        decode_tokens: decode-tail tokens counted (admission: ``min(T - out, clip)``; whole-pool
            check: ``T``; a finished request writes its last sampled token too under overlap
            scheduling, SGLang's default).
        prefix_lens: int64 ``[G]`` kept tokens per head group of the matched prefix; None = none.
        prefix_pages: pages the matched prefix's radix path pins (neither free nor evictable
            while the request uses it).
        cached_tokens: logical tokens of the matched prefix: where the first chunk starts (the
            segment grid's kept-length rule reads it) and for messages.
    """

    prompt_tokens: int
    first_chunk: int
    decode_tokens: int
    prefix_lens: np.ndarray | None = None
    prefix_pages: int = 0
    cached_tokens: int = 0

    def with_decode(self, decode_tokens: int) -> PrefillAsk:
        """The same request counted with another decode tail (tokens)."""
        return replace(self, decode_tokens=max(int(decode_tokens), 0))


@dataclass(frozen=True, slots=True)
class ExtendBatchPlan:
    """What :meth:`TangramState.allocate_extend` allocated for an extend batch (host arrays).

    Attributes:
        rows: int64 ``[bs]`` request rows.
        start_lens: int64 ``[bs, G]`` kept tokens per head group before the segment (the
            history the extend attends to; where its kept K/V start).
        kept_lens: int64 ``[bs, G]`` kept tokens per group of the segment (``k_g(n)``).
    """

    rows: np.ndarray
    start_lens: np.ndarray
    kept_lens: np.ndarray


class TangramState:
    """Per-server Tangram runtime: memory facade, layer maps, scorer, row bookkeeping.

    Args:
        memory: the pool facade (owns pages, tables, reservations).
        full_kv_bytes_per_token: bytes SGLang's uniform pool spends per token, all layers, K+V.
        device: attention device (layer maps live there).
        chunk_tokens: SGLang's chunked-prefill size (tokens; <= 0 = no chunking): each chunk
            is a segment, so footprints are computed per chunk.
    """

    def __init__(
        self,
        memory: TangramMemory,
        full_kv_bytes_per_token: int,
        device: torch.device | str,
        chunk_tokens: int = 0,
    ) -> None:
        self.memory = memory
        self.profile = memory.profile
        self.scorer = build_scorer(self.profile)
        self.group_of_head, self.column_of_head = layer_maps(self.profile, device)
        self.full_kv_bytes_per_token = int(full_kv_bytes_per_token)  # bytes per logical token
        self.chunk_tokens = int(chunk_tokens or 0)  # tokens per prefill segment (<= 0: whole)
        # Grid segmentation (TANGRAM_GRID_SEGMENTS=1): segments cut at absolute multiples of the
        # chunk size, so hot and cold servers keep the same tokens (config.segment_grid); 0 = off.
        self.segment_grid = segment_grid(self.chunk_tokens)
        memory.segment_grid = self.segment_grid  # off-grid segments kept whole (one rule)
        self.logical_tokens = np.zeros(len(memory.rids), np.int64)  # per row (tokens)
        self.start_free_pages = memory.allocator.num_free()  # pages
        self.num_released = 0  # requests released since start-up
        self.last_release: RowRecord | None = None
        self.radix: Any = None  # TangramRadixCache once the scheduler built it (prefix, evict)
        # rows whose finish the tree recorded for later (hold_for_finish); release skips them
        self.finishing_rows: set[int] = set()
        self.plans: dict[int, tuple[int, int]] = {}  # row -> (prompt tokens, decode-tail tokens)
        # row -> (segment tokens, start lens int64 [G], kept lens int64 [G]) of the row's last
        # scheduled extend (allocate_extend), read by the attention backend (extend_plan_for).
        self.extend_plans: dict[int, tuple[int, np.ndarray, np.ndarray]] = {}
        self.num_page_retractions = 0  # decode checks failed for pages (SGLang then retracts)
        self.refused: list[tuple[Any, str]] = []  # (request, HTTP 400 text) refused by admission
        self._fragmentation: tuple[float, float] | None = None  # (monotonic time, value)
        # The next forward's request rows and sequence lengths on the host (int64 [bs] each),
        # from the schedule batch's CPU copies (set_host_batch); read by the attention backend.
        self.host_rows: np.ndarray | None = None
        self.host_seq_lens: np.ndarray | None = None
        self.host_replay_lens: np.ndarray | None = None  # int64 [bs] replay tokens (extend)
        # the repeat prompts of a replay scorer (integration.replay.ReplayPrompts), bound at
        # start-up from the server's tokenizer; None under any other scorer
        self.replay_prompts: Any = None
        self.replay_tokens = 0  # replay tokens run since start (/server_info)
        self.replay_max_positions: int | None = None  # rows of the model's RoPE table
        # row -> the radix node its matched prefix ends at (the extend batch being allocated;
        # SGLang's req.last_node), so a new row finds its compressed prefix without a device read.
        self.host_prefix_nodes: dict[int, Any] = {}

    # ---- the batch about to run (host copies) ------------------------------------------------
    def set_host_batch(self, rows: Any, seq_lens: Any, replay_lens: Any = None) -> None:
        """Record the next forward's rows and sequence lengths (host tensors or arrays).

        Called when SGLang builds the ``ForwardBatch`` (``integration`` hook on
        ``ForwardBatch.init_new``) from ``ScheduleBatch.req_pool_indices_cpu`` /
        ``seq_lens_cpu``, so planning never reads the device tensors (a GPU sync that would
        stop overlap scheduling). None clears the record. ``replay_lens`` (int ``[bs]``, an
        extend batch under a replay scorer: ``integration.replay``) are the replay tokens each
        row runs before its segment; None when no row replays.
        """
        self.host_rows = None if rows is None else np.asarray(rows, np.int64).reshape(-1)
        self.host_seq_lens = (
            None if seq_lens is None else (np.asarray(seq_lens, np.int64).reshape(-1))
        )
        self.host_replay_lens = (
            None if replay_lens is None else np.asarray(replay_lens, np.int64).reshape(-1)
        )

    def host_batch_for(self, forward_batch: Any, num_rows: int) -> tuple[np.ndarray, np.ndarray]:
        """int64 ``(rows [n], seq_lens [n])`` of the batch about to run, host copies.

        Args:
            forward_batch: what the backend was handed (named in the error only).
            num_rows: the batch's real rows (without CUDA-graph padding).

        Raises:
            KernelError: no record, or one of another size (the ``ForwardBatch.init_new`` hook
                of the Tangram plugin did not run for this batch).
        """
        rows, lens = self.host_rows, self.host_seq_lens
        if rows is None or rows.size != num_rows:
            have = "none" if rows is None else f"{rows.size} rows"
            raise KernelError(
                f"Tangram backend: no host copy of the {num_rows} request rows of this "
                f"{type(forward_batch).__name__} ({have} recorded); the Tangram plugin's "
                "ForwardBatch.init_new hook must run (start the server with --tangram and the "
                "plugin loaded)"
            )
        if lens is None or lens.size != rows.size:
            lens = np.zeros(rows.size, np.int64)
        return rows, lens

    # ---- per request (scheduler side) -----------------------------------------------------------
    def plan_row(self, row: int, prompt_tokens: int, decode_tokens: int = 0) -> None:
        """Record a new row's reservation inputs (when SGLang assigns the row).

        Args:
            row: SGLang ``req_pool_idx``.
            prompt_tokens: tokens the row prefills in all, cached prefix included (tokens).
            decode_tokens: decode-tail tokens to reserve with the prompt (tokens). The serving
                policy passes 0: the tail grows by pages as the request decodes (module doc).
        """
        self.plans[int(row)] = (int(prompt_tokens), max(int(decode_tokens), 0))

    # ---- per batch (scheduler side: SGLang's alloc_for_extend / alloc_for_decode) ---------
    def allocate_extend(
        self,
        rows: list[int] | np.ndarray,
        extend_lens: list[int],
        prefix_lens: list[int],
        prefix_nodes: dict | None = None,
    ) -> ExtendBatchPlan:
        """Reserve and allocate each row's segment pages and advance its group lengths.

        Called when SGLang schedules the extend batch (``alloc_for_extend``), before the
        batch runs. A row without a table is a new request, starting from the radix tree's
        compressed prefix when ``prefix_len > 0``. With a plan (:meth:`plan_row`) admission
        reserves :meth:`request_pages` of the plan: this segment, the prompt's later chunks as
        an uncompressed upper bound (SGLang sizes each chunk when it schedules it) and the
        planned decode tokens; after the last chunk the grant is trimmed to the exact planned
        tail, so later chunks never wait for pages. Without a plan only the segment is
        reserved. A row with a table continues a chunked prefill. Page shortfalls evict
        unlocked radix nodes first.

        Kept lengths are static (``k_g(n)`` from the profile), so each group's length grows by
        ``k_g`` here, as SGLang advances ``seq_lens`` at schedule time; the batch's kernels
        read the lengths before the segment from the returned plan (recorded for the attention
        backend: :meth:`extend_plan_for`), never from the live table.

        Args:
            rows: ``bs`` request rows (``req_pool_idx``), distinct.
            extend_lens: ``bs`` segment lengths (tokens).
            prefix_lens: ``bs`` logical tokens already cached or prefilled (tokens).
            prefix_nodes: row -> the radix node its matched prefix ends at (SGLang's
                ``req.last_node``); None keeps the last recorded ones.

        Returns:
            The batch's :class:`ExtendBatchPlan` (host arrays).

        Raises:
            RequestTooLargeError: a segment needs more pages than the whole pool.
            PoolError: the pages are not free now (admission did not hold them back).
        """
        if prefix_nodes is not None:
            self.host_prefix_nodes = dict(prefix_nodes)
        rows = [int(r) for r in np.asarray(rows, np.int64).reshape(-1)]
        batch = self._allocate_new_rows(rows, extend_lens, prefix_lens)
        if batch is not None:
            return batch
        groups = self.memory.num_head_groups
        start = np.zeros((len(rows), groups), np.int64)
        kept = np.zeros((len(rows), groups), np.int64)
        for i, (row, n, prefix) in enumerate(zip(rows, extend_lens, prefix_lens, strict=True)):
            n, prefix = int(n), int(prefix)
            active = self.memory.rids[row] is not None
            if active and prefix == 0:
                logger.warning("Tangram: row %d was not released before reuse; freeing it", row)
                self.release(row)
                active = False
            plan = self.plans.get(row)
            if active and plan is not None:
                res = True  # reserved at admission with the first chunk
            elif active:
                self._make_room(self.memory.table.append_need(row, self._kept(prefix, n)).sum())
                res = self.memory.admit_chunk(row, n, 0, start_token=prefix)
            else:
                match = self._prefix(row, prefix)
                later = 0 if plan is None else max(plan[0] - prefix - n, 0) + plan[1]
                lens = None if match is None else match.lens
                ask = PrefillAsk(n + later, n, 0, lens, cached_tokens=prefix)
                self._make_room(self.request_pages(ask))  # the admission formula
                res = self.memory.admit(
                    row, f"row{row}", n, 0, prefix=match, decode_tokens=later, start_token=prefix
                )
            if res is None:
                raise PoolError(
                    f"Tangram pool: segment of {n} tokens (row {row}) does not fit: "
                    f"{self.memory.ledger.unreserved_free()} unreserved pages free; lower "
                    "--max-running-requests / --max-total-tokens until page admission lands"
                )
            segment = self.memory.alloc_extend(row, n, start_token=prefix)
            self.memory.commit_extend(row)
            if plan is not None and prefix + n >= plan[0]:
                self.memory.trim_reservation(row, plan[1])
            start[i], kept[i] = segment.start_len, segment.kept_len
            self.logical_tokens[row] = prefix + n
            self.extend_plans[row] = (n, start[i], kept[i])
        return ExtendBatchPlan(np.asarray(rows, np.int64), start, kept)

    def _allocate_new_rows(
        self, rows: list[int], extend_lens: list[int], prefix_lens: list[int]
    ) -> ExtendBatchPlan | None:
        """:meth:`allocate_extend` of a batch of new rows in one pass (the common case).

        Each row's compressed prefix comes from the tree as before; admission, pages and
        lengths are then set for the whole batch by ``TangramMemory.admit_extend_new``, with
        the same outcome as row by row. None (nothing changed) where a row is running,
        repeated, lacks its prefix, or the batch would have to evict or wait: the caller then
        goes row by row.
        """
        if len(extend_lens) != len(rows) or len(prefix_lens) != len(rows):
            return None
        lens = [int(n) for n in extend_lens]
        prefixes = [int(p) for p in prefix_lens]
        memory = self.memory
        if any(not 0 <= r < len(memory.rids) or memory.rids[r] is not None for r in rows):
            return None
        plans = [self.plans.get(row) for row in rows]
        later = [
            0 if plan is None else max(plan[0] - p - n, 0) + plan[1]
            for plan, p, n in zip(plans, prefixes, lens, strict=True)
        ]
        try:
            matches = [self._prefix(row, p) for row, p in zip(rows, prefixes, strict=True)]
        except PoolError:
            return None
        rids = [f"row{row}" for row in rows]
        got = memory.admit_extend_new(rows, rids, lens, prefixes, matches, later)
        if got is None:
            return None
        start, kept = got
        for i, (row, n, p, plan) in enumerate(zip(rows, lens, prefixes, plans, strict=True)):
            if plan is not None and p + n >= plan[0]:
                memory.trim_reservation(row, plan[1])
            self.logical_tokens[row] = p + n
            self.extend_plans[row] = (n, start[i], kept[i])
        return ExtendBatchPlan(np.asarray(rows, np.int64), start, kept)

    def extend_plan_for(
        self, rows: np.ndarray, extend_lens: list[int] | np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """int64 ``(start_lens [bs, G], kept_lens [bs, G])`` the scheduler allocated for rows.

        Read by the attention backend when it plans the extend batch (no allocation there).

        Raises:
            KernelError: a row has no allocation of that segment length (the plugin's
                ``alloc_for_extend`` hook did not run for this batch).
        """
        groups = self.memory.num_head_groups
        start = np.zeros((len(rows), groups), np.int64)
        kept = np.zeros((len(rows), groups), np.int64)
        for i, (row, n) in enumerate(zip(np.asarray(rows).tolist(), extend_lens, strict=True)):
            entry = self.extend_plans.get(int(row))
            if entry is None or entry[0] != int(n):
                have = "none" if entry is None else f"{entry[0]} tokens"
                raise KernelError(
                    f"Tangram backend: row {row} extends {int(n)} tokens but the scheduler "
                    f"allocated {have} for it; the Tangram plugin's alloc_for_extend hook must "
                    "run (start the server with --tangram and the plugin loaded)"
                )
            start[i], kept[i] = entry[1], entry[2]
        return start, kept

    def _kept(self, start_token: int, extend_len: int) -> np.ndarray:
        """int64 ``[G]``: kept tokens per group of ``[start_token, start_token + extend_len)``
        (``mem.reservation.segment_kept_lens`` on this server's segment grid)."""
        return self.memory.kept_lens(start_token, extend_len)  # the memory holds the same grid

    def _prefix(self, row: int, prefix_len: int) -> PrefixMatch | None:
        """The compressed prefix of a new row (None when it starts from scratch)."""
        if prefix_len <= 0:
            return None
        if self.radix is None:
            raise PoolError(
                f"Tangram: row {row} starts from a {prefix_len}-token cached prefix but no "
                "Tangram radix cache holds compressed history; use --radix-cache-backend "
                "tangram (the default under --tangram) or --disable-radix-cache"
            )
        return self.radix.prefix_for(row, prefix_len, self.host_prefix_nodes.get(row))

    def _make_room(self, num_pages: int) -> None:
        """Evict radix nodes until ``num_pages`` unreserved pages are free (if a tree exists)."""
        short = self.memory.pages_to_evict(int(num_pages))
        if short > 0 and self.radix is not None:
            self.radix.evict_pages(short)

    def _active_rows(self, rows: Any) -> np.ndarray:
        """int64 ``[n]``: the rows that hold pages (vectorised; no loop over rows)."""
        rows = np.asarray(rows, np.int64).reshape(-1)
        return rows[self.memory.active[rows]]

    def make_room_for_decode(self, rows: Any) -> None:
        """Evict radix nodes so one decode step of ``rows`` fits (SGLang's decode check)."""
        active = self._active_rows(rows)
        if active.size:
            self._make_room(self.memory.decode_pages_needed(active))

    def evictable_pages(self, exclude: Any = None) -> int:
        """Pages unlocked radix nodes hold (0 without a tree); see ``TangramRadixCache``."""
        return 0 if self.radix is None else int(self.radix.evictable_pages(exclude))

    def allocate_decode(
        self, rows: list[int] | np.ndarray, seq_lens: list[int] | np.ndarray
    ) -> int:
        """Append one decode token to every group of each row (schedule time, before the batch).

        Called from SGLang's ``alloc_for_decode``, right after its decode check
        (``check_decode_mem``, which Tangram extends with :meth:`can_decode`: a shortfall
        retracts requests there, as stock does). Group lengths include the new token afterwards.

        Args:
            rows: int ``[bs]`` request rows.
            seq_lens: int ``[bs]`` SGLang's sequence lengths with the new token (tokens, for
                reports).

        Returns:
            Pages allocated (0 for most steps: only full or shared last pages take one).

        Raises:
            PoolError: out of pages after evicting radix nodes (the decode check was skipped)
                or a row without pages; raised before any change.
        """
        rows = np.asarray(rows, np.int64).reshape(-1)
        taken = self.memory.alloc_decode(rows, make_room=self._make_room)
        self.logical_tokens[rows] = seq_lens
        return taken

    # ---- admission (one footprint formula) ---------------------------------------------------
    def request_pages(self, ask: PrefillAsk) -> int:
        """Pages a new request takes beyond its matched prefix: THE admission formula.

        Per head group g with matched-prefix kept length ``L_g`` (0 without a prefix)::

            a_g = k_g(cached_tokens, first_chunk) + (prompt_tokens - first_chunk) + decode_tokens
            pages = sum_g ceil((L_g + a_g) / P) - ceil(L_g / P) + [L_g % P != 0 and a_g > 0]

        (``k_g(start, n)``: ``mem.reservation.segment_kept_lens``, the first chunk starting at
        the matched prefix's end, kept whole under the segment grid unless it is a whole cell;
        the prompt's later chunks counted uncompressed, the copy-on-write page of a partial
        shared prefix tail included; ``mem.reservation.group_pages_needed``). With
        ``decode_tokens = 0`` this is exactly what :meth:`allocate_extend` reserves.
        """
        first = min(max(int(ask.first_chunk), 0), int(ask.prompt_tokens))
        kept = self._kept(int(ask.cached_tokens), first)
        add = kept + (int(ask.prompt_tokens) - first) + max(ask.decode_tokens, 0)
        lens = np.zeros_like(add) if ask.prefix_lens is None else np.asarray(ask.prefix_lens)
        return int(group_pages_needed(lens, lens > 0, add, self.memory.page_size).sum())

    def lifetime_pages(self, ask: PrefillAsk) -> int:
        """Pages the request holds at its end: its prefix path's pages + :meth:`request_pages`."""
        return int(ask.prefix_pages) + self.request_pages(ask)

    @property
    def pool_pages(self) -> int:
        """Usable pages of the whole pool (page 0 is padding)."""
        return int(self.memory.allocator.num_usable_pages)

    def fits_pool(self, ask: PrefillAsk) -> bool:
        """Could the request ever run to its end, alone on an empty pool? (no side effects)"""
        return self.lifetime_pages(ask) <= self.pool_pages

    def max_decode_tokens(self, ask: PrefillAsk) -> int:
        """Largest decode tail (tokens) with which :meth:`fits_pool` holds; -1 if none does.

        Binary search over the same formula (pages grow monotonically with the tail).
        """
        if not self.fits_pool(ask.with_decode(0)):
            return -1
        lo, hi = 0, self.pool_pages * self.memory.page_size  # hi: never fits
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.fits_pool(ask.with_decode(mid)) else (lo, mid)
        return lo

    def decode_headroom_pages(self, rows: list[int], tokens: list[int]) -> int:
        """Pages running ``rows`` need to append ``tokens[i]`` more decode tokens each.

        Exact per head group from each row's table (full last pages, shared partial tails);
        rows that hold no pages are skipped.
        """
        pairs = [
            (r, t)
            for r, t in zip(rows, tokens, strict=True)
            if t > 0 and self.memory.rids[r] is not None
        ]
        if not pairs:
            return 0
        idx = np.asarray([r for r, _ in pairs], np.int64)
        add = np.asarray([t for _, t in pairs], np.int64)[:, None]
        return int(self.memory.table.append_need(idx, add).sum())

    def admission_need(self, asks: list[PrefillAsk], headroom_pages: int = 0) -> int:
        """Pages admitting ``asks`` needs now: their :meth:`request_pages` + running headroom."""
        return sum(self.request_pages(a) for a in asks) + int(headroom_pages)

    def can_admit(
        self, asks: list[PrefillAsk], headroom_pages: int = 0, evictable_pages: int = 0
    ) -> bool:
        """No side effects: do these new requests fit now (see ``docs/admission.md``)?

        Args:
            asks: new requests to price (decode tails as counted at admission:
                ``min(T - out, clip)`` tokens each); the server passes the candidate alone.
            headroom_pages: pages already spoken for this round: :meth:`decode_headroom_pages`
                of the running requests (their remaining tails x SGLang's ``new_token_ratio``)
                plus the :meth:`request_pages` of the requests picked before the candidate
                (``integration.sglang_adapters.round_picks`` keeps that sum).
            evictable_pages: pages unlocked radix nodes would give back (the candidate's own
                prefix path excluded).
        """
        need = self.admission_need(asks, headroom_pages)
        return need <= self.memory.ledger.unreserved_free() + int(evictable_pages)

    def is_idle(self) -> bool:
        """No request row holds pages or a reservation (nothing running, no chunked prefill)."""
        return not self.memory.ledger.by_row

    def can_decode(self, rows: Any) -> bool:
        """No side effects: does one decode step of ``rows`` fit (see ``TangramMemory``)?

        Rows that hold no pages are skipped. ``rows``: int ``[n]`` (list or array).
        """
        return self.memory.can_decode(self._active_rows(rows))

    def never_fits_message(self, ask: PrefillAsk, max_new_tokens: int, asked: int | None) -> str:
        """The HTTP 400 text for a request that :meth:`fits_pool` refuses.

        Names the pages needed, the pool size, the client's ``max_tokens`` (``max_new_tokens``)
        and the largest value that would fit with this prompt (or that the prompt alone does not
        fit); and, where the prompt spans several prefill chunks and would fit as one (its later
        chunks are counted uncompressed), the ``--chunked-prefill-size`` that makes it fit.

        Args:
            ask: the request with its whole decode tail (``T`` tokens).
            max_new_tokens: T after SGLang's own cap (tokens).
            asked: the value the client sent (None: not set).
        """
        need = self.lifetime_pages(ask)
        prompt = int(ask.prompt_tokens) + int(ask.cached_tokens)
        sent = "not set" if asked is None else str(int(asked))
        if asked is not None and int(asked) == int(max_new_tokens):
            wanted = f"max_tokens {max_new_tokens}"
        elif int(max_new_tokens) <= 0:  # SGLang's cap left no token after the prompt
            wanted = f"max_tokens {sent}; the prompt leaves no token within the server's limit"
        else:
            wanted = f"max_tokens {sent}, capped to {max_new_tokens} by the server"
        cached = "" if not ask.cached_tokens else f", {ask.cached_tokens} of them cached"
        best = self.max_decode_tokens(ask)
        fix = (
            f"at most max_tokens {best} fits with this prompt: lower max_tokens "
            "(max_new_tokens), shorten the prompt"
            if best >= 1
            else "the prompt alone does not fit: shorten the prompt"
        )
        left, first = int(ask.prompt_tokens), int(ask.first_chunk)
        if first < left and self.fits_pool(replace(ask, first_chunk=left)):
            fix += (
                f", raise --chunked-prefill-size to {left} or more (the {left - first} prompt "
                f"tokens after its first {first}-token chunk are counted uncompressed)"
            )
        return (
            f"Tangram: request needs {need} KV pages ({prompt} prompt tokens{cached}, {wanted}) "
            f"but the whole pool holds {self.pool_pages} pages; {fix}, or give the server more "
            "KV memory (--max-total-tokens / --mem-fraction-static)"
        )

    # ---- end of a request --------------------------------------------------------------------
    def finish_row(self, row: int) -> list[SegmentPages]:
        """A finished row's segments for the radix tree (``TangramMemory.finish``).

        Ownership: the caller (the radix tree) now holds the row's own pages; the row is free,
        so the ``ReqToTokenPool.free`` hook that follows finds nothing to release (under the
        tree's deferred insert the hook came first and left the row alone: hold_for_finish).

        Raises:
            PoolError: the row holds no request, or its extend is not committed.
        """
        try:
            record = self._record(row)
            segments = self.memory.finish(row)
        finally:  # a row that failed to finish is released like any other (release)
            self.finishing_rows.discard(row)
        self._forget(row)
        self._log_end(row, record, "cached")
        return segments

    def hold_for_finish(self, row: int) -> None:
        """Keep a finished row's pages for a later :meth:`finish_row` (the tree's deferred
        insert, ``TangramRadixCache.deferred_finishes``): :meth:`release`, which SGLang's
        ``ReqToTokenPool.free`` hook calls right after, leaves the row alone.

        Args:
            row: the finished request's row (SGLang's ``req_pool_idx``).

        Raises:
            PoolError: the row holds no request.
        """
        if not 0 <= row < len(self.memory.rids) or self.memory.rids[row] is None:
            raise PoolError(f"hold_for_finish: row {row} holds no request")
        self.finishing_rows.add(row)

    def _forget(self, row: int) -> None:
        self.plans.pop(row, None)
        self.extend_plans.pop(row, None)

    def _record(self, row: int) -> RowRecord:
        usage = self.memory.row_usage(row)
        tokens = int(self.logical_tokens[row])
        return RowRecord(
            row,
            tokens,
            usage.own_pages,
            usage.borrowed_pages,
            self.memory.bytes_per_page,
            tokens * self.full_kv_bytes_per_token,
        )

    def _log_end(self, row: int, record: RowRecord, what: str) -> None:
        self.logical_tokens[row] = 0
        self.num_released += 1
        self.last_release = record
        allocator = self.memory.allocator  # O(1) counts: this runs once per finished request
        logger.info(
            "Tangram: %s row %d: %d tokens, %d own pages (%d bytes) + %d from the radix "
            "tree; all its pages vs full KV %d bytes: %.3f; pool %d/%d pages used",
            what,
            row,
            record.logical_tokens,
            record.pages,
            record.bytes_held,
            record.borrowed_pages,
            record.full_kv_bytes,
            record.held_fraction,
            allocator.num_used(),
            allocator.num_usable_pages,
        )

    def release(self, row: int) -> RowRecord | None:
        """Free every page of ``row`` (finish, abort or retraction); None if it holds none.

        Ownership: the row's own pages go back to the free list; borrowed radix pages lose
        the row's reference (their nodes keep them). A row held for the tree's deferred insert
        (:meth:`hold_for_finish`) is left to :meth:`finish_row` (returns None).
        """
        if not 0 <= row < len(self.memory.rids) or self.memory.rids[row] is None:
            return None
        if row in self.finishing_rows:
            return None  # the tree's deferred insert takes its pages (hold_for_finish)
        record = self._record(row)
        self._forget(row)
        self.memory.abort(row)
        self._log_end(row, record, "released")
        return record

    # ---- reports -----------------------------------------------------------------------------
    def fragmentation(self, max_age_s: float = 0.0) -> float:
        """Share of the (token, KV head) slots of held pages that hold no token, in [0, 1].

        O(num_pages) host work (``mem.stats.collect_stats``: ~20 ms on a 3M-page pool, which the
        GPU waits for between batches). With ``max_age_s`` > 0, a value computed less than
        ``max_age_s`` seconds ago is returned instead: the per-batch log lines and gauges use
        that (issue 7: computing it per batch and per finished request cost 0.5 s of GPU idle
        time in 16 x 8192 prefill). An empty pool (no held page) gives 0.0 at once, never an
        older value.
        """
        if self.memory.allocator.num_used() == 0:
            return 0.0
        now = time.monotonic()
        if self._fragmentation is None or now - self._fragmentation[0] >= max_age_s:
            self._fragmentation = (now, self.memory.stats().fragmentation_fraction)
        return self._fragmentation[1]

    def pool_info(self) -> dict[str, Any]:
        """Live pool numbers (pages, bytes held vs full KV of the live tokens); plain builtins."""
        stats = self.memory.stats()
        live_tokens = int(self.logical_tokens.sum())
        return {
            "pages_total": stats.num_usable_pages,
            "pages_used": stats.used_pages,
            "pages_free": stats.free_pages,
            "pages_free_at_start": self.start_free_pages,
            "peak_pages_used": stats.peak_used_pages,
            "bytes_per_page": stats.bytes_per_page,
            "pool_bytes": (stats.num_usable_pages + 1) * stats.bytes_per_page,
            "bytes_held": stats.bytes_held,
            "live_logical_tokens": live_tokens,
            "full_kv_bytes_of_live_tokens": live_tokens * self.full_kv_bytes_per_token,
            "full_kv_bytes_per_token": self.full_kv_bytes_per_token,
            "fragmentation_fraction": stats.fragmentation_fraction,
            "active_rows": stats.num_active_rows,
            "requests_released": self.num_released,
            "last_release": None if self.last_release is None else self.last_release.to_dict(),
            "page_retractions": self.num_page_retractions,
            "replay_tokens": self.replay_tokens,
            "radix": None if self.radix is None else self.radix.stats(),
        }
