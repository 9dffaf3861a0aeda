"""``bench.multiturn --client sglang`` without a server: the trace, the command line (read by
SGLang's own bench_serving parser), the result's keys and the flags refused before a server."""

from __future__ import annotations

import dataclasses
import json
import sys
from unittest import mock

import pytest
from transformers import AutoTokenizer

from tangram_sglang.bench import multiturn as mt
from tangram_sglang.bench import sglang_client as sc
from tangram_sglang.bench.dummy_tokenizer import write_dummy_tokenizer
from tangram_sglang.bench.multiturn_workloads import ID_LOW, WorkloadSpec, make_conversations
from tangram_sglang.errors import ConfigError

TINY = {"vocab_size": 3000, "bos_token_id": 1, "eos_token_id": 2}


@pytest.fixture(scope="module")
def dummy_tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dummy")
    (folder / "config.json").write_text(json.dumps(TINY))
    write_dummy_tokenizer(folder)
    return AutoTokenizer.from_pretrained(folder)


def test_the_trace_holds_every_round_and_words_encode_back_to_the_drawn_ids(dummy_tokenizer):
    convs = make_conversations(WorkloadSpec("short-chat", 3, 4, request_length=40))
    trace, out = sc.agentic_trace(convs, TINY["vocab_size"], dummy_tokenizer.decode, seed=7)
    assert out == 128 and len(trace["conversations"]) == 3
    for conv, turns in zip(convs, trace["conversations"], strict=True):
        assert [t["prompt_tokens"] for t in turns] == [n for n, _ in conv.rounds]
        for turn, (n, _) in zip(turns, conv.rounds, strict=True):
            (message,) = turn["messages"]
            ids = dummy_tokenizer.encode(message["content"], add_special_tokens=False)
            assert message["role"] == "user" and len(ids) == n
            assert all(ID_LOW <= i < TINY["vocab_size"] - ID_LOW for i in ids)
    again, _ = sc.agentic_trace(convs, TINY["vocab_size"], dummy_tokenizer.decode, seed=7)
    assert again == trace  # seeded
    other, _ = sc.agentic_trace(convs, TINY["vocab_size"], dummy_tokenizer.decode, seed=8)
    assert other != trace


def test_a_shared_context_is_the_same_words_in_every_conversation(dummy_tokenizer):
    spec = WorkloadSpec("long-context", 3, 2, request_length=8, context_tokens=64)
    convs = make_conversations(dataclasses.replace(spec, shared_context=True))
    trace, _ = sc.agentic_trace(convs, TINY["vocab_size"], dummy_tokenizer.decode, seed=0)
    firsts = [turns[0]["messages"][0]["content"].split()[:64] for turns in trace["conversations"]]
    assert firsts[0] == firsts[1] == firsts[2]
    private = make_conversations(spec)
    trace, _ = sc.agentic_trace(private, TINY["vocab_size"], dummy_tokenizer.decode, seed=0)
    firsts = [turns[0]["messages"][0]["content"].split()[:64] for turns in trace["conversations"]]
    assert firsts[0] != firsts[1]


def test_rounds_of_different_output_lengths_are_refused_with_the_workload_named():
    convs = make_conversations(WorkloadSpec("sharegpt", 8, 4))
    with pytest.raises(ConfigError, match=r"sharegpt-8x4: --client sglang needs one output"):
        sc.uniform_output_length(convs, "sharegpt-8x4")


def test_the_command_is_one_sglang_bench_serving_accepts(tmp_path):
    """Parsed by the pinned SGLang's own ``cli_main`` parser (its run is stopped at the parse)."""
    from sglang.benchmark import serving

    command = sc.bench_serving_command(
        "http://127.0.0.1:30000", "/m", tmp_path / "t.json", 64, 64, 128, tmp_path / "r.jsonl"
    )
    assert command[:3] == [sys.executable, "-m", "sglang.benchmark.serving"]
    seen = {}

    def run_benchmark(args):
        seen.update(vars(args))

    with (
        mock.patch.object(sys, "argv", ["serving", *command[3:]]),
        mock.patch.object(serving, "run_benchmark", run_benchmark),
    ):
        serving.cli_main()
    assert seen["backend"] == "sglang-oai-chat" and seen["dataset_name"] == "agentic-trace"
    assert seen["num_prompts"] == 64 and seen["max_concurrency"] == 64
    assert seen["sharegpt_output_len"] == 128 and seen["warmup_requests"] == 0
    assert seen["request_rate"] == float("inf")
    assert seen["output_file"] == str(tmp_path / "r.jsonl")


RAW = {
    "completed": 8,
    "duration": 2.0,
    "total_input_tokens": 400,
    "total_output_tokens": 32,
    "output_throughput": 16.0,
    "total_throughput": 216.0,
    "median_ttft_ms": 100.0,
    "p90_ttft_ms": 200.0,
    "p99_ttft_ms": 300.0,
    "median_tpot_ms": 10.0,
    "p90_tpot_ms": 20.0,
    "p99_tpot_ms": None,
    "median_e2e_latency_ms": 500.0,
    "p90_e2e_latency_ms": 600.0,
    "p99_e2e_latency_ms": 700.0,
    "server_info": {"big": "dict"},
}


COUNTED = {"prompt": 400, "cached": 100, "generated": 32}


def test_the_result_line_reads_in_the_own_clients_keys_and_units():
    peaks = {"sglang:num_running_reqs": 4.0}
    raw = {**RAW, "errors": ["", "", "HTTP 503"], "generated_texts": ["x"] * 8}
    run = sc.summarize_bench_serving(raw, 10, 4, peaks, 60, COUNTED)
    assert run["requests_ok"] == 8 and run["requests_failed"] == 2 and not run["timed_out"]
    assert run["output_tok_per_s"] == 16.0 and run["wall_s"] == 2.0
    assert run["mean_output_tokens"] == 4.0 and run["cache_hit_rate"] == 0.25
    assert run["prompt_tokens"] == 400 and run["total_tok_per_s"] == 216.0
    assert run["output_tokens_short"] == 0 and run["first_errors"] == ["HTTP 503"]
    assert "generated_texts" not in run["bench_serving"]
    assert run["ttft_s"] == {"p50": 0.1, "p90": 0.2, "p99": 0.3}
    assert run["tpot_s"] == {"p50": 0.01, "p90": 0.02, "p99": None}
    assert run["latency_s"]["p50"] == 0.5 and run["peak_running_reqs"] == 4.0
    assert run["client"] == "sglang.benchmark.serving (sglang-oai-chat)"
    assert "server_info" not in run["bench_serving"]
    own_keys = set(mt.summarize_run([], 1.0, 0, {}, False))
    assert own_keys <= set(run)  # the summary and merge read the same keys


def test_answers_cut_short_count_by_the_servers_tokens_not_bench_servings():
    """An answer the server aborts inside an HTTP 200 stream reads to bench_serving as a whole
    one; the server's generation counter tells: throughput from it, the shortfall named."""
    run = sc.summarize_bench_serving(RAW, 8, 4, {}, 60, {**COUNTED, "generated": 26})
    assert run["output_tokens"] == 26 and run["output_tokens_short"] == 8 * 4 - 26
    assert run["output_tok_per_s"] == 13.0 and RAW["output_throughput"] == 16.0


def test_a_run_past_the_timeout_is_recorded_as_timed_out(tmp_path, monkeypatch):
    monkeypatch.setattr(sc, "STARTUP_ALLOWANCE_S", 0.5)
    slow = [sys.executable, "-c", "import time; time.sleep(10)"]
    raw = sc.run_bench_serving(slow, tmp_path / "r.jsonl", 0.5, tmp_path / "b.log")
    run = sc.summarize_bench_serving(raw, 8, 4, {}, 0.5, COUNTED)
    assert run["timed_out"] and run["requests_ok"] == 0 and run["requests_failed"] == 8
    assert run["wall_s"] == 0.5 and run["output_tokens"] == 32
    assert "ran past 0 s (--workload-timeout-s) + 0 s for its start-up" in run["first_errors"][0]


def test_a_bench_serving_without_a_result_fails_every_request_and_says_why(tmp_path):
    """bench_serving stops with a traceback when no request succeeded (e.g. every prompt past
    the server's context): the run is recorded, not the system failed."""
    log = tmp_path / "b.log"
    command = [sys.executable, "-c", "import sys; print('IndexError: index -1'); sys.exit(1)"]
    raw = sc.run_bench_serving(command, tmp_path / "r.jsonl", 30, log)
    run = sc.summarize_bench_serving(raw, 4, 8, {}, 30, {**COUNTED, "generated": 0})
    assert run["requests_ok"] == 0 and run["requests_failed"] == 4 and not run["timed_out"]
    (why,) = run["first_errors"]
    assert "exited 1 with no result: no request succeeded" in why
    assert str(log) in why and "IndexError: index -1" in why


def test_the_last_result_line_is_returned(tmp_path):
    result = tmp_path / "r.jsonl"
    script = f"open({str(result)!r}, 'a').write('{{\"completed\": 1}}\\n{{\"completed\": 2}}\\n')"
    raw = sc.run_bench_serving([sys.executable, "-c", script], result, 30, tmp_path / "b.log")
    assert raw == {"completed": 2}


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--workloads", "sharegpt:4x2"], "sharegpt-4x2: --client sglang needs one output"),
        (["--request-rate", "2"], "--request-rate: --client sglang (bench_serving) cannot"),
        (["--round-barrier"], "--round-barrier: --client sglang"),
        (["--workloads", "cliff:2:no-max"], "--workloads cliff-2-no-max: --client sglang"),
        (["--trace-steps", "3"], "--trace-steps: --client sglang"),
        (["--server-args=--skip-tokenizer-init"], "--server-args: --skip-tokenizer-init leaves"),
        (["--max-parallel", "1"], "short-chat-2x2: 2 clients but --max-parallel 1"),
        (["--workloads", "mixed:4x2", "--output-length", "4"], "(mixed: 128, its long"),
        ([], "needs the model's tokenizer and cannot load it"),
    ],
    ids=["sharegpt", "rate", "barrier", "no-max", "trace", "no-tok", "parallel", "mixed", "none"],
)
def test_what_bench_serving_cannot_run_is_refused_before_any_server(tmp_path, capsys, argv, match):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"vocab_size": 5000}')
    out = tmp_path / "r.json"
    base = ["--model-path", str(model), "--device", "cpu", "--systems", "baseline"]
    base += ["--client", "sglang", "--workloads", "short-chat:2x2"]
    assert mt.main([*base, *argv, "--output", str(out)]) == 2
    assert match in capsys.readouterr().err and not out.exists()


def test_a_tokenizer_without_a_chat_template_is_refused_with_the_fix(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    write_dummy_tokenizer(tmp_path)
    assert sc.check_chat_tokenizer(str(tmp_path)).chat_template
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del config["chat_template"]  # as the dummy tokenizer wrote it before the template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"no chat template.*dummy_tokenizer .* --overwrite"):
        sc.check_chat_tokenizer(str(tmp_path))


def test_one_round_workloads_may_have_more_clients_than_max_parallel(tmp_path):
    """A one-round conversation is one request: the same load under either client's bound."""
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    write_dummy_tokenizer(tmp_path)
    argv = ["--model-path", str(tmp_path), "--systems", "baseline", "--client", "sglang"]
    argv += ["--max-parallel", "4", "--output", str(tmp_path / "r.json")]
    a = mt.build_parser().parse_args(argv)
    a.device, a.vocab_size = "cpu", TINY["vocab_size"]
    mt.check_args(a, mt.parse_systems("baseline"), [mt.parse_workload("prefill:16x64", a)])
    spec = mt.parse_workload("short-chat:16x2", a)
    with pytest.raises(ConfigError, match="16 clients but --max-parallel 4"):
        mt.check_sglang_client(a, mt.parse_systems("baseline"), [spec])


def test_baseline_args_of_a_tangram_only_run_are_not_read(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    write_dummy_tokenizer(tmp_path)
    argv = ["--model-path", str(tmp_path), "--client", "sglang"]
    argv += ["--baseline-args=--skip-tokenizer-init", "--output", str(tmp_path / "r.json")]
    a = mt.build_parser().parse_args(argv)
    a.device = "cpu"
    cliff = [mt.parse_workload("cliff:2", a)]
    mt.check_sglang_client(a, mt.parse_systems("tangram:0.5"), cliff)
    with pytest.raises(ConfigError, match="--baseline-args: --skip-tokenizer-init leaves"):
        mt.check_sglang_client(a, mt.parse_systems("baseline"), cliff)
