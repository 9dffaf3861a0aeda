"""The ``kvzip`` scorer and the replay pass's layout (``scoring.kvzip``, ``backend.replay``,
``integration.replay``), against explicit attention computed here."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram_sglang.backend.replay import (
    check_every_compressed_row_replays,
    replay_layout,
    replay_positions,
    replay_token_scores,
)
from tangram_sglang.errors import ConfigError, KernelError
from tangram_sglang.integration.replay import _with_replay_slots
from tangram_sglang.scoring import get_scorer
from tangram_sglang.scoring.kvzip import KVzipScorer, ReplayPrompts, needs_replay


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


def test_a_replay_past_the_rope_table_ends_on_its_last_position():
    # row 0: prefix 90, n 4, m 6 -> replay would take 94..99, table of 97 rows: 91..96
    flat, replay, prefix = np.array([10, 3]), np.array([6, 0]), np.array([90, 5])
    positions = replay_positions(prefix, flat, replay, max_positions=97)
    assert positions.tolist() == [91, 92, 93, 94, 95, 96, 90, 91, 92, 93, 5, 6, 7]
    # no limit: KVzip's geometry, the replay right after the segment
    free = replay_positions(prefix, flat, replay)
    assert free.tolist()[:6] == [94, 95, 96, 97, 98, 99]
    # a replay longer than the table starts at 0 and is clamped
    tight = replay_positions(np.array([0]), np.array([9]), np.array([6]), max_positions=4)
    assert tight.max() == 3 and tight.min() == 0


def test_every_compressed_row_must_replay():
    kept = np.array([[4, 2], [3, 3], [1, 1]])
    check_every_compressed_row_replays([4, 3, 2], kept, np.array([5, 0, 4]))
    with pytest.raises(KernelError, match="request 2 of the batch compresses its 2-token"):
        check_every_compressed_row_replays([4, 3, 2], kept, np.array([5, 0, 0]))
    with pytest.raises(KernelError, match="request 0 of the batch"):
        check_every_compressed_row_replays([4, 3, 2], kept, None)
    check_every_compressed_row_replays([2, 3], np.array([[2, 2], [3, 3]]), None)  # all whole


def test_replay_slots_pad_each_replay_with_slot_zero():
    loc = torch.tensor([11, 12, 13, 21, 22, 31])  # segments of 3, 2 and 1 tokens
    out = _with_replay_slots(loc, [3, 2, 1], [2, 0, 3])
    assert out.tolist() == [0, 0, 11, 12, 13, 21, 22, 0, 0, 0, 31]


class _ChatTokenizer(_Tokenizer):
    chat_template = "a template"

    def __init__(self, keeps_marker: bool):
        self.keeps_marker = keeps_marker

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt and not tokenize
        content = messages[0]["content"] if self.keeps_marker else "no marker"
        return f"<user>{content}</user><bot>"


def test_replay_prompts_take_the_assistant_header_after_the_user_turn():
    prompts = ReplayPrompts.from_tokenizer(_ChatTokenizer(keeps_marker=True))
    assert "".join(map(chr, prompts.suffix)) == "</user><bot>"
    assert prompts.ids_for([7, 8, 9], 0, 3)[-6:] == [*map(ord, "<bot>"), 7, 8, 9][-6:]
    assert ReplayPrompts.from_tokenizer(_ChatTokenizer(keeps_marker=False)).suffix == ()


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("return_logprob", True, "logprobs"),
        ("return_hidden_states", True, "hidden states"),
        ("input_embeds", [[0.0] * 8] * 3, "input embeddings"),
    ],
)
def test_the_edge_refuses_per_token_outputs_and_embeddings_under_kvzip(field, value, named):
    """HTTP-side check (``edge_checks.check_request``) on SGLang's own request object: what the
    replay tokens would shift is refused with the field's name; other scorers let it through
    (SGLang applies its own checks to hidden states and embeddings before this one)."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    from tangram_sglang.integration.edge_checks import check_request
    from tangram_sglang.integration.server_args import PROFILE_STASH

    def manager(scorer: str):
        profile = Path(__file__).parents[2] / f"calibration/smollm2/{scorer}-r0.25.json"
        args = SimpleNamespace(tangram=True, device="cpu", grammar_backend=None)
        setattr(args, PROFILE_STASH, profile.read_text())
        return SimpleNamespace(server_args=args, model_config=SimpleNamespace(vocab_size=100))

    kwargs = {field: value} if field == "input_embeds" else {"text": "Hi!", field: value}
    obj = GenerateReqInput(sampling_params={"max_new_tokens": 2}, **kwargs)
    obj.normalize_batch_and_arguments()
    ids = None if field == "input_embeds" else [1, 2, 3]
    with pytest.raises(ValueError, match=f"{named}.*--tangram-scorer kvzip"):
        check_request(manager("kvzip"), obj, ids)
    check_request(manager("kvzip-lite"), obj, ids)


def _causal_attention(q, k, v, scale, group):
    """[T, H_q, D] outputs of plain causal attention of one sequence (no history)."""
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    logits = torch.einsum("thd,shd->hts", q, k) * scale
    t = q.shape[0]
    logits = logits.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), -math.inf)
    return torch.einsum("hts,shd->thd", torch.softmax(logits, -1), v)


def test_extend_layer_with_replay_attends_in_kvzip_order_and_keeps_segment_tokens_only():
    """One extend layer on the CPU reference kernels with two replayed rows: the segment's
    outputs are its plain causal attention (the replay after it changes nothing), each replay
    token attends to the whole segment and the replay before it, the outputs come back in the
    flat order, and each head's kept count is its group's budget of the segment."""
    from factories import make_profile

    from tangram_sglang.backend import metadata as md
    from tangram_sglang.backend.layer_ops import ReferenceKernels, extend_layer
    from tangram_sglang.backend.state import TangramState
    from tangram_sglang.mem.manager import TangramMemory

    # 1 layer, 2 KV heads of 16 dims, GQA 2; the heads keep half and a quarter
    profile = make_profile([[0.5, 0.25]], 1, "global", 1, 1, head_dim=16, gqa_size=2)
    profile = dataclasses.replace(profile, scorer="kvzip", provenance={})
    memory = TangramMemory.create(
        profile,
        memory_bytes=64 * 2 * 4 * 16 * 4,
        page_size=4,
        max_rows=4,
        max_context_tokens=128,
        dtype=torch.float32,
    )
    state = TangramState(memory, full_kv_bytes_per_token=2 * 2 * 16 * 4, device="cpu")
    seg, replay = np.array([12, 8]), np.array([5, 7])
    flat = seg + replay
    plan = state.allocate_extend([1, 2], seg.tolist(), [0, 0])
    assert (plan.kept_lens < seg[:, None]).all()  # both rows compressed: both replay
    meta = md.extend_metadata(
        [1, 2],
        flat.tolist(),
        plan.kept_lens,
        "cpu",
        profile.grouping.cluster_of,
        start_lens=plan.start_lens,
        hist_len=torch.zeros_like(memory.table.group_len),
    )
    meta.replay = replay_layout(flat, replay, "cpu")
    torch.manual_seed(3)
    total = int(flat.sum())
    q, k, v = torch.randn(total, 4, 16), torch.randn(total, 2, 16), torch.randn(total, 2, 16)
    out = extend_layer(ReferenceKernels(), state, meta, q, k, v, 0, 0.25)
    start = 0
    for n, m in zip(seg.tolist(), replay.tolist(), strict=True):
        rows = slice(start, start + n + m)
        logical = torch.cat([torch.arange(m, m + n), torch.arange(m)]) + start  # seg, replay
        expected = _causal_attention(q[logical], k[logical], v[logical], 0.25, 2)
        torch.testing.assert_close(out[rows][m:], expected[:n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out[rows][:m], expected[n:], rtol=1e-5, atol=1e-5)
        start += n + m
    kept = memory.table.group_len[[1, 2]].numpy()
    assert (kept == plan.kept_lens).all()  # the segment's budgets, not segment + replay
