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
from pathlib import Path

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


class _FakeServer:
    """A local HTTP endpoint in a thread speaking /generate's streaming format, /flush_cache,
    /metrics and SGLang's /start_profile (which here writes a small gzip Chrome trace into the
    requested folder, as SGLang's profiler does once its steps are done) and /stop_profile
    (which answers an error, as SGLang does when the profiler already stopped)."""

    def __init__(self, refuse_profile: bool = False) -> None:
        import asyncio
        import threading

        self.calls: list[tuple] = []
        self.refuse_profile = refuse_profile
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        assert self.ready.wait(30)

    def _serve(self) -> None:
        import asyncio

        from aiohttp import web

        async def generate(request):
            body = await request.json()
            n = body["sampling_params"]["max_new_tokens"]
            self.calls.append(("generate",))
            resp = web.StreamResponse()
            await resp.prepare(request)
            meta = {"prompt_tokens": len(body["input_ids"]), "completion_tokens": n}
            chunk = {"output_ids": list(range(5, 5 + n)), "meta_info": meta | {"cached_tokens": 0}}
            await resp.write(f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode())
            return resp

        async def flush(request):
            self.calls.append(("flush",))
            return web.Response(text="ok")

        async def metrics(request):
            return web.Response(text="")

        async def start_profile(request):
            body = await request.json()
            self.calls.append(("start_profile", body))
            if self.refuse_profile:
                return web.Response(status=400, text="profiling is already in progress")
            events = [{"ph": "X", "cat": "kernel", "name": "decode", "ts": 0, "dur": 4 * US}]
            _write_trace(Path(body["output_dir"]) / "9-TP-0.trace.json.gz", events)
            return web.Response(text="Start profiling.\n")

        async def stop_profile(request):
            self.calls.append(("stop_profile",))
            return web.Response(status=500, text="Profiling is not in progress")

        async def start():
            app = web.Application()
            app.add_routes(
                [
                    web.post("/generate", generate),
                    web.post("/flush_cache", flush),
                    web.get("/metrics", metrics),
                    web.post("/start_profile", start_profile),
                    web.post("/stop_profile", stop_profile),
                ]
            )
            self.runner = web.AppRunner(app)
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
            self.ready.set()

        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(start())
        self.loop.run_forever()

    def close(self) -> None:
        import asyncio

        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


def _args(tmp_path):
    from types import SimpleNamespace

    return SimpleNamespace(log_dir=str(tmp_path), trace_steps=7, trace_top=5, vocab_size=32000)


def test_traced_repeat_flushes_profiles_the_workload_then_reads_the_trace(tmp_path):
    from tangram_sglang.bench.multiturn_client import LoadSettings
    from tangram_sglang.bench.multiturn_workloads import WorkloadSpec

    server = _FakeServer()
    try:
        spec = WorkloadSpec("short-chat", num_clients=2, num_rounds=2)
        measured = {"timed_out": False, "requests_ok": 4}
        settings = LoadSettings(timeout_s=30.0, warmup_clients=2)
        out = mt.traced_repeat(
            server.url, "tangram-r0.25", spec, measured, settings, _args(tmp_path)
        )
    finally:
        server.close()
    names = [c[0] for c in server.calls]
    # no warm-up on the repeat: flush, profiler on, the 4 requests, profiler off
    assert names == ["flush", "start_profile", *["generate"] * 4, "stop_profile"]
    body = server.calls[1][1]
    assert body["num_steps"] == 7 and body["record_shapes"] is False and body["with_stack"]
    assert body["output_dir"] == str(tmp_path.resolve() / "trace-tangram-r0.25-short-chat-2x2")
    assert out["traced_wall_s"] > 0
    assert out["trace"]["gpu_time_by_kernel_ms"] == {"decode": 4.0}


def test_a_refused_profiler_is_recorded_and_a_failed_run_is_not_traced(tmp_path, capsys):
    from tangram_sglang.bench.multiturn_client import LoadSettings
    from tangram_sglang.bench.multiturn_workloads import WorkloadSpec

    spec = WorkloadSpec("short-chat", num_clients=2, num_rounds=2)
    settings = LoadSettings(timeout_s=30.0)
    server = _FakeServer(refuse_profile=True)
    try:
        ok = {"timed_out": False, "requests_ok": 4}
        refused = mt.traced_repeat(server.url, "baseline", spec, ok, settings, _args(tmp_path))
        server.calls.clear()
        timed_out = {"timed_out": True, "requests_ok": 3}
        skipped = mt.traced_repeat(
            server.url, "baseline", spec, timed_out, settings, _args(tmp_path)
        )
    finally:
        server.close()
    assert (
        set(refused) == {"trace"}
        and "/start_profile answered HTTP 400" in refused["trace"]["error"]
    )
    assert "trace failed" in capsys.readouterr().out
    assert server.calls == [] and "not traced" in skipped["trace"]["error"]
