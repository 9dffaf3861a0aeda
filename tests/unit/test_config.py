"""TangramConfig validation and the profile loader (no sglang import)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from factories import random_profile

from tangram_sglang.config import (
    DECODE_CTAS_ENV,
    DECODE_PLAN_ENV,
    DEFAULT_MIN_COMPRESS_TOKENS,
    DEFAULT_PAGE_SIZE,
    PREFILL_ATTENTION_ENV,
    SCOPES,
    TangramConfig,
    decode_ctas_per_sm,
    decode_plan,
    prefill_attention,
)
from tangram_sglang.errors import ConfigError, ProfileError
from tangram_sglang.grouping import SCOPES as GROUPING_SCOPES
from tangram_sglang.integration import profile_loader
from tangram_sglang.profile import ModelIdentity

MODEL = ModelIdentity("LlamaForCausalLM", num_layers=4, num_kv_heads=2, num_qo_heads=4, head_dim=8)
OTHER = ModelIdentity("LlamaForCausalLM", num_layers=6, num_kv_heads=2, num_qo_heads=4, head_dim=8)


def model_profile(model=MODEL, scorer="ada-snapkv", target=0.25, heads_per_group=2, seed=0):
    """``factories.random_profile`` with H_p 2, 2 sink tokens and a 4-token window."""
    return random_profile(model, target, seed, heads_per_group, scorer, 2, 4)


@pytest.fixture
def profile_file(tmp_path):
    path = tmp_path / "p.json"
    model_profile().save(path)
    return str(path)


def test_disabled_config_is_not_validated():
    config = TangramConfig(page_size=3)  # odd page size, but Tangram is off
    assert not config.enabled and config.page_size == 3


def test_defaults(profile_file):
    config = TangramConfig(enabled=True, profile_path=profile_file)
    assert config.page_size == DEFAULT_PAGE_SIZE
    assert config.as_dict() == {
        "enabled": True,
        "profile_path": profile_file,
        "page_group_size": None,
        "page_size": DEFAULT_PAGE_SIZE,
        "target_ratio": None,
        "scope": None,
        "min_compress_tokens": DEFAULT_MIN_COMPRESS_TOKENS,
        "scorer": None,
    }


def test_scopes_match_grouping():
    assert SCOPES == GROUPING_SCOPES


def test_missing_profile_path_means_shipped_default():
    assert TangramConfig(enabled=True).profile_path is None


@pytest.mark.parametrize(
    ("changes", "flag"),
    [
        ({"profile_path": "/nonexistent/p.json"}, "--tangram-profile"),
        ({"page_size": 0}, "--tangram-page-size"),
        ({"page_size": 12}, "--tangram-page-size"),
        ({"page_size": 2048}, "--tangram-page-size"),
        ({"page_size": True}, "--tangram-page-size"),
        ({"min_compress_tokens": -1}, "--tangram-min-compress-tokens"),
        ({"min_compress_tokens": 1.5}, "--tangram-min-compress-tokens"),
        ({"page_group_size": 0}, "--tangram-page-group-size"),
        ({"page_group_size": 1.5}, "--tangram-page-group-size"),
        ({"target_ratio": 0.0}, "--tangram-target-ratio"),
        ({"target_ratio": 1.5}, "--tangram-target-ratio"),
        ({"target_ratio": float("nan")}, "--tangram-target-ratio"),
        ({"scope": "per_head"}, "--tangram-scope"),
    ],
    ids=lambda v: str(v),
)
def test_bad_option_names_the_flag(changes, flag):
    with pytest.raises(ConfigError, match=flag):
        TangramConfig(enabled=True, **changes)


def test_frozen(profile_file):
    config = TangramConfig(enabled=True, profile_path=profile_file)
    with pytest.raises(AttributeError):
        config.page_size = 32  # type: ignore[misc]


def test_resolve_rescales_and_regroups(profile_file):
    config = TangramConfig(
        enabled=True,
        profile_path=profile_file,
        target_ratio=0.5,
        page_group_size=1,
        scope="per_layer",
    )
    profile, resolved = profile_loader.resolve_profile(config, MODEL)
    assert resolved == config
    assert profile.mean_kept_fraction() == pytest.approx(0.5)
    assert profile.grouping.heads_per_group == 1 and profile.grouping.scope == "per_layer"
    assert profile.grouping.num_head_groups == MODEL.num_layers * MODEL.num_kv_heads


def test_resolve_rejects_group_size_the_model_cannot_take(profile_file):
    config = TangramConfig(
        enabled=True, profile_path=profile_file, page_group_size=3, scope="per_layer"
    )
    with pytest.raises(ConfigError, match="--tangram-page-group-size 3"):
        profile_loader.resolve_profile(config, MODEL)


def test_resolve_rejects_profile_of_another_model(profile_file):
    config = TangramConfig(enabled=True, profile_path=profile_file)
    with pytest.raises(ProfileError, match=r"--tangram-profile .*num_layers=4.*has 6"):
        profile_loader.resolve_profile(config, OTHER)


def test_resolve_rejects_corrupt_profile(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"schema_version": 1, "model": ')
    with pytest.raises(ProfileError, match="not a JSON profile") as info:
        profile_loader.resolve_profile(TangramConfig(enabled=True, profile_path=str(path)), MODEL)
    message = str(info.value)
    assert message.startswith(f"--tangram-profile {str(path)!r}: not a JSON profile (Expecting")
    assert "pass a valid profile JSON" in message and "leave the flag out" in message
    assert "python -m tangram_sglang.calibrate" in message
    path.write_text('{"schema_version": 1}')  # JSON, but not a profile
    with pytest.raises(ProfileError, match=r"^--tangram-profile .*: profile: missing field"):
        profile_loader.resolve_profile(TangramConfig(enabled=True, profile_path=str(path)), MODEL)


def test_shipped_default_prefers_gate_then_lite_then_ada_snapkv_closest_to_quarter(
    tmp_path, caplog
):
    folder = tmp_path / "tiny"
    folder.mkdir()
    model_profile(target=0.5).save(folder / "ada-snapkv-r0.5.json")
    model_profile(target=0.25).save(folder / "ada-snapkv-r0.25.json")
    model_profile(scorer="snapkv", target=0.25).save(folder / "snapkv-r0.25.json")
    model_profile(model=OTHER).save(folder / "other-model.json")
    (folder / "broken.json").write_text("not json")
    with caplog.at_level(logging.WARNING, logger=profile_loader.__name__):
        assert profile_loader.find_shipped_profile(MODEL, tmp_path).name == "ada-snapkv-r0.25.json"
    assert "unreadable shipped profile" in caplog.text and "broken.json" in caplog.text
    assert profile_loader.find_shipped_profile(OTHER, tmp_path).name == "other-model.json"
    model_profile(scorer="kvzip-lite", target=0.5).save(folder / "kvzip-lite-r0.5.json")
    model_profile(scorer="kvzip-lite", target=0.25).save(folder / "kvzip-lite-r0.25.json")
    assert profile_loader.find_shipped_profile(MODEL, tmp_path).name == "kvzip-lite-r0.25.json"
    model_profile(scorer="kvzip-gate", target=0.5).save(folder / "kvzip-gate-r0.5.json")
    assert profile_loader.find_shipped_profile(MODEL, tmp_path).name == "kvzip-gate-r0.5.json"
    model_profile(scorer="snapkv", target=0.9).save(folder / "default.json")
    assert profile_loader.find_shipped_profile(MODEL, tmp_path).name == "default.json"


def test_scorer_flag_picks_the_shipped_profile_calibrated_with_it(tmp_path):
    folder = tmp_path / "tiny"
    folder.mkdir()
    model_profile(target=0.25).save(folder / "ada-snapkv-r0.25.json")
    model_profile(scorer="kvzip-lite", target=0.25).save(folder / "kvzip-lite-r0.25.json")
    model_profile(scorer="snapkv", target=0.9).save(folder / "default.json")
    for scorer in ("ada-snapkv", "kvzip-lite", "snapkv"):
        config = TangramConfig(enabled=True, scorer=scorer)
        profile, resolved = profile_loader.resolve_profile(config, MODEL, tmp_path)
        assert profile.scorer == scorer and resolved.scorer == scorer
        assert Path(resolved.profile_path).parent == folder
    # --tangram-target-ratio: the profile calibrated closest to it (then rescaled to it)
    model_profile(target=0.5).save(folder / "ada-snapkv-r0.5.json")
    for ratio, name in ((0.5, "ada-snapkv-r0.5.json"), (0.3, "ada-snapkv-r0.25.json")):
        config = TangramConfig(enabled=True, scorer="ada-snapkv", target_ratio=ratio)
        assert (
            Path(profile_loader.resolve_profile(config, MODEL, tmp_path)[1].profile_path).name
            == name
        )
    with pytest.raises(ConfigError, match="--tangram-scorer 'h2o' is unknown; use one of"):
        profile_loader.resolve_profile(TangramConfig(enabled=True, scorer="h2o"), MODEL, tmp_path)
    with pytest.raises(ConfigError, match="--tangram-scorer pyramidkv: no shipped profile") as info:
        profile_loader.resolve_profile(
            TangramConfig(enabled=True, scorer="pyramidkv"), MODEL, tmp_path
        )
    assert "['ada-snapkv', 'kvzip-lite', 'snapkv']" in str(info.value)
    assert "--scorer pyramidkv" in str(info.value)


def test_scorer_flag_must_match_the_given_profile(profile_file):
    scorer = profile_loader.BudgetProfile.load(profile_file).scorer
    config = TangramConfig(enabled=True, profile_path=profile_file, scorer=scorer)
    assert profile_loader.resolve_profile(config, MODEL)[0].scorer == scorer
    other = "kvzip-lite" if scorer != "kvzip-lite" else "ada-snapkv"
    config = TangramConfig(enabled=True, profile_path=profile_file, scorer=other)
    with pytest.raises(ConfigError, match=f"--tangram-scorer {other} but --tangram-profile"):
        profile_loader.resolve_profile(config, MODEL)


def test_synthetic_profiles_are_never_a_shipped_default(tmp_path):
    folder = tmp_path / "synthetic"
    folder.mkdir()
    synthetic = model_profile(scorer="kvzip-lite", target=0.25)
    synthetic = dataclasses.replace(synthetic, provenance={"source": "synthetic skewed"})
    synthetic.save(folder / "kvzip-lite-r0.25.json")
    with pytest.raises(ConfigError, match="no shipped profile"):
        profile_loader.find_shipped_profile(MODEL, tmp_path)
    model_profile(target=0.5).save(folder / "ada-snapkv-r0.5.json")  # a calibrated one
    assert profile_loader.find_shipped_profile(MODEL, tmp_path).name == "ada-snapkv-r0.5.json"
    # the repository's synthetic Llama-3.1-8B profiles: for benchmarks, passed explicitly
    for path in (profile_loader.CALIBRATION_DIR / "synthetic").glob("*.json"):
        assert profile_loader.is_synthetic(profile_loader.BudgetProfile.load(path)), path


def test_no_shipped_default_says_how_to_calibrate(tmp_path):
    (tmp_path / "other").mkdir()
    model_profile(model=OTHER).save(tmp_path / "other" / "r.json")
    with pytest.raises(ConfigError, match="python -m tangram_sglang.calibrate") as info:
        profile_loader.resolve_profile(TangramConfig(enabled=True), MODEL, tmp_path)
    assert "other models: ['other/r.json']" in str(info.value)
    assert "--scorer ada-snapkv" in str(info.value)
    with pytest.raises(ConfigError, match="--scorer snapkv --target-ratio 0.25") as info:
        config = TangramConfig(enabled=True, scorer="snapkv")  # the hint calibrates that scorer
        profile_loader.resolve_profile(config, MODEL, tmp_path)
    assert "calibration/<model>/snapkv-r0.25.json" in str(info.value)


def test_summary_numbers(profile_file):
    profile, config = profile_loader.resolve_profile(
        TangramConfig(enabled=True, profile_path=profile_file), MODEL
    )
    summary = profile_loader.profile_summary(profile, config)
    padded = float(np.sum(profile.group_ratios) * 2 / (MODEL.num_layers * MODEL.num_kv_heads))
    assert summary["padded_kept_ratio"] == pytest.approx(padded, abs=1e-6)
    assert summary["padded_kept_ratio"] >= summary["mean_kept_ratio"]
    assert summary["predicted_capacity_vs_full_kv"] == pytest.approx(1 / padded, abs=1e-3)
    assert summary["num_head_groups"] == profile.grouping.num_head_groups
    assert summary["window_share"] == 0  # the scorer option, off in this profile
    assert "predicted capacity" in profile_loader.summary_line(summary)
    restored = profile_loader.profile_from_json(profile_loader.profile_to_json(profile))
    np.testing.assert_array_equal(restored.ratio, profile.ratio)


def test_decode_plan_env_defaults_to_batch_and_rejects_other_values(monkeypatch):
    assert decode_plan({}) == "batch"
    assert decode_plan({DECODE_PLAN_ENV: ""}) == "batch"
    assert decode_plan({DECODE_PLAN_ENV: "table"}) == "table"
    assert decode_plan({DECODE_PLAN_ENV: " Lengths "}) == "lengths"
    assert decode_plan({DECODE_PLAN_ENV: "batch"}) == "batch"
    with pytest.raises(
        ConfigError, match=r"^TANGRAM_DECODE_PLAN='ratio': use 'batch' .* 'lengths' .* 'table'"
    ):
        decode_plan({DECODE_PLAN_ENV: "ratio"})
    # the server reads it at start-up through kernels_for, on every device
    from tangram_sglang.backend.layer_ops import ReferenceKernels, kernels_for

    monkeypatch.setenv(DECODE_PLAN_ENV, "table")
    assert isinstance(kernels_for(torch.device("cpu"), None, 1), ReferenceKernels)
    monkeypatch.setenv(DECODE_PLAN_ENV, "static")
    with pytest.raises(ConfigError, match="TANGRAM_DECODE_PLAN='static'"):
        kernels_for(torch.device("cpu"), None, 1)


def test_decode_ctas_env_defaults_to_12_and_rejects_other_values(monkeypatch):
    assert decode_ctas_per_sm({}) == 12
    assert decode_ctas_per_sm({DECODE_CTAS_ENV: " "}) == 12
    assert decode_ctas_per_sm({DECODE_CTAS_ENV: " 20 "}) == 20
    assert decode_ctas_per_sm({DECODE_CTAS_ENV: "08"}) == 8
    for bad in ("0", "65", "-3", "2.5", "eight", "0008", "\uff18", "\u0668", "9" * 5000):
        with pytest.raises(ConfigError, match=r"^TANGRAM_DECODE_CTAS_PER_SM='.*': use a whole"):
            decode_ctas_per_sm({DECODE_CTAS_ENV: bad})
    # the server reads it at start-up through kernels_for, on every device
    from tangram_sglang.backend.layer_ops import kernels_for

    monkeypatch.setenv(DECODE_CTAS_ENV, "20")
    assert kernels_for(torch.device("cpu"), None, 1).launch_ctas == 20 * 132
    monkeypatch.delenv(DECODE_CTAS_ENV)
    assert kernels_for(torch.device("cpu"), None, 1).launch_ctas == 12 * 132
    monkeypatch.setenv(DECODE_CTAS_ENV, "0")
    with pytest.raises(ConfigError, match="TANGRAM_DECODE_CTAS_PER_SM='0'"):
        kernels_for(torch.device("cpu"), None, 1)
    from tangram_sglang.backend.layer_ops import ReferenceKernels
    from tangram_sglang.errors import KernelError

    with pytest.raises(KernelError, match="launch_ctas=0"):
        ReferenceKernels(ctas_per_sm=0)


def test_prefill_attention_env_defaults_to_auto_and_rejects_other_values(monkeypatch):
    assert prefill_attention({}) == "auto"
    assert prefill_attention({PREFILL_ATTENTION_ENV: " "}) == "auto"
    assert prefill_attention({PREFILL_ATTENTION_ENV: "Triton"}) == "triton"
    assert prefill_attention({PREFILL_ATTENTION_ENV: "FlashInfer"}) == "flashinfer"
    assert prefill_attention({PREFILL_ATTENTION_ENV: " AUTO "}) == "auto"
    with pytest.raises(
        ConfigError,
        match=r"^TANGRAM_PREFILL_ATTENTION=' Fa3': use 'auto' .* 'triton' .* 'flashinfer'",
    ):
        prefill_attention({PREFILL_ATTENTION_ENV: " Fa3"})
    from tangram_sglang.backend.layer_ops import ReferenceKernels, kernels_for

    monkeypatch.setenv(PREFILL_ATTENTION_ENV, "flashinfer")  # CPU keeps the torch reference
    assert isinstance(kernels_for(torch.device("cpu"), None, 1), ReferenceKernels)
    monkeypatch.setenv(PREFILL_ATTENTION_ENV, "fa3")
    with pytest.raises(ConfigError, match="TANGRAM_PREFILL_ATTENTION='fa3'"):
        kernels_for(torch.device("cpu"), None, 1)
