"""Tangram's static per-head budgets vs the dynamic allocation (tangram_sglang.eval.budgets)."""

from __future__ import annotations

import numpy as np
import pytest

from tangram_sglang.eval.budgets import compare, tangram_kept_per_head
from tangram_sglang.eval.systems import tangram_kept_fraction, tangram_profile
from tangram_sglang.profile import BudgetProfile


@pytest.fixture(scope="module")
def profile():
    return tangram_profile(BudgetProfile.load("calibration/smollm2/ada-snapkv-r0.25.json"), 0.25)


def test_per_head_budgets_are_the_group_kept_lengths(profile):
    n = 1000
    kept = tangram_kept_per_head(profile, n)
    assert kept.shape == profile.ratio.shape
    assert kept.mean() / n == pytest.approx(tangram_kept_fraction(profile, n))


def test_on_the_grid_whole_cells_are_compressed_and_the_rest_kept_whole(profile):
    """1,000 tokens on a 256-token grid: three cells of kept_len(256) each, 232 tokens whole."""
    per_cell = tangram_kept_per_head(profile, 256)
    expected = (3 * per_cell + 232).mean() / 1000
    assert tangram_kept_fraction(profile, 1000, 256) == pytest.approx(expected)
    assert tangram_kept_fraction(profile, 1000, 0) == tangram_kept_fraction(profile, 1000)
    # fewer tokens than one cell: one partial chunk, kept whole by the server whatever k_g(n)
    assert tangram_kept_fraction(profile, 300, 512) == 1.0
    assert tangram_kept_fraction(profile, 300) < 1.0
    # the grid compresses less of the same tokens (the tail stays whole)
    assert tangram_kept_fraction(profile, 1000, 256) > tangram_kept_fraction(profile, 1000)


def test_the_head_the_dynamic_method_gave_more_is_named_first(profile):
    n = 1000
    tangram = tangram_kept_per_head(profile, n)
    dynamic = tangram.copy()
    dynamic[3, 1] += 200  # AdaKV moved 200 slots of layer 3 from head 0 to head 1
    dynamic[3, 0] -= 200
    rec = {
        "system": "dynamic-ada-snapkv",
        "ratio": 0.25,
        "context_prompt_tokens": n,
        "kept_per_head": dynamic.tolist(),
    }
    out = compare({"records": [rec, dict(rec, ratio=0.5)]}, {0.25: profile})["0.25"]
    assert out["num_samples"] == 1
    assert out["share_of_heads_below"] == pytest.approx(1 / tangram.size, abs=1e-3)
    assert out["mean_deficit_share"] == pytest.approx(0.2)
    layer, head, tangram_share, dynamic_share = out["largest_deficits"][0]
    assert (layer, head) == (3, 1) and dynamic_share - tangram_share == pytest.approx(0.2, 1e-2)
    assert out["kept_share_tangram"] == pytest.approx(out["kept_share_dynamic"])
    assert np.isfinite(out["spearman_mean_allocation"])
