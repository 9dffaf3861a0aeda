"""bench.multiturn pieces without a server: workloads, flag parsing, metrics text, summary."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from tangram_sglang.bench import multiturn as mt
from tangram_sglang.bench.multiturn_workloads import WorkloadSpec, make_conversations
from tangram_sglang.errors import ConfigError, TangramError

REPO = Path(__file__).resolve().parents[2]


def args(**kw) -> argparse.Namespace:
    return mt.build_parser().parse_args(["--model-path", "m", *kw.pop("argv", [])])


def test_cliff_is_16k_then_three_rounds_of_256_with_128_out():
    convs = make_conversations(WorkloadSpec("cliff", num_clients=3))
    assert len(convs) == 3
    assert convs[0].rounds == ((16384, 128), (256, 128), (256, 128), (256, 128))
    assert convs[0].total_tokens == 16384 + 3 * 256 + 4 * 128


def test_sharegpt_rounds_come_from_the_table_and_respect_caps():
    spec = WorkloadSpec(
        "sharegpt", num_clients=5, num_rounds=3, request_length=50, output_length=20
    )
    convs = make_conversations(spec)
    assert len(convs) == 5 and all(len(c.rounds) == 3 for c in convs)
    assert all(1 <= a <= 50 and 1 <= b <= 20 for c in convs for a, b in c.rounds)
    assert make_conversations(spec) == convs  # seeded


def test_long_context_shares_its_context_only_when_asked():
    spec = WorkloadSpec(
        "long-context",
        num_clients=2,
        num_rounds=3,
        request_length=8,
        output_length=4,
        context_tokens=100,
        shared_context=True,
    )
    conv = make_conversations(spec)[0]
    assert conv.rounds == ((108, 4), (8, 4), (8, 4)) and conv.shared_prefix == 100
    assert spec.label == "long-context-shared-2x3"


def test_system_prompt_conversations_share_one_system_prompt_then_sharegpt_rounds():
    spec = WorkloadSpec("system-prompt", num_clients=5, num_rounds=3, output_length=20)
    convs = make_conversations(spec)
    plain = make_conversations(
        WorkloadSpec("sharegpt", num_clients=5, num_rounds=3, output_length=20)
    )
    assert all(c.shared_prefix == 2048 for c in convs)
    for conv, chat in zip(convs, plain, strict=True):  # the same ShareGPT rounds after it
        assert conv.rounds[0] == (2048 + chat.rounds[0][0], chat.rounds[0][1])
        assert conv.rounds[1:] == chat.rounds[1:]
    assert spec.label == "system-prompt-5x3"
    short = WorkloadSpec("system-prompt", num_clients=1, num_rounds=2, system_prompt_tokens=300)
    assert make_conversations(short)[0].shared_prefix == 300
    assert short.label == "system-prompt300-1x2"
    with pytest.raises(ConfigError, match="--system-prompt-tokens"):
        make_conversations(WorkloadSpec("system-prompt", num_clients=1, system_prompt_tokens=0))


def test_short_chat_and_mixed_workloads():
    short = make_conversations(WorkloadSpec("short-chat", num_clients=3, num_rounds=6))
    assert len(short) == 3
    assert short[0].rounds == ((1024, 128),) + ((128, 128),) * 5
    assert WorkloadSpec("short-chat", num_clients=64, num_rounds=6).label == "short-chat-64x6"
    capped = make_conversations(
        WorkloadSpec("short-chat", num_clients=1, num_rounds=2, request_length=500, output_length=7)
    )
    assert capped[0].rounds == ((500, 7), (128, 7))
    mixed = make_conversations(
        WorkloadSpec("mixed", num_clients=120, num_rounds=4, context_tokens=16384)
    )
    long = [c for c in mixed if c.rounds[0][0] == 16384]
    assert len(long) == 24 and len(mixed) == 120  # 1 in 5: 24 long + 96 short
    assert long[0].rounds == ((16384, 128),) + ((256, 128),) * 3
    assert mixed[1].rounds == ((1024, 128),) + ((128, 128),) * 3
    assert [c.rounds[0][0] for c in mixed[:6]] == [16384, 1024, 1024, 1024, 1024, 16384]


def test_shared_prefix_ratios_compare_tangram_025_with_the_best_stock():
    def run(tok_s, hit):
        return {"requests_ok": 4, "output_tok_per_s": tok_s, "wall_s": 1.0, "cache_hit_rate": hit}

    systems = {
        "baseline": {
            "workloads": {
                "long-context-shared-64x4": run(1449, 0.992),
                "system-prompt-64x4": run(1000, 0.9),
            }
        },
        "baseline-flashinfer": {"workloads": {"long-context-shared-64x4": run(1500, 0.99)}},
        "tangram-r0.25": {
            "workloads": {
                "long-context-shared-64x4": run(1650, 0.97),
                "long-context-shared-8x4": run(10, 0.5),
                "system-prompt-64x4": run(960, 0.89),
            }
        },
    }
    s = mt.summarize(systems, "long-context-shared-64x4", None)
    assert s["shared_context_ratio_vs_stock"] == 1650 / 1500
    assert s["system_prompt_ratio_vs_stock"] == 960 / 1000
    assert s["shared_prefix"]["tangram-r0.25"]["system-prompt-64x4"] == {
        "output_tok_per_s": 960,
        "cache_hit_rate": 0.89,
    }
    del systems["tangram-r0.25"]["workloads"]["system-prompt-64x4"]
    s = mt.summarize(systems, "long-context-shared-64x4", None)
    assert s["system_prompt_ratio_vs_stock"] is None
    assert "system-prompt-" in s["missing"]["system_prompt_ratio_vs_stock"]


ITEMS = [
    ("cliff:64", "cliff-64"),
    ("prefill:4x512", "prefill-4x512"),
    ("sharegpt:8x2", "sharegpt-8x2"),
    ("system-prompt:64x4", "system-prompt-64x4"),
    ("short-chat:64x6", "short-chat-64x6"),
    ("mixed:120x4", "mixed-120x4"),
    ("cliff:64:no-max", "cliff-64-no-max"),
    ("sharegpt:8x2:no-max", "sharegpt-8x2-no-max"),
]


@pytest.mark.parametrize("item,label", ITEMS)
def test_workload_items_parse_to_labels(item, label):
    assert mt.parse_workload(item, args()).label == label


def test_no_max_item_marks_only_its_workload():
    assert mt.parse_workload("cliff:64:no-max", args()).no_max_tokens
    assert not mt.parse_workload("cliff:64", args()).no_max_tokens


@pytest.mark.parametrize(
    "bad", ["nope:3", "cliff:x", "sharegpt:2xq", "prefill:4x512:no-max", "cliff:64:nomax"]
)
def test_bad_workload_items_are_config_errors(bad):
    with pytest.raises(ConfigError, match="--workloads"):
        mt.parse_workload(bad, args())


@pytest.mark.parametrize(
    "bad", ["short-chat:4x0", "prefill:16x0", "mixed:1x2x3", "mixed:0x4", "mixed:2x-1"]
)
def test_a_zero_or_extra_size_part_is_named_not_replaced_by_a_default(bad):
    """``4x0`` was read as 4 x --num-rounds and ``1x2x3`` as 1x2: the size must be N or NxM."""
    with pytest.raises(ConfigError, match=r"size must be N or NxM, whole numbers >= 1"):
        mt.parse_workload(bad, args())


def test_systems_parse_and_reject_bad_ratios():
    assert mt.parse_systems("baseline, tangram:0.25") == [
        ("baseline", None),
        ("tangram-r0.25", 0.25),
    ]
    for bad in ("tangram:0", "tangram:1.5", "vllm", ""):
        with pytest.raises(ConfigError, match="--systems"):
            mt.parse_systems(bad)


def test_metrics_text_sums_label_sets_of_the_wanted_gauges():
    text = (
        '# HELP x\nsglang:num_running_reqs{tp_rank="0"} 3.0\n'
        'sglang:num_running_reqs{tp_rank="1"} 2.0\ntangram:pages_used 17\nother 9\n'
    )
    assert mt.parse_metrics(text) == {"sglang:num_running_reqs": 5.0, "tangram:pages_used": 17.0}


def test_summary_ratios_and_missing_runs():
    def run(tok_s, wall, peak):
        return {
            "requests_ok": 4,
            "output_tok_per_s": tok_s,
            "wall_s": wall,
            "peak_running_reqs": peak,
            "cache_hit_rate": 0.5,
        }

    systems = {
        "baseline": {
            "max_total_num_tokens": 100,
            "workloads": {"cliff-64": run(100, 10, 40), "prefill-2x8": run(1, 4.0, 2)},
        },
        "tangram-r0.25": {
            "max_total_num_tokens": 400,
            "workloads": {"cliff-64": run(300, 5, 64), "prefill-2x8": run(1, 5, 2)},
        },
    }
    s = mt.summarize(systems, "cliff-64", "prefill-2x8")
    assert s["throughput_ratio_at_25pct"] == 3.0 and s["cliff_throughput_ratio_64_clients"] == 3.0
    assert s["prefill_time_ratio"] == 1.25 and s["max_concurrency_ratio"] == 1.6
    assert s["kv_capacity_ratio"] == 4.0
    assert s["throughput_ratio_at_50pct"] is None and "throughput_ratio_at_50pct" in s["missing"]


def test_never_slower_ratios_use_the_best_stock_backend_per_workload():
    def run(tok_s):
        return {"requests_ok": 4, "output_tok_per_s": tok_s, "wall_s": 1.0}

    systems = {
        "baseline": {"workloads": {"sharegpt-64x4": run(2400), "cliff-64": run(150)}},
        "baseline-flashinfer": {"workloads": {"sharegpt-64x4": run(2000), "cliff-64": run(185)}},
        "tangram-r0.25": {"workloads": {"sharegpt-64x4": run(2280), "cliff-64": run(500)}},
        "tangram-r1": {"workloads": {"sharegpt-64x4": run(2160), "cliff-64": run(148)}},
    }
    s = mt.summarize(systems, "cliff-64", None)
    assert s["sharegpt_ratio_vs_best_stock"] == 2280 / 2400
    assert s["ratio1_per_workload"] == {"sharegpt-64x4": 0.9, "cliff-64": 148 / 185}
    assert s["ratio1_min_ratio_vs_stock"] == 148 / 185
    assert s["vs_best_stock"]["tangram-r0.25"]["cliff-64"] == {
        "ratio": 500 / 185,
        "stock": "baseline-flashinfer",
    }
    assert s["cliff_throughput_ratio_64_clients"] == 500 / 150  # issue 7's: vs ``baseline``
    del systems["tangram-r1"]
    s = mt.summarize(systems, "cliff-64", None)
    assert s["ratio1_min_ratio_vs_stock"] is None and "ratio1_min_ratio_vs_stock" in s["missing"]


def test_stock_backend_args_replace_the_attention_backend():
    base = ["--attention-backend", "triton", "--disable-radix-cache"]
    assert mt.stock_backend_args("baseline", base) == base
    assert mt.stock_backend_args("baseline-flashinfer", base) == [
        "--disable-radix-cache",
        "--attention-backend",
        "flashinfer",
    ]
    assert mt.stock_backend_args("baseline-no-overlap", base) == base
    assert mt.stock_backend_args("baseline-triton", ["--attention-backend=fa3"]) == [
        "--attention-backend",
        "triton",
    ]


def test_merge_joins_workloads_per_system_and_later_runs_win(tmp_path):
    import json

    def part(name, systems):
        path = tmp_path / name
        path.write_text(json.dumps({"settings": {"main_workload": "cliff-64"}, "systems": systems}))
        return str(path)

    def run(tok_s):
        return {"requests_ok": 4, "output_tok_per_s": tok_s, "wall_s": 1.0}

    old = part(
        "old.json",
        {
            "baseline": {"startup_s": 1, "workloads": {"cliff-64": run(100), "cliff-32": run(400)}},
            "tangram-r0.25": {
                "startup_s": 1,
                "workloads": {"cliff-64": run(300), "cliff-96": run(200)},
            },
        },
    )
    new = part(
        "new.json",
        {
            "tangram-r0.25": {
                "startup_s": 2,
                "workloads": {"cliff-64": run(500), "sharegpt-64x4": run(50)},
            },
        },
    )
    merged = mt.merge([old, new], str(tmp_path / "merged.json"))
    t = merged["systems"]["tangram-r0.25"]
    assert set(t["workloads"]) == {"cliff-64", "cliff-96", "sharegpt-64x4"}
    assert t["startup_s"] == 2
    assert t["workloads"]["cliff-64"]["output_tok_per_s"] == 500
    assert set(merged["systems"]["baseline"]["workloads"]) == {"cliff-64", "cliff-32"}
    assert merged["summary"]["cliff_throughput_ratio_64_clients"] == 5.0
    assert json.loads((tmp_path / "merged.json").read_text())["merged_from"] == [old, new]
    # each run names its file: the workload kept from the older run is not read as the new one's
    assert t["workloads"]["cliff-96"]["source_file"] == old
    assert t["workloads"]["cliff-64"]["source_file"] == new
    assert t["server_source_file"] == new
    assert merged["systems"]["baseline"]["server_source_file"] == old
    # merged again (into a missing folder): the names of the first merge's sources stay
    again = mt.merge([str(tmp_path / "merged.json")], str(tmp_path / "sub" / "again.json"))
    assert again["systems"]["tangram-r0.25"]["workloads"]["cliff-96"]["source_file"] == old
    assert again["systems"]["tangram-r0.25"]["server_source_file"] == new


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (None, "no such file"),
        ("not json", "not JSON"),
        ('{"settings": {}}', "no 'systems' object"),
        ("[1, 2]", "no 'systems' object"),
        ('{"systems": {"baseline": 5}}', "systems.baseline is not an object"),
        ('{"systems": {"baseline": {"workloads": []}}}', "baseline.workloads is not an object"),
        (
            '{"systems": {"baseline": {"workloads": {"cliff-64": 3}}}}',
            "baseline.workloads.cliff-64 is not an object",
        ),
        ('{"settings": [], "systems": {}}', "settings is not an object"),
        (
            '{"systems": {"baseline": {"workloads": {"cliff-64": {"requests_ok": 4,'
            ' "output_tok_per_s": "fast"}}}, "tangram-r0.25": {"workloads": {"cliff-64":'
            ' {"requests_ok": 4, "output_tok_per_s": 3}}}}}',
            "a type the summary cannot read",
        ),
    ],
    ids=[
        "missing",
        "not-json",
        "no-systems",
        "a-list",
        "system-not-dict",
        "workloads-not-dict",
        "workload-not-dict",
        "settings-not-dict",
        "throughput-not-number",
    ],
)
def test_merge_names_the_bad_file_and_exits_2(tmp_path, capsys, text, match):
    good = tmp_path / "good.json"
    good.write_text('{"systems": {"baseline": {"workloads": {}}}}')
    bad = tmp_path / "bad.json"
    if text is not None:
        bad.write_text(text)
    out = tmp_path / "merged.json"
    assert mt.main(["merge", str(good), str(bad), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and match in err and not out.exists()


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--num-clients", "100000000", "--systems", "baseline"], "--num-clients"),
        (["--systems", "baseline", "--workloads", "sharegpt:20000x2"], "clients must be"),
        (["--systems", "tangram:0.25"], "--profile"),
        (["--systems", "baseline", "--max-parallel", "0"], "--max-parallel"),
        (["--systems", "baseline", "--workloads", ","], "--workloads is empty"),
    ],
    ids=["huge-clients", "huge-workload", "no-profile", "zero-parallel", "no-workloads"],
)
def test_bad_flags_stop_before_any_server_or_file(tmp_path, capsys, argv, match):
    out = tmp_path / "r.json"
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"vocab_size": 5000}')
    code = mt.main(["--model-path", str(model), "--device", "cpu", "--output", str(out), *argv])
    assert code == 2 and match in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--workloads", "cliff:2", "--main-workload", "zzz"], "--main-workload 'zzz': not one"),
        (["--server-args", '"x'], "--server-args '\"x': No closing quotation"),
        (["--baseline-args", "'y"], '--baseline-args "\'y": No closing quotation'),
    ],
)
def test_main_workload_and_server_args_are_checked_before_any_server(tmp_path, capsys, argv, match):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"vocab_size": 5000}')
    argv = ["--model-path", str(model), "--device", "cpu", "--systems", "baseline", *argv]
    assert mt.main([*argv, "--output", str(tmp_path / "r.json")]) == 2
    assert match in capsys.readouterr().err


def test_main_workload_defaults_to_cliff_64_else_the_first_workload(tmp_path):
    a = args(argv=["--systems", "baseline", "--output", str(tmp_path / "r.json")])
    a.device = "cpu"
    mt.check_args(a, mt.parse_systems("baseline"), [mt.parse_workload("sharegpt:2x2", a)])
    assert a.main_workload == "sharegpt-2x2"


def test_cpu_runs_never_default_to_the_committed_results(tmp_path, monkeypatch):
    assert mt.CPU_OUTPUT.startswith("/tmp/") and "benchmarks/results" in mt.CUDA_OUTPUT
    monkeypatch.setattr(mt, "CPU_OUTPUT", str(tmp_path / "cpu" / "multiturn-cpu.json"))
    a = args(argv=["--systems", "baseline"])
    a.device = "cpu"
    mt.check_args(a, mt.parse_systems("baseline"), [mt.parse_workload("cliff:2", a)])
    assert a.output == mt.CPU_OUTPUT and (tmp_path / "cpu").is_dir()  # made for the JSON


def test_no_max_tokens_requests_end_on_a_fixed_stop_subset():
    from tangram_sglang.bench.multiturn_client import stop_token_ids

    ids = stop_token_ids(128256, 128)
    assert len(ids) == 1002 and ids == stop_token_ids(128256, 128)  # fixed per (vocab, mean)
    assert len(set(ids)) == len(ids) and min(ids) >= 0 and max(ids) < 128256
    assert stop_token_ids(100, 1000) and len(stop_token_ids(100, 1)) == 100


def test_client_drops_idle_connections_before_the_server_does(monkeypatch):
    """SGLang's HTTP server (uvicorn) closes a keep-alive connection idle for
    SGLANG_TIMEOUT_KEEP_ALIVE seconds; a client waiting at a round barrier longer than that must
    not reuse it (ServerDisconnectedError), so the client's pool gives idle connections up first."""
    import asyncio

    import aiohttp
    from sglang.srt.environ import envs

    from tangram_sglang.bench import multiturn_client as mc

    assert 0 < mc.KEEPALIVE_S < envs.SGLANG_TIMEOUT_KEEP_ALIVE.get()
    seen = []

    class Recorded(aiohttp.TCPConnector):
        def __init__(self, *args, **kwargs):
            seen.append(kwargs)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(aiohttp, "TCPConnector", Recorded)
    from tangram_sglang.bench.multiturn_workloads import Conversation

    # port 9 (discard) refuses: the one request ends as a recorded connection error
    settings = mc.LoadSettings(timeout_s=5.0)
    conv = [Conversation(rounds=((4, 2),))]
    records, _ = asyncio.run(mc.run_conversations("http://127.0.0.1:9", conv, 32000, settings))
    assert len(records) == 1 and records[0].error
    assert seen == [{"limit": 0, "keepalive_timeout": mc.KEEPALIVE_S}]


def test_no_max_tokens_reaches_sglang_unset():
    """SGLang's own SamplingParams, built from the JSON body as /generate does: no 128 cap."""
    from sglang.srt.sampling.sampling_params import SamplingParams

    from tangram_sglang.bench.multiturn_client import sampling_params

    body = json.loads(json.dumps(sampling_params(64, 49152, no_max_tokens=True, length=300)))
    params = SamplingParams(**body)
    params.verify(49152)  # min_new_tokens 299: above the default cap, a 400 if it were set
    assert params.max_new_tokens is None and params.min_new_tokens == 299
    fixed = SamplingParams(**sampling_params(64, 49152, no_max_tokens=False))
    assert fixed.max_new_tokens == 64 and fixed.ignore_eos


def test_no_max_tokens_lengths_are_the_same_for_every_system_and_geometric():
    from tangram_sglang.bench.multiturn_client import (
        STOP_BIAS,
        no_max_length,
        sampling_params,
        stop_token_ids,
    )

    # fixed per (seed, client, round), whatever order the requests go out in
    assert no_max_length(128, 0, 3, 1) == no_max_length(128, 0, 3, 1)
    draws = [no_max_length(128, 0, c, r) for c in range(200) for r in range(4)]
    assert min(draws) >= 1 and 115 < np.mean(draws) < 141  # geometric, mean 128
    assert len(set(draws)) > 100  # the conversations fall out of step
    assert [no_max_length(128, 1, c, 0) for c in range(20)] != draws[:80:4]  # seed matters
    params = sampling_params(128, 128256, no_max_tokens=True, length=57)
    assert params["max_new_tokens"] is None and "ignore_eos" not in params
    assert params["temperature"] == 1.0 and params["min_new_tokens"] == 56
    # one fixed stop id, biased so that it is the token right after min_new_tokens (the
    # exact length on a real server: tests/e2e/test_admission.py)
    assert params["stop_token_ids"] == stop_token_ids(128256, 128256)
    assert params["logit_bias"] == {str(params["stop_token_ids"][0]): STOP_BIAS}
    again = sampling_params(64, 128256, no_max_tokens=True, length=9)
    assert again["stop_token_ids"] == params["stop_token_ids"]
    fixed = sampling_params(128, 128256, no_max_tokens=False)
    assert fixed == {"max_new_tokens": 128, "ignore_eos": True, "temperature": 0.0}


@pytest.mark.parametrize("where", ["--server-args", "--baseline-args"])
def test_no_max_workloads_refuse_skip_tokenizer_init_before_any_server(tmp_path, capsys, where):
    """SGLang answers min_new_tokens with HTTP 400 without a tokenizer (seen on an H200: 252
    failed requests); the bench says so before a server starts."""
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"vocab_size": 5000}')
    argv = ["--model-path", str(model), "--device", "cpu", "--systems", "baseline"]
    argv += ["--workloads", "cliff:2,cliff:2:no-max", f"{where}=--skip-tokenizer-init"]
    assert mt.main([*argv, "--output", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err
    assert "--workloads cliff-2-no-max" in err and "drop --skip-tokenizer-init" in err
    assert "dummy_tokenizer" in err


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["--workloads", "cliff:2", "--no-max-tokens"], "--no-max-tokens:"),
        (["--workloads", "cliff:2:no-max", "--server-args=--skip-tokenizer"], "--server-args"),
        (["--workloads", "cliff:2:no-max", "--server-args=--x 1 --skip-tok"], "--server-args"),
    ],
)
def test_no_max_refusal_names_its_source_and_reads_abbreviated_flags(
    tmp_path, capsys, extra, named
):
    """SGLang's argparse takes ``--skip-tokenizer`` for ``--skip-tokenizer-init``; the global
    ``--no-max-tokens`` is named as the reason, not the workload list."""
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"vocab_size": 5000}')
    argv = ["--model-path", str(model), "--device", "cpu", "--systems", "baseline"]
    argv += ["--baseline-args=--skip-tokenizer-init"] if "--no-max-tokens" in extra else []
    assert mt.main([*argv, *extra, "--output", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err
    assert named in err and "drop --skip-tokenizer-init" in err


def test_baseline_args_of_a_tangram_only_run_are_not_refused(tmp_path):
    """``--baseline-args`` reach stock systems only: a tangram-only run ignores them."""
    profile = REPO / "calibration/smollm2/ada-snapkv-r0.25.json"
    args = mt.build_parser().parse_args(
        ["--model-path", "m", "--profile", str(profile), "--systems", "tangram:0.5"]
        + ["--workloads", "cliff:2:no-max", "--baseline-args=--skip-tokenizer-init"]
        + ["--output", str(tmp_path / "r.json")]
    )
    args.vocab_size = 5000
    systems = mt.parse_systems(args.systems)
    specs = [mt.parse_workload(args.workloads, args)]
    mt.check_args(args, systems, specs)  # no error: no stock system reads --baseline-args
    args.server_args = "--skip-tokenizer-init"
    with pytest.raises(ConfigError, match="drop --skip-tokenizer-init from --server-args"):
        mt.check_args(args, systems, specs)


def test_no_max_requests_hold_off_the_model_eos_ids(tmp_path):
    """The min-new-tokens penalizer blocks the tokenizer's EOS only; the server also stops on
    the config's EOS ids (SmolLM2: 1 and 2), so the bench biases those away."""
    from tangram_sglang.bench.multiturn_client import model_eos_ids, sampling_params

    (tmp_path / "config.json").write_text('{"eos_token_id": 2}')
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 7, true]}')
    assert model_eos_ids(tmp_path) == (2, 7)
    assert model_eos_ids(tmp_path / "missing") == ()
    params = sampling_params(64, 5000, True, 10, model_eos_ids(tmp_path))
    (stop,) = params["stop_token_ids"]
    assert params["logit_bias"] == {"2": -100.0, "7": -100.0, str(stop): 100.0}
    assert "logit_bias" not in sampling_params(64, 5000, False, None, (2, 7))


def test_warmup_conversations_keep_the_workload_prompts_and_cut_rounds_and_outputs():
    from tangram_sglang.bench.multiturn_workloads import (
        WARMUP_OUTPUT,
        WARMUP_ROUNDS,
        warmup_conversations,
    )

    convs = make_conversations(WorkloadSpec("cliff", num_clients=12))
    warm = warmup_conversations(convs, 8)
    assert len(warm) == 8 and WARMUP_ROUNDS == 2
    assert warm[0].rounds == ((16384, WARMUP_OUTPUT), (256, WARMUP_OUTPUT))
    assert len(warmup_conversations(convs[:3], 8)) == 3  # never more than the workload has
    assert warmup_conversations(convs, 0) == []
    with pytest.raises(ConfigError, match="--warmup-clients -1 is negative"):
        warmup_conversations(convs, -1)


def test_bad_warmup_clients_flag_stops_before_any_server(tmp_path, capsys):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"vocab_size": 5000}')
    argv = ["--model-path", str(model), "--device", "cpu", "--systems", "baseline"]
    out = tmp_path / "r.json"
    assert mt.main([*argv, "--warmup-clients", "-2", "--output", str(out)]) == 2
    assert "--warmup-clients -2: must be 0..10000" in capsys.readouterr().err
    assert not out.exists()


def test_measure_warms_up_unmeasured_then_flushes_then_runs_the_workload():
    """Against a local HTTP endpoint that speaks /generate's streaming format: the warm-up's
    requests come first (other token ids, 8 tokens out), then /flush_cache, then the workload;
    only the workload's requests are in the result."""
    import asyncio

    from aiohttp import web

    from tangram_sglang.bench.multiturn_client import LoadSettings

    calls: list[tuple] = []

    async def generate(request):
        body = await request.json()
        ids, n = body["input_ids"], body["sampling_params"]["max_new_tokens"]
        calls.append(("generate", len(ids), n, tuple(ids[:4])))
        resp = web.StreamResponse()
        await resp.prepare(request)
        meta = {"prompt_tokens": len(ids), "completion_tokens": n, "cached_tokens": 0}
        chunk = {"output_ids": list(range(5, 5 + n)), "meta_info": meta}
        await resp.write(f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode())
        return resp

    async def flush(request):
        calls.append(("flush",))
        if refuse_flush:
            return web.Response(status=400, text="Cache not flushed: requests are running")
        return web.Response(text="ok")

    async def metrics(request):
        return web.Response(text="")

    async def run():
        app = web.Application()
        app.add_routes(
            [
                web.post("/generate", generate),
                web.post("/flush_cache", flush),
                web.get("/metrics", metrics),
            ]
        )
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            spec = WorkloadSpec("short-chat", num_clients=3, num_rounds=3)
            settings = LoadSettings(timeout_s=30.0, warmup_clients=2)
            return await mt.measure(
                f"http://127.0.0.1:{port}",
                spec,
                32000,
                settings,
                on_start=lambda: calls.append(("start",)),
            )
        finally:
            await runner.cleanup()

    refuse_flush = False
    result = asyncio.run(run())
    flush_at = calls.index(("flush",))
    assert calls[flush_at + 1] == ("start",)  # the run's start is marked after the flush
    warm, timed = calls[:flush_at], calls[flush_at + 2 :]
    assert [c[1:3] for c in warm if c[1] == 1024] == [(1024, 8), (1024, 8)]  # 2 first turns
    assert len(warm) == 4 and all(c[2] == 8 for c in warm)  # 2 clients x 2 rounds, 8 out
    assert len(timed) == 9 and all(c[2] == 128 for c in timed)  # 3 clients x 3 rounds
    firsts = {c[3] for c in warm if c[1] == 1024} & {c[3] for c in timed if c[1] == 1024}
    assert not firsts  # the warm-up's token ids are not the workload's (no cache hit)
    assert result["requests_ok"] == result["requests_planned"] == 9
    assert result["output_tokens"] == 9 * 128
    # a refused flush stops the workload before it runs: it would not start cold
    refuse_flush = True
    calls.clear()
    with pytest.raises(TangramError, match="short-chat-3x3: /flush_cache answered HTTP 400"):
        asyncio.run(run())
    assert not calls[calls.index(("flush",)) + 1 :]


@pytest.mark.parametrize("error", [None, "profile model.num_layers=24 but the served model has 30"])
def test_a_failed_system_makes_the_run_exit_1_after_writing_the_json(
    tmp_path, capsys, monkeypatch, error
):
    """A system whose server or workload failed (``error`` set) is a failed run (exit 1), yet
    the JSON and the summary are still written."""
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"vocab_size": 5000}')

    def fake_run_system(name, flags, specs, args, result):
        result["systems"][name] = {"server_args": flags, "workloads": {}, "error": error}
        mt.write_result(result, args)

    monkeypatch.setattr(mt, "run_system", fake_run_system)
    out = tmp_path / "r.json"
    argv = ["--model-path", str(model), "--device", "cpu", "--systems", "baseline"]
    argv += ["--workloads", "cliff:2", "--log-dir", str(tmp_path / "logs"), "--output", str(out)]
    code = mt.main(argv)
    captured = capsys.readouterr()
    assert json.loads(out.read_text())["systems"]["baseline"]["error"] == error
    assert '"main_workload": "cliff-2"' in captured.out  # the summary is printed either way
    if error is None:
        assert code == 0 and "failed" not in captured.err
    else:
        assert code == 1 and "1 system(s) failed: baseline" in captured.err


def _model_folder(tmp_path, profile_path) -> Path:
    """A config-only model folder with the geometry of ``profile_path``'s model."""
    from tangram_sglang.profile import BudgetProfile

    m = BudgetProfile.load(profile_path).model
    folder = tmp_path / "model"
    folder.mkdir()
    config = {
        "vocab_size": 5000,
        "architectures": [m.architecture],
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_qo_heads,
        "num_key_value_heads": m.num_kv_heads,
        "head_dim": m.head_dim,
        "hidden_size": m.num_qo_heads * m.head_dim,
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_profile_for_another_model_stops_before_any_server(tmp_path, capsys, monkeypatch):
    """The profile's geometry is checked against the model's config.json up front: a Qwen
    profile on SmolLM2 used to show only after the stock baseline had run."""
    monkeypatch.setattr(mt, "run_system", lambda *a: pytest.fail("a server was started"))
    model = _model_folder(tmp_path, REPO / "calibration/smollm2/ada-snapkv-r0.25.json")
    out = tmp_path / "r.json"
    other = REPO / "calibration/qwen2.5-0.5b/ada-snapkv-r0.25.json"
    argv = ["--model-path", str(model), "--device", "cpu", "--profile", str(other)]
    assert mt.main([*argv, "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--profile {other}: profile model.num_layers=24 but the served model has 30" in err
    assert "calibrate one for this model" in err and not out.exists()
    # the matching profile passes (the fingerprint is left to the server's own check)
    a = args(argv=["--profile", str(REPO / "calibration/smollm2/ada-snapkv-r0.25.json")])
    a.model_path, a.output = str(model), str(out)
    mt.check_args(a, mt.parse_systems(a.systems), [mt.parse_workload("cliff:2", a)])
    # a config that leaves a head count to its transformers class (a VLM's text_config, say)
    # is not judged here: the server reads the filled-in config and checks the profile itself
    config = json.loads((model / "config.json").read_text())
    del config["num_key_value_heads"]
    (model / "config.json").write_text(json.dumps({"text_config": config}))
    a.profile = str(other)
    mt.check_args(a, mt.parse_systems(a.systems), [mt.parse_workload("cliff:2", a)])


def test_an_invalid_profile_file_is_named_before_any_server(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(mt, "run_system", lambda *a: pytest.fail("a server was started"))
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"vocab_size": 5000}')
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema_version": 1, "model": ')
    argv = ["--model-path", str(model), "--device", "cpu", "--profile", str(bad)]
    assert mt.main([*argv, "--output", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err
    assert f"--profile: {bad}: not a JSON profile" in err and "calibrate" in err


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--workloads", ","], "--workloads is empty"),
        (["--max-parallel", "0"], "--max-parallel 0: must be > 0"),
        (["--workloads", "cliff:2", "--main-workload", "zzz"], "--main-workload 'zzz'"),
        ([], "--profile is missing: the tangram:R systems (tangram-r0.25, tangram-r0.5)"),
    ],
)
def test_without_profile_other_bad_flags_are_reported_first(
    tmp_path, capsys, monkeypatch, argv, match
):
    """The default systems need --profile, but a bad flag elsewhere is named as such."""
    monkeypatch.setattr(mt, "run_system", lambda *a: pytest.fail("a server was started"))
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"vocab_size": 5000}')
    out = tmp_path / "r.json"
    code = mt.main(["--model-path", str(model), "--device", "cpu", "--output", str(out), *argv])
    assert code == 2 and match in capsys.readouterr().err and not out.exists()


def test_every_flag_has_help_and_the_help_examples_parse():
    parser = mt.build_parser()
    assert [a.option_strings for a in parser._actions if not a.help] == []
    help_of = {a.option_strings[0]: a.help for a in parser._actions}
    workloads = help_of["--workloads"].split("e.g. ", 1)[1].split(" ", 1)[0]
    labels = [mt.parse_workload(item, args()).label for item in workloads.split(",")]
    assert labels == ["cliff-64", "sharegpt-64x4", "mixed-120x4", "prefill-16x8192"] + [
        "cliff-64-no-max"
    ]
    systems = help_of["--systems"].split("e.g. ", 1)[1].split(" ", 1)[0]
    names = [name for name, _ in mt.parse_systems(systems)]
    assert names == ["baseline", "baseline-flashinfer", "tangram-r0.25"]
    assert "(default: inf, no pacing)" in help_of["--request-rate"]
