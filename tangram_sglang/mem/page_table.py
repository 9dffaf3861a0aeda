"""Per-(request row, head group) dense page tables, kept lengths and segment bookkeeping.

Owns the kernel-readable tensors and their host mirror. Allocation decisions (which groups need
a page, copy-on-write) are made by :mod:`manager`; page ids come from :mod:`page_allocator`.

Layout (rows are SGLang's ``req_pool_idx``)::

    page_table[max_rows, num_head_groups, max_pages_per_group]  int32, unused entries = 0
    group_len [max_rows, num_head_groups]                       int32, kept tokens
    token t of group g of row r -> page_table[r, g, t // page_size], slot t % page_size

    entries of (r, g):  [0 ........ own_start) [own_start ........ num_pages)
                         borrowed: a radix       the row's own pages (one holder: the row),
                         node's pages, immutable  each taken by one segment of the row

A segment (one extend chunk, or the decode tail after it) owns the entries from its
``first_page_index[g]`` up to the next segment's. A segment whose first kept token is not at a
page start either continues the previous segment's own tail page (no new page) or starts with a
copy of a shared tail page (copy-on-write), so its first owned page may hold older tokens.

Source: docs/contracts.md (dense per-(row, group) tables, COW tail); Tangram arXiv 2606.06302,
Ragged Paging; SGLang ``ReqToTokenPool`` (rows).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tangram_sglang.errors import PoolError

EXTEND = "extend"
DECODE = "decode"


def ragged_entries(count: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each entry of a ragged block, in order: the cell that holds it and its place there.

    Args:
        count: int ``[G]`` or ``[n, G]`` entries per cell (>= 0), e.g. pages per head group.

    Returns:
        int64 ``(cell, offset)``, each ``[count.sum()]``: the entry's cell as a flat
        (row-major) index into ``count`` (``divmod(cell, G)`` gives row and group of an
        ``[n, G]`` block) and its position within that cell.
    """
    per = np.asarray(count, np.int64).ravel()
    cell = np.repeat(np.arange(per.size), per)
    return cell, np.arange(cell.size) - np.repeat(np.cumsum(per) - per, per)


@dataclass(slots=True)
class SegmentPages:
    """One segment's pages per head group: the unit a radix node takes ownership of.

    Ownership: when returned by ``TangramMemory.finish`` / ``detach_segments`` the caller holds
    one reference to every id in ``pages`` and must free it (``TangramMemory.free_pages``).

    ``pages[g]`` are views of ``flat`` (one array of the ids it is given, copied). Build a copy
    with ``SegmentPages(...)``, not ``copy.deepcopy`` or pickle: those copy each view apart, and
    a page replaced in the copy's ``pages[g]`` would not reach its ``flat``.
    """

    kind: str  # "extend" (one compressed chunk) or "decode" (uncompressed decode tail)
    num_tokens: int  # logical tokens of the segment (drive positions)
    start_len: np.ndarray  # int64 [G]: group kept length before the segment (tokens)
    kept_len: np.ndarray  # int64 [G]: tokens the segment added per group (tokens)
    first_page_index: np.ndarray  # int64 [G]: table index of the segment's first owned page
    pages: list[np.ndarray]  # per group: int64 page ids it owns, in table order
    # pages owned over all groups; counted once: an id may be replaced (a radix node adopts a
    # copy-on-write copy), a group's list never grows or shrinks
    num_pages: int = field(init=False)
    # int64 [G]: pages per group (sizes of ``pages``; fixed, as the lists never change length)
    page_counts: np.ndarray = field(init=False)
    # int64 [num_pages]: every group's pages, group after group; ``pages[g]`` are views of it,
    # so a page replaced in place (``pages[g][-1] = copy``) is replaced here too
    flat: np.ndarray = field(init=False)
    group_of_page: np.ndarray = field(init=False)  # int64 [num_pages]: the group of each page
    index_in_group: np.ndarray = field(init=False)  # int64 [num_pages]: its index in pages[g]

    def __post_init__(self) -> None:
        counts = np.fromiter((p.size for p in self.pages), np.int64, len(self.pages))
        flat = (
            np.concatenate(self.pages).astype(np.int64, copy=False)
            if self.pages
            else np.zeros(0, np.int64)
        )
        self._lay_out(flat, counts, *ragged_entries(counts))

    @classmethod
    def from_table(
        cls,
        kind: str,
        num_tokens: int,
        start_len: np.ndarray,
        kept_len: np.ndarray,
        first_page_index: np.ndarray,
        flat: np.ndarray,
        counts: np.ndarray,
        group_of_page: np.ndarray,
        index_in_group: np.ndarray,
    ) -> SegmentPages:
        """A segment over page ids gathered from a page table in one pass (no copy).

        Args:
            flat: int64 ``[counts.sum()]`` page ids, group after group; the segment takes it
                (the caller must not keep or change it).
            counts: int64 ``[G]`` pages per group.
            group_of_page, index_in_group: int64 ``[counts.sum()]``, ``ragged_entries(counts)``.
        """
        seg = cls.__new__(cls)
        seg.kind, seg.num_tokens = kind, num_tokens
        seg.start_len, seg.kept_len, seg.first_page_index = start_len, kept_len, first_page_index
        seg._lay_out(flat, counts, group_of_page, index_in_group)
        return seg

    def _lay_out(
        self,
        flat: np.ndarray,
        counts: np.ndarray,
        group_of_page: np.ndarray,
        index_in_group: np.ndarray,
    ) -> None:
        """Set ``flat``, the per-group views ``pages`` and the derived fields."""
        self.page_counts, self.num_pages, self.flat = counts, int(counts.sum()), flat
        bounds = np.cumsum(counts)
        self.pages = [
            flat[lo:hi] for lo, hi in zip((bounds - counts).tolist(), bounds.tolist(), strict=True)
        ]
        self.group_of_page, self.index_in_group = group_of_page, index_in_group


@dataclass(slots=True)
class _OpenSegment:
    """Host bookkeeping of a segment still attached to its row."""

    kind: str  # "extend" or "decode"
    num_tokens: int  # logical tokens so far
    start_len: np.ndarray  # int64 [G] (tokens)
    kept_len: np.ndarray | None  # int64 [G] (tokens); None: an open decode tail (tail_tokens)
    first_page_index: np.ndarray  # int64 [G] (table index)


class PageTable:
    """Dense per-(row, group) page lists: device tensors for kernels plus a host mirror.

    Every method updates both; the host mirror answers scheduler questions without a device
    sync. Mutating methods do not check ownership; :class:`~tangram_sglang.mem.manager.
    TangramMemory` does.

    Args:
        max_rows: request rows (SGLang ``max_running_requests`` / req pool size).
        num_head_groups: G of the profile's grouping.
        max_pages_per_group: table width (pages), ``ceil(max context kept tokens / page_size)``.
        page_size: tokens per page.
        device: where ``page_table`` / ``group_len`` live (the attention device).
    """

    def __init__(
        self,
        max_rows: int,
        num_head_groups: int,
        max_pages_per_group: int,
        page_size: int,
        device: str | torch.device = "cpu",
    ) -> None:
        for name, value in (
            ("max_rows", max_rows),
            ("num_head_groups", num_head_groups),
            ("max_pages_per_group", max_pages_per_group),
            ("page_size", page_size),
        ):
            if int(value) < 1:
                raise PoolError(f"PageTable {name}={value} must be >= 1")
        shape = (max_rows, num_head_groups)
        self.page_size = int(page_size)  # tokens per page
        self.page_table = torch.zeros(
            (*shape, max_pages_per_group), dtype=torch.int32, device=device
        )
        self.group_len = torch.zeros(shape, dtype=torch.int32, device=device)
        self.pages = np.zeros((*shape, max_pages_per_group), np.int32)  # host mirror, ids
        self.num_pages = np.zeros(shape, np.int64)  # table entries in use per (row, group)
        self.lens = np.zeros(shape, np.int64)  # host mirror of group_len (tokens)
        self.own_start = np.zeros(shape, np.int64)  # first entry owned by the row
        self.segments: list[list[_OpenSegment]] = [[] for _ in range(max_rows)]
        self.in_tail = np.zeros(max_rows, bool)  # the row's last segment is an open decode tail
        self.tail_tokens = np.zeros(max_rows, np.int64)  # tokens of that tail (every group +1)
        # Device writes are staged on the host and applied by flush(): at once (deferred False)
        # or once per batch plan by the attention backend (deferred True).
        self.deferred = False
        self._zero_rows: list[int] = []
        self._entries: list[np.ndarray] = []  # flat page_table indices
        self._len_rows: list[np.ndarray] = []
        self.uploader = PackedUpload(device)

    @property
    def max_rows(self) -> int:
        return int(self.pages.shape[0])

    @property
    def num_head_groups(self) -> int:
        return int(self.pages.shape[1])

    @property
    def max_pages_per_group(self) -> int:
        return int(self.pages.shape[2])

    # ---- queries ---------------------------------------------------------------------------
    def group_pages(self, row: int, group: int) -> np.ndarray:
        """int64 ``[num_pages]``: the dense page list of (row, group)."""
        return self.pages[row, group, : self.num_pages[row, group]].astype(np.int64)

    def last_page_shared(self, rows: np.ndarray | int) -> np.ndarray:
        """bool ``[..., G]``: the group's last page exists and is not the row's own."""
        n = self.num_pages[rows]
        return (n > 0) & (n <= self.own_start[rows])

    def append_need(self, rows: np.ndarray | int, append_tokens: np.ndarray) -> np.ndarray:
        """int64 ``[..., G]``: new pages (COW copy included) to append ``append_tokens``."""
        lens, ps = self.lens[rows], self.page_size
        add = np.broadcast_to(np.asarray(append_tokens, np.int64), lens.shape)
        full_after = -(-(lens + add) // ps) - self.num_pages[rows]
        cow = self.cow_needed(rows, add)
        return np.maximum(full_after, 0) + cow

    def cow_needed(self, rows: np.ndarray | int, append_tokens: np.ndarray) -> np.ndarray:
        """int64 ``[..., G]``: 1 where appending must first copy a shared partial tail page."""
        lens = self.lens[rows]
        add = np.broadcast_to(np.asarray(append_tokens, np.int64), lens.shape)
        partial = lens % self.page_size != 0
        return (self.last_page_shared(rows) & partial & (add > 0)).astype(np.int64)

    # ---- mutation (host + device) ----------------------------------------------------------
    def set_borrowed(self, row: int, pages: list[np.ndarray], lens: np.ndarray) -> None:
        """Fill an empty row with a matched prefix's pages (all borrowed) and kept lengths."""
        for g, ids in enumerate(pages):
            self.pages[row, g, : ids.size] = ids
            self.num_pages[row, g] = ids.size
        self.lens[row] = lens
        self.own_start[row] = self.num_pages[row]
        self.sync_row(row)

    def replace_last(self, row: int, group: int, page: int) -> int:
        """COW: make ``page`` (the row's own) the last entry; returns the replaced page id."""
        idx = self.num_pages[row, group] - 1
        old = int(self.pages[row, group, idx])
        self.pages[row, group, idx] = page
        self.own_start[row, group] = idx
        return old

    def append(self, row: int, group: int, pages: np.ndarray) -> None:
        """Append the row's own pages to (row, group) (host only; call :meth:`sync_row`)."""
        start = self.num_pages[row, group]
        self.pages[row, group, start : start + pages.size] = pages
        self.num_pages[row, group] = start + pages.size

    def open_segment(self, row: int, kind: str, first_page_index: np.ndarray) -> _OpenSegment:
        """Start a segment at the row's current lengths; returns its record."""
        g = self.num_head_groups
        seg = _OpenSegment(kind, 0, self.lens[row].copy(), np.zeros(g, np.int64), first_page_index)
        self.segments[row].append(seg)
        self.in_tail[row] = False
        self.tail_tokens[row] = 0
        return seg

    def take_segments(self, row: int) -> list[SegmentPages]:
        """Hand out the row's own pages per segment; they become borrowed entries of the row.

        Ownership: the row keeps referencing the pages (the table is unchanged) but no longer
        owns them; the caller decides who holds them (see ``TangramMemory``).
        """
        out = []
        segs = self.segments[row]
        for i, seg in enumerate(segs):
            if seg.kind == DECODE and seg.kept_len is None:  # the open tail (open_tail)
                seg.num_tokens = int(self.tail_tokens[row])
                seg.kept_len = np.full(self.num_head_groups, seg.num_tokens, np.int64)
            end = segs[i + 1].first_page_index if i + 1 < len(segs) else self.num_pages[row]
            start = np.asarray(seg.first_page_index, np.int64)
            counts = np.maximum(np.asarray(end, np.int64) - start, 0)
            g, offset = ragged_entries(counts)
            flat = self.pages[row, g, offset + start[g]].astype(np.int64, copy=False)  # fresh
            out.append(
                SegmentPages.from_table(
                    seg.kind,
                    seg.num_tokens,
                    seg.start_len,
                    seg.kept_len,
                    seg.first_page_index,
                    flat,
                    counts,
                    g,
                    offset,
                )
            )
        self.segments[row] = []
        self.in_tail[row] = False
        self.tail_tokens[row] = 0
        self.own_start[row] = self.num_pages[row]
        return out

    def clear(self, row: int) -> None:
        """Empty a row on the host (entries back to padding page 0); the device is not touched.

        A batch still in flight may read the row (overlap scheduling: a request finished in
        batch i-1 is still in batch i), so the device row keeps its old entries until the next
        owner's :meth:`sync_row` overwrites it in stream order. No kernel reads a free row:
        padded batch entries use row 0.
        """
        self.pages[row] = 0
        self.num_pages[row] = 0
        self.lens[row] = 0
        self.own_start[row] = 0
        self.segments[row] = []
        self.in_tail[row] = False
        self.tail_tokens[row] = 0

    def open_tail(self, rows: np.ndarray, first_page_index: np.ndarray) -> None:
        """Open a decode-tail segment on each of ``rows`` (which must not have one open).

        Args:
            rows: int64 ``[n]`` distinct rows.
            first_page_index: int64 ``[n, G]`` table index of each tail's first owned page.
        """
        for b, row in enumerate(rows.tolist()):
            seg = self.open_segment(row, DECODE, first_page_index[b])
            seg.kept_len = None  # the tail grows in ``tail_tokens``; take_segments reads it
        self.in_tail[rows] = True

    # ---- device copies ---------------------------------------------------------------------
    def sync_row(self, row: int) -> None:
        """Stage a whole row for the device: zero it, then its entries and kept lengths."""
        self._zero_rows.append(int(row))
        self.sync_range(row, np.zeros(self.num_head_groups, np.int64), self.num_pages[row])
        self._len_rows.append(np.array([row], np.int64))
        self._maybe_flush()

    def sync_rows(self, rows: np.ndarray) -> None:
        """:meth:`sync_row` of each of ``rows`` (int64 ``[n]``, distinct), staged at once."""
        rows = np.asarray(rows, np.int64).reshape(-1)
        self._zero_rows.extend(rows.tolist())
        count = self.num_pages[rows].ravel()  # row-major: row, then group
        total = int(count.sum())
        if total:
            flat = (rows[:, None] * self.num_head_groups + np.arange(self.num_head_groups)).ravel()
            offset = np.arange(total) - np.repeat(np.cumsum(count) - count, count)
            self._entries.append(np.repeat(flat, count) * self.max_pages_per_group + offset)
        self._len_rows.append(rows)
        self._maybe_flush()

    def sync_range(self, row: int, start: np.ndarray, end: np.ndarray) -> None:
        """Stage the entries ``[start[g], end[g])`` of every group g of ``row`` (table indices)."""
        count = np.maximum(np.asarray(end, np.int64) - start, 0)
        total = int(count.sum())
        if total:
            g, offset = ragged_entries(count)
            idx = np.asarray(start, np.int64)[g] + offset
            self._entries.append((row * self.num_head_groups + g) * self.max_pages_per_group + idx)
        self._maybe_flush()

    def sync_entries(self, rows: np.ndarray, groups: np.ndarray, idxs: np.ndarray) -> None:
        """Stage the listed (row, group, index) table entries for the device (decode growth)."""
        if len(rows):
            flat = np.asarray(rows, np.int64) * self.num_head_groups + groups
            self._entries.append(flat * self.max_pages_per_group + idxs)
        self._maybe_flush()

    def sync_lens(self, rows: np.ndarray) -> None:
        """Stage the kept lengths of the listed rows for the device."""
        self._len_rows.append(np.asarray(rows, np.int64).reshape(-1))
        self._maybe_flush()

    def _maybe_flush(self) -> None:
        if not self.deferred:
            self.flush()

    def has_staged(self) -> bool:
        """Whether device writes are staged and not yet flushed."""
        return bool(self._zero_rows or self._entries or self._len_rows)

    def flush(self, extra: list[np.ndarray] | None = None) -> list[torch.Tensor]:
        """Apply the staged writes to ``page_table`` / ``group_len`` with one host-to-device copy.

        Values are read from the host mirror now (the latest state), so staging an entry twice or
        staging a row that changed owner since is harmless. Order on the device: zeroed rows,
        then entries, then kept lengths. With ``extra`` the same copy also carries those int64
        host arrays (a step's decode plan) and their device copies are returned, in order.

        No device-to-host read and no pageable copy: on CUDA the packed buffer is pinned and
        copied ``non_blocking`` on the current stream (:class:`PackedUpload`).

        Returns:
            int64 device tensors, one per ``extra`` array (same shapes).
        """
        extra = list(extra or [])
        zero = np.unique(np.asarray(self._zero_rows, np.int64))
        # entries staged twice are written twice with the same value (read from the mirror now):
        # no sort of the (large) entry list is needed
        flat = np.concatenate(self._entries) if self._entries else np.zeros(0, np.int64)
        rows = np.unique(np.concatenate(self._len_rows)) if self._len_rows else zero[:0]
        self._zero_rows, self._entries, self._len_rows = [], [], []
        if not (zero.size or flat.size or rows.size or extra):
            return []
        vals = self.pages.reshape(-1)[flat].astype(np.int64)
        lens = self.lens[rows]
        dev = self.uploader.upload([zero, flat, vals, rows, lens, *extra])
        d_zero, d_flat, d_vals, d_rows, d_lens = dev[:5]
        if zero.size:
            self.page_table.index_fill_(0, d_zero, 0)
        if flat.size:
            self.page_table.view(-1).index_copy_(0, d_flat, d_vals.to(torch.int32))
        if rows.size:
            self.group_len.index_copy_(0, d_rows, d_lens.to(torch.int32))
        return dev[5:]


class PackedUpload:
    """One host-to-device copy per call for several int64 host arrays (the step's deltas).

    CUDA: the arrays are packed into a pinned host buffer and copied ``non_blocking`` on the
    current stream into a device buffer; ``slots`` (>= 2) pinned/device buffer pairs are used
    in turn, and before a pinned buffer is rewritten the event recorded after its last copy is
    waited for (normally long done: the host runs at most one batch ahead and a batch makes at
    most two uploads, its copy-on-write page ids and its plan), so a copy still in flight is
    never overwritten. The device buffers are reused in stream order: every upload and every
    kernel that reads it run on one stream (the batch's, in ``init_forward_metadata``).
    Buffers grow (doubling) when a call needs more room.
    CPU: the arrays are concatenated into a fresh tensor (no copy to make).

    Args:
        device: where the returned tensors live.
        slots: buffer pairs used in turn (CUDA).
    """

    def __init__(self, device: str | torch.device, slots: int = 4) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.slots = max(int(slots), 2)
        self._host: list[torch.Tensor | None] = [None] * self.slots
        self._dev: list[torch.Tensor | None] = [None] * self.slots
        self._events: list[object | None] = [None] * self.slots
        self._next = 0
        self.num_uploads = 0  # calls that copied something (for tests and benchmarks)

    def upload(self, parts: list[np.ndarray]) -> list[torch.Tensor]:
        """int64 device tensors with the contents (and shapes) of ``parts``, one copy for all."""
        arrays = [np.asarray(p, np.int64) for p in parts]
        sizes = [a.size for a in arrays]
        total = int(sum(sizes))
        self.num_uploads += 1
        if not self.cuda:
            flat = torch.from_numpy(np.concatenate([a.reshape(-1) for a in arrays]))
            flat = flat.to(self.device)
            return _split(flat, arrays, sizes)
        k = self._next
        self._next = (k + 1) % self.slots
        host = self._host[k]
        if host is None or host.numel() < total:
            cap = max(total, 2 * (0 if host is None else host.numel()), 1024)
            if self._events[k] is not None:
                self._events[k].synchronize()
            self._host[k] = host = torch.empty(cap, dtype=torch.int64, pin_memory=True)
            self._dev[k] = torch.empty(cap, dtype=torch.int64, device=self.device)
        elif self._events[k] is not None:
            self._events[k].synchronize()  # the copy that last read this pinned buffer
        view = host.numpy()
        offset = 0
        for a, n in zip(arrays, sizes, strict=True):
            view[offset : offset + n] = a.reshape(-1)
            offset += n
        dev = self._dev[k][:total]
        dev.copy_(host[:total], non_blocking=True)
        event = self._events[k] or torch.cuda.Event()
        event.record()
        self._events[k] = event
        return _split(dev, arrays, sizes)


def _split(flat: torch.Tensor, arrays: list[np.ndarray], sizes: list[int]) -> list[torch.Tensor]:
    out, offset = [], 0
    for a, n in zip(arrays, sizes, strict=True):
        out.append(flat[offset : offset + n].view(a.shape))
        offset += n
    return out
