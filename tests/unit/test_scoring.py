"""Scorers and top-k selection on hand-built attention patterns (pure torch, CPU, milliseconds)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tangram_sglang.errors import ConfigError
from tangram_sglang.scoring import (
    RopeShift,
    SnapKVScorer,
    adaptive_select,
    available_scorers,
    bind_rope,
    get_scorer,
    is_token_scorer,
    pyramid_layer_budget,
    register_scorer,
    select_kept,
)
from tangram_sglang.scoring.duo import nonlocal_mass, retrieval_heads
from tangram_sglang.scoring.kvzip import needs_replay
from tangram_sglang.scoring.snapkv import reduce_gqa, window_attention

D = 16
BIG = 30.0  # logit gap that makes a pattern's softmax effectively one-hot


def keys_with_targets(num_kv_heads: int, n: int, targets: list[list[int]]) -> torch.Tensor:
    """Keys [H_kv, n, D]: small noise; head h's tokens in targets[h] share one strong direction."""
    k = 0.01 * torch.randn(num_kv_heads, n, D)
    for h, toks in enumerate(targets):
        k[h, toks, h] = 1.0
    return k


def queries_towards(num_qo_heads: int, w: int, num_kv_heads: int) -> torch.Tensor:
    """Queries [Hq, w, D] of query head q pointing at direction kv_head(q) (GQA layout)."""
    gqa = num_qo_heads // num_kv_heads
    q = torch.zeros(num_qo_heads, w, D)
    for qh in range(num_qo_heads):
        q[qh, :, qh // gqa] = BIG
    return q


def test_sink_head_keeps_sinks_and_window():
    n, w, sink, window = 64, 8, 4, 8
    k = keys_with_targets(1, n, [[0, 1, 2, 3]])  # the head attends only to the first 4 tokens
    scores = SnapKVScorer(obs_window=w).score(queries_towards(3, w, 1), k, 1.0)
    kept = select_kept(scores, sink + window, sink, window)
    assert kept[0].tolist() == [0, 1, 2, 3, *range(n - window, n)]


def test_retrieval_head_keeps_the_needle():
    n, w, needle = 100, 8, 57
    k = keys_with_targets(2, n, [[needle], [3]])
    scores = SnapKVScorer(obs_window=w, kernel_size=1).score(queries_towards(4, w, 2), k, 1.0)
    kept = select_kept(scores, 4 + w + 1, 4, w)
    assert needle in kept[0].tolist()
    assert needle not in kept[1].tolist()  # the other head looks at token 3, not the needle


def test_gqa_reduction_mean_and_max():
    x = torch.tensor([[1.0, 0.0], [3.0, 2.0], [5.0, 5.0], [7.0, 1.0]])  # 4 query heads, n = 2
    assert reduce_gqa(x, 2, "mean").tolist() == [[2.0, 1.0], [6.0, 3.0]]
    assert reduce_gqa(x, 2, "max").tolist() == [[3.0, 2.0], [7.0, 5.0]]


def test_gqa_query_heads_map_to_their_kv_head():
    # Query heads 0-2 belong to KV head 0 (HF repeat_kv layout): only they see the needle.
    n, w = 40, 4
    k = keys_with_targets(3, n, [[10], [20], [30]])
    scores = SnapKVScorer(obs_window=w, kernel_size=1).score(queries_towards(9, w, 3), k, 1.0)
    assert scores[:, : n - w].argmax(-1).tolist() == [10, 20, 30]


def test_window_attention_is_causal_inside_the_window():
    q, k = torch.randn(2, 4, D), torch.randn(2, 10, D)
    probs = window_attention(q, k, 0.25, None)
    assert probs.shape == (2, 4, 10)
    for i in range(4):  # window query i sits at token 6 + i
        assert torch.all(probs[:, i, 7 + i :] == 0)
    assert torch.allclose(probs.sum(-1), torch.ones(2, 4))


def test_lse_normalisation_matches_softmax_when_lse_is_the_segment_lse():
    q, k = torch.randn(3, 4, D), torch.randn(3, 12, D)
    scorer = SnapKVScorer(obs_window=4)
    logits = (q @ k.transpose(-1, -2)) * 0.3
    future = torch.triu(torch.ones(4, 12, dtype=torch.bool), diagonal=9)
    lse = torch.logsumexp(logits.masked_fill(future, float("-inf")), dim=-1)
    torch.testing.assert_close(scorer.score(q, k, 0.3, lse), scorer.score(q, k, 0.3))
    # A larger normaliser (history outside the segment) scales scores down, ranking unchanged.
    smaller = scorer.score(q, k, 0.3, lse + 1.0)
    assert torch.all(smaller[:, :8] < scorer.score(q, k, 0.3)[:, :8])


def test_ties_never_drop_sinks_or_window():
    scores = torch.ones(2, 50)  # every token ties
    kept = select_kept(scores, 10, 3, 5)
    assert kept.tolist() == [[0, 1, 2, 3, 4, 45, 46, 47, 48, 49]] * 2
    low = torch.full((1, 50), 5.0)
    low[0, :3] = low[0, -5:] = -1.0  # protected tokens score lowest: still kept
    assert set(range(3)) | set(range(45, 50)) <= set(select_kept(low, 8, 3, 5)[0].tolist())


def test_nan_scores_rank_last():
    scores = torch.tensor([[float("nan"), 1.0, 0.5, float("nan"), 2.0]])
    assert select_kept(scores, 2, 0, 0).tolist() == [[1, 4]]


@pytest.mark.parametrize("n", [1, 2], ids=["1-token", "2-token"])
def test_one_and_two_token_segments(n):
    scorer = SnapKVScorer(obs_window=8)
    scores = scorer.score(torch.randn(6, 1, D), torch.randn(2, n, D), 0.25)
    assert scores.shape == (2, n) and torch.isfinite(scores).all()
    kept = select_kept(scores, 1, 4, 8)
    assert kept.shape == (2, 1) and kept.tolist() == [[0], [0]]
    assert select_kept(scores, n, 4, 8).tolist() == [list(range(n))] * 2


def test_k_must_be_positive_and_at_most_n():
    with pytest.raises(ConfigError, match="k=0"):
        select_kept(torch.ones(1, 4), 0, 0, 0)
    with pytest.raises(ConfigError, match="k=5"):
        select_kept(torch.ones(1, 4), 5, 0, 0)


def test_batch_equals_one_by_one():
    scorer = SnapKVScorer(obs_window=6)
    q, k = torch.randn(3, 9, 6, D), torch.randn(3, 3, 40, D)
    batch = scorer.score(q, k, 0.25)
    singles = torch.stack([scorer.score(q[b], k[b], 0.25) for b in range(3)])
    torch.testing.assert_close(batch, singles)
    kept = select_kept(batch, 12, 2, 6)
    assert torch.equal(kept, torch.stack([select_kept(singles[b], 12, 2, 6) for b in range(3)]))
    mask = adaptive_select(batch, 12, 0.2, 2, 6)
    assert torch.equal(
        mask, torch.stack([adaptive_select(singles[b], 12, 0.2, 2, 6) for b in range(3)])
    )


def test_adaptive_select_gives_focused_heads_fewer_tokens():
    n = 200
    scores = torch.rand(3, n) * 1e-3
    scores[0, 10:20] = 1.0  # head 0 concentrates on 10 tokens
    scores[2] += 0.5  # head 2 spreads its attention widely: it wins most of the layer budget
    mask = adaptive_select(scores, 40, 0.2, 4, 8)
    counts = mask.sum(-1)
    assert counts.sum() == 3 * 40
    assert counts[2] > counts[0] and counts[2] > counts[1]
    assert counts.min() >= 4 + 8 and mask[:, :4].all() and mask[:, -8:].all()
    assert mask[0, 10:20].all()


def test_adaptive_select_safeguard_floor():
    scores = torch.zeros(2, 100)
    scores[1] = 1.0  # head 1 would take the whole layer budget without the safeguard
    counts = adaptive_select(scores, 20, 0.2, 0, 0).sum(-1)
    assert counts.tolist() == [4, 36]  # int(0.2 * 20) = 4 guaranteed to head 0
    assert adaptive_select(scores, 20, 0.0, 0, 0).sum(-1).tolist() == [0, 40]


def test_pyramid_budget_shrinks_with_depth_and_keeps_the_mean():
    budgets = [pyramid_layer_budget(i, 30, 4096, 0.25, 32) for i in range(30)]
    assert budgets == sorted(budgets, reverse=True) and budgets[0] > 2 * budgets[-1]
    assert abs(sum(budgets) / 30 - 4096 * 0.25) <= 0.5  # kvpress: layers average n * ratio
    assert pyramid_layer_budget(5, 30, 100, 0.25, 32) == 25  # short input: uniform fallback


def test_duo_retrieval_heads_are_the_non_local_ones():
    scores = torch.zeros(2, 2, 50)
    scores[0, 1, 10:20] = 0.05  # layer 0 head 1 attends to the middle
    scores[1, 0, 0:4] = 0.2  # layer 1 head 0 attends to sinks only
    mass = nonlocal_mass(scores, 4, 8, 8)
    assert mass[0, 1] == pytest.approx(0.5) and mass[1, 0] == 0
    assert retrieval_heads(mass, 0.25).tolist() == [[False, True], [False, False]]


def test_registry_rejects_empty_and_duplicate_names():
    assert {"snapkv", "ada-snapkv", "pyramidkv", "duo"} <= set(available_scorers())
    with pytest.raises(ConfigError, match="empty"):
        register_scorer("", SnapKVScorer)
    with pytest.raises(ConfigError, match="already registered"):
        register_scorer("snapkv", SnapKVScorer)
    with pytest.raises(ConfigError, match="not registered.*snapkv"):
        get_scorer("h2o")
    with pytest.raises(ConfigError, match="kernel_size"):
        get_scorer("snapkv", kernel_size=4)
    assert get_scorer("ada-snapkv", obs_window=16).name == "ada-snapkv"


def test_scorers_run_on_half_precision_inputs():
    q, k = torch.randn(4, 8, D, dtype=torch.bfloat16), torch.randn(2, 30, D, dtype=torch.bfloat16)
    for name in available_scorers():
        if is_token_scorer(get_scorer(name)):  # kvzip-gate: scores from k and v
            gate = get_scorer(name, weights=np.ones((1, 2, D // 2 + D + 1)).tolist())
            scores = gate.token_scores(0, k, k)
            assert scores.dtype == torch.float32 and scores.shape == (2, 30)
            continue
        if needs_replay(name):  # kvzip: the replay's queries and their LSE
            scores = get_scorer(name).score(q, k, 0.25, torch.full((4, 8), 3.0))
            assert scores.dtype == torch.float32 and scores.shape == (2, 30)
            continue
        scorer = bind_rope(get_scorer(name, obs_window=8), RopeShift.standard(D))
        scores = scorer.score(q, k, 0.25)
        assert scores.dtype == torch.float32 and scores.shape == (2, 30)


@pytest.mark.parametrize("lead", [(), (2,)], ids=["no-batch", "batch"])
def test_window_attention_gqa_matches_repeated_kv_heads(lead):
    # 6 query heads over 3 KV heads (gqa 2): each query head must read its own KV head exactly as
    # HF's repeat_kv does; random tensors so every wrong head mapping changes the numbers.
    torch.manual_seed(0)
    q, k = torch.randn(*lead, 6, 5, D), torch.randn(*lead, 3, 11, D)
    k_rep = k.repeat_interleave(2, dim=-3)  # query head h reads KV head h // 2
    logits = (q @ k_rep.transpose(-1, -2)) * 0.2
    future = torch.triu(torch.ones(5, 11, dtype=torch.bool), diagonal=7)
    logits = logits.masked_fill(future, float("-inf"))
    torch.testing.assert_close(window_attention(q, k, 0.2, None), torch.softmax(logits, -1))
    lse = torch.logsumexp(logits, dim=-1) + 0.5
    torch.testing.assert_close(window_attention(q, k, 0.2, lse), torch.exp(logits - lse[..., None]))
