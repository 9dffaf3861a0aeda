"""Aggregate records into ``accuracy.json``: per task, ratio and system; the summary; a table.

Scores are means in points (0-100) over every scored turn. The full-KV systems (``full``,
``full-hf``) run once and are listed under every ratio. Summary (issue 8):

* ``tangram_minus_dynamic_points``: mean over tasks and the ratios 0.25 and 0.5 (those run) of
  Tangram's score minus kvpress dynamic Ada-SnapKV's (same samples, same kept KV entries);
* ``tangram_minus_uniform_points``: the same against uniform SnapKV;
* per-ratio breakdowns and the three targets with met / missed; the full-KV reference is stock
  SGLang (``full``), or ``full-hf`` when the stock server did not run (``full_reference``).

Summary of the later questions (compressed history that answers questions asked later):

* ``later_questions_minus_full_points``: per ratio, on the multi-turn task's questions 2+
  (turns > 0, ``later_turns_<metric>``), the best Tangram system (any scorer) minus full KV;
* ``later_questions_points``: per ratio and system, those later-question scores;
* ``later_questions_best_tangram``: per ratio, which Tangram system that best one is.

and of the needle (query-agnostic, the fact a later question asks for):

* ``needle_minus_full_points``, ``needle_points`` and ``needle_best_tangram``: the same three
  over the needle task's score.

and, for each, whether a difference stands out from chance (:func:`paired_vs_full`):

* ``later_questions_paired_vs_full`` and ``needle_paired_vs_full``: per ratio and compressed
  system, the questions only full KV answers, those only the system answers, and the exact
  McNemar p-value of that split.
"""

from __future__ import annotations

import json
import platform
import sys
from collections import defaultdict
from datetime import UTC, datetime
from typing import Any

import numpy as np
from scipy.stats import binomtest

from tangram_sglang.eval.scoring import METRIC
from tangram_sglang.eval.tasks import PROTOCOLS

FULL_SYSTEMS = ("full", "full-hf")
# summary: best of
TANGRAM_SYSTEMS = (
    "tangram",
    "tangram-kvzip-lite",
    "tangram-kvzip-replay",
    "tangram-kvzip-gate",
    "tangram-kvzip",
)
GRID_SYSTEMS = ("tangram-grid", "tangram-kvzip-lite-grid")  # eval.systems.GRID_SYSTEMS' names
MULTITURN_TASK = "multiturn-squad"
NEEDLE_TASK = "needle"
LATER = "later_turns_" + METRIC
SUMMARY_RATIOS = (0.25, 0.5)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


_TEXT = (lambda v: isinstance(v, str), "a string")
_NUMBER = (_is_number, "a number")
# what aggregate() and merge() read from every record, and the type each must have
# (load_report checks them): key -> (test, what the value should be)
RECORD_TYPES: dict[str, tuple[Any, str]] = {
    "task": _TEXT,
    "sample_id": _TEXT,
    "system": _TEXT,
    "turn": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "ratio": (lambda v: v is None or _is_number(v), "a number (or null for full KV)"),
    METRIC: _NUMBER,
    "exact_match": _NUMBER,
    "kept_fraction": _NUMBER,
    "cached_tokens": _NUMBER,
}
RECORD_KEYS = tuple(RECORD_TYPES)
# the ``config`` fields of the form {system: {ratio: value}} that the run computes from the
# profiles it reads and that ``merge`` and ``--resume`` join (:func:`merge_per_ratio`):
# field -> (test of one value, what a value is, how a conflict names the value)
PER_RATIO_FIELDS: dict[str, tuple[Any, str, str]] = {
    "profile_files": (lambda v: isinstance(v, str), "profile path", "{}"),
    "profile_scorer_options": (
        lambda v: isinstance(v, dict),
        "{option: value}",
        "a profile whose scorer options have {}",
    ),
}


def build(cfg: Any, samples: list, records: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """The report dict written to ``--json``."""
    results = aggregate(records, cfg.ratios)
    return {
        "metric": METRIC,
        "metric_definition": "1 if any normalised gold answer occurs (whole words) in the "
        "normalised greedy reply (RULER string_match_part); exact_match also given",
        "protocol": cfg.protocol,
        "protocol_definition": PROTOCOLS[cfg.protocol],
        "kept_fraction_definition": "share of the context's KV entries kept (sink, window and "
        "group padding included; the same for every compressed system of a ratio but the "
        "*-grid ones, whose tokens after the last whole grid cell are kept whole)",
        "model": cfg.model,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(cfg.device),
        "command": " ".join(sys.argv),
        "config": {
            "tasks": list(cfg.tasks),
            "ratios": list(cfg.ratios),
            "num_samples": cfg.num_samples,
            "lengths": list(cfg.lengths),
            "depths": list(cfg.depths),
            "num_turns": cfg.num_turns,
            "systems": list(cfg.systems),
            "seed": cfg.seed,
            "device": cfg.device,
            "dtype": cfg.dtype,
            "protocol": cfg.protocol,
            "grid_cell": getattr(cfg, "grid_cell", None),
            **{field: getattr(cfg, field, None) for field in PER_RATIO_FIELDS},
        },
        "samples": [
            {
                "task": s.task,
                "sample_id": s.sample_id,
                "context_tokens": s.context_tokens,
                "num_turns": len(s.turns),
                **s.meta,
            }
            for s in samples
        ],
        "results": results,
        "summary": summary(results, records),
        "wall_s": round(wall_s, 1),
        "records": records,
    }


def machine(device: str) -> str:
    """Host, CPU or GPU name, python version: the ``machine`` field of a report."""
    where = f"{platform.node()} {platform.machine()} CPU"
    if device == "cuda":
        import torch

        where = f"{platform.node()} {torch.cuda.get_device_name(0)} (cuda)"
    return f"{where}, python {sys.version.split()[0]}"


def protocol_name(rep: dict[str, Any]) -> str:
    """The protocol of a report (``query-agnostic`` / ``query-aware``; reports written before the
    ``--protocol`` flag hold its definition, which starts with the name and a colon)."""
    return str(rep.get("protocol", "")).split(":")[0]


def device_name(rep: dict[str, Any]) -> str:
    """The device of a report (``cpu`` / ``cuda``; reports written before ``--device`` ran on
    cpu). Records of two devices differ in dtype (``systems.DEVICE_DTYPES``): never one report."""
    return str(rep.get("config", {}).get("device", "cpu"))


def aggregate(records: list[dict[str, Any]], ratios: tuple[float, ...]) -> dict[str, Any]:
    """``results[task][ratio][system]`` = points, n, kept fraction, cached tokens."""
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for rec in records:
        groups[(rec["task"], rec["ratio"], rec["system"])].append(rec)
    out: dict[str, Any] = {}
    for (task, ratio, system), recs in sorted(groups.items(), key=lambda kv: str(kv[0])):
        cell = {
            METRIC: _points(recs, METRIC),
            "exact_match": _points(recs, "exact_match"),
            "num_scored": len(recs),
            "kept_fraction": round(float(np.mean([r["kept_fraction"] for r in recs])), 4),
            "cached_tokens_mean": round(float(np.mean([r["cached_tokens"] for r in recs])), 1),
            "later_turns_" + METRIC: _points([r for r in recs if r["turn"] > 0], METRIC),
        }
        targets = ratios if ratio is None else (ratio,)
        for r in targets:
            out.setdefault(task, {}).setdefault(str(r), {})[system] = cell
    return out


def _points(recs: list[dict[str, Any]], key: str) -> float | None:
    return round(100.0 * float(np.mean([r[key] for r in recs])), 2) if recs else None


def summary(results: dict[str, Any], records: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The issue-8 summary fields and targets (None where a system or ratio was not run); with
    ``records`` (the per-question records ``results`` was aggregated from) also the paired
    comparisons with full KV (:func:`paired_vs_full`)."""
    out: dict[str, Any] = {}
    for other, key in (("dynamic-ada-snapkv", "dynamic"), ("uniform-snapkv", "uniform")):
        per = _diffs(results, "tangram", other)
        out[f"tangram_minus_{key}_points"] = _mean([d for r, d in per if r in SUMMARY_RATIOS])
        out[f"tangram_minus_{key}_points_by_ratio"] = {
            str(r): _mean([d for rr, d in per if rr == r]) for r in sorted({r for r, _ in per})
        }
    ref = _full_reference(results)
    out["full_reference"] = ref
    out["tangram_minus_full_points_by_task"] = {
        task: {r: _sub(cells.get("tangram"), cells.get(ref)) for r, cells in by_ratio.items()}
        for task, by_ratio in results.items()
    }
    dyn = out["tangram_minus_dynamic_points"]
    uni = out["tangram_minus_uniform_points_by_ratio"].get("0.25")
    needle = out["tangram_minus_full_points_by_task"].get("needle", {}).get("0.5")
    out["needle_0.5_tangram_minus_full_points"] = needle
    out["targets"] = {
        "within_2_points_of_dynamic": None if dyn is None else bool(dyn >= -2.0),
        "above_uniform_at_0.25": None if uni is None else bool(uni > 0.0),
        "needle_0.5_within_3_points_of_full": None if needle is None else bool(needle >= -3.0),
    }
    out.update(best_tangram_fields(results, ref))
    if records is not None:
        out["later_questions_paired_vs_full"] = paired_vs_full(records, MULTITURN_TASK, ref, True)
        out["needle_paired_vs_full"] = paired_vs_full(records, NEEDLE_TASK, ref, False)
    return out


def paired_vs_full(
    records: list[dict[str, Any]], task: str, ref: str, later_only: bool
) -> dict[str, dict[str, dict[str, Any]]]:
    """Each compressed system against full KV on the same questions: where do they disagree?

    Two systems scored on the same questions differ only where one answers and the other does
    not; the exact McNemar test asks whether that split is more lopsided than a fair coin would
    make it (McNemar 1947, Psychometrika 12:153; the exact form is a two-sided binomial test
    of one side's count among the discordant questions at p = 0.5). A question is answered
    when its score (``METRIC``, 0 or 1 per question) is at least 0.5.

    Args:
        records: per-question records (``task``, ``sample_id``, ``turn``, ``system``,
            ``ratio``, ``METRIC``); full-KV systems have ratio None.
        task: the task to compare on (e.g. ``multiturn-squad``).
        ref: the full-KV system (``full`` or ``full-hf``).
        later_only: only turns > 0 (the multi-turn task's later questions).

    Returns:
        ``{ratio: {system: {"questions", "only_full", "only_system", "p_value"}}}`` over the
        questions both scored (matched on sample and turn); ``p_value`` (3 significant
        digits) is 1.0 when they never disagree. Empty without the task or without ``ref``.
    """
    answered: dict[tuple, dict[tuple, bool]] = defaultdict(dict)
    for rec in records:
        if rec["task"] != task or (later_only and rec["turn"] == 0):
            continue
        key = (rec["system"], rec["ratio"])
        answered[key][(rec["sample_id"], rec["turn"])] = rec[METRIC] >= 0.5
    full = answered.get((ref, None))
    out: dict[str, dict[str, dict[str, Any]]] = {}
    if not full:
        return out
    for (system, ratio), marks in sorted(answered.items(), key=lambda kv: str(kv[0])):
        if ratio is None:
            continue
        both = full.keys() & marks.keys()
        only_full = sum(1 for q in both if full[q] and not marks[q])
        only_system = sum(1 for q in both if marks[q] and not full[q])
        split = only_full + only_system
        p = binomtest(only_full, split, 0.5).pvalue if split else 1.0
        out.setdefault(str(ratio), {})[system] = {
            "questions": len(both),
            "only_full": only_full,
            "only_system": only_system,
            "p_value": float(f"{p:.3g}"),  # 3 significant digits: tiny p stay > 0
        }
    return out


def best_tangram_fields(results: dict[str, Any], ref: str) -> dict[str, Any]:
    """The later-question fields: questions 2+ of the multi-turn task, per ratio (module doc),
    and the needle's (the same three over the needle task's score).

    Args:
        results: :func:`aggregate`'s ``results``.
        ref: the full-KV system (:func:`_full_reference`).

    Returns:
        ``later_questions_points`` {ratio: {system: points}}, ``later_questions_best_tangram``
        {ratio: system} and ``later_questions_minus_full_points`` {ratio: best Tangram - full},
        and ``needle_points``, ``needle_best_tangram``, ``needle_minus_full_points`` (empty
        dicts without the task; a ratio without Tangram or full KV is left out).
    """
    out: dict[str, Any] = {}
    for task, key, name in (
        (MULTITURN_TASK, LATER, "later_questions"),
        (NEEDLE_TASK, METRIC, "needle"),
    ):
        points, best, minus_full = _best_tangram(results.get(task, {}), key, ref)
        out[f"{name}_points"] = points
        out[f"{name}_best_tangram"] = best
        out[f"{name}_minus_full_points"] = minus_full
    return out


def _best_tangram(
    by_ratio: dict[str, dict[str, dict]], key: str, ref: str
) -> tuple[dict[str, dict[str, float]], dict[str, str], dict[str, float]]:
    """Per ratio: every system's ``key`` score, the best Tangram system (``tangram`` on a tie)
    and its score minus ``ref``'s."""
    points: dict[str, dict[str, float]] = {}
    best: dict[str, str] = {}
    minus_full: dict[str, float] = {}
    for r, cells in by_ratio.items():
        scores = {s: c[key] for s, c in cells.items() if c.get(key) is not None}
        points[r] = scores
        ours = {s: v for s, v in scores.items() if s in TANGRAM_SYSTEMS}
        if not ours:
            continue
        top = max(ours, key=lambda s: (ours[s], s == "tangram"))
        best[r] = top
        if ref in scores:
            minus_full[r] = round(ours[top] - scores[ref], 2)
    return points, best, minus_full


def _full_reference(results: dict[str, Any]) -> str:
    """``full`` (stock SGLang) when it ran, else ``full-hf`` (same weights in transformers)."""
    ran = {system for by_ratio in results.values() for c in by_ratio.values() for system in c}
    return "full" if "full" in ran or "full-hf" not in ran else "full-hf"


def _diffs(results: dict[str, Any], a: str, b: str) -> list[tuple[float, float]]:
    out = []
    for by_ratio in results.values():
        for r, cells in by_ratio.items():
            d = _sub(cells.get(a), cells.get(b))
            if d is not None:
                out.append((float(r), d))
    return out


def _sub(a: dict | None, b: dict | None) -> float | None:
    if a is None or b is None or a[METRIC] is None or b[METRIC] is None:
        return None
    return round(a[METRIC] - b[METRIC], 2)


def _mean(values: list[float]) -> float | None:
    return round(float(np.mean(values)), 2) if values else None


def markdown_table(rep: dict[str, Any]) -> str:
    """A RESULTS.md table: one row per (task, ratio), one column per system (points)."""
    systems = ["full", *TANGRAM_SYSTEMS, *GRID_SYSTEMS, "dynamic-ada-snapkv", "uniform-snapkv"]
    present = {s for by_ratio in rep["results"].values() for c in by_ratio.values() for s in c}
    systems = [s for s in [*systems, "kvzip", "kvzip-budgets"] if s in present]
    # then every other system of the report (the diagnostic presses), full-hf last
    systems += sorted(present - {*systems, "full-hf"}) + ["full-hf"] * ("full-hf" in present)
    lines = [
        f"| task | ratio | kept | {' | '.join(systems)} | n |",
        "|---|---|---|" + "---|" * len(systems) + "---|",
    ]
    for task, by_ratio in rep["results"].items():
        for r, cells in by_ratio.items():
            vals = [cells.get(s, {}).get(METRIC) for s in systems]
            kept = cells.get("tangram", {}).get("kept_fraction")
            n = max((c["num_scored"] for c in cells.values()), default=0)
            lines.append(
                f"| {task} | {r} | {kept if kept is not None else '-'} | "
                + " | ".join("-" if v is None else f"{v:.1f}" for v in vals)
                + f" | {n} |"
            )
    return "\n".join(lines)


def merge_per_ratio(
    mappings: list[dict[str, dict[str, Any]] | None], field: str
) -> dict[str, dict[str, Any]] | None:
    """The union of several runs' ``config.<field>`` (a :data:`PER_RATIO_FIELDS` field:
    ``profile_files``, ``profile_scorer_options``); None entries: runs that recorded none
    (reports written before the field); None when every entry is None.

    Raises:
        ConfigError: a mapping of another shape, or two runs that recorded different values for
            one (system, ratio): another profile file, or a profile with other scorer options
            (names the options that differ).
    """
    from tangram_sglang.errors import ConfigError

    is_value, what, shown = PER_RATIO_FIELDS[field]
    if all(m is None for m in mappings):
        return None
    merged: dict[str, dict[str, Any]] = {}
    for mapping in mappings:
        ok = mapping is None or (
            isinstance(mapping, dict)
            and all(
                isinstance(values, dict) and all(is_value(v) for v in values.values())
                for values in mapping.values()
            )
        )
        if not ok:
            raise ConfigError(
                f"config.{field} must map each system to {{ratio: {what}}}; got {str(mapping)[:80]}"
            )
        for system, values in (mapping or {}).items():
            mine = merged.setdefault(system, {})
            for ratio, value in values.items():
                if mine.setdefault(ratio, value) != value:
                    one, other = _differing(mine[ratio], value)
                    raise ConfigError(
                        f"{system} at ratio {ratio} read {shown.format(one)} in one run and "
                        f"{shown.format(other)} in another; run them with the same --profile-dir"
                    )
    return merged


def _differing(one: Any, other: Any) -> tuple[str, str]:
    """Two conflicting values as a message shows them: of two dicts (scorer options), only the
    options whose values differ (``window_share=0.25`` / ``window_share unset``); any other
    value whole."""
    if not (isinstance(one, dict) and isinstance(other, dict)):
        return str(one), str(other)
    unset = object()
    keys = [k for k in {**one, **other} if one.get(k, unset) != other.get(k, unset)]

    def shown(options: dict[str, Any]) -> str:
        return ", ".join(f"{k}={options[k]!r}" if k in options else f"{k} unset" for k in keys)

    return shown(one), shown(other)


def dumps(rep: dict[str, Any]) -> str:
    """The report as JSON text: indented, except one line per record (a record's ``output_ids``
    one token per line made a 30-sample report about 1 MB; this keeps it near 0.6 MB and a diff
    shows one line per changed record). ``json.loads`` gives ``rep`` back.
    """
    if not isinstance(rep.get("records"), list) or not rep["records"]:
        return json.dumps(rep, indent=1) + "\n"
    head = json.dumps({k: v for k, v in rep.items() if k != "records"}, indent=1)
    lines = ",\n".join("  " + json.dumps(r, ensure_ascii=False) for r in rep["records"])
    return head[:-2] + ',\n "records": [\n' + lines + "\n ]\n}\n"


def _merged_config(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """The first report's ``config`` with every report's systems, ratios (high to low),
    profile files and their scorer options (:func:`merge_per_ratio`; reports written before
    one of those fields have none of it).

    Raises:
        ConfigError: as :func:`merge_per_ratio`.
    """
    ratios = sorted({r for rep in reports for r in rep["config"]["ratios"]}, reverse=True)
    systems = list(dict.fromkeys(s for rep in reports for s in rep["config"]["systems"]))
    per_ratio = {
        field: merge_per_ratio([rep["config"].get(field) for rep in reports], field)
        for field in PER_RATIO_FIELDS
    }
    return dict(reports[0]["config"], systems=systems, ratios=ratios, **per_ratio)


def merge(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One report from runs of other systems on the first run's samples (or a subset of them).

    Scores are over the samples every system of a task finished (:func:`common_samples`); the
    merged report lists them in ``scored_samples``.

    A (system, ratio) may come from several runs (processes that split the samples, e.g.
    ``--skip``) as long as no sample of it is in two of them.

    Raises:
        ConfigError: a run used samples the first run does not hold, two runs hold the same
            (system, ratio, sample), the runs used different protocols or devices, or two
            runs read different profile files, or profiles with different scorer options,
            for one (system, ratio).
    """
    from tangram_sglang.errors import ConfigError

    first = reports[0]
    protocols = [protocol_name(rep) for rep in reports]
    if len(set(protocols)) > 1:
        raise ConfigError(f"merge: the reports were run with different protocols {protocols}")
    devices = [device_name(rep) for rep in reports]
    if len(set(devices)) > 1:
        raise ConfigError(f"merge: the reports were run on different devices {devices}")
    ids = [s["sample_id"] for s in first["samples"]]
    seen: set[tuple] = set()
    for rep in reports:
        if not {s["sample_id"] for s in rep["samples"]} <= set(ids):
            raise ConfigError("merge: the reports were run on different samples")
        cells = {(r["system"], r["ratio"], r["sample_id"]) for r in rep["records"]}
        if cells & seen:
            twice = sorted(cells & seen, key=str)[:3]
            raise ConfigError(f"merge: (system, ratio, sample) {twice} in two reports")
        seen |= cells
    records = common_samples([r for rep in reports for r in rep["records"]])
    config = _merged_config(reports)
    results = aggregate(records, tuple(config["ratios"]))
    scored = sorted({r["sample_id"] for r in records})
    return dict(
        first,
        config=config,
        results=results,
        summary=summary(results, records),
        records=records,
        command=[rep["command"] for rep in reports],
        wall_s=[rep["wall_s"] for rep in reports],
        machine=[rep.get("machine") for rep in reports],
        scored_samples=scored,
    )


def common_samples(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Only the records of samples that every (system, ratio) run on that task has finished.

    Runs cut short (a time limit) end on different samples; comparing their means would compare
    different samples. Per task, the kept samples are the intersection over its (system, ratio)
    cells; a system that did not run a task at all does not shrink it.
    """
    done: dict[str, dict[tuple, set[str]]] = defaultdict(lambda: defaultdict(set))
    for rec in records:
        done[rec["task"]][(rec["system"], rec["ratio"])].add(rec["sample_id"])
    keep = {task: set.intersection(*cells.values()) for task, cells in done.items()}
    return [rec for rec in records if rec["sample_id"] in keep[rec["task"]]]


def load_report(path: Any) -> dict[str, Any]:
    """One accuracy JSON (``python -m tangram_sglang.eval --json``) from ``path``.

    Raises:
        ConfigError: unreadable, not JSON, without the ``model``/``config``/``samples``/
            ``records`` keys of a report, or a record without one of ``RECORD_KEYS`` or with a
            value of the wrong type: a score that is not a number, a ``turn`` that is not an
            integer, a ``ratio`` that is neither a number nor null (names the file, the record
            and the key).
    """
    import json

    from tangram_sglang.errors import ConfigError

    try:
        rep = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"report {str(path)!r} is not a readable JSON file: {exc}") from None
    if not isinstance(rep, dict) or not {"model", "config", "samples", "records"} <= rep.keys():
        raise ConfigError(
            f"report {str(path)!r}: not an eval report (model, config, samples, records)"
        )
    if not isinstance(rep["records"], list):
        raise ConfigError(f"report {str(path)!r}: records is not a list of per-question records")
    for i, rec in enumerate(rep["records"]):
        missing = [k for k in RECORD_KEYS if not isinstance(rec, dict) or k not in rec]
        if missing:
            raise ConfigError(
                f"report {str(path)!r}: records[{i}] lacks {', '.join(missing)} (every record of "
                f"python -m tangram_sglang.eval --json has {', '.join(RECORD_KEYS)})"
            )
        wrong = [
            f"{key} is {rec[key]!r}, not {what}"
            for key, (ok, what) in RECORD_TYPES.items()
            if not ok(rec[key])
        ]
        if wrong:
            raise ConfigError(f"report {str(path)!r}: records[{i}]: {'; '.join(wrong)}")
    return rep


def main(argv: list[str] | None = None) -> int:
    """``python -m tangram_sglang.eval.report A.json B.json --json OUT``: merge, print table."""
    import argparse
    import json
    from pathlib import Path

    p = argparse.ArgumentParser(prog="python -m tangram_sglang.eval.report")
    p.add_argument("reports", nargs="+", help="accuracy JSON files of the same samples")
    p.add_argument("--json", required=True, help="merged output")
    args = p.parse_args(argv)
    from tangram_sglang.errors import TangramError

    try:
        rep = merge([load_report(Path(path)) for path in args.reports])
        Path(args.json).write_text(dumps(rep))
    except TangramError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: --json {args.json!r} cannot be written: {exc}", file=sys.stderr)
        return 2
    print(markdown_table(rep))
    print(json.dumps({k: v for k, v in rep["summary"].items() if k != "records"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
