"""Answer scoring and the report's aggregation/summary (tangram_sglang.eval.scoring, .report)."""

from __future__ import annotations

import json
import re

import pytest

from tangram_sglang.errors import ConfigError
from tangram_sglang.eval.report import (
    aggregate,
    load_report,
    markdown_table,
    paired_vs_full,
    summary,
)
from tangram_sglang.eval.scoring import contains_answer, exact_match, normalize, score


def test_normalize_is_squads():
    assert normalize("  The  Eiffel-Tower, in PARIS!  ") == "eiffeltower in paris"
    assert normalize("an apple a day") == "apple day"


@pytest.mark.parametrize(
    ("prediction", "answers", "contains", "exact"),
    [
        ("The special magic number for canyon is 1618065.", ("1618065",), 1.0, 0.0),
        ("1618065", ("1618065",), 1.0, 1.0),
        ("The special magic number is 161806.", ("1618065",), 0.0, 0.0),
        ("16180655", ("1618065",), 0.0, 0.0),  # whole words: a longer number is wrong
        ("the British", ("British", "English"), 1.0, 1.0),
        ("Germany", ("British", "English"), 0.0, 0.0),
        ("", ("France",), 0.0, 0.0),
        ("anything", ("the",), 0.0, 0.0),  # an answer that normalises to "" never matches
    ],
    ids=[
        "needle-sentence",
        "needle-exact",
        "needle-cut",
        "needle-longer",
        "squad-article",
        "squad-wrong",
        "empty",
        "empty-answer",
    ],
)
def test_known_good_and_bad_answers(prediction, answers, contains, exact):
    assert contains_answer(prediction, answers) == contains
    assert exact_match(prediction, answers) == exact
    assert score(prediction, answers) == {"contains_answer": contains, "exact_match": exact}


def _rec(task, system, ratio, ok, turn=0):
    return {
        "task": task,
        "sample_id": f"{task}:0",
        "system": system,
        "ratio": ratio,
        "turn": turn,
        "contains_answer": ok,
        "exact_match": 0.0,
        "kept_fraction": ratio or 1.0,
        "cached_tokens": 0,
    }


def test_summary_is_tangram_minus_each_method_in_points_over_tasks_and_ratios():
    recs = [_rec("needle", "full", None, 1.0), _rec("needle", "full", None, 1.0)]
    for r, t, d, u in [(0.5, [1, 1], [1, 0], [1, 0]), (0.25, [1, 0], [1, 0], [0, 0])]:
        for system, oks in (("tangram", t), ("dynamic-ada-snapkv", d), ("uniform-snapkv", u)):
            recs += [_rec("needle", system, r, float(ok)) for ok in oks]
    results = aggregate(recs, (0.5, 0.25))
    assert results["needle"]["0.5"]["full"]["contains_answer"] == 100.0  # full under every ratio
    assert results["needle"]["0.25"]["tangram"]["contains_answer"] == 50.0
    s = summary(results)
    assert s["tangram_minus_dynamic_points"] == 25.0  # (50 + 0) / 2
    assert s["tangram_minus_uniform_points_by_ratio"] == {"0.25": 50.0, "0.5": 50.0}
    assert s["tangram_minus_full_points_by_task"]["needle"]["0.5"] == 0.0
    assert s["targets"] == {
        "within_2_points_of_dynamic": True,
        "above_uniform_at_0.25": True,
        "needle_0.5_within_3_points_of_full": True,
    }
    # one column per system the report holds (full, tangram, dynamic, uniform), in a fixed order
    table = markdown_table({"results": results})
    assert table.startswith(
        "| task | ratio | kept | full | tangram | dynamic-ada-snapkv | uniform-snapkv | n |"
    )
    assert "| needle | 0.25 | 0.25 | 100.0 | 50.0 | 50.0 | 0.0 | 2 |" in table


def test_every_system_the_eval_runs_has_a_markdown_column():
    """report.py spells the system names out (eval.systems' sets): a renamed or added system
    must not drop out of the RESULTS table."""
    from tangram_sglang.eval import report
    from tangram_sglang.eval.runner import SYSTEMS
    from tangram_sglang.eval.systems import GRID_SYSTEMS, TANGRAM_SYSTEMS

    assert set(report.GRID_SYSTEMS) == set(GRID_SYSTEMS)
    assert set(report.TANGRAM_SYSTEMS) == set(TANGRAM_SYSTEMS) - set(GRID_SYSTEMS)
    cells = {s: {"kept_fraction": 0.25, "num_scored": 1} for s in SYSTEMS}
    header = markdown_table({"results": {"needle": {"0.25": cells}}}).splitlines()[0]
    columns = header.strip("| ").split(" | ")
    assert columns[:3] == ["task", "ratio", "kept"] and columns[-1] == "n"
    assert sorted(columns[3:-1]) == sorted(SYSTEMS)


def test_missing_systems_give_none_not_a_number():
    s = summary(aggregate([_rec("squad", "full", None, 1.0)], (0.5,)))
    assert s["tangram_minus_dynamic_points"] is None
    assert s["targets"]["within_2_points_of_dynamic"] is None


def _rep(systems, recs, sample_ids=("needle:0",)):
    return {
        "samples": [{"sample_id": s} for s in sample_ids],
        "records": recs,
        "command": "c",
        "wall_s": 1.0,
        "config": {"systems": list(systems), "ratios": [0.5]},
    }


def test_merge_joins_runs_of_other_systems_on_the_same_samples():
    from tangram_sglang.errors import ConfigError
    from tangram_sglang.eval.report import merge

    servers = _rep(
        ("full", "tangram"),
        [_rec("needle", "full", None, 1.0), _rec("needle", "tangram", 0.5, 1.0)],
    )
    presses = _rep(("dynamic-ada-snapkv",), [_rec("needle", "dynamic-ada-snapkv", 0.5, 0.0)])
    merged = merge([servers, presses])
    assert merged["summary"]["tangram_minus_dynamic_points"] == 100.0
    assert merged["config"]["systems"] == ["full", "tangram", "dynamic-ada-snapkv"]
    with pytest.raises(ConfigError, match="different samples"):
        merge([servers, _rep(("uniform-snapkv",), [], sample_ids=("needle:1",))])
    with pytest.raises(ConfigError, match="in two reports"):
        merge([servers, servers])


def test_merge_scores_only_the_samples_every_system_finished():
    from tangram_sglang.eval.report import merge

    ids = ("needle:0", "needle:1", "squad:0")
    cut = _rep(
        ("tangram",),
        [dict(_rec("needle", "tangram", 0.5, 1.0), sample_id="needle:0")],
        sample_ids=ids,
    )
    full = _rep(
        ("dynamic-ada-snapkv",),
        [
            dict(_rec(t, "dynamic-ada-snapkv", 0.5, ok), sample_id=sid)
            for t, sid, ok in (
                ("needle", "needle:0", 1.0),
                ("needle", "needle:1", 0.0),
                ("squad", "squad:0", 1.0),
            )
        ],
        sample_ids=ids,
    )
    merged = merge([full, cut])
    assert merged["scored_samples"] == ["needle:0", "squad:0"]  # squad: tangram did not run it
    assert merged["results"]["needle"]["0.5"]["dynamic-ada-snapkv"]["contains_answer"] == 100.0
    assert merged["summary"]["tangram_minus_dynamic_points"] == 0.0


def test_merge_joins_one_system_run_by_two_processes_on_disjoint_samples():
    from tangram_sglang.eval.report import merge

    ids = ("needle:0", "needle:1")
    a, b = (
        _rep(
            ("uniform-snapkv",),
            [dict(_rec("needle", "uniform-snapkv", 0.5, ok), sample_id=sid)],
            sample_ids=ids if sid == "needle:0" else (sid,),
        )
        for sid, ok in (("needle:0", 1.0), ("needle:1", 0.0))
    )
    tangram = _rep(
        ("tangram",),
        [dict(_rec("needle", "tangram", 0.5, 1.0), sample_id=sid) for sid in ids],
        sample_ids=ids,
    )
    merged = merge([a, b, tangram])
    assert merged["scored_samples"] == ["needle:0", "needle:1"]
    assert merged["summary"]["tangram_minus_uniform_points"] == 50.0


@pytest.mark.parametrize("text", [None, "{", "[]", '{"records": []}'], ids=str)
def test_merge_cli_bad_report_exits_2_naming_the_file(tmp_path, capsys, text):
    from tangram_sglang.eval.report import main

    path = tmp_path / "a.json"
    if text is not None:
        path.write_text(text)
    assert main([str(path), "--json", str(tmp_path / "out.json")]) == 2
    assert f"report '{path}'" in capsys.readouterr().err


def test_merge_refuses_reports_of_different_protocols():
    from tangram_sglang.errors import ConfigError
    from tangram_sglang.eval.report import merge

    old = "query-agnostic: the context (instruction + documents / haystack) is compressed ..."
    agnostic = dict(_rep(("tangram",), [_rec("needle", "tangram", 0.5, 1.0)]), protocol=old)
    aware = dict(
        _rep(("uniform-snapkv",), [_rec("needle", "uniform-snapkv", 0.5, 0.0)]),
        protocol="query-aware",
    )
    with pytest.raises(ConfigError, match="different protocols"):
        merge([agnostic, aware])
    # a report written before --protocol (its definition text) merges with a named one
    same = merge([agnostic, dict(aware, protocol="query-agnostic")])
    assert same["summary"]["tangram_minus_uniform_points"] == 100.0


def test_merge_refuses_reports_of_different_devices():
    from tangram_sglang.errors import ConfigError
    from tangram_sglang.eval.report import merge

    def on(device, system, points):
        rep = _rep((system,), [_rec("needle", system, 0.5, points)])
        return dict(rep, config=dict(rep["config"], device=device))

    with pytest.raises(ConfigError, match=r"different devices \['cuda', 'cpu'\]"):
        merge([on("cuda", "tangram", 1.0), on("cpu", "uniform-snapkv", 0.0)])
    old = _rep(("uniform-snapkv",), [_rec("needle", "uniform-snapkv", 0.5, 0.0)])  # no device
    assert merge([on("cpu", "tangram", 1.0), old])["config"]["device"] == "cpu"


def _turn_records(system, ratio, per_turn):
    """Multi-turn records: ``per_turn[t]`` = the contains-answer flags of turn t's samples."""
    return [
        {
            "task": "multiturn-squad",
            "sample_id": f"m{i}",
            "turn": t,
            "system": system,
            "ratio": ratio,
            "kept_fraction": 1.0 if ratio is None else ratio,
            "cached_tokens": 0,
            "contains_answer": flag,
            "exact_match": 0.0,
        }
        for t, flags in enumerate(per_turn)
        for i, flag in enumerate(flags)
    ]


def test_later_questions_take_the_best_tangram_scorer_minus_full_kv():
    records = (
        _turn_records("full", None, [[1, 1], [1, 0], [1, 1]])  # later turns: 3/4 = 75
        + _turn_records("tangram", 0.25, [[1, 1], [0, 0], [0, 1]])  # 25
        + _turn_records("tangram-kvzip-lite", 0.25, [[1, 0], [1, 0], [1, 1]])  # 75
        + _turn_records("tangram", 0.5, [[1, 1], [1, 0], [0, 1]])  # 50
        + _turn_records("kvzip", 0.5, [[1, 1], [1, 1], [1, 1]])  # a press, never "best Tangram"
    )
    out = summary(aggregate(records, (0.5, 0.25)))
    assert out["later_questions_minus_full_points"] == {"0.25": 0.0, "0.5": -25.0}
    assert out["later_questions_best_tangram"] == {"0.25": "tangram-kvzip-lite", "0.5": "tangram"}
    assert out["later_questions_points"]["0.5"] == {"full": 75.0, "tangram": 50.0, "kvzip": 100.0}
    # no multi-turn task: empty fields, not an error
    assert summary(aggregate([], (0.5,)))["later_questions_minus_full_points"] == {}


def test_needle_takes_the_best_tangram_scorer_minus_full_kv():
    records = [_rec("needle", "full", None, ok) for ok in (1.0, 1.0, 1.0, 0.0)]  # 75
    for system, ratio, oks in (
        ("tangram", 0.5, (1.0, 0.0, 0.0, 0.0)),  # 25
        ("tangram-kvzip", 0.5, (1.0, 1.0, 1.0, 0.0)),  # 75
        ("tangram-kvzip", 0.25, (1.0, 1.0, 0.0, 0.0)),  # 50
        ("kvzip", 0.25, (1.0, 1.0, 1.0, 1.0)),  # a press, never "best Tangram"
    ):
        records += [_rec("needle", system, ratio, ok) for ok in oks]
    out = summary(aggregate(records, (0.5, 0.25)))
    assert out["needle_minus_full_points"] == {"0.5": 0.0, "0.25": -25.0}
    assert out["needle_best_tangram"] == {"0.5": "tangram-kvzip", "0.25": "tangram-kvzip"}
    assert out["needle_points"]["0.25"] == {"full": 75.0, "tangram-kvzip": 50.0, "kvzip": 100.0}
    assert out["later_questions_minus_full_points"] == {}  # no multi-turn task
    assert summary(aggregate([], (0.5,)))["needle_minus_full_points"] == {}


def test_a_resumed_run_at_one_ratio_keeps_the_files_other_ratios_in_its_summary(tmp_path):
    from tangram_sglang.eval.report import build
    from tangram_sglang.eval.runner import RunConfig, with_resumed_cells

    resumed = (
        _turn_records("full", None, [[1, 1], [1, 0], [1, 1]])  # later turns: 75
        + _turn_records("tangram-kvzip-lite", 0.5, [[1, 1], [1, 0], [0, 1]])  # 50
    )
    new = _turn_records("tangram-kvzip-gate", 0.25, [[1, 0], [1, 0], [1, 0]])  # 50
    cfg = RunConfig(
        model="qwen2.5-0.5b",
        model_dir=tmp_path,
        profile_dir=tmp_path,
        tasks=("multiturn-squad",),
        ratios=(0.25,),  # this command's ratio; the file holds 0.5 too
        num_samples=2,
        lengths=(1024,),
        depths=(0.5,),
        num_turns=3,
        systems=("tangram-kvzip-gate",),
        seed=0,
        json_path=None,
        resume=True,
    )
    report_cfg = with_resumed_cells(cfg, resumed)
    assert report_cfg.ratios == (0.5, 0.25)
    assert report_cfg.systems == ("tangram-kvzip-gate", "full", "tangram-kvzip-lite")
    rep = build(report_cfg, [], resumed + new, 1.0)
    assert rep["config"]["ratios"] == [0.5, 0.25]
    # full KV's ratio-free records count at both ratios, the file's 0.5 cell is kept
    assert rep["summary"]["later_questions_minus_full_points"] == {"0.25": -25.0, "0.5": -25.0}
    assert with_resumed_cells(cfg, []) == cfg  # nothing resumed: the command's own cells


def test_a_report_is_written_one_line_per_record_and_reads_back_the_same():
    """``report.dumps``: indented, except one line per record; ``json.loads`` gives the report
    back, non-ASCII predictions included; a report without records is plain indented JSON."""
    import json

    from tangram_sglang.eval.report import dumps

    records = [
        {"sample_id": "needle:0", "output_ids": [1, 2, 3], "prediction": "Zürich"},
        {"sample_id": "needle:1", "output_ids": [], "prediction": "a\nb"},
    ]
    rep = {"metric": "contains_answer", "summary": {"x": [1, 2]}, "records": records}
    text = dumps(rep)
    assert json.loads(text) == rep
    lines = text.splitlines()
    assert lines[-3:] == ["  " + json.dumps(records[1], ensure_ascii=False), " ]", "}"]
    assert len(lines) == len(json.dumps({**rep, "records": 0}, indent=1).splitlines()) + 3
    assert json.loads(dumps({**rep, "records": []})) == {**rep, "records": []}


def test_paired_comparison_counts_the_questions_where_a_system_and_full_kv_disagree():
    """Paired on (sample, turn): only discordant questions move the exact McNemar p-value."""
    full = [[1] * 8, [1] * 6 + [0, 0], [1] * 8]  # later turns: 14 of 16 answered
    records = (
        _turn_records("full", None, full)
        # loses 6 later questions full KV answers, answers none that full KV misses
        + _turn_records("tangram", 0.25, [[0] * 8, [0] * 6 + [0, 0], [1] * 8])
        # the same mean as full KV (14 of 16), reached on other questions
        + _turn_records("tangram", 0.5, [[1] * 8, [1] * 4 + [0, 0, 1, 1], [1] * 8])
    )
    out = summary(aggregate(records, (0.5, 0.25)), records)["later_questions_paired_vs_full"]
    lossy = out["0.25"]["tangram"]
    assert (lossy["questions"], lossy["only_full"], lossy["only_system"]) == (16, 6, 0)
    assert lossy["p_value"] == float(f"{2 * 0.5**6:.3g}")  # both tails of Binomial(6, 1/2)
    swap = out["0.5"]["tangram"]
    assert (swap["only_full"], swap["only_system"], swap["p_value"]) == (2, 2, 1.0)
    assert "full" not in out["0.5"]  # the reference is not paired with itself
    # a one-sided split of 20 keeps a p-value above 0 (3 significant digits, not 4 decimals)
    many = _turn_records("full", None, [[1] * 21] * 2) + _turn_records("t", 0.5, [[0] * 21] * 2)
    many[-1]["contains_answer"] = 1  # 20 of the 21 later questions lost
    tiny = paired_vs_full(many, "multiturn-squad", "full", True)["0.5"]["t"]["p_value"]
    assert 0 < tiny < 1e-5
    # without records (callers that only hold aggregates), no paired fields
    assert "later_questions_paired_vs_full" not in summary(aggregate(records, (0.5, 0.25)))
    # no full KV run (its 24 records dropped), or no needle task: nothing to pair with
    no_full = summary(aggregate(records[24:], (0.5, 0.25)), records[24:])
    assert no_full["later_questions_paired_vs_full"] == {}
    assert no_full["needle_paired_vs_full"] == {}


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda rec: rec.pop("turn"), "records[1] lacks turn"),
        (lambda rec: rec.update(contains_answer=None), "records[1]: contains_answer is None"),
        (lambda rec: rec.update(cached_tokens="12"), "records[1]: cached_tokens is '12'"),
        (lambda rec: rec.update(turn="1"), "records[1]: turn is '1', not an integer"),
        (lambda rec: rec.update(ratio="0.25"), "records[1]: ratio is '0.25', not a number"),
        (lambda rec: rec.update(system=None), "records[1]: system is None, not a string"),
    ],
)
def test_a_report_with_a_malformed_record_is_refused_naming_the_record_and_key(
    tmp_path, edit, message
):
    records = _turn_records("full", None, [[1, 1]])
    edit(records[1])
    path = tmp_path / "acc.json"
    path.write_text(json.dumps({"model": "m", "config": {}, "samples": [], "records": records}))
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_report(path)
    path.write_text(json.dumps({"model": "m", "config": {}, "samples": [], "records": None}))
    with pytest.raises(ConfigError, match="records is not a list"):
        load_report(path)
