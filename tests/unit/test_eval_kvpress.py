"""The kvpress side of the harness equals kvpress's own pipeline protocol, press by press.

``KvpressRunner`` runs one context prefill for several presses (each press's ``compress`` on a
copy of the layer's K/V) and its own greedy loop (transformers 5.12's ``generate`` does not pass
``cache_position``, which kvpress's hook needs). Reference: kvpress 0.5.5's
``KVPressTextGenerationPipeline._forward`` + ``generate_answer`` written out (``with press(model)``
around the context prefill only, then the question and greedy decoding on the compressed cache,
logical positions), per press; and ``model.generate`` on the whole prompt without a press.
SmolLM2, a real needle sample of ~200 tokens (query-agnostic split), compression 0.6.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from tangram_sglang.eval.systems import KvpressRunner, tangram_kept_fraction, tangram_profile
from tangram_sglang.eval.tasks import build_samples, conversation_ids, for_protocol
from tangram_sglang.profile import BudgetProfile

MAX_NEW = 8
pytestmark = pytest.mark.slow  # ~20 s on a quiet 2-core CPU (model load + about ten short runs)


@pytest.fixture(scope="module")
def setup(smollm2_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    runner = KvpressRunner(str(smollm2_path), {tok.eos_token_id})
    (sample,) = build_samples("needle", tok, 1, (160,), depths=(0.5,))
    return runner, conversation_ids(sample, tok)


def _reference(runner, press, context_ids, ids):
    """kvpress's pipeline: press on the context prefill only, then question + greedy decode."""
    from transformers import DynamicCache

    model, n, out = runner.model, len(context_ids), []
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        with press(model) if press else contextlib.nullcontext():
            pos = torch.arange(n)  # kvpress's hook reads cache_position (5.12 no longer sets it)
            model.model(
                input_ids=torch.tensor([context_ids]),
                past_key_values=cache,
                cache_position=pos,
                position_ids=pos[None],
            )
        position_ids = torch.arange(n, len(ids))[None]
        logits = model(
            input_ids=torch.tensor([ids[n:]]), past_key_values=cache, position_ids=position_ids
        ).logits[:, -1]
        for i in range(MAX_NEW):
            out.append(int(logits.argmax(-1)))
            if out[-1] in runner.eos_ids or i == MAX_NEW - 1:
                break
            logits = model(
                input_ids=torch.tensor([[out[-1]]]),
                past_key_values=cache,
                position_ids=position_ids[:, -1:] + 1 + i,
            ).logits[:, -1]
    return out, cache


def test_shared_context_prefill_equals_each_press_run_alone(setup):
    runner, conv = setup
    (ids,) = conv.turn_ids
    assert ids[: len(conv.context_ids)] == conv.context_ids
    presses = {
        "full": None,
        "uniform": KvpressRunner.make_press("uniform-snapkv", 0.6),
        "dynamic": KvpressRunner.make_press("dynamic-ada-snapkv", 0.6),
        "expected": KvpressRunner.make_press("expected-attention", 0.6),
        "dynamic-expected": KvpressRunner.make_press("dynamic-ada-expected-attention", 0.6),
    }
    outs = runner.generate(conv.context_ids, conv.turn_ids, presses, MAX_NEW)
    for name, press in presses.items():
        ref, cache = _reference(runner, press, conv.context_ids, ids)
        assert outs[name] == [ref], name
        if name in ("uniform", "expected"):  # the context was compressed (the question not)
            n, q = len(conv.context_ids), len(ids) - len(conv.context_ids)
            assert cache.layers[0].keys.shape[2] == int(n * 0.4) + q + len(ref) - 1
        if name.startswith("dynamic"):  # AdaKV masks, never frees
            assert cache.layers[0].keys.shape[2] == len(ids) + len(ref) - 1
    k, heads = int(len(conv.context_ids) * 0.4), runner.model.config.num_key_value_heads
    for name in ("uniform", "expected"):
        assert all(per_layer == [k] * heads for per_layer in runner.kept_per_head[name])
    for name in ("dynamic", "dynamic-expected"):  # AdaKV: a layer's heads share heads * k slots
        dynamic = runner.kept_per_head[name]
        assert all(sum(per_layer) == heads * k for per_layer in dynamic)
        assert any(len(set(per_layer)) > 1 for per_layer in dynamic)  # and split them unevenly
    generated = runner.model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False)
    assert generated[0, len(ids) :].tolist()[: len(outs["full"][0])] == outs["full"][0]


def test_kvzip_gets_its_own_prefill_and_answers_as_kvpress_does(setup):
    """KVzip needs its reconstruction forwards: the runner's own prefill for it equals kvpress's
    pipeline (press around the context prefill, then the question on the masked cache)."""
    runner, conv = setup
    (ids,) = conv.turn_ids
    outs = runner.generate(
        conv.context_ids, conv.turn_ids, {"kvzip": KvpressRunner.make_press("kvzip", 0.6)}, MAX_NEW
    )
    attns = [layer.self_attn for layer in runner.model.model.layers]
    try:
        ref, _ = _reference(runner, KvpressRunner.make_press("kvzip", 0.6), conv.context_ids, ids)
    finally:
        for attn in attns:  # kvpress's pipeline leaves KVzip's masks on the modules
            attn.masked_key_indices = None
    assert outs["kvzip"] == [ref]
    kept = runner.kept_per_head["kvzip"]  # one budget over every layer and head (KVzip's)
    layers, heads, n = len(kept), len(kept[0]), len(conv.context_ids)
    assert sum(map(sum, kept)) == layers * heads * n - int(layers * heads * n * 0.6)
    assert len({sum(per_layer) for per_layer in kept}) > 1  # layers keep different counts


def test_kvzip_scores_with_profile_budgets_keep_each_heads_static_count(setup):
    """``kvzip-budgets``: KVzip's reconstruction scores, but every KV head keeps its group's
    ``kept_len`` of the context from a Tangram profile, sinks and recent window included."""
    runner, conv = setup
    profile = tangram_profile(BudgetProfile.load("calibration/smollm2/kvzip-lite-r0.25.json"), 0.5)
    n = len(conv.context_ids)
    frac = tangram_kept_fraction(profile, n)
    press = KvpressRunner.make_press("kvzip-budgets", 1 - frac, profile)
    presses = {"kvzip-budgets": press, "kvzip": KvpressRunner.make_press("kvzip", 1 - frac)}
    runner.generate(conv.context_ids, conv.turn_ids, presses, 2)
    kept = runner.kept_per_head["kvzip-budgets"]
    group_kept = profile.group_kept_lens(n)
    want = [[group_kept[g] for g in layer] for layer in profile.grouping.cluster_of.tolist()]
    assert kept == want
    total = sum(map(sum, kept))  # the same memory as KVzip's own allocation, spread otherwise
    assert abs(sum(map(sum, runner.kept_per_head["kvzip"])) - total) <= len(kept) * len(kept[0])
    assert runner.kept_per_head["kvzip"] != kept
    assert len({k for layer in kept for k in layer}) > 1  # the profile's non-uniform budgets
    attns = [layer.self_attn for layer in runner.model.model.layers]
    mask = runner._prefill_kvzip(torch.tensor([conv.context_ids]), "again", press)[2]
    for attn in attns:
        attn.masked_key_indices = None
    for *_, seq in mask.values():  # sinks and the recent window are never evicted
        assert not ((seq < profile.sink_tokens) | (seq >= n - profile.recent_window)).any()
    with pytest.raises(Exception, match="needs the profile"):
        KvpressRunner.make_press("kvzip-budgets", 0.5)


def test_a_turn_that_does_not_extend_the_context_is_refused(setup):
    from tangram_sglang.errors import TangramError

    runner, conv = setup
    with pytest.raises(TangramError, match="extend the context"):
        runner.generate(conv.context_ids, [conv.context_ids[:-1]], {"full": None}, MAX_NEW)
    other = conv.turn_ids[0][:-2] + [conv.turn_ids[0][-1]] * 2
    with pytest.raises(TangramError, match="extend the context"):
        runner.generate(conv.turn_ids[0], [other], {"full": None}, MAX_NEW)


def _reference_aware(runner, press, ids):
    """SnapKV / kvpress with the question in the prompt: the press around the whole prompt's
    prefill (the first token from its logits), then greedy decoding on the compressed cache."""
    from transformers import DynamicCache

    model, n, out = runner.model, len(ids), []
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        with press(model) if press else contextlib.nullcontext():
            pos = torch.arange(n)
            logits = model(
                input_ids=torch.tensor([ids]),
                past_key_values=cache,
                cache_position=pos,
                position_ids=pos[None],
            ).logits[:, -1]
        for i in range(MAX_NEW):
            out.append(int(logits.argmax(-1)))
            if out[-1] in runner.eos_ids or i == MAX_NEW - 1:
                break
            logits = model(
                input_ids=torch.tensor([[out[-1]]]),
                past_key_values=cache,
                position_ids=torch.tensor([[n + i]]),
            ).logits[:, -1]
    return out, cache


def test_query_aware_compresses_the_whole_first_prompt_as_kvpress_does(setup):
    runner, conv = setup
    aware = for_protocol(conv, "query-aware")
    presses = {
        "full": None,
        "uniform": KvpressRunner.make_press("uniform-snapkv", 0.6),
        "dynamic": KvpressRunner.make_press("dynamic-ada-snapkv", 0.6),
    }
    outs = runner.generate(aware.context_ids, aware.turn_ids, presses, MAX_NEW)
    n = len(aware.context_ids)  # context + question + generation prompt
    for name, press in presses.items():
        ref, cache = _reference_aware(runner, press, aware.context_ids)
        assert outs[name] == [ref], name
        if name == "uniform":
            assert cache.layers[0].keys.shape[2] == int(n * 0.4) + len(ref) - 1
    heads = runner.model.config.num_key_value_heads
    assert runner.kept_per_head["uniform"][0] == [int(n * 0.4)] * heads
    generated = runner.model.generate(
        torch.tensor([aware.context_ids]), max_new_tokens=MAX_NEW, do_sample=False
    )
    assert generated[0, n:].tolist()[: len(outs["full"][0])] == outs["full"][0]


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


def test_group_allocation_and_same_pass_scores_keep_the_profiles_total(setup, monkeypatch):
    """``kvzip-group-alloc`` (KVzip's scores) and ``kvzip-lite-group-alloc`` (the profile's own
    same-pass scorer on the transformers model) keep the profile's total per request, split by
    the request's scores group by group; ``kvzip-lite-budgets`` keeps the static counts."""
    runner, conv = setup
    profile = tangram_profile(BudgetProfile.load("calibration/smollm2/kvzip-lite-r0.25.json"), 0.5)
    n = len(conv.context_ids)
    frac = tangram_kept_fraction(profile, n)
    systems = ("kvzip-group-alloc", "kvzip-lite-budgets", "kvzip-lite-group-alloc")
    presses = {s: KvpressRunner.make_press(s, 1 - frac, profile) for s in systems}
    outs = runner.generate(conv.context_ids, conv.turn_ids, presses, 2)
    assert set(outs) == set(systems) and all(len(o) == len(conv.turn_ids) for o in outs.values())
    cluster = profile.grouping.cluster_of.tolist()
    group_kept = profile.group_kept_lens(n)
    static = [[group_kept[g] for g in layer] for layer in cluster]
    assert runner.kept_per_head["kvzip-lite-budgets"] == static
    total, slack = sum(map(sum, static)), max(profile.grouping.heads_per_group - 1, 0)
    for system in ("kvzip-group-alloc", "kvzip-lite-group-alloc"):
        kept = runner.kept_per_head[system]
        assert total - slack <= sum(map(sum, kept)) <= total, system
        assert kept != static, system  # the request's own scores moved entries between groups
        by_group = {}
        for layer, groups in zip(kept, cluster, strict=True):
            for k, g in zip(layer, groups, strict=True):
                by_group.setdefault(g, set()).add(k)
        assert all(len(ks) == 1 for ks in by_group.values()), system
    # the same-pass system's masks are what its scorer selects: sinks and window never evicted
    masks = runner._observed_masks(conv.context_ids, "again", presses["kvzip-lite-group-alloc"])
    assert runner.kept_per_head["again"] == runner.kept_per_head["kvzip-lite-group-alloc"]
    for layer, (_, heads, seq) in masks.items():
        assert not ((seq < profile.sink_tokens) | (seq >= n - profile.recent_window)).any()
        dropped = torch.bincount(heads, minlength=len(cluster[layer])).tolist()
        assert [n - d for d in dropped] == runner.kept_per_head["again"][layer]
    # the masks reach the answers: every turn of an observed-score system answers on them
    seen = []
    answer = runner._answer

    def spy(cache, masks, *args):
        seen.append(masks)
        return answer(cache, masks, *args)

    monkeypatch.setattr(runner, "_answer", spy)
    runner.generate(conv.context_ids, conv.turn_ids, {"s": presses["kvzip-lite-budgets"]}, 1)
    assert len(seen) == len(conv.turn_ids)
    for masks in seen:
        assert sorted(masks) == list(range(len(cluster)))
        dropped = [
            torch.bincount(masks[i][1], minlength=len(c)).tolist() for i, c in enumerate(cluster)
        ]
        assert [[n - d for d in layer] for layer in dropped] == static
    with pytest.raises(Exception, match="allocation='pooled' is unknown"):
        from tangram_sglang.eval.systems import profile_budget_kvzip_press

        profile_budget_kvzip_press(profile, 0.5, "pooled")


def test_the_gate_twin_keeps_static_budgets_with_one_observer_per_profile(setup):
    """``kvzip-gate-budgets``: the harness builds a new press (and gate scorer, which hashes by
    identity) per sample; the runner keys the gate's observer by its profile, so samples of
    one profile share one observer, and each keeps the profile's static counts."""
    runner, conv = setup
    profile = tangram_profile(BudgetProfile.load("calibration/smollm2/kvzip-gate-r0.25.json"), 0.5)
    n = len(conv.context_ids)
    frac = tangram_kept_fraction(profile, n)
    for _ in range(2):  # two samples
        press = KvpressRunner.make_press("kvzip-gate-budgets", 1 - frac, profile)
        outs = runner.generate(conv.context_ids, conv.turn_ids, {"gate": press}, 1)
        assert len(outs["gate"]) == len(conv.turn_ids)
    group_kept = profile.group_kept_lens(n)
    cluster = profile.grouping.cluster_of.tolist()
    assert runner.kept_per_head["gate"] == [[group_kept[g] for g in layer] for layer in cluster]
    gate_keys = [k for k in runner._observers if isinstance(k, tuple) and k[0] == "kvzip-gate"]
    assert gate_keys == [("kvzip-gate", id(profile))]
    assert runner._observers[gate_keys[0]][1] is profile  # held, so its id is not reused
