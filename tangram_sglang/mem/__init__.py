"""Ragged head-group KV memory: page pool, page tables, Budget Reservation (no sglang imports).

Public entry point: :class:`TangramMemory` (``mem/manager.py``); the pieces it composes are
importable for tests and tools.
"""

from tangram_sglang.mem.kv_pool import KVPool, bytes_per_page, num_pages_for_budget
from tangram_sglang.mem.manager import ExtendPlan, RowUsage, TangramMemory
from tangram_sglang.mem.page_allocator import PageAllocator
from tangram_sglang.mem.page_table import PageTable, SegmentPages
from tangram_sglang.mem.prefix import PrefixMatch
from tangram_sglang.mem.reservation import (
    RequestTooLargeError,
    Reservation,
    ReservationLedger,
    pages_needed,
)
from tangram_sglang.mem.stats import MemoryStats

__all__ = [
    "ExtendPlan",
    "KVPool",
    "MemoryStats",
    "PageAllocator",
    "PageTable",
    "PrefixMatch",
    "RequestTooLargeError",
    "Reservation",
    "ReservationLedger",
    "RowUsage",
    "SegmentPages",
    "TangramMemory",
    "bytes_per_page",
    "num_pages_for_budget",
    "pages_needed",
]
