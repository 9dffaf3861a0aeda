"""bench.prefill_profile case parsing and bench.plot_multiturn (points and the PNG)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tangram_sglang.bench.plot_multiturn import plot, points
from tangram_sglang.bench.prefill_profile import Case, parse_cases
from tangram_sglang.errors import ConfigError

PROFILE = Path(__file__).resolve().parents[2] / "calibration/qwen2.5-0.5b/ada-snapkv-r0.25.json"


def test_parse_cases_with_and_without_history():
    assert parse_cases("1x8192, 64x384+16384") == [Case(1, 8192), Case(64, 384, 16384)]
    assert Case(64, 384, 16384).label == "64x384+16384" and Case(2, 8).label == "2x8"


def test_mixed_length_cases_draw_the_same_lengths_every_run():
    (case,) = parse_cases("16x300-1500+128")
    assert case == Case(16, 1500, 128, 300) and case.label == "16x300-1500+128"
    lengths = case.lengths
    assert lengths == Case(16, 1500, 128, 300).lengths  # seeded from the case
    assert len(lengths) == 16 and max(lengths) == 1500 and min(lengths) >= 300
    assert len(set(lengths)) > 8  # mixed, as a ShareGPT prefill batch
    assert Case(4, 64).lengths == [64] * 4


@pytest.mark.parametrize(
    "bad", ["", "8192", "0x10", "2x10+-1", "ax3", "4x500-300", "4x0-10", "4x-5"]
)
def test_parse_cases_rejects_bad_entries(bad):
    with pytest.raises(ConfigError, match="--cases"):
        parse_cases(bad)


RESULT = {
    "machine": "NVIDIA H200",
    "systems": {
        "baseline": {"workloads": {"cliff-64": {"output_tok_per_s": 148.0}}},
        "tangram-r0.5": {"workloads": {"cliff-64": {"output_tok_per_s": 340.0}}},
        "tangram-r0.1": {"workloads": {"cliff-64": {"output_tok_per_s": 474.0}}},
        "tangram-r0.25": {"workloads": {"cliff-32": {"output_tok_per_s": 411.0}}},
    },
}


def test_points_sorted_by_ratio_and_unmeasured_left_out():
    tangram, stock = points(RESULT, "cliff-64")
    assert tangram == [(0.1, 474.0), (0.5, 340.0)] and stock == {"baseline": 148.0}
    with pytest.raises(ConfigError, match="cliff-96"):
        points(RESULT, "cliff-96")


def test_plot_writes_a_png(tmp_path):
    out = tmp_path / "p.png"
    plot(RESULT, "cliff-64", str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "text", [None, "[1,", "[1, 2]", '{"systems": {"tangram-rX": {"workloads": {"w": {}}}}}']
)
def test_plot_cli_bad_result_exits_2_without_a_traceback(tmp_path, capsys, text):
    from tangram_sglang.bench.plot_multiturn import main

    path = tmp_path / "r.json"
    if text is not None:
        text = text.replace("{}", '{"output_tok_per_s": 1.0}')
        path.write_text(text)
    assert main([str(path), "--workload", "w", "--output", str(tmp_path / "p.png")]) == 2
    assert "plot_multiturn: result" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "flag"),
    [
        (["--cases", "0x1"], "--cases"),
        (["--page-size", "0"], "--page-size"),
        (["--target-ratio", "2"], "--target-ratio"),
    ],
    ids=["cases", "page-size", "target-ratio"],
)
def test_prefill_profile_cli_checks_flags_before_the_gpu(tmp_path, capsys, extra, flag):
    from tangram_sglang.bench.prefill_profile import main

    profile = PROFILE
    assert main(["--profile", str(profile), *extra]) == 2
    assert flag in capsys.readouterr().err
    assert main(["--profile", str(tmp_path / "none.json")]) == 2
    assert "--profile" in capsys.readouterr().err
