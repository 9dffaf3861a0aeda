"""Plot output throughput vs kept ratio (Tangram at each ratio, stock full KV) from the JSON.

    python -m tangram_sglang.bench.plot_multiturn benchmarks/results/multiturn-h200.json \
        --workload cliff-64 --output benchmarks/results/multiturn-h200-kept-ratio.png

Reads ``bench.multiturn``'s result file: every ``tangram-rR`` system gives one point (x = R, the
profile's mean kept fraction, y = output tokens/s of ``--workload``); every stock system
(``baseline``, ``baseline-*``) is full KV, drawn at x = 1.0 and as a dashed level across. Ratios
with no measurement are left out (the title names none: the JSON is the record).

Source: issue 7 ("throughput vs kept ratio 100/50/25/10%, both systems").
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tangram_sglang.errors import ConfigError


def points(result: dict, workload: str) -> tuple[list[tuple[float, float]], dict[str, float]]:
    """``(tangram [(ratio, tok/s)] sorted by ratio, {stock system: tok/s})`` of ``workload``.

    Raises:
        ConfigError: not a ``bench.multiturn`` result (no ``systems`` object, a ``tangram-rR``
            name without a number), or no system measured ``workload``.
    """
    systems = result.get("systems") if isinstance(result, dict) else None
    if not isinstance(systems, dict):
        raise ConfigError("result: not a bench.multiturn JSON (no 'systems' object)")
    tangram, stock = [], {}
    for name, system in systems.items():
        run = ((system or {}).get("workloads") or {}).get(workload) or {}
        tok_s = run.get("output_tok_per_s")
        if tok_s is None:
            continue
        if name.startswith("tangram-r"):
            try:
                tangram.append((float(name.removeprefix("tangram-r")), float(tok_s)))
            except ValueError:
                raise ConfigError(f"result: system {name!r} is not tangram-r<ratio>") from None
        elif name.startswith("baseline"):
            stock[name] = float(tok_s)
    if not tangram and not stock:
        raise ConfigError(f"no system in the file measured workload {workload!r}; see --workload")
    return sorted(tangram), stock


def plot(result: dict, workload: str, output: str) -> None:
    """Write the PNG (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tangram, stock = points(result, workload)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    if tangram:
        xs, ys = zip(*tangram, strict=True)
        # zorder 3: Tangram's point at 1.0 stays above the stock markers there
        ax.plot(xs, ys, "o-", color="tab:green", label="Tangram (--tangram-target-ratio)", zorder=3)
        for x, y in tangram:
            ax.annotate(
                f"{y:.0f}",
                (x, y),
                textcoords="offset points",
                xytext=(0, 6),
                ha="center",
                fontsize=8,
            )
    colors = ("tab:blue", "tab:orange", "tab:red", "tab:purple")
    for (name, y), color in zip(sorted(stock.items()), colors, strict=False):
        label = f"stock SGLang, full KV ({name.removeprefix('baseline').strip('-') or 'triton'})"
        ax.axhline(y, ls="--", lw=1, color=color)
        ax.plot([1.0], [y], "s", color=color, label=label)
        # at the left end of its level: the markers at 1.0 are left to the Tangram point there
        ax.annotate(
            f"{y:.0f}", (0.0, y), textcoords="offset points", xytext=(4, 3), fontsize=8, color=color
        )
    ax.set_xlabel("kept ratio (mean kept fraction of KV)")
    ax.set_ylabel("output tokens / s")
    ax.set_xticks([0.1, 0.25, 0.5, 1.0])
    ax.set_xlim(0, 1.08)
    ax.set_ylim(bottom=0)
    model = Path(str(result.get("model_path", ""))).name  # the result's model, not a fixed one
    ax.set_title(f"{workload}, {result.get('machine', '')}, {model}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(output, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """CLI (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("result", help="bench.multiturn JSON")
    p.add_argument("--workload", default="cliff-64")
    p.add_argument("--output", required=True, help="PNG path")
    args = p.parse_args(argv)
    try:
        result = json.loads(Path(args.result).read_text())
    except (OSError, ValueError) as exc:
        print(
            f"plot_multiturn: result {args.result!r} is not a readable JSON file: {exc}",
            file=sys.stderr,
        )
        return 2
    try:
        plot(result, args.workload, args.output)
    except ConfigError as exc:
        print(f"plot_multiturn: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"plot_multiturn: --output {args.output!r} cannot be written: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
