"""The kvpress side of the harness equals kvpress's own context manager, press by press.

``KvpressRunner`` runs one prefill for several presses (each press's ``compress`` on a copy of
the layer's K/V) and its own greedy loop (transformers 5.12's ``generate`` does not pass
``cache_position``, which kvpress's hook needs). Reference: ``with press(model)`` around a plain
prefill + greedy loop per press, and ``model.generate`` without a press. SmolLM2, a real needle
sample of ~200 tokens, compression 0.6.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from tangram_sglang.eval.systems import KvpressRunner, tangram_kept_fraction, tangram_profile
from tangram_sglang.eval.tasks import build_samples, turn_input_ids
from tangram_sglang.profile import BudgetProfile

MAX_NEW = 8
pytestmark = pytest.mark.slow  # ~20 s on a quiet 2-core CPU (model load + 7 short runs)


@pytest.fixture(scope="module")
def setup(smollm2_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    runner = KvpressRunner(str(smollm2_path), {tok.eos_token_id})
    (sample,) = build_samples("needle", tok, 1, (160,), depths=(0.5,))
    return runner, turn_input_ids(sample, tok)[0]


def _reference(runner, press, ids):
    from transformers import DynamicCache

    model, n, out = runner.model, len(ids), []
    cache = DynamicCache(config=model.config)
    with torch.inference_mode(), press(model) if press else contextlib.nullcontext():
        pos = torch.arange(n)
        logits = model(input_ids=torch.tensor([ids]), past_key_values=cache,
                       cache_position=pos, position_ids=pos[None]).logits[:, -1]  # fmt: skip
        for step in range(MAX_NEW):
            out.append(int(logits.argmax(-1)))
            if out[-1] in runner.eos_ids or step == MAX_NEW - 1:
                break
            pos = torch.tensor([n + step])
            logits = model(input_ids=torch.tensor([[out[-1]]]), past_key_values=cache,
                           cache_position=pos, position_ids=pos[None]).logits[:, -1]  # fmt: skip
    return out, cache


def test_shared_prefill_equals_each_press_run_alone(setup):
    runner, ids = setup
    presses = {
        "full": None,
        "uniform": KvpressRunner.make_press("uniform-snapkv", 0.6),
        "dynamic": KvpressRunner.make_press("dynamic-ada-snapkv", 0.6),
    }
    outs = runner.generate(ids, presses, MAX_NEW)
    for name, press in presses.items():
        ref, cache = _reference(runner, press, ids)
        assert outs[name] == ref, name
    assert cache.layers[0].keys.shape[2] == len(ids) + len(ref) - 1  # AdaKV masks, never frees
    generated = runner.model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False)
    assert generated[0, len(ids) :].tolist()[: len(outs["full"])] == outs["full"]


def test_uniform_press_keeps_the_budget_tangram_keeps(smollm2_path):
    shipped = BudgetProfile.load("calibration/smollm2/ada-snapkv-r0.25.json")
    profile = tangram_profile(shipped, 0.25)
    assert abs(profile.mean_kept_fraction() - 0.25) < 1e-6
    n = 1000
    frac = tangram_kept_fraction(profile, n)
    manual = sum(profile.group_kept_lens(n)[g] for g in profile.grouping.cluster_of.ravel())
    assert frac == pytest.approx(manual / (profile.ratio.size * n))
    assert 0.25 < frac < 0.32  # sink 4 + window 32 + group padding on top of 0.25
    assert tangram_kept_fraction(tangram_profile(shipped, 1.0), n) == 1.0
