"""Per-head kept budgets: Tangram's static profile vs the dynamic Ada-SnapKV allocation.

Reads an ``accuracy.json`` whose kvpress records carry ``kept_per_head`` (``[layer][kv_head]``
context entries the press kept on that sample, recorded by the runner) and compares them, per
sample, with what Tangram's profile keeps of the same context (``group_kept_lens`` of the head's
group: the static budget, Tangram arXiv 2606.06302 §4.1). Answers "which heads' budgets were too
small" for the issue-8 targets: where the dynamic method gave a head more than the profile did.

CLI::

    python -m tangram_sglang.eval.budgets benchmarks/results/accuracy.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
from scipy.stats import spearmanr

from tangram_sglang.errors import TangramError
from tangram_sglang.eval.report import load_report
from tangram_sglang.eval.runner import shipped_profile
from tangram_sglang.eval.systems import tangram_profile
from tangram_sglang.profile import BudgetProfile

DYNAMIC = "dynamic-ada-snapkv"


def tangram_kept_per_head(profile: BudgetProfile, num_tokens: int) -> np.ndarray:
    """Entries each KV head keeps of a ``num_tokens`` segment: ``[layers, kv_heads]`` int64."""
    group_len = np.array(profile.group_kept_lens(num_tokens), dtype=np.int64)
    return group_len[profile.grouping.cluster_of]


def compare(rep: dict[str, Any], profiles: dict[float, BudgetProfile]) -> dict[str, Any]:
    """Per ratio: how the profile's per-head budgets differ from the dynamic allocation.

    Returns ``{ratio: {...}}`` with, over the samples: ``spearman_mean_allocation`` (rank
    correlation of the mean dynamic per-head share and the profile's), ``share_of_heads_below``
    (share of (sample, head) pairs where Tangram keeps fewer entries than dynamic AdaKV),
    ``mean_deficit_share`` (mean of ``(dynamic - tangram) / n`` over those pairs) and
    ``largest_deficits`` (the 5 heads with the largest mean shortfall, as
    ``(layer, kv_head, tangram_share, dynamic_share)``).
    """
    out: dict[str, Any] = {}
    for ratio, profile in sorted(profiles.items()):
        recs = [
            r
            for r in rep["records"]
            if r["system"] == DYNAMIC and r["ratio"] == ratio and "kept_per_head" in r
        ]
        if not recs:
            continue
        dyn = np.array([np.array(r["kept_per_head"]) / r["context_prompt_tokens"] for r in recs])
        tan = np.array(
            [
                tangram_kept_per_head(profile, r["context_prompt_tokens"])
                / r["context_prompt_tokens"]
                for r in recs
            ]
        )  # both [samples, layers, kv_heads], shares of the context
        below = tan < dyn
        deficit = (dyn - tan).mean(axis=0)
        order = np.argsort(deficit, axis=None)[::-1][:5]
        worst = [
            (
                int(layer),
                int(head),
                round(float(tan[:, layer, head].mean()), 3),
                round(float(dyn[:, layer, head].mean()), 3),
            )
            for layer, head in zip(*np.unravel_index(order, deficit.shape), strict=True)
        ]
        out[str(ratio)] = {
            "num_samples": len(recs),
            "kept_share_tangram": round(float(tan.mean()), 4),
            "kept_share_dynamic": round(float(dyn.mean()), 4),
            "spearman_mean_allocation": round(
                float(spearmanr(dyn.mean(axis=0).ravel(), tan[0].ravel()).statistic), 3
            ),
            "share_of_heads_below": round(float(below.mean()), 3),
            "mean_deficit_share": round(float((dyn - tan)[below].mean()), 3) if below.any() else 0,
            "largest_deficits": worst,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m tangram_sglang.eval.budgets REPORT [--profile-dir D]``: print the comparison."""
    import argparse

    from tangram_sglang.models import model_path

    p = argparse.ArgumentParser(prog="python -m tangram_sglang.eval.budgets")
    p.add_argument("report", help="accuracy JSON with kvpress records (kept_per_head)")
    p.add_argument("--profile-dir", default=None, help="default calibration/<model>")
    args = p.parse_args(argv)
    try:
        rep = load_report(Path(args.report))
        repo = Path(__file__).resolve().parents[2]
        profile_dir = Path(args.profile_dir or repo / "calibration" / rep["model"])
        model_dir = model_path(rep["model"])
        ratios = {r["ratio"] for r in rep["records"] if r["system"] == DYNAMIC and r["ratio"]}
        profiles = {
            r: tangram_profile(shipped_profile(profile_dir, r, model_dir), r)
            for r in sorted(ratios)
        }
    except TangramError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(compare(rep, profiles), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
