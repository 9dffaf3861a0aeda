"""TangramForwardMetadata: the per-batch tensors, built once in ``init_forward_metadata``.

Every layer's ``forward_extend`` / ``forward_decode`` only reads them (plan once, run many:
FlashInfer ``plan``/``run``, SGLang ``ForwardMetadata``). No sglang import: the backend passes
plain lists and arrays taken from the ``ForwardBatch`` and the memory's host mirror.

Extend batch (one segment per request)::

    req_rows   int32 [bs]         page-table rows (SGLang req_pool_indices)
    qo_indptr  int32 [bs + 1]     request i owns new tokens qo_indptr[i]:qo_indptr[i+1]
    kept_count int32 [bs, G]      k_g of each request's segment (tokens)
    hist_len   int32 [rows, G]    kept lengths BEFORE the segment at the batch's rows (the
                                  history the kernels attend to, where kept K/V start): the
                                  scheduler already advanced the live group_len by k_g
    bounds     host list          qo_indptr on the host (per-request loops, no device sync)
    kept_lens  host int64 [bs, G] same as kept_count

Decode batch (one new token per request, already counted in group_len)::

    req_rows   int32 [bs]
    dest_page  int64 [bs, G]      page of the new token in each group's table
    dest_slot  int64 [bs, G]      its slot in that page (tokens)
    out        [bs, H_q, D]       decode output buffer (static; None = the kernel allocates)
    chunk_floor  L x int32 [1]    per-layer chunk floors of the batch-balanced split
                                  (TANGRAM_DECODE_PLAN=batch, the default; else None)

CUDA graphs (:class:`DecodeGraphBuffers`): the decode plan lives in static ``[max_bs, ...]``
buffers refilled in place before every step (host page allocation stays outside the graph); a
graph captured for batch size ``bs`` reads the views ``[:bs]``. Entries past the real batch
(SGLang pads to the captured size) point at row 0 (SGLang's padding row: never a request, so
every group length is 0 and decode writes zeros) and write their K/V into page 0 (the pool's
padding page, never handed out)::

    req_rows [max_bs]      rows[:n] real, rows[n:bs] = 0
    dest_page [max_bs, G]  pages[:n] real, [n:bs] = 0 (padding page), slot 0

Source: docs/contracts.md (kernel calling conventions); docs/design.md §8 (plan once, run many).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tangram_sglang.backend.replay import ReplayLayout
from tangram_sglang.errors import KernelError
from tangram_sglang.kernels.history_attention import PagedHistoryIds, PagedHistoryPlan, history_ids
from tangram_sglang.kernels.split_table import check_launch_ctas

EXTEND = "extend"
DECODE = "decode"

# ``upload(host int64 arrays) -> device int64 tensors`` (same shapes, same order). The backend
# passes ``PageTable.flush``: the plan rides in the step's one packed, non-blocking copy.
Upload = Callable[[list[np.ndarray]], list[torch.Tensor]]


def plain_upload(device: torch.device | str) -> Upload:
    """An :data:`Upload` that copies each array on its own (tests, one-off plans)."""

    def upload(parts: list[np.ndarray]) -> list[torch.Tensor]:
        return [torch.from_numpy(np.ascontiguousarray(a, np.int64)).to(device) for a in parts]

    return upload


@dataclass(slots=True)
class TangramForwardMetadata:
    """Per-batch plan read by every layer (see :func:`extend_metadata`, :func:`decode_metadata`)."""

    mode: str  # EXTEND or DECODE
    req_rows: torch.Tensor  # int32 [bs], device
    qo_indptr: torch.Tensor | None  # int32 [bs + 1], device (extend)
    bounds: list[int]  # host copy of qo_indptr (tokens; extend) or [] (decode)
    kept_lens: np.ndarray | None  # int64 [bs, G] host (extend)
    kept_count: torch.Tensor | None  # int32 [bs, G] device (extend)
    dest_page: torch.Tensor | None  # int64 [bs, G] device (decode)
    dest_slot: torch.Tensor | None  # int64 [bs, G] device (decode)
    max_extend_len: int  # longest segment of the batch (tokens; 0 for decode)
    out: torch.Tensor | None = None  # [bs, num_qo_heads, D] decode output buffer, or None
    host_rows: tuple[int, ...] = ()  # req_rows on the host (extend; no device read)
    kept_heads_host: np.ndarray | None = None  # int64 [L, bs, H_kv] k_g per layer and KV head
    kept_heads: torch.Tensor | None = None  # the same on the device (one copy per batch)
    # extend: int32 [rows, G] lengths before the segment at the batch's rows (None: the live
    # group_len is the history, as when the lengths advance after the forward)
    hist_len: torch.Tensor | None = None
    # extend: False when the host knows no request of the batch has history (start_lens all 0),
    # so the history part of a split extend (kernels.new_token_attention) is not launched
    any_history: bool = True
    # extend: whether TANGRAM_PREFILL_ATTENTION=auto splits this batch (new tokens through
    # FlashInfer, history through Tangram's kernel, merged by LSE): :func:`split_pays`
    split_new_tokens: bool = False
    # extend: the paged-history plan (TANGRAM_HISTORY_ATTENTION=flashinfer) when the batch has
    # one history length per (request, KV head) on every layer and enough history work
    # (kernels.history_attention.plan_paged_history), and its page ids on the device
    history: PagedHistoryPlan | None = None
    history_ids: PagedHistoryIds | None = None
    # decode under TANGRAM_DECODE_PLAN=batch: each layer's chunk floor, an int32 [1] device view
    # per layer (split_table.batch_chunk_floor of the batch's lengths, uploaded with the plan)
    chunk_floor: tuple[torch.Tensor, ...] | None = None
    # extend under a replay scorer: where each row's replay tokens sit (backend.replay); None
    # when no row of the batch replays
    replay: ReplayLayout | None = None

    @property
    def batch_size(self) -> int:
        return int(self.req_rows.shape[0])

    def layer_kept(
        self, layer: int, group_of_head: np.ndarray
    ) -> tuple[np.ndarray, torch.Tensor | None]:
        """``(host int64 [bs, H_kv], device int64 [bs, H_kv] or None)``: k_g of layer's heads.

        From the per-batch tables when :func:`extend_metadata` got every layer's group map
        (no host-to-device copy per layer; ``group_of_head`` is then not read), else computed on
        the host from ``group_of_head`` int ``[H_kv]`` (device part None).
        """
        if self.kept_heads_host is not None and self.kept_heads is not None:
            return self.kept_heads_host[layer], self.kept_heads[layer]
        assert self.kept_lens is not None, "layer_kept is for extend batches"
        return self.kept_lens[:, np.asarray(group_of_head, np.int64)], None


def extend_metadata(
    rows: list[int] | np.ndarray,
    extend_lens: list[int],
    kept_lens: np.ndarray,
    device: torch.device | str,
    group_of_head: np.ndarray | None = None,
    upload: Upload | None = None,
    start_lens: np.ndarray | None = None,
    hist_len: torch.Tensor | None = None,
    history: PagedHistoryPlan | None = None,
    page_table: torch.Tensor | None = None,
) -> TangramForwardMetadata:
    """Plan an extend batch.

    Args:
        rows: ``bs`` request rows (req_pool_idx).
        extend_lens: ``bs`` tokens each request runs (tokens; its segment, plus its replay
            tokens under a replay scorer: ``backend.replay``).
        kept_lens: int ``[bs, num_head_groups]`` kept tokens per group (from ``alloc_extend``).
        device: attention device.
        group_of_head: optional int ``[num_layers, H_kv]`` head-group map of every layer: then
            the per-layer kept counts of every KV head are built here once (host and device,
            :meth:`TangramForwardMetadata.layer_kept`), so no layer copies to the device.
        upload: how the host arrays reach ``device`` (default :func:`plain_upload`); all of
            them go in one call.
        start_lens: optional int ``[bs, num_head_groups]`` kept lengths before the segment
            (``TangramState.allocate_extend`` advanced the live lengths at schedule time):
            uploaded with the plan and scattered into ``hist_len`` at the batch's rows, which
            the kernels then read as the history (:attr:`TangramForwardMetadata.hist_len`).
        hist_len: int32 ``[max_rows, num_head_groups]`` device buffer for ``start_lens``,
            shaped like ``PageTable.group_len`` (the backend's, built once); required with
            ``start_lens``.
        history: optional paged-history plan of the batch
            (``kernels.history_attention.plan_paged_history``): its arrays ride in the same
            upload, and the batch's page-id source is built from them on the device
            (:attr:`TangramForwardMetadata.history_ids`).
        page_table: int32 ``[max_rows, G, max_pages]`` device page table (required with
            ``history``: each layer's page ids are read from it).

    Raises:
        KernelError: ``start_lens`` without a ``hist_len`` buffer, or ``history`` without
            ``page_table``.
    """
    if history is not None and page_table is None:
        raise KernelError("extend_metadata: a paged-history plan needs the device page_table")
    if start_lens is not None and hist_len is None:
        raise KernelError(
            "extend_metadata: start_lens needs a hist_len buffer shaped like the page table's "
            "group_len (torch.zeros_like(table.group_len))"
        )
    row_arr = np.asarray(rows, np.int64).reshape(-1)
    bounds_arr = np.concatenate([[0], np.cumsum(np.asarray(extend_lens, np.int64))])
    kept = np.asarray(kept_lens, np.int64).reshape(row_arr.size, -1)
    parts = [row_arr, bounds_arr, kept]
    heads_host = heads = None
    if group_of_head is not None:
        heads_host = np.ascontiguousarray(
            kept[:, np.asarray(group_of_head, np.int64)].swapaxes(0, 1)
        )
        parts.append(heads_host)
    start_at = len(parts)
    if start_lens is not None:
        parts.append(np.asarray(start_lens, np.int64).reshape(kept.shape))
    history_at = len(parts)
    if history is not None:
        parts += history.upload_parts()
    dev = (upload or plain_upload(device))(parts)
    ids = None
    if history is not None:
        ids = history_ids(dev[history_at:], dev[0], page_table, history)
    if heads_host is not None:
        heads = dev[3]
    if start_lens is not None:
        hist_len.index_copy_(0, dev[0], dev[start_at].to(torch.int32))
    bounds = bounds_arr.tolist()
    any_history = start_lens is None or bool(np.any(start_lens))
    return TangramForwardMetadata(
        mode=EXTEND,
        req_rows=dev[0].to(torch.int32),
        qo_indptr=dev[1].to(torch.int32),
        bounds=bounds,
        kept_lens=kept,
        kept_count=dev[2].to(torch.int32),
        dest_page=None,
        dest_slot=None,
        max_extend_len=max(extend_lens, default=0),
        host_rows=tuple(row_arr.tolist()),
        kept_heads_host=heads_host,
        kept_heads=heads,
        hist_len=hist_len,
        any_history=any_history,
        split_new_tokens=split_pays(extend_lens, no_history=not any_history),
        history=history,
        history_ids=ids,
    )


# Mean causal query-key pairs per new token above which the split extend pays for its second
# pass and merge (see split_pays).
SPLIT_MIN_CAUSAL_PAIRS_PER_TOKEN = 1024


def split_pays(extend_lens: list[int] | np.ndarray, no_history: bool) -> bool:
    """Whether an extend batch runs faster split (``kernels.new_token_attention``) than fused.

    The split runs the new tokens' causal attention through FlashInfer and, when some request has
    history, Tangram's kernel over the history only, then merges the two by LSE. The history
    pass costs what the fused kernel spends on history, so the split pays when FlashInfer's
    savings on the causal part exceed the second pass's fixed cost and the merge. Measured on the
    H200 (Llama-3.1-8B shapes, ``benchmarks/RESULTS.md`` 2026-12-02): FlashInfer saves about
    45-75 ps per causal query-key pair, all 32 query heads together (1 x 8,192 and 16 x 1,024
    first turns: 2.43 -> 0.91 and 0.98 -> 0.34 ms per layer); the second pass and merge cost
    about 60 ns per new token (64 turns of 128 tokens over 4,096-token histories: 2.66 -> 3.12
    ms per layer). Break-even:
    about 800-1,300 causal pairs per new token, hence :data:`SPLIT_MIN_CAUSAL_PAIRS_PER_TOKEN`
    (segments of about 2,000 tokens and more). A batch without history has no second pass and
    always splits. A heuristic from three measured points; the untested cases with history
    (``1x8192+8192``, ``16x1024+1024``, ``4x2048+2048``) are in ``scripts/device_prefill_auto.sh``.

    Args:
        extend_lens: ``bs`` new tokens per request.
        no_history: True when the host knows no request of the batch has history.

    Returns:
        True to split.
    """
    if no_history:
        return True
    n = np.asarray(extend_lens, np.float64).reshape(-1)
    return bool(np.sum(n * (n + 1) / 2) >= SPLIT_MIN_CAUSAL_PAIRS_PER_TOKEN * np.sum(n))


def decode_destinations(
    rows: list[int], pages: np.ndarray, lens: np.ndarray, page_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """Host ``(dest_page, dest_slot)``, int64 ``[bs, G]``: where each row's new token goes.

    Args:
        rows: ``bs`` request rows.
        pages: int ``[max_rows, G, max_pages_per_group]`` host page table.
        lens: int ``[max_rows, G]`` host kept lengths, INCLUDING the new token (>= 1).
        page_size: tokens per page.
    """
    r = np.asarray(rows, np.int64)
    last = lens[r] - 1  # [bs, G] slot index of the new token in each group
    groups = np.arange(lens.shape[1])
    page = pages[r[:, None], groups[None, :], last // page_size]
    return np.ascontiguousarray(page, np.int64), np.ascontiguousarray(last % page_size, np.int64)


def decode_metadata(
    rows: list[int] | np.ndarray,
    pages: np.ndarray,
    lens: np.ndarray,
    page_size: int,
    device: torch.device | str,
    upload: Upload | None = None,
    chunk_floor: np.ndarray | None = None,
) -> TangramForwardMetadata:
    """Plan a decode batch from the memory's host mirror (after ``alloc_decode``).

    Args:
        rows: ``bs`` request rows.
        pages: int ``[max_rows, G, max_pages_per_group]`` host page table.
        lens: int ``[max_rows, G]`` host kept lengths, INCLUDING the new token.
        page_size: tokens per page.
        device: attention device.
        upload: how the host arrays reach ``device`` (default :func:`plain_upload`).
        chunk_floor: int ``[num_layers]`` floors of the batch-balanced decode plan
            (:func:`decode_chunk_floors`), carried as int32 ``[1]`` views per layer; None for
            the other plans.
    """
    page, slot = decode_destinations(rows, pages, lens, page_size)
    arrays = [np.asarray(rows, np.int64).reshape(-1), page, slot]
    if chunk_floor is not None:
        arrays.append(np.asarray(chunk_floor, np.int64).reshape(-1))
    uploaded = (upload or plain_upload(device))(arrays)
    d_rows, d_page, d_slot = uploaded[:3]
    floors = None
    if chunk_floor is not None:
        d_floor = uploaded[3].to(torch.int32)
        floors = tuple(d_floor[layer : layer + 1] for layer in range(d_floor.shape[0]))
    return TangramForwardMetadata(
        mode=DECODE,
        req_rows=d_rows.to(torch.int32),
        qo_indptr=None,
        bounds=[],
        kept_lens=None,
        kept_count=None,
        dest_page=d_page,
        dest_slot=d_slot,
        max_extend_len=0,
        chunk_floor=floors,
    )


PADDING_ROW = 0  # SGLang's req_to_token padding row (never a request): all group lengths 0
PADDING_PAGE = 0  # the pool's padding page (never handed out): padded entries write here


def heads_per_group_of_layer(cluster_of: np.ndarray, num_head_groups: int) -> np.ndarray:
    """int64 ``[G, L]``: how many KV heads of layer ``l`` head group ``g`` holds (start-up).

    Args:
        cluster_of: int ``[L, H_kv]``: the head group of every (layer, KV head)
            (``HeadGrouping.cluster_of``).
        num_head_groups: ``G``.
    """
    cluster_of = np.asarray(cluster_of, np.int64)
    num_layers = cluster_of.shape[0]
    counts = np.zeros((num_head_groups, num_layers), np.int64)
    np.add.at(counts, (cluster_of, np.arange(num_layers)[:, None]), 1)
    return counts


def decode_chunk_floors(
    lens: np.ndarray, rows: np.ndarray, heads_of_layer: np.ndarray, launch_ctas: int
) -> np.ndarray:
    """The batch-balanced decode plan's chunk floor of every layer (host, per decode step).

    ``ceil(sum over the batch's rows and the layer's KV heads of the kept length /
    launch_ctas)``: :func:`~tangram_sglang.kernels.split_table.batch_chunk_floor` of each layer,
    from the host lengths the scheduler advanced (no device read).

    Args:
        lens: int ``[max_rows, G]`` host kept lengths (``PageTable.lens``, after
            ``alloc_decode``: the token being decoded included).
        rows: int ``[bs]`` the batch's rows.
        heads_of_layer: int ``[G, L]`` (:func:`heads_per_group_of_layer`).
        launch_ctas: CTAs one decode launch aims for (``SplitTable.launch_ctas``, >= 1).

    Returns:
        int64 ``[L]`` floors in tokens (0 for an empty batch).

    Raises:
        KernelError: ``launch_ctas`` not a whole number >= 1, ``rows`` not 1-D whole numbers
            inside ``lens``, or ``heads_of_layer`` not ``[G, L]`` with ``lens``'s ``G``.
    """
    check_launch_ctas(launch_ctas)
    rows = np.asarray(rows)
    lens = np.asarray(lens)
    heads_of_layer = np.asarray(heads_of_layer)
    if rows.ndim != 1 or (rows.size and not np.issubdtype(rows.dtype, np.integer)):
        raise KernelError(f"rows must be 1-D row indices, got {rows.dtype} {list(rows.shape)}")
    if rows.size and (rows.min() < 0 or rows.max() >= lens.shape[0]):
        raise KernelError(f"rows must lie in [0, {lens.shape[0]}) (the page table's rows)")
    if lens.ndim != 2 or heads_of_layer.ndim != 2 or heads_of_layer.shape[0] != lens.shape[1]:
        raise KernelError(
            f"heads_of_layer must be [G, L] with lens [max_rows, G]; got "
            f"{list(heads_of_layer.shape)} and {list(lens.shape)} (heads_per_group_of_layer)"
        )
    totals = lens[rows].sum(axis=0) @ heads_of_layer
    return -(-totals // int(launch_ctas))


@dataclass(slots=True)
class DecodeGraphBuffers:
    """Static decode-plan buffers for CUDA graphs (built once at start-up, refilled per step).

    A graph captured for batch size ``bs`` keeps the addresses of the ``[:bs]`` views, so every
    step writes the plan into the same memory (:meth:`fill`) and nothing is allocated per step.
    Create with :meth:`create`.
    """

    req_rows: torch.Tensor  # int32 [max_bs], device
    dest_page: torch.Tensor  # int64 [max_bs, G], device
    dest_slot: torch.Tensor  # int64 [max_bs, G], device
    out: torch.Tensor  # [max_bs, num_qo_heads, D] decode output, the pool's dtype
    chunk_floor: torch.Tensor  # int32 [num_layers], device: TANGRAM_DECODE_PLAN=batch's floors
    floor_views: tuple[torch.Tensor, ...]  # chunk_floor[l : l + 1] per layer, built once

    @classmethod
    def create(
        cls,
        max_bs: int,
        num_head_groups: int,
        num_qo_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        num_layers: int,
    ) -> DecodeGraphBuffers:
        """Zeroed buffers (every entry = the padding row / page) for up to ``max_bs`` requests
        (and ``num_layers`` chunk floors of the batch-balanced decode plan)."""
        ints = dict(dtype=torch.int64, device=device)
        floor = torch.zeros(num_layers, dtype=torch.int32, device=device)
        return cls(
            req_rows=torch.full((max_bs,), PADDING_ROW, dtype=torch.int32, device=device),
            dest_page=torch.full((max_bs, num_head_groups), PADDING_PAGE, **ints),
            dest_slot=torch.zeros((max_bs, num_head_groups), **ints),
            out=torch.zeros((max_bs, num_qo_heads, head_dim), dtype=dtype, device=device),
            chunk_floor=floor,
            floor_views=tuple(floor[layer : layer + 1] for layer in range(num_layers)),
        )

    @property
    def max_bs(self) -> int:
        return int(self.req_rows.shape[0])

    def view(self, bs: int, with_floor: bool = False) -> TangramForwardMetadata:
        """The decode plan of a (padded) batch of ``bs``: views of the static buffers (with the
        per-layer chunk floors when ``with_floor``)."""
        return TangramForwardMetadata(
            mode=DECODE,
            req_rows=self.req_rows[:bs],
            qo_indptr=None,
            bounds=[],
            kept_lens=None,
            kept_count=None,
            dest_page=self.dest_page[:bs],
            dest_slot=self.dest_slot[:bs],
            max_extend_len=0,
            out=self.out[:bs],
            chunk_floor=self.floor_views if with_floor else None,
        )

    def fill(
        self,
        rows: list[int] | np.ndarray,
        padded_bs: int,
        pages: np.ndarray,
        lens: np.ndarray,
        page_size: int,
        upload: Upload | None = None,
        chunk_floor: np.ndarray | None = None,
    ) -> TangramForwardMetadata:
        """Write the plan of ``rows`` (after ``alloc_decode``) in place; pad up to ``padded_bs``.

        Runs outside the graph: host arrays, one ``upload`` for the three of them, then
        device-to-device copies into the static buffers on the current stream. Stream order
        makes the refill safe while the previous step's graph may still read the buffers: the
        copies run after it on the same stream. ``rows`` may be empty (graph capture: every
        entry is padding).

        Args:
            rows: the real batch's request rows (``n <= padded_bs``).
            padded_bs: the captured batch size the graph runs (SGLang's padded ``bs``).
            pages, lens, page_size: as :func:`decode_destinations`.
            upload: how the host arrays reach the device (default :func:`plain_upload`; the
                backend passes ``PageTable.flush``).
            chunk_floor: int ``[num_layers]`` host floors of the batch-balanced decode plan
                (:func:`decode_chunk_floors`), uploaded with the plan; None for the other plans.

        Returns:
            :meth:`view` of ``padded_bs`` (with the floors when ``chunk_floor`` is given).

        Raises:
            KernelError: ``padded_bs`` exceeds the buffers or is smaller than the batch, or
                ``chunk_floor`` is not one floor per layer.
        """
        rows = np.asarray(rows, np.int64).reshape(-1)
        n = rows.size
        if not n <= padded_bs <= self.max_bs:
            raise KernelError(
                f"decode graph buffers hold {self.max_bs} requests; asked for {n} rows padded "
                f"to {padded_bs}: raise the buffers' max_bs to the CUDA graph's max batch size"
            )
        groups = self.dest_page.shape[1]
        row_arr = np.full(padded_bs, PADDING_ROW, np.int64)
        page = np.full((padded_bs, groups), PADDING_PAGE, np.int64)
        slot = np.zeros((padded_bs, groups), np.int64)
        if n:
            row_arr[:n] = rows
            page[:n], slot[:n] = decode_destinations(rows, pages, lens, page_size)
        arrays = [row_arr, page, slot]
        if chunk_floor is not None:
            chunk_floor = np.asarray(chunk_floor)
            if not np.issubdtype(chunk_floor.dtype, np.integer):
                raise KernelError(
                    f"chunk_floor must hold whole tokens, got dtype {chunk_floor.dtype} "
                    "(decode_chunk_floors)"
                )
            if chunk_floor.shape != tuple(self.chunk_floor.shape):
                raise KernelError(
                    f"chunk_floor has shape {list(chunk_floor.shape)}, expected "
                    f"[{self.chunk_floor.shape[0]}] (one floor per layer: "
                    "decode_chunk_floors; create the buffers with the model's num_layers)"
                )
            if chunk_floor.size and (chunk_floor.min() < 0 or chunk_floor.max() >= 1 << 31):
                raise KernelError(
                    "chunk_floor values must be tokens in [0, 2**31) (decode_chunk_floors)"
                )
            arrays.append(chunk_floor.astype(np.int64))
        uploaded = (upload or plain_upload(self.req_rows.device))(arrays)
        self.req_rows[:padded_bs].copy_(uploaded[0])
        self.dest_page[:padded_bs].copy_(uploaded[1])
        self.dest_slot[:padded_bs].copy_(uploaded[2])
        if chunk_floor is not None:
            self.chunk_floor.copy_(uploaded[3])
        return self.view(padded_bs, with_floor=chunk_floor is not None)


def write_decode_token(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: TangramForwardMetadata,
    group_of_head: torch.Tensor,
    column_of_head: torch.Tensor,
) -> None:
    """Write each request's new token K/V into its group slot (per layer, decode).

    Args:
        k_pool, v_pool: ``[num_pages, H_p, page_size, D]``, written in place.
        k, v: ``[bs, H_kv, D]`` the new token's K (post-RoPE) and V, the pool's dtype.
        meta: the decode plan (``dest_page``, ``dest_slot``).
        group_of_head, column_of_head: int32 ``[H_kv]`` of the layer.
    """
    groups = group_of_head.long()
    page = meta.dest_page[:, groups]  # [bs, H_kv]
    slot = meta.dest_slot[:, groups]
    col = column_of_head.long()[None, :].expand_as(page)
    k_pool[page, col, slot] = k
    v_pool[page, col, slot] = v
