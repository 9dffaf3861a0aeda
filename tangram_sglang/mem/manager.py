"""TangramMemory: the per-request memory facade that the SGLang integration drives.

Owns the request-level protocol over the pool: admission (Budget Reservation), per-group page
allocation for extend and decode with copy-on-write tails, ownership hand-over at finish, and
accounting. It composes :class:`PageAllocator`, :class:`ReservationLedger`, :class:`PageTable`
and (optionally) :class:`KVPool`; it never imports sglang and never decides eviction (the radix
tree does, and hands pages back through :meth:`TangramMemory.free_pages`).

Life of a request row (every call names SGLang's ``req_pool_idx`` as ``row``)::

    can_admit ─(no side effects)─> admit(prefix) ──> alloc_extend ──> commit_extend ──> [forward]
        ┌─────────────────────────────────────────────────────────────┘
        │  (TangramState calls alloc_extend + commit_extend when SGLang schedules the batch:
        │   lengths advance before the forward writes the kept K/V; COW copies wait for
        │   run_copies when defer_copies is set)
        ├─> admit_chunk ─> alloc_extend ─> commit_extend     (next chunk of a chunked prefill)
        ├─> can_decode ─> alloc_decode (x T-1)               (group_len includes the new token)
        ├─> finish -> [SegmentPages]   caller (radix node) now holds the row's own pages
        └─> abort / retract            row's pages freed, borrowed ones unlocked

Holders: each page's reference count = rows whose table lists it + holders outside (radix nodes,
or whoever took SegmentPages). ``free_pages`` only drops outside holders' references.

Source: Tangram arXiv 2606.06302 (Budget Reservation, Ragged Paging); docs/contracts.md;
docs/design.md §8 (check then commit, named hand-overs); vLLM ``KVCacheManager`` / nano-vllm.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tangram_sglang.errors import PoolError
from tangram_sglang.mem.invariants import check_memory
from tangram_sglang.mem.kv_pool import KVPool, bytes_per_page, filled_slots, num_pages_for_budget
from tangram_sglang.mem.page_allocator import PageAllocator
from tangram_sglang.mem.page_table import EXTEND, PageTable, SegmentPages, ragged_entries
from tangram_sglang.mem.prefix import PrefixMatch, validate_prefix
from tangram_sglang.mem.reservation import (
    Reservation,
    ReservationLedger,
    group_pages_needed,
    segment_kept_lens,
)
from tangram_sglang.mem.stats import MemoryStats, collect_stats
from tangram_sglang.profile import BudgetProfile

_KEPT_CACHE_SIZE = 4096  # segment lengths remembered by TangramMemory.kept_lens


def _scatter(
    pages: np.ndarray, rows: np.ndarray, count: np.ndarray, first: np.ndarray, ids: np.ndarray
) -> np.ndarray:
    """Write ``ids`` into ``pages[rows[b], g, first[b, g] : first[b, g] + count[b, g]]``.

    Args:
        pages: the host table ``[max_rows, G, max_pages_per_group]``.
        rows: int64 ``[n]`` rows.
        count: int64 ``[n, G]`` entries per (row, group).
        first: int64 ``[n, G]`` table index of each (row, group)'s first entry.
        ids: int64 ``[count.sum()]`` page ids, row after row, group after group.

    Returns:
        int64 ``[count.sum()]``: the group of each id.
    """
    b, g, offset = _ragged(count)
    pages[rows[b], g, offset + first[b, g]] = ids
    return g


def _ragged(count: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each entry of a ragged ``[n, G]`` block, in row-major order.

    Args:
        count: int64 ``[n, G]`` entries per (row, group), >= 0.

    Returns:
        int64 ``(b, g, offset)``, each ``[count.sum()]``: the row index into ``count``, the
        group, and the entry's position within its (row, group).
    """
    cell, offset = ragged_entries(count)
    b, g = np.divmod(cell, count.shape[1])
    return b, g, offset


@dataclass(slots=True)
class ExtendPlan:
    """Where an extend segment's kept K/V go; returned by :meth:`TangramMemory.alloc_extend`."""

    row: int  # request row
    start_len: np.ndarray  # int64 [G]: first slot of the segment per group (tokens)
    kept_len: np.ndarray  # int64 [G]: kept tokens per group (tokens)
    cow_src: np.ndarray  # int64 [n]: shared tail pages copied (copy already done if pool set)
    cow_dst: np.ndarray  # int64 [n]: the row's fresh copies, now in its table
    num_new_pages: int  # pages allocated for the segment (copies included)


@dataclass(slots=True)
class RowUsage:
    """Pages of one running request row; returned by :meth:`TangramMemory.row_usage`."""

    own_pages: int  # pages only this row holds (freed by abort)
    borrowed_pages: int  # prefix pages it reads but does not own (radix nodes')
    reserved_pages: int  # pages granted at admission (all chunks)
    used_pages: int  # pages allocated against the grant
    remaining_pages: int  # granted, not yet allocated (returned to admission by abort)
    overflow_pages: int  # decode pages taken beyond the grant


class TangramMemory:
    """Ragged head-group page pool with Budget Reservation, driven per request row.

    Args:
        profile: budget profile; its grouping fixes G and H_p.
        page_size: tokens per page.
        num_pages: pool pages INCLUDING padding page 0.
        max_rows: request rows (SGLang's req pool size).
        max_pages_per_group: table width (pages) = max kept tokens per group / page_size, ceil.
        kv_pool: K/V storage (COW copies run on it); None = accounting only (capacity reports).
        device: device of ``page_table`` / ``group_len``; the free list stays on the host.
        debug: check every invariant after each call; None reads ``TANGRAM_DEBUG_POOL`` once.
        dtype: KV dtype for ``bytes_per_page`` when ``kv_pool`` is None.

    Raises:
        PoolError: ``kv_pool`` geometry differs from the profile / ``page_size`` / ``num_pages``.
    """

    def __init__(
        self,
        profile: BudgetProfile,
        page_size: int,
        num_pages: int,
        max_rows: int,
        max_pages_per_group: int,
        kv_pool: KVPool | None = None,
        device: str | torch.device = "cpu",
        debug: bool | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        grouping = profile.grouping
        self.profile = profile
        self.page_size = int(page_size)  # tokens per page
        # Segment-grid cell in tokens (TANGRAM_GRID_SEGMENTS=1; set by TangramState): segments
        # off the grid are kept whole (reservation.segment_kept_lens); 0 = grid off.
        self.segment_grid = 0
        self.num_head_groups = grouping.num_head_groups
        self.heads_per_group = grouping.heads_per_group
        self.allocator = PageAllocator(num_pages, "cpu", debug)
        self.ledger = ReservationLedger(self.allocator)
        self.table = PageTable(
            max_rows, self.num_head_groups, max_pages_per_group, page_size, device
        )
        self.kv_pool = kv_pool
        if kv_pool is not None:
            want = (num_pages, self.heads_per_group, self.page_size, profile.model.head_dim)
            got = tuple(kv_pool.k_pool.shape)
            if got != want:
                raise PoolError(
                    f"kv_pool shape {list(got)} != [num_pages, H_p, page_size, D] "
                    f"= {list(want)} from the profile; build both from one config"
                )
            dtype = kv_pool.k_pool.dtype
        self.bytes_per_page = bytes_per_page(  # bytes, K and V
            self.heads_per_group, self.page_size, profile.model.head_dim, dtype
        )
        self.debug = self.allocator.debug
        self.rids: list[str | None] = [None] * max_rows  # rid per active row, None = free row
        self.pending: list[ExtendPlan | None] = [None] * max_rows  # allocated, not committed
        self.ready = np.zeros(max_rows, bool)  # active with no pending extend (may decode)
        self.active = np.zeros(max_rows, bool)  # rids[row] is not None, vectorised
        self.row_refs = np.zeros(num_pages, np.int64)  # holders per page that are row tables
        self.page_group = np.full(num_pages, -1, np.int64)  # head group a page was taken for
        self.page_fill = np.zeros(num_pages, np.int64)  # filled slots per page (tokens)
        self.peak_used_pages = 0  # pages
        # Copy-on-write copies of shared tail pages. With ``defer_copies`` (the attention
        # backend sets it: pages are allocated in the scheduler, before the batch runs) they
        # wait in ``_copies`` for :meth:`run_copies`, which the backend calls on the forward
        # stream when it plans the batch; otherwise they run at once.
        self.defer_copies = False
        self._copies: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._kept_cache: dict[tuple[int, bool], np.ndarray] = {}  # kept_lens, per length

    @classmethod
    def create(
        cls,
        profile: BudgetProfile,
        memory_bytes: int,
        page_size: int = 16,
        max_rows: int = 256,
        max_context_tokens: int = 131072,
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cpu",
        allocate_storage: bool = True,
        debug: bool | None = None,
    ) -> TangramMemory:
        """Size the pool from a byte budget (start-up); ``allocate_storage=False`` skips K/V."""
        bpp = bytes_per_page(
            profile.grouping.heads_per_group, page_size, profile.model.head_dim, dtype
        )
        num_pages = num_pages_for_budget(memory_bytes, bpp)
        pool = None
        if allocate_storage:
            h_p, dim = profile.grouping.heads_per_group, profile.model.head_dim
            pool = KVPool.create(num_pages, h_p, page_size, dim, dtype, device)
        width = -(-int(max_context_tokens) // page_size)
        return cls(profile, page_size, num_pages, max_rows, width, pool, device, debug, dtype)

    # ---- admission (Budget Reservation) -----------------------------------------------------
    def footprint(
        self,
        extend_len: int,
        max_new_tokens: int,
        prefix: PrefixMatch | None = None,
        decode_tokens: int | None = None,
        start_token: int = 0,
    ) -> int:
        """Pages a new request needs (no side effects): what :meth:`admit` with the same
        arguments reserves (``start_token`` as there); see ``reservation.pages_needed``."""
        lens, _ = self._prefix_arrays(prefix, "footprint", -1)
        add = self._append_tokens(extend_len, max_new_tokens, decode_tokens, start_token)
        return int(group_pages_needed(lens, lens > 0, add, self.page_size).sum())

    def can_admit(
        self,
        extend_len: int,
        max_new_tokens: int,
        prefix: PrefixMatch | None = None,
        evictable_pages: int = 0,
        decode_tokens: int | None = None,
        start_token: int = 0,
    ) -> bool:
        """Would the request fit now, after evicting ``evictable_pages``? No side effects."""
        need = self.footprint(extend_len, max_new_tokens, prefix, decode_tokens, start_token)
        return self.ledger.can_reserve(need, evictable_pages)

    def pages_to_evict(self, num_pages: int) -> int:
        """Pages the radix tree must free before ``num_pages`` can be reserved (0 if none)."""
        return max(num_pages - self.ledger.unreserved_free(), 0)

    def admit(
        self,
        row: int,
        rid: str,
        extend_len: int,
        max_new_tokens: int,
        prefix: PrefixMatch | None = None,
        decode_tokens: int | None = None,
        start_token: int = 0,
    ) -> Reservation | None:
        """Reserve a new request's footprint and lay its matched prefix into ``row``.

        Args:
            row: a free request row (SGLang ``req_pool_idx``).
            rid: request id (named in errors).
            extend_len: tokens of the first segment (for a chunked prefill: the first chunk,
                with ``max_new_tokens=0``; later chunks go through :meth:`admit_chunk`).
            max_new_tokens: T; T - 1 decode-tail tokens are reserved per group.
            prefix: matched radix prefix; every page is borrowed (one more holder).
            decode_tokens: reserve this many decode tokens instead of T - 1 (overcommit like
                SGLang's ``new_token_ratio``; growth past it needs :meth:`can_decode`).
            start_token: absolute position of the segment's first token (the matched prefix's
                logical tokens); only the segment grid reads it
                (:func:`~tangram_sglang.mem.reservation.segment_kept_lens`).

        Returns:
            The reservation, or None if it does not fit now (nothing changed).

        Raises:
            RequestTooLargeError: more pages than the whole pool (nothing changed).
            PoolError: row out of range or in use, bad prefix, table too narrow (nothing changed).
        """
        self._check_row(row, rid, active=False)
        lens, pages = self._prefix_arrays(prefix, rid, row)
        add = self._append_tokens(extend_len, max_new_tokens, decode_tokens, start_token)
        need = int(group_pages_needed(lens, lens > 0, add, self.page_size).sum())
        self._check_width(row, rid, lens + add)
        res = self.ledger.reserve(row, rid, need)
        if res is None:
            return None
        self.rids[row] = rid
        self.ready[row] = True
        self.active[row] = True
        self._borrow(pages)
        self.table.set_borrowed(row, pages, lens)
        self._after("admit")
        return res

    def admit_chunk(
        self,
        row: int,
        extend_len: int,
        max_new_tokens: int,
        decode_tokens: int | None = None,
        start_token: int = 0,
    ) -> Reservation | None:
        """Reserve the next chunk of a running row (after ``commit_extend`` of the previous).

        Pass ``max_new_tokens=0`` for every chunk but the last; ``start_token`` is the chunk's
        absolute first token (read under the segment grid only). Same returns/raises as
        :meth:`admit`; None leaves the row as it was.
        """
        rid = self._check_committed(row, "admit_chunk")
        lens = self.table.lens[row]
        add = self._append_tokens(extend_len, max_new_tokens, decode_tokens, start_token)
        need = int(self.table.append_need(row, add).sum())
        self._check_width(row, rid, lens + add)
        res = self.ledger.reserve(row, rid, need)
        self._after("admit_chunk")
        return res

    # ---- extend ----------------------------------------------------------------------------
    def alloc_extend(self, row: int, extend_len: int, start_token: int = 0) -> ExtendPlan:
        """Allocate the pages of one extend segment (kept tokens per group), COW tails first.

        Kept tokens per group: :func:`~tangram_sglang.mem.reservation.segment_kept_lens` of
        ``[start_token, start_token + extend_len)`` on :attr:`segment_grid` (``start_token``,
        the segment's absolute first token, is read under the grid only). ``group_len`` stays
        at the history length until :meth:`commit_extend` (the extend kernel reads it as the
        history); ``page_table`` already lists the new pages.

        Raises:
            PoolError: row not active or has an uncommitted extend; ``extend_len`` negative or
                not an integer; the segment was not reserved (``admit`` / ``admit_chunk``);
                table too narrow. Nothing changed.
        """
        rid = self._check_committed(row, "alloc_extend")
        if isinstance(extend_len, bool | float) or int(extend_len) < 0:
            raise PoolError(
                f"alloc_extend: request {rid!r} (row {row}): extend_len={extend_len!r} must be "
                "an integer >= 0 (tokens of the segment)"
            )
        kept = self.kept_lens(start_token, int(extend_len))
        need = self.table.append_need(row, kept)
        cow = self.table.cow_needed(row, kept)
        self._check_width(row, rid, self.table.lens[row] + kept)
        self.ledger.take(row, int(need.sum()), allow_overflow=False)
        first = self.table.num_pages[row] - cow
        src, dst = self._place(row, need, cow, self._alloc(int(need.sum())))
        seg = self.table.open_segment(row, EXTEND, first)
        seg.num_tokens, seg.kept_len = int(extend_len), kept.copy()
        self.table.sync_range(row, first, self.table.num_pages[row])
        plan = ExtendPlan(row, self.table.lens[row].copy(), kept, src, dst, int(need.sum()))
        self.pending[row] = plan
        self.ready[row] = False
        self._after("alloc_extend")
        return plan

    def commit_extend(self, row: int) -> None:
        """After the forward wrote the kept K/V: ``group_len += kept_len`` for the segment.

        Raises:
            PoolError: no extend allocated for ``row``.
        """
        plan = self.pending[row] if 0 <= row < len(self.pending) else None
        if plan is None:
            raise PoolError(f"commit_extend: row {row} has no allocated extend; call alloc_extend")
        new = plan.start_len + plan.kept_len
        self._fill(row, plan.start_len, new)
        self.table.lens[row] = new
        self.table.sync_lens(np.array([row]))
        self.pending[row] = None
        self.ready[row] = True
        self._after("commit_extend")

    # ---- a batch of new rows (one pass) -----------------------------------------------------
    def admit_extend_new(
        self,
        rows: list[int],
        rids: list[str],
        extend_lens: list[int],
        start_tokens: list[int],
        prefixes: list[PrefixMatch | None],
        decode_tokens: list[int],
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """:meth:`admit` + :meth:`alloc_extend` + :meth:`commit_extend` of new rows, batched.

        Called per extend batch (``TangramState.allocate_extend``). The same pages, tables,
        holders, grants and staged writes as those calls row after row, in array operations
        over the batch. It runs only where the row-by-row calls could not fail, evict or
        wait; otherwise it returns None having changed nothing, and the caller takes the
        row-by-row path (which then raises or evicts exactly as before).

        Args:
            rows: ``bs`` distinct free rows (``req_pool_idx``).
            rids: ``bs`` request ids.
            extend_lens: ``bs`` segment lengths (tokens, >= 0).
            start_tokens: ``bs`` absolute first tokens of the segments (tokens, >= 0).
            prefixes: ``bs`` matched radix prefixes (None: from an empty table).
            decode_tokens: ``bs`` tokens reserved beyond the segment (as :meth:`admit`'s).

        Returns:
            int64 ``(start_lens [bs, G], kept_lens [bs, G])``: kept tokens per group before
            the segment and of the segment; or None (nothing changed).

        Ownership: as :meth:`admit` (prefix pages borrowed) and :meth:`alloc_extend`.
        """
        got = self._plan_new_rows(rows, rids, extend_lens, start_tokens, prefixes, decode_tokens)
        if got is None:
            return None
        lens, kept, grant, pages = got
        rows_a = np.asarray(rows, np.int64)
        ps = self.page_size
        need = group_pages_needed(lens, lens > 0, kept, ps)  # [bs, G], COW copies included
        cow = ((lens > 0) & (lens % ps != 0) & (kept > 0)).astype(np.int64)
        for row, rid, granted, taken in zip(
            rows, rids, grant.tolist(), need.sum(axis=1).tolist(), strict=True
        ):
            res = self.ledger.reserve(row, rid, granted)
            assert res is not None, "_plan_new_rows checked the batch's grants against the pool"
            self.ledger.take(row, taken, allow_overflow=False)
            self.rids[row] = rid
        self.active[rows_a] = True
        self.ready[rows_a] = True
        borrowed = self._borrow(pages)
        t = self.table
        sizes = -(-lens // ps)  # borrowed pages per (row, group)
        _scatter(t.pages, rows_a, sizes, np.zeros_like(sizes), borrowed)
        t.num_pages[rows_a] = sizes
        t.own_start[rows_a] = sizes
        t.lens[rows_a] = lens
        first = sizes - cow  # table index of each group's first fresh page
        # no COW source reaches zero holders (each row holds its own reference until its
        # copy drops it), so the fresh pages are the next ones of the free list, row after row
        fresh = self._alloc(int(need.sum()))
        cow_b, cow_g = np.nonzero(cow)
        src = t.pages[rows_a[cow_b], cow_g, first[cow_b, cow_g]].astype(np.int64)
        dst = fresh[(np.cumsum(need) - need.ravel())[cow_b * self.num_head_groups + cow_g]]
        groups = _scatter(t.pages, rows_a, need, first, fresh)
        t.own_start[rows_a[cow_b], cow_g] = first[cow_b, cow_g]
        t.num_pages[rows_a] += need - cow
        self.page_group[fresh] = groups
        self.page_fill[fresh] = 0
        self.row_refs[fresh] += 1
        if src.size:
            self.page_fill[dst] = lens[cow_b, cow_g] % ps
            self._copy(src, dst, self.page_fill[dst])
            self._add_row_refs(src, -1)
            self.allocator.free(torch.from_numpy(src.copy()), f"COW of rows {rows[:8]}")
        for b, row in enumerate(rows):
            seg = t.open_segment(row, EXTEND, first[b].copy())
            seg.num_tokens, seg.kept_len = int(extend_lens[b]), kept[b].copy()
        new = lens + kept
        self._fill_rows(rows_a, lens, new)
        t.lens[rows_a] = new
        t.sync_rows(rows_a)
        return lens, kept

    def _plan_new_rows(self, rows, rids, extend_lens, start_tokens, prefixes, decode_tokens):
        """The checks of :meth:`admit_extend_new`, no side effects: ``(lens, kept, grant,
        pages)`` (int64 ``[bs, G]`` prefix and segment kept tokens, ``[bs]`` pages to reserve,
        the prefixes' per-group page lists, row after row), or None where the row-by-row
        path must run (debug checks, an immediate flush or copy, a busy or repeated row, a
        bad prefix or length, a table too narrow, or fewer unreserved free pages than the
        batch reserves)."""
        immediate = not self.table.deferred or (self.kv_pool is not None and not self.defer_copies)
        if self.debug or immediate or not rows or len(set(rows)) != len(rows):
            return None
        if any(not 0 <= r < len(self.rids) or self.rids[r] is not None for r in rows):
            return None
        if min(extend_lens, default=0) < 0 or min(start_tokens, default=0) < 0:
            return None
        counts = self.allocator.ref_count.numpy()
        lens, pages = [], []
        for row, rid, prefix in zip(rows, rids, prefixes, strict=True):
            try:
                row_lens, row_pages = validate_prefix(
                    prefix, self.num_head_groups, self.page_size, counts, rid, row
                )
            except PoolError:
                return None
            lens.append(row_lens)
            pages.extend(row_pages)
        lens = np.stack(lens).astype(np.int64, copy=False)
        pairs = zip(start_tokens, extend_lens, strict=True)
        kept = np.stack([self.kept_lens(start, n) for start, n in pairs])
        add = kept + np.asarray(decode_tokens, np.int64)[:, None]
        if (-(-(lens + add) // self.page_size) > self.table.max_pages_per_group).any():
            return None
        grant = group_pages_needed(lens, lens > 0, add, self.page_size).sum(axis=1)
        usable = self.allocator.num_usable_pages
        if (grant > usable).any() or int(grant.sum()) > self.ledger.unreserved_free():
            return None
        return lens, kept, grant, pages

    def _fill_rows(self, rows: np.ndarray, old_len: np.ndarray, new_len: np.ndarray) -> None:
        """:meth:`_fill` of several rows: ``old_len`` / ``new_len`` int64 ``[n, G]``."""
        ps = self.page_size
        lo, hi = old_len // ps, -(-new_len // ps)
        count = np.maximum(hi - lo, 0)
        if not count.any():
            return
        b, g, offset = _ragged(count)  # (row, group) of each page
        idx = offset + lo[b, g]
        ids = self.table.pages[rows[b], g, idx]
        self.page_fill[ids] = np.minimum(ps, new_len[b, g] - idx * ps)

    def kept_lens(self, start_token: int, num_tokens: int) -> np.ndarray:
        """int64 ``[G]``: kept tokens per group of one segment, a fresh array (per segment).

        :func:`~tangram_sglang.mem.reservation.segment_kept_lens` on :attr:`segment_grid`,
        remembered per (length, whether the profile's rule applies): admission, reservation
        and allocation ask for the same few lengths over and over.

        Raises:
            PoolError: ``start_token`` or ``num_tokens`` negative.
        """
        start, n, grid = int(start_token), int(num_tokens), self.segment_grid
        if start < 0 or n < 0:
            return segment_kept_lens(self.profile, start, n, grid)  # raises
        key = (n, grid <= 0 or (start % grid == 0 and n == grid))
        kept = self._kept_cache.get(key)
        if kept is None:
            if len(self._kept_cache) >= _KEPT_CACHE_SIZE:
                self._kept_cache.clear()
            kept = self._kept_cache[key] = segment_kept_lens(self.profile, start, n, grid)
        return kept.copy()

    def trim_reservation(self, row: int, decode_tokens: int) -> int:
        """Keep only the pages ``decode_tokens`` more decode tokens need; return the rest.

        For a row that reserved an upper bound at admission (later chunks uncompressed) once its
        last chunk is committed. Returns pages given back to admission.

        Raises:
            PoolError: row not active or with an uncommitted extend.
        """
        self._check_committed(row, "trim_reservation")
        keep = int(self.table.append_need(row, max(int(decode_tokens), 0)).sum())
        freed = self.ledger.trim(row, keep)
        self._after("trim_reservation")
        return freed

    # ---- decode ----------------------------------------------------------------------------
    def decode_pages_needed(self, rows: np.ndarray | list[int]) -> int:
        """Pages the next decode step allocates for ``rows`` (full or shared last pages)."""
        return int(self.table.append_need(np.asarray(rows, np.int64), 1).sum())

    def can_decode(self, rows: np.ndarray | list[int]) -> bool:
        """No side effects: does one decode step for ``rows`` fit (grants + unreserved)?

        SGLang's ``check_decode_mem`` calls this; False means retract requests first.

        Raises:
            PoolError: a row is not active.
        """
        rows = np.asarray(rows, np.int64).reshape(-1)
        active = self.active[rows]
        if not active.all():
            self._check_row(int(rows[~active][0]), None, active=True)
        per_row = self._decode_need(rows)[0].sum(axis=-1)
        return int(self._decode_overflow(rows, per_row).sum()) <= self.ledger.unreserved_free()

    def alloc_decode(
        self, rows: np.ndarray | list[int], make_room: Callable[[int], None] | None = None
    ) -> int:
        """Append one decode token to every group of each row; ``group_len`` includes it.

        Only groups whose last page is full or shared get a page. Returns pages allocated.
        Vectorised over rows (numpy; the only per-row Python is the grant bookkeeping of the rows
        that take a page). Device writes are staged (``PageTable.flush``).

        Args:
            rows: int ``[bs]`` distinct active rows.
            make_room: called with the unreserved pages the step needs when fewer are free
                (the radix tree evicts unlocked nodes); then the step is checked again.

        Raises:
            PoolError: a row inactive, repeated or with an uncommitted extend; out of pages
                (check :meth:`can_decode` first); table full. Raised before any write.
        """
        rows = np.asarray(rows, np.int64).reshape(-1)
        self._check_decode_rows(rows)
        need, cow = self._decode_need(rows)
        per_row = need.sum(axis=1)
        over = int(self._decode_overflow(rows, per_row).sum())
        if over > self.ledger.unreserved_free() and make_room is not None:
            make_room(over)
        if over > self.ledger.unreserved_free():
            raise PoolError(
                f"alloc_decode: out of pages: rows {rows.tolist()} need {int(per_row.sum())} "
                f"pages ({over} beyond their grants), {self.ledger.unreserved_free()} unreserved "
                "free; call can_decode and retract a request first, or lower "
                "--max-running-requests"
            )
        growing = np.nonzero(per_row)[0]
        self.ledger.take_many(rows[growing].tolist(), per_row[growing].tolist())
        pages = self._alloc(int(per_row.sum()))
        t = self.table
        fresh = ~t.in_tail[rows]  # the decode tail is a segment of its own
        if fresh.any():
            t.open_tail(rows[fresh], t.num_pages[rows[fresh]] - cow[fresh])
        t.tail_tokens[rows] += 1
        entries = self._place_decode(rows, need, cow, pages)
        t.lens[rows] += 1
        lens = t.lens[rows]
        last = t.pages[rows[:, None], np.arange(self.num_head_groups), (lens - 1) // self.page_size]
        self.page_fill[last] = (lens - 1) % self.page_size + 1
        t.sync_entries(*entries)
        t.sync_lens(rows)
        self._after("alloc_decode")
        return int(per_row.sum())

    def _decode_need(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """int64 ``(need, cow)`` ``[n, G]`` of one decode token: new pages, COW copies among them.

        Same as ``table.append_need(rows, 1)`` / ``table.cow_needed(rows, 1)``, in one pass.
        """
        t = self.table
        lens, num = t.lens[rows], t.num_pages[rows]
        partial = lens % self.page_size != 0
        cow = (partial & (num > 0) & (num <= t.own_start[rows])).astype(np.int64)
        return np.maximum(-(-(lens + 1) // self.page_size) - num, 0) + cow, cow

    def _decode_overflow(self, rows: np.ndarray, per_row: np.ndarray) -> np.ndarray:
        """int64 ``[n]``: pages beyond each row's grant that a decode step needing ``per_row``
        takes (from the unreserved free pages)."""
        over = np.zeros(rows.size, np.int64)
        by_row = self.ledger.by_row
        growing = np.nonzero(per_row)[0]
        over[growing] = [
            by_row[r].remaining_pages for r in rows[growing].tolist()
        ]  # remaining grant, then what exceeds it
        over[growing] = np.maximum(per_row[growing] - over[growing], 0)
        return over

    def _check_decode_rows(self, rows: np.ndarray) -> None:
        bad = (rows < 0) | (rows >= len(self.rids))
        if not bad.any():
            bad = ~self.ready[rows]
        if bad.any():
            self._check_committed(int(rows[bad][0]), "alloc_decode")
        if np.unique(rows).size != rows.size:
            raise PoolError(f"alloc_decode: rows {rows.tolist()} repeat a row")
        full = -(-(self.table.lens[rows] + 1) // self.page_size) > self.table.max_pages_per_group
        if full.any():
            b = int(np.nonzero(full.any(axis=1))[0][0])
            self._check_width(int(rows[b]), self.rids[rows[b]], self.table.lens[rows[b]] + 1)

    # ---- end of a request ------------------------------------------------------------------
    def finish(self, row: int) -> list[SegmentPages]:
        """End a request and hand its own pages, per segment, to the caller.

        Ownership: the caller (a radix node) now holds one reference to every page in the
        returned segments and must free it with :meth:`free_pages`. Borrowed prefix pages are
        released (their other holders keep them). The unused grant returns to admission.

        Raises:
            PoolError: row not active, or an extend allocated but not committed.
        """
        self._check_committed(row, "finish")
        entries = self._entries(row, own=None)
        borrowed = entries[self._entry_borrowed(row)]
        segments = self.table.take_segments(row)  # changes no entry: only who owns them
        self._drop_row(row, borrowed, entries)
        self._after("finish")
        return segments

    def detach_segments(self, row: int) -> list[SegmentPages]:
        """Hand the row's own pages to the caller while the row keeps running (chunked cache).

        Ownership: as :meth:`finish`; the row keeps reading the pages as borrowed (one more
        holder), so appending to a partial tail later costs a COW page per group, taken beyond
        the reservation (overflow; check :meth:`can_decode`).
        """
        self._check_committed(row, "detach_segments")
        segments = self.table.take_segments(row)
        for seg in segments:
            for ids in seg.pages:
                self.allocator.incref(torch.from_numpy(ids))
        self._after("detach_segments")
        return segments

    def abort(self, row: int) -> int:
        """Abort or retract a request: free its own pages, release borrowed ones and the grant.

        Works with an uncommitted extend. Returns pages that went back to the free list.
        """
        self._check_row(row, self.rids[row] if 0 <= row < len(self.rids) else None, active=True)
        entries = self._entries(row, own=None)
        return self._drop_row(row, entries, entries)

    retract = abort

    def free_pages(self, pages: np.ndarray | torch.Tensor, owner: str = "radix node") -> int:
        """Drop one outside holder's reference per listed page (radix eviction).

        Raises:
            PoolError: non-integer ids, an id out of range, or a page not held by an outside
                holder (double free, or a page only running rows hold). Nothing changes on error.
        """
        raw = torch.as_tensor(pages)
        if raw.is_floating_point() or raw.dtype == torch.bool:
            raise PoolError(f"free_pages by {owner}: page ids must be integers, got {raw.dtype}")
        ids = raw.to(torch.int64).flatten()
        arr = ids.numpy()
        if arr.size and (arr.min() < 1 or arr.max() >= self.allocator.num_pages):
            raise PoolError(
                f"free_pages by {owner}: page ids out of [1, {self.allocator.num_pages})"
            )
        uniq, uses = np.unique(arr, return_counts=True)
        outside = self.allocator.ref_count.numpy()[uniq].astype(np.int64) - self.row_refs[uniq]
        bad = uniq[uses > outside]
        if bad.size:
            raise PoolError(
                f"free_pages by {owner}: pages {bad[:8].tolist()} are not held outside running "
                "rows (double free, or pages a request row still owns: finish it first)"
            )
        freed = self.allocator.free(ids, owner)
        self._after("free_pages")
        return freed

    def share_pages(self, pages: np.ndarray, owner: str = "radix node") -> None:
        """Add one outside holder to each listed page (a radix node takes a reference).

        For a page a second node starts to hold (a parent adopting its child's copy of their
        shared tail page). Free each reference with :meth:`free_pages`.

        Raises:
            PoolError: an id out of range, free or the padding page (nothing changes).
        """
        ids = torch.as_tensor(np.asarray(pages, np.int64))
        try:
            self.allocator.incref(ids)
        except PoolError as exc:
            raise PoolError(f"share_pages by {owner}: {exc}") from None
        self._after("share_pages")

    def row_usage(self, row: int) -> RowUsage:
        """Pages one running row holds and has left (no side effects); for retraction choices.

        ``abort(row)`` returns ``own_pages`` to the free list and ``remaining_pages`` to
        admission.
        """
        self._check_row(row, None, active=True)
        t, res = self.table, self.ledger.by_row[row]
        own = int((t.num_pages[row] - t.own_start[row]).clip(min=0).sum())
        return RowUsage(
            own_pages=own,
            borrowed_pages=int(t.num_pages[row].sum()) - own,
            reserved_pages=res.reserved_pages,
            used_pages=res.used_pages,
            remaining_pages=res.remaining_pages,
            overflow_pages=res.overflow_pages,
        )

    def group_pages(self, row: int, group: int) -> np.ndarray:
        """int64 ``[pages]``: the dense page list of (row, group) (a copy; no side effects).

        Raises:
            PoolError: row not active or group out of range, naming both.
        """
        self._check_row(row, None, active=True)
        if not 0 <= group < self.num_head_groups:
            raise PoolError(
                f"request {self.rids[row]!r} (row {row}): group {group} is outside "
                f"[0, {self.num_head_groups}) head groups of the profile"
            )
        return self.table.group_pages(row, group)

    # ---- accounting ------------------------------------------------------------------------
    def stats(self) -> MemoryStats:
        """A snapshot of the accounting (plain numbers, for logs and /metrics)."""
        return collect_stats(self)

    def check_invariants(self) -> None:
        """Check pool, ledger, tables and holder counts; collect all violations, raise once.

        Raises:
            PoolError: listing every violation (see ``mem/invariants.py``).
        """
        check_memory(self)

    # ---- helpers ---------------------------------------------------------------------------
    def _append_tokens(
        self, extend_len: int, max_new_tokens: int, decode_tokens: int | None, start_token: int = 0
    ) -> np.ndarray:
        if extend_len < 0 or max_new_tokens < 0 or (decode_tokens or 0) < 0:
            raise PoolError(
                f"extend_len={extend_len}, max_new_tokens={max_new_tokens} and "
                f"decode_tokens={decode_tokens} must be >= 0"
            )
        tail = max(max_new_tokens - 1, 0) if decode_tokens is None else int(decode_tokens)
        return self.kept_lens(start_token, int(extend_len)) + tail

    def _prefix_arrays(self, prefix, rid, row) -> tuple[np.ndarray, list[np.ndarray]]:
        counts = self.allocator.ref_count.numpy()
        return validate_prefix(prefix, self.num_head_groups, self.page_size, counts, rid, row)

    def _check_row(self, row: int, rid: str | None, active: bool) -> None:
        if isinstance(row, bool | float) or not 0 <= row < len(self.rids):
            raise PoolError(f"request {rid!r}: row {row} is outside [0, {len(self.rids)})")
        if active and self.rids[row] is None:
            raise PoolError(f"row {row} has no admitted request; call admit first")
        if not active and self.rids[row] is not None:
            raise PoolError(
                f"request {rid!r}: row {row} is still used by request "
                f"{self.rids[row]!r}; finish or abort it first"
            )

    def _check_committed(self, row: int, what: str) -> str:
        self._check_row(row, None, active=True)
        if self.pending[row] is not None:
            raise PoolError(
                f"{what}: request {self.rids[row]!r} (row {row}) has an allocated "
                "extend not committed; call commit_extend (or abort) first"
            )
        return self.rids[row]

    def _check_width(self, row: int, rid: str | None, new_lens: np.ndarray) -> None:
        pages = -(-np.asarray(new_lens) // self.page_size)
        if (pages > self.table.max_pages_per_group).any():
            g = int(np.argmax(pages))
            raise PoolError(
                f"request {rid!r} (row {row}), group {g}: {int(new_lens[g])} kept "
                f"tokens need {int(pages[g])} pages > max_pages_per_group="
                f"{self.table.max_pages_per_group}; raise max_context_tokens"
            )

    def _alloc(self, num: int) -> np.ndarray:
        pages = self.allocator.alloc(num)
        assert pages is not None, "ledger invariant: granted pages are always free"
        self.peak_used_pages = max(self.peak_used_pages, self.allocator.num_used())
        return pages.numpy().copy()

    def _place(
        self, row: int, need: np.ndarray, cow: np.ndarray, pages: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Put fresh pages into the (row, g) tables: COW copy first where needed, then append.

        Args:
            need: int64 ``[G]`` fresh pages per group (COW copies included).
            cow: int64 ``[G]`` 1 where the group's shared partial tail page is copied first.
            pages: int64 ``[need.sum()]`` fresh page ids, group after group.

        Returns:
            ``(src, dst)`` int64 ``[n]``: the shared tail pages copied and their copies.

        Vectorised over groups: O(pages placed) numpy, no Python loop over groups.
        """
        t = self.table
        g, offset = ragged_entries(need)  # group of each fresh page, its place in the group
        first = t.num_pages[row] - cow  # [G] table index the group's first fresh page takes
        idx = offset + first[g]
        cow_g = np.nonzero(cow)[0]
        src = t.pages[row, cow_g, first[cow_g]].astype(np.int64)  # before overwriting
        dst = pages[(np.cumsum(need) - need)[cow_g]]
        t.pages[row, g, idx] = pages
        t.own_start[row, cow_g] = first[cow_g]
        t.num_pages[row] += need - cow
        self.page_group[pages] = g
        self.page_fill[pages] = 0
        self.row_refs[pages] += 1
        if src.size:
            self.page_fill[dst] = t.lens[row, cow_g] % self.page_size
            self._copy(src, dst, self.page_fill[dst])
            self.row_refs[src] -= 1
            self.allocator.free(torch.from_numpy(src.copy()), f"COW of row {row}")
        return src, dst

    def _place_decode(self, rows, need, cow, pages) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Vectorised :meth:`_place` for one decode token: at most one page per (row, group).

        A full last page gets a page appended; a shared partial one is replaced by its copy
        (which has room for the token). Returns the changed (row, group, index) entries.
        """
        assert need.max(initial=0) <= 1, "a decode token needs at most one page per group"
        b_idx, g_idx = np.nonzero(need)
        r_idx, is_cow = rows[b_idx], cow[b_idx, g_idx].astype(bool)
        t = self.table
        idx = t.num_pages[r_idx, g_idx] - is_cow
        src = t.pages[r_idx[is_cow], g_idx[is_cow], idx[is_cow]].astype(np.int64)
        t.pages[r_idx, g_idx, idx] = pages
        t.num_pages[r_idx, g_idx] += ~is_cow
        t.own_start[r_idx[is_cow], g_idx[is_cow]] = idx[is_cow]
        self.page_group[pages] = g_idx
        self.page_fill[pages] = 0
        self.row_refs[pages] += 1
        if src.size:
            dst = pages[is_cow]
            self.page_fill[dst] = t.lens[r_idx[is_cow], g_idx[is_cow]] % self.page_size
            self._copy(src, dst, self.page_fill[dst])
            self._add_row_refs(src, -1)  # two rows may copy one borrowed page in one step
            self.allocator.free(torch.from_numpy(src.copy()), "decode COW")
        return r_idx, g_idx, idx

    def _copy(self, src: np.ndarray, dst: np.ndarray, fill: np.ndarray) -> None:
        """COW copy of ``fill[i]`` slots of page ``src[i]`` into ``dst[i]`` (now or deferred)."""
        if self.kv_pool is None or not src.size:
            return
        if self.defer_copies:
            self._copies.append((src.copy(), dst.copy(), np.asarray(fill, np.int64).copy()))
            return
        self._copy_now(src, dst, np.asarray(fill, np.int64))

    def _copy_now(self, src: np.ndarray, dst: np.ndarray, fill: np.ndarray) -> None:
        """The pool copies of host page ids: their filled slots, uploaded in one packed
        non-blocking copy (``PackedUpload``), then one gather and scatter per pool."""
        parts = filled_slots(src, dst, fill)
        if self.debug:  # one gather then one scatter: no chained copy, no slot written twice
            dst_slots = parts[1] * self.page_size + parts[2]
            if np.unique(dst_slots).size != dst_slots.size or np.isin(dst, src).any():
                raise PoolError(
                    "copy-on-write: a destination page is written twice or is also a source in "
                    f"one batch (src {src[:8].tolist()}, dst {dst[:8].tolist()})"
                )
        self.kv_pool.copy_slots(*self.table.uploader.upload(list(parts)))

    def run_copies(self) -> int:
        """Run the copy-on-write copies deferred since the last call (``defer_copies``).

        The attention backend calls it when it plans a batch, on the stream the batch runs
        on, before any layer: a copy never races a batch still in flight that writes the
        fresh page's previous owner's last token (overlap scheduling), and every kernel of
        the batch sees the copied slots. Host page ids only, no device read.

        Returns:
            Pages copied.
        """
        copies, self._copies = self._copies, []
        if not copies or self.kv_pool is None:
            return 0
        src, dst, fill = (np.concatenate(c) for c in zip(*copies, strict=True))
        self._copy_now(src, dst, fill)
        return int(src.size)

    def _fill(self, row: int, old_len: np.ndarray, new_len: np.ndarray) -> None:
        """Record the filled slots of the pages (row, g) grew through, all groups at once.

        ``old_len`` / ``new_len``: int64 ``[G]`` kept lengths before / after (tokens).
        Vectorised: O(pages touched), no loop over groups.
        """
        ps = self.page_size
        lo, hi = old_len // ps, -(-new_len // ps)  # [G] first / past-last page index touched
        count = np.maximum(hi - lo, 0)
        if not count.any():
            return
        g, offset = ragged_entries(count)
        idx = offset + lo[g]
        ids = self.table.pages[row, g, idx]
        self.page_fill[ids] = np.minimum(ps, new_len[g] - idx * ps)

    def _entries(self, row: int, own: bool | None) -> np.ndarray:
        """Page ids of the row's table, tail first per group: own, borrowed or all (None).

        int64 ``[n]``, groups in order, each group's entries last to first. Vectorised over
        the row's ``[G, widest group]`` block (O(pages the row lists), no loop over groups).
        """
        t = self.table
        n, own_start = t.num_pages[row], t.own_start[row]
        lo = own_start if own else np.zeros_like(n)
        hi = own_start if own is False else n
        width = int(hi.max(initial=0))
        idx = np.arange(width - 1, -1, -1)  # reversed table indices
        keep = (idx >= lo[:, None]) & (idx < hi[:, None])
        return t.pages[row, :, :width][:, ::-1][keep].astype(np.int64)

    def _borrow(self, pages: list[np.ndarray]) -> np.ndarray:
        """A new row's holder reference on each page of its matched prefix.

        ``pages``: the prefix's int64 page ids, one array per head group (of one row or of
        several, in order). Returns them as one int64 ``[n]`` array.
        """
        borrowed = np.concatenate(pages) if pages else np.zeros(0, np.int64)
        self.allocator.incref(torch.from_numpy(borrowed))
        self._add_row_refs(borrowed, 1)
        return borrowed

    def _add_row_refs(self, pages: np.ndarray, delta: int) -> None:
        """``row_refs[p] += delta`` once per listed id (a repeated id counts each time).

        ``pages``: int64 ``[n]`` page ids. ``np.add.at`` semantics, through a tensor view of
        ``row_refs`` made per call (``index_add_`` costs a few microseconds where ``np.add.at``
        costs ~70; a view kept on the object would outlive a copy of the array).
        """
        ids = torch.from_numpy(np.ascontiguousarray(pages, np.int64))
        step = torch.full((1,), int(delta), dtype=torch.int64).expand(ids.numel())
        torch.from_numpy(self.row_refs).index_add_(0, ids, step)

    def _entry_borrowed(self, row: int) -> np.ndarray:
        """bool ``[n]``: which of ``_entries(row, own=None)`` are borrowed (same order)."""
        t = self.table
        n = t.num_pages[row]
        width = int(n.max(initial=0))
        idx = np.arange(width - 1, -1, -1)  # reversed table indices, as _entries
        return (idx < t.own_start[row][:, None])[idx < n[:, None]]

    def _drop_row(self, row: int, release: np.ndarray, entries: np.ndarray) -> int:
        """Release the row's references on ``release``, forget all its entries, clear it.

        ``entries``: ``_entries(row, own=None)``, every page id the row's table lists.
        """
        self._add_row_refs(entries, -1)
        freed = self.allocator.free(torch.from_numpy(release.copy()), f"row {row}")
        self.ledger.release(row)
        self.table.clear(row)
        self.rids[row] = None
        self.active[row] = False
        self.pending[row] = None
        self.ready[row] = False
        self._after("release")
        return freed

    def _after(self, what: str) -> None:
        if self.debug:
            try:
                self.check_invariants()
            except PoolError as exc:
                raise PoolError(f"after {what}: {exc}") from None
