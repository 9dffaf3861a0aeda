"""``--tangram`` flags through SGLang's own ServerArgs (patched sglang 0.5.17, CPU, no server)."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tangram_sglang.config import DEFAULT_MIN_COMPRESS_TOKENS, DEFAULT_PAGE_SIZE
from tangram_sglang.errors import ConfigError, ProfileError
from tangram_sglang.integration import plugin
from tangram_sglang.integration.hook_targets import HOOKS, REGISTRATIONS
from tangram_sglang.integration.server_args import (
    CPU_SERVING_DOC,
    INCOMPATIBLE_FLAGS,
    SUMMARY_STASH,
    check_cpu_engine,
    profile_from_server_args,
    rank_profile_from_server_args,
    summary_from_server_args,
)
from tangram_sglang.profile import BudgetProfile, ModelIdentity
from tangram_sglang.serving import cpu_env

REPO = Path(__file__).resolve().parents[2]


FLAGS = (
    "--tangram",
    "--tangram-profile",
    "--tangram-page-group-size",
    "--tangram-page-size",
    "--tangram-target-ratio",
    "--tangram-scope",
    "--tangram-min-compress-tokens",
    "--tangram-scorer",
)
# A value that turns each incompatible flag on (default: True).
BAD_VALUES = {
    "speculative_algorithm": "EAGLE",
    "disaggregation_mode": "prefill",
    "pp_size": 2,
    "dp_size": 2,
    "attn_cp_size": 2,
    "dcp_size": 2,
    "lora_paths": ["a=/tmp/a"],
    "kv_cache_dtype": "float16",
    "dllm_algorithm": "LowConfidence",
    "page_size": 16,
}


def make_args(server_args_cls, model_path, profile, **kwargs):
    """ServerArgs exactly as ``sglang.Engine(**kwargs)`` builds it."""
    return server_args_cls(
        model_path=str(model_path), device="cpu", tangram=True, tangram_profile=profile, **kwargs
    )


def test_help_documents_every_flag(patched_sglang):
    parser = argparse.ArgumentParser()
    patched_sglang.add_cli_args(parser)
    text = parser.format_help()
    for flag in FLAGS:
        assert flag in text, flag


def test_cli_flags_parse_through_prepare_server_args(patched_sglang, smollm2_path, smollm2_profile):
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(
        [
            "--model-path",
            str(smollm2_path),
            "--device",
            "cpu",
            "--tangram",
            "--tangram-profile",
            smollm2_profile,
            "--tangram-page-group-size",
            "1",
            "--tangram-page-size",
            "32",
            "--tangram-target-ratio",
            "0.4",
            "--tangram-scope",
            "per_layer",
            "--disable-radix-cache",
        ]
    )
    assert (args.tangram, args.tangram_profile) == (True, smollm2_profile)
    assert (args.tangram_page_group_size, args.tangram_page_size) == (1, 32)
    assert (args.tangram_target_ratio, args.tangram_scope) == (0.4, "per_layer")
    profile = profile_from_server_args(args)
    assert profile.mean_kept_fraction() == pytest.approx(0.4)
    assert profile.grouping.heads_per_group == 1 and profile.grouping.scope == "per_layer"
    info = dataclasses.asdict(args)  # what /server_info dumps
    assert info["tangram"] is True and info["tangram_target_ratio"] == 0.4


def test_engine_kwargs_path_and_pickling(patched_sglang, smollm2_path, smollm2_profile):
    from sglang.srt.entrypoints.engine import Engine

    assert Engine.server_args_class is patched_sglang  # Engine(**kwargs) -> ServerArgs(**kwargs)
    args = make_args(patched_sglang, smollm2_path, smollm2_profile, tangram_page_size=8)
    clone = pickle.loads(pickle.dumps(args))  # how the scheduler process receives it
    assert (clone.tangram, clone.tangram_profile, clone.tangram_page_size) == (
        True,
        smollm2_profile,
        8,
    )
    assert summary_from_server_args(clone) == summary_from_server_args(args)
    shipped = BudgetProfile.load(smollm2_profile)
    assert profile_from_server_args(clone).to_dict() == (
        shipped.with_min_compress_tokens(DEFAULT_MIN_COMPRESS_TOKENS).to_dict()
    )


def test_the_summary_records_the_kernel_switches(
    patched_sglang, smollm2_path, smollm2_profile, monkeypatch
):
    """``/server_info``'s ``tangram`` block carries the decode plan, CTAs per SM and attention
    switches the server started under (defaults, then the environment's), stashed or rebuilt."""
    from tangram_sglang.config import DECODE_CTAS_ENV, DECODE_PLAN_ENV

    for name in (DECODE_CTAS_ENV, DECODE_PLAN_ENV):
        monkeypatch.delenv(name, raising=False)
    args = make_args(patched_sglang, smollm2_path, smollm2_profile)
    summary = summary_from_server_args(args)
    assert (summary["decode_plan"], summary["decode_ctas_per_sm"]) == ("batch", 12)
    assert summary["prefill_attention"] and summary["history_attention"]
    monkeypatch.setenv(DECODE_CTAS_ENV, "28")
    monkeypatch.setenv(DECODE_PLAN_ENV, "table")
    args = make_args(patched_sglang, smollm2_path, smollm2_profile)
    assert summary_from_server_args(args)["decode_ctas_per_sm"] == 28
    unstashed = copy.copy(args)
    object.__delattr__(unstashed, SUMMARY_STASH)
    assert summary_from_server_args(unstashed) == summary_from_server_args(args)
    assert summary_from_server_args(unstashed)["decode_plan"] == "table"


def test_min_compress_tokens_reaches_the_scheduler_profile(
    patched_sglang, smollm2_path, smollm2_profile
):
    """The flag is one number for admission, allocation and scoring: it rides on the profile."""
    args = make_args(patched_sglang, smollm2_path, smollm2_profile, tangram_min_compress_tokens=64)
    profile = profile_from_server_args(pickle.loads(pickle.dumps(args)))
    assert profile.min_compress_tokens == 64
    assert profile.group_kept_lens(63) == [63] * profile.grouping.num_head_groups
    assert min(profile.group_kept_lens(64)) < 64  # the smollm2 profile compresses 64 tokens
    assert summary_from_server_args(args)["min_compress_tokens"] == 64
    with pytest.raises(ConfigError, match="--tangram-min-compress-tokens -1 must be an integer"):
        make_args(patched_sglang, smollm2_path, smollm2_profile, tangram_min_compress_tokens=-1)


def test_scorer_flag_picks_the_shipped_profile_of_that_scorer(patched_sglang, smollm2_path):
    """``--tangram-scorer`` chooses among the shipped profiles (default: kvzip-gate's)."""
    from sglang.srt.server_args import prepare_server_args

    base = ["--model-path", str(smollm2_path), "--device", "cpu", "--tangram"]
    for flags, scorer in (
        ([], "kvzip-gate"),
        (["--tangram-scorer", "kvzip-lite"], "kvzip-lite"),
        (["--tangram-scorer", "ada-snapkv"], "ada-snapkv"),
    ):
        args = prepare_server_args(base + flags)
        clone = pickle.loads(pickle.dumps(args))  # the scheduler process resolves it again
        for a in (args, clone):
            assert profile_from_server_args(a).scorer == scorer
            assert summary_from_server_args(a)["scorer"] == scorer
        assert Path(summary_from_server_args(args)["profile_path"]).name == f"{scorer}-r0.25.json"
    with pytest.raises(ConfigError, match="--tangram-scorer 'h2o' is unknown"):
        prepare_server_args(base + ["--tangram-scorer", "h2o"])
    kvzip = str(REPO / "calibration" / "smollm2" / "kvzip-lite-r0.5.json")
    with pytest.raises(ConfigError, match="calibrated with kvzip-lite"):
        prepare_server_args(base + ["--tangram-profile", kvzip, "--tangram-scorer", "snapkv"])


def test_tangram_options_without_tangram_are_refused(patched_sglang, smollm2_path):
    """A stock server would silently ignore them: one line names them and the fix."""
    from sglang.srt.server_args import prepare_server_args

    base = ["--model-path", str(smollm2_path), "--device", "cpu"]
    with pytest.raises(ConfigError, match=r"^--tangram-scorer given without --tangram"):
        prepare_server_args(base + ["--tangram-scorer", "ada-snapkv"])
    flags = ["--tangram-target-ratio", "0.5", "--tangram-page-size", "32"]
    with pytest.raises(ConfigError) as info:
        prepare_server_args(base + flags)
    assert "--tangram-page-size, --tangram-target-ratio given without --tangram" in str(
        info.value
    ) or "--tangram-target-ratio, --tangram-page-size given without --tangram" in str(info.value)
    assert "Add --tangram, or drop them" in str(info.value)
    assert prepare_server_args(base).tangram is False  # defaults pass


def test_stock_args_unchanged(patched_sglang, smollm2_path):
    args = patched_sglang(model_path=str(smollm2_path), device="cpu")
    assert args.tangram is False and args.tangram_profile is None
    assert args.tangram_page_size == DEFAULT_PAGE_SIZE  # the patch's default = config's
    assert not hasattr(args, "_tangram_profile_json")


@pytest.mark.parametrize(
    "env", [{}, {"SGLANG_USE_CPU_ENGINE": "0"}, {"SGLANG_USE_CPU_ENGINE": "true"}]
)
def test_device_cpu_without_the_cpu_engine_is_refused(env):
    """It used to start, then the scheduler died in model code (No module named 'vllm')."""
    with pytest.raises(ConfigError) as info:
        check_cpu_engine(SimpleNamespace(device="cpu"), env)
    message = str(info.value)
    assert message.startswith("--device cpu needs SGLang's CPU engine")
    assert (
        "SGLANG_USE_CPU_ENGINE=1" in message and "PYTHONPATH=tangram_sglang/cpu_standin" in message
    )
    anchor = CPU_SERVING_DOC.split("#")[1]
    assert "\n### CPU serving (development and CI)\n" in (REPO / "docs/reference.md").read_text()
    assert anchor == "cpu-serving-development-and-ci"
    check_cpu_engine(SimpleNamespace(device="cpu"), {"SGLANG_USE_CPU_ENGINE": "1"})
    check_cpu_engine(SimpleNamespace(device="cuda"), env)


def test_tangram_server_args_check_the_cpu_engine(patched_sglang, smollm2_path, monkeypatch):
    from tangram_sglang.integration import server_args

    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    monkeypatch.setattr(server_args, "ENVIRON", os.environ)  # the conftest's CPU launch env off
    with pytest.raises(ConfigError, match="--device cpu needs SGLang's CPU engine"):
        make_args(patched_sglang, smollm2_path, None)


@pytest.mark.parametrize("rule", INCOMPATIBLE_FLAGS, ids=lambda rule: rule.flag)
def test_incompatible_flag_rejected(patched_sglang, smollm2_path, smollm2_profile, rule):
    value = BAD_VALUES.get(rule.field, True)
    with pytest.raises(ConfigError) as info:
        make_args(patched_sglang, smollm2_path, smollm2_profile, **{rule.field: value})
    message = str(info.value)
    assert rule.flag in message and "cannot be combined with --tangram" in message
    assert rule.reason in message


@pytest.mark.parametrize(
    ("name", "overrides", "what"),
    [
        (
            "mistral",
            {
                "architectures": ["MistralForCausalLM"],
                "model_type": "mistral",
                "sliding_window": 256,
            },
            "sliding-window attention",
        ),
        (
            "gpt-oss",
            {
                "architectures": ["GptOssForCausalLM"],
                "model_type": "gpt_oss",
                "sliding_window": 128,
                "num_local_experts": 4,
                "num_experts_per_tok": 2,
                "layer_types": ["sliding_attention", "full_attention"] * 15,
            },
            "hybrid sliding-window",
        ),
        (
            "deepseek-mla",
            {
                "architectures": ["DeepseekV2ForCausalLM"],
                "model_type": "deepseek_v2",
                "kv_lora_rank": 32,
                "q_lora_rank": None,
                "qk_rope_head_dim": 16,
                "qk_nope_head_dim": 32,
                "v_head_dim": 32,
                "n_routed_experts": 4,
                "n_shared_experts": 1,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 64,
                "first_k_dense_replace": 100,
                "topk_method": "greedy",
                "n_group": 1,
                "topk_group": 1,
            },
            "MLA",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_unsupported_model_rejected(
    patched_sglang, fake_model, smollm2_profile, name, overrides, what
):
    with pytest.raises(ConfigError, match=f"--tangram cannot serve .*{what}"):
        make_args(patched_sglang, fake_model(name, **overrides), smollm2_profile)


def test_profile_for_another_model_stops_startup(
    patched_sglang, smollm2_path, tmp_path, make_profile
):
    other = ModelIdentity(
        "LlamaForCausalLM", num_layers=4, num_kv_heads=3, num_qo_heads=9, head_dim=64
    )
    path = tmp_path / "other.json"
    make_profile(other).save(path)
    with pytest.raises(ProfileError, match=r"model.num_layers=4 but the served model has 30"):
        make_args(patched_sglang, smollm2_path, str(path))


def test_corrupt_profile_stops_startup(patched_sglang, smollm2_path, tmp_path):
    path = tmp_path / "corrupt.json"
    path.write_text('{"schema_version": 1, "ratio": [[0.5')
    with pytest.raises(ProfileError, match="not a JSON profile"):
        make_args(patched_sglang, smollm2_path, str(path))


def test_a_bad_scorer_option_stops_startup_naming_the_profile_file(
    patched_sglang, smollm2_path, tmp_path
):
    data = json.loads(Path("calibration/smollm2/kvzip-gate-r0.25.json").read_text())
    data["provenance"]["scorer_options"]["window_share"] = 1.5
    path = tmp_path / "gate-share.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=rf"--tangram-profile {path}: window_share=1.5 must be"):
        make_args(patched_sglang, smollm2_path, str(path))


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (
            lambda p: p["scorer_options"].update(window_shar=0.25),
            r"provenance.scorer_options.window_shar: the kvzip-gate scorer has no option "
            r"'window_shar' \(it accepts weights, obs_window, window_share, alpha_safeguard\); "
            r"did you mean 'window_share'\? Rename it to provenance.scorer_options.window_share$",
        ),
        (
            lambda p: p.update(window_share=0.25),
            r"provenance.window_share is a scorer option outside provenance.scorer_options, "
            r"where the scorer never reads it; move it to provenance.scorer_options.window_share$",
        ),
    ],
    ids=["misspelled", "misplaced"],
)
def test_an_unknown_scorer_option_stops_startup_naming_the_profile_file(
    patched_sglang, smollm2_path, tmp_path, edit, needle
):
    """A misspelled or misplaced option name used to load and serve without the option."""
    data = json.loads(Path("calibration/smollm2/kvzip-gate-r0.25.json").read_text())
    edit(data["provenance"])
    path = tmp_path / "gate-share.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=rf"^--tangram-profile {path}: {needle}"):
        make_args(patched_sglang, smollm2_path, str(path))


def test_bad_tangram_option_names_flag(patched_sglang, smollm2_path, smollm2_profile):
    with pytest.raises(ConfigError, match="--tangram-page-size 12 must be a power of two"):
        make_args(patched_sglang, smollm2_path, smollm2_profile, tangram_page_size=12)


def test_plugin_hooks_applied_in_process(
    patched_sglang, smollm2_path, smollm2_profile, tangram_backends_registered
):
    args = make_args(patched_sglang, smollm2_path, smollm2_profile)  # runs ensure_active()
    assert plugin.state().active and plugin.verify() == []
    registered = [f"{reg.registry}[{reg.key!r}]" for reg in REGISTRATIONS]
    assert plugin.state().verified == [row.target for row in HOOKS] + registered
    from sglang.srt.managers.scheduler import Scheduler

    scheduler = SimpleNamespace(
        server_args=args, max_total_num_tokens=64, max_req_input_len=32, startup_time=0.0
    )
    info = Scheduler.get_init_info(scheduler)  # the real, wrapped method
    assert info["max_total_num_tokens"] == 64
    assert info["tangram"]["profile_path"] == smollm2_profile
    assert info["tangram"]["num_head_groups"] == 30
    stock = patched_sglang(model_path=str(smollm2_path), device="cpu")
    assert "tangram" not in Scheduler.get_init_info(
        SimpleNamespace(
            server_args=stock, max_total_num_tokens=64, max_req_input_len=32, startup_time=0.0
        )
    )


@pytest.mark.slow
def test_plugin_left_out_by_sglang_plugins_stops_startup(
    patched_sglang, smollm2_path, smollm2_profile
):
    code = (
        "from sglang.srt.plugins import load_plugins; load_plugins()\n"
        "from sglang.srt.server_args import prepare_server_args\n"
        f"prepare_server_args(['--model-path', {str(smollm2_path)!r}, '--device', 'cpu', "
        f"'--tangram', '--tangram-profile', {smollm2_profile!r}])\n"
    )
    env = cpu_env({**os.environ, "SGLANG_PLUGINS": "smg-zmq"})  # as a CPU server starts
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode != 0
    assert "--tangram needs the Tangram SGLang plugin" in result.stderr
    assert "SGLANG_PLUGINS" in result.stderr


@pytest.fixture
def tangram_backends_registered(patched_sglang):
    """Register stand-in ``tangram`` entries (torch_native's factory, the default radix
    factory) unless the real ones exist; removes only what it added."""
    from sglang.srt.layers.attention import attention_registry
    from sglang.srt.mem_cache import registry

    added = []
    if "tangram" not in attention_registry.ATTENTION_BACKENDS:
        attention_registry.ATTENTION_BACKENDS["tangram"] = attention_registry.ATTENTION_BACKENDS[
            "torch_native"
        ]
        added.append(attention_registry.ATTENTION_BACKENDS)
    if "tangram" not in registry.registered_radix_cache_backends():
        registry.register_radix_cache_backend("tangram", registry.default_radix_cache_factory)
        added.append(registry._RADIX_CACHE_REGISTRY)
    yield
    for table in added:
        del table["tangram"]


def test_start_refused_without_a_tangram_backend(
    patched_sglang, smollm2_path, smollm2_profile, monkeypatch
):
    """Without a registered backend nothing would compress: start-up fails in the scheduler."""
    from sglang.srt.layers.attention import attention_registry

    from tangram_sglang.integration.server_args import require_compressing_backend

    make_args(patched_sglang, smollm2_path, smollm2_profile)  # loads the plugin: registers it
    monkeypatch.delitem(attention_registry.ATTENTION_BACKENDS, "tangram")
    with pytest.raises(ConfigError, match="cannot compress the KV cache"):
        require_compressing_backend()


def test_registered_backends_are_selected(
    patched_sglang, smollm2_path, smollm2_profile, tangram_backends_registered
):
    args = make_args(patched_sglang, smollm2_path, smollm2_profile)
    assert args.attention_backend == "tangram" and args.radix_cache_backend == "tangram"
    no_radix = make_args(patched_sglang, smollm2_path, smollm2_profile, disable_radix_cache=True)
    assert no_radix.attention_backend == "tangram" and no_radix.radix_cache_backend is None
    for field, value in (
        ("attention_backend", "triton"),
        ("decode_attention_backend", "triton"),
        ("radix_cache_backend", "lmcache"),
    ):
        flag = "--" + field.replace("_", "-")
        with pytest.raises(ConfigError, match=f"{flag} '{value}' cannot be combined"):
            make_args(patched_sglang, smollm2_path, smollm2_profile, **{field: value})


def test_default_profile_is_the_shipped_one(
    patched_sglang, smollm2_path, smollm2_identity, make_profile, tmp_path, monkeypatch
):
    from tangram_sglang.integration import profile_loader

    monkeypatch.setattr(profile_loader, "CALIBRATION_DIR", tmp_path)
    with pytest.raises(ConfigError, match="no shipped profile .*python -m tangram_sglang"):
        make_args(patched_sglang, smollm2_path, None)
    (tmp_path / "smollm2").mkdir()
    make_profile(smollm2_identity).save(tmp_path / "smollm2" / "ada-snapkv-r0.25.json")
    args = make_args(patched_sglang, smollm2_path, None)
    shipped = str(tmp_path / "smollm2" / "ada-snapkv-r0.25.json")
    assert args.tangram_profile == shipped  # filled in, so /server_info shows the file used
    assert summary_from_server_args(args)["profile_path"] == shipped


def test_tp_size_dividing_the_kv_heads_is_accepted(patched_sglang, smollm2_path, smollm2_profile):
    """SmolLM2 (3 KV heads, 9 query heads) at --tp-size 3: one KV head per rank, equal pools."""
    from tangram_sglang.integration.sglang_adapters import full_cell_bytes, tangram_cell_bytes

    args = make_args(patched_sglang, smollm2_path, smollm2_profile, tp_size=3)
    summary = summary_from_server_args(pickle.loads(pickle.dumps(args)))
    assert (summary["tp_size"], summary["kv_heads_per_rank"]) == (3, 1)
    unstashed = copy.copy(args)  # the rebuilt summary (no stash) carries the TP numbers too
    object.__delattr__(unstashed, SUMMARY_STASH)
    assert summary_from_server_args(unstashed) == summary
    cells, groups = set(), set()
    for rank in range(3):
        profile = rank_profile_from_server_args(args, tp_rank=rank)
        m = profile.model
        assert (m.num_kv_heads, m.num_qo_heads) == (1, 3)
        full = full_cell_bytes(m.num_layers, m.num_kv_heads, m.head_dim, torch.float32)
        cells.add(tangram_cell_bytes(full, profile))  # bytes per logical token: pool size
        groups.add(tuple(profile.group_ratios))
    assert len(cells) == 1 and len(groups) == 1  # same pool, same budgets on every rank
    padded = sum(groups.pop()) * profile.grouping.heads_per_group / (m.num_layers * 1)
    assert summary["padded_kept_ratio"] == pytest.approx(padded, abs=1e-6)  # per rank


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        (
            {"tp_size": 2},
            r"--tp-size 2 cannot be combined with --tangram.*Use --tp-size in \[1, 3\]",
        ),
        (
            {"tp_size": 3, "tangram_page_group_size": 3, "tangram_scope": "per_layer"},
            "a head group of 3 KV heads would span TP ranks",
        ),
    ],
    ids=["tp2-does-not-divide", "group-spans-ranks"],
)
def test_tp_size_the_heads_cannot_follow_is_refused(
    patched_sglang, smollm2_path, smollm2_profile, kwargs, needle
):
    with pytest.raises(ConfigError, match=needle):
        make_args(patched_sglang, smollm2_path, smollm2_profile, **kwargs)


def test_rank_profile_reads_the_attention_tp_rank_from_sglang(
    patched_sglang, smollm2_path, smollm2_profile
):
    """In a scheduler process the rank comes from SGLang's parallel state (``get_parallel``)."""
    from sglang.srt.runtime_context import get_parallel

    args = make_args(patched_sglang, smollm2_path, smollm2_profile, tp_size=3)
    with get_parallel().override(attn_tp_rank=2, attn_tp_size=3):
        read = rank_profile_from_server_args(args)
    assert read.to_dict() == rank_profile_from_server_args(args, tp_rank=2).to_dict()
    assert read.provenance["tensor_parallel"]["kv_heads"] == [2, 3]
    with (
        get_parallel().override(attn_tp_rank=0, attn_tp_size=1),
        pytest.raises(ConfigError, match="attention TP size is 1"),
    ):
        rank_profile_from_server_args(args)


@pytest.mark.parametrize(
    ("value", "kwargs", "needle"),
    [
        ("junk", {}, r"TANGRAM_GRID_SEGMENTS='junk': use 1 .* or 0"),
        ("1", {"chunked_prefill_size": -1}, r"chunked prefill is off \(-1\); pass"),
    ],
    ids=["junk", "grid-without-chunking"],
)
def test_bad_grid_switch_stops_startup_in_the_main_process(
    patched_sglang, smollm2_path, smollm2_profile, monkeypatch, value, kwargs, needle
):
    """A bad ``TANGRAM_GRID_SEGMENTS`` is refused by ``check_model`` (one line at start-up),
    not by each scheduler's ``TangramState`` after the weights are loaded."""
    monkeypatch.setenv("TANGRAM_GRID_SEGMENTS", value)
    with pytest.raises(ConfigError, match=needle):
        make_args(patched_sglang, smollm2_path, smollm2_profile, **kwargs)


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"local_band": 1.5}, "local_band=1.5 must be an integer"),
        ({"max_queries": "64"}, "max_queries='64' must be an integer"),
        ({"kernel_size": 4}, "kernel_size=4 must be odd"),
    ],
    ids=["float-band", "string-queries", "even-kernel"],
)
def test_bad_scorer_options_of_the_profile_stop_startup(
    patched_sglang, smollm2_path, tmp_path, options, needle
):
    """A hand-edited profile's scorer options are checked in ``check_model``; a float
    ``local_band`` used to pass start-up and fail in the scheduler's first prefill."""
    profile = BudgetProfile.load(REPO / "calibration/smollm2/kvzip-lite-r0.25.json")
    provenance = {**profile.provenance}
    provenance["scorer_options"] = {**provenance["scorer_options"], **options}
    path = tmp_path / "edited.json"
    dataclasses.replace(profile, provenance=provenance).save(path)
    with pytest.raises(ConfigError, match=needle):
        make_args(patched_sglang, smollm2_path, str(path))


def test_an_embedded_model_name_serves_its_converted_folder(
    patched_sglang, smollm2_path, smollm2_profile
):
    """``--model-path smollm2`` (the README's ``M``): the server reads the converted folder (no
    hub lookup), the tokenizer follows, the API's model name stays ``smollm2``."""
    args = make_args(patched_sglang, "smollm2", smollm2_profile)
    assert Path(args.model_path) == Path(smollm2_path)
    assert Path(args.tokenizer_path) == Path(smollm2_path)
    assert args.served_model_name == "smollm2"
    folder = make_args(patched_sglang, smollm2_path, smollm2_profile)  # a folder: left alone
    assert folder.model_path == str(smollm2_path)


def test_a_folder_named_like_an_embedded_model_wins(
    patched_sglang, smollm2_path, smollm2_profile, tmp_path, monkeypatch
):
    """``./smollm2`` (a folder in the working directory) is served as given, not converted."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2").symlink_to(smollm2_path, target_is_directory=True)
    args = make_args(patched_sglang, "smollm2", smollm2_profile)
    assert args.model_path == "smollm2" and args.tokenizer_path == "smollm2"
