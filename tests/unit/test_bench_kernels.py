"""CPU-testable parts of the kernel benchmark: case plan, memory skips, summary, JSON."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from tangram_sglang.bench import kernels as bench
from tangram_sglang.bench.synthetic import skewed_profile
from tangram_sglang.profile import kept_len


def profile():
    return skewed_profile("llama3-8b", 0.25, heads_per_group=1, scope="per_layer", seed=0)


def test_plan_covers_the_issue_grid_with_rescaled_budgets() -> None:
    cases = bench.plan_cases(profile())
    assert len(cases) == 4 * 3 * 2 * 2
    assert {(c.batch, c.context, c.budget, c.shape) for c in cases} == {
        (b, n, r, s)
        for b in bench.BATCHES
        for n in bench.CONTEXTS
        for r in bench.BUDGETS
        for s in bench.DEFAULT_SHAPES
    }
    for case in cases:
        if case.shape == "equal":  # the chat shape: every head keeps the same tokens
            assert len(set(case.kept_tokens)) == 1
            twin = next(
                c
                for c in cases
                if (c.shape, c.batch, c.context, c.budget)
                == ("ratios", case.batch, case.context, case.budget)
            )
            assert abs(sum(case.kept_tokens) - sum(twin.kept_tokens)) <= 4
            continue
        assert len(case.kept_tokens) == bench.NUM_KV_HEADS
        assert abs(np.mean(case.ratios) - case.budget) < 1e-6
        assert max(case.ratios) / min(case.ratios) > 2  # skewed heads
        assert case.kept_kv_bytes == case.batch * sum(case.kept_tokens) * 128 * 2 * 2
        assert case.full_kv_bytes == case.batch * case.context * 8 * 128 * 2 * 2
        assert not case.skipped  # the default --max-gib fits every case on the H200


def test_skewed_rows_are_seeded_lognormal_up_to_the_context() -> None:
    prof = profile()
    cases = bench.plan_cases(
        prof, batches=(1, 64), contexts=(2048, 4096), budgets=(0.25,), shapes=("skewed",)
    )
    assert len(cases) == 4 and {c.shape for c in cases} == {"skewed"}
    for case in cases:
        rows = case.row_contexts
        assert len(rows) == case.batch and max(rows) == case.context
        assert min(rows) >= bench.MIN_ROW_CONTEXT
        if case.batch == 64:  # a chat batch: most requests well below the longest
            assert np.median(rows) < case.context / 2 and len(set(rows)) > 32
    again = bench.plan_cases(
        prof, batches=(1, 64), contexts=(2048, 4096), budgets=(0.25,), shapes=("skewed",)
    )
    assert [c.row_contexts for c in again] == [c.row_contexts for c in cases]  # seeded
    # one draw per batch size, scaled to each context (up to rounding)
    long, short = bench.skewed_row_contexts(64, 4096), bench.skewed_row_contexts(64, 2048)
    assert max(abs(a - 2 * b) for a, b in zip(long, short, strict=True)) <= 1
    # the other shapes keep one context for every request
    flat = bench.plan_cases(prof, batches=(8,), contexts=(2048,), budgets=(0.25,))
    assert all(c.row_contexts == [] for c in flat)


def test_skewed_bytes_are_per_row_sums() -> None:
    prof = profile()
    _, ratios = bench.layer_ratios(prof, 0.25)
    case = bench.make_case(64, 2048, 0.25, ratios, prof.sink_tokens, prof.recent_window, "skewed")
    per_row = [
        [kept_len(n, float(r), prof.sink_tokens, prof.recent_window) for r in ratios]
        for n in case.row_contexts
    ]
    token_bytes = 128 * 2 * 2
    assert case.row_kept().tolist() == per_row
    assert case.kept_kv_bytes == sum(map(sum, per_row)) * token_bytes
    assert case.full_kv_bytes == sum(case.row_contexts) * 8 * token_bytes
    assert case.full_kv_bytes < 64 * 2048 * 8 * token_bytes
    # the longest request's kept tokens size the pages of every request
    assert case.kept_tokens == [max(col) for col in zip(*per_row, strict=True)]
    assert case.kept_tokens == [kept_len(2048, float(r), 4, 64) for r in ratios]
    assert case.peak_bytes >= 64 * 2048 * 8 * token_bytes * case.replicas_full
    assert case.replicas_kept * case.kept_kv_bytes >= bench.ROTATE_BYTES


def test_budget_one_keeps_every_token() -> None:
    prof = profile()
    _, ratios = bench.layer_ratios(prof, 1.0)
    assert ratios.tolist() == [1.0] * bench.NUM_KV_HEADS
    for shape in bench.SHAPES:
        (case,) = bench.plan_cases(
            prof, batches=(64,), contexts=(131072,), budgets=(1.0,), shapes=(shape,)
        )
        assert case.kept_tokens == [131072] * bench.NUM_KV_HEADS
        assert case.row_kept().tolist() == [[n] * 8 for n in case.contexts()]
        assert case.kept_kv_bytes == case.full_kv_bytes


def test_small_inputs_are_replicated_past_l2_and_big_cases_skipped() -> None:
    cases = bench.plan_cases(
        profile(),
        batches=(1, 128),
        contexts=(8192, 131072),
        budgets=(0.25,),
        max_gib=16,
        shapes=("ratios",),
    )
    small = next(c for c in cases if c.batch == 1 and c.context == 8192)
    assert small.replicas_kept * small.kept_kv_bytes >= bench.ROTATE_BYTES
    assert small.replicas_full * small.full_kv_bytes >= bench.ROTATE_BYTES
    big = next(c for c in cases if c.batch == 128 and c.context == 131072)
    assert big.replicas_kept == big.replicas_full == 1
    assert "--max-gib 16" in big.skipped


def fake_results(case, aot, uniform, full, frac, lengths=None, batch=None):
    case.results = {
        "lengths_ms": lengths or aot,
        "batch_ms": batch or aot,
        "aot_ms": aot,
        "uniform_ms": uniform,
        "sglang_full_kv_ms": full,
        "flashinfer_ms": 2 * aot,
        "aot_bw_fraction": frac,
    }


def test_summary_geomeans_and_median() -> None:
    cases = bench.plan_cases(profile(), batches=(8, 32), contexts=(8192,), budgets=(0.25, 0.5))
    ratio_cases = [c for c in cases if c.shape == "ratios"]
    for case, (aot, uni, full, frac) in zip(
        ratio_cases,
        [(1.0, 2.0, 4.0, 0.7), (1.0, 1.0, 3.0, 0.8), (2.0, 8.0, 4.0, 0.9), (1.0, 1.0, 1.0, 0.6)],
        strict=True,
    ):
        fake_results(case, aot, uni, full, frac)
    for case in cases:
        if case.shape == "equal":  # kept out of the headline numbers
            fake_results(case, 3.0, 100.0, 0.01, 0.01, lengths=2.0)
    summary = bench.summarize(cases)
    assert math.isclose(summary["lengths_vs_aot_speedup_geomean"], 1.0)
    assert math.isclose(summary["lengths_vs_aot_speedup_equal_geomean"], 1.5)
    assert math.isclose(summary["aot_vs_uniform_speedup_geomean"], (2 * 1 * 4 * 1) ** 0.25)
    # 25% cases are batches 8 and 32; only batch >= 32 counts for the target
    assert math.isclose(summary["tangram_vs_full_kv_speedup_at_25pct_geomean"], 3.0)
    assert math.isclose(
        summary["tangram_vs_full_kv_speedup_at_25pct_all_batches_geomean"], math.sqrt(4.0 * 3.0)
    )
    assert math.isclose(summary["bandwidth_fraction_median"], 0.75)
    assert math.isclose(summary["aot_vs_flashinfer_plan_run_speedup_geomean"], 2.0)
    assert math.isclose(summary["batch_vs_aot_speedup_geomean"], 1.0)
    assert summary["batch_vs_aot_speedup_skewed_geomean"] is None  # no skewed case ran


def test_summary_and_table_of_skewed_cases_and_the_batch_column() -> None:
    cases = bench.plan_cases(
        profile(), batches=(64,), contexts=(2048, 4096), budgets=(1.0,), shapes=("skewed",)
    )
    fake_results(cases[0], 4.0, 4.0, 8.0, 0.5, lengths=2.0, batch=1.0)
    fake_results(cases[1], 4.0, 4.0, 8.0, 0.5, lengths=4.0, batch=4.0)
    summary = bench.summarize(cases)
    assert summary["num_ran"] == 0  # the headline numbers stay over the ratios cases
    assert summary["num_ran_by_shape"] == {"ratios": 0, "equal": 0, "skewed": 2}
    assert math.isclose(summary["lengths_vs_aot_speedup_skewed_geomean"], math.sqrt(2.0))
    assert math.isclose(summary["batch_vs_aot_speedup_skewed_geomean"], 2.0)
    assert summary["batch_vs_aot_speedup_geomean"] is None
    line = bench.table_line(cases[0])
    assert line.split()[:4] == ["skewed", "64", "2048", "1.00"]
    assert line.split()[4:6] == ["2.000", "1.000"]  # lengths, then batch
    assert len(bench.TABLE_HEADER.split()) == len(line.split())


def test_plan_only_cli_writes_json(tmp_path, capsys) -> None:
    out = tmp_path / "k.json"
    assert bench.main(["--plan-only", "--quick", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc) == {"meta", "cases", "summary"}
    assert len(doc["cases"]) == 4 and doc["summary"]["num_ran"] == 0
    assert "planned" in capsys.readouterr().out


def test_plan_only_cli_grid_options_select_skewed_cases(tmp_path, capsys) -> None:
    out = tmp_path / "k.json"
    argv = ["--plan-only", "--json", str(out), "--shapes", "skewed", "--batches", "64"]
    assert bench.main(argv + ["--contexts", "2048,4096", "--budgets", "1.0,0.25"]) == 0
    doc = json.loads(out.read_text())
    assert [(c["shape"], c["batch"], c["context"], c["budget"]) for c in doc["cases"]] == [
        ("skewed", 64, n, r) for r in (1.0, 0.25) for n in (2048, 4096)
    ]
    for case in doc["cases"]:
        assert len(case["row_contexts"]) == 64 and max(case["row_contexts"]) == case["context"]
        assert not case["skipped"]
    assert doc["meta"]["grid"] == {
        "batches": [64],
        "contexts": [2048, 4096],
        "budgets": [1.0, 0.25],
        "shapes": ["skewed"],
    }
    printed = capsys.readouterr().out
    assert printed.count("skewed    64") == 4 and "planned: kept 1.000 of full KV" in printed
    # the default run keeps its grid and shapes; --quick takes an explicit option over its own
    assert bench.main(["--plan-only", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert len(doc["cases"]) == 48 and {c["shape"] for c in doc["cases"]} == {"ratios", "equal"}
    assert bench.main(["--plan-only", "--quick", "--shapes", "skewed", "--json", str(out)]) == 0
    assert [c["batch"] for c in json.loads(out.read_text())["cases"]] == [1, 8]


@pytest.mark.parametrize(
    "argv",
    [
        ["--shapes", "ratios,lopsided"],
        ["--budgets", "1.5"],
        ["--budgets", "0"],
        ["--batches", "0"],
        ["--contexts", "2k"],
        ["--contexts", ","],
    ],
)
def test_cli_rejects_bad_grid_options(tmp_path, argv) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.main(["--plan-only", "--json", str(tmp_path / "k.json"), *argv])
    assert exc.value.code == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU this would run the benchmark")
def test_quick_run_imports_gpu_side_and_refuses_without_cuda(tmp_path) -> None:
    assert bench.main(["--quick", "--json", str(tmp_path / "k.json")]) == 2


def test_plan_only_without_json_writes_no_file(tmp_path, monkeypatch, capsys) -> None:
    """A CPU plan must not overwrite the measured results file (the GPU run's default path)."""
    monkeypatch.chdir(tmp_path)
    assert bench.main(["--plan-only", "--quick"]) == 0
    assert not any(tmp_path.rglob("*.json"))
    assert "shape batch" in capsys.readouterr().out
