"""bench.prefill_trace's trace reading: GPU busy/idle union and host time during idle gaps."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram_sglang.bench.prefill_trace import analyse, main, overlap, overlaps, union

_interval = st.tuples(st.integers(0, 60), st.integers(0, 12)).map(lambda a: (a[0], a[0] + a[1]))


def test_union_merges_overlapping_and_touching_intervals():
    iv = np.array([[5.0, 7.0], [0.0, 2.0], [1.0, 3.0], [3.0, 4.0], [9.0, 10.0]])
    assert union(iv).tolist() == [[0.0, 4.0], [5.0, 7.0], [9.0, 10.0]]


def test_overlap_counts_only_the_covered_part():
    idle = np.array([[2.0, 4.0], [6.0, 9.0]])
    assert overlap(0.0, 3.0, idle) == 1.0
    assert overlap(3.0, 7.0, idle) == 2.0
    assert overlap(4.0, 6.0, idle) == 0.0


def _covered(intervals) -> np.ndarray:
    """bool ``[130]``: which unit cells ``[x, x + 1)`` the integer intervals cover (oracle)."""
    cells = np.zeros(130, bool)
    for s, e in intervals:
        cells[int(s) : int(e)] = True
    return cells


@settings(max_examples=200, deadline=None)
@given(st.lists(_interval, max_size=25))
def test_union_is_disjoint_sorted_and_covers_what_the_intervals_cover(intervals):
    merged = union(np.array(intervals, float).reshape(-1, 2))
    assert (np.diff(merged[:, 0]) > 0).all()
    assert (merged[1:, 0] > merged[:-1, 1]).all()  # disjoint, touching ones merged
    assert (_covered(merged) == _covered(intervals)).all()


@settings(max_examples=200, deadline=None)
@given(st.lists(_interval, max_size=25), st.lists(_interval, min_size=1, max_size=40))
def test_overlaps_of_many_events_match_counting_covered_cells(idle, events):
    idle = union(np.array(idle, float).reshape(-1, 2))
    ev = np.array(events, float)
    got = overlaps(ev[:, 0], ev[:, 1], idle)
    cells = _covered(idle)
    want = [cells[int(a) : int(b)].sum() for a, b in events]
    np.testing.assert_allclose(got, want)
    assert [overlap(a, b, idle) for a, b in ev] == got.tolist()


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
    assert out["host_self_during_idle_ms"] == {"python_function: stats": 1.5}
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
        (["--stagger-ms", "nan"], "--turn-tokens and --stagger-ms must be >= 0 (and finite)"),
        (["--top", "0"], "--top 0: list at least 1"),
        (["--trace-dir", "/dev/null/t"], "--trace-dir '/dev/null/t': '/dev/null' is not a"),
        (["--prompt-len", "20000"], "= 20001 tokens, over the model's 16384; use shorter"),
        (["--server-args", "--foo 'bar"], '--server-args "--foo \'bar": No closing quotation'),
        (["--model-path", "/nonexistent/model"], "--model-path '/nonexistent/model': no such"),
        (["--json", "/nonexistent/dir/out.json"], "--json '/nonexistent/dir/out.json': no folder"),
    ],
    ids=[
        "no-prompts",
        "no-output",
        "negative-turn",
        "negative-stagger",
        "nan-stagger",
        "no-top",
        "unwritable-trace-dir",
        "longer-than-the-model",
        "unbalanced-quote",
        "missing-model",
        "json-folder-missing",
    ],
)
def test_bad_flags_exit_2_naming_the_flag_before_any_server(tmp_path, capsys, argv, match):
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 16384}')
    base = {"--model-path": str(tmp_path), "--label": "x", "--trace-dir": str(tmp_path / "t")}
    flags = dict(zip(argv[::2], argv[1::2], strict=True))
    with pytest.raises(SystemExit) as exc:
        main([a for kv in {**base, **flags}.items() for a in kv])
    assert exc.value.code == 2
    assert match in capsys.readouterr().err
    assert not (tmp_path / "t").exists()  # nothing written, no server started


def test_no_cuda_exits_2_before_any_server(tmp_path, capsys):
    if __import__("torch").cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    with pytest.raises(SystemExit) as exc:
        main(["--model-path", str(tmp_path), "--label", "x", "--trace-dir", str(tmp_path / "t")])
    assert exc.value.code == 2 and "no CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "t").exists()


def test_exclusive_idle_time_goes_to_the_innermost_frame():
    """A loop that copies page by page while the GPU waits: the inclusive list names every frame
    on the stack, the exclusive one the frame that does the work."""
    us = 1000.0
    frame = {"ph": "X", "cat": "python_function", "pid": 1, "tid": 1}
    trace = {
        "traceEvents": [
            {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 1 * us},
            {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 11 * us, "dur": 1 * us},
            {**frame, "name": "forward", "ts": 1 * us, "dur": 10 * us},
            {**frame, "name": "plan", "ts": 1 * us, "dur": 9 * us},
            {**frame, "name": "copy_pages", "ts": 2 * us, "dur": 6 * us},
            {**frame, "name": "upload", "ts": 8 * us, "dur": 1 * us},
            {**frame, "tid": 2, "name": "watchdog", "ts": 0, "dur": 12 * us},
        ]
    }
    out = analyse(trace)
    assert out["gpu_idle_ms"] == pytest.approx(10.0)
    inclusive = out["host_during_idle_ms"]
    assert inclusive["python_function: forward"] == pytest.approx(10.0)
    assert inclusive["python_function: plan"] == pytest.approx(9.0)
    assert out["host_self_during_idle_ms"] == pytest.approx(
        {
            "python_function: watchdog": 10.0,  # another thread: its own stack
            "python_function: copy_pages": 6.0,
            "python_function: plan": 2.0,  # 1-2 ms and 9-10 ms
            "python_function: upload": 1.0,
            "python_function: forward": 1.0,  # 10-11 ms
        }
    )


def test_a_parent_and_child_starting_together_keep_their_nesting_at_real_timestamps():
    """Trace timestamps are ~1.7e15 us, where float64 steps by 0.25 us: a child ending 0.1 us
    before its parent must still sort inside it (by duration, not by start - end), even when
    the file lists the child first."""
    base = 1.7e15
    events = [
        {"ph": "X", "cat": "kernel", "name": "k", "ts": base, "dur": 1.0, "pid": 0, "tid": 7},
        {"ph": "X", "cat": "kernel", "name": "k", "ts": base + 100, "dur": 1.0, "pid": 0, "tid": 7},
        {
            "ph": "X",
            "cat": "cpu_op",
            "name": "child",
            "ts": base + 10,
            "dur": 6.9,
            "pid": 1,
            "tid": 1,
        },
        {
            "ph": "X",
            "cat": "python_function",
            "name": "parent",
            "ts": base + 10,
            "dur": 7.0,
            "pid": 1,
            "tid": 1,
        },
    ]
    out = analyse({"traceEvents": events})
    assert set(out["host_self_during_idle_ms"]) == {"cpu_op: child"}
    assert out["host_during_idle_ms"]["python_function: parent"] >= 0.0069


def test_idle_sums_round_as_python_floats():
    events = [
        {"ph": "X", "cat": "kernel", "name": "k", "ts": 0.0, "dur": 1.0, "pid": 0, "tid": 7},
        {"ph": "X", "cat": "kernel", "name": "k", "ts": 428.5, "dur": 1.0, "pid": 0, "tid": 7},
        {"ph": "X", "cat": "cpu_op", "name": "op", "ts": 0.0, "dur": 429.0, "pid": 1, "tid": 1},
    ]
    out = analyse({"traceEvents": events})
    value = out["host_during_idle_ms"]["cpu_op: op"]
    assert type(value) is float and value == round(427.5 / 1e3, 3)
