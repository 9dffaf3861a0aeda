"""A matched radix prefix as the memory manager takes it, and its validation.

Owns the hand-in record (:class:`PrefixMatch`): the radix tree builds it from a matched node
chain; :meth:`TangramMemory.admit` borrows its pages (one more holder each) for a request row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tangram_sglang.errors import PoolError


@dataclass(slots=True)
class PrefixMatch:
    """A matched radix prefix: per group the dense page list of the node chain and its length.

    Build the dense list by laying each node's ``SegmentPages.pages[g]`` at its
    ``first_page_index[g]`` (a node's first page may replace its parent's copied tail page).
    Every page must be held by someone (a radix node); admitting a row adds one holder.
    """

    pages: list[np.ndarray]  # per group: int page ids, ceil(lens[g] / page_size) of them
    lens: np.ndarray  # int64 [G]: kept tokens per group (tokens)


def validate_prefix(
    prefix: PrefixMatch | None,
    num_head_groups: int,
    page_size: int,
    ref_count: np.ndarray,
    rid: str,
    row: int,
) -> tuple[np.ndarray, list[np.ndarray]]:
    """Check a prefix against the pool; returns (lens int64 ``[G]``, per-group int64 page ids).

    ``None`` gives an empty prefix. ``ref_count`` is the allocator's holder count per page.

    Raises:
        PoolError: wrong group count, a length that does not match its page count, or a page
            that is free, padding or out of range; the message names request, row and group.
    """
    if prefix is None:
        return np.zeros(num_head_groups, np.int64), [np.zeros(0, np.int64)] * num_head_groups
    lens = np.asarray(prefix.lens, np.int64)
    if lens.shape != (num_head_groups,) or len(prefix.pages) != num_head_groups:
        raise PoolError(
            f"request {rid!r} (row {row}): prefix has {len(prefix.pages)} page lists / lens "
            f"shape {list(lens.shape)}; need {num_head_groups} head groups"
        )
    pages = [np.asarray(p, np.int64).ravel() for p in prefix.pages]
    sizes = np.fromiter((ids.size for ids in pages), np.int64, num_head_groups)
    want = -(-lens // page_size)
    bad = np.flatnonzero((lens < 0) | (sizes != want))
    if bad.size:
        g = int(bad[0])
        raise PoolError(
            f"request {rid!r} (row {row}), group {g}: prefix length {int(lens[g])} needs "
            f"{max(int(want[g]), 0)} pages, got {int(sizes[g])}"
        )
    if sizes.any():
        flat = np.concatenate(pages)
        in_range = (flat >= 1) & (flat < ref_count.size)
        held = np.zeros(flat.size, bool)
        held[in_range] = ref_count[flat[in_range]] >= 1
        if not held.all():
            g = int(np.searchsorted(np.cumsum(sizes), int(np.argmin(held)), side="right"))
            raise PoolError(
                f"request {rid!r} (row {row}), group {g}: prefix pages must be held pages (a "
                "radix node's), not free or padding pages"
            )
    return lens, pages
