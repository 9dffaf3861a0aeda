"""kvzip-gate: RoPE-invariant features, the ridge fit, the batched selection, bad weights."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from factories import extend_batch

from tangram_sglang.backend.compress import batch_kept_indices, reference_kept_indices
from tangram_sglang.backend.state import build_scorer
from tangram_sglang.errors import ConfigError, KernelError
from tangram_sglang.scoring import KVzipGateScorer, get_scorer, is_token_scorer
from tangram_sglang.scoring.kvzip_gate import fit_gate, gate_features, num_features

L, H_KV, GQA, D = 3, 2, 2, 8


def _weights(seed: int = 0) -> list:
    gen = np.random.default_rng(seed)
    return gen.normal(size=(L, H_KV, num_features(D) + 1)).tolist()


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float = 10_000.0) -> torch.Tensor:
    """Neox-layout RoPE (HF ``rotate_half``): x ``[..., n, D]``, pos ``[n]``."""
    half = x.shape[-1] // 2
    inv = theta ** (-torch.arange(half, dtype=torch.float64) / half)
    ang = pos.double()[:, None] * inv[None, :]
    cos, sin = ang.cos().float(), ang.sin().float()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def test_features_and_scores_are_the_same_before_and_after_rope():
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(H_KV, 50, D, generator=gen)
    v = torch.randn(H_KV, 50, D, generator=gen)
    pos = torch.randint(0, 30_000, (50,), generator=gen)
    feats = gate_features(k, v)
    assert feats.shape == (H_KV, 50, num_features(D)) and feats.dtype == torch.float32
    torch.testing.assert_close(gate_features(_rope(k, pos), v), feats, rtol=1e-5, atol=1e-5)
    scorer = KVzipGateScorer(weights=_weights())
    before = scorer.token_scores(1, k, v)
    assert before.shape == (H_KV, 50) and before.dtype == torch.float32
    torch.testing.assert_close(
        scorer.token_scores(1, _rope(k, pos), v), before, rtol=1e-4, atol=1e-4
    )
    # the score is the documented linear map of the features
    w = torch.tensor(_weights(), dtype=torch.float32)[1]
    torch.testing.assert_close(before, (feats * w[:, None, :-1]).sum(-1) + w[:, -1:])


def test_the_fit_recovers_a_planted_gate():
    gen = np.random.default_rng(1)
    truth = gen.normal(scale=0.3, size=(L, H_KV, num_features(D) + 1))
    x = [gen.normal(size=(4000, H_KV, num_features(D))) for _ in range(L)]
    # KVzip scores are in [0, 1]: plant log-scores well below 0
    y = [
        np.exp(np.einsum("nhf,hf->nh", x[i], truth[i, :, :-1]) + truth[i, :, -1] - 6)
        for i in range(L)
    ]
    truth[:, :, -1] -= 6
    fitted = fit_gate(x, y, ridge=1e-8)
    assert fitted.shape == truth.shape and fitted.dtype == np.float32
    np.testing.assert_allclose(fitted, truth, atol=2e-3)


def test_the_default_ridge_leaves_the_intercept_alone():
    """Features far from 0 (norms) and targets near log(1e-4): the penalty must not pull the
    intercept towards 0 (an uncentred ridge moved -8 to about -0.8 here)."""
    gen = np.random.default_rng(2)
    f = num_features(D)
    x = [np.abs(gen.normal(loc=3.0, size=(5000, H_KV, f)))]
    w = gen.normal(scale=0.1, size=(H_KV, f))
    noise = gen.normal(scale=0.5, size=(5000, H_KV))
    y = [np.exp(np.einsum("nhf,hf->nh", x[0], w) - 8.0 + noise)]
    fitted = fit_gate(x, y)  # the default ridge
    pred = np.einsum("nhf,hf->nh", x[0], fitted[0, :, :-1]) + fitted[0, :, -1]
    rmse = float(np.sqrt(np.mean((pred - np.log(y[0] + 1e-6)) ** 2)))
    assert rmse < 0.55  # the noise floor is 0.5
    np.testing.assert_allclose(fitted[0, :, :-1], w, atol=0.03)


@pytest.mark.parametrize(
    ("features", "scores", "ridge", "message"),
    [
        ([], [], 1e-2, "0 feature and 0 score layers"),
        ([np.ones((5, H_KV, 3))], [np.ones((5, H_KV))] * 2, 1e-2, "1 feature and 2 score"),
        ([np.ones((5, H_KV, 3))], [np.ones((4, H_KV))], 1e-2, "layer 0: features [5, 2, 3]"),
        ([np.ones((0, H_KV, 3))], [np.ones((0, H_KV))], 1e-2, "with N > 0"),
        ([np.ones((5, H_KV, 3))], [np.ones((5, H_KV))], 0.0, "ridge 0.0 (> 0)"),
    ],
)
def test_bad_fit_inputs_are_named(features, scores, ridge, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        fit_gate(features, scores, ridge)


def _batch(lengths, seed):
    return extend_batch(lengths, seed, H_KV, GQA, D)


@pytest.mark.parametrize(
    "lengths",
    [[40], [40, 40, 40], [70, 5, 130, 0, 64, 65, 300, 12, 129, 257, 40, 90], [3, 0, 30]],
    ids=["one", "one-run", "buckets", "short"],
)
@pytest.mark.parametrize("layer", [0, 2])
@pytest.mark.parametrize("share", [0.0, 0.25], ids=["gate", "window-share"])
def test_batched_gate_selection_equals_the_reference(lengths, layer, share):
    rng = np.random.default_rng(len(lengths) + layer)
    scorer = KVzipGateScorer(weights=_weights(layer), window_share=share)
    q, k, v, lse, bounds = _batch(lengths, layer)
    kept = [[int(rng.integers(1, n + 1)) if n else 1 for _ in range(H_KV)] for n in lengths]
    args = (scorer, q, k, lse, bounds, kept, 0.3, 2, 3)
    want = reference_kept_indices(*args, v_new=v, layer_id=layer)
    got = batch_kept_indices(*args, v_new=v, layer_id=layer)
    assert torch.equal(got, want)
    if share:  # united with the window's top tokens (tests/unit/test_window_union.py)
        return
    # the selection is each head's own top-k of its gate scores (sinks, window always kept)
    i = int(np.argmax(lengths))
    n, start = lengths[i], bounds[i]
    scores = scorer.token_scores(
        layer, k[start : start + n].transpose(0, 1), v[start : start + n].transpose(0, 1)
    )
    for h in range(H_KV):
        if kept[i][h] > 5:  # beyond the 2 sinks and the 3-token window: the top scores
            top = torch.topk(scores[h, 2 : n - 3], kept[i][h] - 5).indices + 2
            assert set(top.tolist()) <= set(got[i, h, : kept[i][h]].tolist())


def test_the_serving_path_needs_the_values_and_the_layer():
    scorer = KVzipGateScorer(weights=_weights())
    q, k, v, lse, bounds = _batch([40, 20], 0)
    kept = [[10, 12], [5, 6]]
    with pytest.raises(KernelError, match="pass v_new and layer_id"):
        batch_kept_indices(scorer, q, k, lse, bounds, kept, 0.3, 2, 3)
    with pytest.raises(ConfigError, match="call token_scores"):
        scorer.score(q[:4].transpose(0, 1), k[:40].transpose(0, 1), 0.3)


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ([[1.0, 2.0]], "has shape [1, 2]"),
        (np.ones((L, H_KV, 5)).tolist(), "has shape [3, 2, 5]"),
        (np.full((L, H_KV, 13), np.nan).tolist(), "weights[0][0][0] is nan: the gate weights must"),
        ([[[0.5, 1, 2, 3]], [[1, 2, float("-inf"), 3]]], "weights[1][0][2] is -inf: the gate"),
        ([[[float("nan"), 1, 2, 3]]], "be finite numbers (1 non-finite"),
        ([[[1.0, 2.0], [1.0]]], "is not a [num_layers][num_kv_heads]"),
        ([[["a"] * 13] * H_KV] * L, "is not a [num_layers][num_kv_heads]"),
    ],
)
def test_bad_weights_are_refused_naming_the_profile_field(weights, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        get_scorer("kvzip-gate", weights=weights)


def test_a_gate_without_weights_or_for_another_model_is_refused():
    empty = get_scorer("kvzip-gate")
    assert is_token_scorer(empty) and empty.shape is None
    with pytest.raises(ConfigError, match="has no gate weights"):
        empty.token_scores(0, torch.ones(H_KV, 4, D), torch.ones(H_KV, 4, D))
    scorer = KVzipGateScorer(weights=_weights())
    assert scorer.shape == (L, H_KV, D)
    with pytest.raises(ConfigError, match="layer 3 with 2 KV heads"):
        scorer.token_scores(3, torch.ones(H_KV, 4, D), torch.ones(H_KV, 4, D))
    with pytest.raises(ConfigError, match="head_dim 4 gives 6 features"):
        scorer.token_scores(0, torch.ones(H_KV, 4, 4), torch.ones(H_KV, 4, 4))
    with pytest.raises(ConfigError, match=r"are for \(layers, KV heads, head_dim\) \(3, 2, 8\)"):
        scorer.check_model(30, 3, 64)
    with pytest.raises(ConfigError, match="obs_window=4 must be 0"):
        get_scorer("kvzip-gate", weights=_weights(), obs_window=4)


def test_the_server_refuses_a_profile_whose_gate_does_not_fit_its_model():
    """``backend.state.build_scorer``: the profile's model (SmolLM2: 30 layers, 3 KV heads,
    head_dim 64) against the gate's weights, at start-up."""
    import dataclasses

    from tangram_sglang.profile import BudgetProfile

    smollm2_profile = BudgetProfile.load("calibration/smollm2/ada-snapkv-r0.25.json")

    fits = np.zeros((30, 3, num_features(64) + 1)).tolist()
    provenance = {**smollm2_profile.provenance, "scorer_options": {"weights": fits}}
    good = dataclasses.replace(smollm2_profile, scorer="kvzip-gate", provenance=provenance)
    assert build_scorer(good).shape == (30, 3, 64)
    wrong = {**provenance, "scorer_options": {"weights": _weights()}}
    with pytest.raises(ConfigError, match="the model has \\(30, 3, 64\\)"):
        build_scorer(dataclasses.replace(good, provenance=wrong))
    missing = {**provenance, "scorer_options": {}}
    with pytest.raises(ConfigError, match="has no gate weights"):
        build_scorer(dataclasses.replace(good, provenance=missing))


def test_a_synthetic_profile_from_a_gate_source_gets_weights_of_its_own_shape(tmp_path):
    """``scripts/synthesize_profile.py`` (Llama-3.1-8B-shaped dummy model for the GPU
    benchmarks): a kvzip-gate source's weights fit only the source, so the synthetic profile
    carries seeded random weights of the target's shape, which the server accepts."""
    import dataclasses
    import importlib.util
    from pathlib import Path

    from tangram_sglang.profile import BudgetProfile

    repo = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location(
        "synthesize_profile", repo / "scripts/synthesize_profile.py"
    )
    synth = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(synth)
    base = BudgetProfile.load(repo / "calibration/smollm2/ada-snapkv-r0.25.json")
    weights = np.zeros((30, 3, num_features(64) + 1)).tolist()
    source = dataclasses.replace(
        base, scorer="kvzip-gate", provenance={"scorer_options": {"weights": weights}}
    )
    source.save(tmp_path / "gate.json")
    dummy = repo / "calibration/synthetic/llama3.1-8b-dummy"
    profile = synth.synthesize(dummy, [tmp_path / "gate.json"], 4, "global", 0)
    assert profile.scorer == "kvzip-gate"
    scorer = build_scorer(profile)
    assert scorer.shape == (32, 8, 128)
    again = synth.synthesize(dummy, [tmp_path / "gate.json"], 4, "global", 0)
    assert again.provenance["scorer_options"] == profile.provenance["scorer_options"]  # seeded
