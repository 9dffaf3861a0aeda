"""CPU-testable parts of the kernel benchmark: case plan, memory skips, summary, JSON."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from tangram_sglang.bench import kernels as bench
from tangram_sglang.bench.synthetic import skewed_profile


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
        for s in bench.SHAPES
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


def fake_results(case, aot, uniform, full, frac, lengths=None):
    case.results = {
        "lengths_ms": lengths or aot,
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


def test_plan_only_cli_writes_json(tmp_path, capsys) -> None:
    out = tmp_path / "k.json"
    assert bench.main(["--plan-only", "--quick", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc) == {"meta", "cases", "summary"}
    assert len(doc["cases"]) == 4 and doc["summary"]["num_ran"] == 0
    assert "planned" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU this would run the benchmark")
def test_quick_run_imports_gpu_side_and_refuses_without_cuda(tmp_path) -> None:
    assert bench.main(["--quick", "--json", str(tmp_path / "k.json")]) == 2
