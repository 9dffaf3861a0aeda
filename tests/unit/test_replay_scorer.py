"""``scoring.replay``: the RoPE shift and the kvzip-replay scores, against references.

* ``RopeShift.rotate`` of post-RoPE queries by ``s`` equals the HF model's own RoPE applied at
  positions ``i + s`` (SmolLM2's rotary embedding, neox halves), and a ``cos | sin`` table row
  (SGLang's ``cos_sin_cache`` layout) gives the same frequencies as the HF module;
* ``ReplayScorer.score`` equals a per-head loop of softmax over every key at the shifted query
  positions (GQA folded, a subset of queries when ``max_queries`` bounds them);
* an unbound scorer refuses to score; a profile's options never hold the RoPE.
"""

from __future__ import annotations

import pytest
import torch
from sglang.srt.runtime_context import get_context

from tangram_sglang.calibrate.cli import scorer_options
from tangram_sglang.errors import ConfigError
from tangram_sglang.scoring import (
    ReplayScorer,
    RopeShift,
    bind_rope,
    get_scorer,
    needs_rope,
    rope_from_hf,
)
from tangram_sglang.scoring.replay import check_rope_span


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()


def _hf_rope(model, x: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """HF's RoPE of ``x`` ``[H, n, D]`` at ``positions`` (the model's own functions)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cos, sin = model.model.rotary_emb(x[None], torch.as_tensor(positions)[None])
    return apply_rotary_pos_emb(x[None], x[None], cos, sin)[0][0]


def test_the_shift_equals_rope_at_the_later_positions(smollm2):
    rope = rope_from_hf(smollm2)
    dim = smollm2.config.hidden_size // smollm2.config.num_attention_heads
    raw = torch.randn(3, 7, dim, generator=torch.Generator().manual_seed(0))
    at = _hf_rope(smollm2, raw, list(range(7)))
    want = _hf_rope(smollm2, raw, [1000 + i for i in range(7)])
    torch.testing.assert_close(rope.rotate(at, 1000), want, atol=1e-4, rtol=1e-4)


def test_a_cos_sin_table_row_gives_the_hf_frequencies(smollm2):
    dim = smollm2.config.hidden_size // smollm2.config.num_attention_heads
    cos, sin = smollm2.model.rotary_emb(torch.zeros(1, 1, dim), torch.tensor([[1]]))
    row = torch.cat([cos[0, 0, : dim // 2], sin[0, 0, : dim // 2]])  # SGLang's cache layout
    got = RopeShift.from_cos_sin_row(row, neox=True)
    torch.testing.assert_close(got.inv_freq, rope_from_hf(smollm2).inv_freq)


def test_interleaved_pairs_rotate_each_pair_by_its_frequency():
    rope = RopeShift(torch.tensor([0.5, 0.25]), neox=False)
    x = torch.tensor([1.0, 0.0, 0.0, 1.0, 7.0])  # two pairs and one dimension past rotary_dim
    got = rope.rotate(x, 2)  # angles 1.0 and 0.5
    c1, s1, c2, s2 = (torch.tensor(v) for v in (1.0, 1.0, 0.5, 0.5))
    want = torch.stack([c1.cos(), s1.sin(), -s2.sin(), c2.cos(), torch.tensor(7.0)])
    torch.testing.assert_close(got, want)


def _loop_scores(scorer: ReplayScorer, q, k, scale: float) -> torch.Tensor:
    """Per query head: max over the chosen queries of softmax over every key; max over GQA."""
    hq, n, _ = q.shape
    hkv = k.shape[0]
    slots = list(range(n)) if scorer.max_queries in (0,) or scorer.max_queries >= n else None
    if slots is None:
        from tangram_sglang.scoring import KVzipLiteScorer

        slots = KVzipLiteScorer(max_queries=scorer.max_queries).query_slots(n)
    shifted = scorer.rope.rotate(q[:, slots], n + scorer.gap_tokens)
    per_head = []
    for h in range(hq):
        probs = torch.softmax(shifted[h] @ k[h // (hq // hkv)].T * scale, dim=-1)
        per_head.append(probs.amax(0))
    return torch.stack(per_head).view(hkv, hq // hkv, n).amax(1)


@pytest.mark.parametrize("max_queries, block", [(0, 3), (5, 2), (64, 256)])
def test_scores_match_a_loop_over_heads_and_queries(max_queries, block):
    gen = torch.Generator().manual_seed(1)
    rope = RopeShift(1.0 / 10000 ** (torch.arange(0, 8, 2) / 8), neox=True)
    scorer = ReplayScorer(max_queries=max_queries, query_block=block, gap_tokens=3, rope=rope)
    q, k = torch.randn(4, 11, 8, generator=gen), torch.randn(2, 11, 8, generator=gen)
    got = scorer.score(q, k, 0.35)
    torch.testing.assert_close(got, _loop_scores(scorer, q, k, 0.35))
    batched = scorer.score(torch.stack([q, q]), torch.stack([k, k]), 0.35)
    torch.testing.assert_close(batched, torch.stack([got, got]))


def test_an_unbound_scorer_refuses_and_a_profile_never_stores_the_rope():
    scorer = get_scorer("kvzip-replay", max_queries=16)
    assert needs_rope(scorer)
    with pytest.raises(ConfigError, match="kvzip-replay has no RoPE"):
        scorer.score(torch.zeros(2, 4, 8), torch.zeros(1, 4, 8), 1.0)
    bound = bind_rope(scorer, RopeShift(torch.ones(4)))
    assert not needs_rope(bound) and bound.max_queries == 16
    assert "rope" not in scorer_options(bound) and scorer_options(bound)["gap_tokens"] == 8
    assert bind_rope(get_scorer("snapkv"), RopeShift(torch.ones(4))) == get_scorer("snapkv")
    with pytest.raises(ConfigError, match="gap_tokens"):
        ReplayScorer(gap_tokens=-1)


def test_the_standard_rope_is_roformers_and_matches_smollm2s_base(smollm2):
    dim = smollm2.config.hidden_size // smollm2.config.num_attention_heads
    theta = smollm2.config.rope_parameters["rope_theta"]
    torch.testing.assert_close(
        RopeShift.standard(dim, theta).inv_freq, rope_from_hf(smollm2).inv_freq
    )


def _sglang_rope(cls_name: str, head: int, base: float, dtype=torch.bfloat16, **scaling):
    """SGLang's own rotary module with its own ``_compute_cos_sin_cache``, cast to ``dtype``
    as SGLang casts it off CUDA (built without ``__init__``, which needs a GPU kernel here)."""
    from sglang.srt.layers.rotary_embedding import rope_variant
    from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding
    from sglang.srt.runtime_context import get_context

    cls = getattr(rope_variant, cls_name, None) or RotaryEmbedding
    with get_context().override_server_args():  # the scheduler's published settings
        module = cls.__new__(cls)
        torch.nn.Module.__init__(module)
        module.head_size, module.rotary_dim, module.base = head, head, base
        module.max_position_embeddings, module.is_neox_style, module.dtype = 4096, True, dtype
        for key, value in scaling.items():
            setattr(module, key, value)
        module.cos_sin_cache = module._compute_cos_sin_cache().to(dtype)
    return module


def _served(*ropes, names=None):
    model = torch.nn.Module()
    for i, rope in enumerate(ropes):
        model.add_module((names or [f"layer{j}" for j in range(len(ropes))])[i], rope)
    return model


def _model_rope(model):
    """``model_rope`` as the server calls it: with its settings published."""
    from sglang.srt.runtime_context import get_context

    from tangram_sglang.backend.attention_backend import model_rope

    with get_context().override_server_args():
        return model_rope(model)


def test_the_server_reads_float32_frequencies_from_a_bf16_rope_cache():
    plain = _sglang_rope("RotaryEmbedding", 128, 500000.0)
    got = _model_rope(_served(plain, _sglang_rope("RotaryEmbedding", 128, 500000.0)))
    torch.testing.assert_close(got.inv_freq, RopeShift.standard(128, 500000.0).inv_freq)
    llama3 = dict(
        scaling_factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, orig_max_position=8192
    )
    scaled = _sglang_rope("Llama3RotaryEmbedding", 128, 500000.0, **llama3)
    with get_context().override_server_args():
        want = scaled._compute_inv_freq(500000.0).float()  # Llama-3's scaled frequencies
    torch.testing.assert_close(_model_rope(_served(scaled)).inv_freq, want, rtol=1e-5, atol=1e-9)


def test_the_server_refuses_mixed_ropes_and_models_without_one_and_skips_vision_towers():
    local, global_ = (_sglang_rope("RotaryEmbedding", 64, b) for b in (10000.0, 1000000.0))
    with pytest.raises(ConfigError, match="different ones"):
        _model_rope(_served(local, global_))
    with pytest.raises(ConfigError, match="no rotary embedding"):
        _model_rope(torch.nn.Linear(2, 2))
    got = _model_rope(_served(local, global_, names=["vision_tower", "layer0"]))
    torch.testing.assert_close(got.inv_freq, RopeShift.standard(64, 1000000.0).inv_freq)
    with pytest.raises(ConfigError, match="not a rotary embedding's"):
        check_rope_span(RopeShift(torch.tensor([0.5, -0.1])), 8)
    with pytest.raises(ConfigError, match="not a rotary embedding's"):
        check_rope_span(RopeShift(torch.ones(8)), 8)  # 8 frequencies need head_dim 16


def test_kvzip_gate_refuses_a_rope_that_moves_the_pair_norms():
    """kvzip-gate's features are the norms of the (i, i + D/2) pairs: unchanged by RoPE only in
    the neox layout over the whole head; an interleaved or partial RoPE is refused at start-up."""
    from sglang.srt.runtime_context import get_context

    from tangram_sglang.backend.attention_backend import check_gate_rope

    neox = _sglang_rope("RotaryEmbedding", 64, 10000.0)
    with get_context().override_server_args():
        check_gate_rope(_served(neox))  # Llama/Qwen2/SmolLM2: accepted
        interleaved = _sglang_rope("RotaryEmbedding", 64, 10000.0)
        interleaved.is_neox_style = False
        with pytest.raises(ConfigError, match="is_neox_style=False"):
            check_gate_rope(_served(neox, interleaved))
        partial = _sglang_rope("RotaryEmbedding", 64, 10000.0)
        partial.rotary_dim = 32
        with pytest.raises(ConfigError, match="rotary_dim=32, head_size=64"):
            check_gate_rope(_served(partial))
        check_gate_rope(_served(interleaved, names=["vision_tower"]))  # vision towers skipped
