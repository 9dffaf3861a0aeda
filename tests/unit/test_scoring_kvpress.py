"""Our SnapKV / AdaKV / PyramidKV selections equal NVIDIA kvpress 0.5.5's, per head, on SmolLM2.

kvpress is installed into the project venv with ``--no-deps`` (it pins transformers < 5.3; its
code runs on 5.12 once ``cache_position`` is passed): see README. Real text (ShareGPT), same
window, kernel size and ratio on both sides; the presses run inside the real model's forward.
"""

from __future__ import annotations

import pytest
import torch

from tangram_sglang.calibrate.crosscheck import METHODS, compare, kvpress_masks, our_masks
from tangram_sglang.calibrate.data import load_samples


@pytest.fixture(scope="module")
def model_and_ids(smollm2_path):
    # Imported here, not at collection: importing kvpress patches transformers' attention table.
    # A missing kvpress must fail these tests (ImportError), never skip them.
    import kvpress  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(
        smollm2_path, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    sample = load_samples("sharegpt", tok, 1, 256, 256, seed=1)[0]
    return model, torch.tensor([sample.input_ids])


@pytest.mark.slow  # SmolLM2 forward through kvpress and through our scorer: ~30 s
@pytest.mark.parametrize("ratio", [0.25], ids=["r0.25"])  # r0.5: see calibration/README.md
def test_selection_matches_kvpress_per_head(model_and_ids, ratio):
    model, ids = model_and_ids
    results = {r.method: r for r in compare(model, ids, ratio, window=32, kernel=5)}
    assert set(results) == set(METHODS)
    for method, res in results.items():
        assert res.overlap.shape == (30, 3)
        assert res.mean >= 0.99, f"{method}: overlap {res.mean:.4f}"
        # Anything not identical must be an exact tie at the selection threshold.
        assert res.num_diff_tokens == res.num_tie_diff_tokens, method


@pytest.mark.slow  # ~25 s (model forward)
def test_the_check_detects_a_different_selection(model_and_ids):
    """The comparison is not vacuous: a changed scorer (max-pool, window 16) disagrees."""
    from tangram_sglang.calibrate.observe import ScoreObserver
    from tangram_sglang.scoring import SnapKVScorer

    model, ids = model_and_ids
    theirs = kvpress_masks(model, ids, "snapkv", 0.25, 32, 5)
    scores = ScoreObserver(model, SnapKVScorer(obs_window=32, pooling="max")).scores(
        ids[0].tolist()
    )
    ours = our_masks(scores, "snapkv", 0.25, 32)
    assert ours.sum() == theirs.sum()
    assert (ours & theirs).sum() / theirs.sum() < 0.99
