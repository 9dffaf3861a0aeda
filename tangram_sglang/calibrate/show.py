"""``python -m tangram_sglang.profile show PROFILE [--plot out.png]``: summary table and plots."""

from __future__ import annotations

import argparse
import sys

import numpy as np

from tangram_sglang.errors import TangramError
from tangram_sglang.profile import BudgetProfile


def summary(profile: BudgetProfile) -> str:
    """A plain-text summary: identity, budgets, grouping, calibration figures, waste table."""
    m, g = profile.model, profile.grouping
    r = profile.ratio
    lines = [
        f"model        {m.architecture}: {m.num_layers} layers x {m.num_kv_heads} KV heads "
        f"({m.num_qo_heads} query heads), head_dim {m.head_dim}",
        f"scorer       {profile.scorer}, target ratio {profile.target_ratio}, sink "
        f"{profile.sink_tokens}, recent window {profile.recent_window}",
        f"ratios       mean {r.mean():.4f}  min {r.min():.4f}  max {r.max():.4f}  "
        f"(heads at 1.0: {int((r >= 1.0).sum())})",
        f"grouping     H_p={g.heads_per_group} {g.scope}: {g.num_head_groups} groups, mean group "
        f"ratio {profile.group_ratios.mean():.4f}",
        "layer mean r " + " ".join(f"{x:.2f}" for x in r.mean(axis=1)),
    ]
    if profile.stats is not None:
        s = profile.stats
        lines.append(
            f"calibration  {s.num_samples} samples, alpha {s.alpha}, mean retention "
            f"{s.mean.mean():.4f}, mean std {s.std.mean():.4f}"
        )
    stab = profile.provenance.get("stability")
    if stab:
        lines += _stability_lines(stab)
    timing = profile.provenance.get("timing_s")
    if timing:
        lines.append("timing (s)   " + ", ".join(f"{k} {v}" for k, v in timing.items()))
    return "\n".join(lines)


def _stability_lines(stab: dict) -> list[str]:
    def f(x: object) -> str:
        return "n/a" if x is None else f"{float(x):.4f}"

    lines = [
        f"stability    Spearman mean {f(stab.get('spearman_mean'))} min "
        f"{f(stab.get('spearman_min'))}; heads with std < 0.05: "
        f"{f(stab.get('frac_std_below_0.05'))}",
        f"kept         target {f(stab.get('target_kept_fraction'))}, profile per head "
        f"{f(stab.get('expected_kept_fraction_heads'))}, with grouping "
        f"{f(stab.get('expected_kept_fraction_groups'))} (share of full KV at calib lengths)",
        "padding waste   H_p=" + "      ".join(str(h) for h in (1, 2, 4, 8)),
    ]
    for scope, row in (stab.get("padding_waste") or {}).items():
        cells = "  ".join(f"{f(row.get(str(h))):>7s}" for h in (1, 2, 4, 8))
        lines.append(f"  {scope:10s}  {cells}")
    return lines


def main(argv: list[str] | None = None) -> int:
    """``show PROFILE [--plot PNG]``; returns the exit status (2 on a bad profile)."""
    parser = argparse.ArgumentParser(prog="python -m tangram_sglang.profile")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("show", help="print a profile's summary and optionally plot it")
    p.add_argument("profile")
    p.add_argument("--plot", default=None, help="write the three-panel PNG here")
    args = parser.parse_args(argv)
    try:
        profile = BudgetProfile.load(args.profile)
    except TangramError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    np.set_printoptions(precision=3)
    print(summary(profile))
    if args.plot:
        from tangram_sglang.calibrate.plots import plot_profile

        try:
            print(f"wrote {plot_profile(profile, args.plot)}")
        except OSError as exc:
            print(f"error: --plot {args.plot}: cannot write the figure ({exc})", file=sys.stderr)
            return 2
    return 0
