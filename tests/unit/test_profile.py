"""BudgetProfile: file round-trip, kept_len, and every ProfileError the format promises."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from tangram_sglang.errors import ProfileError
from tangram_sglang.grouping import HeadGrouping
from tangram_sglang.profile import (
    BudgetProfile,
    CalibrationStats,
    ModelIdentity,
    config_fingerprint,
    kept_len,
)

L, H = 4, 3  # layers x KV heads of the synthetic model
MODEL = ModelIdentity("LlamaForCausalLM", L, H, 9, 64, "abcd1234abcd1234")


def calibrated_profile(ratio=None, heads_per_group=2, scope="global", **kw) -> BudgetProfile:
    ratio = np.linspace(0.1, 1.0, L * H).reshape(L, H) if ratio is None else np.asarray(ratio)
    stats = CalibrationStats(ratio * 0.8, np.full((L, H), 0.05), 2.0, 50)
    fields = dict(
        model=MODEL,
        scorer="ada-snapkv",
        target_ratio=0.25,
        ratio=ratio,
        sink_tokens=4,
        recent_window=32,
        grouping=HeadGrouping.build(ratio, heads_per_group, scope),
        stats=stats,
        provenance={"command": "test", "num_samples": 50},
    )
    fields.update(kw)
    return BudgetProfile(**fields)


def as_dict(**changes) -> dict:
    data = calibrated_profile().to_dict()
    data.update(changes)
    return data


def test_round_trip(tmp_path):
    profile = calibrated_profile()
    path = tmp_path / "p.json"
    profile.save(path)
    loaded = BudgetProfile.load(path)
    assert loaded.to_dict() == profile.to_dict()
    np.testing.assert_array_equal(loaded.grouping.cluster_of, profile.grouping.cluster_of)
    assert not (tmp_path / "p.json.tmp").exists()


def test_all_ones_profile_is_valid_and_keeps_everything():
    profile = calibrated_profile(ratio=np.ones((L, H)))
    assert profile.group_kept_lens(1000) == [1000] * profile.grouping.num_head_groups


@pytest.mark.parametrize(
    ("n", "ratio", "expected"),
    [(0, 0.5, 0), (1, 0.01, 1), (10, 0.3, 10), (136, 0.25, 4 + 32 + 25), (1000, 1.0, 1000)],
    ids=["empty", "one-token", "short", "typical", "ratio-1"],
)
def test_kept_len(n, ratio, expected):
    assert kept_len(n, ratio, 4, 32) == expected


@given(
    n=st.integers(0, 5000),
    ratio=st.floats(1e-6, 1.0),
    sink=st.integers(0, 64),
    window=st.integers(0, 256),
    floor=st.integers(0, 2048),
)
def test_kept_len_never_exceeds_the_segment_and_keeps_short_segments_whole(
    n, ratio, sink, window, floor
):
    """No head ever holds more tokens than full KV; below the floor a segment is kept whole."""
    k = kept_len(n, ratio, sink, window, floor)
    assert min(n, 1) <= k <= n
    if n < floor:
        assert k == n
    else:
        assert k == kept_len(n, ratio, sink, window)


def test_min_compress_tokens_threads_through_group_kept_lens_and_the_json_copy():
    profile = calibrated_profile().with_min_compress_tokens(512)
    groups = profile.grouping.num_head_groups
    assert profile.group_kept_lens(511) == [511] * groups
    assert profile.group_kept_lens(512) == calibrated_profile().group_kept_lens(512)
    assert min(profile.group_kept_lens(512)) < 512
    again = BudgetProfile.from_dict(json.loads(json.dumps(profile.to_dict())))
    assert again.min_compress_tokens == 512 and again.to_dict() == profile.to_dict()
    assert "min_compress_tokens" not in calibrated_profile().to_dict()  # files stay as they were
    with pytest.raises(ProfileError, match="min_compress_tokens=-1 must be an integer >= 0"):
        calibrated_profile().with_min_compress_tokens(-1)
    with pytest.raises(ProfileError, match="min_compress_tokens='64' must be an integer"):
        BudgetProfile.from_dict(as_dict(min_compress_tokens="64"))


def test_shape_mismatch_with_the_model():
    profile = calibrated_profile()
    other = ModelIdentity("Qwen2ForCausalLM", 24, 2, 14, 64)
    with pytest.raises(ProfileError, match="num_layers=4 but the served model has 24"):
        profile.check_model(other)
    fingerprint = ModelIdentity("LlamaForCausalLM", L, H, 9, 64, "ffff0000ffff0000")
    with pytest.raises(ProfileError, match="config_fingerprint"):
        profile.check_model(fingerprint)
    with pytest.raises(ProfileError, match=r"ratio has shape \[4, 2\]"):
        BudgetProfile.from_dict(as_dict(ratio=[[0.5, 0.5]] * L))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_nan_and_inf(bad):
    data = as_dict()
    data["ratio"][1][2] = bad
    with pytest.raises(ProfileError, match=r"ratio\[1\]\[2\].*NaN/inf"):
        BudgetProfile.from_dict(data)
    data = as_dict()
    data["stats"]["std"][0][0] = bad
    with pytest.raises(ProfileError, match="stats.std"):
        BudgetProfile.from_dict(data)


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.0001, 2.0], ids=["zero", "neg", "above1", "two"])
def test_ratio_outside_unit_interval(bad):
    data = as_dict()
    data["ratio"][3][0] = bad
    with pytest.raises(ProfileError, match=r"ratio\[3\]\[0\].*outside \(0, 1\]"):
        BudgetProfile.from_dict(data)
    with pytest.raises(ProfileError, match="target_ratio"):
        BudgetProfile.from_dict(as_dict(target_ratio=bad if bad != 1.0001 else 1.5))


def test_unknown_scorer():
    with pytest.raises(ProfileError, match="scorer='h2o' is unknown.*snapkv"):
        BudgetProfile.from_dict(as_dict(scorer="h2o"))


def test_group_size_must_divide_heads_for_per_layer():
    data = as_dict()
    data["grouping"]["scope"] = "per_layer"
    with pytest.raises(ProfileError, match="page_group_size=2 does not divide num_kv_heads=3"):
        BudgetProfile.from_dict(data)
    with pytest.raises(ProfileError, match="does not divide"):
        calibrated_profile(heads_per_group=2, scope="per_layer")
    assert calibrated_profile(heads_per_group=2, scope="global").grouping.num_head_groups == 6
    assert calibrated_profile(heads_per_group=3, scope="per_layer").grouping.num_head_groups == L


@pytest.mark.parametrize("version", [0, 2, None, "1"], ids=["v0", "v2", "missing", "string"])
def test_wrong_schema_version(version):
    data = as_dict(schema_version=version)
    if version is None:
        del data["schema_version"]
    with pytest.raises(ProfileError, match="schema_version"):
        BudgetProfile.from_dict(data)


def test_file_errors_name_the_path(tmp_path):
    with pytest.raises(ProfileError, match="not found"):
        BudgetProfile.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ProfileError, match="bad.json: not a JSON profile"):
        BudgetProfile.load(bad)
    data = as_dict(scorer="nope")
    bad.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="bad.json: scorer="):
        BudgetProfile.load(bad)


def test_missing_and_mistyped_fields():
    data = as_dict()
    del data["model"]
    with pytest.raises(ProfileError, match="missing field 'model'"):
        BudgetProfile.from_dict(data)
    data = as_dict()
    data["grouping"]["cluster_of"] = [[0.5] * H] * L
    with pytest.raises(ProfileError, match="cluster_of must be a 2-D list of integers"):
        BudgetProfile.from_dict(data)


def test_broken_grouping_map():
    data = as_dict()
    data["grouping"]["cluster_of"][0][0] = data["grouping"]["cluster_of"][0][1]
    data["grouping"]["column_of"][0][0] = data["grouping"]["column_of"][0][1]
    with pytest.raises(ProfileError, match="share one"):
        BudgetProfile.from_dict(data)


def test_rescaled_keeps_the_ranking():
    profile = calibrated_profile()
    half = profile.rescaled(0.3)
    assert half.ratio.mean() == pytest.approx(0.3)
    assert (np.argsort(half.ratio.ravel()) == np.argsort(profile.ratio.ravel())).all()


def test_rescaled_refuses_a_target_below_the_smallest_fraction_instead_of_clipping():
    profile = calibrated_profile()
    with pytest.raises(ProfileError, match="too small for this profile.*use a target >="):
        profile.rescaled(1e-9)
    smallest = float(np.minimum(profile.ratio / profile.ratio.min() * 1e-6, 1.0).mean())
    assert profile.rescaled(smallest * 1.01).ratio.mean() == pytest.approx(smallest * 1.01)


def _set(data: dict, dotted: str, value) -> dict:
    *parents, leaf = dotted.split(".")
    node = data
    for key in parents:
        node = node[key]
    node[leaf] = value
    return data


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("model.num_layers", "4", "model.num_layers='4' must be an integer"),
        ("model.num_layers", math.inf, "model.num_layers=inf must be an integer"),
        ("sink_tokens", 3.7, "sink_tokens=3.7 must be an integer"),
        ("recent_window", True, "recent_window=True must be an integer"),
        ("target_ratio", "0.25", "target_ratio='0.25' must be a number"),
        ("grouping.page_group_size", 2.5, "grouping.page_group_size=2.5 must be an integer"),
        ("stats.num_samples", "50", "stats.num_samples='50' must be an integer"),
        ("scorer", 3, "scorer=3 must be a string"),
        ("model", [1, 2], "model must be a JSON object"),
        ("stats", "x", "stats must be a JSON object"),
        ("provenance", "abc", "provenance must be a JSON object"),
        ("ratio", [["0.5"] * H] * L, "ratio must be a 2-D list of numbers"),
        ("ratio", [[0.5] * H] * (L - 1) + [[0.5] * (H - 1)], "ratio must be a 2-D list"),
        ("ratio", [[None] * H] * L, "ratio must be a 2-D list of numbers"),
    ],
    ids=lambda v: str(v)[:20],
)
def test_mistyped_fields_are_named_not_coerced(field, value, message):
    with pytest.raises(ProfileError) as exc:
        BudgetProfile.from_dict(_set(as_dict(), field, value))
    assert message in str(exc.value)


def test_unreadable_path_is_a_profile_error(tmp_path):
    (tmp_path / "dir.json").mkdir()
    with pytest.raises(ProfileError, match="dir.json: cannot read the profile file"):
        BudgetProfile.load(tmp_path / "dir.json")


def test_cluster_ids_with_a_gap_are_rejected():
    data = as_dict()
    last = max(max(row) for row in data["grouping"]["cluster_of"])
    data["grouping"]["cluster_of"] = [
        [c + 3 if c == last else c for c in row] for row in data["grouping"]["cluster_of"]
    ]
    with pytest.raises(ProfileError, match=rf"grouping.cluster_of skips group ids \[{last}, "):
        BudgetProfile.from_dict(data)


def test_config_fingerprint_is_the_same_across_transformers_config_layouts():
    # transformers >= 5 moves rope_theta into rope_parameters and may drop a derivable head_dim.
    old = {
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rope_theta": 1000000,
        "max_position_embeddings": 32768,
        "vocab_size": 151936,
    }
    new = {k: v for k, v in old.items() if k not in ("rope_theta", "head_dim")}
    new["rope_parameters"] = {"rope_theta": 1000000.0, "rope_type": "default"}
    assert config_fingerprint(old) == config_fingerprint(new)
    assert config_fingerprint(old) != config_fingerprint({**old, "num_hidden_layers": 23})


def test_shipped_smollm2_profiles_match_the_embedded_model(smollm2_path):
    local = ModelIdentity.from_hf_config(json.loads((smollm2_path / "config.json").read_text()))
    for path in sorted(Path("calibration/smollm2").glob("*.json")):
        profile = BudgetProfile.load(path)
        assert profile.model.config_fingerprint == local.config_fingerprint, path
        profile.check_model(local)


@given(n=st.integers(0, 70_000), floor=st.sampled_from([0, 1, 256, 512, 4096]))
@example(n=255, floor=256)
@example(n=256, floor=256)
@example(n=1, floor=0)
def test_group_kept_array_is_kept_len_group_by_group(n, floor):
    """The vectorised hot-path form equals the scalar formula for every head group."""
    profile = calibrated_profile().with_min_compress_tokens(floor)
    expected = [
        kept_len(n, float(r), profile.sink_tokens, profile.recent_window, floor)
        for r in profile.group_ratios
    ]
    got = profile.group_kept_array(n)
    assert got.dtype == np.int64
    assert got.tolist() == expected == profile.group_kept_lens(n)
