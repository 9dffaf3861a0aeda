"""``python -m tangram_sglang.bench.multiturn`` at a toy size on CPU (SmolLM2, two servers).

One short run: stock SGLang then ``--tangram`` (shipped 0.5 profile), a 2-client x 2-round
long-context workload (turn 2 reuses turn 1 through each system's prefix cache) and a prefill
workload, each repeated once under SGLang's profiler (``--trace-steps``). Checks the JSON
schema, that both systems ran every workload without failures, the cache hit rate the servers
reported, the traces, and the summary's ratios. The same run through the CLI
took 17 min on this project's 2-core CPU under load 16 (tangram 0.5 first: hit 0.471, stock
0.475; every request answered); mostly the two servers' start-up.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tangram_sglang.bench import multiturn as mt

pytestmark = pytest.mark.e2e

PROFILE_05 = "calibration/smollm2/ada-snapkv-r0.5.json"
RUN_KEYS = {
    "requests_ok",
    "requests_failed",
    "wall_s",
    "output_tok_per_s",
    "cache_hit_rate",
    "ttft_s",
    "tpot_s",
    "peak_running_reqs",
    "retracted_requests_total",
    "decode_log",
    "triton_builds",
}


def test_toy_run_writes_both_systems_and_the_summary(tmp_path):
    out = tmp_path / "multiturn-cpu.json"
    code = mt.main(
        [
            "--model-path",
            "smollm2",
            "--device",
            "cpu",
            "--profile",
            PROFILE_05,
            "--systems",
            "baseline,tangram:0.5",
            "--workloads",
            "long-context:2x2,prefill:2x64",
            "--context-tokens",
            "96",
            "--request-length",
            "16",
            "--output-length",
            "4",
            "--main-workload",
            "long-context-2x2",
            "--workload-timeout-s",
            "300",
            "--trace-steps",
            "3",
            "--server-args=--decode-log-interval 1",
            "--log-dir",
            str(tmp_path),
            "--output",
            str(out),
        ]
    )
    assert code == 0
    result = json.loads(out.read_text())
    assert result["schema"] == mt.SCHEMA and set(result["systems"]) == {"baseline", "tangram-r0.5"}
    for name, system in result["systems"].items():
        assert system["error"] is None, name
        assert set(system["workloads"]) == {"long-context-2x2", "prefill-2x64"}
        for label, run in system["workloads"].items():
            assert set(run) >= RUN_KEYS, (name, label)
            assert run["requests_failed"] == 0 and run["requests_ok"] == run["requests_planned"]
            assert isinstance(run["decode_log"], list)
            assert run["triton_builds"] == []  # a CPU server builds no Triton kernel
            # --trace-steps: SGLang's profiler recorded a repeat of the workload; a CPU server's
            # trace has no GPU side, so the file is kept and the analysis says why it is absent
            trace = run["trace"]
            assert run["traced_wall_s"] > 0 and Path(trace["trace"]).is_file(), trace
            assert str(tmp_path / f"trace-{name}-{label}") in trace["trace"]
            assert "no GPU events" in trace["error"], trace
        turn2 = system["workloads"]["long-context-2x2"]
        # a decode line per step (--decode-log-interval 1): the run's 2 clients decode 3 steps
        # after each first token, so its lines are there, with at most 2 requests running
        lines = turn2["decode_log"]
        assert lines and all(1 <= running <= 2 for running, _, _ in lines), lines
        assert turn2["output_tokens"] == 2 * 2 * 4  # ignore_eos: every round generates 4
        assert turn2["cache_hit_rate"] > 0, name  # round 2 reused round 1 (radix on both)
    assert "--tangram" in result["systems"]["tangram-r0.5"]["server_args"]
    assert "--tangram" not in result["systems"]["baseline"]["server_args"]
    summary = result["summary"]
    assert summary["throughput_ratio_at_50pct"] > 0 and summary["kv_capacity_ratio"] is None
    assert (
        summary["max_concurrency_ratio"] is None and "max_concurrency_ratio" in summary["missing"]
    )
