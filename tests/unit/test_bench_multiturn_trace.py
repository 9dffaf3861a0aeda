"""``bench.multiturn --trace-steps``: the traced repeat's flag checks and trace reading.

The profiler itself is SGLang's: ``tests/e2e/test_bench_multiturn_server.py`` runs it on a real
CPU server. Here: the flags are refused before any server, and a Chrome trace written the way
SGLang writes it (gzip, under the output folder) is found and analysed.
"""

from __future__ import annotations

import gzip
import json
import os
import time

import pytest

from tangram_sglang.bench import multiturn as mt
from tangram_sglang.bench.multiturn_trace import collect_trace
from tangram_sglang.errors import TangramError

US = 1000.0  # trace timestamps are microseconds


def _write_trace(path, events) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--trace-steps", "-1", "--trace-steps -1: must be 0..100000"),
        ("--trace-top", "0", "--trace-top 0: list at least 1"),
    ],
)
def test_bad_trace_flags_stop_before_any_server(
    tmp_path, capsys, monkeypatch, flag, value, message
):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"vocab_size": 5000}')

    def no_server(*a, **k):
        raise AssertionError("a server was started")

    monkeypatch.setattr(mt, "run_system", no_server)
    out = tmp_path / "r.json"
    argv = ["--model-path", str(model), "--device", "cpu", "--systems", "baseline"]
    assert mt.main([*argv, flag, value, "--output", str(out), "--log-dir", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_collect_trace_reads_the_newest_trace_written_after_the_start(tmp_path):
    gpu = [
        {"ph": "X", "cat": "kernel", "name": "extend_attention", "ts": 0, "dur": 2 * US},
        {"ph": "X", "cat": "python_function", "name": "plan", "ts": 2 * US, "dur": 3 * US},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 4 * US, "dur": 1 * US},
    ]
    old = tmp_path / "old" / "1-TP-0.trace.json.gz"
    _write_trace(old, [{"ph": "X", "cat": "kernel", "name": "stale", "ts": 0, "dur": 9 * US}])
    past = time.time() - 60
    os.utime(old, (past, past))
    since = time.time() - 1
    _write_trace(tmp_path / "run" / "2-TP-0.trace.json.gz", gpu)
    out = collect_trace(tmp_path, since, top=5, wait_s=30)
    assert out["trace"].endswith("2-TP-0.trace.json.gz")
    assert out["gpu_busy_ms"] == pytest.approx(3.0) and out["gpu_idle_ms"] == pytest.approx(2.0)
    assert out["gpu_time_by_kernel_ms"] == {"extend_attention": 2.0, "gemm": 1.0}
    assert out["host_self_during_idle_ms"] == {"python_function: plan": 2.0}


def test_collect_trace_of_a_cpu_server_keeps_the_file_and_says_why_there_is_no_analysis(tmp_path):
    since = time.time() - 1
    cpu = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5}]
    _write_trace(tmp_path / "3-TP-0.trace.json.gz", cpu)
    out = collect_trace(tmp_path, since, top=5, wait_s=30)
    assert set(out) == {"trace", "error"} and "no GPU events" in out["error"]


def test_collect_trace_without_a_trace_file_raises_with_the_folder(tmp_path):
    with pytest.raises(TangramError, match=str(tmp_path)):
        collect_trace(tmp_path, time.time(), top=5, wait_s=0.1)
