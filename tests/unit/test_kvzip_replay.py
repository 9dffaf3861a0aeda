"""The ``kvzip`` scorer and the replay pass's layout (``scoring.kvzip``, ``backend.replay``,
``integration.replay``), against explicit attention computed here."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram_sglang.backend.replay import (
    replay_layout,
    replay_positions,
    replay_token_scores,
)
from tangram_sglang.errors import ConfigError, KernelError
from tangram_sglang.integration.replay import ReplayPrompts
from tangram_sglang.scoring import get_scorer
from tangram_sglang.scoring.kvzip import KVzipScorer, needs_replay


def _explicit_scores(q_rep, k_hist, k_seg, k_rep, scale, group):
    """Max softmax probability each segment key gets from the replay queries: the replay query
    u attends to the history, the segment and replay keys 0..u (causal), per query head."""
    h_q, m, _ = q_rep.shape
    n = k_seg.shape[1]
    keys = torch.cat([k_hist, k_seg, k_rep], dim=1)  # [H_kv, hist + n + m, D]
    keys = keys.repeat_interleave(group, dim=0)  # per query head
    logits = torch.einsum("hud,hjd->huj", q_rep, keys) * scale
    hist = k_hist.shape[1]
    causal = torch.ones(m, m, dtype=torch.bool).tril()
    mask = torch.ones(m, hist + n + m, dtype=torch.bool)
    mask[:, hist + n :] = causal
    logits = logits.masked_fill(~mask, -math.inf)
    probs = torch.softmax(logits, dim=-1)[..., hist : hist + n]  # [H_q, m, n]
    best = probs.amax(dim=1)  # [H_q, n]
    return best.view(-1, group, n).amax(dim=1), torch.logsumexp(logits, dim=-1)


@pytest.mark.parametrize("hist", [0, 7])
def test_kvzip_scores_are_the_replay_queries_max_attention(hist):
    torch.manual_seed(0)
    h_kv, group, n, m, d = 2, 3, 11, 14, 8
    q_rep = torch.randn(h_kv * group, m, d)
    k_hist, k_seg, k_rep = (
        torch.randn(h_kv, hist, d),
        torch.randn(h_kv, n, d),
        torch.randn(h_kv, m, d),
    )
    scale = d**-0.5
    expected, lse = _explicit_scores(q_rep, k_hist, k_seg, k_rep, scale, group)
    got = KVzipScorer(query_block=4).score(q_rep, k_seg, scale, lse)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert got.shape == (h_kv, n) and got.dtype == torch.float32


def test_kvzip_matches_kvpress_on_a_first_segment():
    """On a segment with no history, KVzip's own normaliser (kvpress: sinks within the chunk, the
    chunk and the replay keys, causal) is the replay query's whole attention: the same scores."""
    torch.manual_seed(1)
    h_kv, group, n, m, d = 2, 2, 9, 12, 16
    q = torch.randn(1, h_kv, group, m, d)
    keys = torch.randn(1, h_kv, n + m, d)
    scale = d**-0.5
    # kvpress 0.5.5 KVzipPress._compute_cross_attention + score_kvzip, start_idx 0 (no sinks)
    logits = torch.matmul(q, keys.unsqueeze(2).transpose(-2, -1)) * scale
    mask = torch.full((m, m), torch.finfo(logits.dtype).min)
    cond = torch.arange(m)
    mask.masked_fill_(cond < (cond + 1).view(m, 1), 0)
    logits[..., -m:, -m:] += mask
    weights = torch.softmax(logits, dim=-1)
    kvpress = weights[..., :n].amax(dim=(-3, -2))[0]  # [H_kv, n]
    q_rep = q[0].reshape(h_kv * group, m, d)
    lse = torch.logsumexp(logits[0].reshape(h_kv * group, m, n + m), dim=-1)
    got = KVzipScorer().score(q_rep, keys[0, :, :n], scale, lse)
    torch.testing.assert_close(got, kvpress, rtol=1e-5, atol=1e-6)


def test_kvzip_scorer_refuses_bad_input():
    q, k = torch.randn(4, 3, 8), torch.randn(2, 5, 8)
    with pytest.raises(ConfigError, match="log-sum-exp"):
        KVzipScorer().score(q, k, 0.3)
    with pytest.raises(ConfigError, match=r"lse_obs \[4, 2\] must be \[4, 3\]"):
        KVzipScorer().score(q, k, 0.3, torch.zeros(4, 2))
    with pytest.raises(ConfigError, match="must be 0"):
        KVzipScorer(obs_window=32)
    with pytest.raises(ConfigError, match="query_block=0"):
        get_scorer("kvzip", query_block=0)
    assert needs_replay(get_scorer("kvzip")) and needs_replay("kvzip")
    assert not needs_replay(get_scorer("kvzip-lite")) and not needs_replay("snapkv")


def test_layout_of_a_batch():
    # rows: replayed (n=3, m=2), kept whole (n=2), replayed (n=1, m=4)
    flat, replay, prefix = np.array([5, 2, 5]), np.array([2, 0, 4]), np.array([10, 0, 4])
    layout = replay_layout(flat, replay, "cpu")
    # flat order: row 0 [r0 r1 s0 s1 s2], row 1 [s0 s1], row 2 [r0 r1 r2 r3 s0]
    assert layout.to_logical.tolist() == [2, 3, 4, 0, 1, 5, 6, 11, 7, 8, 9, 10]
    assert layout.to_flat.tolist() == [3, 4, 0, 1, 2, 5, 6, 8, 9, 10, 11, 7]
    assert layout.segment_tokens.tolist() == [0, 1, 2, 5, 6, 7]
    assert layout.segment_bounds == [0, 3, 5, 6]
    assert layout.segment_indptr.tolist() == [0, 3, 5, 6]
    assert layout.replayed == ((0, 0, 3, 2, 0), (2, 7, 1, 4, 5))
    positions = replay_positions(prefix, flat, replay)
    assert positions.tolist() == [13, 14, 10, 11, 12, 0, 1, 5, 6, 7, 8, 4]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 9), st.integers(0, 9), st.integers(0, 50)), min_size=1, max_size=6
    )
)
def test_layout_is_a_permutation_with_logical_positions(rows):
    seg = np.array([n for n, _, _ in rows])
    replay = np.array([m for _, m, _ in rows])
    prefix = np.array([p for _, _, p in rows])
    flat = seg + replay
    layout = replay_layout(flat, replay, "cpu")
    to_logical, to_flat = layout.to_logical.numpy(), layout.to_flat.numpy()
    total = int(flat.sum())
    assert sorted(to_logical.tolist()) == list(range(total))
    assert (to_flat[to_logical] == np.arange(total)).all()  # inverse permutations
    positions = replay_positions(prefix, flat, replay)
    logical = positions[to_logical]  # positions in the logical order: prefix + 0, 1, 2...
    expected = np.concatenate([p + np.arange(f) for p, f in zip(prefix, flat, strict=True)])
    assert (logical == expected).all()
    # the segment tokens are, per row, the first n logical tokens
    starts = np.cumsum(flat) - flat
    seg_expected = np.concatenate([s + np.arange(n) for s, n in zip(starts, seg, strict=True)])
    assert (layout.segment_tokens.numpy() == seg_expected).all()


def test_layout_refuses_a_replay_without_segment():
    with pytest.raises(KernelError, match="row 1 has 3 replay tokens of 3"):
        replay_layout(np.array([4, 3]), np.array([1, 3]), "cpu")
    with pytest.raises(KernelError, match="2 replay lengths for 3 rows"):
        replay_positions(np.zeros(3), np.array([4, 3, 2]), np.array([1, 0]))


def test_batch_scores_are_each_rows_own():
    torch.manual_seed(2)
    h_kv, group, d = 2, 2, 8
    flat, replay = np.array([7, 3, 6]), np.array([3, 0, 4])
    layout = replay_layout(flat, replay, "cpu")
    total = int(flat.sum())
    q, k = torch.randn(total, h_kv * group, d), torch.randn(total, h_kv, d)
    lse = torch.randn(total, h_kv * group).abs() + 3.0
    scorer = KVzipScorer()
    got = replay_token_scores(scorer, q, k, lse, layout, 0.5)
    assert got.shape == (h_kv, 4 + 3 + 2)
    # row 0: logical [0, 4) segment, [4, 7) replay; row 2: logical [10, 12) segment, [12, 16)
    for (start, n, m), cols in (((0, 4, 3), slice(0, 4)), ((10, 2, 4), slice(7, 9))):
        own = scorer.score(
            q[start + n : start + n + m].transpose(0, 1),
            k[start : start + n].transpose(0, 1),
            0.5,
            lse[start + n : start + n + m].T,
        )
        torch.testing.assert_close(got[:, cols], own)
    assert (got[:, 4:7] == 0).all()  # the row without replay (kept whole)


class _Tokenizer:
    """A tokenizer stand-in with one id per character (the prompt arithmetic only)."""

    chat_template = None

    def encode(self, text, add_special_tokens=False):
        assert add_special_tokens is False
        return [ord(c) for c in text]


def test_replay_prompts_first_and_later_segments():
    prompts = ReplayPrompts.from_tokenizer(_Tokenizer())
    fill = list(range(100, 140))
    first = prompts.ids_for(fill, 0, 5)
    assert first == list(prompts.first) + [100, 101, 102, 103, 104]
    later = prompts.ids_for(fill, 20, 4)
    assert later == list(prompts.later) + list(range(112, 120)) + [120, 121, 122, 123]
    short = prompts.ids_for(fill, 3, 2)  # fewer than 8 tokens before the segment
    assert short == list(prompts.later) + [100, 101, 102] + [103, 104]
    with pytest.raises(ConfigError, match="skip-tokenizer-init"):
        ReplayPrompts.from_tokenizer(None)


def test_replay_prompts_of_a_chat_model(smollm2_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    prompts = ReplayPrompts.from_tokenizer(tok)
    assert tok.decode(list(prompts.first)) == "\n\nRepeat the previous context exactly."
    assert "assistant" in tok.decode(list(prompts.suffix))  # the chat template's header
