"""Find, load and adapt the budget profile a Tangram server runs with (at start-up).

Order of operations (:func:`resolve_profile`):
1. path: ``--tangram-profile``, else the shipped profile under ``calibration/<model>/`` whose
   model identity matches the served model (:func:`find_shipped_profile`);
2. load and validate (:meth:`BudgetProfile.load`), check it against the served model
   (:meth:`BudgetProfile.check_model`);
3. ``--tangram-target-ratio``: :meth:`BudgetProfile.rescaled`;
4. ``--tangram-page-group-size`` / ``--tangram-scope``: :meth:`BudgetProfile.with_grouping`.

It also builds the start-up summary (:func:`profile_summary`) logged by the server and returned
in ``/server_info``. No ``sglang`` import: this module works on plain values.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import numpy as np

from tangram_sglang.config import TangramConfig
from tangram_sglang.errors import ConfigError, ProfileError
from tangram_sglang.profile import BudgetProfile, ModelIdentity

logger = logging.getLogger(__name__)
CALIBRATION_DIR = Path(__file__).resolve().parents[2] / "calibration"
DEFAULT_PROFILE_NAME = "default.json"  # a shipped profile of this name wins
# Among shipped profiles of a model, scorers in this order: kvzip-gate (query-agnostic: the kept
# history also answers later turns' questions, and single details such as a needle stay kept;
# docs/scorers.md), then kvzip-lite, then Ada-SnapKV.
SCORER_PREFERENCE = ("kvzip-gate", "kvzip-lite", "ada-snapkv")
# among several matches, prefer the one calibrated closest to this (or --tangram-target-ratio)
DEFAULT_TARGET_RATIO = 0.25


def calibrate_hint(scorer: str | None = None) -> str:
    """How to calibrate a profile for ``scorer`` (``--tangram-scorer``; None: ada-snapkv)."""
    scorer = scorer or "ada-snapkv"
    return (
        f"calibrate one with `python -m tangram_sglang.calibrate --model-path <model> --scorer "
        f"{scorer} --target-ratio 0.25 --output calibration/<model>/{scorer}-r0.25.json` (see "
        "calibration/README.md) and pass it with --tangram-profile"
    )


def check_scorer_name(name: str | None) -> None:
    """``--tangram-scorer``: None or a registered scorer name.

    Raises:
        ConfigError: an unknown name; lists the registered ones.
    """
    if name is None:
        return
    from tangram_sglang.scoring import available_scorers

    names = available_scorers()
    if name not in names:
        raise ConfigError(
            f"--tangram-scorer {name!r} is unknown; use one of {list(names)} (or leave it out "
            "to use the profile's scorer)"
        )


def find_shipped_profile(
    model: ModelIdentity,
    calibration_dir: Path | None = None,
    scorer: str | None = None,
    target_ratio: float | None = None,
) -> Path:
    """The shipped profile for ``model``: ``calibration/*/*.json`` whose model matches.

    Among several matches: ``default.json`` first, then by scorer (:data:`SCORER_PREFERENCE`:
    ``kvzip-gate``, then ``kvzip-lite``, then ``ada-snapkv``, then any other), then the target
    ratio closest to ``target_ratio`` (``--tangram-target-ratio``; None: 0.25), then the path
    name. With ``scorer`` (``--tangram-scorer``) only profiles calibrated with it match.
    Synthetic profiles (:func:`is_synthetic`) never match. Unreadable files are skipped with a
    warning naming them (so a corrupt preferred profile never silently hands the default to
    another scorer).

    Raises:
        ConfigError: no shipped profile matches (for ``scorer``, when given); says where it
            looked, which scorers the model has profiles for, and how to calibrate.
    """
    calibration_dir = CALIBRATION_DIR if calibration_dir is None else calibration_dir
    matches, others, scorers = [], [], set()
    for path in sorted(calibration_dir.glob("*/*.json")):
        try:
            profile = BudgetProfile.load(path)
        except ProfileError as exc:
            logger.warning("Tangram: skipping the unreadable shipped profile %s: %s", path, exc)
            continue
        if is_synthetic(profile):  # dummy-weight benchmarks pass it with --tangram-profile
            continue
        try:
            profile.check_model(model)
        except ProfileError:
            others.append(path.relative_to(calibration_dir).as_posix())
            continue
        scorers.add(profile.scorer)
        if scorer is not None and profile.scorer != scorer:
            continue
        rank = (
            path.name != DEFAULT_PROFILE_NAME,
            _scorer_rank(profile.scorer),
            abs(profile.target_ratio - (target_ratio or DEFAULT_TARGET_RATIO)),
            str(path),
        )
        matches.append((rank, path))
    if not matches and scorer is not None and scorers:
        raise ConfigError(
            f"--tangram-scorer {scorer}: no shipped profile for the served model was calibrated "
            f"with it (shipped scorers for this model: {sorted(scorers)}); pick one of those, or "
            + calibrate_hint(scorer)
        )
    if not matches:
        raise ConfigError(
            f"--tangram-profile was not given and no shipped profile under {calibration_dir}/"
            f"<model>/ matches the served model ({model.architecture}, {model.num_layers} "
            f"layers x {model.num_kv_heads} KV heads, head_dim {model.head_dim}; shipped "
            f"profiles for other models: {others or 'none'}); " + calibrate_hint(scorer)
        )
    return min(matches)[1]


def is_synthetic(profile: BudgetProfile) -> bool:
    """A generated profile (``bench.synthetic``: random ratios for dummy-weight benchmarks).

    Never a shipped default: a real model of the same shape must not get random budgets.
    """
    source = str((profile.provenance or {}).get("source", ""))
    return source.startswith("synthetic")


def _scorer_rank(scorer: str) -> int:
    """Position of ``scorer`` in :data:`SCORER_PREFERENCE` (others after every listed one)."""
    return (
        SCORER_PREFERENCE.index(scorer) if scorer in SCORER_PREFERENCE else len(SCORER_PREFERENCE)
    )


def resolve_profile(
    config: TangramConfig, model: ModelIdentity, calibration_dir: Path | None = None
) -> tuple[BudgetProfile, TangramConfig]:
    """Load the profile ``config`` names (or the shipped default) and adapt it to ``config``.

    Args:
        config: options; ``profile_path`` may be None (then the shipped default is used).
        model: identity of the served model (``ModelIdentity.from_hf_config``).
        calibration_dir: where shipped profiles live (``calibration/<model>/*.json``; default
            the repository's ``calibration/``).

    Returns:
        ``(profile, config)``: the validated, rescaled and regrouped profile, and the config
        with ``profile_path`` filled in.

    Raises:
        ConfigError: an unknown scorer name, no profile found (for ``config.scorer``), or a
            flag that the profile cannot honour (H_p, scope, a scorer other than the profile's).
        ProfileError: the file is missing, corrupt, or made for another model.
    """
    check_scorer_name(config.scorer)
    if not config.profile_path:
        path = find_shipped_profile(model, calibration_dir, config.scorer, config.target_ratio)
        config = replace(config, profile_path=str(path))
    profile = load_profile_flag(config.profile_path)
    try:
        profile.check_model(model)
    except ProfileError as exc:
        raise ProfileError(f"--tangram-profile {config.profile_path}: {exc}") from None
    if config.scorer is not None and profile.scorer != config.scorer:
        raise ConfigError(
            f"--tangram-scorer {config.scorer} but --tangram-profile {config.profile_path} was "
            f"calibrated with {profile.scorer}: per-head budgets are calibrated for one scorer. "
            f"Drop one of the two flags, or calibrate a profile with --scorer {config.scorer}"
        )
    if config.target_ratio is not None:
        profile = profile.rescaled(config.target_ratio)
    if config.page_group_size is not None or config.scope is not None:
        heads_per_group = config.page_group_size or profile.grouping.heads_per_group
        scope = config.scope or profile.grouping.scope
        try:
            profile = profile.with_grouping(heads_per_group, scope)
        except ProfileError as exc:
            raise ConfigError(
                f"--tangram-page-group-size {heads_per_group} / --tangram-scope {scope}: {exc}; "
                f"the model has {model.num_kv_heads} KV heads per layer (per_layer scope needs "
                "a divisor of it)"
            ) from None
    profile = profile.with_min_compress_tokens(config.min_compress_tokens)
    return profile, config


def load_profile_flag(path: str | Path) -> BudgetProfile:
    """:meth:`BudgetProfile.load` of the ``--tangram-profile`` file; errors name the flag.

    Args:
        path: the flag's value (a profile JSON file).

    Returns:
        The loaded profile (not yet checked against the served model).

    Raises:
        ProfileError: the file is unreadable, not JSON or not a valid profile; the message
            names ``--tangram-profile`` and the path, says what is wrong and how to fix it.
    """
    try:
        return BudgetProfile.load(path)
    except ProfileError as exc:
        detail = str(exc).removeprefix(f"{Path(path)}: ")
        raise ProfileError(
            f"--tangram-profile {str(path)!r}: {detail}; pass a valid profile JSON (the "
            "shipped ones are calibration/<model>/*.json), leave the flag out to use the "
            "shipped profile for the model, or calibrate one with `python -m "
            "tangram_sglang.calibrate --model-path ...`"
        ) from None


def padded_kept_fraction(profile: BudgetProfile) -> float:
    """Fraction of full KV memory the profile's pages hold for long segments.

    Every column of a head group keeps the group's ratio (its max member), and a partial last
    group's empty columns still take page space, so this is
    ``sum_g(group_ratio[g] * H_p) / (L * H_kv)`` (>= the mean ratio). Sinks, the recent window and
    page rounding are not included (they vanish for long segments).
    """
    grouping = profile.grouping
    total_heads = grouping.num_layers * grouping.num_kv_heads
    return float(np.sum(profile.group_ratios) * grouping.heads_per_group / total_heads)


def profile_summary(profile: BudgetProfile, config: TangramConfig) -> dict[str, object]:
    """Plain-builtin summary for the start-up log and ``/server_info`` (key ``tangram``)."""
    padded = padded_kept_fraction(profile)
    return {
        **config.as_dict(),
        "scorer": profile.scorer,
        # the scorer option that changes which tokens a head keeps (docs/scorers.md)
        "window_share": (profile.provenance.get("scorer_options") or {}).get("window_share", 0),
        "profile_target_ratio": profile.target_ratio,
        "mean_kept_ratio": round(profile.mean_kept_fraction(), 6),
        "padded_kept_ratio": round(padded, 6),
        "predicted_capacity_vs_full_kv": round(1.0 / padded, 4),
        "num_head_groups": profile.grouping.num_head_groups,
        "heads_per_group": profile.grouping.heads_per_group,
        "group_scope": profile.grouping.scope,
        "sink_tokens": profile.sink_tokens,
        "recent_window": profile.recent_window,
        "model": profile.model.architecture,
    }


def summary_line(summary: dict[str, object]) -> str:
    """One log line: the numbers an operator checks first (per TP rank under ``--tp-size``)."""
    groups = (
        f"{summary['num_head_groups']} head groups of {summary['heads_per_group']} "
        f"({summary['group_scope']})"
    )
    if "tp_size" in summary:  # tensor parallelism: what each rank holds (tangram_sglang/tp.py)
        groups = (
            f"TP {summary['tp_size']}: per rank {summary['kv_heads_per_rank']} KV heads per "
            f"layer in {summary['head_groups_per_rank']} head groups of "
            f"{summary['heads_per_group']} ({summary['group_scope']}), budgets shared across "
            f"ranks (+{100 * float(summary['tp_budget_overhead']):.1f}% kept tokens)"
        )
    return (
        f"Tangram: profile {summary['profile_path']} ({summary['scorer']}), mean kept ratio "
        f"{summary['mean_kept_ratio']:.3f} ({summary['padded_kept_ratio']:.3f} with group "
        f"padding), {groups}, page {summary['page_size']} tokens, predicted capacity "
        f"{summary['predicted_capacity_vs_full_kv']:.2f}x full KV for long prompts"
    )


def profile_from_json(text: str) -> BudgetProfile:
    """Rebuild a resolved profile from :func:`profile_to_json` (the copy a subprocess gets)."""
    return BudgetProfile.from_dict(json.loads(text))


def profile_to_json(profile: BudgetProfile) -> str:
    """Serialise a resolved profile to JSON text (survives pickling to subprocesses)."""
    return json.dumps(profile.to_dict())
