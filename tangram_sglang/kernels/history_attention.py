"""The history part of an extend through FlashInfer's paged prefill, one head per request.

A split extend (``kernels.new_token_attention.split_extend``) runs the new tokens' causal part
through FlashInfer and the part over each request's history (its KV heads' pages) separately,
then merges the two by LSE. Tangram's history is ragged per KV head: head ``h`` of layer ``l``
reads the pages of head group ``g = cluster_of[l, h]``, column ``c = column_of[l, h]``, for
``group_len[row, g]`` tokens. FlashInfer's paged prefill takes one page list per request and the
same heads on every page. The two meet through a view of the pool::

    k_pool [num_pages, H_p, page_size, D]  ->  [num_pages * H_p, 1, page_size, D]   (HND)
    (page p, column c) is the single-head page  p * H_p + c   (a contiguous [page_size, D] block)

so each (KV head, request) pair is one FlashInfer request with one KV head and the ``gqa`` query
heads that read it, over the single-head pages of its own group and column. Queries go
head-major (``[T, H_q, D] -> [H_kv * T, gqa, D]``): request ``r = h * bs + i`` owns rows
``h * T + bounds[i] : h * T + bounds[i + 1]``; non-causal (every history token precedes every
new one).

FlashInfer plans once per batch from the host lengths (``plan`` is host work and cannot run
inside a layer loop: consecutive plans of one wrapper share a pinned staging buffer that an
earlier plan's queued copy may still read). One plan serves every layer only when each
(request, KV head) has the same history length on every layer, so :func:`plan_paged_history`
builds a plan only then: at ratio 1.0, and whenever every history segment was kept whole
(``--tangram-min-compress-tokens``); the layers then differ only in their page ids, which are
copied into the planned index buffer before each layer's run. Other batches keep Tangram's own
history kernel.

* :func:`plan_paged_history`: the host plan (numpy), or None where it does not apply or pay;
* :func:`paged_prefill_reference`: FlashInfer's paged prefill semantics in torch (CPU, the
  tests' oracle for the plan's arrays);
* :func:`to_head_major` / :func:`from_head_major`: the query and output layouts;
* :class:`FlashInferPagedHistory`: plan once per batch, run per layer (CUDA).

LSE convention: natural log (``kernels.new_token_attention``), ``-inf`` for a query without
history; FlashInfer's base-2 LSE is converted, and its LSE of a request without pages (``-5e4``,
its finite stand-in for infinity: ``include/flashinfer/math.cuh`` ``inf = 5e4``) becomes ``-inf``.
Source: SGLang 0.5.17 ``layers/attention/flashinfer_backend.py`` (paged prefix with
``causal=False``, FA2, merged with the ragged new tokens by ``merge_state``); FlashInfer 0.6
``prefill.BatchPrefillWithPagedKVCacheWrapper`` (``plan`` / ``run(return_lse=True)``, HND
layout, ``page.cuh`` ``get_length``: a request with no page has length 0).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tangram_sglang.errors import KernelError
from tangram_sglang.kernels.new_token_attention import check_finite, flashinfer_fallback

logger = logging.getLogger(__name__)

# History work per layer (query-key pairs x head_dim, summed over query heads) below which a
# batch keeps Tangram's history kernel. Per layer the split adds about ten launches (the
# re-layouts, the index copy, the LSE merge), 50-100 us of host time, while FlashInfer's FA2
# saves perhaps a quarter of the history kernel's time (about 230 TFLOP/s on 8,192 x 8,192 on
# the H200, benchmarks/RESULTS.md 2026-12-05): it pays from about 0.5 ms of history per layer.
# 2**28 pairs at head_dim 128 is about 0.6 ms (e.g. 64 requests x 128 new tokens over 1,024
# tokens of history, 32 query heads). To be tuned on the H200 (scripts/device_history.sh).
PAGED_HISTORY_MIN_WORK = 128 * 2**28

# FlashInfer's base-2 LSE at or below this is a request without pages: FlashInfer starts its
# running max at -5e4 (``math.cuh``: ``inf = 5e4``), so an empty request returns ``log2(1) - 5e4``.
# A real LSE this low would need every score below -2.7e4, where exp() underflows anyway.
EMPTY_LSE2 = -4.0e4


@dataclass(frozen=True, slots=True)
class PagedHistoryPlan:
    """Host arrays of one extend batch's paged-history plan (:func:`plan_paged_history`).

    FlashInfer request ``r = h * bs + i`` is KV head ``h`` of the batch's request ``i``. The
    single-head page ids of a layer are read from the device page table when the layer runs
    (:class:`PagedHistoryIds`): the host uploads only per-request page counts and head maps.

    Attributes:
        num_kv_heads: H_kv (KV heads per layer).
        heads_per_group: H_p (columns per page).
        qo_indptr: int32 ``[H_kv * bs + 1]``: request r owns rows ``qo_indptr[r]:qo_indptr[r+1]``
            of the head-major queries (:func:`to_head_major`).
        kv_indptr: int32 ``[H_kv * bs + 1]``: request r's pages are entries
            ``kv_indptr[r]:kv_indptr[r + 1]`` of each layer's page ids.
        last_page_len: int32 ``[H_kv * bs]``: tokens in request r's last page (``page_size``
            for a request with no page).
        kv_lens: int32 ``[H_kv * bs]``: history tokens of request r (the same on every layer).
        num_pages: int64 ``[H_kv * bs]``: pages of request r (``kv_indptr``'s steps).
        cluster_of, column_of: int64 ``[num_layers, H_kv]``: the profile's head maps.
    """

    num_kv_heads: int
    heads_per_group: int
    qo_indptr: np.ndarray
    kv_indptr: np.ndarray
    last_page_len: np.ndarray
    kv_lens: np.ndarray
    num_pages: np.ndarray
    cluster_of: np.ndarray
    column_of: np.ndarray

    @property
    def num_entries(self) -> int:
        """nnz: page ids per layer."""
        return int(self.kv_indptr[-1])

    def upload_parts(self) -> list[np.ndarray]:
        """The arrays :func:`history_ids` reads, in its order (one packed upload)."""
        return [self.num_pages, self.cluster_of, self.column_of]

    def ids_on(self, rows: torch.Tensor, page_table: torch.Tensor) -> PagedHistoryIds:
        """:func:`history_ids` from plain copies of :meth:`upload_parts` (tests, benches)."""
        parts = [torch.from_numpy(a).to(page_table.device) for a in self.upload_parts()]
        return history_ids(parts, rows, page_table, self)


@dataclass(frozen=True, slots=True)
class PagedHistoryIds:
    """What a layer's single-head page ids are read from, on the device (one batch).

    Entry ``e`` of layer ``l`` is ``table[base[e] + group_offset[l, head[e]]] * H_p +
    column_of[l, head[e]]``: page ``e - kv_indptr[r]`` of row i's pages of KV head h's group, for
    the entry's FlashInfer request ``r = h * bs + i``.

    Attributes:
        table: int32 ``[max_rows * G * max_pages]``: the page table, flattened (a view).
        head: int64 ``[nnz]``: each entry's KV head.
        base: int64 ``[nnz]``: each entry's offset in ``table`` in group 0 (row and page).
        group_offset: int64 ``[num_layers, H_kv]``: ``cluster_of * max_pages``.
        column_of: int64 ``[num_layers, H_kv]``.
        heads_per_group: H_p.
    """

    table: torch.Tensor
    head: torch.Tensor
    base: torch.Tensor
    group_offset: torch.Tensor
    column_of: torch.Tensor
    heads_per_group: int

    def layer(self, layer: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """int32 ``[nnz]``: layer ``layer``'s page ids, written into ``out`` if given (one
        Triton launch on CUDA, ``kernels.history_page_ids``; torch elsewhere)."""
        if out is None:
            out = torch.empty(self.head.shape[0], dtype=torch.int32, device=self.head.device)
        if out.is_cuda:
            from tangram_sglang.kernels.history_page_ids import write_layer_page_ids

            write_layer_page_ids(self, layer, out)
            return out
        src = self.base + self.group_offset[layer][self.head]
        ids = self.table[src].long() * self.heads_per_group + self.column_of[layer][self.head]
        return out.copy_(ids)


def history_ids(
    parts: Sequence[torch.Tensor],
    rows: torch.Tensor,
    page_table: torch.Tensor,
    plan: PagedHistoryPlan,
) -> PagedHistoryIds:
    """The batch's :class:`PagedHistoryIds`, built on the device (no device read).

    Args:
        parts: int64 device tensors of :meth:`PagedHistoryPlan.upload_parts` (same order).
        rows: int ``[bs]`` page-table rows of the batch's requests, on the device.
        page_table: int32 ``[max_rows, G, max_pages]`` (``PageTable.page_table``), contiguous.
        plan: the batch's plan (host ints: entries, H_p).
    """
    num_pages, cluster, column = parts
    bs = rows.shape[0]
    _, num_groups, width = page_table.shape
    device = page_table.device
    nnz = plan.num_entries
    requests = torch.arange(num_pages.shape[0], device=device)
    request = torch.repeat_interleave(requests, num_pages, output_size=nnz)  # [nnz]
    first = torch.cumsum(num_pages, 0) - num_pages  # kv_indptr[:-1]
    page = torch.arange(nnz, device=device) - first[request]
    head, req = request // bs, request % bs
    base = rows.long()[req] * (num_groups * width) + page
    return PagedHistoryIds(
        table=page_table.reshape(-1),
        head=head,
        base=base,
        group_offset=cluster * width,
        column_of=column,
        heads_per_group=plan.heads_per_group,
    )


def plan_paged_history(
    rows: Sequence[int] | np.ndarray,
    bounds: Sequence[int],
    start_lens: np.ndarray,
    cluster_of: np.ndarray,
    column_of: np.ndarray,
    heads_per_group: int,
    page_size: int,
    num_qo_heads: int,
    head_dim: int,
    min_work: int = PAGED_HISTORY_MIN_WORK,
) -> PagedHistoryPlan | None:
    """The paged-history plan of an extend batch, or None where it does not apply or pay.

    Args:
        rows: ``bs`` page-table rows of the batch's requests.
        bounds: ``bs + 1`` host ints: request i owns new tokens ``bounds[i]:bounds[i + 1]``.
        start_lens: int ``[bs, G]``: kept history tokens per head group before the segment.
        cluster_of, column_of: int ``[num_layers, H_kv]``: head group and column of each KV head.
        heads_per_group: H_p (columns per page).
        page_size: tokens per page.
        num_qo_heads: H_q (for the work estimate).
        head_dim: D (for the work estimate).
        min_work: the least history work per layer, ``sum_i new_i * hist_(i,h) * gqa * D`` over
            requests and KV heads, for which a plan is built.

    Returns:
        A :class:`PagedHistoryPlan`, or None when some (request, KV head) has a different
        history length on two layers (one FlashInfer plan cannot serve every layer), when no
        request has history, or when the history work is under ``min_work``.
    """
    bs = len(rows)
    if bs == 0:
        return None
    new = np.diff(np.asarray(bounds, np.int64))
    start = np.asarray(start_lens, np.int64).reshape(bs, -1)
    cluster = np.asarray(cluster_of, np.int64)
    num_kv_heads = cluster.shape[1]
    per_layer = start[:, cluster]  # [bs, L, H_kv]
    hist = per_layer[:, 0, :]  # [bs, H_kv]
    if not (per_layer == hist[:, None, :]).all():
        return None
    gqa = num_qo_heads // num_kv_heads
    if int((new[:, None] * hist).sum()) * gqa * head_dim < max(min_work, 1):
        return None
    kv_lens = np.ascontiguousarray(hist.T).reshape(-1)  # [H_kv * bs], head-major
    num_pages = -(-kv_lens // page_size)
    kv_indptr = np.concatenate([[0], np.cumsum(num_pages)])
    last = np.where(num_pages > 0, kv_lens - (num_pages - 1) * page_size, page_size)
    tokens = int(new.sum())
    qo_starts = np.arange(num_kv_heads, dtype=np.int64)[:, None] * tokens + np.asarray(bounds[:-1])
    qo_indptr = np.concatenate([qo_starts.reshape(-1), [num_kv_heads * tokens]])
    return PagedHistoryPlan(
        num_kv_heads=num_kv_heads,
        heads_per_group=int(heads_per_group),
        qo_indptr=qo_indptr.astype(np.int32),
        kv_indptr=kv_indptr.astype(np.int32),
        last_page_len=last.astype(np.int32),
        kv_lens=kv_lens.astype(np.int32),
        num_pages=num_pages.astype(np.int64),
        cluster_of=cluster,
        column_of=np.asarray(column_of, np.int64),
    )


def single_head_pages(pool: torch.Tensor) -> torch.Tensor:
    """``[num_pages, H_p, page_size, D] -> [num_pages * H_p, 1, page_size, D]`` (a view).

    Raises:
        KernelError: the pool is not contiguous (the view would not exist).
    """
    if not pool.is_contiguous():
        raise KernelError(
            "paged history: the KV pool must be contiguous to view its single-head pages"
        )
    num_pages, heads, page_size, head_dim = pool.shape
    return pool.view(num_pages * heads, 1, page_size, head_dim)


def to_head_major(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``[T, H_q, D] -> [H_kv * T, gqa, D]`` (a copy): rows of KV head h are ``h*T:(h+1)*T``."""
    num_tokens, num_qo_heads, head_dim = q.shape
    gqa = num_qo_heads // num_kv_heads
    return (
        q.view(num_tokens, num_kv_heads, gqa, head_dim).transpose(0, 1).reshape(-1, gqa, head_dim)
    )


def from_head_major(x: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Inverse of :func:`to_head_major` for outputs ``[H_kv * T, gqa, D]`` or LSE ``[H_kv * T,
    gqa]``: ``[T, H_q, D]`` or ``[T, H_q]`` (a copy)."""
    rest = x.shape[1:]
    num_tokens = x.shape[0] // num_kv_heads
    y = x.view(num_kv_heads, num_tokens, *rest).transpose(0, 1)
    return y.reshape(num_tokens, num_kv_heads * rest[0], *rest[1:])


def paged_prefill_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    qo_indptr: Sequence[int],
    kv_indptr: Sequence[int],
    kv_indices: torch.Tensor,
    last_page_len: Sequence[int],
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-causal paged prefill as FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper`` defines
    it (HND layout), in torch float32.

    Args:
        q: ``[qo_indptr[-1], H_q, D]``.
        k_cache, v_cache: ``[max_num_pages, H_kv, page_size, D]`` (HND).
        qo_indptr, kv_indptr: ``bs + 1`` host ints (rows; pages).
        kv_indices: int ``[kv_indptr[-1]]`` page ids.
        last_page_len: ``bs`` host ints: entries of each request's last page.
        sm_scale: softmax scale.

    Returns:
        ``(out [qo_indptr[-1], H_q, D] in q's dtype, lse float32 [qo_indptr[-1], H_q])``, natural
        log; a request with no page gets output 0 and LSE ``-inf`` (as
        :meth:`FlashInferPagedHistory.run` returns it: FlashInfer's own is ``-5e4`` in base 2).
    """
    num_qo_heads, num_kv_heads = q.shape[1], k_cache.shape[1]
    gqa = num_qo_heads // num_kv_heads
    page_size = k_cache.shape[2]
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
    for r in range(len(qo_indptr) - 1):
        q0, q1 = int(qo_indptr[r]), int(qo_indptr[r + 1])
        p0, p1 = int(kv_indptr[r]), int(kv_indptr[r + 1])
        if p1 == p0 or q1 == q0:
            continue
        length = (p1 - p0 - 1) * page_size + int(last_page_len[r])
        ids = kv_indices[p0:p1].long()
        # [pages, H_kv, ps, D] -> [H_kv, pages * ps, D] -> first `length` tokens
        keys = k_cache[ids].float().transpose(0, 1).reshape(num_kv_heads, -1, q.shape[2])
        vals = v_cache[ids].float().transpose(0, 1).reshape(num_kv_heads, -1, q.shape[2])
        keys = keys[:, :length].repeat_interleave(gqa, 0)
        vals = vals[:, :length].repeat_interleave(gqa, 0)
        logits = torch.matmul(q[q0:q1].float().transpose(0, 1), keys.transpose(1, 2)) * sm_scale
        norm = torch.logsumexp(logits, dim=-1)  # [H_q, n]
        probs = torch.exp(logits - norm.unsqueeze(-1))
        out[q0:q1] = torch.matmul(probs, vals).transpose(0, 1).to(q.dtype)
        lse[q0:q1] = norm.transpose(0, 1)
    return out, lse


class TorchPagedHistory:
    """The history part by :func:`paged_prefill_reference` on a plan (CPU and tests)."""

    def __init__(self) -> None:
        self.arrays: PagedHistoryPlan | None = None
        self.ids: PagedHistoryIds | None = None
        self.sm_scale = 1.0

    def plan(
        self,
        plan: PagedHistoryPlan,
        ids: PagedHistoryIds,
        num_qo_heads: int,
        head_dim: int,
        page_size: int,
        dtype: torch.dtype,
        sm_scale: float,
    ) -> bool:
        """Keep the plan (arguments of :meth:`FlashInferPagedHistory.plan`); always usable."""
        self.arrays, self.ids, self.sm_scale = plan, ids, sm_scale
        return True

    def run(
        self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out [T, H_q, D], lse float32 [T, H_q])`` of layer ``layer``'s history."""
        p, ids = self.arrays, self.ids
        assert p is not None and ids is not None, "plan first"
        out, lse = paged_prefill_reference(
            to_head_major(q, p.num_kv_heads),
            single_head_pages(k_pool),
            single_head_pages(v_pool),
            p.qo_indptr.tolist(),
            p.kv_indptr.tolist(),
            ids.layer(layer),
            p.last_page_len.tolist(),
            self.sm_scale,
        )
        return from_head_major(out, p.num_kv_heads), from_head_major(lse, p.num_kv_heads)


class FlashInferPagedHistory:
    """The history part by FlashInfer's paged prefill (FA2, as SGLang's flashinfer backend
    runs its prefix part), planned once per batch and run per layer (CUDA).

    FlashInfer's ``plan`` stages its schedule in a pinned buffer of the wrapper and queues the
    copy to the device without waiting; the next batch's ``plan`` writes the same buffer, so it
    first waits for an event recorded after the previous copy (normally long done).

    Args:
        workspace: FlashInfer's float workspace (uint8, CUDA); may be shared with other
            wrappers of the same stream (runs are serialised on it).
        dtype: the model's (and pool's) dtype.

    Raises:
        ConfigError: a dtype FlashInfer's prefill does not take (float32), naming
            ``TANGRAM_HISTORY_ATTENTION`` and the fix.
        KernelError: flashinfer cannot be imported.
    """

    def __init__(self, workspace: torch.Tensor, dtype: torch.dtype) -> None:
        from tangram_sglang.kernels.new_token_attention import check_flashinfer

        check_flashinfer(dtype, "TANGRAM_HISTORY_ATTENTION")
        from flashinfer.prefill import BatchPrefillWithPagedKVCacheWrapper

        self.wrapper = BatchPrefillWithPagedKVCacheWrapper(workspace, "HND", backend="fa2")
        self.dtype, self.device = dtype, workspace.device
        self.num_kv_heads = 0
        self.ids: PagedHistoryIds | None = None
        self.buffer: torch.Tensor | None = None  # [nnz] int32: the index buffer FlashInfer reads
        self.planned_at: torch.cuda.Event | None = None  # after the last plan's queued copies
        self.sm_scale = 0.0  # the planned softmax scale (FlashInfer applies it on every run)
        self.usable = True

    def plan(
        self,
        plan: PagedHistoryPlan,
        ids: PagedHistoryIds,
        num_qo_heads: int,
        head_dim: int,
        page_size: int,
        dtype: torch.dtype,
        sm_scale: float,
    ) -> bool:
        """Plan the batch (host work, once per batch; every host array goes pinned, so no copy
        waits for the GPU). False when FlashInfer cannot plan this configuration (its exception
        logged) or does not read the index buffer it was given: the batch and every later one
        then keep Tangram's history kernel (``usable`` False).

        Args:
            plan: the batch's host plan.
            ids: the batch's page-id source (:func:`history_ids`).
            num_qo_heads, head_dim: the model's H_q and D.
            page_size: tokens per page of the pool.
            dtype: the model's (and pool's) dtype.
            sm_scale: softmax scale of every layer (FlashInfer takes it at plan time).
        """
        if not self.usable:
            return False

        def pinned(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a, np.int32)).pin_memory()

        if self.planned_at is not None:
            self.planned_at.synchronize()  # the previous plan's staged copy has run
        self.buffer = ids.layer(0)
        try:
            self._plan(plan, num_qo_heads, head_dim, page_size, dtype, sm_scale, pinned)
        except torch.OutOfMemoryError:
            raise  # a full device is not this path's to hide
        except Exception as exc:  # e.g. a FlashInfer build that cannot compile this config
            return self._turn_off("paged prefill cannot plan the paged history", exc)
        self.planned_at = torch.cuda.Event()
        self.planned_at.record()
        # run() reads the index buffer plan() kept; each layer's page ids are written into it
        if getattr(self.wrapper, "_paged_kv_indices_buf", None) is not self.buffer:
            logger.warning(
                "Tangram: this FlashInfer does not keep the paged-history index buffer it is "
                "planned with; the history part stays in Tangram's kernel"
            )
            self.usable = False
            return False
        self.num_kv_heads = plan.num_kv_heads
        self.ids = ids
        self.sm_scale = sm_scale
        return True

    def _turn_off(self, what: str, exc: Exception) -> bool:
        """Log that FlashInfer ``what`` (with ``exc``) and keep Tangram's history kernel for
        every later batch (``usable`` False); returns False."""
        flashinfer_fallback(what, exc, "the history part stays in Tangram's kernel")
        self.usable = False
        return False

    def warm_up(self, num_qo_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        """Plan and run one query over one single-token page at start-up, so that a JIT-built
        FlashInfer compiles this path's module (FA2; the new tokens' wrapper may build another
        one, FA3 on Hopper) and Triton builds the page-id kernel (``kernels.history_page_ids``,
        through :meth:`PagedHistoryIds.layer`) before the server takes traffic, not in the first
        batch with a paged-history plan. The run asks for the LSE, as :meth:`run` does. The next
        batch's plan replaces this one.

        Args:
            num_qo_heads, num_kv_heads, head_dim: the model's H_q, H_kv and D.

        Returns:
            True when the run finished with a finite output; False (logged as a warning, and
            ``usable`` False: every batch keeps Tangram's history kernel) when it raised or its
            output was not finite. Its inputs come from a seeded CPU generator, so the device's
            generator (sampling) is left as SGLang seeded it.

        Raises:
            torch.OutOfMemoryError: no room on the device (a full device is not hidden).
        """
        page_size, one, device = 16, torch.ones(1, dtype=torch.int32), self.device
        gqa = num_qo_heads // num_kv_heads
        try:
            gen = torch.Generator(device="cpu").manual_seed(0)
            pages = torch.randn(1, 1, page_size, head_dim, generator=gen).to(device, self.dtype)
            q = torch.randn(1, gqa, head_dim, generator=gen).to(device, self.dtype)
            indptr = torch.tensor([0, 1], dtype=torch.int32)  # pageable: start-up, nothing queued
            zeros = torch.zeros(1, 1, dtype=torch.int64, device=device)
            ids = PagedHistoryIds(
                table=torch.zeros(1, dtype=torch.int32, device=device),
                head=zeros[0],
                base=zeros[0],
                group_offset=zeros,
                column_of=zeros,
                heads_per_group=1,
            )
            self.wrapper.plan(
                indptr,
                indptr,
                ids.layer(0),  # page 0, by the kernel the planned batches use
                one,
                gqa,
                1,
                head_dim,
                page_size,
                causal=False,
                q_data_type=self.dtype,
                kv_data_type=self.dtype,
                seq_lens=one,
                max_token_per_sequence=1,
            )
            self.planned_at = torch.cuda.Event()
            self.planned_at.record()  # the next plan waits for this one's staged copy
            check_finite(self.wrapper.run(q, (pages, pages), return_lse=True)[0])
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:  # e.g. a FlashInfer build that cannot compile this config
            return self._turn_off("paged prefill failed its start-up run", exc)
        self.usable = True
        return True

    def _plan(self, plan, num_qo_heads, head_dim, page_size, dtype, sm_scale, pinned) -> None:
        """``BatchPrefillWithPagedKVCacheWrapper.plan`` for the batch (arguments of
        :meth:`plan`; ``pinned``: host array -> pinned int32 tensor)."""
        self.wrapper.plan(
            pinned(plan.qo_indptr),
            pinned(plan.kv_indptr),
            self.buffer,
            pinned(plan.last_page_len),
            num_qo_heads // plan.num_kv_heads,
            1,
            head_dim,
            page_size,
            causal=False,
            sm_scale=sm_scale,
            q_data_type=dtype,
            kv_data_type=dtype,
            seq_lens=pinned(plan.kv_lens),
            max_token_per_sequence=int(np.diff(plan.qo_indptr).max()),
        )

    def run(
        self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out [T, H_q, D], lse float32 [T, H_q] natural log, -inf without history)`` of layer
        ``layer``."""
        assert self.ids is not None and self.buffer is not None, "plan first"
        self.ids.layer(layer, self.buffer)
        out, lse2 = self.wrapper.run(
            to_head_major(q, self.num_kv_heads),
            (single_head_pages(k_pool), single_head_pages(v_pool)),
            return_lse=True,
        )
        lse = from_head_major(lse2, self.num_kv_heads)
        lse.masked_fill_(lse <= EMPTY_LSE2, float("-inf"))  # rows without history
        return from_head_major(out, self.num_kv_heads), lse.mul_(math.log(2.0))
