"""Triton extend attention and kept-KV write against the torch reference (tiny shapes on CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_cases import DEVICE, TOL, extend_inputs, make_paged_layer, rel_err
from torch.utils._python_dispatch import TorchDispatchMode

from tangram_sglang.errors import KernelError
from tangram_sglang.kernels import _checks
from tangram_sglang.kernels.extend_attention import ragged_extend_attention
from tangram_sglang.kernels.kv_write import write_kept_kv
from tangram_sglang.kernels.reference import extend_reference, kv_write_reference

DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=DTYPE_IDS.get)
def test_extend_matches_reference(dtype) -> None:
    # Request lengths 1, 70 (two query blocks) and 0 (no new tokens); history includes length 0.
    _, q, k_new, v_new, qo_indptr, paging = extend_inputs(dtype, 16, 64, [1, 70, 0], seed=4)
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), device=DEVICE)
    ragged_extend_attention(q, k_new, v_new, qo_indptr, *paging, 0.125, out, lse)
    f32 = [a.float() if a.is_floating_point() else a for a in (q, k_new, v_new, qo_indptr, *paging)]
    want_out, want_lse = extend_reference(*f32, 0.125)
    assert not out.isnan().any() and not lse.isnan().any()
    assert rel_err(out, want_out) < TOL[dtype]
    assert rel_err(lse, want_lse) < TOL[dtype]


def test_extend_head_dim_128_page_1_gqa_3() -> None:
    _, q, k_new, v_new, qo_indptr, paging = extend_inputs(
        torch.bfloat16, 1, 128, [9, 3], gqa=3, seed=6
    )
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), device=DEVICE)
    ragged_extend_attention(q, k_new, v_new, qo_indptr, *paging, 0.09, out, lse, max_extend_len=9)
    f32 = [a.float() if a.is_floating_point() else a for a in (q, k_new, v_new, qo_indptr, *paging)]
    want_out, want_lse = extend_reference(*f32, 0.09)
    assert rel_err(out, want_out) < 1e-2 and rel_err(lse, want_lse) < 1e-2


def test_extend_rejects_mismatched_new_kv() -> None:
    _, q, k_new, v_new, qo_indptr, paging = extend_inputs(torch.float32, 4, 64, [2], seed=1)
    out, lse = torch.empty_like(q), torch.empty(q.shape[:2], device=DEVICE)
    with pytest.raises(KernelError, match="v_new"):
        ragged_extend_attention(q, k_new, v_new[:, :1], qo_indptr, *paging, 0.1, out, lse)
    with pytest.raises(KernelError, match="lse"):
        ragged_extend_attention(q, k_new, v_new, qo_indptr, *paging, 0.1, out, lse.double())


@pytest.mark.parametrize("page_size", [1, 16], ids=lambda p: f"page{p}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
def test_kv_write_matches_reference(page_size: int, dtype) -> None:
    num_kv_heads, head_dim, extend_lens = 3, 64, [40, 3]
    lens = np.array([[17, 0, 5], [1, 33, 0]])
    kept = np.array([[37, 1, 2], [3, 2, 1]])  # per (request, group); 37 > BLOCK_K (two blocks)
    layer = make_paged_layer(
        lens,
        num_kv_heads,
        2,
        page_size,
        head_dim,
        dtype,
        seed=page_size,
        spare_pages=200,
        max_pages=64,
    )
    req_rows = torch.tensor([1, 0], dtype=torch.int32, device=DEVICE)
    for i, row in enumerate(req_rows.tolist()):  # reserve pages for [len, len + kept)
        for g in range(3):
            first = -(-int(lens[row, g]) // page_size)
            for p in range(first, -(-int(lens[row, g] + kept[i, g]) // page_size)):
                layer.page_table[row, g, p] = layer.free_pages.pop()
    qo_indptr = torch.tensor(np.cumsum([0, *extend_lens]), dtype=torch.int32, device=DEVICE)
    k_new = torch.randn(sum(extend_lens), num_kv_heads, head_dim, device=DEVICE).to(dtype)
    v_new = torch.randn_like(k_new)
    kept_idx = torch.zeros(2, num_kv_heads, 40, dtype=torch.int32, device=DEVICE)
    groups = layer.group_of_head.tolist()
    for i in range(2):
        for h in range(num_kv_heads):
            k = int(kept[i, groups[h]])
            idx = torch.randperm(extend_lens[i])[:k].sort().values
            kept_idx[i, h, :k] = idx.to(DEVICE, torch.int32)
    kept_count = torch.tensor(kept, dtype=torch.int32, device=DEVICE)
    ref_k, ref_v = layer.k_pool.clone(), layer.v_pool.clone()
    before = layer.k_pool.clone()
    args = (layer.page_table, layer.group_len, req_rows, layer.group_of_head, layer.column_of_head)
    kv_write_reference(k_new, v_new, qo_indptr, kept_idx, kept_count, ref_k, ref_v, *args)
    write_kept_kv(k_new, v_new, qo_indptr, kept_idx, kept_count, layer.k_pool, layer.v_pool, *args)
    assert torch.equal(layer.k_pool, ref_k) and torch.equal(layer.v_pool, ref_v)
    assert not torch.equal(layer.k_pool, before), "nothing was written"
    # the launcher's argument checks run once per layer of every extend batch: host metadata
    # only, no device op (each would be a kernel launch on a GPU)
    with CountOps() as ops:
        _checks.check_kv_write_args(
            k_new, v_new, qo_indptr, kept_idx, kept_count, layer.k_pool, layer.v_pool, *args
        )
    assert ops.names == []


def test_kv_write_reads_a_broadcast_kept_idx_as_its_copy() -> None:
    """A batch kept whole gets ``kept_idx`` as a view broadcast over the KV heads (stride 0,
    backend.compress): the kernel reads it through its strides, like the contiguous copy."""
    num_kv_heads, head_dim, extend_lens = 2, 64, [5, 3]
    lens = np.array([[4, 0], [0, 2]])
    layer = make_paged_layer(
        lens, num_kv_heads, 2, 16, head_dim, torch.float32, seed=3, spare_pages=50, max_pages=8
    )
    req_rows = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    for i, row in enumerate(req_rows.tolist()):  # every group keeps the whole segment
        for g in range(2):
            first = -(-int(lens[row, g]) // 16)
            for p in range(first, -(-int(lens[row, g] + extend_lens[i]) // 16)):
                layer.page_table[row, g, p] = layer.free_pages.pop()
    qo_indptr = torch.tensor(np.cumsum([0, *extend_lens]), dtype=torch.int32, device=DEVICE)
    k_new = torch.randn(sum(extend_lens), num_kv_heads, head_dim, device=DEVICE)
    v_new = torch.randn_like(k_new)
    fill = torch.tensor([[[0, 1, 2, 3, 4]], [[0, 1, 2, 0, 0]]], device=DEVICE)
    broadcast = fill.expand(2, num_kv_heads, 5)
    kept_count = torch.tensor([[5, 5], [3, 3]], dtype=torch.int32, device=DEVICE)
    args = (layer.page_table, layer.group_len, req_rows, layer.group_of_head, layer.column_of_head)
    ref_k, ref_v = layer.k_pool.clone(), layer.v_pool.clone()
    before = ref_k.clone()
    write_kept_kv(k_new, v_new, qo_indptr, broadcast.contiguous(), kept_count, ref_k, ref_v, *args)
    write_kept_kv(k_new, v_new, qo_indptr, broadcast, kept_count, layer.k_pool, layer.v_pool, *args)
    assert not torch.equal(ref_k, before), "nothing was written"
    assert torch.equal(layer.k_pool, ref_k) and torch.equal(layer.v_pool, ref_v)


class CountOps(TorchDispatchMode):
    """Records the aten ops run inside the block (``names``)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_checked_layouts_check_each_layout_once_and_never_skip_a_new_one(monkeypatch) -> None:
    """With ``checked`` (one per launcher, as the server's kernels hold), the argument checks
    run on the first call of a layout (an extend batch's first layer), not on the later calls
    with the same layout (its other layers); a call with another shape, dtype or scale is
    checked again and still refused, and a refused layout is never remembered."""
    _, q, k_new, v_new, qo_indptr, paging = extend_inputs(torch.float32, 16, 64, [3, 5], seed=2)
    calls = []
    real = _checks.check_extend_args
    monkeypatch.setattr(_checks, "check_extend_args", lambda *a: calls.append(1) or real(*a))
    checked = _checks.CheckedLayouts()
    out, lse = torch.empty_like(q), torch.empty(q.shape[:2], device=DEVICE)
    want = ragged_extend_attention(q, k_new, v_new, qo_indptr, *paging, 0.125, out.clone(), lse)
    calls.clear()
    for _ in range(3):  # three "layers" of one batch: fresh tensors, one layout
        got, _ = ragged_extend_attention(
            q.clone(),
            k_new.clone(),
            v_new.clone(),
            qo_indptr,
            *paging,
            0.125,
            torch.empty_like(q),
            torch.empty_like(lse),
            checked=checked,
        )
        assert torch.equal(got, want[0])
    assert len(calls) == 1 and len(checked) == 1
    for _ in range(2):  # a refused layout is checked (and refused) every time
        with pytest.raises(KernelError, match="lse"):
            ragged_extend_attention(
                q, k_new, v_new, qo_indptr, *paging, 0.125, out, lse.double(), checked=checked
            )
        with pytest.raises(KernelError, match="sm_scale"):
            ragged_extend_attention(
                q, k_new, v_new, qo_indptr, *paging, float("nan"), out, lse, checked=checked
            )
        with pytest.raises(KernelError, match="v_new"):
            ragged_extend_attention(
                q, k_new, v_new[:, :1], qo_indptr, *paging, 0.125, out, lse, checked=checked
            )
    assert len(checked) == 1


def test_kv_write_checked_layouts_refuse_a_new_bad_layout(monkeypatch) -> None:
    """``write_kept_kv`` with ``checked``: a good layout is remembered; a kept_idx of another
    shape (the next layer's wider budget, here a wrong batch size) is checked and refused."""
    lens = np.array([[2, 0], [0, 1]])
    layer = make_paged_layer(lens, 2, 2, 16, 64, torch.float32, seed=5, spare_pages=20, max_pages=4)
    req_rows = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    qo_indptr = torch.tensor([0, 2, 4], dtype=torch.int32, device=DEVICE)
    k_new = torch.randn(4, 2, 64, device=DEVICE)
    kept_idx = torch.zeros(2, 2, 0, dtype=torch.int32, device=DEVICE)  # nothing kept
    kept_count = torch.zeros(2, 2, dtype=torch.int32, device=DEVICE)
    args = (layer.page_table, layer.group_len, req_rows, layer.group_of_head, layer.column_of_head)
    calls = []
    real = _checks.check_kv_write_args
    monkeypatch.setattr(_checks, "check_kv_write_args", lambda *a: calls.append(1) or real(*a))
    checked = _checks.CheckedLayouts()
    pools = (layer.k_pool, layer.v_pool)
    for _ in range(3):  # one layout: checked on the first call only
        write_kept_kv(k_new, k_new, qo_indptr, kept_idx, kept_count, *pools, *args, checked=checked)
    assert len(checked) == 1 and len(calls) == 1
    with pytest.raises(KernelError, match="kept_idx"):
        write_kept_kv(
            k_new, k_new, qo_indptr, kept_idx[:1], kept_count, *pools, *args, checked=checked
        )
    assert len(checked) == 1
