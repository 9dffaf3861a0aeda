"""Decode-attention benchmark: Tangram (4 split plans) vs FlashInfer vs SGLang, bf16, one layer.

    python -m tangram_sglang.bench.kernels --json benchmarks/results/kernels-h200.json
    python -m tangram_sglang.bench.kernels --quick --json /tmp/kernels-quick.json   # smoke run
    python -m tangram_sglang.bench.kernels --plan-only                             # CPU: cases only
    python -m tangram_sglang.bench.kernels --shapes skewed --batches 64 --contexts 2048,4096 \
        --budgets 1.0,0.25 --json /tmp/kernels-skewed.json                        # a chat batch

Llama-3.1-8B decode shapes (32 query heads, 8 KV heads, head_dim 128, bf16, page_size 16), batch
in {1, 8, 32, 128} x context in {8k, 32k, 128k} tokens x budget {50%, 25%}; per-head ratios of
one layer of a skewed profile (``--profile`` file, else ``bench.synthetic.skewed_profile``)
rescaled to each budget (budget 1.0: every head keeps every token); kept tokens per head =
``profile.kept_len`` (shape ``ratios``), and the same total spread evenly over the heads (shape
``equal``: the chat case, where short turns and the decode tail are kept whole and every group
holds about the same tokens). ``--batches``, ``--contexts`` (tokens), ``--budgets`` (kept
fractions in (0, 1]) and ``--shapes`` (comma lists) replace the grid; an option given with
``--quick`` replaces that part of the smoke grid.

Shape ``skewed`` (only with ``--shapes``): requests of different lengths in one batch, as a chat
server's decode batch (ShareGPT: tens of conversations of a few hundred to a few thousand
tokens). Request b's context is drawn once (``numpy.random.default_rng(0)``, lognormal with sigma
0.8) and scaled so the longest request is the case's ``context``, at least 64 tokens each
(``row_contexts`` in the JSON); its kept tokens per KV head are ``kept_len`` of its own context
(the ``ratios`` rule). Kept and full KV bytes, GB/s and the roofline are the sums over the
requests; the buffers hold every request at the longest one's pages (ragged pool) or slots (full
KV), and each request reads only its own tokens.

Side by side, one run:

* ``lengths``: :func:`ragged_decode_attention` with ``plan="lengths"`` (split fitted to the real
  lengths in the kernel; ``TANGRAM_DECODE_PLAN=lengths``; CUDA-graph replay);
* ``batch``: the same kernel with ``plan="batch"`` (the length-fitted split with a chunk floor
  from the whole batch: ``split_table.batch_chunk_floor`` of the batch's kept tokens per request
  and KV head over the table's ``launch_ctas``, passed as ``chunk_floor``; the serving default;
  CUDA-graph replay);
* ``aot``: the same kernel with the static AOT split table, ``plan="table"`` (the paper's
  plan; CUDA-graph replay);
* ``uniform``: the same kernel with the uniform split table (CUDA-graph replay);
* ``flashinfer``: FlashInfer 0.6.15's ``BatchDecodeWithPagedKVCacheWrapper`` over the same ragged
  heads (every (request, KV head) one sequence with 1 KV head and 4 query heads, its own page
  count and last-page length), per-step ``plan()`` + ``run()`` timed eagerly (planning counted),
  and ``run()`` alone;
* ``sglang_full_kv``: SGLang 0.5.17's Triton decode kernel on the FULL KV (page_size 1, shuffled
  slots, per-request sequence lengths, its own ``get_num_kv_splits``; CUDA-graph replay), once
  per (batch, request contexts);
* ``roofline``: kept KV bytes / the measured device-to-device copy bandwidth (4 GiB clone).

Tangram's plans use the split table of the batch's bucket, as a server does (the smallest power
of two >= the batch: a 23-row case gets the 32-row bucket's CTA budgets), and the CTAs per SM of
``TANGRAM_DECODE_CTAS_PER_SM`` (default 12; recorded as ``meta.ctas_per_sm``). A server whose
largest bucket is not a power of two (``--cuda-graph-max-bs`` 100, say) uses that size instead
for its largest batches; this benchmark does not.

Inputs smaller than ``ROTATE_BYTES`` are replicated and rotated so timings never run from L2.
Cases whose buffers exceed ``--max-gib`` are skipped with a note. The JSON holds ``meta`` (with
the ``grid`` run), ``cases`` (one row per configuration; times in ms, bandwidth in GB/s) and a
``summary``. This module holds the case plan, the summary and the CLI (CPU-testable); the GPU
work is in ``bench/kernel_runners.py``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tangram_sglang.config import decode_ctas_per_sm
from tangram_sglang.errors import TangramError
from tangram_sglang.profile import BudgetProfile, kept_len

NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE, DTYPE_BYTES = 32, 8, 128, 16, 2
BATCHES = (1, 8, 32, 128)
CONTEXTS = (8192, 32768, 131072)
BUDGETS = (0.25, 0.5)  # 25% first: the headline target, if the time budget runs out
# kept lengths proportional to the head ratios / equal on all heads / ratios with rows of
# different contexts (the chat server's decode batch); the default run leaves ``skewed`` out
SHAPES = ("ratios", "equal", "skewed")
DEFAULT_SHAPES = ("ratios", "equal")
QUICK = {"batches": (1, 8), "contexts": (8192,), "budgets": (0.25,), "shapes": DEFAULT_SHAPES}
# ``skewed`` rows: contexts drawn once from a lognormal (seeded), scaled so the longest row is
# the case's context, floored at MIN_ROW_CONTEXT tokens
SKEW_SIGMA = 0.8
SKEW_SEED = 0
MIN_ROW_CONTEXT = 64
# 4 x the H200's 50 MiB L2: replicate smaller inputs so each timed call reads cold HBM.
ROTATE_BYTES = 256 << 20
MAX_REPLICAS = 32
DEFAULT_JSON = Path("benchmarks/results/kernels-h200.json")
MAX_BATCH = 4096  # requests per batch the CLI accepts (SGLang's largest CUDA graph is far below)
MAX_CONTEXT = 1 << 24  # tokens per request the CLI accepts (16M; --max-gib skips big cases)
DEFAULT_MAX_GIB = 110.0  # of the H200's ~139 GiB: leaves room for scratch, graphs, allocator


@dataclass(slots=True)
class Case:
    """One benchmark configuration (sizes in tokens / bytes) and, after running, its times."""

    batch: int  # requests
    context: int  # logical tokens per request (``skewed``: of the longest request)
    budget: float  # target mean kept fraction
    shape: str  # "ratios" (kept tokens follow the head ratios), "equal" (same on every head),
    #             "skewed" ("ratios" with a different context per request)
    ratios: list[float]  # per-KV-head ratio of the benchmarked layer
    kept_tokens: list[int]  # per-KV-head kept tokens of one request (``skewed``: the longest)
    kept_kv_bytes: int  # K + V bytes the kept tokens occupy (one layer, whole batch)
    full_kv_bytes: int  # K + V bytes of the full KV (one layer, whole batch)
    replicas_kept: int  # rotated copies of the ragged pool
    replicas_full: int  # rotated copies of the full KV
    peak_bytes: int  # largest live set of the case (ragged pool or full KV, with replicas)
    row_contexts: list[int] = field(default_factory=list)  # ``skewed``: tokens per request
    sink_tokens: int = 0  # the kept-length rule's always-kept first tokens
    recent_window: int = 0  # the kept-length rule's always-kept last tokens
    results: dict[str, Any] = field(default_factory=dict)  # times (ms), GB/s, notes
    skipped: str = ""  # why the case did not run ("" = ran)

    def contexts(self) -> list[int]:
        """Logical tokens of each request (``context`` for every one, except ``skewed``)."""
        return list(self.row_contexts) or [self.context] * self.batch

    def row_kept(self) -> np.ndarray:
        """int64 ``[batch, num_kv_heads]``: kept tokens of each request and KV head.

        ``skewed``: ``kept_len(row context, ratio_h, sink, window)``; else ``kept_tokens`` on
        every request.
        """
        if not self.row_contexts:
            return np.tile(np.asarray(self.kept_tokens, dtype=np.int64), (self.batch, 1))
        return np.array(
            [
                [kept_len(n, r, self.sink_tokens, self.recent_window) for r in self.ratios]
                for n in self.row_contexts
            ],
            dtype=np.int64,
        )


def layer_ratios(profile: BudgetProfile, budget: float) -> tuple[int, np.ndarray]:
    """(layer, per-head ratios with mean ``budget``) of one layer of the profile.

    The layer is the one whose max/mean group ratio (its skew) is the median over layers, so
    neither the flattest nor the most skewed layer decides the result; its per-head group ratios
    are then rescaled to mean ``budget`` (``BudgetProfile.rescaled``: one factor, clipped at 1).
    ``budget=1.0`` gives exactly 1 on every head (every head keeps every token).
    """
    from tangram_sglang.bench.synthetic import make_profile

    ratios = profile.group_ratios[profile.grouping.cluster_of]  # [L, H_kv]
    skew = ratios.max(axis=1) / ratios.mean(axis=1)
    layer = int(np.argsort(skew)[len(skew) // 2])
    if budget >= 1.0:  # the rescale's bisection stops an ulp short of 1 on the smallest head
        return layer, np.ones(ratios.shape[1])
    return layer, make_profile(ratios[layer : layer + 1]).rescaled(budget).ratio[0]


def skewed_row_contexts(batch: int, context: int, seed: int = SKEW_SEED) -> list[int]:
    """Per-request contexts of a ``skewed`` case (tokens; the longest is ``context``).

    ``batch`` draws of a lognormal (sigma ``SKEW_SIGMA``, ``numpy.random.default_rng(seed)``),
    scaled so the largest is ``context``, rounded, and floored at ``MIN_ROW_CONTEXT`` tokens
    (at ``context`` when that is shorter): a chat server's decode batch, many short
    conversations and a few long ones.
    """
    draw = np.random.default_rng(seed).lognormal(0.0, SKEW_SIGMA, batch)
    rows = np.rint(draw / draw.max() * context).astype(np.int64)
    return np.clip(rows, min(MIN_ROW_CONTEXT, context), context).tolist()


def replicas_for(nbytes: int) -> int:
    """Copies needed so that one rotation reads at least ``ROTATE_BYTES`` (at most 32)."""
    return max(1, min(MAX_REPLICAS, math.ceil(ROTATE_BYTES / max(1, nbytes))))


def make_case(
    batch: int,
    context: int,
    budget: float,
    ratios: np.ndarray,
    sink: int,
    window: int,
    shape: str = "ratios",
):
    """A :class:`Case` with its kept lengths, byte counts, replicas and peak memory.

    ``shape="equal"`` gives every head the mean of the ``ratios`` kept lengths (same total).
    ``shape="skewed"`` draws each request's context (:func:`skewed_row_contexts`; ``context``
    is the longest) and keeps ``kept_len`` of it per head; its byte counts are the sums over
    the requests, while the buffers hold every request at the longest one's size (the peak).
    """
    if shape not in SHAPES:
        raise ValueError(f"shape {shape!r} is not one of {SHAPES}")
    kept = [kept_len(context, float(r), sink, window) for r in ratios]
    if shape == "equal":
        kept = [round(sum(kept) / len(kept))] * len(kept)
    case = Case(
        batch,
        context,
        budget,
        shape,
        [float(r) for r in ratios],
        kept,
        0,
        0,
        1,
        1,
        0,
        row_contexts=skewed_row_contexts(batch, context) if shape == "skewed" else [],
        sink_tokens=sink,
        recent_window=window,
    )
    token_bytes = HEAD_DIM * DTYPE_BYTES * 2  # K and V of one token of one head
    case.kept_kv_bytes = int(case.row_kept().sum()) * token_bytes
    case.full_kv_bytes = sum(case.contexts()) * NUM_KV_HEADS * token_bytes
    case.replicas_kept = replicas_for(case.kept_kv_bytes)
    case.replicas_full = replicas_for(case.full_kv_bytes)
    # allocated: every request's pages / slots at the longest request's size
    padded = batch * sum(-(-k // PAGE_SIZE) * PAGE_SIZE for k in kept) * token_bytes
    full_alloc = batch * context * NUM_KV_HEADS * token_bytes
    case.peak_bytes = max(padded * case.replicas_kept, full_alloc * case.replicas_full)
    return case


def plan_cases(
    profile: BudgetProfile,
    batches=BATCHES,
    contexts=CONTEXTS,
    budgets=BUDGETS,
    max_gib: float = DEFAULT_MAX_GIB,
    shapes=DEFAULT_SHAPES,
) -> list[Case]:
    """Every (budget, shape, batch, context) case; the ones over ``max_gib`` carry a skip note."""
    cases = []
    for budget in budgets:
        _, ratios = layer_ratios(profile, budget)
        for shape in shapes:
            for batch in batches:
                for context in contexts:
                    case = make_case(
                        batch,
                        context,
                        budget,
                        ratios,
                        profile.sink_tokens,
                        profile.recent_window,
                        shape,
                    )
                    if case.peak_bytes > max_gib * (1 << 30):
                        case.skipped = (
                            f"needs {case.peak_bytes / (1 << 30):.1f} GiB > --max-gib {max_gib}"
                        )
                    cases.append(case)
    return cases


def _geomean(values: list[float]) -> float | None:
    values = [v for v in values if v and v > 0 and math.isfinite(v)]
    return float(np.exp(np.mean(np.log(values)))) if values else None


def summarize(cases: list[Case]) -> dict[str, Any]:
    """The summary block: geomean speedups and the median bandwidth fraction.

    Over the ``ratios``-shaped cases (comparable across runs), except the ``..._equal_geomean``
    and ``..._skewed_geomean`` keys (the ``equal``- and ``skewed``-shaped cases: AOT table time
    / length-fitted or batch-balanced time). ``tangram_vs_full_kv_speedup_at_25pct_geomean`` is
    over 25% cases with batch >= 32 (the issue's target); ``..._all_batches`` adds the small
    batches. ``num_ran`` counts the ``ratios`` cases that ran, ``num_ran_by_shape`` every shape.
    """
    done = [c for c in cases if not c.skipped and c.results.get("aot_ms")]
    ran = [c for c in done if c.shape == "ratios"]
    equal = [c for c in done if c.shape == "equal"]
    skewed = [c for c in done if c.shape == "skewed"]

    def ratio(c: Case, num: str, den: str) -> float | None:
        a, b = c.results.get(num), c.results.get(den)
        return a / b if a and b else None

    at25 = [c for c in ran if abs(c.budget - 0.25) < 1e-9]
    fractions = [c.results["aot_bw_fraction"] for c in ran if c.results.get("aot_bw_fraction")]
    return {
        "num_cases": len(cases),
        "num_ran": len(ran),
        "num_ran_by_shape": {s: sum(c.shape == s for c in done) for s in SHAPES},
        "aot_vs_uniform_speedup_geomean": _geomean([ratio(c, "uniform_ms", "aot_ms") for c in ran]),
        "lengths_vs_aot_speedup_geomean": _geomean([ratio(c, "aot_ms", "lengths_ms") for c in ran]),
        "lengths_vs_aot_speedup_equal_geomean": _geomean(
            [ratio(c, "aot_ms", "lengths_ms") for c in equal]
        ),
        "lengths_vs_aot_speedup_skewed_geomean": _geomean(
            [ratio(c, "aot_ms", "lengths_ms") for c in skewed]
        ),
        "batch_vs_aot_speedup_geomean": _geomean([ratio(c, "aot_ms", "batch_ms") for c in ran]),
        "batch_vs_aot_speedup_equal_geomean": _geomean(
            [ratio(c, "aot_ms", "batch_ms") for c in equal]
        ),
        "batch_vs_aot_speedup_skewed_geomean": _geomean(
            [ratio(c, "aot_ms", "batch_ms") for c in skewed]
        ),
        "tangram_vs_full_kv_speedup_at_25pct_geomean": _geomean(
            [ratio(c, "sglang_full_kv_ms", "aot_ms") for c in at25 if c.batch >= 32]
        ),
        "tangram_vs_full_kv_speedup_at_25pct_all_batches_geomean": _geomean(
            [ratio(c, "sglang_full_kv_ms", "aot_ms") for c in at25]
        ),
        "aot_vs_flashinfer_plan_run_speedup_geomean": _geomean(
            [ratio(c, "flashinfer_ms", "aot_ms") for c in ran]
        ),
        "bandwidth_fraction_median": float(np.median(fractions)) if fractions else None,
    }


def write_json(path: Path, cases: list[Case], meta: dict[str, Any]) -> dict[str, Any]:
    """Write ``{"meta", "cases", "summary"}`` atomically; returns the document."""
    doc = {"meta": meta, "cases": [asdict(c) for c in cases], "summary": summarize(cases)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)
    return doc


def load_profile(path: str | None) -> BudgetProfile:
    """The profile to draw ratios from: a file, else the seeded synthetic skewed profile."""
    if path:
        return BudgetProfile.load(path)
    from tangram_sglang.bench.synthetic import skewed_profile

    return skewed_profile("llama3-8b", 0.25, heads_per_group=1, scope="per_layer", seed=0)


TABLE_KEYS = (
    "lengths_ms",
    "batch_ms",
    "aot_ms",
    "uniform_ms",
    "flashinfer_ms",
    "sglang_full_kv_ms",
    "roofline_ms",
)
TABLE_LABELS = ("len_ms", "bat_ms", "aot_ms", "unif_ms", "fi_ms", "full_ms", "roof_ms")
TABLE_HEADER = (
    f"{'shape':>6} {'batch':>5} {'context':>7} {'budg':>5} "
    + " ".join(f"{k:>8}" for k in TABLE_LABELS)
    + " bw_frac"
)


def table_line(c: Case) -> str:
    """One row of the printed summary table."""
    head = f"{c.shape:>6} {c.batch:>5} {c.context:>7} {c.budget:>5.2f}"
    if c.skipped:
        return f"{head}  skipped: {c.skipped}"
    r = c.results
    if not r:
        rows = ""
        if c.row_contexts:
            rows = (
                f", contexts {min(c.row_contexts)}..{max(c.row_contexts)} "
                f"(mean {np.mean(c.row_contexts):.0f}) tokens"
            )
        return (
            f"{head}  planned: kept {c.kept_kv_bytes / c.full_kv_bytes:.3f} of full KV{rows}, "
            f"peak {c.peak_bytes / (1 << 30):.1f} GiB, replicas {c.replicas_kept}/{c.replicas_full}"
        )

    def fmt(key: str) -> str:
        return f"{r[key]:8.3f}" if isinstance(r.get(key), float) else f"{'-':>8}"

    keys = TABLE_KEYS
    frac = r.get("aot_bw_fraction")
    frac_text = f"{frac:5.2f}" if frac else "    -"
    return f"{head} " + " ".join(map(fmt, keys)) + (f" {frac_text}")


def _comma_list(convert, check, what: str):
    """An argparse ``type``: a comma-separated list of values, each passing ``check``."""

    def parse(text: str) -> tuple:
        try:
            values = tuple(convert(v.strip()) for v in text.split(",") if v.strip())
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from exc
        bad = [v for v in values if not check(v)]
        if not values or bad:
            raise argparse.ArgumentTypeError(f"{text!r}: want a comma list of {what}")
        return values

    return parse


def _positive_gib(text: str) -> float:
    """An argparse ``type``: a finite number of GiB > 0."""
    try:
        value = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: want a number of GiB > 0") from exc
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: want a finite number of GiB > 0")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        help=f"result file (default {DEFAULT_JSON} on a GPU run; --plan-only writes one only "
        "when given)",
    )
    parser.add_argument("--profile", default=None, help="budget profile JSON (default: synthetic)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 small cases")
    parser.add_argument("--plan-only", action="store_true", help="print the cases, no GPU")
    parser.add_argument(
        "--max-gib",
        type=_positive_gib,
        default=DEFAULT_MAX_GIB,
        help=f"skip cases whose buffers need more GiB (default {DEFAULT_MAX_GIB})",
    )
    parser.add_argument(
        "--shapes",
        type=_comma_list(str, SHAPES.__contains__, f"shapes in {','.join(SHAPES)}"),
        default=None,
        help=f"comma list of {','.join(SHAPES)} (default: {','.join(DEFAULT_SHAPES)})",
    )
    parser.add_argument(
        "--batches",
        type=_comma_list(int, lambda v: 1 <= v <= MAX_BATCH, f"batch sizes in [1, {MAX_BATCH}]"),
        default=None,
        help=f"comma list of requests per batch (default: {','.join(map(str, BATCHES))})",
    )
    parser.add_argument(
        "--contexts",
        type=_comma_list(
            int, lambda v: 1 <= v <= MAX_CONTEXT, f"contexts in [1, {MAX_CONTEXT}] tokens"
        ),
        default=None,
        help="comma list of tokens per request, the longest one under skewed "
        f"(default: {','.join(map(str, CONTEXTS))})",
    )
    parser.add_argument(
        "--budgets",
        type=_comma_list(float, lambda v: 0.0 < v <= 1.0, "kept fractions in (0, 1]"),
        default=None,
        help=f"comma list of mean kept fractions (default: {','.join(map(str, BUDGETS))})",
    )
    args = parser.parse_args(argv)
    if args.json is not None and args.json.is_dir():
        parser.error(f"--json {args.json}: a directory; give a file path, e.g. {DEFAULT_JSON}")
    try:
        profile = load_profile(args.profile)
    except TangramError as exc:
        parser.error(f"--profile: {exc}")
    grid: dict[str, Any] = (
        dict(QUICK)
        if args.quick
        else {
            "batches": BATCHES,
            "contexts": CONTEXTS,
            "budgets": BUDGETS,
            "shapes": DEFAULT_SHAPES,
        }
    )
    for key in grid:
        if getattr(args, key) is not None:  # an explicit option overrides the grid, --quick's too
            grid[key] = getattr(args, key)
    try:
        cases = plan_cases(profile, max_gib=args.max_gib, **grid)
    except TangramError as exc:  # e.g. a budget below what the profile's sinks and window keep
        parser.error(f"--budgets {','.join(map(str, grid['budgets']))}: {exc}")
    try:
        ctas_per_sm = decode_ctas_per_sm()  # TANGRAM_DECODE_CTAS_PER_SM, as a server reads it
    except TangramError as exc:
        parser.error(str(exc))
    meta: dict[str, Any] = {
        "profile": profile.provenance,
        "quick": args.quick,
        "grid": {k: list(v) for k, v in grid.items()},
        "ctas_per_sm": ctas_per_sm,
    }
    if not args.plan_only:
        from tangram_sglang.bench import kernel_runners

        if not kernel_runners.cuda_available():
            print("no CUDA device: use --plan-only on CPU", file=sys.stderr)
            return 2
        out = args.json or DEFAULT_JSON
        meta |= kernel_runners.run_all(cases, on_case=lambda: write_json(out, cases, meta))
        doc = write_json(out, cases, meta)
    elif args.json is not None:
        doc = write_json(args.json, cases, meta)
    else:  # a plan on CPU never overwrites a measured result file by default
        doc = {"summary": summarize(cases)}
    print(TABLE_HEADER)
    for case in cases:
        print(table_line(case))
    print(json.dumps(doc["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
