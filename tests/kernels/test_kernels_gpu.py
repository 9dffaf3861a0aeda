"""Full-size kernel checks on a CUDA GPU (run on the device: ``pytest -m gpu tests/kernels``).

Llama-3.1-8B shapes (32 query heads, 8 KV heads, head_dim 128) and SmolLM2 shapes (9/3, 64),
bf16, thousands of kept tokens per group, against the torch reference on the same GPU; plus a
CUDA-graph capture/replay of the decode launch with lengths changed between replays (both split
plans; under the length-fitted one the replay re-plans from the new lengths inside the kernel).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_cases import make_paged_layer, rel_err

from tangram_sglang.grouping import HeadGrouping
from tangram_sglang.kernels.decode_attention import (
    BLOCK_N,
    decode_scratch,
    ragged_decode_attention,
)
from tangram_sglang.kernels.extend_attention import ragged_extend_attention
from tangram_sglang.kernels.kv_write import write_kept_kv
from tangram_sglang.kernels.reference import (
    decode_reference,
    extend_reference,
    kv_write_reference,
)
from tangram_sglang.kernels.split_table import batch_chunk_floor, build_split_table, fitted_splits

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

DEV = torch.device("cuda")
NUM_SMS = torch.cuda.get_device_properties(0).multi_processor_count
GEOMETRIES = {"llama": (8, 4, 128), "smollm2": (3, 3, 64)}  # (H_kv, gqa, head_dim)


def skewed_layer(num_kv_heads, head_dim, page_size, rows, max_len, seed):
    """A layer whose groups have skewed ratios and lengths proportional to them.

    Returns the layer and each KV head's ratio (the ratio of the group it reads).
    """
    rng = np.random.default_rng(seed)
    ratios = np.clip(rng.lognormal(np.log(0.25), 0.9, num_kv_heads), 0.02, 1.0)
    lens = np.rint(ratios[None, :] * rng.integers(max_len // 2, max_len, (rows, 1))).astype(int)
    lens[0, 0], lens[-1, -1] = 0, 1
    layer = make_paged_layer(lens, num_kv_heads, 1, page_size, head_dim, torch.bfloat16, seed)
    # make_paged_layer shuffles the heads' (group, column) slots: head h reads group
    # group_of_head[h], so its work (and its split count) follows that group's ratio.
    return layer, ratios[layer.group_of_head.cpu().numpy()]


def table_for(ratios, batch, uniform):
    grouping = HeadGrouping.build(np.asarray(ratios)[None, :], 1, "per_layer")
    return (
        build_split_table(
            grouping, grouping.group_ratios(ratios[None, :]), NUM_SMS, batch, uniform=uniform
        )
        .to(DEV)
        .layer(0)
    )


def as_f32(args):
    return [a.float() if a.is_floating_point() else a for a in args]


PLANS = {"aot": (False, "table"), "uniform": (True, "table"), "lengths": (False, "lengths")}


@pytest.mark.parametrize("geometry", list(GEOMETRIES))
@pytest.mark.parametrize("page_size", [1, 16, 64], ids=lambda p: f"page{p}")
@pytest.mark.parametrize("plan", list(PLANS))
def test_decode_full_size(geometry, page_size, plan) -> None:
    uniform, plan_arg = PLANS[plan]
    num_kv_heads, gqa, head_dim = GEOMETRIES[geometry]
    rows, batch = 24, 16
    layer, ratios = skewed_layer(num_kv_heads, head_dim, page_size, rows, 8192, seed=page_size)
    req_rows = torch.randperm(rows)[:batch].int().to(DEV)
    view = table_for(ratios, batch, uniform)
    q = torch.randn(batch, num_kv_heads * gqa, head_dim, device=DEV, dtype=torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    splits = max(view.max_splits, view.split_cap)
    mid_o, mid_lse = decode_scratch(batch, q.shape[1], splits, head_dim, DEV)
    ragged_decode_attention(
        q, *layer.paging(req_rows), view, head_dim**-0.5, out, mid_o, mid_lse, plan_arg
    )
    want = decode_reference(q.float(), *as_f32(layer.paging(req_rows)), head_dim**-0.5)
    assert not out.isnan().any()
    assert rel_err(out, want) < 1e-2


@pytest.mark.parametrize("plan", ["table", "lengths"])
def test_decode_cuda_graph_replay_follows_new_lengths(plan) -> None:
    num_kv_heads, gqa, head_dim = GEOMETRIES["llama"]
    layer, ratios = skewed_layer(num_kv_heads, head_dim, 16, 8, 4096, seed=1)
    req_rows = torch.arange(8, dtype=torch.int32, device=DEV)
    view = table_for(ratios, 8, uniform=False)
    q = torch.randn(8, num_kv_heads * gqa, head_dim, device=DEV, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    splits = max(view.max_splits, view.split_cap)
    mid_o, mid_lse = decode_scratch(8, q.shape[1], splits, head_dim, DEV)
    args = (q, *layer.paging(req_rows), view, head_dim**-0.5, out, mid_o, mid_lse, plan)
    ragged_decode_attention(*args)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ragged_decode_attention(*args)
    for step in range(3):
        layer.group_len.copy_((layer.group_len - step * 7).clamp(min=0))
        q.copy_(torch.randn_like(q))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = decode_reference(q.float(), *as_f32(layer.paging(req_rows)), head_dim**-0.5)
        assert not out.isnan().any() and rel_err(out, want) < 1e-2


@pytest.mark.parametrize("plan", ["lengths", "batch"])
def test_fitted_decode_equal_lengths_in_a_cuda_graph(plan) -> None:
    """The chat case (every group of a row holds the same tokens), captured once and replayed
    with equal lengths, then skewed ones, then one long group: the fitted plans re-plan inside
    the graph (``batch``: with each step's floor written into its buffer before the replay) and
    match the reference; their split counts match the numpy twin."""
    num_kv_heads, gqa, head_dim = GEOMETRIES["llama"]
    rows = 16
    lens = np.full((rows, num_kv_heads), 1500)
    lens[:, 0] = 6000  # page room for the later steps' longer group
    layer = make_paged_layer(lens, num_kv_heads, 1, 16, head_dim, torch.bfloat16, seed=7)
    ratios = np.linspace(0.9, 0.05, num_kv_heads)  # the table would split these unevenly
    view = table_for(ratios, rows, uniform=False)
    req_rows = torch.arange(rows, dtype=torch.int32, device=DEV)
    q = torch.randn(rows, num_kv_heads * gqa, head_dim, device=DEV, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    cap = view.batch_cap if plan == "batch" else view.split_cap
    mid_o, mid_lse = decode_scratch(rows, q.shape[1], cap, head_dim, DEV)
    floor = torch.zeros(1, dtype=torch.int32, device=DEV)
    args = (q, *layer.paging(req_rows), view, head_dim**-0.5, out, mid_o, mid_lse, plan, floor)
    ragged_decode_attention(*args)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ragged_decode_attention(*args)
    rng = np.random.default_rng(0)
    steps = [
        np.full((rows, num_kv_heads), 1500),
        rng.integers(0, 1500, (rows, num_kv_heads)),
        np.where(np.arange(num_kv_heads) == 0, 6000, 3)[None].repeat(rows, 0),
    ]
    for step in steps:
        layer.group_len.copy_(torch.as_tensor(step, dtype=torch.int32))
        head_lens = step[:, layer.group_of_head.cpu().numpy()]
        floor.fill_(batch_chunk_floor(head_lens, view.launch_ctas) if plan == "batch" else 0)
        q.copy_(torch.randn_like(q))
        out.fill_(float("nan"))
        mid_lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = decode_reference(q.float(), *as_f32(layer.paging(req_rows)), head_dim**-0.5)
        assert not out.isnan().any() and rel_err(out, want) < 1e-2
        if plan == "batch":
            twin = (view.batch_budget, view.batch_cap, BLOCK_N, int(floor.item()))
        else:
            twin = (view.cta_budget, view.split_cap, BLOCK_N)
        splits, _ = fitted_splits(head_lens, *twin)
        written = (~mid_lse.isnan()).sum(dim=2).cpu().numpy()
        assert (written == np.repeat(splits, gqa, axis=1)).all()


@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_extend_full_size(geometry) -> None:
    num_kv_heads, gqa, head_dim = GEOMETRIES[geometry]
    layer, _ = skewed_layer(num_kv_heads, head_dim, 16, 6, 4096, seed=2)
    extend_lens = [1000, 1, 513, 2048]
    req_rows = torch.tensor([5, 0, 2, 3], dtype=torch.int32, device=DEV)
    qo_indptr = torch.tensor(np.cumsum([0, *extend_lens]), dtype=torch.int32, device=DEV)
    n = sum(extend_lens)
    q = torch.randn(n, num_kv_heads * gqa, head_dim, device=DEV, dtype=torch.bfloat16)
    k_new, v_new = (
        torch.randn(n, num_kv_heads, head_dim, device=DEV, dtype=torch.bfloat16) for _ in range(2)
    )
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), device=DEV)
    ragged_extend_attention(
        q,
        k_new,
        v_new,
        qo_indptr,
        *layer.paging(req_rows),
        head_dim**-0.5,
        out,
        lse,
        max_extend_len=max(extend_lens),
    )
    want, want_lse = extend_reference(
        *as_f32((q, k_new, v_new, qo_indptr, *layer.paging(req_rows))), head_dim**-0.5
    )
    assert not out.isnan().any() and not lse.isnan().any()
    assert rel_err(out, want) < 1e-2 and rel_err(lse, want_lse) < 1e-3


def test_kv_write_full_size() -> None:
    num_kv_heads, _, head_dim = GEOMETRIES["llama"]
    page_size, extend_lens = 16, [3000, 700]
    lens = np.array([[100, 0, 33, 7, 1, 900, 15, 16], [0] * 8])
    kept = np.array([[1500, 31, 700, 90, 3000, 1, 16, 17], [350, 700, 1, 2, 3, 4, 5, 6]])
    layer = make_paged_layer(
        lens,
        num_kv_heads,
        1,
        page_size,
        head_dim,
        torch.bfloat16,
        3,
        spare_pages=2000,
        max_pages=300,
    )
    req_rows = torch.tensor([0, 1], dtype=torch.int32, device=DEV)
    for i in range(2):
        for g in range(num_kv_heads):
            first = -(-int(lens[i, g]) // page_size)
            for p in range(first, -(-int(lens[i, g] + kept[i, g]) // page_size)):
                layer.page_table[i, g, p] = layer.free_pages.pop()
    qo_indptr = torch.tensor(np.cumsum([0, *extend_lens]), dtype=torch.int32, device=DEV)
    k_new = torch.randn(sum(extend_lens), num_kv_heads, head_dim, device=DEV, dtype=torch.bfloat16)
    v_new = torch.randn_like(k_new)
    kept_idx = torch.zeros(2, num_kv_heads, 3000, dtype=torch.int64, device=DEV)
    groups = layer.group_of_head.tolist()
    for i in range(2):
        for h in range(num_kv_heads):
            k = int(kept[i, groups[h]])
            kept_idx[i, h, :k] = torch.randperm(extend_lens[i], device=DEV)[:k].sort().values
    kept_count = torch.tensor(kept, dtype=torch.int32, device=DEV)
    ref_k, ref_v = layer.k_pool.clone(), layer.v_pool.clone()
    args = (layer.page_table, layer.group_len, req_rows, layer.group_of_head, layer.column_of_head)
    kv_write_reference(k_new, v_new, qo_indptr, kept_idx, kept_count, ref_k, ref_v, *args)
    write_kept_kv(k_new, v_new, qo_indptr, kept_idx, kept_count, layer.k_pool, layer.v_pool, *args)
    assert torch.equal(layer.k_pool, ref_k) and torch.equal(layer.v_pool, ref_v)
