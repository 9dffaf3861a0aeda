"""SegmentValue: what one radix node holds for Tangram, and how a node chain becomes a prefix.

A compressed segment is a pure function of its own tokens and the history before it, so a
conversation's compressed state is the chain of its segments from the root (docs/design.md §5). A
segment covering tokens ``[start_depth, end_depth)`` is stored on the tree node that ENDS at
``end_depth`` (a "boundary" node); the nodes above it down to ``start_depth`` may be plain
token nodes (SGLang splits nodes wherever two conversations diverge). Matches stop only at
boundaries: a compressed segment cannot be cut mid-way. A segment kept whole (a decode tail, a
short prompt under ``--tangram-min-compress-tokens``) can: the tree splits it where a match ends
inside it, and the split node holds its first pages too (``cache.TangramRadixCache.
_split_whole_segment``).

::

    root ──[0, 40)── A ──[40, 52)── B ──[52, 60)── C
                     plain          boundary:        boundary:
                                    extend [0, 52)   decode tail [52, 60), start_node = B

Chain of C = [value(B), value(C)]; the dense page list of a group is built by laying each
segment's pages at its ``first_page_index`` (a segment may start with a copy of its parent's
partial tail page, which then replaces that page in the list).

No sglang import (unit-testable in milliseconds); :mod:`tangram_sglang.radix.cache` owns the tree.

Source: docs/design.md §5; docs/contracts.md (dense tables, copy-on-write tail); Tangram arXiv
2606.06302 (Ragged Paging).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tangram_sglang.errors import PoolError
from tangram_sglang.mem.page_table import SegmentPages
from tangram_sglang.mem.prefix import PrefixMatch


@dataclass(slots=True)
class SegmentValue:
    """One boundary node's Tangram value: a segment's pages and where its tokens lie.

    Ownership: the node holds one reference to every page in ``segment.pages``; evicting the
    node hands them to ``TangramMemory.free_pages`` exactly once.
    """

    start_node: Any  # the boundary node (or root) the segment continues; never evicted first
    start_depth: int  # tokens from the root where the segment starts
    end_depth: int  # tokens from the root where it ends (= depth of the holding node)
    segment: SegmentPages  # per-group pages + kept lengths (the pages this node owns)
    # Of them, the first pages shallower nodes also hold (a parent's adopted copies, a split
    # node's share of a whole segment): counted there, so each page counts once.
    shared_pages: int = 0

    @property
    def num_pages(self) -> int:
        """Pages only this node holds (all groups): evicting it frees exactly these."""
        return self.segment.num_pages - self.shared_pages

    @property
    def group_lens(self) -> np.ndarray:
        """int64 ``[G]``: kept tokens per group of the whole chain up to this segment's end."""
        return np.asarray(self.segment.start_len, np.int64) + self.segment.kept_len


def is_grid_cell(kind: str, start_depth: int, end_depth: int, grid: int) -> bool:
    """Is ``[start_depth, end_depth)`` one whole cell of the segment grid (a prefill chunk)?

    Under grid segmentation (``config.segment_grid``, ``grid`` = the chunk size in tokens) only
    whole cells ``[k * grid, (k + 1) * grid)`` of compressed prompt: a cold server cuts the same
    prompt at the same absolute positions, so it computes the very same segment. The rest of a
    conversation (a prompt's last, partial chunk, a decode tail) is kept whole and cached in
    pieces inside one cell (:func:`is_cell_piece`), reused only while a prompt ends inside that
    cell (``cache.TangramRadixCache.match_prefix``).

    Args:
        kind: ``SegmentPages.kind`` ("extend" or "decode").
        start_depth: tokens from the root where the segment starts.
        end_depth: tokens from the root where it ends.
        grid: cell size in tokens (> 0).
    """
    return kind == "extend" and end_depth - start_depth == grid and start_depth % grid == 0


def is_cell_piece(seg: SegmentPages, start_depth: int, end_depth: int, grid: int) -> bool:
    """Is ``[start_depth, end_depth)`` a segment kept whole that lies inside one grid cell?

    Under the grid a segment that is not a whole cell is kept whole (every group keeps every
    token: ``mem.reservation.segment_kept_lens``; a decode tail always is). Inside one cell its
    K/V is what a cold server computes for the same tokens in the cell's partial chunk (the
    tokens before the cell compressed, the cell's own tokens uncompressed), so it can be cached
    and reused to the token while a prompt ends inside that cell. A piece reaching into the
    next cell is not: a cold server compresses the cell it fills.

    Args:
        seg: the segment's pages (``kept_len`` per group, ``num_tokens``).
        start_depth: tokens from the root where it starts.
        end_depth: tokens from the root where it ends (> ``start_depth``).
        grid: cell size in tokens (> 0).
    """
    whole = bool(np.all(np.asarray(seg.kept_len) == seg.num_tokens))
    return whole and end_depth > start_depth and start_depth // grid == (end_depth - 1) // grid


def segment_depths(prefix_len: int, segments: list[SegmentPages]) -> list[tuple[int, int]]:
    """``(start_depth, end_depth)`` in tokens of each segment of a finished row, in order.

    Args:
        prefix_len: tokens of the matched prefix the row started from.
        segments: ``TangramMemory.finish`` output (chunks, then the decode tail).
    """
    out, depth = [], int(prefix_len)
    for seg in segments:
        out.append((depth, depth + int(seg.num_tokens)))
        depth += int(seg.num_tokens)
    return out


def chain_prefix(chain: list[SegmentValue], num_head_groups: int, page_size: int) -> PrefixMatch:
    """Build the :class:`PrefixMatch` of a root-to-node chain of segments (root first).

    Args:
        chain: the segments from the root down to the matched boundary node.
        num_head_groups: G of the profile's grouping.
        page_size: tokens per page.

    Returns:
        Per group the dense page list (each segment laid at its ``first_page_index``) and the
        kept length of the chain's last segment; empty for an empty chain.

    Raises:
        PoolError: a segment's first page index past the list built so far, or a list whose
            length does not match ``ceil(kept / page_size)`` (a broken chain).
    """
    firsts = [np.asarray(v.segment.first_page_index, np.int64) for v in chain]
    counts = [v.segment.page_counts for v in chain]
    ends = [int((f + n).max(initial=0)) for f, n in zip(firsts, counts, strict=True)]
    width = max(ends, default=0)
    dense = np.zeros((num_head_groups, width), np.int64)
    length = np.zeros(num_head_groups, np.int64)  # pages of the chain so far, per group
    lens = np.zeros(num_head_groups, np.int64)
    for value, first, n in zip(chain, firsts, counts, strict=True):
        past = np.nonzero(first > length)[0]
        if past.size:
            g = int(past[0])
            raise PoolError(
                f"radix chain: segment at depth {value.start_depth} group {g} starts at page "
                f"index {int(first[g])} but the chain above holds {int(length[g])} pages"
            )
        seg = value.segment
        if seg.num_pages:
            g_of = seg.group_of_page
            dense[g_of, seg.index_in_group + first[g_of]] = seg.flat
        length = first + n  # a segment replaces everything from its first page on
        lens = value.group_lens
    want = -(-lens // page_size)
    broken = np.nonzero(length != want)[0]
    if broken.size:
        g = int(broken[0])
        raise PoolError(
            f"radix chain: group {g} holds {int(length[g])} pages for {int(lens[g])} kept "
            f"tokens (page_size {page_size}); the chain is broken"
        )
    # views of the fresh dense array (no other holder)
    return PrefixMatch(
        pages=[row[:n] for row, n in zip(dense, length.tolist(), strict=True)], lens=lens
    )
