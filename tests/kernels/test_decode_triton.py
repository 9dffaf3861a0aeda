"""Triton ragged decode (length-fitted plan; AOT and uniform split tables) against the reference.

On CPU the kernels run under TRITON_INTERPRET=1 (see conftest.py), so shapes stay tiny.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_cases import DEVICE, TOL, make_paged_layer, random_lens, rel_err

from tangram_sglang.errors import KernelError
from tangram_sglang.grouping import HeadGrouping
from tangram_sglang.kernels.decode_attention import (
    BLOCK_N,
    decode_scratch,
    ragged_decode_attention,
)
from tangram_sglang.kernels.reference import decode_reference
from tangram_sglang.kernels.split_table import (
    CTAS_PER_SM,
    LayerSplits,
    batch_chunk_floor,
    build_split_table,
    fitted_splits,
)

DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def layer_table(
    group_of_head: torch.Tensor,
    ratios: list[float],
    batch_size: int,
    uniform: bool,
    max_splits: int = 64,
    num_sms: int = 2,
    ctas_per_sm: int = CTAS_PER_SM,
):
    """A split table for one layer whose heads have the given group ratios (2 SMs: few CTAs)."""
    num_kv_heads = group_of_head.numel()
    grouping = HeadGrouping.build(np.array([ratios]), 1, "per_layer")
    table = build_split_table(
        grouping,
        grouping.group_ratios(np.array([ratios])),
        num_sms,
        batch_size,
        uniform=uniform,
        max_splits=max_splits,
        ctas_per_sm=ctas_per_sm,
    )
    assert table.splits.shape == (1, num_kv_heads)
    return table.to(DEVICE).layer(0)


def chunk_floor_of(layer, req_rows, table) -> tuple[int, torch.Tensor]:
    """The batch-balanced plan's floor of ``req_rows`` (host twin) and its int32 [1] tensor."""
    goh = layer.group_of_head.cpu().numpy()
    lens = layer.group_len.cpu().numpy()[req_rows.cpu().numpy()][:, goh]
    floor = batch_chunk_floor(lens, table.launch_ctas)
    return floor, torch.tensor([floor], dtype=torch.int32, device=DEVICE)


def decode_and_check(layer, req_rows, q, table, out, mid_o, mid_lse, plan) -> None:
    """Run the Triton decode of ``layer`` with ``plan``; every output element written and within
    the dtype's tolerance of the torch reference."""
    args = layer.paging(req_rows)
    scale = q.shape[-1] ** -0.5
    floor = chunk_floor_of(layer, req_rows, table)[1] if plan == "batch" else None
    ragged_decode_attention(
        q, *args, table, scale, out, mid_o, mid_lse, plan=plan, chunk_floor=floor
    )
    want = decode_reference(
        q.float(), *(a.float() if a.is_floating_point() else a for a in args), scale
    )
    assert not out.isnan().any(), "unwritten or NaN output"
    assert rel_err(out, want) < TOL[q.dtype]


def run_case(
    dtype,
    page_size,
    head_dim,
    uniform,
    gqa=2,
    num_kv_heads=2,
    heads_per_group=2,
    max_len=40,
    seed=0,
    strided_out=False,
    plan="table",
):
    lens = random_lens(4, 3, max_len, page_size, seed)
    layer = make_paged_layer(lens, num_kv_heads, heads_per_group, page_size, head_dim, dtype, seed)
    req_rows = torch.tensor([3, 0, 1], dtype=torch.int32, device=DEVICE)
    bs, num_qo_heads = 3, num_kv_heads * gqa
    table = layer_table(layer.group_of_head, [0.9, 0.2, 0.5, 0.3][:num_kv_heads], bs, uniform)
    scratch_splits = max(table.max_splits, table.split_cap, table.batch_cap)
    q = torch.randn(bs, num_qo_heads, head_dim, device=DEVICE).to(dtype)
    if strided_out:
        out = torch.empty(bs, num_qo_heads + 3, head_dim, dtype=dtype, device=DEVICE)[:, 1:-2]
    else:
        out = torch.empty(bs, num_qo_heads, head_dim, dtype=dtype, device=DEVICE)
    out.fill_(float("nan"))
    mid_o, mid_lse = decode_scratch(bs + 1, num_qo_heads, scratch_splits + 1, head_dim, DEVICE)
    mid_o.fill_(float("nan"))
    mid_lse.fill_(float("nan"))
    decode_and_check(layer, req_rows, q, table, out, mid_o, mid_lse, plan)
    return layer, out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize(
    ("uniform", "plan"),
    [(False, "table"), (True, "table"), (False, "lengths"), (False, "batch")],
    ids=["aot", "uniform", "lengths", "batch"],
)
def test_decode_dtypes_and_plans(dtype, uniform, plan) -> None:
    run_case(dtype, page_size=16, head_dim=64, uniform=uniform, seed=1, plan=plan)


@pytest.mark.parametrize("page_size", [1, 4, 64], ids=lambda p: f"page{p}")
def test_decode_page_sizes(page_size: int) -> None:
    run_case(
        torch.bfloat16, page_size=page_size, head_dim=64, uniform=False, seed=page_size, max_len=70
    )


def test_decode_head_dim_128_gqa_4_strided_out() -> None:
    run_case(
        torch.bfloat16, 16, 128, uniform=False, gqa=4, heads_per_group=1, seed=5, strided_out=True
    )


@pytest.mark.parametrize("plan", ["table", "lengths", "batch"])
def test_decode_zero_length_group_gives_zeros(plan) -> None:
    lens = np.array([[0, 5]])
    layer = make_paged_layer(lens, 2, 1, 4, 64, torch.float32, seed=2)
    table = layer_table(layer.group_of_head, [0.5, 0.5], 1, uniform=False)
    q = torch.randn(1, 2, 64, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    splits = max(table.max_splits, table.split_cap, table.batch_cap)
    mid_o, mid_lse = decode_scratch(1, 2, splits, 64, DEVICE)
    rows = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    floor = chunk_floor_of(layer, rows, table)[1] if plan == "batch" else None
    ragged_decode_attention(
        q,
        layer.k_pool,
        layer.v_pool,
        layer.page_table,
        layer.group_len,
        rows,
        layer.group_of_head,
        layer.column_of_head,
        table,
        0.125,
        out,
        mid_o,
        mid_lse,
        plan=plan,
        chunk_floor=floor,
    )
    empty_head = int((layer.group_of_head == 0).nonzero()[0])
    assert torch.equal(out[0, empty_head], torch.zeros(64, device=DEVICE))
    assert not out.isnan().any()


def test_decode_launcher_rejects_small_scratch_and_bad_table() -> None:
    lens = np.array([[3, 5]])
    layer = make_paged_layer(lens, 2, 1, 4, 64, torch.float32, seed=3)
    table = layer_table(layer.group_of_head, [1.0, 0.1], 1, uniform=False)
    q = torch.randn(1, 2, 64, device=DEVICE)
    rows = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    args = (
        q,
        layer.k_pool,
        layer.v_pool,
        layer.page_table,
        layer.group_len,
        rows,
        layer.group_of_head,
        layer.column_of_head,
    )
    mid_o, mid_lse = decode_scratch(1, 2, table.max_splits - 1, 64, DEVICE)
    with pytest.raises(KernelError, match="mid_o"):
        ragged_decode_attention(
            *args, table, 0.125, torch.empty_like(q), mid_o, mid_lse, plan="table"
        )
    mid_o, mid_lse = decode_scratch(1, 2, table.split_cap - 1, 64, DEVICE)
    with pytest.raises(KernelError, match=r"mid_o .* splits >= \d+ \(plan='lengths'\)"):
        ragged_decode_attention(
            *args, table, 0.125, torch.empty_like(q), mid_o, mid_lse, plan="lengths"
        )
    bad = LayerSplits(
        table.splits.long(),
        table.cta_head,
        table.cta_split,
        table.num_ctas,
        table.max_splits,
        table.cta_budget,
        table.split_cap,
        table.fitted_ctas,
        table.batch_budget,
        table.batch_cap,
        table.batch_ctas,
        table.launch_ctas,
    )
    mid_o, mid_lse = decode_scratch(1, 2, max(table.max_splits, table.split_cap), 64, DEVICE)
    with pytest.raises(KernelError, match="table.splits"):
        ragged_decode_attention(*args, bad, 0.125, torch.empty_like(q), mid_o, mid_lse)
    with pytest.raises(
        KernelError, match="plan='ratios' must be one of 'batch', 'lengths', 'table'"
    ):
        ragged_decode_attention(
            *args, table, 0.125, torch.empty_like(q), mid_o, mid_lse, plan="ratios"
        )
    with pytest.raises(KernelError, match="out"):
        ragged_decode_attention(
            *args,
            table,
            0.125,
            torch.empty(1, 2, 64, dtype=torch.float16, device=DEVICE),
            mid_o,
            mid_lse,
        )
    with pytest.raises(KernelError, match=r"plan='batch' needs chunk_floor"):
        ragged_decode_attention(*args, table, 0.125, torch.empty_like(q), mid_o, mid_lse, "batch")
    mid_o, mid_lse = decode_scratch(1, 2, table.batch_cap, 64, DEVICE)
    for floor in (torch.zeros(1, dtype=torch.int64, device=DEVICE), torch.zeros(2).int()):
        with pytest.raises(KernelError, match="chunk_floor"):
            ragged_decode_attention(
                *args, table, 0.125, torch.empty_like(q), mid_o, mid_lse, "batch", floor
            )


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"sm_scale": float("nan")}, "sm_scale=nan must be a finite number > 0"),
        ({"sm_scale": "0.125"}, "sm_scale='0.125' must be a finite number > 0"),
        ({"group_of_head": [0, 1]}, "group_of_head must be a torch.Tensor"),
        ({"group_of_head": "2d"}, r"group_of_head has shape \[1, 2\], expected \[\*\]"),
        ({"k_pool": "3d"}, r"k_pool must be a tensor \[num_pages, H_p, page_size, D\]"),
    ],
    ids=["nan-scale", "str-scale", "list-heads", "2d-heads", "3d-pool"],
)
@pytest.mark.parametrize("launcher", ["triton", "reference"])
def test_decode_bad_scale_heads_and_pool_are_kernel_errors(change, match, launcher) -> None:
    """Each used to escape as a raw TypeError/IndexError/AttributeError or silent NaN output."""
    layer = make_paged_layer(np.array([[3, 5]]), 2, 1, 4, 64, torch.float32, seed=3)
    table = layer_table(layer.group_of_head, [1.0, 0.1], 1, uniform=False)
    kwargs = dict(
        q=torch.randn(1, 2, 64, device=DEVICE),
        k_pool=layer.k_pool,
        v_pool=layer.v_pool,
        page_table=layer.page_table,
        group_len=layer.group_len,
        req_rows=torch.zeros(1, dtype=torch.int32, device=DEVICE),
        group_of_head=layer.group_of_head,
        column_of_head=layer.column_of_head,
        sm_scale=0.125,
        out=torch.empty(1, 2, 64, device=DEVICE),
    )
    kwargs.update(change)
    if change.get("group_of_head") == "2d":
        kwargs["group_of_head"] = layer.group_of_head[None]
    if change.get("k_pool") == "3d":
        kwargs["k_pool"] = layer.k_pool[0]
    with pytest.raises(KernelError, match=match):
        if launcher == "reference":
            decode_reference(**kwargs)
        else:
            splits = max(table.max_splits, table.split_cap)
            mid_o, mid_lse = decode_scratch(1, 2, splits, 64, DEVICE)
            ragged_decode_attention(**kwargs, table=table, mid_o=mid_o, mid_lse=mid_lse)


# ---- length-fitted plan -------------------------------------------------------------------------


def run_fitted(
    lens,
    dtype=torch.float32,
    page_size=16,
    gqa=2,
    heads_per_group=1,
    max_splits=64,
    num_sms=2,
    head_dim=64,
    seed=0,
    plan="lengths",
    ctas_per_sm=CTAS_PER_SM,
):
    """Fitted decode (``plan`` "lengths" or "batch") of every row of ``lens [rows, groups]``
    against the reference.

    Also checks the kernel's plan against the numpy twin: stage 1 writes exactly the first
    ``fitted_splits(...)`` split slots of each head (poisoned scratch), nothing past them.
    Returns the twin's ``(splits, chunk)``, int64 ``[rows, H_kv]`` each (tokens per split).
    """
    lens = np.asarray(lens)
    rows, num_groups = lens.shape
    num_kv_heads = num_groups * heads_per_group
    layer = make_paged_layer(lens, num_kv_heads, heads_per_group, page_size, head_dim, dtype, seed)
    req_rows = torch.arange(rows, dtype=torch.int32, device=DEVICE).flip(0)
    ratios = np.linspace(0.9, 0.1, num_kv_heads).tolist()
    table = layer_table(layer.group_of_head, ratios, rows, False, max_splits, num_sms, ctas_per_sm)
    if plan == "batch":
        budget, cap, grid = table.batch_budget, table.batch_cap, table.batch_ctas
        floor = chunk_floor_of(layer, req_rows, table)[0]
    else:
        budget, cap, grid, floor = table.cta_budget, table.split_cap, table.fitted_ctas, 0
    num_qo_heads = num_kv_heads * gqa
    q = torch.randn(rows, num_qo_heads, head_dim, device=DEVICE).to(dtype)
    out = torch.full_like(q, float("nan"))
    mid_o, mid_lse = decode_scratch(rows, num_qo_heads, cap + 1, head_dim, DEVICE)
    mid_lse.fill_(float("nan"))
    decode_and_check(layer, req_rows, q, table, out, mid_o, mid_lse, plan)
    head_lens = lens[req_rows.cpu().numpy()][:, layer.group_of_head.cpu().numpy()]
    splits, chunk = fitted_splits(head_lens, budget, cap, BLOCK_N, floor)
    assert (splits <= cap).all() and splits.sum(axis=1).max() <= grid
    written = (~mid_lse.isnan()).sum(dim=2).cpu().numpy()  # [rows, num_qo_heads]
    assert (written == np.repeat(splits, gqa, axis=1)).all(), "kernel plan != numpy twin"
    return splits, chunk


DTYPES_FIT = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES_FIT, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("gqa", [1, 4], ids=lambda g: f"gqa{g}")
@pytest.mark.parametrize("page_size", [1, 16], ids=lambda p: f"page{p}")
def test_fitted_equal_lengths_on_all_groups(dtype, gqa, page_size) -> None:
    """The uncompressed-tail case: every group of a row holds the same tokens."""
    splits, _ = run_fitted(
        [[70, 70, 70, 70], [33, 33, 33, 33]], dtype, page_size, gqa, seed=gqa + page_size
    )
    assert (splits == splits[:, :1]).all()  # equal lengths -> equal splits (balanced)
    assert splits[0, 0] > 1


def test_fitted_lengths_proportional_to_ratios() -> None:
    splits, _ = run_fitted([[96, 48, 24, 12]], page_size=4, num_sms=4)
    head_lens = np.sort(splits[0])[::-1]
    assert head_lens[0] > head_lens[-1]  # the long group gets more splits


def test_fitted_one_group_empty() -> None:
    run_fitted([[0, 50, 50], [50, 0, 1]], page_size=4)


def test_fitted_one_group_much_longer_hits_the_split_cap() -> None:
    splits, chunk = run_fitted([[300, 2, 5, 1]], page_size=16, max_splits=3, num_sms=16)
    # N = 192 CTAs (12 per SM on 16 SMs) would allow 2-token chunks; the cap of 3 splits sets
    # ceil(300 / 3) -> 128.
    assert splits.max() == 3 and chunk.max() == 4 * BLOCK_N


def test_fitted_rows_of_very_different_lengths() -> None:
    run_fitted([[1, 1, 2], [200, 180, 150], [40, 0, 90]], dtype=torch.bfloat16, page_size=16)


def test_fitted_several_heads_per_group() -> None:
    run_fitted([[64, 17], [5, 120]], heads_per_group=2, page_size=4, gqa=2)


def test_batch_plan_splits_a_long_row_among_short_ones_finer() -> None:
    """One long row among short ones (1 SM, bucket 4: a row budget of 3 CTAs under the
    length-fitted plan; 16 and a floor of 71 tokens under the batch-balanced one): the batch
    plan splits the long row into more, shorter chunks, the short rows stay at one CTA."""
    lens = [[400, 400], [8, 8], [8, 8], [8, 8]]
    fit, fit_chunk = run_fitted(lens, page_size=16, num_sms=1, seed=7)
    bal, bal_chunk = run_fitted(lens, page_size=16, num_sms=1, seed=7, plan="batch")
    long_row = 3  # req_rows are flipped: the first row of lens is batch entry 3
    assert bal[long_row].sum() > fit[long_row].sum()
    assert bal_chunk[long_row].max() < fit_chunk[long_row].max()
    assert (bal[:long_row] == 1).all()


def test_batch_plan_with_more_ctas_per_sm_splits_finer_and_stays_exact() -> None:
    """``TANGRAM_DECODE_CTAS_PER_SM`` above the default (28 against 12): the launch
    aims for more CTAs, so the batch plan's floor falls and equal rows split into more chunks;
    the kernel still matches the reference and writes the numpy twin's split slots."""
    lens = [[200, 200]] * 4
    default, default_chunk = run_fitted(lens, page_size=16, num_sms=1, seed=3, plan="batch")
    wide, wide_chunk = run_fitted(
        lens, page_size=16, num_sms=1, seed=3, plan="batch", ctas_per_sm=28
    )
    assert (wide > default).all() and wide_chunk.max() < default_chunk.max()


@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    lens=st.lists(st.lists(st.integers(0, 130), min_size=3, max_size=3), min_size=1, max_size=3),
    max_splits=st.integers(1, 6),
    num_sms=st.integers(1, 8),
)
@pytest.mark.parametrize("plan", ["lengths", "batch"])
def test_fitted_random_lengths(lens, max_splits, num_sms, plan) -> None:
    run_fitted(lens, page_size=8, max_splits=max_splits, num_sms=num_sms, plan=plan)


def test_numpy_twins_use_the_kernel_block() -> None:
    """bench.split_balance (and the plan's unit tests) copy BLOCK_N to stay free of triton."""
    from tangram_sglang.bench import split_balance

    assert split_balance.BLOCK_N == BLOCK_N
