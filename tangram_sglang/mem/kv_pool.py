"""K/V page storage: one pool for all layers and head groups.

Owns the two tensors and byte sizing. Which pages are free is :mod:`page_allocator`'s job; which
page holds which token is :mod:`page_table`'s.

Layout (head-major inside a page, so one (page, column) is a contiguous single-head block)::

    k_pool, v_pool : [num_pages, H_p, page_size, D]
                      page 0 = padding, never handed out
    token t of head group g, column c (a (layer, kv_head) of g) of request row r:
        page = page_table[r, g, t // page_size], slot = t % page_size
        k_pool[page, c, slot, :]

In ``global`` scope a group spans layers: at layer l only the columns of layer l's heads are read
or written; in a partial last group the spare columns are never used (counted as fragmentation).

Source: docs/contracts.md (pages and page tables); Tangram arXiv 2606.06302, Ragged Paging
(Head Group Page); SGLang ``MHATokenToKVPool`` HND layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tangram_sglang.errors import PoolError
from tangram_sglang.profile import BudgetProfile


def bytes_per_page(heads_per_group: int, page_size: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one page, K and V together: ``2 * H_p * page_size * D * itemsize``."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * heads_per_group * page_size * head_dim * itemsize


def filled_slots(
    src: np.ndarray, dst: np.ndarray, num_slots: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """int64 ``(src_page, dst_page, slot)``, each ``[sum(num_slots)]``: page i's slots
    ``0 .. num_slots[i] - 1``, the arguments of :meth:`KVPool.copy_slots` for the copy-on-write
    ``dst[i][:, :n_i] = src[i][:, :n_i]`` of whole tail pages (host only).

    Args:
        src: int ``[n]`` source page ids (a shared partial tail page; repeats allowed).
        dst: int ``[n]`` fresh destination page ids, distinct.
        num_slots: int ``[n]`` filled slots of each source page (tokens, 1..page_size).
    """
    count = np.asarray(num_slots, np.int64).reshape(-1)
    total = int(count.sum())
    slot = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
    return (
        np.repeat(np.asarray(src, np.int64), count),
        np.repeat(np.asarray(dst, np.int64), count),
        slot,
    )


def num_pages_for_budget(memory_bytes: int, bytes_page: int) -> int:
    """Pages (including padding page 0) that fit in ``memory_bytes``.

    Raises:
        PoolError: the budget holds fewer than 2 pages (padding + one usable).
    """
    num_pages = int(memory_bytes) // int(bytes_page)
    if num_pages < 2:
        raise PoolError(
            f"memory budget {memory_bytes} bytes holds {num_pages} pages of {bytes_page} bytes; "
            "need at least 2 (padding page 0 + one usable): raise the memory budget"
        )
    return num_pages


@dataclass(slots=True)
class KVPool:
    """K and V page storage ``[num_pages, H_p, page_size, D]`` on one device.

    Build with :meth:`create` or :meth:`from_memory_budget`; page 0 is zero padding.

    Attributes:
        k_pool: ``[num_pages, heads_per_group, page_size, head_dim]``, contiguous.
        v_pool: same shape, dtype and device as ``k_pool``.
    """

    k_pool: torch.Tensor  # [num_pages, H_p, page_size, D], keys after RoPE
    v_pool: torch.Tensor  # [num_pages, H_p, page_size, D], values

    @classmethod
    def create(
        cls,
        num_pages: int,
        heads_per_group: int,
        page_size: int,
        head_dim: int,
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cpu",
    ) -> KVPool:
        """Allocate zeroed storage (``device="meta"`` sizes without memory, for reports).

        Raises:
            PoolError: a non-positive size.
        """
        for name, value in (
            ("num_pages", num_pages),
            ("heads_per_group", heads_per_group),
            ("page_size", page_size),
            ("head_dim", head_dim),
        ):
            if int(value) < 1:
                raise PoolError(f"KVPool {name}={value} must be >= 1")
        shape = (num_pages, heads_per_group, page_size, head_dim)
        k = torch.zeros(shape, dtype=dtype, device=device)
        v = torch.zeros(shape, dtype=dtype, device=device)
        return cls(k_pool=k, v_pool=v)

    @classmethod
    def from_memory_budget(
        cls,
        memory_bytes: int,
        profile: BudgetProfile,
        dtype: torch.dtype = torch.bfloat16,
        page_size: int = 16,
        device: str | torch.device = "cpu",
    ) -> KVPool:
        """The largest pool (padding page included) that fits in ``memory_bytes``.

        Runs at start-up. H_p and D come from the profile (its grouping and model).

        Raises:
            PoolError: fewer than 2 pages fit.
        """
        h_p, dim = profile.grouping.heads_per_group, profile.model.head_dim
        num_pages = num_pages_for_budget(memory_bytes, bytes_per_page(h_p, page_size, dim, dtype))
        return cls.create(num_pages, h_p, page_size, dim, dtype, device)

    # ---- geometry --------------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return int(self.k_pool.shape[0])

    @property
    def heads_per_group(self) -> int:
        return int(self.k_pool.shape[1])

    @property
    def page_size(self) -> int:
        return int(self.k_pool.shape[2])

    @property
    def head_dim(self) -> int:
        return int(self.k_pool.shape[3])

    @property
    def bytes_per_page(self) -> int:
        """Bytes of one page, K and V together."""
        return bytes_per_page(
            self.heads_per_group, self.page_size, self.head_dim, self.k_pool.dtype
        )

    # ---- data movement ---------------------------------------------------------------------
    def copy_slots(
        self, src_page: torch.Tensor, dst_page: torch.Tensor, slot: torch.Tensor
    ) -> None:
        """``pool[dst_page[i], :, slot[i]] = pool[src_page[i], :, slot[i]]`` for K and V.

        One gather and one scatter per pool for the whole call, whatever the number of pages
        (a later turn of 64 chats copies one tail page per head group per conversation:
        thousands of pages), moving only the filled slots. No device-to-host read.

        Args:
            src_page, dst_page, slot: int64 ``[m]`` on the pool's device (page ids, slot index
                ``< page_size``); ``(dst_page[i], slot[i])`` pairs distinct.
        """
        if slot.numel():
            for pool in (self.k_pool, self.v_pool):
                pool[dst_page, :, slot] = pool[src_page, :, slot]

    def write(
        self,
        page_ids: torch.Tensor,
        columns: torch.Tensor,
        slots: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Scatter kept K/V rows to (page, column, slot); the torch reference of the kept-KV write.

        Args:
            page_ids, columns, slots: int ``[n]`` destinations.
            k, v: ``[n, head_dim]`` rows (cast to the pool dtype).

        Raises:
            PoolError: mismatched lengths, padding page 0, or an index out of range.
        """
        n = int(page_ids.numel())
        if not (columns.numel() == slots.numel() == n == k.shape[0] == v.shape[0]):
            raise PoolError("KVPool.write: page_ids, columns, slots, k and v need the same length")
        if n and (
            int(page_ids.min()) < 1
            or int(page_ids.max()) >= self.num_pages
            or int(columns.min()) < 0
            or int(columns.max()) >= self.heads_per_group
            or int(slots.min()) < 0
            or int(slots.max()) >= self.page_size
        ):
            raise PoolError(
                "KVPool.write: a destination is page 0, out of range, or has a column >= H_p "
                f"({self.heads_per_group}) or slot >= page_size ({self.page_size})"
            )
        idx = (page_ids.long(), columns.long(), slots.long())
        self.k_pool.index_put_(idx, k.to(self.k_pool.dtype))
        self.v_pool.index_put_(idx, v.to(self.v_pool.dtype))

    def gather(
        self, pages: torch.Tensor, column: int, num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V ``[num_tokens, head_dim]`` of one column along a dense page list (for tests)."""
        t = torch.arange(num_tokens, device=self.k_pool.device)
        page = pages.to(self.k_pool.device).long()[t // self.page_size]
        slot = t % self.page_size
        return self.k_pool[page, column, slot], self.v_pool[page, column, slot]
