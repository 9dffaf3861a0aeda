"""bench.decode_windows: two servers' decode log lines paired, by requests running."""

from __future__ import annotations

import json

import pytest

from tangram_sglang.bench import multiturn as mt
from tangram_sglang.bench.decode_windows import (
    bin_label,
    main,
    paired_seconds,
    parse_decode_lines,
    window_seconds,
)


def decode_line(running: int, tokens: int, tps: float, tangram: bool = False) -> str:
    """A decode log line as SGLang 0.5.17 writes it (a --tangram server adds its pool)."""
    pool = (
        "tangram pages: 75348/3154476 (0 reserved), KV 2354.6 MiB vs full KV 2984.8 MiB, "
        "frag 0.095, "
    )
    return (
        f"[2026-12-04 17:29:15] Decode batch, #running-req: {running}, #token: {tokens}, "
        f"token usage: 0.02, {pool if tangram else ''}cuda graph: True, "
        f"gen throughput (token/s): {tps:.2f}, #queue-req: 0\n"
    )


PREFILL = "[2026-12-04 17:29:15] Prefill batch, #new-seq: 3, #new-token: 300, #cached-token: 0\n"
STOCK = PREFILL + "".join(
    decode_line(*x) for x in [(62, 12160, 167.96), (62, 22791, 8000.0), (6, 15669, 960.0)]
)
TANGRAM = "".join(
    decode_line(*x, tangram=True)
    for x in [(62, 12160, 25.18), (62, 22787, 6200.0), (6, 15667, 1200.0)]
)


def test_parse_reads_stock_and_tangram_decode_lines_and_skips_the_rest():
    assert parse_decode_lines(STOCK) == [
        [62, 12160, 167.96],
        [62, 22791, 8000.0],
        [6, 15669, 960.0],
    ]
    assert [line[:2] for line in parse_decode_lines(TANGRAM)] == [
        [62, 12160],
        [62, 22787],
        [6, 15667],
    ]
    assert parse_decode_lines("no decode here\n") == []


def test_window_seconds_is_interval_times_running_over_throughput():
    assert window_seconds([62, 0, 8000.0]) == pytest.approx(40 * 62 / 8000)
    assert window_seconds([4, 0, 100.0], interval=10) == pytest.approx(0.4)
    assert window_seconds([4, 0, 0.0]) == float("inf")


@pytest.mark.parametrize(
    ("running", "label"),
    [(0, "0"), (1, "1-4"), (4, "1-4"), (5, "5-19"), (54, "20-54"), (64, "55+")],
)
def test_bins_are_labelled_by_their_edges(running, label):
    assert bin_label(running) == label


def test_pairs_sum_by_the_base_servers_running_count_and_drop_idle_windows():
    stock, tangram = parse_decode_lines(STOCK), parse_decode_lines(TANGRAM)
    out = paired_seconds(stock, tangram, max_window_s=10.0)
    assert out["windows"] == 2 and out["dropped"] == 1 and out["unpaired"] == 0  # 98 s window out
    many, few = out["bins"]["55+"], out["bins"]["5-19"]
    assert many["base_s"] == pytest.approx(40 * 62 / 8000) and many["windows"] == 1
    assert many["speed"] == pytest.approx(6200 / 8000)  # Tangram slower with 62 running
    assert few["speed"] == pytest.approx(1200 / 960)  # and faster with 6
    assert out["all"]["base_s"] == pytest.approx(many["base_s"] + few["base_s"])
    assert list(out["bins"]) == ["5-19", "55+"]  # in bin order
    kept = paired_seconds(stock, tangram[:2])  # no limit: every pair, up to the shorter log
    assert kept["windows"] == 2 and kept["unpaired"] == 1 and kept["dropped"] == 0


@pytest.mark.parametrize(
    ("bins", "interval", "match"),
    [
        ((), 40, "ascending distinct edges"),
        ((5, 1), 40, "ascending distinct edges"),
        ((1, 1), 40, "ascending distinct edges"),
        ((1,), 0, "interval 0: decode steps per log line"),
    ],
)
def test_bad_bins_or_interval_are_refused(bins, interval, match):
    with pytest.raises(ValueError, match=match):
        paired_seconds([[1, 0, 1.0]], [[1, 0, 1.0]], bins=bins, interval=interval)


def test_cli_pairs_two_logs(tmp_path, capsys):
    a, b = tmp_path / "stock.log", tmp_path / "tangram.log"
    a.write_text(STOCK)
    b.write_text(TANGRAM)
    assert main([str(a), str(b), "--bins", "1,20"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["dropped"] == 1 and set(out["bins"]) == {"1-19", "20+"}
    b.write_text(TANGRAM + TANGRAM)  # not the same request stream: said on stderr
    assert main([str(a), str(b)]) == 0
    assert "differ by 3 windows" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["missing.log", "{b}"], "no such log file"),
        (["{a}", "{b}", "--bins", "1,x"], "comma-separated integers"),
        (["{a}", "{b}", "--bins", "5,1"], "--bins '5,1': ascending distinct edges"),
        (["{a}", "{empty}"], "e.log holds no 'Decode batch' line"),
        (["{a}", "{b}", "--interval", "0"], "--interval 0"),
        (["{a}", "{b}", "--max-window-s", "-1"], "--max-window-s -1.0"),
        (["{a}", "{b}", "--max-window-s", "nan"], "--max-window-s nan"),
        (["{a}", "{dir}"], "is a folder"),
    ],
)
def test_cli_bad_input_exits_2_naming_it(tmp_path, capsys, argv, match):
    files = {"a": tmp_path / "a.log", "b": tmp_path / "b.log", "empty": tmp_path / "e.log"}
    files["dir"] = tmp_path / "logs"
    files["dir"].mkdir()
    files["a"].write_text(STOCK)
    files["b"].write_text(TANGRAM)
    files["empty"].write_text("nothing\n")
    with pytest.raises(SystemExit) as exc:
        main([x.format(**files) if "{" in x else x for x in argv])
    assert exc.value.code == 2 and match in capsys.readouterr().err


def test_a_run_keeps_only_its_own_lines_after_the_mark_less_the_first(tmp_path):
    log = tmp_path / "server.log"
    log.write_text(STOCK)
    mark = mt._LogMark(log)
    mark()  # the run starts here: the lines above are the warm-up's
    with log.open("a") as f:
        f.write(TANGRAM)
    lines = mt.run_decode_lines(log, mark.offset)
    assert [line[:2] for line in lines] == [[62, 22787], [6, 15667]]  # first window reaches back
    assert mt.run_decode_lines(tmp_path / "absent.log", 0) == []


def test_summary_pairs_a_tangram_runs_windows_with_the_best_stock_runs():
    def run(tps, lines):
        return {
            "requests_ok": 1,
            "output_tok_per_s": tps,
            "decode_log": parse_decode_lines(lines)[1:],
        }

    systems = {
        "baseline": {"workloads": {"sharegpt-64x4": run(2300.0, STOCK)}},
        "baseline-flashinfer": {
            "workloads": {"sharegpt-64x4": {"requests_ok": 1, "output_tok_per_s": 1900.0}}
        },
        "tangram-r0.25": {"workloads": {"sharegpt-64x4": run(2200.0, TANGRAM)}},
    }
    entry = mt.summarize(systems, "sharegpt-64x4", None)["vs_best_stock"]["tangram-r0.25"]
    windows = entry["sharegpt-64x4"]["decode_windows"]
    assert entry["sharegpt-64x4"]["stock"] == "baseline" and windows["windows"] == 2
    assert windows["bins"]["55+"]["speed"] == pytest.approx(6200 / 8000)
    # a stock run without its log lines (an older result file): the ratio, no pairing
    systems["baseline"]["workloads"]["sharegpt-64x4"].pop("decode_log")
    entry = mt.summarize(systems, "sharegpt-64x4", None)["vs_best_stock"]["tangram-r0.25"]
    assert "decode_windows" not in entry["sharegpt-64x4"]


def test_a_zero_throughput_window_is_left_out_not_summed_as_infinite():
    base = [[10, 0, 1000.0], [10, 0, 1000.0]]
    other = [[10, 0, 0.0], [10, 0, 500.0]]
    out = paired_seconds(base, other)
    assert out["dropped"] == 1 and out["windows"] == 1
    assert out["all"]["other_s"] == pytest.approx(40 * 10 / 500)
    json.dumps(out, allow_nan=False)  # valid JSON: no Infinity


def test_lines_with_forward_iteration_numbers_are_read_too():
    line = decode_line(7, 900, 350.0).replace("Decode batch,", "Decode batch [123],")
    assert parse_decode_lines(line) == [[7, 900, 350.0]]


def test_a_run_reports_the_triton_builds_logged_during_it(tmp_path):
    """``run_build_lines``: the build log's lines after the mark, from "Triton built" on."""
    log = tmp_path / "server.log"
    log.write_text(
        "[2026-12-06 12:00:00] Tangram: Triton built extend_attention._extend_kernel in 812 ms "
        "(compile or cache load 790 ms, then launcher and device load; build 1 of it in this "
        "process)\n"
    )
    mark = mt._LogMark(log)
    mark()  # start-up and warm-up builds above the mark are not the run's
    assert mt.run_build_lines(log, mark.offset) == []
    with log.open("a") as f:
        f.write(STOCK)
        f.write(
            "[2026-12-06 12:00:05] Tangram: Triton built history_page_ids._page_ids_kernel in "
            "480 ms (compile or cache load 470 ms, then launcher and device load; build 1 of it "
            "in this process)\n"
        )
    builds = mt.run_build_lines(log, mark.offset)
    assert builds == [
        "Triton built history_page_ids._page_ids_kernel in 480 ms (compile or cache load 470 "
        "ms, then launcher and device load; build 1 of it in this process)"
    ]
    assert mt.run_build_lines(tmp_path / "absent.log", 0) == []
