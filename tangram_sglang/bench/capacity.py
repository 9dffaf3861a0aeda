"""Capacity report: how many conversations of one length fit in a KV memory budget.

    python -m tangram_sglang.bench.capacity --profile PROFILE --context-tokens 32768 \
        --memory-gib 40 --json

Configurations (all through the real :class:`TangramMemory`: admit, alloc_extend, commit and
T - 1 decode steps, one conversation after another, until admission says "does not fit"; so
the count includes every page the allocator really takes, COW and tails included):

  full_kv        stock SGLang: every head keeps every token, one page spans a layer's H_kv heads
  uniform_padded the profile on uniform pages: every head padded to the longest head's kept
                 length (one length per request, as a stock paged engine has)
  tangram        ragged head-group pages, H_p in {1, 2, 4, 8} x scope {per_layer, global}
                 (per_layer only where H_p divides H_kv)

Slots are (token, KV head) cells. ``ideal`` slots are what each head's own budget needs
(``kept_len(n, r_h) + T - 1`` per head); ``unused`` slots are held but empty (page tails, spare
columns of a partial group: the allocator's fragmentation); ``padding`` slots hold tokens beyond
a head's own budget (the group keeps its max member's length). ``waste = 1 - ideal/allocated``.

The pool holds ``floor(memory / bytes_per_page)`` usable pages plus the padding page 0 (as
SGLang sizes ``size + page_size`` rows), so no configuration loses a conversation to page 0.

Source: Tangram arXiv 2606.06302 (Ragged Paging, fragmentation vs H_p; Budget Reservation).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from tangram_sglang.bench.synthetic import GEOMETRIES, make_profile, skewed_profile
from tangram_sglang.errors import ConfigError, TangramError
from tangram_sglang.mem.kv_pool import bytes_per_page
from tangram_sglang.mem.manager import TangramMemory
from tangram_sglang.mem.reservation import pages_needed
from tangram_sglang.profile import BudgetProfile, kept_len

HEADS_PER_GROUP = (1, 2, 4, 8)
SCOPES = ("per_layer", "global")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(slots=True)
class CapacityRow:
    """One configuration's result."""

    name: str  # configuration label
    heads_per_group: int  # H_p (KV heads per page)
    scope: str  # per_layer | global
    num_head_groups: int  # G
    conversations: int  # conversations admitted until the pool was full (real allocation)
    pages_per_conversation: int  # pages one conversation holds (first one, exact)
    bytes_per_conversation: int  # bytes one conversation holds (K and V)
    capacity_ratio_vs_full_kv: float  # full-KV bytes per conversation / this one's
    fraction_of_ideal: float  # capacity_ratio / ideal_capacity_ratio
    unused_fraction: float  # empty slots / allocated slots (allocator fragmentation)
    padding_fraction: float  # slots over a head's own budget / allocated slots
    waste_fraction: float  # 1 - ideal slots / allocated slots


def ideal_slots(profile: BudgetProfile, context_tokens: int, max_new_tokens: int) -> int:
    """(token, head) slots each head's own budget needs for one conversation."""
    tail = max(max_new_tokens - 1, 0)
    kept = [
        kept_len(context_tokens, float(r), profile.sink_tokens, profile.recent_window)
        for r in profile.ratio.ravel()
    ]
    return int(sum(kept)) + tail * profile.ratio.size


def fill_pool(
    profile: BudgetProfile,
    memory_bytes: int,
    page_size: int,
    context_tokens: int,
    max_new_tokens: int,
    dtype: torch.dtype,
) -> tuple[int, int, Any]:
    """Admit conversations until the pool is full. Returns (count, pages of one, stats)."""
    h_p, dim = profile.grouping.heads_per_group, profile.model.head_dim
    num_pages = memory_bytes // bytes_per_page(h_p, page_size, dim, dtype) + 1
    footprint = pages_needed(profile, page_size, context_tokens, max_new_tokens)
    max_rows = (num_pages - 1) // max(footprint, 1) + 1
    width = -(-(context_tokens + max_new_tokens) // page_size)
    mem = TangramMemory(profile, page_size, num_pages, max_rows, width, None, "cpu", False, dtype)
    count = 0
    while count < max_rows and mem.admit(count, f"c{count}", context_tokens, max_new_tokens):
        mem.alloc_extend(count, context_tokens)
        mem.commit_extend(count)
        for _ in range(max(max_new_tokens - 1, 0)):
            mem.alloc_decode([count])
        count += 1
    st = mem.stats()
    assert st.used_pages == count * footprint, "Budget Reservation must be exact to the page"
    return count, footprint, st


def measure(
    name: str,
    profile: BudgetProfile,
    ideal_profile: BudgetProfile,
    args: argparse.Namespace,
) -> CapacityRow:
    """Run one configuration; ``ideal_profile`` gives each head's own budget."""
    dtype = DTYPES[args.dtype]
    memory_bytes = int(args.memory_gib * (1 << 30))
    count, pages, st = fill_pool(
        profile, memory_bytes, args.page_size, args.context_tokens, args.max_new_tokens, dtype
    )
    per_conv_slots = st.allocated_slots / max(count, 1)
    ideal = ideal_slots(ideal_profile, args.context_tokens, args.max_new_tokens)
    stored = (st.allocated_slots - st.unused_slots) / max(count, 1)
    return CapacityRow(
        name=name,
        heads_per_group=profile.grouping.heads_per_group,
        scope=profile.grouping.scope,
        num_head_groups=profile.grouping.num_head_groups,
        conversations=count,
        pages_per_conversation=pages,
        bytes_per_conversation=pages * st.bytes_per_page,
        capacity_ratio_vs_full_kv=0.0,  # filled in by run()
        fraction_of_ideal=0.0,
        unused_fraction=st.unused_slots / max(st.allocated_slots, 1),
        padding_fraction=(stored - ideal) / per_conv_slots,
        waste_fraction=1.0 - ideal / per_conv_slots,
    )


def configurations(profile: BudgetProfile) -> list[tuple[str, BudgetProfile]]:
    """(label, profile) of every configuration, full KV first."""
    m = profile.model
    full = make_profile(
        np.ones_like(profile.ratio),
        m.num_kv_heads,
        "per_layer",
        profile.sink_tokens,
        profile.recent_window,
        m.head_dim,
        m.num_qo_heads // m.num_kv_heads,
    )
    padded = make_profile(
        np.full_like(profile.ratio, profile.ratio.max()),
        m.num_kv_heads,
        "per_layer",
        profile.sink_tokens,
        profile.recent_window,
        m.head_dim,
        m.num_qo_heads // m.num_kv_heads,
    )
    out = [("full_kv", full), ("uniform_padded", padded)]
    for scope in SCOPES:  # the profile's own H_p too, so its summary row always exists
        for h_p in sorted({*HEADS_PER_GROUP, profile.grouping.heads_per_group}):
            if scope == "per_layer" and m.num_kv_heads % h_p:
                continue
            out.append((f"tangram H_p={h_p} {scope}", profile.with_grouping(h_p, scope)))
    return out


def run(profile: BudgetProfile, args: argparse.Namespace) -> dict[str, Any]:
    """Every configuration, the summary and the inputs, as a JSON-ready dict.

    Raises:
        ConfigError: ``--heads-per-group``/``--scope`` name no configuration (checked first).
        PoolError: the memory budget holds not even one page.
    """
    configs = configurations(profile)
    label = summary_label(profile, args)
    if label not in {name for name, _ in configs}:
        raise ConfigError(
            f"--heads-per-group {args.heads_per_group} with --scope per_layer does not divide "
            f"num_kv_heads={profile.model.num_kv_heads}; pick a divisor or --scope global"
        )
    rows = [
        measure(name, prof, prof if name == "full_kv" else profile, args) for name, prof in configs
    ]
    full_slots = ideal_slots(configs[0][1], args.context_tokens, args.max_new_tokens)
    ideal_ratio = full_slots / ideal_slots(profile, args.context_tokens, args.max_new_tokens)
    for row in rows:
        row.capacity_ratio_vs_full_kv = rows[0].bytes_per_conversation / row.bytes_per_conversation
        row.fraction_of_ideal = row.capacity_ratio_vs_full_kv / ideal_ratio
    default = next(r for r in rows if r.name == label)
    return {
        "summary": {
            "configuration": label,
            "capacity_ratio_vs_full_kv": default.capacity_ratio_vs_full_kv,
            "ideal_capacity_ratio": ideal_ratio,
            "fragmentation_fraction": default.unused_fraction,
            "waste_fraction": default.waste_fraction,
            "fraction_of_ideal": default.fraction_of_ideal,
            "conversations": default.conversations,
            "conversations_full_kv": rows[0].conversations,
        },
        "inputs": _inputs(profile, args),
        "rows": [asdict(r) for r in rows],
    }


def summary_label(profile: BudgetProfile, args: argparse.Namespace) -> str:
    """The summary's configuration: the flags, else the profile file's own grouping."""
    heads_per_group = args.heads_per_group or (
        profile.grouping.heads_per_group if args.profile else 4
    )
    return f"tangram H_p={heads_per_group} {args.scope or profile.grouping.scope}"


def _inputs(profile: BudgetProfile, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "profile": args.profile or "synthetic",
        "model": profile.model.architecture,
        "num_layers": profile.model.num_layers,
        "num_kv_heads": profile.model.num_kv_heads,
        "head_dim": profile.model.head_dim,
        "target_ratio": profile.target_ratio,
        "mean_ratio": profile.mean_kept_fraction(),
        "sink_tokens": profile.sink_tokens,
        "recent_window": profile.recent_window,
        "context_tokens": args.context_tokens,
        "max_new_tokens": args.max_new_tokens,
        "memory_gib": args.memory_gib,
        "page_size": args.page_size,
        "dtype": args.dtype,
        "method": "real allocation until admission fails (TangramMemory, no K/V storage)",
    }


def markdown_table(report: dict[str, Any]) -> str:
    """The rows as a markdown table."""
    head = (
        "| configuration | groups | conversations | GiB/conv | x full KV | of ideal | "
        "unused | padding | waste |\n|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = [
        f"| {r['name']} | {r['num_head_groups']} | {r['conversations']} | "
        f"{r['bytes_per_conversation'] / (1 << 30):.3f} | {r['capacity_ratio_vs_full_kv']:.3f} | "
        f"{r['fraction_of_ideal']:.1%} | {r['unused_fraction']:.2%} | "
        f"{r['padding_fraction']:.2%} | {r['waste_fraction']:.2%} |"
        for r in report["rows"]
    ]
    return head + "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m tangram_sglang.bench.capacity",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--profile", help="budget profile JSON (default: a synthetic skewed one)")
    p.add_argument(
        "--geometry",
        default="llama3-8b",
        choices=sorted(GEOMETRIES),
        help="model geometry of the synthetic profile",
    )
    p.add_argument("--target-ratio", type=float, default=0.25, help="synthetic profile target")
    p.add_argument("--seed", type=int, default=0, help="synthetic profile seed")
    p.add_argument("--context-tokens", type=int, default=32768, help="tokens per conversation")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=1,
        help="T; T - 1 uncompressed decode-tail tokens per conversation",
    )
    p.add_argument("--memory-gib", type=float, default=40.0, help="KV memory budget (GiB)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per page")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="KV dtype")
    p.add_argument(
        "--heads-per-group",
        type=int,
        default=None,
        choices=HEADS_PER_GROUP,
        help="H_p of the configuration the summary reports (default: the profile's; "
        "4 for a synthetic profile)",
    )
    p.add_argument(
        "--scope",
        default=None,
        choices=SCOPES,
        help="scope of that configuration (default: the profile's)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)
    _check_args(p, args)
    return args


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject sizes that would hang the fill loop or crash deep inside (exits with status 2)."""
    if args.context_tokens < 1:
        parser.error(f"--context-tokens {args.context_tokens} must be >= 1 (tokens)")
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens {args.max_new_tokens} must be >= 1 (tokens)")
    if not (math.isfinite(args.memory_gib) and args.memory_gib > 0):
        parser.error(f"--memory-gib {args.memory_gib} must be a finite number > 0 (GiB)")
    if args.page_size < 1 or args.page_size & (args.page_size - 1):
        parser.error(f"--page-size {args.page_size} must be a power of two >= 1 (tokens)")


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (2 on a bad flag, profile or too small a pool)."""
    args = parse_args(argv)
    try:
        if args.profile:
            profile = BudgetProfile.load(args.profile)
        else:
            profile = skewed_profile(args.geometry, args.target_ratio, seed=args.seed)
        report = run(profile, args)
    except TangramError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        json.dump(report, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(markdown_table(report))
        sys.stdout.write(json.dumps(report["summary"], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
