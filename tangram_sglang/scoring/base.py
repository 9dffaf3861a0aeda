"""The scorer interface and the scorer registry.

A scorer turns one layer's observation-window queries and one segment's keys into a score per
(KV head, token); the server keeps each head's top-``k_g`` tokens (:func:`select.select_kept`).
Scorers run per layer at prefill, inside the attention backend, on tensors that may live on the
GPU: they are pure torch, vectorised, with no Python loop over tokens.

The registry maps the profile's ``scorer`` name (``snapkv``, ``ada-snapkv``, ``pyramidkv``,
``duo``, ``kvzip-lite``, ``kvzip-gate``...) to a factory. A scorer with a ``token_scores(layer,
k, v)`` method (``kvzip-gate``) scores each token from its own key and value and reads no
queries (``scoring.kvzip_gate.is_token_scorer``). Like SGLang's radix-cache registry (and
unlike its attention registry, which silently overwrites) it rejects empty and duplicate names.

This module owns the protocol and the registry only; each scorer lives in its own file.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Mapping
from typing import Protocol, runtime_checkable

import torch

from tangram_sglang.errors import ConfigError


@runtime_checkable
class Scorer(Protocol):
    """Per-KV-head token scores of one segment at one layer.

    Attributes:
        name: the registry name (the profile's ``scorer`` field).
        obs_window: observation window w (queries; the segment's last w queries are scored).
    """

    name: str
    obs_window: int

    def score(
        self,
        q_obs: torch.Tensor,
        k_seg: torch.Tensor,
        sm_scale: float,
        lse_obs: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Scores of every token of the segment, per KV head (higher = keep).

        Args:
            q_obs: shape ``[num_qo_heads, w, head_dim]`` (optionally a leading batch dim), the
                segment's last ``w`` queries after RoPE; any float dtype, any device.
            k_seg: shape ``[num_kv_heads, n, head_dim]`` (same leading batch dim), the segment's
                keys after RoPE. Query i of the window sits at token ``n - w + i`` (causal).
            sm_scale: softmax scale (``1/sqrt(head_dim)`` for standard attention).
            lse_obs: optional float32 ``[num_qo_heads, w]``: log-sum-exp (natural log) of each
                window query over history + segment, from the extend kernel; without it the
                softmax is normalised over the segment's keys (kvpress behaviour).

        Returns:
            float32 ``[num_kv_heads, n]`` on the input's device.
        """
        ...


ScorerFactory = Callable[..., Scorer]

_REGISTRY: dict[str, ScorerFactory] = {}

# Keys that calibration records in a profile's ``provenance.scorer_options`` beside the scorer's
# own options (``alpha_safeguard``: ``calibrate --alpha-safeguard``, the safeguard of the
# Ada-SnapKV allocation); the scorers that have no such field do not read them.
RECORDED_OPTIONS = ("alpha_safeguard",)


def option_names(scorer: object) -> tuple[str, ...]:
    """A scorer's profile options: its dataclass fields but ``name`` and the model-bound ones
    (field metadata ``runtime``, e.g. kvzip-replay's RoPE), which no profile stores."""
    if not dataclasses.is_dataclass(scorer):
        return ()
    fields = dataclasses.fields(scorer)  # ClassVar markers (kvzip's ``replay``) are not fields
    return tuple(f.name for f in fields if f.name != "name" and not f.metadata.get("runtime"))


def profile_options(name: str, provenance: Mapping[str, object]) -> dict[str, object]:
    """The options a profile's ``provenance`` gives scorer ``name``, each name checked.

    A profile may set, under ``provenance.scorer_options``, the scorer's
    :func:`option_names` and calibration's :data:`RECORDED_OPTIONS`; a scorer option of any
    registered scorer placed directly under ``provenance`` is refused too (the scorer would
    otherwise be built without it, silently). Values are checked by the scorer itself.

    Returns:
        ``{option: value}`` for :func:`get_scorer` (the recorded keys the scorer lacks left out).

    Raises:
        ConfigError: an unknown scorer, ``scorer_options`` not a JSON object, an option name the
            scorer does not know (names the field, the scorer, the names it accepts and the
            nearest one), or a scorer option directly under ``provenance``.
    """
    known = option_names(get_scorer(name))
    accepted = (*known, *(k for k in RECORDED_OPTIONS if k not in known))
    owners = _option_owners()
    for key in provenance:
        if key in owners:
            fix = f"move it to provenance.scorer_options.{key}"
            if key not in accepted:
                fix = (
                    f"it is an option of {_listed(owners[key], 'and')} only, not of this "
                    f"profile's {name}: remove it"
                )
            raise ConfigError(
                f"provenance.{key} is a scorer option outside provenance.scorer_options, where "
                f"the scorer never reads it; {fix}"
            )
    options = provenance.get("scorer_options")
    if options is None:  # absent or null: the scorer's defaults
        options = {}
    if not isinstance(options, Mapping):  # [], "", 0 and false included
        raise ConfigError(
            f"provenance.scorer_options is a {type(options).__name__}; it must be a JSON object "
            f"of option names and values (the {name} scorer accepts {', '.join(accepted)})"
        )
    for key in options:
        if key in accepted:
            continue
        field = f"provenance.scorer_options.{key}"
        if key in owners:
            raise ConfigError(
                f"{field} is an option of the {_listed(owners[key], 'and')} "
                f"scorer{'s' * (len(owners[key]) > 1)} only, not of {name}; remove it from this "
                f"profile, or serve a {_listed(owners[key], 'or')} profile with it"
            )
        nearest = difflib.get_close_matches(str(key), accepted, n=1)
        fix = (
            f"did you mean {nearest[0]!r}? Rename it to provenance.scorer_options.{nearest[0]}"
            if nearest
            else "remove it, or rename it to one of those"
        )
        raise ConfigError(
            f"{field}: the {name} scorer has no option {key!r} (it accepts "
            f"{', '.join(accepted)}); {fix}"
        )
    return {k: v for k, v in options.items() if k in known}


def _option_owners() -> dict[str, tuple[str, ...]]:
    """Every registered scorer's option names, each with the scorers that have it (sorted)."""
    owners: dict[str, list[str]] = {}
    for scorer in available_scorers():
        try:
            names = option_names(get_scorer(scorer))
        except ConfigError:  # a registered factory that needs options to build: none known
            continue
        for option in names:
            owners.setdefault(option, []).append(scorer)
    return {option: tuple(names) for option, names in owners.items()}


def _listed(names: tuple[str, ...], word: str) -> str:
    """``a``, ``a and b``, ``a, b and c`` (``word``: ``and`` / ``or``)."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} {word} {names[-1]}"


def register_scorer(name: str, factory: ScorerFactory) -> None:
    """Register a scorer factory under ``name`` (called at import time of each scorer file).

    Raises:
        ConfigError: empty name, or a name that is already registered.
    """
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"scorer name {name!r} is empty; register it under a non-empty name")
    if name in _REGISTRY:
        raise ConfigError(
            f"scorer {name!r} is already registered ({_REGISTRY[name]!r}); pick another name"
        )
    _REGISTRY[name] = factory


def available_scorers() -> tuple[str, ...]:
    """Registered scorer names, sorted."""
    _load_builtin()
    return tuple(sorted(_REGISTRY))


def get_scorer(name: str, **options: object) -> Scorer:
    """Build the scorer registered under ``name`` with ``options`` (window, kernel size...).

    Raises:
        ConfigError: unknown name (the message lists the registered ones) or a bad option.
    """
    _load_builtin()
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ConfigError(
            f"scorer {name!r} is not registered; registered: {', '.join(available_scorers())}"
        ) from None
    try:
        return factory(**options)
    except TypeError as exc:
        raise ConfigError(f"scorer {name!r}: bad option ({exc})") from None


def _load_builtin() -> None:
    """Import the built-in scorer modules (each registers itself once)."""
    from tangram_sglang.scoring import (  # noqa: F401
        ada_snapkv,
        duo,
        kvzip,
        kvzip_gate,
        kvzip_lite,
        pyramidkv,
        snapkv,
    )
