"""Triton decode-token K/V write: one launch per layer puts each request's new token in its slots.

Decode appends one token to every head group of each request; the host plan already says where
(``dest_page[b, g]``, ``dest_slot[b, g]``: page and slot of group g's new token, see
``backend.metadata.decode_destinations``). Per layer, KV head h of request b goes to column
``column_of_head[h]`` of page ``dest_page[b, group_of_head[h]]`` at slot
``dest_slot[b, group_of_head[h]]``. The torch path (``backend.metadata.write_decode_token``)
takes about eight small kernels for this (index casts, two gathers, two scatters); this is one,
and it reads K/V through their strides (views of the model's fused QKV output, no copies).

Grid ``(bs, H_kv)``; each program copies ``D`` elements of K and of V. Padded batch entries
(CUDA graphs) point at the padding page 0, slot 0, like the torch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tangram_sglang.errors import KernelError
from tangram_sglang.kernels import _checks


@triton.jit
def _decode_kv_write_kernel(
    k_ptr,
    v_ptr,
    k_pool_ptr,
    v_pool_ptr,
    dest_page_ptr,
    dest_slot_ptr,
    group_of_head_ptr,
    column_of_head_ptr,
    stride_k_b,
    stride_k_h,
    stride_v_b,
    stride_v_h,
    stride_dest_b,
    stride_pool_page,
    stride_pool_col,
    stride_pool_slot,
    HEAD_DIM: tl.constexpr,
):
    """One (request, KV head)."""
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    group = tl.load(group_of_head_ptr + head)
    column = tl.load(column_of_head_ptr + head).to(tl.int64)
    page = tl.load(dest_page_ptr + b * stride_dest_b + group).to(tl.int64)
    slot = tl.load(dest_slot_ptr + b * stride_dest_b + group).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    dst = page * stride_pool_page + column * stride_pool_col + slot * stride_pool_slot + offs_d
    k = tl.load(k_ptr + b * stride_k_b + head * stride_k_h + offs_d)
    tl.store(k_pool_ptr + dst, k)
    v = tl.load(v_ptr + b * stride_v_b + head * stride_v_h + offs_d)
    tl.store(v_pool_ptr + dst, v)


def write_decode_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    dest_page: torch.Tensor,
    dest_slot: torch.Tensor,
    group_of_head: torch.Tensor,
    column_of_head: torch.Tensor,
) -> None:
    """Write each request's new-token K/V into its group slots (one launch, per layer).

    Args:
        k, v: ``[bs, H_kv, D]`` the new token's K (post-RoPE) and V, the pools' dtype; any
            strides with the last dim contiguous (views of the QKV output are fine).
        k_pool, v_pool: ``[num_pages, H_p, page_size, D]``, written in place.
        dest_page, dest_slot: int64 ``[bs, num_head_groups]`` (same strides): page and slot of
            each group's new token (the decode plan).
        group_of_head, column_of_head: int32 ``[H_kv]``: this layer's head -> (group, column).

    Raises:
        KernelError: a shape, dtype, device or stride does not match the above.

    Source: this module's docstring; the torch path ``backend.metadata.write_decode_token``.
    """
    device = k_pool.device
    _checks.check_pools(k_pool, v_pool, device)
    num_pages, _, _, head_dim = k_pool.shape
    bs = k.shape[0] if k.dim() == 3 else -1
    num_kv_heads = _checks.num_kv_heads_of(group_of_head, device)
    for name, t in (("k", k), ("v", v)):
        _checks.check_tensor(name, t, (bs, num_kv_heads, head_dim), (k_pool.dtype,), device)
    groups = dest_page.shape[1] if dest_page.dim() == 2 else -1
    for name, t in (("dest_page", dest_page), ("dest_slot", dest_slot)):
        _checks.check_tensor(name, t, (bs, groups), (torch.int64,), device)
    _checks.check_tensor("column_of_head", column_of_head, (num_kv_heads,), (torch.int32,), device)
    if dest_page.stride() != dest_slot.stride():
        raise KernelError(
            f"dest_page strides {dest_page.stride()} differ from dest_slot strides "
            f"{dest_slot.stride()}; pass both from one plan"
        )
    if bs == 0:
        return
    _decode_kv_write_kernel[(bs, num_kv_heads)](
        k,
        v,
        k_pool,
        v_pool,
        dest_page,
        dest_slot,
        group_of_head,
        column_of_head,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        dest_page.stride(0),
        k_pool.stride(0),
        k_pool.stride(1),
        k_pool.stride(2),
        HEAD_DIM=head_dim,
    )
