"""The page pool's free list and per-page reference counts.

Owns: which page ids are free, how many holders each used page has, and the debug self-check.
Leaves to others: what a page holds (:mod:`kv_pool`), which request or radix node holds it
(:mod:`page_table`, the radix tree) and how many pages a request may take (:mod:`reservation`).

Layout (like SGLang's ``PagedTokenToKVPoolAllocator``)::

    page id   0        1  2  3 ...                     num_pages - 1
              padding  <------------- usable pages ------------->
    ring       = tensor([num_pages - 1])   the free list, a FIFO ring buffer of page ids:
                 free ids are ring[(head + i) % capacity] for i in [0, num_free)
                 alloc takes from the head, free appends at the tail (head + num_free)
    ref_count  = tensor([holders per page])   0 = free; page 0 is always 0 and never free

The ring never overflows: at most ``num_pages - 1`` pages are free. Every alloc/incref/free
costs O(pages touched) (a slice or two of the ring, ``unique`` over the listed ids); only the
debug self-check (:meth:`PageAllocator.check_invariants`) is O(num_pages).

A page's reference count is the number of holders: a running request's page table, or a radix
node that took ownership of it. ``alloc`` hands out pages with count 1, ``incref`` adds a holder
(sharing), ``free`` drops one holder per listed id and returns a page to the free list only when
its last holder lets go. Pages are never copied to be shared.

``TANGRAM_DEBUG_POOL=1`` (read once, at construction) runs :meth:`PageAllocator.check_invariants`
after every alloc/incref/free, like SGLang's ``SGLANG_DEBUG_MEMORY_POOL``.

Source: SGLang 0.5.17 ``mem_cache/allocator/paged.py`` (tensor free list, batched frees);
vLLM v1 ``BlockPool`` (ref counts, null block 0); Tangram arXiv 2606.06302, Ragged Paging.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from tangram_sglang.errors import PoolError

DEBUG_ENV = "TANGRAM_DEBUG_POOL"
PADDING_PAGE = 0


def debug_pool_from_env() -> bool:
    """True when ``TANGRAM_DEBUG_POOL`` is set to a true value (1/true/yes)."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "yes")


class PageAllocator:
    """Free-page list and reference counts of one page pool.

    Runs on the scheduler, once per alloc/free; alloc/incref/free are O(pages touched) tensor
    ops whatever the pool size (:meth:`check_invariants` and :attr:`free_pages` are O(pool)).

    Args:
        num_pages: pages in the pool INCLUDING the padding page 0 (so ``num_pages - 1`` usable).
        device: where the free list and counts live (``"cpu"`` for a host-side scheduler).
        debug: run :meth:`check_invariants` after every mutation; ``None`` reads
            ``TANGRAM_DEBUG_POOL`` (once, here).

    Raises:
        PoolError: ``num_pages < 2`` (no usable page).
    """

    def __init__(
        self, num_pages: int, device: str | torch.device = "cpu", debug: bool | None = None
    ) -> None:
        if num_pages < 2:
            raise PoolError(
                f"num_pages={num_pages}: a pool needs the padding page 0 and at least one usable "
                "page; give the pool more memory or use a smaller page_size"
            )
        self.num_pages = int(num_pages)  # pages, including padding page 0
        self.device = torch.device(device)
        self.debug = debug_pool_from_env() if debug is None else bool(debug)
        self.ring = torch.arange(1, num_pages, dtype=torch.int64, device=self.device)
        self.head = 0  # ring index of the next page alloc hands out
        self._num_free = self.num_pages - 1  # pages on the ring from head on
        self.ref_count = torch.zeros(num_pages, dtype=torch.int32, device=self.device)
        # host scratch of _held_host: a position per page (4 bytes a page; values are stale
        # outside a call)
        self._position = np.zeros(num_pages if self.device.type == "cpu" else 0, np.int32)

    # ---- sizes ---------------------------------------------------------------------------
    @property
    def num_usable_pages(self) -> int:
        """Pages that can ever be handed out (``num_pages - 1``)."""
        return self.num_pages - 1

    def num_free(self) -> int:
        """Pages free now."""
        return self._num_free

    @property
    def free_pages(self) -> torch.Tensor:
        """int64 ``[num_free]``: the free list in hand-out order (a copy; O(num_free))."""
        return self._ring_read(self.head, self._num_free)

    def num_used(self) -> int:
        """Pages with at least one holder."""
        return self.num_usable_pages - self.num_free()

    # ---- mutation --------------------------------------------------------------------------
    def alloc(self, num: int) -> torch.Tensor | None:
        """Take ``num`` free pages (from the head of the free list), each with one holder.

        Returns:
            int64 tensor ``[num]`` of page ids on ``device``, or ``None`` when fewer than ``num``
            pages are free (nothing taken: "does not fit" is a value).

        Raises:
            PoolError: ``num < 0``.

        Ownership: the caller holds one reference to each returned page and must ``free`` it.
        """
        if num < 0:
            raise PoolError(f"alloc(num={num}): the page count must be >= 0")
        if num > self._num_free:
            return None
        pages = self._ring_read(self.head, num)
        self.head = (self.head + num) % self.ring.numel()
        self._num_free -= num
        self.ref_count[pages] = 1
        self._after_mutation("alloc")
        return pages

    def incref(self, pages: torch.Tensor) -> None:
        """Add one holder to each listed page (a repeated id adds one holder per occurrence).

        Raises:
            PoolError: a listed page is free, the padding page or out of range (state unchanged).
        """
        pages = self._as_ids(pages)
        if pages.numel() == 0:
            return
        self._check_held(pages, "incref", per_occurrence=False)
        self.ref_count.index_add_(0, pages, torch.ones_like(pages, dtype=torch.int32))
        self._after_mutation("incref")

    def free(self, pages: torch.Tensor, owner: str = "caller") -> int:
        """Drop one holder per listed id; pages whose last holder let go return to the free list.

        Freed pages are appended to the free-list tail in the order they are listed (free the
        tail of a page list first, as vLLM does, to keep recently used pages at the back).

        Args:
            pages: int tensor ``[n]`` of page ids; a repeated id drops one holder per occurrence.
            owner: who frees (e.g. ``"request 'r1' (row 3), group 5"``), named in errors.

        Returns:
            How many pages went back to the free list.

        Raises:
            PoolError: double free, a page with fewer holders than occurrences, the padding page
                or an id out of range. Nothing changes on error.
        """
        pages = self._as_ids(pages)
        if pages.numel() == 0:
            return 0
        distinct = self._check_held(pages, f"free by {owner}", per_occurrence=True)
        if distinct and self.ref_count.device.type == "cpu":  # numpy views: the common case
            ids, counts = pages.numpy(), self.ref_count.numpy()
            counts[ids] -= 1
            released = torch.from_numpy(ids[counts[ids] == 0])
        else:
            self.ref_count.index_add_(0, pages, torch.full_like(pages, -1, dtype=torch.int32))
            released = pages[self.ref_count[pages] == 0]
        if released.numel():
            if not distinct:
                # A page listed twice reaches zero once; keep its first occurrence, in order.
                released = released[_first_occurrences(released).sort().values]
            self._ring_write((self.head + self._num_free) % self.ring.numel(), released)
            self._num_free += int(released.numel())
        self._after_mutation("free")
        return int(released.numel())

    # ---- checks ----------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Check the whole pool; collect every violation, then raise once.

        Invariants: page 0 is never free and has no holder; counts are >= 0; the free list has
        no duplicates and holds exactly the pages with count 0; free + used = usable pages.

        Raises:
            PoolError: listing every violation found.
        """
        problems: list[str] = []
        free = self.free_pages
        counts = self.ref_count
        if (free == PADDING_PAGE).any():
            problems.append("padding page 0 is on the free list")
        if int(counts[PADDING_PAGE]) != 0:
            problems.append(f"padding page 0 has {int(counts[PADDING_PAGE])} holders")
        if ((free < 0) | (free >= self.num_pages)).any():
            problems.append("the free list holds ids outside [1, num_pages)")
            free = free[(free >= 0) & (free < self.num_pages)]
        if (counts < 0).any():
            bad = torch.nonzero(counts < 0).flatten()[:8].tolist()
            problems.append(f"negative holder counts on pages {bad}")
        on_list = torch.bincount(free, minlength=self.num_pages)
        if (on_list > 1).any():
            bad = torch.nonzero(on_list > 1).flatten()[:8].tolist()
            problems.append(f"pages {bad} are on the free list more than once")
        zero = counts == 0
        zero[PADDING_PAGE] = False
        missing = zero & (on_list == 0)
        if missing.any():
            bad = torch.nonzero(missing).flatten()[:8].tolist()
            problems.append(f"pages {bad} have no holder but are not free (leaked)")
        held_and_free = (counts > 0) & (on_list > 0)
        if held_and_free.any():
            bad = torch.nonzero(held_and_free).flatten()[:8].tolist()
            problems.append(f"pages {bad} are free but still have holders")
        if problems:
            raise PoolError("page pool invariants broken: " + "; ".join(problems))

    # ---- helpers ---------------------------------------------------------------------------
    def _as_ids(self, pages: torch.Tensor) -> torch.Tensor:
        pages = torch.as_tensor(pages, device=self.device)
        if pages.dtype not in (torch.int32, torch.int64) or pages.dim() != 1:
            raise PoolError(
                f"page ids must be a 1-D int32/int64 tensor, got dtype {pages.dtype} and shape "
                f"{list(pages.shape)}"
            )
        return pages.to(torch.int64)

    def _check_held(self, pages: torch.Tensor, what: str, per_occurrence: bool) -> bool:
        """Raise unless every listed page is held (``per_occurrence``: once per listing).

        O(n log n) in the listed ids, never O(pool): a gather of their holder counts, plus (for
        ``per_occurrence``) a sort of the ids to count repeats, in numpy on a host pool (a torch
        sort on the CPU costs ~4x numpy's for the 10^4 ids of a long request). On a host pool
        the common case (distinct, held ids) is settled first in O(n) (:meth:`_held_host`).

        Returns:
            Whether the listed ids are all distinct (``per_occurrence`` only; else True).
        """
        if self.ref_count.device.type == "cpu" and self._held_host(pages.numpy(), per_occurrence):
            return True
        out_of_range = (pages <= PADDING_PAGE) | (pages >= self.num_pages)
        if out_of_range.any():
            bad = pages[out_of_range][:8].tolist()
            raise PoolError(
                f"{what}: page ids {bad} are the padding page 0 or outside [1, "
                f"{self.num_pages}); only ids handed out by alloc may be passed"
            )
        if self.ref_count.device.type == "cpu":
            ids, counts = pages.numpy(), self.ref_count.numpy()
            if per_occurrence:
                uniq, uses = np.unique(ids, return_counts=True)
            else:
                uniq, uses = ids, np.ones(ids.size, np.int64)
            held = counts[uniq].astype(np.int64)
        else:
            if per_occurrence:
                uniq, uses = torch.unique(pages, return_counts=True)
            else:
                uniq, uses = pages, torch.ones_like(pages)
            held = self.ref_count[uniq].to(torch.int64)
        short = uses > held
        if short.any():
            detail = ", ".join(
                f"page {p} ({h} holders, listed {u}x)"
                for p, h, u in zip(
                    uniq[short][:8].tolist(),
                    held[short][:8].tolist(),
                    uses[short][:8].tolist(),
                    strict=True,
                )
            )
            raise PoolError(f"{what}: {detail}: a double free or a page this owner does not hold")
        return len(uniq) == pages.numel()

    def _held_host(self, ids: np.ndarray, per_occurrence: bool) -> bool:
        """The common case of :meth:`_check_held` on a host pool: True when the ids are in
        range, distinct (``per_occurrence`` only) and each held; False sends the caller to
        the full check, which counts repeats and names the offending pages.

        O(n) in the listed ids: a min/max, and for ``per_occurrence`` a scatter of each id's
        position into a per-page scratch array read back (a repeated id keeps only its last
        position), no sort.
        """
        if not ids.size:
            return True
        if ids.min() <= PADDING_PAGE or ids.max() >= self.num_pages:
            return False
        if per_occurrence and ids.size > 1:
            order = np.arange(ids.size, dtype=np.int32)
            self._position[ids] = order
            if not np.array_equal(self._position[ids], order):
                return False
        return bool(self.ref_count.numpy()[ids].min() >= 1)

    def _ring_read(self, start: int, num: int) -> torch.Tensor:
        """int64 ``[num]``: ring entries from ``start`` on, wrapping (a copy)."""
        cap = self.ring.numel()
        end = start + num
        if end <= cap:
            return self.ring[start:end].clone()
        return torch.cat((self.ring[start:], self.ring[: end - cap]))

    def _ring_write(self, start: int, ids: torch.Tensor) -> None:
        """Write ``ids`` into the ring from ``start`` on, wrapping."""
        cap, num = self.ring.numel(), ids.numel()
        first = min(num, cap - start)
        self.ring[start : start + first] = ids[:first]
        if first < num:
            self.ring[: num - first] = ids[first:]

    def _after_mutation(self, what: str) -> None:
        if self.debug:
            try:
                self.check_invariants()
            except PoolError as exc:
                raise PoolError(f"after {what}: {exc}") from None


def _first_occurrences(ids: torch.Tensor) -> torch.Tensor:
    """int64 ``[num_unique]``: index of each distinct id's first occurrence in ``ids``."""
    uniq, inverse = torch.unique(ids, return_inverse=True)
    first = torch.full((uniq.numel(),), ids.numel(), dtype=torch.int64, device=ids.device)
    first.scatter_reduce_(0, inverse, torch.arange(ids.numel(), device=ids.device), "amin")
    return first
