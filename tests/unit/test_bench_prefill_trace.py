"""bench.prefill_trace's trace reading: GPU busy/idle union and host time during idle gaps."""

from __future__ import annotations

import numpy as np
import pytest

from tangram_sglang.bench.prefill_trace import analyse, main, overlap, union


def test_union_merges_overlapping_and_touching_intervals():
    iv = np.array([[5.0, 7.0], [0.0, 2.0], [1.0, 3.0], [3.0, 4.0], [9.0, 10.0]])
    assert union(iv).tolist() == [[0.0, 4.0], [5.0, 7.0], [9.0, 10.0]]


def test_overlap_counts_only_the_covered_part():
    idle = np.array([[2.0, 4.0], [6.0, 9.0]])
    assert overlap(0.0, 3.0, idle) == 1.0
    assert overlap(3.0, 7.0, idle) == 2.0
    assert overlap(4.0, 6.0, idle) == 0.0


def test_analyse_attributes_gpu_idle_time_to_the_host_functions_running_then():
    us = 1000.0  # trace timestamps are microseconds
    trace = {
        "traceEvents": [
            {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 1 * us},
            {"ph": "X", "cat": "kernel", "name": "attn", "ts": 0.5 * us, "dur": 1 * us},
            {"ph": "X", "cat": "gpu_memcpy", "name": "HtoD", "ts": 4 * us, "dur": 1 * us},
            {"ph": "X", "cat": "python_function", "name": "stats", "ts": 1 * us, "dur": 2 * us},
            {"ph": "X", "cat": "python_function", "name": "launch", "ts": 0, "dur": 1 * us},
            {"ph": "i", "cat": "kernel", "name": "marker", "ts": 2 * us},
        ]
    }
    out = analyse(trace)
    assert out["span_ms"] == pytest.approx(5.0)
    assert out["gpu_busy_ms"] == pytest.approx(2.5)
    assert out["gpu_idle_ms"] == pytest.approx(2.5)
    assert out["largest_gaps_ms"] == [2.5]
    assert out["host_during_idle_ms"] == {"python_function: stats": 1.5}
    assert out["gpu_time_by_kernel_ms"] == {"gemm": 1.0, "attn": 1.0, "HtoD": 1.0}
    assert out["gpu_launches_by_kernel"] == {"gemm": 1, "attn": 1, "HtoD": 1}


def test_analyse_refuses_a_trace_without_gpu_events():
    with pytest.raises(SystemExit, match="no GPU events"):
        analyse({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "x", "ts": 0, "dur": 1}]})


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--num-prompts", "0"], "--num-prompts, --prompt-len and --output-len must be >= 1"),
        (["--output-len", "0"], "--output-len must be >= 1"),
        (["--turn-tokens", "-1"], "--turn-tokens and --stagger-ms must be >= 0"),
        (["--stagger-ms", "-5"], "--turn-tokens and --stagger-ms must be >= 0"),
        (["--server-args", "--foo 'bar"], '--server-args "--foo \'bar": No closing quotation'),
        (["--model-path", "/nonexistent/model"], "--model-path '/nonexistent/model': no such"),
        (["--json", "/nonexistent/dir/out.json"], "--json '/nonexistent/dir/out.json': no folder"),
    ],
    ids=[
        "no-prompts",
        "no-output",
        "negative-turn",
        "negative-stagger",
        "unbalanced-quote",
        "missing-model",
        "json-folder-missing",
    ],
)
def test_bad_flags_exit_2_naming_the_flag_before_any_server(tmp_path, capsys, argv, match):
    base = {"--model-path": str(tmp_path), "--label": "x", "--trace-dir": str(tmp_path / "t")}
    flags = dict(zip(argv[::2], argv[1::2], strict=True))
    with pytest.raises(SystemExit) as exc:
        main([a for kv in {**base, **flags}.items() for a in kv])
    assert exc.value.code == 2
    assert match in capsys.readouterr().err
    assert not (tmp_path / "t").exists()  # nothing written, no server started


def test_turn_rounds_start_the_profiler_after_the_histories_are_cached():
    """``--turn-tokens``: histories (1 output token), then the profiler, then the later turns
    (history + E new ids, max_new_tokens = --output-len), as an HTTP server receives them."""
    import argparse
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from tangram_sglang.bench.prefill_trace import run_round

    seen: list[tuple[int, int | None]] = []  # (prompt tokens, max_new_tokens); (-1, None): mark
    prompts: list[list[int]] = []
    lock = threading.Lock()

    class Generate(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                seen.append((len(body["input_ids"]), body["sampling_params"]["max_new_tokens"]))
                prompts.append(body["input_ids"])
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    http = ThreadingHTTPServer(("127.0.0.1", 0), Generate)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{http.server_address[1]}"
    args = argparse.Namespace(
        num_prompts=3, prompt_len=40, output_len=5, turn_tokens=7, stagger_ms=1.0
    )
    try:
        times = run_round(url, args, 3, lambda: seen.append((-1, None)))
        assert seen == [(40, 1)] * 3 + [(-1, None)] + [(47, 5)] * 3
        assert set(times) == {"history_wall_s", "wall_s"}
        histories = sorted(p for p in prompts if len(p) == 40)
        assert sorted(p[:40] for p in prompts if len(p) == 47) == histories  # cached prefixes
        seen.clear()
        args.turn_tokens = 0  # plain rounds: the profiler first, then the prompts at once
        assert set(run_round(url, args, 3, lambda: seen.append((-1, None)))) == {"wall_s"}
        assert seen == [(-1, None)] + [(40, 5)] * 3
    finally:
        http.shutdown()
