"""TangramRadixCache: SGLang's radix tree whose boundary nodes own compressed segments' pages.

SGLang's Python :class:`~sglang.srt.mem_cache.radix_cache.RadixCache` keeps doing what it does
for the scheduler: token keys, logical token-slot values (``req_to_token`` ids), lock counts,
``evictable_size`` / ``protected_size`` and LRU leaf eviction, so SGLang's own accounting and its
idle self-check stay exact. On top, each node where a finished request's segment ends holds a
:class:`~tangram_sglang.radix.segment.SegmentValue` (the segment's per-group pages):

* ``match_prefix`` stops at the deepest boundary node on the matched path (whole segments only),
  so ``prefix_indices`` / ``extend_prefix_lens`` / ``cached_tokens`` are exactly the reused
  tokens and the next turn extends from them without recomputation;
* ``cache_finished_req`` takes the row's pages (``TangramMemory.finish``) BEFORE SGLang frees the
  row (the ``ReqToTokenPool.free`` hook then finds an empty row), inserts the tokens, and puts
  each segment on the node ending at its last token (a duplicate's pages are freed at once).
  Inside :meth:`deferred_finishes` (the scheduler's whole result step) it only records the
  request; the records are inserted in order when the step ends (:meth:`flush_finishes`), so
  a decode step's finished answers leave before the tree work, which then overlaps the
  client's next turn on its way in;
* ``cache_unfinished_req`` (chunked prefill) does not insert the chunk (as SGLang's
  ``ChunkCache``): a row's chunks go to the tree together at finish; under the segment grid
  the row's whole cells are inserted while it runs (``_insert_in_flight``);
* evicting a node (SGLang's token eviction, :meth:`evict_pages`, ``reset`` on ``/flush_cache``)
  frees its pages exactly once through ``TangramMemory.free_pages``.

The backend asks :meth:`prefix_for` for a new row's :class:`~tangram_sglang.mem.prefix.
PrefixMatch`: from the matched node when the caller has it (``req.last_node``: no device
read), else from the row's last prefix token slot (a fallback the server never takes: it reads
the boundary nodes' last slots from the device on demand). Inserting, evicting and
``/flush_cache`` never read the device.

Why a ``RadixCache`` subclass and not a ``FullComponent`` override of ``UnifiedRadixCache``: the
0.5.17 unified tree needs ``SGLANG_ENABLE_UNIFIED_RADIX_TREE`` or a hybrid model to be chosen by
the default factory, and its component hooks split node values per component; a registered
factory (``register_radix_cache_backend("tangram")``) returning this subclass is the smallest
seam that works on the pinned version.

Source: docs/design.md §5; SGLang 0.5.17 ``radix_cache.py`` / ``chunk_cache.py`` / ``registry.py``.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams, MatchResult
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey, TreeNode

from tangram_sglang.errors import PoolError
from tangram_sglang.mem.page_table import SegmentPages
from tangram_sglang.mem.prefix import PrefixMatch
from tangram_sglang.radix.segment import (
    SegmentValue,
    chain_prefix,
    is_cell_piece,
    is_grid_cell,
    segment_depths,
)

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

logger = logging.getLogger(__name__)

VALUE_ATTR = "tangram_value"  # TreeNode attribute holding a boundary node's SegmentValue
SLOT_ATTR = "tangram_slot"  # TreeNode attribute: a boundary node's last token slot (host int,
# read on demand by TangramRadixCache._node_of_slot)


def value_of(node: TreeNode) -> SegmentValue | None:
    """The node's segment value (boundary node), or None (plain token node, root)."""
    return getattr(node, VALUE_ATTR, None)


def same_segment(
    cached: SegmentValue, parent: TreeNode, start_depth: int, seg: SegmentPages
) -> bool:
    """Is ``cached`` the very segment a row computed as ``seg`` over ``[start_depth, ...)``?

    A compressed segment is a function of its own tokens and the chain before it, so the
    cached node holds the row's segment only when it continues the same chain node (which, by
    induction from the root, means the same chunking of every earlier segment), starts at the
    same depth and kept the same tokens per group. Kept lengths alone are not enough: two
    chunkings of one prompt (say 4 + 8 and 8 + 4 tokens) can end with equal per-group lengths
    but different kept tokens (docs/design.md §5).
    """
    return (
        cached.start_node is parent
        and cached.start_depth == start_depth
        and np.array_equal(cached.group_lens, seg.start_len + seg.kept_len)
    )


def node_depth(node: TreeNode) -> int:
    """Tokens from the root to the end of ``node``."""
    depth = 0
    while node.parent is not None:
        depth += len(node.key)
        node = node.parent
    return depth


@dataclass(slots=True)
class PendingFinish:
    """A finished request's insert, recorded by ``cache_finished_req`` inside
    :meth:`TangramRadixCache.deferred_finishes` and done by ``flush_finishes``.

    Holds what the insert reads from the request and its row, taken when it finished: SGLang
    frees the request's row right after (``ReqToTokenPool.free``), and the row's memory-manager
    entries stay until the flush (``TangramState.hold_for_finish``).
    """

    row: int  # the finished request's req_pool_idx
    start_len: int  # tokens of that prefix (SGLang's cache_protected_len)
    # the tokens whose KV the row holds: req.origin_input_ids + req.output_ids, cut to the
    # committed length (SGLang's key type: a list or array('q') of ints)
    token_ids: Any
    # int64 [len(token_ids)] on req_to_token's device: the row's token slots (a copy)
    kv_indices: torch.Tensor
    extra_key: Any  # SGLang's RadixKey extra key (e.g. LoRA id)
    priority: int  # SGLang's request priority (the tree's eviction order under priority)
    # the boundary node its prefix ended at, locked by SGLang at admission (unlocked at the
    # flush); None: the prefix is empty (the chain starts at the root)
    last_node: TreeNode | None


class TangramRadixCache(RadixCache):
    """Radix tree over logical token slots whose boundary nodes own segments' pages.

    Args:
        params: SGLang's cache parameters; ``params.req_to_token_pool.tangram_state`` must be
            the server's :class:`~tangram_sglang.backend.state.TangramState` (set by the
            attention backend, which the model runner builds before the scheduler's tree).

    Raises:
        PoolError: no Tangram state on the request pool (server not started with --tangram).
    """

    def __init__(self, params: CacheInitParams) -> None:
        self._boundaries: dict[int, TreeNode] = {}  # id(node) -> boundary node (holds a segment)
        self.num_evicted_pages = 0  # pages freed by evicting nodes since start-up
        self.num_duplicate_pages = 0  # pages of segments already cached, freed at insert
        self.num_adopted_pages = 0  # copy-on-write copies a parent chain took (duplicates saved)
        self._unlocked_pages = 0  # pages on boundary nodes with lock_ref == 0 (evictable)
        self.num_off_grid_pages = 0  # pages of segments off the segment grid, freed at insert
        self.num_in_flight_inserts = 0  # chunked prefills whose grid cells were inserted mid-way
        self.held_pages = 0  # pages the boundary nodes hold, each page once (kept up to date)
        self.num_split_segments = 0  # whole segments split where a match ended inside them
        # Finished requests recorded inside deferred_finishes, not yet inserted (in order).
        self._pending: list[PendingFinish] = []
        self._defer_depth = 0  # open deferred_finishes scopes
        self.num_deferred_finishes = 0  # recorded finished requests inserted since start-up
        super().__init__(params)
        state = getattr(params.req_to_token_pool, "tangram_state", None)
        if state is None:
            raise PoolError(
                "radix cache backend 'tangram' needs the Tangram KV pool and attention backend; "
                "start the server with --tangram"
            )
        self.state = state
        self.memory = state.memory
        # Tokens per grid cell (TANGRAM_GRID_SEGMENTS=1): whole cells, then a tail kept whole
        # inside one cell, are cached (_on_grid, _grid_match_node); 0 = off (config.segment_grid).
        self.grid = int(getattr(state, "segment_grid", 0))
        state.radix = self

    # ---- matching ----------------------------------------------------------------------------
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        """SGLang's match, ending on a boundary node.

        A match that ends inside a segment kept whole (every group kept every token: a short
        turn, a system prompt under ``--tangram-min-compress-tokens``, a decode tail) ends
        there: the segment is split at that token (:meth:`_split_whole_segment`), as SGLang's
        tree splits a node, so a conversation that shares only part of it reuses that part.
        Otherwise the match is cut back to the deepest boundary node (a compressed segment is
        reused whole or not at all).

        Under the segment grid (C tokens a cell) the tree holds whole cells and, after the last
        one, pieces kept whole inside a cell (``segment.is_cell_piece``). A match ending in such
        pieces is kept while the request's prompt ends inside the cell they start
        (its new tokens are then one partial chunk, kept whole, as a cold server keeps them);
        when the prompt fills that cell, the match is cut back to the cell's start, so the cell
        is prefilled and compressed whole, as a cold server compresses it
        (:meth:`_grid_match_node`).
        """
        self.flush_finishes()
        result = super().match_prefix(params)
        node = result.last_device_node
        prompt_len = self._prompt_len(params)
        if node is not self.root_node and value_of(node) is None:
            depth = node_depth(node)
            if not self.grid or prompt_len < (depth // self.grid + 1) * self.grid:
                self._split_whole_segment(node)
        while node is not self.root_node and value_of(node) is None:
            node = node.parent
        if self.grid:
            node = self._grid_match_node(node, prompt_len)
        if node is result.last_device_node:
            return result
        depth = node_depth(node)
        return result._replace(
            device_indices=result.device_indices[:depth],
            last_device_node=node,
            last_host_node=node,
            best_match_node=node,
        )

    @staticmethod
    def _prompt_len(params: MatchPrefixParams) -> int:
        """Tokens of the matching request's prompt (input + output so far; SGLang's fill ids).

        SGLang's key is the whole fill with a ``limit`` one token short (the last token is
        always prefilled); without the request the key's token array is taken as the prompt.
        """
        req = params.req
        if req is not None:
            return len(req.origin_input_ids) + len(req.output_ids)
        return len(params.key.token_ids)

    def _grid_match_node(self, node: TreeNode, prompt_len: int) -> TreeNode:
        """Under the grid: the boundary ``node`` itself, or the cell start to cut back to.

        From ``node`` the chain is walked up through its cell pieces to the deepest node that
        ends a whole cell (or the root) at depth ``g``. The pieces ``[g, depth)`` hold their
        tokens whole, as a cold server holds a partial last chunk starting at ``g``; that holds
        only while the prompt ends before ``g + C``. A prompt reaching ``g + C`` makes a cold
        server compress the cell ``[g, g + C)``, so the match is cut back to ``g``.
        """
        cell_end = node
        while cell_end is not self.root_node:
            value = value_of(cell_end)
            if is_grid_cell(value.segment.kind, value.start_depth, value.end_depth, self.grid):
                break
            cell_end = value.start_node
        if cell_end is node or prompt_len < node_depth(cell_end) + self.grid:
            return node
        return cell_end

    def _split_whole_segment(self, node: TreeNode, max_candidates: int = 8) -> bool:
        """Make the plain ``node`` a boundary holding the first tokens of a whole segment.

        The first boundary below ``node`` (on any of up to ``max_candidates`` paths) whose
        segment ``[lo, hi)`` contains ``node``'s depth ``d`` and keeps every token in every
        group: the tokens ``[lo, d)`` of that segment are a segment of their own on the same
        chain (the KV of a token kept whole depends on the tokens before it only), so ``node``
        gets a :class:`SegmentValue` over ``[lo, d)`` whose pages are the first pages of the
        segment's (a reference each, ``TangramMemory.share_pages``; no page is copied). Pages
        are counted once: a page held by several nodes counts on the shallowest, so the longer
        segment's ``shared_pages`` becomes the split's page count and the split takes over the
        longer segment's own shared count (pages its chain's ancestors adopted).

        Returns:
            True when ``node`` now holds a segment.
        """
        depth = node_depth(node)
        below, stack = None, list(node.children.values())
        while stack and max_candidates > 0:
            child = stack.pop()
            value = value_of(child)
            if value is None:
                stack.extend(child.children.values())
                continue
            max_candidates -= 1
            seg = value.segment
            if value.start_depth < depth and np.all(seg.kept_len == seg.num_tokens):
                below = child
                break
        if below is None:
            return False
        value = value_of(below)
        seg, ps = value.segment, self.memory.page_size
        kept = depth - value.start_depth
        start_len = np.asarray(seg.start_len, np.int64)
        counts = -(-(start_len + kept) // ps) - np.asarray(seg.first_page_index, np.int64)
        pages = [ids[: int(n)].copy() for ids, n in zip(seg.pages, counts, strict=True)]
        head = SegmentPages(
            seg.kind,
            kept,
            start_len.copy(),
            np.full(len(pages), kept, np.int64),
            np.asarray(seg.first_page_index, np.int64).copy(),
            pages,
        )
        self.memory.share_pages(np.concatenate(pages), "radix node (split of a whole segment)")
        split = SegmentValue(value.start_node, value.start_depth, depth, head, value.shared_pages)
        moved = head.num_pages - value.shared_pages  # pages now counted on the split, not below
        value.shared_pages = head.num_pages
        setattr(node, VALUE_ATTR, split)
        if node.lock_ref == 0:
            self._unlocked_pages += split.num_pages
        if below.lock_ref == 0:
            self._unlocked_pages -= moved
        self._boundaries[id(node)] = node
        self.num_split_segments += 1
        return True

    def _node_of_slot(self, slot: int) -> TreeNode | None:
        """The boundary node whose last token holds KV slot ``slot`` (None if none).

        The fallback of :meth:`prefix_for` when the caller has no node: the boundary nodes'
        last slots are read to the host once (one device-to-host copy for the nodes not read
        before) and kept on the nodes; O(boundary nodes).
        """
        unread = [n for n in self._boundaries.values() if getattr(n, SLOT_ATTR, None) is None]
        if unread:
            slots = torch.stack([n.value[-1] for n in unread]).tolist()
            for node, value in zip(unread, slots, strict=True):
                setattr(node, SLOT_ATTR, int(value))
        return next((n for n in self._boundaries.values() if getattr(n, SLOT_ATTR) == slot), None)

    def prefix_for(self, row: int, prefix_len: int, node: TreeNode | None = None) -> PrefixMatch:
        """The compressed prefix of a new row whose first ``prefix_len`` tokens were matched.

        Called before the row's first extend; the matched node is locked by SGLang
        (``inc_lock_ref``) from admission to ``cache_finished_req``.

        Args:
            row: the row's ``req_pool_idx``.
            prefix_len: matched tokens (``len(req.prefix_indices)``).
            node: the matched boundary node (``req.last_node``, handed over on the host by the
                ``ForwardBatch.init_new`` hook) when the caller has it: no device read. Without
                it (or when it holds no segment) the node is found from the row's last prefix
                token slot in ``req_to_token`` (two device-to-host reads at most: that slot,
                and the last slots of boundary nodes not read before; O(boundary nodes)).

        Raises:
            PoolError: the prefix ends at no boundary node of the tree.
        """
        if node is None or value_of(node) is None:
            node = self._node_of_slot(int(self.req_to_token_pool.req_to_token[row, prefix_len - 1]))
        if node is None or value_of(node).end_depth != prefix_len:
            raise PoolError(
                f"radix: row {row} starts from a {prefix_len}-token prefix that ends at no "
                "compressed segment of the tree (prefix must come from TangramRadixCache)"
            )
        chain = []
        while node is not self.root_node:
            value = value_of(node)
            chain.append(value)
            node = value.start_node
        chain.reverse()
        return chain_prefix(chain, self.memory.num_head_groups, self.memory.page_size)

    # ---- insertion ---------------------------------------------------------------------------
    def cache_finished_req(self, req: Req, is_insert: bool = True, *, kv_len_to_handle: int):
        """Take the row's segments, insert its tokens, hang each segment on its end node.

        Ownership: the row's own pages pass to the boundary nodes (duplicates are freed now);
        with ``is_insert=False`` (abort, retraction) the row's pages are freed instead. Inside
        :meth:`deferred_finishes` an insert is recorded (:class:`PendingFinish`) and done,
        in order, by :meth:`flush_finishes`; until then the row keeps its pages.
        """
        row = req.req_pool_idx
        start = req.last_node if req.last_node is not None else self.root_node
        start_len = int(req.cache_protected_len)
        if (
            self.disable_finished_insert
            or not is_insert
            or self.memory.rids[row] is None
            or node_depth(start) != start_len
        ):
            self.flush_finishes()  # earlier finishes first, in the order SGLang gave them
            self.state.release(row)
            return super().cache_finished_req(req, False, kv_len_to_handle=kv_len_to_handle)
        token_ids = (req.origin_input_ids + req.output_ids)[:kv_len_to_handle]
        kv_indices = self.req_to_token_pool.req_to_token[row, : len(token_ids)]
        finish = PendingFinish(
            row,
            start_len,
            token_ids,
            kv_indices.to(torch.int64, copy=True),
            req.extra_key,
            getattr(req, "priority", 0) or 0,
            req.last_node,
        )
        if self._defer_depth:
            self.state.hold_for_finish(row)
            self._pending.append(finish)
            return
        self.flush_finishes()  # records left by a failed flush go in first, in order
        self._finish(finish)

    @contextlib.contextmanager
    def deferred_finishes(self) -> Iterator[None]:
        """A scope whose finished requests are inserted when it closes, in order.

        The scheduler runs each result step (``Scheduler.process_batch_result``: the finished
        requests' release, then ``stream_output``) inside one, so a decode step's answers
        leave before the tree work. Anything that needs the tree or the pool current first
        inserts the records: ``match_prefix``, eviction (``evict``, ``evict_pages``), a new
        row (``ReqToTokenPool.alloc``'s hook), an abort or retraction, ``cache_unfinished_req``
        under the segment grid, ``reset`` and ``stats``. Counts read inside the step without
        that (``evictable_pages``, ``held_pages``, the pool snapshot of a log line inside
        the step) count a recorded row as the row's own pages, not the tree's, and SGLang's
        KV events of the inserts go out with the next step's.

        Nested scopes insert when the outermost closes. When the step raises, the records are
        still inserted; an error there is logged and the step's own error propagates.
        """
        self._defer_depth += 1
        try:
            yield
        except BaseException:
            self._defer_depth -= 1
            if not self._defer_depth:
                try:
                    self.flush_finishes()
                except Exception:
                    logger.exception("Tangram: finished requests not inserted after a failed step")
            raise
        self._defer_depth -= 1
        if not self._defer_depth:
            self.flush_finishes()

    def flush_finishes(self) -> int:
        """Insert every recorded finished request, in the order they finished.

        Returns:
            How many were inserted.

        Raises:
            PoolError: a record's row no longer holds its request. The records after the
                failing one stay recorded (the next flush takes them first); the failing
                one is dropped. Like any error in SGLang's result step, this ends the
                scheduler.
        """
        done = 0
        while self._pending:
            finish = self._pending.pop(0)
            self._finish(finish)
            self.num_deferred_finishes += 1
            done += 1
        return done

    def _finish(self, finish: PendingFinish) -> None:
        """One finished request's insert (see :meth:`cache_finished_req`).

        Raises:
            PoolError: the row holds no request (``TangramState.finish_row``).
        """
        segments = self.state.finish_row(finish.row)
        key = RadixKey(finish.token_ids, finish.extra_key)
        result = self.insert(
            InsertParams(key=key, value=finish.kv_indices, priority=finish.priority)
        )
        self.token_to_kv_pool_allocator.free_segment(
            finish.kv_indices[finish.start_len : result.prefix_len], start_pos=finish.start_len
        )
        start = self.root_node if finish.last_node is None else finish.last_node
        self._attach(key, start, finish.start_len, segments)
        if finish.last_node is not None:
            self.dec_lock_ref(finish.last_node)

    def _attach(
        self, key: RadixKey, start: TreeNode, start_len: int, segments: list[SegmentPages]
    ) -> None:
        """Put each segment on the node ending at its last token; free what cannot be kept.

        Host work only: no device read (a finished request's insert runs while the next batch
        is in flight under overlap scheduling; a read would wait for that batch).
        """
        # A chain continues a boundary node (or the root); a row whose in-flight insert ended on
        # a plain node (a cell another chain held) cannot hang anything after it.
        chained = start is self.root_node or value_of(start) is not None
        parent, attached = (start if chained else None), []
        for (lo, hi), seg in zip(segment_depths(start_len, segments), segments, strict=True):
            off_grid = self.grid > 0 and not self._on_grid(parent, seg, lo, hi)
            if parent is None or seg.num_tokens <= 0 or hi > len(key) or off_grid:
                self._free(seg.pages)
                self.num_off_grid_pages += seg.num_pages if off_grid else 0
                parent = None  # a chain cannot skip a segment
                continue
            node = self._node_at(key, hi, parent, lo)  # parent ends at lo
            cached = value_of(node)
            if cached is not None:
                self._free(seg.pages)  # a segment ending here is already cached: keep that one
                self.num_duplicate_pages += seg.num_pages
                if not same_segment(cached, parent, lo, seg):
                    # Another chain (other chunking) ends here: the row's later segments were
                    # compressed on its own history, not the cached node's; they cannot hang
                    # here (equal kept lengths are not enough: the content differs).
                    parent = None
                    continue
            else:
                value = SegmentValue(parent, lo, hi, seg)
                setattr(node, VALUE_ATTR, value)
                self.held_pages += value.num_pages
                if node.lock_ref == 0:
                    self._unlocked_pages += value.num_pages
                attached.append(node)
            parent = node
        if attached and attached[0] is not None and value_of(attached[0]).start_node is start:
            self._adopt_copies(start, attached[0])
        for node in attached:
            self._boundaries[id(node)] = node

    def _on_grid(self, parent: TreeNode | None, seg: SegmentPages, lo: int, hi: int) -> bool:
        """Under the grid: may the row's segment ``[lo, hi)`` hang after ``parent``?

        A cold server computes whole cells on whole cells, then pieces kept whole inside the
        one cell that follows. So a whole cell is cached only after the root or a cell; a piece
        kept whole inside one cell (``segment.is_cell_piece``) only after the root, a cell or
        a piece of the same cell. Anything else (a segment reaching into the next cell, a cell
        computed on pieces after a row left the grid, a piece of a later cell) is not what a
        cold server computes and is freed (``pages_off_grid_freed``). A ``parent`` of None
        (the chain is already cut) accepts any segment here; the caller frees it anyway.
        """
        grid = self.grid
        after = None if parent is None or parent is self.root_node else value_of(parent)
        after_cell = after is None or is_grid_cell(
            after.segment.kind, after.start_depth, after.end_depth, grid
        )
        if is_grid_cell(seg.kind, lo, hi, grid):
            return after_cell
        if seg.num_tokens <= 0 or not is_cell_piece(seg, lo, hi, grid):
            return False
        return after_cell or after.start_depth // grid == lo // grid

    def _adopt_copies(self, parent: TreeNode, child: TreeNode) -> None:
        """The parent chain adopts the child's copies of its partial tail pages.

        A row that continues a chain whose last page in group g is partial copies that page
        (copy-on-write) and appends after the copied tokens. Once the row's first segment hangs
        on ``child``, the copy holds the chain's tokens (slots ``[0, f)``, identical) plus the
        child's. If no one but the chain's owning node holds the original, that node takes the
        copy instead (its readers read only ``[0, f)``) and the original is freed: a turn
        boundary then costs no duplicate page per group. The copy is then held by both nodes
        and counted on the parent (``SegmentValue.shared_pages`` on the child), so eviction
        counts stay exact; the child is a leaf below the parent, so it is evicted first.
        """
        parent_value = value_of(parent)
        if parent_value is None:
            return
        ps, seg = self.memory.page_size, value_of(child).segment
        plens = parent_value.group_lens
        n_pages = -(-plens // ps)
        cow = (plens % ps != 0) & (seg.first_page_index == n_pages - 1) & (seg.page_counts > 0)
        # The owner of group g's tail page: the deepest chain node listing a page for g.
        # Walk order, then groups ascending: the order of the shares and frees below.
        owners: list[tuple[SegmentValue, np.ndarray]] = []
        node = parent
        while cow.any() and node is not self.root_node:
            value = value_of(node)
            hit = cow & (value.segment.page_counts > 0)
            if hit.any():
                owners.append((value, np.flatnonzero(hit)))
                cow &= ~hit
            node = value.start_node
        if not owners:
            return
        # Flat positions (SegmentPages.flat) of each owner's tail pages and of the child's
        # first pages of the same groups; pages[g] are views of flat, so writing flat there
        # replaces pages[g][-1].
        tails = [np.cumsum(v.segment.page_counts)[gs] - 1 for v, gs in owners]
        olds = np.concatenate([v.segment.flat[t] for (v, _), t in zip(owners, tails, strict=True)])
        heads = np.cumsum(seg.page_counts) - seg.page_counts
        news = seg.flat[heads[np.concatenate([gs for _, gs in owners])]]
        counts = self.memory.allocator.ref_count.numpy()
        alone = (counts[olds] == 1) & (self.memory.row_refs[olds] == 0)  # only its node holds it
        num_swaps = int(np.count_nonzero(alone))
        if not num_swaps:
            return
        self.memory.share_pages(news[alone], "radix node (adopted copy)")
        self.memory.free_pages(olds[alone], "radix node (copied)")
        lo = 0
        for (value, _), tail in zip(owners, tails, strict=True):
            ok = alone[lo : lo + tail.size]
            value.segment.flat[tail[ok]] = news[lo : lo + tail.size][ok]
            lo += tail.size
        value_of(child).shared_pages += num_swaps
        self.held_pages -= num_swaps
        if child.lock_ref == 0:
            self._unlocked_pages -= num_swaps
        self.num_adopted_pages += num_swaps

    def _node_at(
        self, key: RadixKey, depth: int, start: TreeNode | None = None, start_depth: int = 0
    ) -> TreeNode:
        """The node ending exactly at ``depth`` on ``key``'s path (split if needed).

        Args:
            key: the inserted tokens (every token of ``key[:depth]`` is in the tree).
            depth: tokens from the root where the node ends.
            start: a node of ``key``'s path ending at ``start_depth`` (tokens) to walk down
                from, instead of the root: O(nodes between them), not O(depth).
            start_depth: where ``start`` ends (tokens; 0 with the root).
        """
        if start is None:
            start, start_depth = self.root_node, 0
        _, node = self._match_prefix_helper(start, key[start_depth:depth])
        assert node_depth(node) == depth, "inserted tokens must all be in the tree"
        return node

    def cache_unfinished_req(self, req: Req, chunked: bool = False) -> None:
        """Chunked prefill: insert the row's whole grid cells now (grid), else keep the chunk.

        Without the grid the chunk stays in the row (no insert, like SGLang's ``ChunkCache``):
        a row's chunks go to the tree together at finish. Under the grid
        (``TANGRAM_GRID_SEGMENTS=1``) the cells prefilled so far are inserted while the row
        runs on (:meth:`_insert_in_flight`), so requests that arrive while a long shared prefix
        is being prefilled match its cells instead of prefilling their own copy.
        """
        if self.grid:
            self.flush_finishes()  # _insert_in_flight changes the tree
            if self._insert_in_flight(req, chunked):
                return
        kv = self.req_to_token_pool.req_to_token[req.req_pool_idx, : req.extend_range.end]
        req.prefix_indices = kv.to(dtype=torch.int64, copy=True)

    def _insert_in_flight(self, req: Req, chunked: bool) -> bool:
        """Hang a running row's committed grid cells on the tree; False when it cannot now.

        The row's own pages pass to the new boundary nodes (``TangramMemory.detach_segments``:
        the row keeps reading them as borrowed), its tokens are inserted and SGLang's lock moves
        to the node ending at the prefilled tokens, exactly as SGLang's
        ``RadixCache.cache_unfinished_req`` does (duplicate token slots freed, the row's slot
        list rewritten to the tree's). Pages: the row's partial last pages become shared, so
        its next chunk copies them (one copy-on-write page per such head group); those pages
        are reserved first, and when they are not free the chunk simply stays in the row.
        """
        row, end = int(req.req_pool_idx), int(req.extend_range.end)
        start = req.last_node if req.last_node is not None else self.root_node
        start_len = int(req.cache_protected_len)
        memory = self.memory
        if (
            self.disable
            or memory.rids[row] is None
            or end % self.grid
            or end <= start_len
            or node_depth(start) != start_len
            or (start is not self.root_node and value_of(start) is None)
            or not memory.ready[row]
        ):
            return False
        lens = memory.table.lens[row]
        cow_pages = int(np.count_nonzero(lens % memory.page_size))
        if cow_pages and memory.ledger.reserve(row, memory.rids[row], cow_pages) is None:
            return False
        segments = memory.detach_segments(row)
        token_ids = (req.origin_input_ids + req.output_ids)[:end]
        kv_indices = self.req_to_token_pool.req_to_token[row, :end]
        key = RadixKey(token_ids, req.extra_key)
        priority = getattr(req, "priority", 0) or 0
        result = self.insert(
            InsertParams(
                key=key,
                value=kv_indices.to(torch.int64, copy=True),
                chunked=chunked,
                priority=priority,
            )
        )
        self.token_to_kv_pool_allocator.free_segment(
            kv_indices[start_len : result.prefix_len], start_pos=start_len
        )
        self._attach(key, start, start_len, segments)
        match = super().match_prefix(MatchPrefixParams(key=key))
        new_indices, node = match.device_indices, match.last_device_node
        assert len(new_indices) == end, "inserted tokens must all be in the tree"
        self.req_to_token_pool.write((row, slice(start_len, end)), new_indices[start_len:])
        req.cache_protected_len = end
        self.dec_lock_ref(start)
        self.inc_lock_ref(node)
        req.prefix_indices = new_indices.to(dtype=torch.int64, copy=True)
        req.last_node = node
        self.num_in_flight_inserts += 1
        return True

    # ---- eviction ----------------------------------------------------------------------------
    def _delete_leaf(self, node: TreeNode) -> None:
        """SGLang's leaf removal, plus: free the node's pages (exactly once)."""
        value = value_of(node)
        if value is not None:
            self._boundaries.pop(id(node), None)
            setattr(node, VALUE_ATTR, None)
            if node.lock_ref == 0:
                self._unlocked_pages -= value.num_pages
            self._free(value.segment.pages)
            self.held_pages -= value.num_pages
            self.num_evicted_pages += value.num_pages
        super()._delete_leaf(node)

    def evict_pages(self, num_pages: int) -> int:
        """Evict unlocked leaves, least recently used first, until ``num_pages`` pages are free.

        Token slots of the evicted nodes go back to SGLang's allocator too (its accounting
        stays exact). Returns pages freed (may be fewer when little is evictable).
        """
        self.flush_finishes()
        heap = [(self.eviction_strategy.get_priority(n), n) for n in self.evictable_leaves]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, node = heapq.heappop(heap)
            value = value_of(node)
            freed += 0 if value is None else value.num_pages
            self.token_to_kv_pool_allocator.free_segment(node.value, start_pos=0)
            self._delete_leaf(node)
            parent = node.parent
            if not parent.children and parent.lock_ref == 0 and parent is not self.root_node:
                heapq.heappush(heap, (self.eviction_strategy.get_priority(parent), parent))
            self._record_remove_event(node)
        return freed

    def evict(self, params: Any) -> Any:
        """SGLang's token eviction, after the recorded finishes are inserted."""
        self.flush_finishes()
        return super().evict(params)

    def inc_lock_ref(self, node: TreeNode) -> Any:
        """SGLang's lock of ``node``'s path; its boundary pages stop counting as evictable."""
        self._unlocked_pages -= self._path_pages(node, lock_ref=0)
        return super().inc_lock_ref(node)

    def dec_lock_ref(self, node: TreeNode, params: Any = None) -> Any:
        """SGLang's unlock of ``node``'s path; boundary pages whose last lock goes count again."""
        self._unlocked_pages += self._path_pages(node, lock_ref=1)
        return super().dec_lock_ref(node, params)

    def _path_pages(self, node: TreeNode | None, lock_ref: int) -> int:
        """Pages of the boundary nodes from ``node`` up to the root whose lock count is
        ``lock_ref`` (O(path length))."""
        if self.disable:
            return 0
        pages = 0
        while node is not None and node is not self.root_node:
            value = value_of(node)
            if value is not None and node.lock_ref == lock_ref:
                pages += value.num_pages
            node = node.parent
        return pages

    def evictable_pages(self, exclude: TreeNode | None = None) -> int:
        """Pages on unlocked boundary nodes (all evictable), minus those on ``exclude``'s path.

        A node with ``lock_ref == 0`` has no locked descendant, so its whole subtree can go.
        O(length of ``exclude``'s path): the unlocked total is kept up to date by the lock,
        attach and delete paths (admission asks this once per waiting request per round).
        """
        return self._unlocked_pages - self._path_pages(exclude, lock_ref=0)

    def evictable_pages_scan(self, exclude: TreeNode | None = None) -> int:
        """:meth:`evictable_pages` by a scan of every boundary node (O(tree); tests' oracle)."""
        keep = set()
        while exclude is not None:
            keep.add(id(exclude))
            exclude = exclude.parent
        return sum(
            value_of(n).num_pages
            for n in self._boundaries.values()
            if n.lock_ref == 0 and id(n) not in keep
        )

    def path_pages(self, node: TreeNode | None) -> int:
        """Pages on the boundary nodes from ``node`` up to the root (what a match on it pins).

        These are exactly the pages :meth:`evictable_pages` leaves out for ``exclude=node``: on an
        idle tree, free + evictable(exclude=node) + path_pages(node) = the whole pool.
        """
        total = 0
        while node is not None:
            value = value_of(node)
            total += 0 if value is None else value.num_pages
            node = node.parent
        return total

    def reset(self) -> None:
        """``/flush_cache`` (and start-up): free every node's pages, then SGLang's reset."""
        self.flush_finishes()  # _pending is set before RadixCache.__init__, which calls reset
        for node in list(getattr(self, "_boundaries", {}).values()):
            value = value_of(node)
            setattr(node, VALUE_ATTR, None)
            if value is not None:
                self._free(value.segment.pages)
        if hasattr(self, "_boundaries"):
            self._boundaries.clear()
        self._unlocked_pages = 0
        self.held_pages = 0
        super().reset()

    # ---- reports -----------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Pages and nodes the tree holds (plain builtins, for ``/server_info``; O(segments))."""
        self.flush_finishes()
        return {
            "segments": len(self._boundaries),
            "pages_held": self.held_pages,
            "pages_evictable": self.evictable_pages(),
            "tokens_evictable": int(self.evictable_size_),
            "tokens_protected": int(self.protected_size_),
            "pages_evicted": self.num_evicted_pages,
            "pages_duplicate_freed": self.num_duplicate_pages,
            "pages_copy_adopted": self.num_adopted_pages,
            "segment_grid": self.grid,
            "pages_off_grid_freed": self.num_off_grid_pages,
            # segments that are whole grid cells (the others are whole pieces inside one cell)
            "grid_cells": sum(
                is_grid_cell(v.segment.kind, v.start_depth, v.end_depth, self.grid)
                for v in map(value_of, self._boundaries.values())
            )
            if self.grid
            else 0,
            "in_flight_inserts": self.num_in_flight_inserts,
            "whole_segments_split": self.num_split_segments,
            "deferred_finishes": self.num_deferred_finishes,
        }

    def _free(self, pages: list[Any]) -> None:
        ids = [torch.as_tensor(p, dtype=torch.int64) for p in pages if len(p)]
        if ids:
            self.memory.free_pages(torch.cat(ids), "radix node")
