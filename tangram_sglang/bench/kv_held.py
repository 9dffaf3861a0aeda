"""KV bytes Tangram holds vs full KV after a multi-turn workload, per short-segment threshold.

    python -m tangram_sglang.bench.kv_held --workload sharegpt --clients 64 --rounds 4 \
        --thresholds 0 64 128 256 512 1024

CPU only, no model: the real :class:`~tangram_sglang.mem.manager.TangramMemory` plays every
conversation of a ``bench.multiturn`` workload the way the server does (each round's new
prompt tokens, plus the previous round's last sampled token, are one extend segment per
``chunk`` tokens; the reply is the uncompressed decode tail of ``output - 1`` tokens; a finished
round's pages pass to the radix tree and the next round borrows them as its prefix, with the
copy-on-write of partial tail pages). It reports, per ``min_compress_tokens``:

* ``held_over_full``: pages held at the end (the tree) x bytes per page / full KV bytes of the
  same tokens (SGLang's token pool, page size 1);
* ``dense_over_full``: the same for ``ceil(kept / page_size)`` pages per group and conversation
  (what the tree would hold without copy-on-write duplicates);
* ``cow_pages_per_round``: copy-on-write duplicates per (conversation, round boundary);
* ``scored_segments``: extend segments the scorer runs on (some head keeps fewer than n).

Default profile: the skewed synthetic Llama-3.1-8B 0.25 (H_p 4, global: G = 64), page 16.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import numpy as np

from tangram_sglang.bench.multiturn_workloads import WorkloadSpec, make_conversations
from tangram_sglang.bench.synthetic import GEOMETRIES, skewed_profile
from tangram_sglang.mem.manager import PrefixMatch, TangramMemory
from tangram_sglang.profile import BudgetProfile


def kv_held(
    profile: BudgetProfile,
    rounds: list[tuple[tuple[int, int], ...]],
    page_size: int = 16,
    chunk: int = 8192,
) -> dict[str, Any]:
    """Play ``rounds`` (per conversation: ``(new_input, output)`` tokens) and count pages.

    Returns:
        ``held_over_full``, ``dense_over_full``, ``cow_pages_per_round``, ``scored_segments``,
        ``segments`` and ``tokens`` (see the module docstring).
    """
    layers, kv_heads = profile.model.num_layers, profile.model.num_kv_heads
    total = sum(a + b for conv in rounds for a, b in conv)
    groups = profile.grouping.num_head_groups
    width = -(-total // page_size) + 2
    num_pages = groups * (total // page_size + 4 * sum(len(c) for c in rounds)) + 16
    mem = TangramMemory(profile, page_size, num_pages, 1, width, None, "cpu", False)
    held: list[np.ndarray] = []  # pages the "tree" holds
    tokens = dense = scored = segments = boundaries = 0
    for conv in rounds:
        lens, table, carry = np.zeros(groups, np.int64), None, 0
        for i, (new, out) in enumerate(conv):
            extend = new + carry  # the previous round's last sampled token has no KV yet
            prefix = None if table is None else PrefixMatch(table, lens)
            pieces = [min(chunk, extend - s) for s in range(0, extend, chunk)]
            tail = max(out - 1, 0)
            for j, n in enumerate(pieces):
                last = j == len(pieces) - 1
                t = tail + 1 if last else 0
                ok = mem.admit(0, "c", n, t, prefix) if j == 0 else mem.admit_chunk(0, n, t)
                assert ok is not None
                kept = np.asarray(profile.group_kept_lens(n))
                scored += int(kept.min() < n)
                segments += 1
                mem.alloc_extend(0, n)
                mem.commit_extend(0)
            for _ in range(tail):
                mem.alloc_decode([0])
            boundaries += int(i > 0)
            tokens += extend + tail
            lens = mem.table.lens[0].copy()
            table = [mem.group_pages(0, g) for g in range(groups)]
            held += [p for seg in mem.finish(0) for p in seg.pages]
            carry = 1 if out > 0 else 0
        dense += int((-(-lens // page_size)).sum())
    cells = profile.grouping.heads_per_group * page_size  # (token, head) slots per page
    full = tokens * layers * kv_heads
    held_pages = int(sum(p.size for p in held))
    return {
        "held_over_full": round(held_pages * cells / full, 4),
        "dense_over_full": round(dense * cells / full, 4),
        "cow_pages_per_round": round((held_pages - dense) / max(boundaries, 1), 2),
        "scored_segments": scored,
        "segments": segments,
        "tokens": tokens,
    }


def main(argv: list[str] | None = None) -> int:
    """CLI: one line (or JSON) per threshold."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="sharegpt", choices=["sharegpt", "cliff"])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--ratio", type=float, default=0.25, help="profile mean kept ratio")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--thresholds", type=int, nargs="+", default=[0, 64, 128, 256, 512, 1024])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    spec = WorkloadSpec(args.workload, args.clients, args.rounds)
    rounds = [c.rounds for c in make_conversations(spec)]
    if args.ratio < 1.0:
        base = skewed_profile("llama3-8b", args.ratio, 4, "global")
    else:
        layers, kv_heads, _, _ = GEOMETRIES["llama3-8b"]
        base = skewed_profile("llama3-8b", 0.25, 4, "global").rescaled(1.0)
        assert base.ratio.shape == (layers, kv_heads)
    rows = {
        t: kv_held(base.with_min_compress_tokens(t), rounds, args.page_size)
        for t in args.thresholds
    }
    if args.json:
        json.dump(rows, sys.stdout, indent=1)
        print()
        return 0
    print(f"{spec.label}, ratio {args.ratio}, page {args.page_size}")
    for t, r in rows.items():
        print(f"min_compress_tokens {t:>5}: " + ", ".join(f"{k} {v}" for k, v in r.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
