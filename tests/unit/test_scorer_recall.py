"""``eval.scorer_recall``: the recall measure, the probe's RoPE shift and kvpress's KVzip scores.

Runs the embedded SmolLM2 (transformers, CPU) on a short context: no server.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tangram_sglang.errors import ConfigError
from tangram_sglang.eval.scorer_recall import (
    ShiftedReplayProbe,
    _probe_for,
    kvzip_scores,
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


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    return model, tok


def test_the_probe_shift_equals_rope_at_the_later_positions(smollm2):
    """Rotating post-RoPE queries by s more positions = RoPE of the raw queries at i + s."""
    model, tok = smollm2
    probe = _probe_for(model, tok)
    rng = torch.Generator().manual_seed(0)
    raw = torch.randn(
        3, 7, model.config.hidden_size // model.config.num_attention_heads, generator=rng
    )
    rope = lambda x, pos: probe.apply_rotary(  # noqa: E731
        x[None], x[None], *model.model.rotary_emb(x[None], torch.as_tensor(pos)[None])
    )[0][0]
    at = rope(raw, list(range(7)))
    shifted = probe.rotate(at, 500)
    torch.testing.assert_close(
        shifted, rope(raw, [500 + i for i in range(7)]), atol=1e-4, rtol=1e-4
    )


def test_probe_scores_are_max_softmax_over_every_key_of_the_segment():
    """Shift 0 (an identity rotation) and one KV head of two query heads, against a loop."""
    probe = ShiftedReplayProbe(rotary=None, apply_rotary=None, gap_tokens=0, query_block=2)
    probe.rotate = lambda q, shift: q  # the rotation is checked above; here the scoring
    q, k = torch.randn(2, 5, 4), torch.randn(1, 5, 4)
    got = probe.score(q, k, 0.5)
    want = torch.stack([torch.softmax(q[h] @ k[0].T * 0.5, -1).amax(0) for h in range(2)]).amax(0)
    torch.testing.assert_close(got, want[None])


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
