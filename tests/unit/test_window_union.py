"""The ``window_share`` option: kvzip-lite's and kvzip-gate's top tokens united with the
observation window's by a budget-independent rank fusion (``scoring.select.window_union``),
the same on the HF side (the scorers' own calls) and on every serving path (backend.compress)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from factories import extend_batch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from tangram_sglang.backend import compress
from tangram_sglang.backend.compress import batch_kept_indices, reference_kept_indices
from tangram_sglang.errors import ConfigError, KernelError
from tangram_sglang.scoring import KVzipGateScorer, KVzipLiteScorer, get_scorer, select_kept, snapkv
from tangram_sglang.scoring.kvzip_gate import num_features
from tangram_sglang.scoring.select import window_union
from tangram_sglang.scoring.snapkv import WINDOW_SCORER, with_window

GQA, H_KV, D = 2, 3, 16  # head_dim 16: the scoring kernels run (TRITON_INTERPRET=1 on CPU)
SINK, RECENT = 2, 4


def _ranks(x: np.ndarray) -> np.ndarray:
    """0-based stable descending ranks along the last axis, NaN and -inf tied last (the loop
    form of window_union's rule)."""
    low = np.finfo(np.float32).min
    key = np.where(np.isnan(x) | (x == -np.inf), low, x)
    out = np.empty(x.shape, np.int64)
    for idx in np.ndindex(x.shape[:-1]):
        order = sorted(range(x.shape[-1]), key=lambda j, row=key[idx]: (-row[j], j))
        out[idx][order] = np.arange(x.shape[-1])
    return out


# --- the fusion itself ---------------------------------------------------------------------


def test_share_zero_is_the_primary_scores():
    gen = torch.Generator().manual_seed(0)
    primary = torch.randn(2, H_KV, 50, generator=gen, dtype=torch.float64)
    window = torch.randn(2, H_KV, 50, generator=gen)
    out = window_union(primary, window, 0.0)
    assert out.dtype == torch.float32 and torch.equal(out, primary.float())
    assert torch.equal(select_kept(out, 20, 2, 4), select_kept(primary, 20, 2, 4))


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    n=st.integers(1, 40),
    share=st.sampled_from([0.1, 0.25, 0.3, 0.5, 0.75, 0.9]),
)
def test_fused_score_is_one_minus_the_smaller_scaled_rank(data, n, share):
    """fused = 1 - min(r1, r2 (1 - s) / s) / n, ranks stable with ties to the lower index and
    NaN / -inf last; in (0, 1] with the best tokens of either at 1."""
    values = st.sampled_from([0.0, 1.0, 2.0, -1.0, 0.5, float("nan"), float("-inf"), 3.0])
    primary = data.draw(arrays(np.float32, (2, n), elements=values))
    window = data.draw(arrays(np.float32, (2, n), elements=values))
    got = window_union(torch.from_numpy(primary), torch.from_numpy(window), share).numpy()
    r1, r2 = _ranks(primary), _ranks(window)
    scaled = r2.astype(np.float32) * np.float32((1 - share) / share)
    want = 1 - np.minimum(r1.astype(np.float32), scaled) / np.float32(n)
    np.testing.assert_array_equal(got, want.astype(np.float32))
    assert (got > 0).all() and (got <= 1).all()
    assert (got[r1 == 0] == 1).all() and (got[r2 == 0] == 1).all()


@pytest.mark.parametrize("share", [0.25, 0.5, 0.8])
def test_top_k_of_the_fused_score_is_a_union_of_top_fractions(share):
    """For every threshold a, the top-|K| tokens by the fused score are exactly
    K = {r1 < a} | {r2 < a s / (1 - s)}: the primary's top fraction t and the window's c t."""
    gen = torch.Generator().manual_seed(1)
    n = 90
    primary, window = torch.randn(H_KV, n, generator=gen), torch.randn(H_KV, n, generator=gen)
    fused = window_union(primary, window, share)
    r1 = _ranks(primary.numpy())
    r2 = _ranks(window.numpy())
    for h in range(H_KV):
        for a in range(1, n + 1):
            union = (r1[h] < a) | (r2[h] * np.float32((1 - share) / share) < a)
            k = int(union.sum())
            kept = select_kept(fused[h : h + 1], k, 0, 0)[0].tolist()
            assert kept == np.nonzero(union)[0].tolist(), (h, a)


def test_a_token_only_the_window_ranks_first_is_kept():
    """A needle the question attends to but the primary scorer ranks last: kept under a share
    once the budget reaches the window's first tokens, never without it."""
    n = 200
    primary = torch.linspace(1.0, 0.0, n).repeat(H_KV, 1)  # token 150 near the bottom
    window = torch.zeros(H_KV, n)
    window[:, 150] = 5.0
    for share, kept_needle in ((0.0, False), (0.25, True), (0.5, True)):
        scores = window_union(primary, window, share)
        kept = select_kept(scores, 40, SINK, RECENT)
        assert bool((kept == 150).any(dim=-1).all()) is kept_needle, share


def test_protected_tokens_pads_and_nan():
    """Sinks and the recent window stay kept whatever their fused score; NaN tokens rank after
    every real one; a padded row (pads at the left, outside ``valid``) fuses as the unpadded
    one, pads below every real token."""
    gen = torch.Generator().manual_seed(2)
    n, pad = 30, 7
    primary = torch.randn(H_KV, n, generator=gen)
    window = torch.randn(H_KV, n, generator=gen)
    primary[:, :SINK] = -50.0
    window[:, :SINK] = -50.0  # last under both: kept anyway
    primary[0, 10] = float("nan")
    window[0, 10] = float("nan")
    fused = window_union(primary, window, 0.25)
    kept = select_kept(fused, 12, SINK, RECENT)
    for h in range(H_KV):
        assert set(range(SINK)) | set(range(n - RECENT, n)) <= set(kept[h].tolist())
    assert fused[0, 10] == fused[0].min()  # NaN under both: the last place
    padded = lambda x: torch.cat([torch.full((H_KV, pad), 9.0), x], dim=-1)  # noqa: E731
    valid = torch.arange(n + pad) >= pad
    fused_pad = window_union(padded(primary), padded(window), 0.25, valid.view(1, -1))
    assert torch.equal(fused_pad[:, pad:], fused)
    assert (fused_pad[:, :pad] <= 0).all() and (fused > 0).all()


@given(
    shape=st.sampled_from([(1, 5), (H_KV, 33), (2, H_KV, 17), (2, 2, 1, 8)]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
)
@settings(max_examples=20, deadline=None)
def test_shapes_and_dtypes(shape, dtype):
    gen = torch.Generator().manual_seed(3)
    primary = torch.randn(shape, generator=gen).to(dtype)
    window = torch.randn(shape, generator=gen).to(dtype)
    out = window_union(primary, window, 0.25)
    assert out.shape == primary.shape and out.dtype == torch.float32
    flat = window_union(primary.reshape(-1, shape[-1]), window.reshape(-1, shape[-1]), 0.25)
    assert torch.equal(out.reshape(-1, shape[-1]), flat)  # each head on its own
    with pytest.raises(KernelError, match="same shape"):
        window_union(primary, window[..., :-1], 0.25)


# --- HF side: the scorers' own calls --------------------------------------------------------


def _segment(n, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(GQA * H_KV, n, D, generator=gen)
    k = torch.randn(H_KV, n, D, generator=gen)
    v = torch.randn(H_KV, n, D, generator=gen)
    lse = torch.randn(GQA * H_KV, n, generator=gen).abs() + 3.0
    return q, k, v, lse


def _weights(seed=0):
    return np.random.default_rng(seed).normal(size=(2, H_KV, num_features(D) + 1)).tolist()


@pytest.mark.parametrize("lse", [True, False])
def test_the_scorers_fuse_their_scores_with_snapkvs_window(lse):
    """kvzip-lite's ``score`` and the gate's ``union_scores``: the scorer's own scores fused
    with SnapKV's (window 32, avg-pool 5, GQA mean) on the segment's last 32 queries."""
    n = 120
    q, k, v, lse_all = _segment(n, 4)
    lse_all = lse_all if lse else None
    lite = KVzipLiteScorer(max_queries=48, local_band=8)
    union = dataclasses.replace(lite, window_share=0.3)
    primary = lite.score(q, k, 0.25, lse_all)
    tail = None if lse_all is None else lse_all[:, -32:]
    window = WINDOW_SCORER.score(q[:, -32:], k, 0.25, tail)
    assert (WINDOW_SCORER.obs_window, WINDOW_SCORER.kernel_size) == (32, 5)
    assert torch.equal(union.score(q, k, 0.25, lse_all), window_union(primary, window, 0.3))
    gate = KVzipGateScorer(weights=_weights(), window_share=0.3)
    plain = KVzipGateScorer(weights=_weights())
    got = gate.union_scores(1, k, v, q, 0.25, lse_all)
    assert torch.equal(got, window_union(plain.token_scores(1, k, v), window, 0.3))
    assert torch.equal(plain.union_scores(1, k, v, q, 0.25), plain.token_scores(1, k, v))
    assert torch.equal(with_window(primary, 0.0, q, k, 0.25), primary)


# --- serving paths == HF side ---------------------------------------------------------------

# one layer's batch, each shape taking another path of the batch plan: several lengths in
# padded buckets (one bucket of every request in order; one bucket beside an empty request;
# two buckets, one far longer, beside a row kept whole), one run of equal lengths, a single
# long segment, two runs (one of segments under the window)
LENGTHS = {
    "in-order": [150, 90, 300, 210, 70, 400, 120, 260],
    "one-bucket": [70, 5, 130, 0, 64, 65, 300, 12, 129, 257, 40, 90],
    "buckets+whole": [600, 40, 50, 20, 700, 45, 33],
    "run": [100, 100, 100],
    "one": [300],
    "runs+short": [600, 600, 30, 30],
}


def _batch(lengths, seed):
    return extend_batch(lengths, seed, H_KV, GQA, D)


def _kept(lengths, seed):
    rng = np.random.default_rng(seed)
    kept = [[int(rng.integers(1, n + 1)) if n else 1 for _ in range(H_KV)] for n in lengths]
    if 20 in lengths:
        kept[lengths.index(20)] = [20] * H_KV  # a row every head keeps whole
    return kept


def _scorer(name, share):
    if name == "kvzip-lite":
        return KVzipLiteScorer(max_queries=24, local_band=4, window_share=share)
    return KVzipGateScorer(weights=_weights(1), window_share=share)


# the scoring kernels (TANGRAM_SCORE_KERNEL; kvzip-lite's query max and SnapKV's window, the
# Triton interpreter on CPU) on every shape but the second single bucket (the in-order one's path)
PATHS = [
    (s, kernel) for s in LENGTHS for kernel in (False, True) if not (kernel and s == "one-bucket")
]


@pytest.mark.parametrize(("shape", "kernel"), PATHS, ids=[f"{s}-{k}" for s, k in PATHS])
@pytest.mark.parametrize("name", ["kvzip-lite", "kvzip-gate"])
def test_served_selection_equals_the_hf_side_under_a_share(name, shape, kernel):
    """``batch_kept_indices`` (the attention backend's call) keeps the tokens of
    ``reference_kept_indices`` (each segment scored by the scorer's own HF-side call, then
    ``select_kept``) with ``window_share`` 0.25; the share changes the selection; the plan
    took the path the shape is for."""
    lengths = LENGTHS[shape]
    q, k, v, lse, bounds = _batch(lengths, len(shape))
    kept = _kept(lengths, len(shape))
    extra = {"v_new": v, "layer_id": 1} if name == "kvzip-gate" else {}
    scorer = _scorer(name, 0.25)
    compress._PLANS.clear()
    want = reference_kept_indices(scorer, q, k, lse, bounds, kept, 0.3, SINK, RECENT, **extra)
    args = (q, k, lse, bounds, kept, 0.3, SINK, RECENT)
    got = batch_kept_indices(scorer, *args, window_kernel=kernel, **extra)
    assert torch.equal(got, want)
    plans = list(compress._PLANS.values())
    buckets = [b for p in plans for b in p.buckets]
    bucketed = shape in ("in-order", "one-bucket", "buckets+whole")
    bucketed = bucketed or (kernel and name == "kvzip-lite")
    assert bool(buckets) == bucketed and all(bool(p.runs) != bucketed for p in plans)
    if shape == "buckets+whole":
        assert len(buckets) == 2 and not plans[0].in_order
    if shape == "in-order":
        assert len(buckets) == 1 and plans[0].in_order
    if name == "kvzip-lite":
        assert all(b.window_bucket is not None for b in buckets)
    off = batch_kept_indices(_scorer(name, 0.0), *args, window_kernel=kernel, **extra)
    assert not torch.equal(got, off)


@pytest.mark.parametrize("name", ["kvzip-lite", "kvzip-gate"])
def test_share_zero_serves_exactly_as_before_without_the_fusion(name, monkeypatch):
    """``window_share`` 0 never reaches the fusion, on any path nor in kvzip-lite's own
    ``score``: the served selection is the code of before. (That it equals each request's
    ``select_kept`` at share 0 is the older oracle tests' part: test_kvzip_lite.py,
    test_kvzip_gate.py.)"""

    def boom(*args, **kwargs):
        raise AssertionError("window_union called with window_share 0")

    monkeypatch.setattr(compress, "window_union", boom)
    monkeypatch.setattr(snapkv, "window_union", boom)
    for shape, lengths in LENGTHS.items():
        q, k, v, lse, bounds = _batch(lengths, 5)
        kept = _kept(lengths, 5)
        extra = {"v_new": v, "layer_id": 0} if name == "kvzip-gate" else {}
        args = (q, k, lse, bounds, kept, 0.3, SINK, RECENT)
        base = KVzipLiteScorer(max_queries=24, local_band=4)
        if name == "kvzip-gate":
            base = KVzipGateScorer(weights=_weights(1))
        for kernel in (False, True) if shape in ("one", "run", "runs+short") else (False,):
            got = batch_kept_indices(_scorer(name, 0.0), *args, window_kernel=kernel, **extra)
            want = batch_kept_indices(base, *args, window_kernel=kernel, **extra)
            assert torch.equal(got, want), (shape, kernel)


def test_the_plan_cache_tells_shares_apart():
    """The same batch under kvzip-lite with and without a share, the cache kept between them:
    each keeps its own tokens (a plan without the window's slots must not serve the union)."""
    lengths = LENGTHS["one-bucket"]
    q, _, _, lse, bounds = _batch(lengths, 6)
    k = _batch(lengths, 7)[1]
    kept = _kept(lengths, 6)
    compress._PLANS.clear()
    for _ in range(2):
        for share in (0.0, 0.25, 0.0):
            scorer = _scorer("kvzip-lite", share)
            want = reference_kept_indices(scorer, q, k, lse, bounds, kept, 0.3, SINK, RECENT)
            got = batch_kept_indices(scorer, q, k, lse, bounds, kept, 0.3, SINK, RECENT)
            assert torch.equal(got, want), share


# --- the option's validation ----------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [-0.1, 0.995, 1.0, 1.5, 1e-300, 1e-40, 9e-4, math.nan, math.inf, "0.25", True, None, [0.2]],
)
@pytest.mark.parametrize("name", ["kvzip-lite", "kvzip-gate"])
def test_a_bad_share_is_refused_naming_the_field_and_the_fix(name, bad):
    with pytest.raises(
        ConfigError, match=r"window_share=.* must be 0 \(off\) or a number in \[0.001, 0.99\]"
    ) as err:
        get_scorer(name, window_share=bad)
    assert "provenance.scorer_options.window_share" in str(err.value)


def test_good_shares_and_the_window_kvzip_lite_needs():
    for share in (0, 0.0, 1e-3, 0.25, 0.99, np.float32(0.25)):
        assert get_scorer("kvzip-lite", window_share=share).window_share == share
        assert get_scorer("kvzip-gate", window_share=share).window_share == share
    with pytest.raises(ConfigError, match="obs_window=16 hands fewer; raise obs_window to >= 32"):
        get_scorer("kvzip-lite", obs_window=16, window_share=0.25)
    assert get_scorer("kvzip-lite", obs_window=16).window_share == 0.0  # off: any window


@pytest.mark.parametrize(
    ("path", "scorer"),
    [
        ("calibration/qwen2.5-0.5b/kvzip-lite-r0.5.json", KVzipLiteScorer),
        ("calibration/qwen2.5-0.5b/kvzip-gate-r0.5.json", KVzipGateScorer),
    ],
)
def test_the_profile_option_reaches_the_server_and_the_twins(path, scorer):
    """``provenance.scorer_options.window_share`` builds the scorer with it (server start-up
    and the eval harness's HF twins both call ``build_scorer``); a bad value is a ConfigError
    naming the field, not a traceback from deep inside; shipped profiles leave it off."""
    from tangram_sglang.backend.state import build_scorer
    from tangram_sglang.profile import BudgetProfile

    shipped = BudgetProfile.load(path)
    assert build_scorer(shipped).window_share == 0.0
    options = {**shipped.provenance["scorer_options"], "window_share": 0.25}
    profile = dataclasses.replace(
        shipped, provenance={**shipped.provenance, "scorer_options": options}
    )
    built = build_scorer(profile)
    assert isinstance(built, scorer) and built.window_share == 0.25
    options["window_share"] = 1.25
    with pytest.raises(
        ConfigError, match=r"window_share=1.25 must be 0 \(off\) or a number in \[0.001, 0.99\]"
    ):
        build_scorer(profile)


def test_the_per_request_allocations_refuse_a_share():
    """The per-request splits compare scores across heads; fused ranks are per head, so an
    observed-score system with a share and a split is refused; static budgets take it."""
    from tangram_sglang.eval.systems import KvpressRunner, ObservedScorePress
    from tangram_sglang.profile import BudgetProfile

    shipped = BudgetProfile.load("calibration/qwen2.5-0.5b/kvzip-gate-r0.5.json")
    options = {**shipped.provenance["scorer_options"], "window_share": 0.25}
    profile = dataclasses.replace(
        shipped, provenance={**shipped.provenance, "scorer_options": options}
    )
    press = KvpressRunner.make_press("kvzip-gate-budgets", 0.5, profile)
    assert isinstance(press, ObservedScorePress) and press.scorer.window_share == 0.25
    assert press.allocation == "static"
    with pytest.raises(ConfigError, match="allocation='group' splits the budget"):
        ObservedScorePress(press.scorer, profile, "group")


def test_the_eval_cli_refuses_a_split_on_a_share_before_any_model_loads(smollm2_path, tmp_path):
    """``--systems kvzip-lite-head-alloc`` with a ``--profile-dir`` whose kvzip-lite profile has
    a share: refused while the profiles are read, naming the systems and the fix; the
    static-budget twin and KVzip's own splits (which read only the budgets) pass."""
    import json
    import shutil

    from tangram_sglang.eval.cli import _check_profile_models

    folder = tmp_path / "smollm2"
    shutil.copytree("calibration/smollm2", folder)
    path = folder / "kvzip-lite-r0.5.json"
    data = json.loads(path.read_text())
    data["provenance"]["scorer_options"]["window_share"] = 0.25
    path.write_text(json.dumps(data))
    check = lambda systems: _check_profile_models(  # noqa: E731
        folder, systems, (0.5,), smollm2_path, "smollm2"
    )
    with pytest.raises(ConfigError, match=r"--systems kvzip-lite-head-alloc: .*\(\*-budgets\)"):
        check(("full", "kvzip-lite-head-alloc"))
    check(("kvzip-lite-budgets", "kvzip-head-alloc", "tangram-kvzip-lite"))


def test_calibrations_observer_runs_the_union_on_the_hf_model(smollm2_path):
    """``calibrate.observe.ScoreObserver`` (calibration and the eval harness's twins) on
    SmolLM2: with a share, each layer's scores are the scorer's own fused with the window's
    SnapKV scores of the same forward (the gate through ``union_scores``, kvzip-lite through
    ``score``)."""
    from transformers import AutoModelForCausalLM

    from tangram_sglang.calibrate.observe import ScoreObserver

    model = AutoModelForCausalLM.from_pretrained(
        smollm2_path, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    cfg = model.config
    dim = cfg.hidden_size // cfg.num_attention_heads
    shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, num_features(dim) + 1)
    weights = (np.random.default_rng(0).normal(size=shape) * 0.1).tolist()
    ids = torch.randint(0, cfg.vocab_size, (90,), generator=torch.Generator().manual_seed(0))
    ids = ids.tolist()
    window = ScoreObserver(model, WINDOW_SCORER).scores(ids)
    for plain in (KVzipLiteScorer(max_queries=32), KVzipGateScorer(weights=weights)):
        union = dataclasses.replace(plain, window_share=0.25)
        want = window_union(
            torch.from_numpy(ScoreObserver(model, plain).scores(ids)),
            torch.from_numpy(window),
            0.25,
        )
        got = torch.from_numpy(ScoreObserver(model, union).scores(ids))
        assert torch.equal(got, want), plain.name


@pytest.mark.parametrize("share", [0.25, 0, "0.25"])
def test_a_share_on_a_scorer_without_it_is_refused(share):
    """A profile of another scorer (here Ada-SnapKV) with ``window_share`` would otherwise
    build and serve without the option, silently."""
    from tangram_sglang.backend.state import build_scorer
    from tangram_sglang.profile import BudgetProfile

    shipped = BudgetProfile.load("calibration/qwen2.5-0.5b/ada-snapkv-r0.5.json")
    options = {**(shipped.provenance.get("scorer_options") or {}), "window_share": share}
    profile = dataclasses.replace(
        shipped, provenance={**shipped.provenance, "scorer_options": options}
    )
    with pytest.raises(ConfigError, match="window_share is an option of the kvzip-gate and kvzip-"):
        build_scorer(profile)
