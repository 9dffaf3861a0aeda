"""Host cost of one request's page lifecycle vs pool size (CPU; no model, no server).

    python -m tangram_sglang.bench.lifecycle --pool-pages 200000 3154477 --json

Drives the real :class:`~tangram_sglang.mem.manager.TangramMemory` (accounting only, no K/V
storage) the way the radix cache and the attention backend do for a two-turn chat:

  turn 1   admit -> alloc_extend -> commit_extend -> ``decode_steps`` x alloc_decode -> finish
           (its segments pass to an outside holder, as to a radix node)
  turn 2   admit with turn 1 as the prefix (incref of every borrowed page) -> alloc_extend
           (copy-on-write of the shared partial tail pages: a free) -> commit_extend -> finish
  evict    free_pages of both turns' segments (radix eviction)

and reports the best-of-``repeats`` wall time of each call in milliseconds. The lifecycle must
cost O(pages touched): the times must not grow with the pool (``--pool-pages``); only
``TANGRAM_DEBUG_POOL=1`` adds the O(num_pages) self-check.

Default shape: Llama-3.1-8B KV geometry (32 layers x 8 KV heads), the skewed synthetic 0.25
profile, H_p = 4 global grouping (G = 64 head groups), page 16, a 1,000-token first turn, 20
decode steps and a 100-token second turn (ShareGPT-like).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from tangram_sglang.bench.synthetic import skewed_profile
from tangram_sglang.mem.manager import PrefixMatch, TangramMemory
from tangram_sglang.profile import BudgetProfile

CALLS = (
    "admit",
    "alloc_extend",
    "commit_extend",
    "alloc_decode",
    "finish",
    "admit_prefix",
    "alloc_extend_prefix",
    "commit_extend_prefix",
    "finish_prefix",
    "free_pages",
)


class _Timer:
    """Best-of time per call name: ``with timer("admit"): ...``."""

    def __init__(self) -> None:
        self.best: dict[str, float] = {}  # ms
        self._name, self._start = "", 0.0

    def __call__(self, name: str) -> _Timer:
        self._name = name
        return self

    def __enter__(self) -> None:
        self._start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        ms = (time.perf_counter() - self._start) * 1e3
        self.best[self._name] = min(self.best.get(self._name, float("inf")), ms)


def lifecycle_cost(
    num_pages: int,
    profile: BudgetProfile | None = None,
    page_size: int = 16,
    first_turn_tokens: int = 1000,
    second_turn_tokens: int = 100,
    decode_steps: int = 20,
    repeats: int = 5,
    max_context_tokens: int = 16384,
    debug: bool = False,
) -> dict[str, float]:
    """Best-of-``repeats`` host time (ms) of each call of a two-turn lifecycle on one pool.

    Args:
        num_pages: pool pages including the padding page 0.
        profile: budget profile (default: the skewed synthetic Llama-3.1-8B 0.25, H_p 4 global).
        page_size: tokens per page.
        first_turn_tokens / second_turn_tokens: extend segment lengths (tokens).
        decode_steps: decode tokens of turn 1 (timed per step, the best step is reported).
        repeats: lifecycles run; each call's minimum over them is reported.
        max_context_tokens: page table width (tokens per group).
        debug: run the O(num_pages) self-check after every call (``TANGRAM_DEBUG_POOL``).

    Returns:
        ``{call: ms}`` for every name in :data:`CALLS`, plus ``"total"`` (their sum, with
        ``alloc_decode`` counted ``decode_steps`` times).
    """
    prof = profile if profile is not None else skewed_profile("llama3-8b", 0.25, 4, "global")
    width = -(-max_context_tokens // page_size)
    mem = TangramMemory(prof, page_size, num_pages, 2, width, None, "cpu", debug)
    groups = mem.num_head_groups
    timer = _Timer()
    for i in range(repeats):
        with timer("admit"):
            mem.admit(0, f"a{i}", first_turn_tokens, decode_steps + 1)
        with timer("alloc_extend"):
            mem.alloc_extend(0, first_turn_tokens)
        with timer("commit_extend"):
            mem.commit_extend(0)
        for _ in range(decode_steps):
            with timer("alloc_decode"):
                mem.alloc_decode([0])
        prefix = PrefixMatch(
            [mem.group_pages(0, g) for g in range(groups)], mem.table.lens[0].copy()
        )
        with timer("finish"):
            first = mem.finish(0)
        with timer("admit_prefix"):
            mem.admit(1, f"b{i}", second_turn_tokens, 1, prefix)
        with timer("alloc_extend_prefix"):
            mem.alloc_extend(1, second_turn_tokens)
        with timer("commit_extend_prefix"):
            mem.commit_extend(1)
        with timer("finish_prefix"):
            second = mem.finish(1)
        held = np.concatenate([ids for seg in first + second for ids in seg.pages])
        with timer("free_pages"):
            mem.free_pages(held, "bench")
    times = timer.best
    total = sum(times[c] for c in CALLS) + times["alloc_decode"] * (decode_steps - 1)
    return {**{c: round(times[c], 4) for c in CALLS}, "total": round(total, 4)}


def main(argv: list[str] | None = None) -> int:
    """CLI: print the per-call cost for each pool size (a table, or JSON with ``--json``)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pool-pages", type=int, nargs="+", default=[200_000, 3_154_477])
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--debug", action="store_true", help="O(pool) self-check after every call")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = {
        n: lifecycle_cost(n, page_size=args.page_size, repeats=args.repeats, debug=args.debug)
        for n in args.pool_pages
    }
    if args.json:
        json.dump({str(n): r for n, r in rows.items()}, sys.stdout, indent=1)
        print()
        return 0
    print(f"{'call (ms)':<22}" + "".join(f"{n:>14,}" for n in rows))
    for call in (*CALLS, "total"):
        print(f"{call:<22}" + "".join(f"{r[call]:>14.3f}" for r in rows.values()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
