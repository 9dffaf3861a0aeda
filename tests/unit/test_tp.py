"""Tensor parallelism: per-rank head groups, shared budgets, identical pages on every rank.

Several TP ranks are simulated in one process: each gets its own rank profile
(``TensorParallelLayout.rank_profile``) and its own ``TangramMemory``; the ranks are driven
through the same request sequence, as SGLang's TP schedulers are, and must agree on every
footprint, every page id and every free count.
"""

from __future__ import annotations

import numpy as np
import pytest
from factories import random_profile
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram_sglang.errors import ConfigError
from tangram_sglang.grouping import HeadGrouping
from tangram_sglang.mem.manager import TangramMemory
from tangram_sglang.mem.reservation import RequestTooLargeError
from tangram_sglang.profile import BudgetProfile, CalibrationStats, ModelIdentity, kept_len
from tangram_sglang.tp import (
    TensorParallelLayout,
    check_tensor_parallel,
    kv_head_range,
    rank_profile,
)

PAGE = 4  # tokens per page in the simulated pools


def _model(layers: int, kv_heads: int, gqa: int = 2) -> ModelIdentity:
    return ModelIdentity("LlamaForCausalLM", layers, kv_heads, kv_heads * gqa, 8, "fp")


def _profile(layers, kv_heads, heads_per_group, scope, seed, gqa=2) -> BudgetProfile:
    rng = np.random.default_rng(seed)
    ratio = rng.uniform(0.05, 1.0, (layers, kv_heads))
    stats = CalibrationStats(ratio * 0.5, ratio * 0.1, 2.0, 50)
    return BudgetProfile(
        model=_model(layers, kv_heads, gqa),
        scorer="ada-snapkv",
        target_ratio=0.25,
        ratio=ratio,
        sink_tokens=2,
        recent_window=3,
        grouping=HeadGrouping.build(ratio, 1, "global"),
        stats=stats,
        min_compress_tokens=int(rng.integers(0, 8)),
    ).with_grouping(heads_per_group, scope)


@st.composite
def tp_cases(draw):
    """(profile, N): N divides K, H_p fits a rank's heads (scope per_layer or global)."""
    layers = draw(st.integers(1, 3))
    per_rank = draw(st.integers(1, 4))
    tp_size = draw(st.integers(1, 4))
    scope = draw(st.sampled_from(["per_layer", "global"]))
    if scope == "per_layer":
        h_p = draw(st.sampled_from([d for d in range(1, per_rank + 1) if per_rank % d == 0]))
    else:
        h_p = draw(st.integers(1, min(layers * per_rank, 5)))
    seed = draw(st.integers(0, 2**16))
    gqa = draw(st.integers(1, 3))
    return _profile(layers, per_rank * tp_size, h_p, scope, seed, gqa), tp_size


@given(st.integers(1, 8), st.integers(1, 8))
def test_kv_head_ranges_tile_the_heads_in_rank_order(per_rank, tp_size):
    k = per_rank * tp_size
    ranges = [kv_head_range(k, tp_size, r) for r in range(tp_size)]
    assert ranges[0][0] == 0 and ranges[-1][1] == k
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    assert all(hi - lo == per_rank for lo, hi in ranges)


@settings(max_examples=60, deadline=None)
@given(tp_cases())
def test_groups_stay_inside_ranks_and_share_budgets(case):
    profile, n = case
    layout = TensorParallelLayout.build(profile, n)
    per_rank = profile.model.num_kv_heads // n
    g = layout.num_head_groups
    for r, grouping in enumerate(layout.groupings):
        grouping.validate(profile.model.num_layers, per_rank)  # a bijection over local heads
        assert grouping.num_head_groups == g  # same G on every rank
        assert (grouping.heads_per_group, grouping.scope) == (
            profile.grouping.heads_per_group,
            profile.grouping.scope,
        )
        lo, hi = kv_head_range(profile.model.num_kv_heads, n, r)
        own = grouping.group_ratios(profile.ratio[:, lo:hi])
        np.testing.assert_array_equal(own, layout.own_group_ratios[r])
    # A model-wide id names one rank: every member head of a group is on that rank.
    model_cluster = layout.model_cluster_of()
    head_rank = np.arange(profile.model.num_kv_heads) // per_rank
    rank_of = layout.rank_of_group()[model_cluster]
    assert (rank_of == head_rank[None, :]).all()
    np.testing.assert_array_equal(layout.shared_group_ratios, layout.own_group_ratios.max(axis=0))
    assert layout.budget_overhead >= 0.0
    # Per-layer scope: a rank's groups never span layers either.
    if profile.grouping.scope == "per_layer":
        per_layer = per_rank // profile.grouping.heads_per_group
        for grouping in layout.groupings:
            layer_of = grouping.cluster_of // per_layer
            assert (layer_of == np.arange(profile.model.num_layers)[:, None]).all()


@settings(max_examples=60, deadline=None)
@given(tp_cases(), st.lists(st.integers(0, 200), min_size=1, max_size=6))
def test_rank_profiles_keep_the_same_tokens_per_group_on_every_rank(case, lengths):
    profile, n = case
    layout = TensorParallelLayout.build(profile, n)
    ranks = [layout.rank_profile(profile, r) for r in range(n)]
    m = profile.model
    for r, rp in enumerate(ranks):
        assert rp.model.num_kv_heads * n == m.num_kv_heads
        assert rp.model.num_qo_heads * n == m.num_qo_heads
        assert rp.model.num_qo_heads // rp.model.num_kv_heads == m.num_qo_heads // m.num_kv_heads
        assert (rp.model.head_dim, rp.model.num_layers) == (m.head_dim, m.num_layers)
        assert rp.provenance["tensor_parallel"]["tp_rank"] == r
        np.testing.assert_array_equal(rp.group_ratios, layout.shared_group_ratios)
        lo, hi = kv_head_range(m.num_kv_heads, n, r)
        np.testing.assert_array_equal(rp.stats.mean, profile.stats.mean[:, lo:hi])
        assert (rp.ratio >= profile.ratio[:, lo:hi]).all()  # a head never keeps less
    for length in lengths:
        kept = [rp.group_kept_array(length) for rp in ranks]
        for other in kept[1:]:
            np.testing.assert_array_equal(other, kept[0])
        # Each head keeps at least what its own ratio asks (kept_len is monotone in the ratio).
        for r, rp in enumerate(ranks):
            lo, hi = kv_head_range(m.num_kv_heads, n, r)
            own = profile.ratio[:, lo:hi]
            cluster = rp.grouping.cluster_of
            for (layer, head), ratio in np.ndenumerate(own):
                floor = kept_len(
                    length, ratio, rp.sink_tokens, rp.recent_window, rp.min_compress_tokens
                )
                assert kept[r][cluster[layer, head]] >= floor


def _memories(profile, n, num_pages=160, rows=4, width_tokens=512):
    layout = TensorParallelLayout.build(profile, n)
    return [
        TangramMemory(layout.rank_profile(profile, r), PAGE, num_pages, rows, width_tokens // PAGE)
        for r in range(n)
    ]


def _assert_same(memories):
    first = memories[0]
    for mem in memories[1:]:
        np.testing.assert_array_equal(mem.table.pages, first.table.pages)
        np.testing.assert_array_equal(mem.table.lens, first.table.lens)
        assert mem.allocator.num_free() == first.allocator.num_free()
        assert mem.ledger.unreserved_free() == first.ledger.unreserved_free()


@settings(max_examples=30, deadline=None)
@given(
    tp_cases(),
    st.lists(
        st.tuples(st.integers(1, 90), st.integers(0, 12), st.integers(0, 3)),
        min_size=1,
        max_size=5,
    ),
)
def test_every_rank_allocates_the_same_pages(case, requests):
    """The ranks' pools, driven alike, agree on footprints, page ids and free counts."""
    profile, n = case
    memories = _memories(profile, n)
    for row, (prompt, decode_steps, finish_after) in enumerate(requests[:4]):
        feet = {mem.footprint(prompt, decode_steps + 1) for mem in memories}
        assert len(feet) == 1  # the footprint admission computes is one number on every rank
        outcomes = set()
        for mem in memories:
            try:
                outcomes.add(mem.admit(row, f"r{row}", prompt, decode_steps + 1) is not None)
            except RequestTooLargeError:
                outcomes.add("never fits")
        assert len(outcomes) == 1  # every rank admits, defers or refuses alike
        if outcomes.pop() is not True:
            continue
        plans = [mem.alloc_extend(row, prompt) for mem in memories]
        for plan in plans[1:]:
            np.testing.assert_array_equal(plan.kept_len, plans[0].kept_len)
        for mem in memories:
            mem.commit_extend(row)
        _assert_same(memories)
        for _ in range(decode_steps):
            ok = {mem.can_decode([row]) for mem in memories}
            assert len(ok) == 1
            if not ok.pop():
                break
            for mem in memories:
                mem.alloc_decode([row])
            _assert_same(memories)
        if finish_after == 0:
            for mem in memories:
                for seg in mem.finish(row):
                    mem.free_pages(np.concatenate(seg.pages))
            _assert_same(memories)


def test_ratio_one_profile_keeps_everything_on_every_rank():
    ratio = np.ones((2, 4))
    profile = BudgetProfile(
        model=_model(2, 4),
        scorer="snapkv",
        target_ratio=1.0,
        ratio=ratio,
        sink_tokens=0,
        recent_window=0,
        grouping=HeadGrouping.build(ratio, 2, "per_layer"),
    )
    layout = TensorParallelLayout.build(profile, 2)
    assert layout.budget_overhead == 0.0 and layout.padded_kept_fraction() == 1.0
    for r in range(2):
        rp = layout.rank_profile(profile, r)
        assert rp.group_kept_lens(37) == [37] * rp.grouping.num_head_groups


def test_shipped_profiles_split_over_their_tp_sizes():
    """SmolLM2 (3 KV heads) at TP=3 and the Llama-3.1-8B shape (8 KV heads) at TP=2."""
    from tangram_sglang.integration.profile_loader import CALIBRATION_DIR

    smol = BudgetProfile.load(CALIBRATION_DIR / "smollm2" / "ada-snapkv-r0.25.json")
    layout = TensorParallelLayout.build(smol, 3)
    assert layout.heads_per_rank == 1 and layout.num_head_groups == 8  # ceil(30 / 4)
    llama = BudgetProfile.load(CALIBRATION_DIR / "synthetic" / "llama3.1-8b-ada-snapkv-r0.25.json")
    layout = TensorParallelLayout.build(llama, 2)
    assert layout.heads_per_rank == 4 and layout.num_head_groups == 32
    summary = layout.summary()
    assert summary["tp_size"] == 2 and 0 <= summary["tp_budget_overhead"] < 0.05
    assert summary["predicted_capacity_vs_full_kv"] > 2.0  # still ~0.3 kept per rank


def test_tp_one_is_the_profile_itself():
    profile = random_profile(_model(2, 4), heads_per_group=3)
    assert rank_profile(profile, 1, 0) is profile
    with pytest.raises(ConfigError, match="TP rank 1 is outside"):
        rank_profile(profile, 1, 1)


@pytest.mark.parametrize(
    ("kv_heads", "qo_heads", "h_p", "scope", "tp", "needle"),
    [
        (3, 9, 1, "global", 2, "does not divide the model's 3 KV heads and 9 query heads"),
        (2, 14, 1, "global", 4, r"Use --tp-size in \[1, 2\]"),
        (4, 6, 1, "global", 4, "does not divide"),  # KV heads divide, query heads do not
        (8, 32, 8, "per_layer", 2, "a head group of 8 KV heads would span TP ranks"),
        (8, 32, 4, "per_layer", 4, r"--tangram-page-group-size in \[1, 2\]"),
        (12, 24, 4, "per_layer", 2, "4 does not divide the 6 KV heads each TP rank holds"),
        (4, 8, 5, "global", 2, r"--tangram-page-group-size <= 4"),
        (4, 8, 1, "global", 0, "--tp-size 0 must be >= 1"),
    ],
)
def test_start_up_checks_name_the_flag_and_the_fix(kv_heads, qo_heads, h_p, scope, tp, needle):
    model = ModelIdentity("LlamaForCausalLM", 2, kv_heads, qo_heads, 8)
    with pytest.raises(ConfigError, match=needle) as info:
        check_tensor_parallel(model, h_p, scope, tp)
    assert "--tp-size" in str(info.value)


def test_layout_build_runs_the_checks():
    profile = random_profile(_model(2, 4), heads_per_group=4).with_grouping(4, "per_layer")
    with pytest.raises(ConfigError, match="would span TP ranks"):
        TensorParallelLayout.build(profile, 2)
    with pytest.raises(ConfigError, match="does not divide the model's 4 KV heads"):
        TensorParallelLayout.build(profile, 3)


def test_start_up_line_says_what_each_rank_holds():
    from tangram_sglang.config import TangramConfig
    from tangram_sglang.integration.profile_loader import profile_summary, summary_line

    profile = random_profile(_model(4, 8), heads_per_group=2)
    summary = profile_summary(profile, TangramConfig(enabled=True))
    assert "TP" not in summary_line(summary)
    summary |= TensorParallelLayout.build(profile, 2).summary()
    line = summary_line(summary)
    assert "TP 2: per rank 4 KV heads per layer in 8 head groups of 2 (global)" in line


def test_a_kvzip_gate_profile_gives_each_rank_the_gates_of_its_kv_heads():
    """Each rank's profile carries its own KV heads' gate weights, so the scorer each rank
    builds fits the rank's model (``K/N`` KV heads) and scores its heads with their own gates."""
    from tangram_sglang.backend.state import build_scorer
    from tangram_sglang.integration.profile_loader import CALIBRATION_DIR

    smol = BudgetProfile.load(CALIBRATION_DIR / "smollm2" / "kvzip-gate-r0.25.json")
    weights = np.asarray(smol.provenance["scorer_options"]["weights"])
    assert weights.shape == (30, 3, 97)
    layout = TensorParallelLayout.build(smol, 3)
    for rank in range(3):
        part = layout.rank_profile(smol, rank)
        scorer = build_scorer(part)
        assert scorer.shape == (30, 1, 64)
        mine = np.asarray(part.provenance["scorer_options"]["weights"])
        np.testing.assert_array_equal(mine, weights[:, rank : rank + 1])
    assert np.asarray(smol.provenance["scorer_options"]["weights"]).shape == (30, 3, 97)
