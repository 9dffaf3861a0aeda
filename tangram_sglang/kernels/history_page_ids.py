"""One layer's single-head page ids for the paged history, in one Triton launch.

``kernels.history_attention.PagedHistoryIds.layer`` on CUDA: entry ``e`` of layer ``l`` is
``table[base[e] + group_offset[l, head[e]]] * H_p + column_of[l, head[e]]`` (the page of the
entry's row and page index in its KV head's group, as a single-head page of the head's column),
written into FlashInfer's planned index buffer before the layer's paged prefill. The torch
expression it replaces takes six launches and two ``[nnz]`` int64 temporaries per layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # entries per program


@triton.jit(
    do_not_specialize=["num_entries", "heads_per_group"],
    do_not_specialize_on_alignment=["group_offset_ptr", "column_ptr"],
)
def _page_ids_kernel(
    table_ptr,
    base_ptr,
    head_ptr,
    group_offset_ptr,
    column_ptr,
    out_ptr,
    num_entries,
    heads_per_group,
    BLOCK: tl.constexpr,
):
    """Entries ``[pid * BLOCK, (pid + 1) * BLOCK)``; the head-map pointers point at one layer."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_entries
    head = tl.load(head_ptr + offs, mask=mask, other=0)
    src = tl.load(base_ptr + offs, mask=mask, other=0) + tl.load(
        group_offset_ptr + head, mask=mask, other=0
    )
    page = tl.load(table_ptr + src, mask=mask, other=0).to(tl.int64)
    column = tl.load(column_ptr + head, mask=mask, other=0)
    tl.store(out_ptr + offs, (page * heads_per_group + column).to(tl.int32), mask=mask)


def write_layer_page_ids(ids, layer: int, out: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Write layer ``layer``'s page ids of ``ids`` (a ``PagedHistoryIds``) into ``out``.

    Args:
        ids: the batch's ``kernels.history_attention.PagedHistoryIds`` (device tensors).
        layer: layer index (a row of its head maps).
        out: int32 ``[nnz]``, contiguous, on the same device.
        block: entries per program (a power of two).

    Returns:
        ``out``.
    """
    nnz = ids.head.shape[0]
    if nnz == 0:
        return out
    _page_ids_kernel[(triton.cdiv(nnz, block),)](
        ids.table,
        ids.base,
        ids.head,
        ids.group_offset[layer],
        ids.column_of[layer],
        out,
        nnz,
        ids.heads_per_group,
        BLOCK=block,
    )
    return out
