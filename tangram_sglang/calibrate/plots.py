"""Profile plots (matplotlib, Agg): heatmap, sorted budget curve, rank-stability scatter.

1. ``r[layer, kv_head]`` heatmap (layers down, heads across).
2. Sorted budget curve: every head's ratio, highest first, with the head-group boundaries and the
   group ratio (what each member is allocated) as a step line; the gap is padding waste.
3. Rank stability: each head's mean retention on the first half of the samples against the
   second half (split-half, with Spearman rho); falls back to mean vs std without samples.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from scipy.stats import spearmanr

from tangram_sglang.profile import BudgetProfile


def plot_profile(profile: BudgetProfile, out: str | Path) -> Path:
    """Draw the three panels of ``profile`` into a PNG at ``out``; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2))
    _heatmap(fig, axes[0], profile)
    _budget_curve(axes[1], profile)
    _stability(axes[2], profile)
    m = profile.model
    fig.suptitle(
        f"{m.architecture} ({m.num_layers} layers x {m.num_kv_heads} KV heads): {profile.scorer} "
        f"target {profile.target_ratio}, mean r {profile.ratio.mean():.3f}, "
        f"H_p={profile.grouping.heads_per_group} {profile.grouping.scope}"
    )
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _heatmap(fig, ax, profile: BudgetProfile) -> None:
    im = ax.imshow(
        profile.ratio, aspect="auto", cmap="viridis", vmin=0, vmax=1, interpolation="nearest"
    )
    ax.set_xlabel("KV head")
    ax.set_ylabel("layer")
    ax.set_xticks(range(profile.model.num_kv_heads))
    ax.set_title("ratio r[layer, kv_head]")
    fig.colorbar(im, ax=ax, label="r")


def _budget_curve(ax, profile: BudgetProfile) -> None:
    grouping = profile.grouping
    flat = profile.ratio.ravel()
    order = np.argsort(-flat, kind="stable")
    allocated = grouping.group_ratios(profile.ratio)[grouping.cluster_of.ravel()][order]
    x = np.arange(flat.size)
    ax.plot(x, flat[order], ".", ms=4, label="head ratio r")
    ax.step(x, allocated, where="mid", color="C3", lw=1, label="group ratio (allocated)")
    if grouping.scope == "global":
        for b in range(grouping.heads_per_group, flat.size, grouping.heads_per_group):
            ax.axvline(b - 0.5, color="0.85", lw=0.5, zorder=0)
    ax.set_xlabel("heads, sorted by r")
    ax.set_ylabel("ratio")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"sorted budgets, {grouping.num_head_groups} head groups")
    ax.legend(loc="upper right")


def _stability(ax, profile: BudgetProfile) -> None:
    stab = profile.provenance.get("stability") or {}
    halves = stab.get("split_half_mean") or [None, None]
    if halves[0] is not None and halves[1] is not None:
        a, b = np.asarray(halves[0]).ravel(), np.asarray(halves[1]).ravel()
        rho = spearmanr(a, b).statistic if np.ptp(a) and np.ptp(b) else float("nan")
        ax.scatter(
            a,
            b,
            s=10,
            c=np.repeat(np.arange(profile.model.num_layers), profile.model.num_kv_heads),
            cmap="viridis",
        )
        ax.plot([0, 1], [0, 1], color="0.6", lw=0.8)
        ax.set_xlabel("mean retention, first half of samples")
        ax.set_ylabel("mean retention, second half")
        ax.set_title(
            f"rank stability: split-half rho {rho:.3f}; per-sample rho mean "
            f"{_fmt(stab.get('spearman_mean'))} min {_fmt(stab.get('spearman_min'))}",
            fontsize=9,
        )
    elif profile.stats is not None:
        ax.scatter(profile.stats.mean.ravel(), profile.stats.std.ravel(), s=10)
        ax.set_xlabel("mean retention")
        ax.set_ylabel("std of retention")
        ax.set_title("retention band per head (no split-half data)")
    else:
        ax.text(0.5, 0.5, "no calibration statistics", ha="center", va="center")
        ax.set_axis_off()


def _fmt(x: object) -> str:
    return "n/a" if x is None else f"{float(x):.3f}"
