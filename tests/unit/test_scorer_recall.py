"""``eval.scorer_recall``: the recall measure and kvpress's KVzip scores (the oracle).

Runs the embedded SmolLM2 (transformers, CPU) on a short context: no server.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tangram_sglang.errors import ConfigError
from tangram_sglang.eval.scorer_recall import (
    _allocation_shares,
    answer_positions,
    kept_share,
    kept_share_budgets,
    kept_share_global,
    kvzip_scores,
    profile_budgets,
    shipped_profile,
    topk_recall,
)


def test_recall_is_one_for_the_oracle_and_about_keep_for_a_random_ranking():
    rng = np.random.default_rng(0)
    oracle = rng.random((8, 4, 400))
    assert topk_recall(oracle, oracle, 0.25) == 1.0
    assert topk_recall(oracle, -oracle, 0.25) == 0.0  # the oracle's bottom: no overlap
    chance = topk_recall(oracle, rng.random(oracle.shape), 0.25)
    assert 0.2 < chance < 0.3


def test_recall_refuses_mismatched_shapes_and_bad_fractions():
    with pytest.raises(ConfigError, match="one shape"):
        topk_recall(np.zeros((2, 5)), np.zeros((2, 4)), 0.5)
    for keep in (0.0, 1.5, float("nan")):
        with pytest.raises(ConfigError, match="keep="):
            topk_recall(np.zeros(5), np.zeros(5), keep)


def test_kept_share_counts_the_heads_whose_top_k_holds_each_position():
    scores = np.array([[5.0, 4.0, 1.0, 0.0], [0.0, 1.0, 4.0, 5.0]])  # two heads, k = 2
    assert kept_share(scores, [0], 0.5) == 0.5  # head 0 keeps token 0, head 1 does not
    assert kept_share(scores, [0, 3], 0.5) == 0.5
    assert kept_share(scores, [1, 2], 1.0) == 1.0
    assert np.isnan(kept_share(scores, [], 0.5))


def test_budgets_keep_sinks_and_window_then_each_heads_own_top_scores():
    scores = np.array([[[9.0, 1.0, 8.0, 2.0, 7.0, 0.0]], [[0.0, 9.0, 1.0, 8.0, 2.0, 0.5]]])
    budgets = np.array([[3], [4]])  # [L=2, H=1]; sink 1, window 1
    # layer 0 keeps 0 (sink), 5 (window), then its best middle token 2; layer 1 keeps 0, 5, 1, 3
    assert kept_share_budgets(scores, [2], budgets, 1, 1) == 0.5
    assert kept_share_budgets(scores, [0, 5], budgets, 1, 1) == 1.0
    assert kept_share_budgets(scores, [3], budgets, 1, 1) == 0.5
    assert kept_share_budgets(scores, [4], budgets, 1, 1) == 0.0
    assert np.isnan(kept_share_budgets(scores, [], budgets, 1, 1))


def test_budgets_keep_exactly_what_select_kept_keeps_row_by_row():
    from tangram_sglang.scoring.select import select_kept

    rng = np.random.default_rng(7)
    for _ in range(400):
        m = int(rng.integers(1, 12))
        heads = int(rng.integers(1, 4))
        scores = rng.integers(0, 3, size=(2, heads, m)).astype(np.float32)  # many ties
        scores[rng.random(scores.shape) < 0.15] = np.nan
        scores[rng.random(scores.shape) < 0.05] = -np.inf
        sink, window = int(rng.integers(0, 5)), int(rng.integers(0, 5))
        budgets = rng.integers(1, m + 1, size=(2, heads))
        for layer in range(2):
            for head in range(heads):
                k = int(budgets[layer, head])
                row = scores[layer, head]
                want = set(select_kept(torch.from_numpy(row), k, sink, window).tolist())
                one = np.zeros_like(budgets)
                one[layer, head] = k  # only this row keeps anything
                for pos in range(m):
                    share = kept_share_budgets(scores, [pos], one, sink, window)
                    got = share * scores[..., 0].size  # this row's 0/1 "kept"
                    assert round(got) == (pos in want), (row, k, sink, window, pos)
    # float32, as select_kept compares: 1 + 1e-9 ties with 1, so the lower index wins
    close = np.array([[[1.0, 1.0 + 1e-9]]])
    assert kept_share_budgets(close, [0], np.array([[1]]), 0, 0) == 1.0


def test_budgets_must_match_the_scores_heads_and_fit_the_segment():
    scores = np.zeros((2, 3, 5))
    with pytest.raises(ConfigError, match=r"budgets \(3, 2\) must have scores' leading shape"):
        kept_share_budgets(scores, [0], np.ones((3, 2), int), 0, 0)
    with pytest.raises(ConfigError, match=r"budgets \(6,\)"):
        kept_share_budgets(scores, [0], np.ones(6, int), 0, 0)
    for bad in (-1, 6):
        budgets = np.ones((2, 3), int)
        budgets[1, 2] = bad
        with pytest.raises(ConfigError, match=r"budgets must be kept lengths in \[0, m=5\]"):
            kept_share_budgets(scores, [0], budgets, 0, 0)
    assert kept_share_budgets(scores, [0], np.full((2, 3), 5), 0, 0) == 1.0
    assert kept_share_budgets(scores, [0], np.zeros((2, 3), int), 0, 0) == 0.0


def test_a_global_total_must_be_in_one_to_the_number_of_pairs():
    scores = np.zeros((2, 3, 5))
    for bad in (0, -1, 31):
        with pytest.raises(ConfigError, match=rf"total={bad} must be in \[1, scores.size=30\]"):
            kept_share_global(scores, [0], bad)
    assert kept_share_global(scores, [0, 1, 2, 3, 4], 30) == 1.0


def test_a_global_allocation_spends_the_total_on_the_requests_top_scores():
    scores = np.array([[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 30.0, 40.0]])  # head 1 scores higher
    # a total of 4 goes to head 1 only: position 0 is kept by one head of two
    assert kept_share_global(scores, [0], 4) == 0.5
    assert kept_share_global(scores, [3], 4) == 0.5
    assert kept_share(scores, [3], 0.5) == 1.0  # uniform: both heads keep their best 2
    assert kept_share_global(scores, [0, 1, 2, 3], 8) == 1.0


def test_profile_budgets_follow_the_shipped_profile_groups(smollm2_path):
    from transformers import AutoConfig

    from tangram_sglang.profile import kept_len

    config = AutoConfig.from_pretrained(smollm2_path)
    profile = shipped_profile(config, "kvzip-lite", 0.25)
    assert profile is not None and profile.target_ratio == 0.25
    assert shipped_profile(config, "kvzip-lite", 0.3) is None  # no profile at that target
    budgets = profile_budgets(profile, 1000)
    assert budgets.shape == profile.ratio.shape
    layer, head = 3, 1
    ratio = profile.group_ratios[profile.grouping.cluster_of[layer, head]]
    expect = kept_len(1000, float(ratio), profile.sink_tokens, profile.recent_window)
    assert budgets[layer, head] == expect
    assert (budgets >= profile.sink_tokens + profile.recent_window).all()
    for m in (0, 1, 7, 300, 1000, 2048):  # every head: its group's kept length, the server's
        groups = profile.group_kept_array(m)
        budgets = profile_budgets(profile, m)
        assert budgets.dtype == np.int64 and budgets.shape == profile.ratio.shape
        for (layer, head), kept in np.ndenumerate(budgets):
            assert kept == groups[profile.grouping.cluster_of[layer, head]]
            assert kept == kept_len(
                m,
                float(profile.group_ratios[profile.grouping.cluster_of[layer, head]]),
                profile.sink_tokens,
                profile.recent_window,
            )


def test_allocation_shares_under_the_shipped_profile(smollm2_path):
    from transformers import AutoConfig

    from tangram_sglang.profile import kept_len

    profile = shipped_profile(AutoConfig.from_pretrained(smollm2_path), "kvzip-lite", 0.25)
    assert profile is not None
    layers, heads = profile.ratio.shape
    m, pairs = 600, profile.ratio.size * 600
    budgets = profile_budgets(profile, m)
    total = int(budgets.sum())
    rng = np.random.default_rng(3)
    flat = rng.permutation(pairs).astype(np.float32)  # distinct scores, exact in float32
    # the answer's first pair (layer 0, KV head 0, token 200) holds the total-th largest score
    cut = int(np.argsort(-flat)[total - 1])
    flat[[cut, 200]] = flat[[200, cut]]
    scores = flat.reshape(layers, heads, m)
    later = list(range(200, 230))
    shares = _allocation_shares(profile, scores, later, 0.25)
    keys = {"uniform", "global", "profile", "profile_global", "profile_kept_fraction"}
    assert set(shares) == keys
    ratios = profile.group_ratios[profile.grouping.cluster_of]
    sink, window = profile.sink_tokens, profile.recent_window
    expect = sum(kept_len(m, float(r), sink, window) for r in ratios.flat) / pairs
    assert shares["profile_kept_fraction"] == pytest.approx(expect, rel=1e-12)
    assert shares["profile_kept_fraction"] > 0.25  # sinks and window on top of the ratios
    # profile_global spends exactly the profile's total: one pair fewer drops the answer's pair
    one_pair = 1 / (layers * heads * len(later))
    assert shares["profile_global"] == kept_share_global(scores, later, total + 1)
    assert shares["profile_global"] - kept_share_global(scores, later, total - 1) == (
        pytest.approx(one_pair)
    )
    assert shares["profile"] == kept_share_budgets(scores, later, budgets, sink, window)
    # random scores: each allocation keeps the answer at about its kept fraction
    assert abs(shares["profile"] - shares["profile_kept_fraction"]) < 0.1
    assert abs(shares["profile_global"] - shares["profile_kept_fraction"]) < 0.1
    assert abs(shares["uniform"] - 0.25) < 0.1 and abs(shares["global"] - 0.25) < 0.1
    assert shares["uniform"] == kept_share(scores, later, 0.25)
    assert set(_allocation_shares(None, scores, later, 0.25)) == {"uniform", "global"}


def test_answer_positions_find_the_answer_tokens(smollm2):
    _, tok = smollm2
    ids = tok("The capital of Italy is Rome, and Paris is in France.")["input_ids"]
    found = answer_positions(tok, ids, ("Lisbon", "Paris"))  # the first answer found counts
    assert tok.decode([ids[i] for i in found]).strip() == "Paris"
    assert answer_positions(tok, ids, ("Lisbon",)) == []


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    return model, tok


def test_kvzip_scores_cover_the_context_after_the_template_head(smollm2):
    model, tok = smollm2
    text = "The river flows north past the old mill. " * 12
    chat = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False)
    ids = tok(chat, add_special_tokens=False)["input_ids"]
    scores, head = kvzip_scores(model, ids)
    cfg = model.config
    assert scores.shape == (cfg.num_hidden_layers, cfg.num_key_value_heads, len(ids))
    assert 0 < head < len(ids)
    assert np.all(scores[..., head:] > 0) and np.all(scores[..., head:] <= 1)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--keep", "0"], "--keep '0': 0.0 must be in (0, 1] (a kept fraction)"),
        (["--keep", "0.25,1.5"], "--keep '0.25,1.5': 1.5 must be in (0, 1]"),
        (["--keep", "0.25,,0.5"], "--keep '0.25,,0.5': item 2 is empty"),
        (["--keep", "0.25,"], "--keep '0.25,': item 2 is empty"),
        (["--scorers", "snapkv,,kvzip-lite"], "--scorers 'snapkv,,kvzip-lite': item 2 is empty"),
        (["--lengths", "1024,,2048"], "--lengths '1024,,2048': item 2 is empty"),
        (["--keep", "abc"], "--keep 'abc'"),
        (["--num-samples", "0"], "--num-samples must be >= 1"),
        (["--lengths", "10"], "--lengths must be token counts > 64"),
        (["--lengths", "1024.5"], "--lengths '1024.5': give comma-separated integers"),
        (["--scorers", "nope"], "--scorers 'nope': scorer 'nope' is not registered; registered:"),
        (["--output", "/nonexistent/recall.json"], "folder /nonexistent does not exist"),
        (["--model-path", "nosuch"], "unknown embedded model 'nosuch'"),
        (["--output", "/tmp"], "--output /tmp is a folder"),
        (["--scorers", ","], "name at least one"),
        (["--keep", ",,"], "--keep ',,'"),
        (["--model-path", "smollm2", "--lengths", "9000"], "must fit the model's 8192-token"),
    ],
)
def test_bad_flags_stop_before_the_model_loads(argv, message, capsys):
    from tangram_sglang.eval.scorer_recall import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and "Loading weights" not in err


def test_a_folder_without_a_model_is_named(tmp_path, capsys):
    from tangram_sglang.eval.scorer_recall import main

    assert main(["--model-path", str(tmp_path)]) == 2
    assert f"--model-path {tmp_path}: no config.json there" in capsys.readouterr().err
