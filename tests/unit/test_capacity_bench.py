"""Capacity benchmark: counts come from real allocation and agree with hand arithmetic."""

import json

import numpy as np
import pytest
from factories import make_profile

from tangram_sglang.bench import capacity
from tangram_sglang.bench.synthetic import skewed_profile

GIB = 1 << 30


def args(**overrides):
    overrides = {"memory_gib": 0.25, **overrides}
    base = ["--context-tokens", "2048", "--page-size", "16"]
    for key, value in overrides.items():
        base += [f"--{key.replace('_', '-')}", str(value)]
    return capacity.parse_args(base)


def test_full_kv_count_matches_hand_arithmetic():
    prof = skewed_profile("smollm2", heads_per_group=1, scope="global")
    report = capacity.run(prof, args())
    full = report["rows"][0]
    bytes_per_conv = 30 * 3 * 64 * 2 * 2 * 2048  # layers * heads * D * (K, V) * bf16 * tokens
    assert full["name"] == "full_kv" and full["bytes_per_conversation"] == bytes_per_conv
    assert full["conversations"] == int(0.25 * GIB) // bytes_per_conv
    summary = report["summary"]
    assert summary["configuration"] == "tangram H_p=4 global"
    mean_kept = np.mean([k / 2048 for k in prof.with_grouping(1, "global").group_kept_lens(2048)])
    assert summary["ideal_capacity_ratio"] == pytest.approx(1 / mean_kept)
    assert 0 <= summary["fragmentation_fraction"] < 0.05
    assert summary["capacity_ratio_vs_full_kv"] <= summary["ideal_capacity_ratio"]
    by_name = {r["name"]: r for r in report["rows"]}
    assert by_name["tangram H_p=1 global"]["padding_fraction"] == pytest.approx(0.0, abs=1e-9)


def test_ratio_one_profile_gains_nothing():
    prof = make_profile(np.ones((2, 4)), heads_per_group=2, head_dim=16)
    report = capacity.run(prof, args(heads_per_group=2, scope="per_layer", memory_gib=0.02))
    for row in report["rows"]:
        assert row["capacity_ratio_vs_full_kv"] == pytest.approx(1.0)
        assert row["waste_fraction"] == pytest.approx(0.0)
    assert report["summary"]["ideal_capacity_ratio"] == pytest.approx(1.0)


def test_cli_json_reads_a_profile_file(tmp_path, capsys):
    path = tmp_path / "p.json"
    skewed_profile("qwen2.5-0.5b").save(path)
    assert (
        capacity.main(
            ["--profile", str(path), "--context-tokens", "1024", "--memory-gib", "0.05", "--json"]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert set(report["summary"]) >= {
        "capacity_ratio_vs_full_kv",
        "ideal_capacity_ratio",
        "fragmentation_fraction",
    }
    assert report["inputs"]["profile"] == str(path)
    assert [r["name"] for r in report["rows"]][:3] == [
        "full_kv",
        "uniform_padded",
        "tangram H_p=1 per_layer",
    ]


@pytest.mark.parametrize(
    "flag,value",
    [
        ("--context-tokens", "0"),  # used to loop forever: a 0-page footprint always fits
        ("--context-tokens", "-5"),
        ("--max-new-tokens", "0"),
        ("--memory-gib", "0"),
        ("--memory-gib", "-1"),
        ("--memory-gib", "nan"),
        ("--memory-gib", "inf"),
        ("--page-size", "0"),
        ("--page-size", "3"),
    ],
    ids=lambda v: str(v),
)
def test_cli_rejects_bad_sizes_with_exit_2(flag, value, capsys):
    with pytest.raises(SystemExit) as exc:
        capacity.main(["--geometry", "smollm2", flag, value])
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


def test_cli_bad_profile_and_tiny_pool_are_clean_errors(tmp_path, capsys):
    assert capacity.main(["--profile", str(tmp_path / "missing.json")]) == 2
    assert "profile file not found" in capsys.readouterr().err
    argv = ["--geometry", "smollm2", "--context-tokens", "64", "--memory-gib", "1e-9"]
    assert capacity.main(argv) == 2
    assert "num_pages=1" in capsys.readouterr().err


def test_summary_row_exists_for_any_profile_grouping(tmp_path, capsys):
    prof = skewed_profile("smollm2", heads_per_group=3, scope="global")  # H_p=3: not in (1,2,4,8)
    path = tmp_path / "p.json"
    prof.save(path)
    report = capacity.run(prof, args(context_tokens=256, profile=path))
    assert report["summary"]["configuration"] == "tangram H_p=3 global"
    argv = ["--profile", str(path), "--heads-per-group", "2", "--scope", "per_layer"]
    assert capacity.main([*argv, "--context-tokens", "256", "--memory-gib", "0.01"]) == 2
    assert "--heads-per-group 2 with --scope per_layer" in capsys.readouterr().err
