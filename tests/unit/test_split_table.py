"""Split plans: the AOT table (proportionality, exact coverage of (head, split), the CTA-count rule)
and the length-fitted rule's numpy twin (exact token coverage, the grid bound, the split cap)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram_sglang.bench.split_balance import BLOCK_N  # the kernel's, without importing triton
from tangram_sglang.bench.synthetic import skewed_profile
from tangram_sglang.errors import ConfigError, KernelError
from tangram_sglang.grouping import HeadGrouping
from tangram_sglang.kernels.split_table import (
    CTAS_PER_SM,
    MAX_SPLITS_PER_HEAD,
    batch_chunk_floor,
    build_split_table,
    build_split_tables,
    cta_map,
    fitted_cta_spans,
    fitted_splits,
    layer_splits,
)


def table_for(
    ratio, num_sms=132, batch_size=8, uniform=False, heads_per_group=1, scope="per_layer"
):
    ratio = np.asarray(ratio, dtype=np.float64)
    grouping = HeadGrouping.build(ratio, heads_per_group, scope)
    return build_split_table(grouping, grouping.group_ratios(ratio), num_sms, batch_size, uniform)


def test_design_example_100_50_25_gives_8_4_2() -> None:
    # docs/design.md §3.3: 100% -> 8 splits, 50% -> 4, 25% -> 2 when the CTA budget is 14 per row.
    splits = layer_splits(np.array([1.0, 0.5, 0.25]), target_ctas=14, uniform=False)
    assert splits.tolist() == [8, 4, 2]


def test_splits_proportional_to_group_ratio() -> None:
    profile = skewed_profile("llama3-8b", 0.25, heads_per_group=1, scope="per_layer", seed=3)
    grouping = profile.grouping
    table = build_split_table(grouping, profile.group_ratios, num_sms=132, batch_size=4)
    ratios = profile.group_ratios[grouping.cluster_of]
    target = max(8, math.ceil(CTAS_PER_SM * 132 / 4))
    for layer in range(grouping.num_layers):
        splits = table.splits[layer].numpy()
        r = ratios[layer]
        scale = min(target / r.sum(), MAX_SPLITS_PER_HEAD / r.max())
        # rounding only: each head within 0.5 split of the exact proportion (or the floor of 1)
        expected = np.maximum(r * scale, 1.0)
        assert np.all(np.abs(splits - expected) <= 0.5 + 1e-9)


@pytest.mark.parametrize("uniform", [False, True], ids=["aot", "uniform"])
@pytest.mark.parametrize("batch_size", [1, 8, 32, 128, 1000])
def test_every_head_split_covered_exactly_once(uniform: bool, batch_size: int) -> None:
    profile = skewed_profile("llama3-8b", 0.5, heads_per_group=4, scope="global", seed=1)
    table = build_split_table(profile.grouping, profile.group_ratios, 132, batch_size, uniform)
    for layer in range(profile.model.num_layers):
        view = table.layer(layer)
        pairs = sorted(zip(view.cta_head.tolist(), view.cta_split.tolist(), strict=True))
        expected = sorted((h, s) for h, n in enumerate(view.splits.tolist()) for s in range(n))
        assert pairs == expected
        assert view.num_ctas == len(expected) and view.max_splits == max(view.splits.tolist())
        assert (table.cta_head[layer, view.num_ctas :] == -1).all()


def test_total_cta_rule_and_uniform_baseline() -> None:
    ratio = [[0.9, 0.5, 0.2, 0.1, 0.05, 0.05, 0.3, 0.7]]
    for batch_size in (1, 4, 16, 64, 256):
        target = max(8, math.ceil(CTAS_PER_SM * 132 / batch_size))
        aot = table_for(ratio, batch_size=batch_size)
        total = aot.num_ctas[0]
        uniform = table_for(ratio, batch_size=batch_size, uniform=True)
        per_head = min(max(round(total / 8), 1), MAX_SPLITS_PER_HEAD)
        assert uniform.splits.tolist() == [[per_head] * 8]  # same CTA budget, split evenly
        assert abs(uniform.num_ctas[0] - total) <= 4
        # about `target` CTAs (rounding, the floor of 1 split, the cap on the longest head)
        assert total <= target + 8
        assert aot.splits.max() <= MAX_SPLITS_PER_HEAD and aot.splits.min() >= 1
        if target <= 8 * 0.9 / sum(ratio[0]) * MAX_SPLITS_PER_HEAD:
            assert total >= target - 8


def test_cta_order_heaviest_first() -> None:
    heads, splits_idx = cta_map(np.array([1, 4, 2]), np.array([0.1, 0.8, 0.6]))
    work = np.array([0.1, 0.2, 0.3])[heads]
    assert list(work) == sorted(work, reverse=True)
    assert heads.tolist() == [2, 2, 1, 1, 1, 1, 0]
    assert splits_idx.tolist() == [0, 1, 0, 1, 2, 3, 0]


def test_buckets_pick_smallest_bucket_at_least_batch() -> None:
    ratio = np.array([[0.9, 0.1], [0.5, 0.5]])
    grouping = HeadGrouping.build(ratio, 1, "per_layer")
    tables = build_split_tables(grouping, grouping.group_ratios(ratio), 16, max_batch_size=24)
    assert [t.batch_size for t in tables.tables] == [1, 2, 4, 8, 16, 24]
    assert tables.for_batch(3).batch_size == 4
    assert tables.for_batch(24).batch_size == 24
    assert tables.for_batch(100).batch_size == 24
    assert tables.max_splits == max(t.max_splits for t in tables.tables)
    assert tables.scratch_splits == max(max(t.max_splits, t.split_cap) for t in tables.tables)
    assert tables.for_batch(1).num_ctas[0] >= tables.for_batch(24).num_ctas[0]


def test_bad_arguments_raise_config_error() -> None:
    ratio = np.array([[0.5, 0.25]])
    grouping = HeadGrouping.build(ratio, 1, "per_layer")
    with pytest.raises(ConfigError, match="num_sms"):
        build_split_table(grouping, grouping.group_ratios(ratio), 0, 1)
    with pytest.raises(ConfigError, match=r"num_sms=2\.5 must be a whole number"):
        build_split_table(grouping, grouping.group_ratios(ratio), 2.5, 1)
    with pytest.raises(ConfigError, match="group_ratios"):
        build_split_table(grouping, np.array([0.5]), 132, 1)
    with pytest.raises(ConfigError, match="max_batch_size"):
        build_split_tables(grouping, grouping.group_ratios(ratio), 132, 0)


def check_fitted_plan(lens, cta_budget, split_cap, block_n=BLOCK_N, floor=0) -> None:
    """The fitted rules on one row (``floor`` > 0: the batch-balanced plan): exact coverage,
    the grid bound, the cap, the balance."""
    lens = np.asarray(lens, dtype=np.int64)
    num_kv_heads = lens.size
    grid = min(cta_budget + num_kv_heads, num_kv_heads * split_cap)  # LayerSplits.fitted_ctas
    splits, head_chunk = fitted_splits(lens, cta_budget, split_cap, block_n, floor)
    assert splits.sum() <= grid, "the static grid must hold every split"
    assert (splits >= 1).all() and (splits <= split_cap).all()
    head, start, end = fitted_cta_spans(lens, cta_budget, split_cap, block_n, grid, floor)
    for h in range(num_kv_heads):
        mine = head == h
        assert mine.sum() == splits[h]
        covered = np.zeros(lens[h], dtype=np.int64)
        for a, b in zip(start[mine], end[mine], strict=True):
            assert 0 <= a <= b <= lens[h]
            covered[a:b] += 1
        assert (covered == 1).all(), f"head {h}: tokens covered {covered.tolist()}"
    assert (start[head < 0] == end[head < 0]).all()  # idle CTAs do nothing
    assert (head[: splits.sum()] >= 0).all() and (head[splits.sum() :] < 0).all()
    busy = head >= 0
    assert ((end - start)[busy] <= head_chunk[head[busy]]).all() and (
        head_chunk % block_n == 0
    ).all()
    assert (end[busy] > start[busy]).sum() == (splits * (lens > 0)).sum()  # no empty split
    # balance: every CTA within one block of total / N, unless the split cap or the floor binds
    need = max(-(-int(lens.sum()) // cta_budget), -(-int(lens.max()) // split_cap), floor, 1)
    assert head_chunk.max() < need + block_n


@settings(max_examples=300, deadline=None)
@given(
    lens=st.lists(st.integers(0, 5000), min_size=1, max_size=12),
    cta_budget=st.integers(1, 1100),
    split_cap=st.integers(1, 64),
    block_n=st.sampled_from([1, 16, 32]),
    floor=st.one_of(st.just(0), st.integers(1, 3000)),
)
def test_fitted_rule_covers_every_token_once_within_the_grid(
    lens, cta_budget, split_cap, block_n, floor
) -> None:
    check_fitted_plan(lens, cta_budget, split_cap, block_n, floor)


@pytest.mark.parametrize(
    "lens",
    [[800] * 8, [0] * 8, [0, 1, 0, 31, 32, 33, 64, 65], [100000, 1, 1, 1], [7]],
    ids=["equal", "all-empty", "block-edges", "one-long", "one-head"],
)
def test_fitted_rule_edge_rows(lens) -> None:
    for cta_budget in (1, 8, 17, 1056):
        check_fitted_plan(lens, cta_budget, 64)


def test_fitted_equal_lengths_split_evenly_and_table_carries_the_budget() -> None:
    ratio = np.array([[0.9, 0.5, 0.2, 0.1, 0.05, 0.05, 0.3, 0.7]])
    table = table_for(ratio, batch_size=64)
    target = max(8, math.ceil(CTAS_PER_SM * 132 / 64))
    assert table.cta_budget == target and table.split_cap == min(MAX_SPLITS_PER_HEAD, target)
    view = table.layer(0)
    assert view.fitted_ctas == min(target + 8, 8 * view.split_cap)
    splits, chunk = fitted_splits(np.full(8, 800), view.cta_budget, view.split_cap, BLOCK_N)
    assert (splits == splits[0]).all()  # the static table gives the 0.05 heads 1 split here
    assert splits.sum() <= view.fitted_ctas and chunk.max() <= -(-800 * 8 // target) + BLOCK_N
    assert table.splits[0].min() == 1 and table.scratch_splits >= table.split_cap


def test_split_balance_report_on_the_llama_profile() -> None:
    """bench.split_balance: equal lengths unbalance the table, not the length-fitted plan."""
    from tangram_sglang.bench import split_balance
    from tangram_sglang.integration.profile_loader import CALIBRATION_DIR
    from tangram_sglang.profile import BudgetProfile

    profile = BudgetProfile.load(CALIBRATION_DIR / split_balance.DEFAULT_PROFILE)
    rows = {r["shape"]: r for r in split_balance.balance_rows(profile, 132, buckets=(64,))}
    assert rows["whole"]["table_mean"] > 1.4 and rows["whole"]["lengths_mean"] < 1.1
    for row in rows.values():
        assert row["lengths_mean"] <= row["table_mean"] + 1e-9
        # N + H_kv at bucket 64 on 132 SMs (N = ceil(CTAS_PER_SM * 132 / 64))
        assert row["lengths_ctas"] <= math.ceil(CTAS_PER_SM * 132 / 64) + 8
    assert "| whole | 64 |" in split_balance.format_rows(list(rows.values()))


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--profile", "/nonexistent/profile.json"], "--profile: /nonexistent/profile.json"),
        (["--num-sms", "0"], "--num-sms 0 must be >= 1"),
    ],
)
def test_split_balance_bad_flags_give_one_line(argv, needle, capsys) -> None:
    """A missing profile or a bad SM count: exit status 2 and one line naming the flag."""
    from tangram_sglang.bench import split_balance

    try:
        status = split_balance.main(argv)
    except SystemExit as exc:  # argparse's parser.error
        status = exc.code
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and needle in err[-1] and "Traceback" not in "\n".join(err)


@pytest.mark.parametrize("value", ["0", "65", "12.0", "abc", "9" * 5000])
def test_bench_clis_refuse_a_bad_ctas_per_sm_before_any_output(value, monkeypatch, capsys):
    """``TANGRAM_DECODE_CTAS_PER_SM`` that a server would refuse: ``bench.split_balance`` and
    ``bench.decode_step`` (under every plan, not only ``batch``, which reads it) exit 2 with one
    line naming the variable, nothing printed before it, the value cut short."""
    from tangram_sglang.bench import decode_step, split_balance
    from tangram_sglang.config import DECODE_CTAS_ENV
    from tangram_sglang.integration.profile_loader import CALIBRATION_DIR

    monkeypatch.setenv(DECODE_CTAS_ENV, value)
    assert split_balance.main([]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith("error: TANGRAM_DECODE_CTAS_PER_SM=") and len(err) < 200
    profile = str(CALIBRATION_DIR / split_balance.DEFAULT_PROFILE)
    for plan in ("table", "lengths", "batch"):
        argv = ["--profile", profile, "--batch", "2", "--prompt", "64", "--steps", "3"]
        with pytest.raises(SystemExit) as exc:
            decode_step.main([*argv, "--plan", plan])
        out, err = capsys.readouterr()
        assert exc.value.code == 2 and out == ""
        assert "error: TANGRAM_DECODE_CTAS_PER_SM=" in err.strip().splitlines()[-1]


def test_batch_chunk_floor_spreads_the_batch_over_the_launch() -> None:
    lens = np.array([[3000] * 8] + [[200] * 8] * 63)
    assert batch_chunk_floor(lens, 1056) == -(-(3000 * 8 + 63 * 200 * 8) // 1056)
    assert batch_chunk_floor(np.zeros((0, 8), np.int64), 1056) == 0
    assert batch_chunk_floor(lens, 1) == int(lens.sum())
    for bad in (0, -3, 2.5, True, np.True_, None, float("nan")):
        with pytest.raises(KernelError, match="launch_ctas"):
            batch_chunk_floor(lens, bad)
    for bad in (-lens, lens.astype(float), lens[None], lens[0]):
        with pytest.raises(KernelError, match="lens must be whole numbers >= 0"):
            batch_chunk_floor(bad, 1056)
    assert batch_chunk_floor(np.full((2, 2), 2**62), 1) == 2**64  # no int64 wrap


def test_batch_plan_splits_the_long_row_of_a_chat_batch_finer() -> None:
    """64 rows at ratio 1.0: one 3,000-token row among 200-token rows. The length-fitted plan
    (a budget of 25 CTAs per row at bucket 64, 12 CTAs per SM) walks the long row's heads in 4
    chunks of 750 tokens; the batch-balanced plan splits it in 8 (its widened row budget) and
    leaves the short rows no finer than the floor, and the whole launch stays near the CTAs it
    aims for."""
    table = table_for(np.ones((1, 8)), batch_size=64)
    view = table.layer(0)
    budget = math.ceil(CTAS_PER_SM * 132 / 64)
    assert view.launch_ctas == CTAS_PER_SM * 132 and view.batch_budget == max(budget, 8 * 8)
    assert view.batch_cap == min(MAX_SPLITS_PER_HEAD, view.batch_budget)
    assert view.batch_ctas == min(view.batch_budget + 8, 8 * view.batch_cap)
    assert table.scratch_splits >= view.batch_cap
    lens = np.array([[3000] * 8] + [[200] * 8] * 63)
    floor = batch_chunk_floor(lens, view.launch_ctas)
    fit, fit_chunk = fitted_splits(lens, view.cta_budget, view.split_cap, BLOCK_N)
    bal, bal_chunk = fitted_splits(lens, view.batch_budget, view.batch_cap, BLOCK_N, floor)
    # the row budget at bucket 64 splits each 3,000-token head in 4; the batch plan in 8 of 375
    assert (fit[0] == 4).all() and (bal[0] == 8).all()
    assert fit_chunk[0].max() > bal_chunk[0].max() and bal_chunk[0].max() <= 400
    assert bal[0].sum() <= view.batch_ctas
    # a row's chunk is never below the floor, so no head splits more than ceil(L / floor) times
    # (a 200-token head: 3 splits at the default's floor of 79 tokens, rounded up to a chunk of
    # 96; each split's share is then evened out)
    chunk = -(-floor // BLOCK_N) * BLOCK_N
    assert (bal[1:] <= -(-200 // floor)).all() and (bal[1:] == -(-200 // chunk)).all()
    assert bal.sum() <= view.launch_ctas + lens.size  # the launch's CTAs: about its aim
    check_fitted_plan(lens[0], view.batch_budget, view.batch_cap, BLOCK_N, floor)


def test_split_balance_chat_batch_report(monkeypatch):
    """bench.split_balance's chat-batch table, at 8 CTAs per SM: at 64 and 128 rows the
    batch-balanced plan's longest CTA is within 15% of the launch's balanced share, the static
    table's over 3x and the row-balanced plan's in between. At the default (12 per SM, more
    CTAs than one wave holds) the share is smaller and the order still holds; the rows are
    seeded."""
    from tangram_sglang.bench import split_balance
    from tangram_sglang.config import DECODE_CTAS_ENV
    from tangram_sglang.integration.profile_loader import CALIBRATION_DIR
    from tangram_sglang.profile import BudgetProfile

    profile = BudgetProfile.load(CALIBRATION_DIR / split_balance.DEFAULT_PROFILE)
    monkeypatch.setenv(DECODE_CTAS_ENV, "8")
    rows = split_balance.batch_balance_rows(profile, 132, buckets=(64, 128), means=(600,))
    for r in rows:
        assert r["batch_ratio"] < 1.15 and r["table_ratio"] > 3.0
        assert r["batch_ratio"] < r["lengths_ratio"] < r["table_ratio"]
        # the floor keeps the short rows whole-ish: about the CTAs a launch aims for
        assert r["batch_ctas"] <= 8 * 132 + r["bucket"] * 8
    monkeypatch.delenv(DECODE_CTAS_ENV)
    for r in split_balance.batch_balance_rows(profile, 132, buckets=(64, 128), means=(600,)):
        assert r["batch_ratio"] < r["lengths_ratio"] <= r["table_ratio"]
        assert r["batch_ctas"] <= CTAS_PER_SM * 132 + r["bucket"] * 8
    lens = split_balance.chat_batch_lengths(64, 600)
    assert lens.min() >= 64 and (lens == split_balance.chat_batch_lengths(64, 600)).all()
    assert "| 64 | 600 |" in split_balance.format_batch_rows(rows)


def test_batch_plan_honours_the_tables_split_limit():
    """build_split_table(max_splits=4) caps every plan's splits of one head, batch's too."""
    ratio = np.ones((1, 8))
    grouping = HeadGrouping.build(ratio, 1, "per_layer")
    view = build_split_table(grouping, grouping.group_ratios(ratio), 132, 64, max_splits=4).layer(0)
    assert view.batch_cap == 4 and view.batch_ctas == min(view.batch_budget + 8, 8 * 4)
    lens = np.array([[30000] * 8] + [[50] * 8] * 63)
    splits, _ = fitted_splits(
        lens, view.batch_budget, view.batch_cap, BLOCK_N, batch_chunk_floor(lens, 1056)
    )
    assert splits.max() <= 4


def test_ctas_per_sm_sets_the_row_budget_and_the_launch() -> None:
    """``ctas_per_sm`` (``TANGRAM_DECODE_CTAS_PER_SM``) replaces :data:`CTAS_PER_SM` in the row
    budget ``max(H_kv, ceil(c * S / B))`` and in the batch plan's ``launch_ctas``, so the batch
    plan's floor at cliff-64's shape (23 rows of 16k tokens, 8 KV heads, the 32-row bucket)
    gives 15 splits per head at 28 CTAs per SM (2,760 CTAs, 6.97 waves of 3 x 132), 8 at the
    default 12 (1,472 CTAs, 3.72 waves) and 6 at 8 (1,104, 2.79 waves)."""
    ratio = np.ones((2, 8))
    grouping = HeadGrouping.build(ratio, 1, "per_layer")
    ratios = grouping.group_ratios(ratio)
    default = build_split_table(grouping, ratios, 132, 32)
    assert CTAS_PER_SM == 12
    assert default.launch_ctas == 12 * 132 and default.cta_budget == 50
    eight = build_split_table(grouping, ratios, 132, 32, ctas_per_sm=8)
    assert eight.launch_ctas == 8 * 132 and eight.cta_budget == 33
    wide = build_split_table(grouping, ratios, 132, 32, ctas_per_sm=28)
    assert wide.launch_ctas == 28 * 132 and wide.cta_budget == math.ceil(28 * 132 / 32)
    assert build_split_table(grouping, ratios, 132, 32, ctas_per_sm=1).cta_budget == 8  # H_kv
    lens = np.full((23, 8), 16384)
    for table, splits in ((eight, 6), (default, 8), (wide, 15)):
        view = table.layer(0)
        floor = batch_chunk_floor(lens, view.launch_ctas)
        got, _ = fitted_splits(lens, view.batch_budget, view.batch_cap, BLOCK_N, floor)
        assert (got == splits).all()
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ConfigError, match="ctas_per_sm"):
            build_split_table(grouping, ratios, 132, 32, ctas_per_sm=bad)
    # every bucket a server builds takes it
    tables = build_split_tables(grouping, ratios, 132, 64, ctas_per_sm=28)
    assert {t.launch_ctas for t in tables.tables} == {28 * 132}
    assert [t.cta_budget for t in tables.tables] == [
        max(8, math.ceil(28 * 132 / t.batch_size)) for t in tables.tables
    ]
