"""A profile's scorer option names (``provenance.scorer_options``) are checked, not dropped.

An option name the scorer does not know (a misspelling, another scorer's option) or a scorer
option placed directly under ``provenance`` used to load and serve without the option. Every
path that builds a profile's scorer goes through ``backend.state.build_scorer`` and so through
``scoring.base.profile_options``: server start-up (``integration.server_args.check_model``, its
test in ``tests/integration/test_server_args.py``), each scheduler's ``TangramState``, the eval
harness's profile check and its HF twins.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tangram_sglang.backend.state import build_scorer
from tangram_sglang.calibrate.cli import scorer_options
from tangram_sglang.errors import ConfigError
from tangram_sglang.profile import BudgetProfile
from tangram_sglang.scoring.base import (
    RECORDED_OPTIONS,
    available_scorers,
    get_scorer,
    option_names,
    profile_options,
)

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted(p for p in (REPO / "calibration").rglob("*.json") if p.name != "config.json")
LITE = REPO / "calibration/smollm2/kvzip-lite-r0.25.json"
ADA = REPO / "calibration/smollm2/ada-snapkv-r0.25.json"


def accepted(name: str) -> tuple[str, ...]:
    known = option_names(get_scorer(name))
    return (*known, *(k for k in RECORDED_OPTIONS if k not in known))


def every_option() -> set[str]:
    return {o for name in available_scorers() for o in option_names(get_scorer(name))}


def edited(path: Path, **top) -> BudgetProfile:
    """The shipped profile at ``path``, ``options`` merged into its ``scorer_options`` (key
    ``options``) and the other keywords set directly under ``provenance``."""
    profile = BudgetProfile.load(path)
    options = top.pop("options", {})
    provenance = {**profile.provenance, **top}
    provenance["scorer_options"] = {**provenance["scorer_options"], **options}
    return dataclasses.replace(profile, provenance=provenance)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(REPO / "calibration")))
def test_every_shipped_profile_loads_and_builds_its_scorer(path):
    profile = BudgetProfile.load(path)
    scorer = build_scorer(profile)
    assert scorer.name == profile.scorer
    assert not set(profile.provenance) & every_option()  # no legitimate key is refused


def test_the_shipped_profiles_are_found():
    assert len(SHIPPED) >= 20 and {p.parent.name for p in SHIPPED} >= {"smollm2", "synthetic"}


@pytest.mark.parametrize("name", available_scorers())
def test_what_calibration_records_is_accepted(name):
    """``calibrate`` writes the scorer's options plus ``alpha_safeguard``
    (``calibrate.cli._provenance``); every scorer's profile takes that record back."""
    scorer = get_scorer(name)
    record = {**scorer_options(scorer), "alpha_safeguard": 0.2}
    assert profile_options(name, {"scorer_options": record}) == scorer_options(scorer)


@pytest.mark.parametrize(
    ("path", "typo", "nearest"),
    [
        (LITE, "window_shar", "window_share"),
        (LITE, "max_querys", "max_queries"),
        (ADA, "obs_windw", "obs_window"),
        (ADA, "alpha_safegaurd", "alpha_safeguard"),
        (REPO / "calibration/smollm2/kvzip-gate-r0.25.json", "weight", "weights"),
    ],
)
def test_a_misspelled_option_is_refused_naming_the_field_and_the_fix(path, typo, nearest):
    profile = edited(path, options={typo: 1})
    with pytest.raises(ConfigError) as err:
        build_scorer(profile)
    message = str(err.value)
    assert message.startswith(f"provenance.scorer_options.{typo}: the {profile.scorer} scorer ")
    assert f"has no option {typo!r} (it accepts {', '.join(accepted(profile.scorer))})" in message
    assert f"did you mean {nearest!r}? Rename it to provenance.scorer_options.{nearest}" in message
    assert "Traceback" not in message and "\n" not in message


def test_a_name_near_none_is_refused_with_the_accepted_names():
    with pytest.raises(ConfigError, match=r"no option 'zzz' \(it accepts obs_window, .*\); "):
        build_scorer(edited(LITE, options={"zzz": 1}))
    with pytest.raises(ConfigError, match="remove it, or rename it to one of those$"):
        build_scorer(edited(LITE, options={"zzz": 1}))


def test_another_scorers_option_is_refused_naming_the_scorers_that_have_it():
    with pytest.raises(
        ConfigError,
        match=r"^provenance.scorer_options.beta is an option of the pyramidkv scorer only, not "
        r"of kvzip-lite; remove it from this profile, or serve a pyramidkv profile with it$",
    ):
        build_scorer(edited(LITE, options={"beta": 20}))


@given(data=st.data())
@settings(max_examples=150, deadline=None)
def test_any_one_slip_of_an_option_name_points_back_to_it(data):
    """A letter dropped, doubled or swapped with the next: refused, the fix names the option."""
    name = data.draw(st.sampled_from(available_scorers()), label="scorer")
    option = data.draw(st.sampled_from(accepted(name)), label="option")
    i = data.draw(st.integers(0, len(option) - 1), label="at")
    slip = data.draw(st.sampled_from(["drop", "double", "swap"]), label="slip")
    typo = {
        "drop": option[:i] + option[i + 1 :],
        "double": option[:i] + option[i] + option[i:],
        "swap": option[:i] + option[i + 1 : i + 2] + option[i] + option[i + 2 :],
    }[slip]
    assume(typo not in accepted(name) and typo not in every_option())
    with pytest.raises(ConfigError) as err:
        profile_options(name, {"scorer_options": {typo: 1}})
    message = str(err.value)
    assert message.startswith(f"provenance.scorer_options.{typo}: the {name} scorer ")
    assert f"Rename it to provenance.scorer_options.{option}" in message


@given(
    name=st.sampled_from(available_scorers()),
    key=st.text(st.characters(codec="ascii"), min_size=1, max_size=24),
)
@settings(max_examples=150, deadline=None)
def test_an_unknown_name_is_never_dropped(name, key):
    """Any name the scorer does not accept is refused, naming the field and the scorer."""
    assume(key not in accepted(name))
    with pytest.raises(ConfigError) as err:
        profile_options(name, {"scorer_options": {key: 1}})
    message = str(err.value)
    assert message.startswith(f"provenance.scorer_options.{key}") and name in message


@pytest.mark.parametrize("option", sorted(every_option()))
def test_a_scorer_option_directly_under_provenance_is_refused(option):
    """``provenance.window_share`` instead of ``provenance.scorer_options.window_share``."""
    for path in (LITE, ADA):
        profile = edited(path, **{option: 1})
        with pytest.raises(ConfigError) as err:
            build_scorer(profile)
        message = str(err.value)
        assert message.startswith(
            f"provenance.{option} is a scorer option outside provenance.scorer_options"
        )
        if option in accepted(profile.scorer):
            assert message.endswith(f"move it to provenance.scorer_options.{option}")
        else:
            assert message.endswith(f"not of this profile's {profile.scorer}: remove it")


def test_scorer_options_must_be_an_object():
    profile = BudgetProfile.load(LITE)
    for bad in ([1], "obs_window=32", 3, [], "", 0, False):
        wrong = dataclasses.replace(profile, provenance={"scorer_options": bad})
        with pytest.raises(ConfigError, match=r"provenance.scorer_options is a \w+; it must be"):
            build_scorer(wrong)
    for empty in (None, {}):  # no options: the scorer's defaults
        build_scorer(dataclasses.replace(profile, provenance={"scorer_options": empty}))


def test_the_eval_cli_refuses_a_misspelled_option_before_any_model_loads(smollm2_path, tmp_path):
    """``_check_profile_models`` reads the profiles as JSON before any model or server starts;
    the message names ``--profile-dir``, the file and the field."""
    from tangram_sglang.eval.cli import _check_profile_models

    folder = tmp_path / "smollm2"
    shutil.copytree(REPO / "calibration/smollm2", folder)
    path = folder / "kvzip-lite-r0.5.json"
    data = json.loads(path.read_text())
    data["provenance"]["scorer_options"]["window_shar"] = 0.25
    path.write_text(json.dumps(data))
    with pytest.raises(
        ConfigError,
        match=rf"^--profile-dir {folder}: kvzip-lite-r0.5.json: "
        r"provenance.scorer_options.window_shar: .*did you mean 'window_share'\?",
    ):
        _check_profile_models(folder, ("kvzip-lite-budgets",), (0.5,), smollm2_path, "smollm2")


GATE = REPO / "calibration/qwen2.5-0.5b/kvzip-gate-r0.25.json"


@pytest.mark.parametrize("path", [ADA, LITE], ids=["ada-snapkv", "kvzip-lite"])
@pytest.mark.parametrize(
    ("option", "value", "expected"),
    [
        ("obs_window", float("nan"), "must be an integer"),
        ("obs_window", 32.5, "must be an integer"),
        ("obs_window", "32", "must be an integer"),
        ("obs_window", None, "must be an integer"),
        ("obs_window", True, "must be an integer"),
        ("obs_window", float("inf"), "must be an integer"),
        ("obs_window", 10**30, "out of range"),
        ("kernel_size", "5", "must be an integer"),
        ("kernel_size", float("nan"), "must be an integer"),
    ],
)
def test_integer_options_of_other_types_or_sizes_are_refused_naming_the_field(
    path, option, value, expected
):
    """The SnapKV family and kvzip-lite take their window options as plain ints within the
    kernels' index range: a float, string, bool, null or huge value is refused at build time
    (it used to pass and fail inside the scoring ops at the first prefill)."""
    profile = BudgetProfile.load(path)
    options = dict(profile.provenance.get("scorer_options") or {}, **{option: value})
    bad = dataclasses.replace(profile, provenance={**profile.provenance, "scorer_options": options})
    with pytest.raises(ConfigError, match=f"{option}=.*{expected}") as info:
        build_scorer(bad)
    assert f"provenance.scorer_options.{option}" in str(info.value) or expected == "out of range"


def test_kvzip_lite_max_queries_past_the_index_range_is_refused():
    profile = BudgetProfile.load(LITE)
    options = dict(profile.provenance["scorer_options"], max_queries=10**30)
    bad = dataclasses.replace(profile, provenance={**profile.provenance, "scorer_options": options})
    with pytest.raises(ConfigError, match=r"max_queries=10+ is out of range; use 0 to 2147483647"):
        build_scorer(bad)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (10**400, r"weights is not a \[num_layers\]"),  # past float64: no OverflowError
        (1e300, r"weights\[0\]\[0\]\[0\] is 1e\+300: .* non-finite in float32"),  # inf in float32
    ],
    ids=["int-past-float64", "inf-in-float32"],
)
def test_gate_weights_past_float32_are_refused_naming_the_entry(value, expected):
    profile = BudgetProfile.load(GATE)
    options = json.loads(json.dumps(profile.provenance["scorer_options"]))
    options["weights"][0][0][0] = value
    bad = dataclasses.replace(profile, provenance={**profile.provenance, "scorer_options": options})
    with pytest.raises(ConfigError, match=expected):
        build_scorer(bad)
