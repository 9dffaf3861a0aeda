"""Budget Reservation: the one page-footprint formula and the ledger of reserved pages.

Owns :func:`pages_needed` (admission, decode growth and capacity reports all call it; vLLM's
lesson: two formulas drift and deadlock) and :class:`ReservationLedger` (check, then commit).
Leaves page ids to :mod:`page_allocator` and tables to :mod:`page_table`.

Footprint of a request, per head group g with current kept length ``L_g`` (after the matched
prefix) and ``a_g = k_g(extend_len) + (T - 1)`` tokens to append (``T = max_new_tokens``; the
last sampled token is never fed back, so T - 1 decode-tail tokens)::

    new_pages_g = ceil((L_g + a_g) / page_size) - ceil(L_g / page_size)
                  + 1   if a_g > 0 and L_g % page_size != 0 and the last page is not the
                        request's own (copy-on-write of a shared partial tail page)

A reservation is exact: a request that runs to the tokens it reserved uses exactly the pages it
reserved. Reserved-but-unused pages are held back from admission (``unreserved_free``). The
serving policy (``backend.state``, ``docs/admission.md``) reserves the prompt only and lets the
decode tail grow past the grant from unreserved free pages (``take(..., allow_overflow=True)``);
admission then counts each tail as :func:`admission_decode_tokens`.

Source: Tangram arXiv 2606.06302, Budget Reservation; docs/contracts.md (footprint);
vLLM v1 ``get_num_blocks_to_allocate`` / nano-vllm ``can_allocate`` (check, then commit).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tangram_sglang.errors import PoolError
from tangram_sglang.mem.page_allocator import PageAllocator
from tangram_sglang.profile import BudgetProfile


class RequestTooLargeError(PoolError):
    """A request needs more pages than the whole pool holds: it can never be admitted."""


def decode_tail_tokens(max_new_tokens: int) -> int:
    """Decode-tail tokens written for ``max_new_tokens`` (``T - 1``, at least 0)."""
    return max(int(max_new_tokens) - 1, 0)


def admission_decode_tokens(tokens_left: int, clip: int, ratio: float = 1.0) -> int:
    """Decode-tail tokens admission counts for a request that may still generate ``tokens_left``.

    ``ceil(min(tokens_left, clip) x ratio)``, the token estimate of SGLang's ``PrefillAdder``
    (``CLIP_MAX_NEW_TOKENS`` = ``SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION``, 4096 by default;
    ``new_token_ratio`` for running requests, 1.0 for the new one).

    Args:
        tokens_left: ``max_new_tokens`` minus tokens generated so far (tokens).
        clip: cap on the counted tail (tokens).
        ratio: fraction of the capped tail counted, in [0, 1].
    """
    left = min(max(int(tokens_left), 0), max(int(clip), 0))
    return int(np.ceil(left * float(ratio) - 1e-9)) if left else 0


def segment_kept_lens(
    profile: BudgetProfile, start_token: int, num_tokens: int, grid: int = 0
) -> np.ndarray:
    """int64 ``[num_head_groups]``: tokens each head group keeps of one prefill segment.

    THE kept-length rule: admission (``TangramState.request_pages``, the whole-pool check),
    reservation (``TangramMemory.admit`` / ``admit_chunk``) and allocation
    (``TangramMemory.alloc_extend``) all call it, so they always agree.

    * Without the segment grid (``grid <= 0``): the profile's ``k_g(n)``
      (``BudgetProfile.group_kept_array``; ``--tangram-min-compress-tokens`` included).
    * Under the grid (``grid`` = the chunk size C, ``TANGRAM_GRID_SEGMENTS=1``): a whole cell
      ``[kC, (k+1)C)`` keeps ``k_g(C)``; any other segment (a prompt's last, partial chunk, a
      continuation that starts inside a cell) keeps every token in every group (``k_g = n``,
      not scored), so its kept K/V is the same whatever the radix tree held when the request
      came and it can be cached and reused to the token (docs/design.md §5.1).

    Args:
        profile: the budget profile.
        start_token: absolute position of the segment's first token in the sequence (tokens
            from token 0, the matched prefix included; >= 0).
        num_tokens: tokens of the segment (n, >= 0).
        grid: cell size in tokens (``TangramState.segment_grid``); <= 0 = grid off.

    Raises:
        PoolError: ``start_token`` or ``num_tokens`` negative.
    """
    start, n, grid = int(start_token), int(num_tokens), int(grid)
    if start < 0 or n < 0:
        raise PoolError(
            f"segment kept lengths: start_token={start} and num_tokens={n} must be >= 0 "
            "(tokens from the start of the sequence, tokens of the segment)"
        )
    if grid > 0 and not (start % grid == 0 and n == grid):
        return np.full(profile.grouping.num_head_groups, n, dtype=np.int64)
    return np.asarray(profile.group_kept_array(n), dtype=np.int64)


def group_append_tokens(
    profile: BudgetProfile,
    extend_len: int,
    decode_tokens: int,
    start_token: int = 0,
    grid: int = 0,
) -> np.ndarray:
    """int64 ``[num_head_groups]``: tokens each group appends, kept segment + ``decode``.

    The segment's kept lengths are :func:`segment_kept_lens` of ``[start_token, start_token +
    extend_len)`` on ``grid`` (``k_g(extend_len)`` without a grid).
    """
    kept = segment_kept_lens(profile, start_token, extend_len, grid)
    return kept + int(decode_tokens)


def group_pages_needed(
    group_lens: np.ndarray, last_page_shared: np.ndarray, append_tokens: np.ndarray, page_size: int
) -> np.ndarray:
    """int64 ``[num_head_groups]``: new pages each group needs to append ``append_tokens``.

    Args:
        group_lens: int ``[G]`` current kept tokens per group (tokens).
        last_page_shared: bool ``[G]``: the group's last page is not the request's own (a
            radix node's or a shared page), so appending to a partial one copies it first.
        append_tokens: int ``[G]`` tokens to append per group.
        page_size: tokens per page.
    """
    lens = np.asarray(group_lens, dtype=np.int64)
    add = np.asarray(append_tokens, dtype=np.int64)
    shared = np.asarray(last_page_shared, dtype=bool)
    have = -(-lens // page_size)
    need = -(-(lens + add) // page_size) - have
    cow = shared & (lens % page_size != 0) & (add > 0)
    return need + cow.astype(np.int64)


def pages_needed(
    profile: BudgetProfile,
    page_size: int,
    extend_len: int,
    max_new_tokens: int,
    group_lens: np.ndarray | None = None,
    last_page_shared: np.ndarray | None = None,
    decode_tokens: int | None = None,
) -> int:
    """Pages a request needs, exact to the page: the Budget Reservation footprint.

    Args:
        profile: the budget profile (its grouping gives the head groups and ratios).
        page_size: tokens per page.
        extend_len: tokens of the new segment (n; the group keeps ``kept_len(n, r_g, ...)``).
        max_new_tokens: T; the decode tail is T - 1 tokens per group.
        group_lens: int ``[G]`` kept tokens per group already in the request's table (matched
            prefix or earlier chunks); None = empty.
        last_page_shared: bool ``[G]``, see :func:`group_pages_needed`; None = all own.
        decode_tokens: override of the decode-tail tokens reserved (SGLang's overcommit);
            None = ``T - 1``.

    Returns:
        Pages (each ``H_p x page_size`` slots, K and V).
    """
    num_groups = profile.grouping.num_head_groups
    lens = np.zeros(num_groups, np.int64) if group_lens is None else np.asarray(group_lens)
    shared = (
        np.zeros(num_groups, bool) if last_page_shared is None else np.asarray(last_page_shared)
    )
    tail = decode_tail_tokens(max_new_tokens) if decode_tokens is None else int(decode_tokens)
    add = group_append_tokens(profile, extend_len, tail)
    return int(group_pages_needed(lens, shared, add, page_size).sum())


@dataclass(slots=True)
class Reservation:
    """Pages granted to one request row and how many it has taken."""

    row: int  # request row (SGLang req_pool_idx)
    rid: str  # request id, for messages
    reserved_pages: int  # pages granted by admission (all chunks together)
    used_pages: int  # pages allocated against the grant (COW copies included)
    overflow_pages: int  # decode pages taken beyond the grant from unreserved free pages

    @property
    def remaining_pages(self) -> int:
        """Granted pages not yet allocated."""
        return self.reserved_pages - self.used_pages


class ReservationLedger:
    """Reserved-page accounting on top of one :class:`PageAllocator`.

    Invariant: ``allocator.num_free() >= outstanding_pages()``; every granted page is backed by a
    free page, so a request never fails to get a page it was granted.
    """

    def __init__(self, allocator: PageAllocator) -> None:
        self.allocator = allocator
        self.by_row: dict[int, Reservation] = {}  # row -> its reservation
        self._outstanding = 0  # pages: sum of remaining_pages

    def outstanding_pages(self) -> int:
        """Granted pages not yet allocated, over all rows."""
        return self._outstanding

    def unreserved_free(self) -> int:
        """Free pages not promised to anyone: what admission and overflow may take."""
        return self.allocator.num_free() - self._outstanding

    def fits_pool(self, num_pages: int) -> bool:
        """Could ``num_pages`` ever be granted (empty pool)?"""
        return num_pages <= self.allocator.num_usable_pages

    def can_reserve(self, num_pages: int, evictable_pages: int = 0) -> bool:
        """No side effects: would ``num_pages`` fit now, after evicting ``evictable_pages``?"""
        return self.fits_pool(num_pages) and num_pages <= self.unreserved_free() + evictable_pages

    def reserve(self, row: int, rid: str, num_pages: int) -> Reservation | None:
        """Grant ``num_pages`` to ``row`` (adding to its grant if it has one).

        Returns:
            The row's reservation, or None when the pages are not free now (nothing changes).

        Raises:
            RequestTooLargeError: more pages than the whole pool (nothing changes).
        """
        if not self.fits_pool(num_pages):
            raise RequestTooLargeError(
                f"request {rid!r} (row {row}) needs {num_pages} pages but the whole pool has "
                f"{self.allocator.num_usable_pages}; shorten the prompt or max_new_tokens, or "
                "give the KV pool more memory"
            )
        if num_pages > self.unreserved_free():
            return None
        res = self.by_row.get(row)
        if res is None:
            res = self.by_row[row] = Reservation(row, rid, 0, 0, 0)
        res.reserved_pages += num_pages
        self._outstanding += num_pages
        return res

    def overflow_needed(self, row: int, num_pages: int) -> int:
        """Pages beyond ``row``'s remaining grant that taking ``num_pages`` would need."""
        return max(num_pages - self.by_row[row].remaining_pages, 0)

    def take(self, row: int, num_pages: int, allow_overflow: bool) -> None:
        """Record that ``row`` allocates ``num_pages`` now (before the allocator call).

        Raises:
            PoolError: the grant is exceeded and overflow is not allowed (extend) or the
                unreserved free pages do not cover it (decode). Nothing changes on error.
        """
        res = self.by_row[row]
        over = self.overflow_needed(row, num_pages)
        if over and not allow_overflow:
            raise PoolError(
                f"request {res.rid!r} (row {row}) asks for {num_pages} pages but has "
                f"{res.remaining_pages} of its {res.reserved_pages} reserved left; reserve the "
                "segment at admission (admit / admit_chunk) before allocating it"
            )
        if over > self.unreserved_free():
            raise PoolError(
                f"request {res.rid!r} (row {row}) needs {over} pages beyond its reservation but "
                f"only {self.unreserved_free()} unreserved pages are free; check can_decode and "
                "retract a request first"
            )
        from_grant = num_pages - over
        res.used_pages += from_grant
        res.overflow_pages += over
        self._outstanding -= from_grant

    def trim(self, row: int, keep_pages: int) -> int:
        """Return ``row``'s unused grant beyond ``keep_pages`` to admission; returns pages given.

        Used when a request reserved an upper bound (later prefill chunks, uncompressed) and
        its exact remaining need (the decode tail) is known.
        """
        res = self.by_row[row]
        surplus = max(res.remaining_pages - max(int(keep_pages), 0), 0)
        res.reserved_pages -= surplus
        self._outstanding -= surplus
        return surplus

    def release(self, row: int) -> Reservation:
        """Drop ``row``'s reservation; its unused grant returns to admission. Returns it."""
        res = self.by_row.pop(row)
        self._outstanding -= res.remaining_pages
        return res

    def take_many(self, rows: list[int], counts: list[int]) -> None:
        """:meth:`take` with overflow allowed for several rows at once (one decode step).

        Args:
            rows: distinct rows with a reservation.
            counts: pages each row allocates now (> 0).

        Raises:
            PoolError: the rows' pages beyond their grants, together, exceed the unreserved
                free pages (check ``can_decode`` and retract first). Nothing changes on error.
        """
        reservations = [self.by_row[r] for r in rows]
        pairs = zip(reservations, counts, strict=True)
        over = [max(n - res.remaining_pages, 0) for res, n in pairs]
        if sum(over) > self.unreserved_free():
            raise PoolError(
                f"rows {list(rows)[:8]} need {sum(over)} pages beyond their reservations but "
                f"only {self.unreserved_free()} unreserved pages are free; check can_decode and "
                "retract a request first"
            )
        taken = 0
        for res, n, extra in zip(reservations, counts, over, strict=True):
            res.used_pages += n - extra
            res.overflow_pages += extra
            taken += n - extra
        self._outstanding -= taken
