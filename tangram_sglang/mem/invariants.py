"""Whole-state self-check of a :class:`~tangram_sglang.mem.manager.TangramMemory`.

Runs after every call when ``TANGRAM_DEBUG_POOL=1`` (and in tests). Like SGLang's
``sanity_check`` it collects every violation, then raises once. O(num_pages + rows * G * pages).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from tangram_sglang.errors import PoolError

if TYPE_CHECKING:
    from tangram_sglang.mem.manager import TangramMemory


def memory_problems(mem: TangramMemory) -> list[str]:
    """Every broken invariant of pool, ledger, tables and holder counts (empty when sound)."""
    problems = []
    try:
        mem.allocator.check_invariants()
    except PoolError as exc:
        problems.append(str(exc))
    if mem.ledger.outstanding_pages() > mem.allocator.num_free():
        problems.append("reserved pages exceed free pages")
    refs = np.zeros_like(mem.row_refs)
    t = mem.table
    for row in (r for r, rid in enumerate(mem.rids) if rid is not None):
        for g in range(mem.num_head_groups):
            np.add.at(refs, t.pages[row, g, : t.num_pages[row, g]], 1)
        pend = mem.pending[row]
        lens = t.lens[row] + (0 if pend is None else pend.kept_len)
        if (-(-lens // mem.page_size) != t.num_pages[row]).any():
            problems.append(f"row {row}: table not dense (pages != ceil(len / page_size))")
    if (refs != mem.row_refs).any():
        problems.append("row holder counts disagree with the row tables")
    if (mem.allocator.ref_count.numpy() < mem.row_refs).any():
        problems.append("a page listed in a row table has fewer holders than rows")
    # Staged device writes are applied first; a free row may keep its old device entries
    # (released host-only, see PageTable.clear), so only active rows are compared.
    t.flush()
    live = [r for r, rid in enumerate(mem.rids) if rid is not None]
    idx = torch.tensor(live, dtype=torch.int64)
    pages = torch.from_numpy(t.pages[live]).to(torch.int32)
    if not torch.equal(t.page_table.cpu()[idx], pages):
        problems.append("device page_table differs from the host mirror")
    if not torch.equal(t.group_len.cpu()[idx], torch.from_numpy(t.lens[live]).to(torch.int32)):
        problems.append("device group_len differs from the host mirror")
    return problems


def check_memory(mem: TangramMemory) -> None:
    """Raise one :class:`PoolError` listing every violation found by :func:`memory_problems`."""
    problems = memory_problems(mem)
    if problems:
        raise PoolError("memory invariants broken: " + "; ".join(problems))
