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

from dataclasses import dataclass

import numpy as np
import torch

from tangram_sglang.errors import PoolError

EXTEND = "extend"
DECODE = "decode"


@dataclass(slots=True)
class SegmentPages:
    """One segment's pages per head group: the unit a radix node takes ownership of.

    Ownership: when returned by ``TangramMemory.finish`` / ``detach_segments`` the caller holds
    one reference to every id in ``pages`` and must free it (``TangramMemory.free_pages``).
    """

    kind: str  # "extend" (one compressed chunk) or "decode" (uncompressed decode tail)
    num_tokens: int  # logical tokens of the segment (drive positions)
    start_len: np.ndarray  # int64 [G]: group kept length before the segment (tokens)
    kept_len: np.ndarray  # int64 [G]: tokens the segment added per group (tokens)
    first_page_index: np.ndarray  # int64 [G]: table index of the segment's first owned page
    pages: list[np.ndarray]  # per group: int64 page ids it owns, in table order

    @property
    def num_pages(self) -> int:
        """Pages owned by the segment over all groups."""
        return int(sum(p.size for p in self.pages))


@dataclass(slots=True)
class _OpenSegment:
    """Host bookkeeping of a segment still attached to its row."""

    kind: str  # "extend" or "decode"
    num_tokens: int  # logical tokens so far
    start_len: np.ndarray  # int64 [G] (tokens)
    kept_len: np.ndarray  # int64 [G] (tokens)
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
        return seg

    def take_segments(self, row: int) -> list[SegmentPages]:
        """Hand out the row's own pages per segment; they become borrowed entries of the row.

        Ownership: the row keeps referencing the pages (the table is unchanged) but no longer
        owns them; the caller decides who holds them (see ``TangramMemory``).
        """
        out = []
        segs = self.segments[row]
        for i, seg in enumerate(segs):
            end = segs[i + 1].first_page_index if i + 1 < len(segs) else self.num_pages[row]
            pages = [
                self.pages[row, g, seg.first_page_index[g] : end[g]].astype(np.int64)
                for g in range(self.num_head_groups)
            ]
            out.append(
                SegmentPages(
                    seg.kind,
                    seg.num_tokens,
                    seg.start_len,
                    seg.kept_len,
                    seg.first_page_index,
                    pages,
                )  # fmt: skip
            )
        self.segments[row] = []
        self.own_start[row] = self.num_pages[row]
        return out

    def clear(self, row: int) -> None:
        """Empty a row (entries back to padding page 0)."""
        self.pages[row] = 0
        self.num_pages[row] = 0
        self.lens[row] = 0
        self.own_start[row] = 0
        self.segments[row] = []
        self.sync_row(row)

    def sync_row(self, row: int) -> None:
        """Copy one row of the host mirror to the device tensors."""
        width = int(self.num_pages[row].max(initial=0))
        self.page_table[row, :, :width] = torch.from_numpy(self.pages[row, :, :width]).to(
            self.page_table.device, torch.int32
        )
        self.page_table[row, :, width:] = 0
        self.group_len[row] = torch.from_numpy(self.lens[row]).to(
            self.group_len.device, torch.int32
        )

    def sync_entries(self, rows: np.ndarray, groups: np.ndarray, idxs: np.ndarray) -> None:
        """Copy the listed (row, group, index) table entries to the device (decode growth)."""
        if len(rows) == 0:
            return
        dev = self.page_table.device
        r, g, i = (torch.from_numpy(np.asarray(a, np.int64)).to(dev) for a in (rows, groups, idxs))
        vals = torch.from_numpy(self.pages[rows, groups, idxs]).to(dev, torch.int32)
        self.page_table[r, g, i] = vals

    def sync_lens(self, rows: np.ndarray) -> None:
        """Copy the kept lengths of the listed rows (distinct) to the device.

        ``index_copy_``, not ``group_len[idx] = lens``: on CPU, torch 2.11's index_put goes
        parallel (OpenMP) already at 64 rows and took ~6 ms per decode step on a loaded 2-core
        box (0.1 ms on one thread), index_copy_ ~10 us; one kernel either way on GPU.
        """
        idx = torch.from_numpy(np.asarray(rows, np.int64)).to(self.group_len.device)
        lens = torch.from_numpy(self.lens[rows]).to(self.group_len.device, torch.int32)
        self.group_len.index_copy_(0, idx, lens)
