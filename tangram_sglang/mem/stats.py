"""Accounting snapshot of a :class:`~tangram_sglang.mem.manager.TangramMemory` (plain numbers).

Owns the numbers exposed to logs, ``/metrics`` and benchmarks; reads the manager's state and
changes nothing.

Slots are (token, KV head) cells: a page has ``H_p * page_size`` of them. A slot is unused when
its page is held but the slot holds no token: the tail of a group's last page, and the spare
columns of a partial head group (global scope, ``H_p`` not dividing ``L * H_kv``). Their share
of the held slots is the fragmentation (Tangram arXiv 2606.06302, Ragged Paging).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from tangram_sglang.mem.manager import TangramMemory


@dataclass(slots=True)
class MemoryStats:
    """Accounting of one pool at one instant."""

    num_usable_pages: int  # pages the pool can hand out (page 0 excluded)
    free_pages: int  # pages with no holder
    used_pages: int  # pages with >= 1 holder (request rows or radix nodes)
    reserved_pages: int  # pages granted to running rows and not yet allocated
    granted_pages: int  # pages granted to running rows in total
    granted_used_pages: int  # pages running rows allocated against their grants
    overflow_pages: int  # decode pages running rows took beyond their grants
    peak_used_pages: int  # max used_pages seen (pages)
    pages_per_group: tuple[int, ...]  # used pages per head group (pages)
    bytes_per_page: int  # bytes, K and V together
    bytes_held: int  # used_pages * bytes_per_page (bytes)
    allocated_slots: int  # (token, head) slots in used pages
    unused_slots: int  # slots in used pages that hold no token (fragmentation)
    fragmentation_fraction: float  # unused_slots / allocated_slots (0 when nothing is used)
    num_active_rows: int  # request rows admitted and not finished

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return asdict(self)


def collect_stats(mem: TangramMemory) -> MemoryStats:
    """Snapshot ``mem`` (O(num_pages) host work; call per log line, not per layer)."""
    counts = mem.allocator.ref_count.numpy()
    used = counts > 0
    groups = mem.page_group[used]
    members = mem.profile.grouping.group_sizes()[groups]
    allocated = int(used.sum()) * mem.heads_per_group * mem.page_size
    stored = int((mem.page_fill[used] * members).sum())
    grants = mem.ledger.by_row.values()
    per_group = np.bincount(groups, minlength=mem.num_head_groups)
    return MemoryStats(
        num_usable_pages=mem.allocator.num_usable_pages,
        free_pages=mem.allocator.num_free(),
        used_pages=int(used.sum()),
        reserved_pages=mem.ledger.outstanding_pages(),
        granted_pages=sum(r.reserved_pages for r in grants),
        granted_used_pages=sum(r.used_pages for r in grants),
        overflow_pages=sum(r.overflow_pages for r in grants),
        peak_used_pages=mem.peak_used_pages,
        pages_per_group=tuple(int(x) for x in per_group),
        bytes_per_page=mem.bytes_per_page,
        bytes_held=int(used.sum()) * mem.bytes_per_page,
        allocated_slots=allocated,
        unused_slots=allocated - stored,
        fragmentation_fraction=(allocated - stored) / allocated if allocated else 0.0,
        num_active_rows=sum(rid is not None for rid in mem.rids),
    )
