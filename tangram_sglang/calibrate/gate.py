"""Fit ``kvzip-gate``'s weights: KVzip's scores on calibration contexts, regressed on k and v.

``calibrate --scorer kvzip-gate`` runs this before the budgets are measured: for each of the
first ``--gate-samples`` calibration samples (their first ``--gate-max-tokens`` tokens) it
computes KVzip's reconstruction scores with kvpress's ``KVzipPress`` (a second forward over the
context, offline only) and the gate's features (:func:`scoring.kvzip_gate.gate_features` of
every layer's post-RoPE keys and values, captured through the same attention hook as
:class:`observe.ScoreObserver`), then fits one ridge regression per (layer, KV head)
(:func:`scoring.kvzip_gate.fit_gate`). The tokens of the chat-template head that KVzip leaves
unscored are left out of the fit. KVzip's scores (the slow part: a second forward over each
context) are cached per model and context, so refitting, or calibrating another ratio, reads
them back.

Source: KVzip (arXiv 2505.23416) scores via kvpress 0.5.5 ``KVzipPress``; Fast KVzip (arXiv
2601.17668) for training a same-pass gate on them.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tangram_sglang.calibrate.observe import ScoreObserver
from tangram_sglang.errors import ConfigError
from tangram_sglang.scoring.kvzip_gate import SCORE_FLOOR, fit_gate, gate_features

DEFAULT_GATE_SAMPLES = 8  # calibration samples the gate is fitted on
DEFAULT_GATE_MAX_TOKENS = 2048  # tokens of each (KVzip's second forward costs 2-3 prefills)


@dataclass(frozen=True, slots=True)
class _FeatureCapture:
    """A token scorer whose "scores" are the gate's features: ``[H_kv, n, F]`` per layer."""

    name: str = "kvzip-gate-features"
    obs_window: int = 0

    def token_scores(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return gate_features(k, v)


def kvzip_scores_cached(
    model: Any, input_ids: Sequence[int], cache: Path | None
) -> tuple[np.ndarray, int]:
    """``eval.scorer_recall.kvzip_scores`` of one context, read from ``cache`` if there (a file
    per context, named by the hash of its token ids) and written there otherwise (atomically).
    ``cache`` must be specific to the model (the caller keys it by the model's identity)."""
    from tangram_sglang.eval.scorer_recall import kvzip_scores

    file = None
    if cache is not None:
        digest = hashlib.sha256(np.asarray(input_ids, np.int64).tobytes()).hexdigest()[:20]
        file = cache / f"{digest}.npz"
        if file.is_file():
            try:
                with np.load(file) as data:
                    return data["scores"], int(data["head"])
            except (OSError, ValueError, KeyError):
                pass  # unreadable: compute again and overwrite
    scores, head = kvzip_scores(model, list(input_ids))
    if file is not None:
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(".tmp.npz")
        np.savez(tmp, scores=scores, head=np.asarray(head))
        os.replace(tmp, file)
    return scores, head


def feature_observer(model: Any) -> ScoreObserver:
    """A :class:`observe.ScoreObserver` whose per-layer output is the gate's features
    (``[L, H_kv, n, F]``); build it once per model."""
    return ScoreObserver(model, _FeatureCapture())


def gate_training_data(
    model: Any,
    input_ids: Sequence[int],
    cache: Path | None = None,
    observer: ScoreObserver | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """One context's features and KVzip scores, the scored tokens only.

    Args:
        model: a transformers causal LM (Llama/Qwen2 family, SDPA attention: kvpress's need).
        input_ids: the context (tokens).
        cache: folder of this model's cached KVzip scores (:func:`kvzip_scores_cached`), or None.
        observer: :func:`feature_observer` of ``model`` (None: one is built for this call).

    Returns:
        ``(features, scores)``: float32 ``[L, H_kv, n', F]`` and ``[L, H_kv, n']`` for the
        ``n'`` tokens after the head KVzip leaves unscored.

    Raises:
        ConfigError: KVzip scored no token of the context (too short).
    """
    oracle, head = kvzip_scores_cached(model, input_ids, cache)
    if oracle.shape[-1] - head < 1:
        raise ConfigError(
            f"kvzip-gate: a calibration context of {len(input_ids)} tokens has no token after "
            f"KVzip's {head}-token head; use longer samples (--min-tokens)"
        )
    features = (observer or feature_observer(model)).scores(input_ids)
    return features[:, :, head:], oracle[:, :, head:]


def fit_gate_weights(
    model: Any,
    samples: Sequence[Any],
    num_samples: int,
    max_tokens: int,
    cache: Path | None = None,
) -> tuple[np.ndarray, dict]:
    """Gate weights from the first ``num_samples`` samples' first ``max_tokens`` tokens.

    Args:
        model: as :func:`gate_training_data`.
        samples: calibration samples (``input_ids`` each).
        num_samples: how many to fit on (>= 1; fewer if there are fewer).
        max_tokens: tokens of each sample used (>= 64).
        cache: folder of this model's cached KVzip scores, or None (computed every time).

    Returns:
        ``(weights, info)``: float32 ``[L, H_kv, 3 D / 2 + 1]`` and a JSON-ready record
        (samples, tokens, seconds, the fit's R^2 on its own tokens per layer, mean).

    Raises:
        ConfigError: bad counts.
    """
    from tqdm import tqdm

    if num_samples < 1 or max_tokens < 64:
        raise ConfigError(
            f"--gate-samples {num_samples} must be >= 1 and --gate-max-tokens {max_tokens} >= 64"
        )
    t0 = time.perf_counter()
    feats: list[list[np.ndarray]] = []
    scores: list[list[np.ndarray]] = []
    used = samples[:num_samples]
    observer = feature_observer(model)
    for sample in tqdm(used, desc="kvzip-gate: KVzip scores", unit="sample", file=sys.stderr):
        f, s = gate_training_data(model, list(sample.input_ids)[:max_tokens], cache, observer)
        if not feats:
            feats = [[] for _ in range(f.shape[0])]
            scores = [[] for _ in range(f.shape[0])]
        for layer in range(f.shape[0]):
            feats[layer].append(f[layer].transpose(1, 0, 2))  # [n', H_kv, F]
            scores[layer].append(s[layer].T)  # [n', H_kv]
    x = [np.concatenate(layer) for layer in feats]
    y = [np.concatenate(layer) for layer in scores]
    weights = fit_gate(x, y)
    r2 = []
    for layer, (xl, yl) in enumerate(zip(x, y, strict=True)):
        pred = np.einsum("nhf,hf->nh", xl, weights[layer, :, :-1]) + weights[layer, :, -1]
        target = np.log(np.clip(yl, 0.0, None) + SCORE_FLOOR)
        r2.append(
            1.0 - float(((target - pred) ** 2).sum() / ((target - target.mean(0)) ** 2).sum())
        )
    info = {
        "samples": len(used),
        "tokens": int(x[0].shape[0]),
        "max_tokens": max_tokens,
        "seconds": round(time.perf_counter() - t0, 1),
        "train_r2_mean": round(float(np.mean(r2)), 4),
    }
    return weights, info
