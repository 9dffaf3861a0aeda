"""Where one server loses time to another, by how many requests were running.

SGLang's scheduler logs one ``Decode batch`` line every ``--decode-log-interval`` decode steps
(40 by default) with the requests running and the generation throughput since the previous
line: the tokens generated over the wall time of the window, prefill batches run inside it
included. Two servers fed the same request stream (``bench.multiturn`` seeds every workload)
log their windows in the same order, so pairing them line by line and summing each window's
time by the number of requests running tells *when* one loses to the other: at round starts
with many requests prefilling and decoding, or in the tails with a few long ones.

A window's time is ``interval * running / throughput`` (s): the line's running count stands for
every step of its window, so a window where requests finish or arrive is approximate, the same
way for both servers.

    python -m tangram_sglang.bench.decode_windows STOCK.server.log TANGRAM.server.log

reads whole logs (every run in them, the warm-ups too; windows longer than ``--max-window-s``,
which hold idle time between runs, are left out); ``bench.multiturn`` stores each measured
run's own lines (``decode_log``) and their pairing against the best stock system
(``summary.vs_best_stock.<system>.<workload>.decode_windows``).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

DECODE_LINE = re.compile(
    r"Decode batch(?: \[\d+\])?, #running-req: (\d+), #token: (\d+),.*"
    r"gen throughput \(token/s\): ([\d.]+)"
)
BINS = (1, 5, 20, 55)  # lower edges of the running-request bins
INTERVAL = 40  # SGLang's default --decode-log-interval


def parse_decode_lines(text: str) -> list[list[float]]:
    """``[[running requests, tokens held, generation tok/s], ...]`` of SGLang's decode log lines
    in ``text``, in order (other lines ignored)."""
    return [
        [int(m.group(1)), int(m.group(2)), float(m.group(3))] for m in DECODE_LINE.finditer(text)
    ]


def window_seconds(line: list[float], interval: int = INTERVAL) -> float:
    """Wall time (s) of the window a decode line closes: ``interval * running / tok/s``
    (inf where the throughput is 0)."""
    running, _, tps = line
    return interval * running / tps if tps > 0 else float("inf")


def bin_label(running: int, bins: tuple[int, ...] = BINS) -> str:
    """``"lo-hi"`` (or ``"lo+"`` for the last) of the bin whose lower edge is the largest at or
    below ``running``; ``"0"`` below the first edge."""
    edges = [b for b in bins if b <= running]
    if not edges:
        return "0"
    i = bins.index(edges[-1])
    return f"{bins[i]}+" if i == len(bins) - 1 else f"{bins[i]}-{bins[i + 1] - 1}"


def paired_seconds(
    base: list[list[float]],
    other: list[list[float]],
    bins: tuple[int, ...] = BINS,
    interval: int = INTERVAL,
    max_window_s: float | None = None,
) -> dict:
    """Pair two servers' decode windows in order and sum their times by requests running.

    Args:
        base, other: :func:`parse_decode_lines` of the same request stream on two servers (the
            base is the one compared against, e.g. stock SGLang). Pairs go up to the shorter
            list; the bin is the base's running count.
        bins: ascending lower edges of the bins (requests running).
        interval: decode steps per log line (SGLang's ``--decode-log-interval``).
        max_window_s: leave out a pair where either window is longer (s): such a window holds
            time the server sat idle (between runs in a whole log); None keeps every pair
            except those with a throughput of 0 (an unbounded window), which are always left
            out.

    Returns:
        ``{"windows": n paired, "unpaired": |len(base) - len(other)|, "dropped": pairs left
        out (``max_window_s``, or a throughput of 0), "bins": {label:
        {"windows", "base_s", "other_s", "speed"}}, "all": {...}}``, where ``speed`` =
        ``base_s / other_s`` (above 1: the other server is faster in those windows).

    Raises:
        ValueError: ``bins`` empty or not ascending distinct, or ``interval`` < 1.
    """
    if not bins or list(bins) != sorted(set(bins)):
        raise ValueError(f"bins {list(bins)} must be ascending distinct edges, e.g. 1,5,20,55")
    if interval < 1:
        raise ValueError(f"interval {interval}: decode steps per log line, must be >= 1")
    out: dict[str, dict] = {}
    total = {"windows": 0, "base_s": 0.0, "other_s": 0.0}
    dropped = 0
    for b, o in zip(base, other, strict=False):
        tb, to = window_seconds(b, interval), window_seconds(o, interval)
        longest = max(tb, to)
        if longest == float("inf") or (max_window_s is not None and longest > max_window_s):
            dropped += 1
            continue
        cell = out.setdefault(
            bin_label(int(b[0]), bins), {"windows": 0, "base_s": 0.0, "other_s": 0.0}
        )
        for acc in (cell, total):
            acc["windows"] += 1
            acc["base_s"] += tb
            acc["other_s"] += to
    for acc in (*out.values(), total):
        acc["speed"] = acc["base_s"] / acc["other_s"] if acc["other_s"] else None
    order = {bin_label(b, bins): i for i, b in enumerate(bins)}
    return {
        "windows": total["windows"],
        "unpaired": abs(len(base) - len(other)),
        "dropped": dropped,
        "bins": {k: out[k] for k in sorted(out, key=lambda k: order.get(k, -1))},
        "all": total,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tangram_sglang.bench.decode_windows",
        description="Pair two SGLang server logs' decode windows (same request stream) and sum "
        "their wall time by requests running. Output (JSON): per bin, windows, base_s, other_s "
        "and speed = base_s / other_s (above 1: the second server is faster there); "
        "'unpaired': windows one log has beyond the other (0 for the same request stream); "
        "'dropped': pairs left out as idle (--max-window-s) or with a throughput of 0.",
    )
    p.add_argument("base_log", type=Path, help="the server compared against (e.g. stock)")
    p.add_argument("other_log", type=Path, help="the other server's log")
    p.add_argument(
        "--bins",
        default=",".join(map(str, BINS)),
        help="ascending lower edges of the running-request bins (default %(default)s)",
    )
    p.add_argument(
        "--interval", type=int, default=INTERVAL, help="--decode-log-interval (default 40)"
    )
    p.add_argument(
        "--max-window-s",
        type=float,
        default=10.0,
        help="leave out pairs with a window longer than this (s): idle time between runs "
        "(default %(default)s)",
    )
    args = p.parse_args(argv)
    try:
        bins = tuple(int(x) for x in args.bins.split(","))
    except ValueError:
        p.error(f"--bins {args.bins!r}: comma-separated integers, e.g. 1,5,20,55")
    if list(bins) != sorted(set(bins)):
        p.error(f"--bins {args.bins!r}: ascending distinct edges, e.g. 1,5,20,55")
    if args.interval < 1:
        p.error(f"--interval {args.interval}: the server's --decode-log-interval, >= 1")
    if not math.isfinite(args.max_window_s) or args.max_window_s <= 0:
        p.error(f"--max-window-s {args.max_window_s}: a window length in seconds, > 0")
    lines = []
    for path in (args.base_log, args.other_log):
        if path.is_dir():
            p.error(f"{path} is a folder; give the server's log file")
        if not path.is_file():
            p.error(f"{path}: no such log file")
        lines.append(parse_decode_lines(path.read_text(errors="replace")))
        if not lines[-1]:
            p.error(
                f"{path} holds no 'Decode batch' line (SGLang logs one per "
                "--decode-log-interval decode steps)"
            )
    result = paired_seconds(
        *lines, bins=bins, interval=args.interval, max_window_s=args.max_window_s
    )
    if result["unpaired"]:
        print(
            f"decode_windows: the logs differ by {result['unpaired']} windows; pairs are only "
            "meaningful for the same request stream (e.g. two bench.multiturn runs)",
            file=sys.stderr,
        )
    json.dump(result, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
