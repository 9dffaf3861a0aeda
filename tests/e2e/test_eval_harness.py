"""The accuracy harness end to end on CPU (SmolLM2): stock SGLang vs the ``--tangram`` server.

Per protocol, one stock server start and one Tangram server start (the shipped profile rescaled to
ratio 1.0, radix reuse on), one short sample of each task; query-agnostic (each context is its own
request, the questions follow) and query-aware (the first prompt, question included, is the
compressed request; later turns extend it). Checks the issue-8 invariants of the harness: Tangram at
ratio 1.0 gives exactly full KV's answers (same greedy ids on every turn), every question is served
on the context reused from the radix cache (and later multi-turn turns on the earlier turns too),
and the harness's scores are the scorer's on the real replies (a known-good and a known-bad answer
for each sample score 1 and 0).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tangram_sglang.eval.runner import RunConfig, run
from tangram_sglang.eval.scoring import score
from tangram_sglang.eval.tasks import TASKS

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", params=["query-agnostic", "query-aware"])
def report(smollm2_path, tmp_path_factory, request):
    out = tmp_path_factory.mktemp("eval") / "accuracy.json"
    cfg = RunConfig(
        model="smollm2",
        model_dir=smollm2_path,
        profile_dir=REPO / "calibration" / "smollm2",
        tasks=TASKS,
        ratios=(1.0,),
        num_samples=1,
        lengths=(160,),
        depths=(0.5,),
        num_turns=2,
        systems=("full", "tangram"),
        seed=0,
        json_path=out,
        server_args=("--mem-fraction-static", "0.85"),  # as the CLI: shared hosts run low
        protocol=request.param,
    )
    rep = run(cfg)
    assert json.loads(out.read_text())["summary"] == rep["summary"]
    return rep


def _by_key(rep, system):
    return {(r["sample_id"], r["turn"]): r for r in rep["records"] if r["system"] == system}


def test_tangram_at_ratio_one_answers_exactly_like_full_kv(report):
    full, tangram = _by_key(report, "full"), _by_key(report, "tangram")
    assert set(full) == set(tangram) and len(full) == 4  # needle, squad, 2 multi-turn turns
    for key, rec in full.items():
        assert tangram[key]["output_ids"] == rec["output_ids"], key
        assert tangram[key]["ratio"] == 1.0 and tangram[key]["kept_fraction"] == 1.0
    for task in TASKS:
        cells = report["results"][task]["1.0"]
        assert cells["tangram"]["contains_answer"] == cells["full"]["contains_answer"]


def test_every_question_runs_on_the_reused_context_and_later_turns_on_the_history(report):
    aware = report["protocol"] == "query-aware" == report["config"]["protocol"]
    assert aware or report["protocol"] == "query-agnostic"
    for system in ("full", "tangram"):
        recs = _by_key(report, system)
        for (_, turn), rec in recs.items():
            if aware and turn == 0:  # the first prompt is the compressed request itself
                assert rec["cached_tokens"] < rec["context_prompt_tokens"] == rec["prompt_tokens"]
            else:
                assert rec["context_prompt_tokens"] <= rec["cached_tokens"] < rec["prompt_tokens"]
        turn2 = next(r for (sid, t), r in recs.items() if sid.startswith("multiturn") and t == 1)
        turn1 = recs[(turn2["sample_id"], 0)]
        assert turn1["prompt_tokens"] - 64 <= turn2["cached_tokens"] < turn2["prompt_tokens"]


def test_harness_scores_are_the_scorers_and_tell_good_from_bad(report):
    records = report["records"]
    for rec in records:
        assert {k: rec[k] for k in ("contains_answer", "exact_match")} == score(
            rec["prediction"], rec["answers"]
        )
        good = f"The answer is {rec['answers'][0]}."
        assert score(good, rec["answers"])["contains_answer"] == 1.0
        bad = next(r["answers"][0] for r in records if set(r["answers"]).isdisjoint(rec["answers"]))
        assert score(bad, rec["answers"])["contains_answer"] == 0.0
    assert report["metric"] == "contains_answer"
    assert report["summary"]["tangram_minus_dynamic_points"] is None  # no kvpress in this run
