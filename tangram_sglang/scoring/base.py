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
from collections.abc import Callable
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


def option_names(scorer: object) -> tuple[str, ...]:
    """A scorer's profile options: its dataclass fields but ``name`` and the model-bound ones
    (field metadata ``runtime``, e.g. kvzip-replay's RoPE), which no profile stores."""
    if not dataclasses.is_dataclass(scorer):
        return ()
    fields = dataclasses.fields(scorer)  # ClassVar markers (kvzip's ``replay``) are not fields
    return tuple(f.name for f in fields if f.name != "name" and not f.metadata.get("runtime"))


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
