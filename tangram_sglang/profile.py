"""Budget profiles: the static per-KV-head retention ratios that the server loads.

A profile fixes, for every (layer, kv_head), the fraction ``r`` of a segment's tokens that the head
keeps, plus ``sink_tokens`` and ``recent_window`` (always kept) and the head-group map. It is made
offline by ``python -m tangram_sglang.calibrate`` as ``r = clip(mean + alpha * std, floor, 1)``
over N >= 50 samples (Tangram arXiv 2606.06302, Budget Reservation; alpha = 2).

File format (JSON, ``schema_version`` 1)::

    {
      "schema_version": 1,
      "model": {"architecture", "num_layers", "num_kv_heads", "num_qo_heads", "head_dim",
                "config_fingerprint"},
      "scorer": "ada-snapkv" | "snapkv" | "pyramidkv" | "duo",
      "target_ratio": float in (0, 1],
      "sink_tokens": int >= 0, "recent_window": int >= 0,
      "ratio": [[float] * num_kv_heads] * num_layers,        # in (0, 1]
      "stats": null | {"mean": [[...]], "std": [[...]], "alpha": float, "num_samples": int},
      "grouping": {"page_group_size": int, "scope": "per_layer" | "global",
                   "cluster_of": [[int]], "column_of": [[int]]},
      "provenance": {"command", "dataset", "num_samples", "date", "versions": {...},
                     "scorer_options": {option: value}, ...},  # scoring.base.profile_options
      "min_compress_tokens": int >= 0     # optional, default 0; written only when > 0
    }

``min_compress_tokens`` is a serving setting, not a calibration output: the server sets it from
``--tangram-min-compress-tokens`` (:meth:`BudgetProfile.with_min_compress_tokens`) whatever
the file says; it is in the format only so that the resolved profile survives the JSON copy
the scheduler process gets.

This module owns the format, its validation and the one kept-length formula
(:func:`kept_len`). Memory accounting, kernels and the server all call :func:`kept_len`; nothing
else may re-derive it.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tangram_sglang.errors import ProfileError
from tangram_sglang.grouping import HeadGrouping

SCHEMA_VERSION = 1
SCORERS = (
    "snapkv",
    "ada-snapkv",
    "pyramidkv",
    "duo",
    "kvzip-lite",
    "kvzip-replay",
    "kvzip-gate",
    "kvzip",
)
# Guard against ratio * n landing a hair above an integer (0.3 * 10 = 3.0000000000000004).
_CEIL_EPS = 1e-9
MIN_RATIO = 1e-6  # smallest kept fraction a rescaled head may get (fraction of tokens)


def kept_len(
    num_tokens: int,
    ratio: float,
    sink_tokens: int,
    recent_window: int,
    min_compress_tokens: int = 0,
) -> int:
    """Tokens a head (group) keeps of one segment of ``num_tokens`` tokens.

    ``k(n) = n`` for ``n < min_compress_tokens`` (short segments are kept whole and not
    scored), else ``k(n) = min(n, sink_part + window_part + ceil(ratio * rest))`` where
    ``sink_part = min(sink_tokens, n)``, ``window_part = min(recent_window, n - sink_part)``
    and ``rest`` is what remains. Never 0 for ``n >= 1``; never more than ``n`` (so no head
    ever holds more tokens than full KV); equals ``n`` for ``ratio == 1``.

    Args:
        num_tokens: segment length n (tokens, >= 0).
        ratio: retention ratio in (0, 1].
        sink_tokens: first tokens of the segment always kept (tokens).
        recent_window: last tokens of the segment always kept (tokens).
        min_compress_tokens: segments shorter than this are kept whole (tokens, >= 0; the
            server's ``--tangram-min-compress-tokens``).

    Returns:
        The kept length in tokens, in ``[min(n, 1), n]``.

    Source: docs/design.md §2 (segment, k_g(n)); Tangram arXiv 2606.06302, Budget Reservation;
    the short-segment floor follows the public Tangram code (no compression under 512 tokens).
    """
    if num_tokens <= 0:
        return 0
    if num_tokens < min_compress_tokens:
        return num_tokens
    sink_part = min(sink_tokens, num_tokens)
    window_part = min(recent_window, num_tokens - sink_part)
    rest = num_tokens - sink_part - window_part
    kept = sink_part + window_part + math.ceil(ratio * rest - _CEIL_EPS)
    return max(1, min(num_tokens, kept))


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    """The attention geometry a profile was calibrated for.

    ``config_fingerprint`` is :func:`config_fingerprint` of the HF config; it is compared only
    when both sides have one, so a synthetic profile may leave it empty.
    """

    architecture: str
    num_layers: int
    num_kv_heads: int
    num_qo_heads: int
    head_dim: int
    config_fingerprint: str = ""

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelIdentity:
        """Read the identity from a transformers ``PretrainedConfig`` (or its dict)."""
        cfg = config if isinstance(config, dict) else config.to_dict()
        num_qo_heads = int(cfg["num_attention_heads"])
        return cls(
            architecture=(cfg.get("architectures") or ["unknown"])[0],
            num_layers=int(cfg["num_hidden_layers"]),
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_qo_heads),
            num_qo_heads=num_qo_heads,
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // num_qo_heads),
            config_fingerprint=config_fingerprint(cfg),
        )


def config_fingerprint(cfg: dict[str, Any]) -> str:
    """sha256 (first 16 hex chars) of the config fields that shape the KV cache and attention.

    Values are normalised so that one model converted by different transformers versions gets
    one fingerprint: ``rope_theta`` is read from the top level or from ``rope_parameters``
    (transformers >= 5 moves it there), a missing ``head_dim`` / ``num_key_value_heads`` is
    derived (``hidden_size // num_attention_heads``; MHA), numbers are compared as floats.
    """
    rope = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta")
    heads = cfg.get("num_attention_heads")
    head_dim = cfg.get("head_dim") or (
        cfg["hidden_size"] // heads if cfg.get("hidden_size") and heads else None
    )
    picked = {
        "architectures": cfg.get("architectures"),
        "hidden_size": cfg.get("hidden_size"),
        "num_hidden_layers": cfg.get("num_hidden_layers"),
        "num_attention_heads": heads,
        "num_key_value_heads": cfg.get("num_key_value_heads") or heads,
        "head_dim": head_dim,
        "rope_theta": None if rope is None else float(rope),
        "max_position_embeddings": cfg.get("max_position_embeddings"),
        "vocab_size": cfg.get("vocab_size"),
    }
    return hashlib.sha256(json.dumps(picked, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class CalibrationStats:
    """Per-head retention statistics over the calibration samples.

    Attributes:
        mean: float64 ``[num_layers, num_kv_heads]``: mean observed retention (fraction).
        std: float64 ``[num_layers, num_kv_heads]``: its standard deviation.
        alpha: the safety coefficient of ``r = mean + alpha * std``.
        num_samples: samples observed.
    """

    mean: np.ndarray
    std: np.ndarray
    alpha: float
    num_samples: int


@dataclass(frozen=True, slots=True)
class BudgetProfile:
    """A validated budget profile. Build with :meth:`load`, :meth:`from_dict` or directly.

    Attributes:
        model: the geometry it was calibrated for.
        scorer: the token scorer the server runs at prefill (one of ``SCORERS``).
        target_ratio: the calibration target (the mean kept fraction is larger: mean + 2 std).
        ratio: float64 ``[num_layers, num_kv_heads]`` in (0, 1].
        sink_tokens: always-kept first tokens of each segment (tokens).
        recent_window: always-kept last tokens of each segment (tokens).
        grouping: the head-group map.
        stats: calibration statistics, or None for a synthetic profile.
        provenance: record of how it was made, free-form but for ``scorer_options`` (the
            scorer's options, names checked by ``scoring.base.profile_options``) and the
            registered scorers' option names, which are reserved there (refused as misplaced).
        min_compress_tokens: segments shorter than this are kept whole, unscored (tokens; a
            serving setting, see :meth:`with_min_compress_tokens`; 0 = compress every length).
    """

    model: ModelIdentity
    scorer: str
    target_ratio: float
    ratio: np.ndarray
    sink_tokens: int
    recent_window: int
    grouping: HeadGrouping
    stats: CalibrationStats | None = None
    provenance: dict[str, Any] = field(default_factory=dict)
    min_compress_tokens: int = 0

    def __post_init__(self) -> None:
        self.validate()

    # ---- derived numbers -------------------------------------------------------------------
    @property
    def group_ratios(self) -> np.ndarray:
        """float64 ``[num_head_groups]``: per group the max ratio of its members."""
        return self.grouping.group_ratios(self.ratio)

    def group_kept_lens(self, num_tokens: int) -> list[int]:
        """Kept length (tokens) of each head group for one segment of ``num_tokens`` tokens.

        :func:`kept_len` per group (``min_compress_tokens`` included): the one footprint
        formula that admission, page allocation and the scorer all read. Computed for all
        groups at once (:meth:`group_kept_array`); equal to ``kept_len`` group by group.
        """
        return self.group_kept_array(num_tokens).tolist()

    def group_kept_array(self, num_tokens: int) -> np.ndarray:
        """int64 ``[num_head_groups]``: :meth:`group_kept_lens` as one vectorised array.

        The hot-path form (admission and allocation call it per segment): :func:`kept_len`'s
        formula over every group's ratio in a few numpy operations instead of a Python loop.
        """
        n = int(num_tokens)
        ratios = self.group_ratios
        if n <= 0:
            return np.zeros(ratios.shape, np.int64)
        if n < self.min_compress_tokens:
            return np.full(ratios.shape, n, np.int64)
        sink_part = min(self.sink_tokens, n)
        window_part = min(self.recent_window, n - sink_part)
        rest = n - sink_part - window_part
        kept = sink_part + window_part + np.ceil(ratios * rest - _CEIL_EPS).astype(np.int64)
        return np.clip(kept, 1, n)

    def with_min_compress_tokens(self, tokens: int) -> BudgetProfile:
        """The same profile keeping segments shorter than ``tokens`` whole (not scored).

        Raises:
            ProfileError: ``tokens`` not an integer >= 0.
        """
        return _replace(self, min_compress_tokens=tokens)

    def mean_kept_fraction(self) -> float:
        """Mean of the per-head ratios: the fraction of full KV the profile keeps (long n)."""
        return float(self.ratio.mean())

    def with_grouping(self, heads_per_group: int, scope: str) -> BudgetProfile:
        """The same ratios regrouped (budget-aware clustering) with another H_p or scope."""
        grouping = HeadGrouping.build(self.ratio, heads_per_group, scope)
        return _replace(self, grouping=grouping)

    def rescaled(self, target_mean: float) -> BudgetProfile:
        """Scale the ratios so that their mean is ``target_mean`` (clipped to (0, 1]).

        Scaling keeps the head ranking (and so the grouping order). The clip at 1 can leave the
        mean below the target when the target is close to 1; the ratio then stays at 1 for the
        heads that hit it and the others are scaled with one factor found by bisection.

        Raises:
            ProfileError: target outside (0, 1], or so small that the smallest head would keep
                a fraction below ``MIN_RATIO`` (the message gives the smallest valid target).
        """
        if not 0.0 < target_mean <= 1.0:
            raise ProfileError(f"target ratio {target_mean} must be in (0, 1]")
        smallest = float(np.minimum(self.ratio * (MIN_RATIO / self.ratio.min()), 1.0).mean())
        if target_mean < smallest:
            raise ProfileError(
                f"target ratio {target_mean} is too small for this profile: its smallest head "
                f"would keep less than {MIN_RATIO} of the tokens; use a target >= {smallest:.3g}"
            )
        lo, hi = 0.0, 1.0 / float(self.ratio.min())
        for _ in range(100):  # bisection on the scale; mean(clip(s * r, 1)) is monotone in s
            mid = (lo + hi) / 2
            if np.minimum(self.ratio * mid, 1.0).mean() < target_mean:
                lo = mid
            else:
                hi = mid
        ratio = np.clip(self.ratio * hi, MIN_RATIO, 1.0)
        grouping = HeadGrouping.build(ratio, self.grouping.heads_per_group, self.grouping.scope)
        return _replace(self, ratio=ratio, grouping=grouping)

    # ---- validation ------------------------------------------------------------------------
    def validate(self) -> None:
        """Check every field; raises :class:`ProfileError` naming the field and the fix."""
        m = self.model
        for name in ("num_layers", "num_kv_heads", "num_qo_heads", "head_dim"):
            if int(getattr(m, name)) < 1:
                raise ProfileError(f"model.{name}={getattr(m, name)} must be >= 1")
        if m.num_qo_heads % m.num_kv_heads:
            raise ProfileError(
                f"model.num_qo_heads={m.num_qo_heads} is not a multiple of "
                f"model.num_kv_heads={m.num_kv_heads}"
            )
        if self.scorer not in SCORERS:
            raise ProfileError(f"scorer={self.scorer!r} is unknown; use one of {SCORERS}")
        if not (math.isfinite(self.target_ratio) and 0.0 < self.target_ratio <= 1.0):
            raise ProfileError(f"target_ratio={self.target_ratio} must be in (0, 1]")
        for name in ("sink_tokens", "recent_window"):
            if int(getattr(self, name)) < 0:
                raise ProfileError(f"{name}={getattr(self, name)} must be >= 0")
        mct = self.min_compress_tokens
        if isinstance(mct, bool) or not isinstance(mct, int | np.integer) or mct < 0:
            raise ProfileError(
                f"min_compress_tokens={mct!r} must be an integer >= 0 (tokens; segments shorter "
                "than it are kept whole; 0 compresses every length)"
            )
        shape = (m.num_layers, m.num_kv_heads)
        _check_matrix("ratio", self.ratio, shape)
        if (self.ratio <= 0).any() or (self.ratio > 1).any():
            bad = np.argwhere((self.ratio <= 0) | (self.ratio > 1))[0]
            raise ProfileError(
                f"ratio[{bad[0]}][{bad[1]}]={self.ratio[tuple(bad)]} is outside (0, 1]; every "
                "head must keep a positive fraction at most 1 (recalibrate or clip)"
            )
        if self.stats is not None:
            _check_matrix("stats.mean", self.stats.mean, shape)
            _check_matrix("stats.std", self.stats.std, shape)
            if not math.isfinite(self.stats.alpha) or self.stats.num_samples < 1:
                raise ProfileError(
                    f"stats.alpha={self.stats.alpha} must be finite and stats.num_samples="
                    f"{self.stats.num_samples} >= 1"
                )
        self.grouping.validate(m.num_layers, m.num_kv_heads)

    def check_model(self, model: ModelIdentity) -> None:
        """Check that this profile fits ``model`` (the one being served).

        Raises:
            ProfileError: naming the first mismatching field and how to get a matching profile.
        """
        for name in ("num_layers", "num_kv_heads", "num_qo_heads", "head_dim"):
            mine, theirs = getattr(self.model, name), getattr(model, name)
            if mine != theirs:
                raise ProfileError(
                    f"profile model.{name}={mine} but the served model has {theirs}: this "
                    f"profile was calibrated for {self.model.architecture}; calibrate one for "
                    "this model with `python -m tangram_sglang.calibrate --model-path ...`"
                )
        fp_mine, fp_theirs = self.model.config_fingerprint, model.config_fingerprint
        if fp_mine and fp_theirs and fp_mine != fp_theirs:
            raise ProfileError(
                f"profile model.config_fingerprint={fp_mine} but the served model's config gives "
                f"{fp_theirs}: same shape, different model; calibrate a profile for this model"
            )

    # ---- (de)serialisation -----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready dict of the documented file format."""
        stats = None
        if self.stats is not None:
            stats = {
                "mean": self.stats.mean.tolist(),
                "std": self.stats.std.tolist(),
                "alpha": self.stats.alpha,
                "num_samples": self.stats.num_samples,
            }
        return {
            "schema_version": SCHEMA_VERSION,
            "model": {
                "architecture": self.model.architecture,
                "num_layers": self.model.num_layers,
                "num_kv_heads": self.model.num_kv_heads,
                "num_qo_heads": self.model.num_qo_heads,
                "head_dim": self.model.head_dim,
                "config_fingerprint": self.model.config_fingerprint,
            },
            "scorer": self.scorer,
            "target_ratio": self.target_ratio,
            "sink_tokens": self.sink_tokens,
            "recent_window": self.recent_window,
            "ratio": self.ratio.tolist(),
            "stats": stats,
            "grouping": {
                "page_group_size": self.grouping.heads_per_group,
                "scope": self.grouping.scope,
                "cluster_of": self.grouping.cluster_of.tolist(),
                "column_of": self.grouping.column_of.tolist(),
            },
            "provenance": self.provenance,
        } | ({"min_compress_tokens": self.min_compress_tokens} if self.min_compress_tokens else {})

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BudgetProfile:
        """Parse and validate the documented format.

        Raises:
            ProfileError: wrong schema version, missing or mistyped field, bad value.
        """
        if not isinstance(data, dict):
            raise ProfileError("profile: the top level must be a JSON object")
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ProfileError(
                f"schema_version={version!r} is not supported (this Tangram reads version "
                f"{SCHEMA_VERSION}); recalibrate with this version's calibrate CLI"
            )
        try:
            model = _read_model(_section("model", data["model"]))
            grouping = _read_grouping(_section("grouping", data["grouping"]))
            stats = None
            if data.get("stats") is not None:
                stats = _read_stats(_section("stats", data["stats"]))
            return cls(
                model=model,
                scorer=_str("scorer", data["scorer"]),
                target_ratio=_number("target_ratio", data["target_ratio"]),
                ratio=_float_matrix("ratio", data["ratio"]),
                sink_tokens=_int("sink_tokens", data["sink_tokens"]),
                recent_window=_int("recent_window", data["recent_window"]),
                grouping=grouping,
                stats=stats,
                provenance=dict(_section("provenance", data.get("provenance") or {})),
                min_compress_tokens=_int("min_compress_tokens", data.get("min_compress_tokens", 0)),
            )
        except KeyError as exc:
            raise ProfileError(f"profile: missing field {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:  # safety net; the readers above name the field
            raise ProfileError(f"profile: malformed field ({exc})") from None

    @classmethod
    def load(cls, path: str | Path) -> BudgetProfile:
        """Read and validate a profile file.

        Raises:
            ProfileError: file missing, unreadable or not JSON, or any validation failure (the
                message starts with the path).
        """
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ProfileError(f"{path}: profile file not found") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ProfileError(f"{path}: not a JSON profile ({exc})") from None
        except OSError as exc:  # a folder, no permission, I/O error
            raise ProfileError(f"{path}: cannot read the profile file ({exc.strerror})") from None
        try:
            return cls.from_dict(data)
        except ProfileError as exc:
            raise ProfileError(f"{path}: {exc}") from None

    def save(self, path: str | Path) -> None:
        """Write atomically (temp file + rename), so a crash never leaves half a profile."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        tmp.replace(path)


def _replace(profile: BudgetProfile, **changes: Any) -> BudgetProfile:
    fields = {name: getattr(profile, name) for name in BudgetProfile.__dataclass_fields__}
    fields.update(changes)
    return BudgetProfile(**fields)


def _check_matrix(name: str, arr: np.ndarray, shape: tuple[int, int]) -> None:
    if arr.shape != shape:
        raise ProfileError(
            f"{name} has shape {list(arr.shape)} but the model has [num_layers, num_kv_heads] = "
            f"{list(shape)}; this profile belongs to another model"
        )
    if not np.isfinite(arr).all():
        bad = np.argwhere(~np.isfinite(arr))[0]
        raise ProfileError(f"{name}[{bad[0]}][{bad[1]}] is {arr[tuple(bad)]}: NaN/inf; recalibrate")


def _read_model(m: dict[str, Any]) -> ModelIdentity:
    return ModelIdentity(
        architecture=_str("model.architecture", m["architecture"]),
        num_layers=_int("model.num_layers", m["num_layers"]),
        num_kv_heads=_int("model.num_kv_heads", m["num_kv_heads"]),
        num_qo_heads=_int("model.num_qo_heads", m["num_qo_heads"]),
        head_dim=_int("model.head_dim", m["head_dim"]),
        config_fingerprint=_str("model.config_fingerprint", m.get("config_fingerprint", "")),
    )


def _read_grouping(g: dict[str, Any]) -> HeadGrouping:
    return HeadGrouping(
        heads_per_group=_int("grouping.page_group_size", g["page_group_size"]),
        scope=_str("grouping.scope", g["scope"]),
        cluster_of=_int_matrix("grouping.cluster_of", g["cluster_of"]),
        column_of=_int_matrix("grouping.column_of", g["column_of"]),
    )


def _read_stats(s: dict[str, Any]) -> CalibrationStats:
    return CalibrationStats(
        mean=_float_matrix("stats.mean", s["mean"]),
        std=_float_matrix("stats.std", s["std"]),
        alpha=_number("stats.alpha", s["alpha"]),
        num_samples=_int("stats.num_samples", s["num_samples"]),
    )


def _section(name: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ProfileError(f"{name} must be a JSON object, not {type(value).__name__}")
    return value


def _str(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ProfileError(f"{name}={value!r} must be a string")
    return value


def _int(name: str, value: Any) -> int:
    # JSON ints only: "4", 4.7 and true are rejected rather than silently coerced.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProfileError(f"{name}={value!r} must be an integer")
    return value


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ProfileError(f"{name}={value!r} must be a number")
    return float(value)


def _matrix(name: str, value: Any, kinds: str, what: str) -> np.ndarray:
    """A 2-D array whose numpy dtype kind is in ``kinds`` (``"iu"`` ints, ``"f"`` floats)."""
    try:
        arr = np.asarray(value)
    except ValueError:  # rows of different lengths
        arr = None
    if arr is None or arr.ndim != 2 or arr.dtype.kind not in kinds:
        raise ProfileError(
            f"{name} must be a 2-D list of {what} [num_layers][num_kv_heads] with rows of "
            "equal length"
        )
    return arr


def _float_matrix(name: str, value: Any) -> np.ndarray:
    return _matrix(name, value, "iuf", "numbers").astype(np.float64)


def _int_matrix(name: str, value: Any) -> np.ndarray:
    return _matrix(name, value, "iu", "integers").astype(np.int64)


if __name__ == "__main__":  # `python -m tangram_sglang.profile show PROFILE --plot out.png`
    import sys

    from tangram_sglang.calibrate.show import main as _show_main  # lazy: calibrate is a leaf

    sys.exit(_show_main())
