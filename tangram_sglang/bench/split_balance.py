"""Balance of the decode split plans (CPU): a request row's longest CTA vs its balanced share.

    python -m tangram_sglang.bench.split_balance                      # Llama-3.1-8B, 132 SMs
    python -m tangram_sglang.bench.split_balance --profile P.json --num-sms 108

The tables take the CTAs per SM of ``TANGRAM_DECODE_CTAS_PER_SM`` (default 12), as a server does.
For every batch bucket (1, 2, 4, ... 64) and layer of the profile, one request row's per-KV-head
kept lengths ``L_h = k_g(n)`` (the profile's group of head ``h``) under a length shape, split by

* ``table``: the static AOT split table (``split_table.build_split_table``; splits proportional
  to the group ratios), split ``s`` of head ``h`` covering ``roundup(ceil(L_h / splits_h),
  BLOCK_N)`` tokens, as the kernel's ``plan="table"``;
* ``lengths``: the length-fitted plan (``split_table.fitted_splits``, the kernel's numpy twin).

A second table (:func:`batch_balance_rows`) takes one chat batch kept whole (ratio 1.0), rows of
lognormal lengths, and compares the launch's longest CTA with its balanced share (the batch's
tokens over the CTAs a launch aims for) under the table, ``lengths`` and ``batch`` (the
batch-balanced plan, serving's default: a chunk floor from the whole batch).

Metric: the longest CTA's tokens / ``(sum_h L_h) / C``, with ``C`` the table's CTAs per row at
that layer and bucket (the same CTA budget for both plans); 1.0 is a perfect split, and a plan
with more CTAs than ``C`` can go below 1. Reported as the mean and the max over layers, with each
plan's mean CTAs per row and the mean balanced share and longest CTA in tokens (a CTA walks its
tokens in blocks of ``BLOCK_N`` = 32, so below a few blocks per CTA the ratio mostly measures that
granularity). A measurement of the partition (tokens per CTA), not of speed.

Length shapes (``n`` in tokens): ``compressed`` = ``k_g(4096)`` (lengths proportional to the
ratios); ``chat`` = ``k_g(1024) + 300`` (a compressed history and an uncompressed 300-token tail);
``whole`` = 800 tokens in every group (a conversation kept whole).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from tangram_sglang.config import decode_ctas_per_sm
from tangram_sglang.errors import TangramError
from tangram_sglang.kernels.split_table import (
    MAX_SPLITS_PER_HEAD,
    batch_chunk_floor,
    build_split_table,
    fitted_splits,
)
from tangram_sglang.profile import BudgetProfile

BLOCK_N = 32  # kernels.decode_attention.BLOCK_N (kept free of the triton import)
BUCKETS = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_PROFILE = "synthetic/llama3.1-8b-ada-snapkv-r0.25.json"  # under calibration/
H200_SMS = 132


def shape_lengths(profile: BudgetProfile, shape: str) -> np.ndarray:
    """int64 ``[num_layers, num_kv_heads]``: one row's kept tokens per KV head for ``shape``.

    Raises:
        ValueError: an unknown shape (``compressed``, ``chat`` or ``whole``).
    """
    cluster_of = profile.grouping.cluster_of
    if shape == "compressed":
        return profile.group_kept_array(4096)[cluster_of]
    if shape == "chat":
        return profile.group_kept_array(1024)[cluster_of] + 300
    if shape == "whole":
        return np.full(cluster_of.shape, 800, dtype=np.int64)
    raise ValueError(f"shape {shape!r}: use compressed, chat or whole")


def longest_ctas(
    lens: np.ndarray, profile: BudgetProfile, num_sms: int, bucket: int, ctas_per_sm: int
) -> dict[str, np.ndarray]:
    """Per layer: the longest CTA's tokens under each plan, the table's CTAs, the plans' CTAs.

    Args:
        lens: int ``[num_layers, num_kv_heads]`` kept tokens of one request row.
        profile: the budget profile (grouping, group ratios).
        num_sms: the device's SM count. bucket: the batch bucket (requests per launch).
        ctas_per_sm: CTAs per SM a launch aims for (``TANGRAM_DECODE_CTAS_PER_SM``).

    Returns:
        float64 ``[num_layers]`` arrays ``table``, ``lengths`` (longest CTA, tokens),
        ``table_ctas`` and ``lengths_ctas`` (CTAs per row that do work).
    """
    table = build_split_table(
        profile.grouping, profile.group_ratios, num_sms, bucket, ctas_per_sm=ctas_per_sm
    )
    splits = table.splits.numpy().astype(np.int64)
    per_split = -(-lens // splits)
    table_chunk = -(-per_split // BLOCK_N) * BLOCK_N
    fit, fit_chunk = fitted_splits(lens, table.cta_budget, table.split_cap, BLOCK_N)
    return {
        "table": np.minimum(lens, table_chunk).max(axis=1).astype(np.float64),
        "lengths": np.minimum(lens, fit_chunk).max(axis=1).astype(np.float64),
        "table_ctas": np.asarray(table.num_ctas, dtype=np.float64),
        "lengths_ctas": fit.sum(axis=1).astype(np.float64),
    }


def balance_rows(
    profile: BudgetProfile,
    num_sms: int = H200_SMS,
    buckets=BUCKETS,
    ctas_per_sm: int | None = None,
) -> list[dict]:
    """One dict per (shape, bucket): mean/max over layers of longest CTA / balanced share.

    ``ctas_per_sm``: CTAs per SM a launch aims for (None: ``TANGRAM_DECODE_CTAS_PER_SM``, as a
    server reads it).
    """
    if ctas_per_sm is None:
        ctas_per_sm = decode_ctas_per_sm()
    rows = []
    for shape in ("compressed", "chat", "whole"):
        lens = shape_lengths(profile, shape)
        for bucket in buckets:
            r = longest_ctas(lens, profile, num_sms, bucket, ctas_per_sm)
            share = lens.sum(axis=1) / r["table_ctas"]
            row = {"shape": shape, "bucket": bucket, "share": float(share.mean())}
            for plan in ("table", "lengths"):
                ratio = r[plan] / share
                row |= {
                    f"{plan}_tokens": float(r[plan].mean()),
                    f"{plan}_mean": float(ratio.mean()),
                    f"{plan}_max": float(ratio.max()),
                    f"{plan}_ctas": float(r[f"{plan}_ctas"].mean()),
                }
            rows.append(row)
    return rows


def chat_batch_lengths(bucket: int, mean: int, sigma: float = 0.8, seed: int = 0) -> np.ndarray:
    """int64 ``[bucket]``: one chat batch's row lengths (tokens), lognormal with ``sigma``,
    scaled to ``mean``, at least 64 (seeded: ``numpy.random.default_rng(seed)``)."""
    draw = np.random.default_rng(seed).lognormal(0.0, sigma, bucket)
    return np.maximum(64, draw / draw.mean() * mean).astype(np.int64)


def batch_balance_rows(
    profile: BudgetProfile,
    num_sms: int = H200_SMS,
    buckets=(16, 64, 128),
    means=(600, 1000),
    ctas_per_sm: int | None = None,
) -> list[dict]:
    """Balance across the rows of one chat batch kept whole (ratio 1.0: every KV head of a row
    holds its whole length), one dict per (bucket, mean length).

    The metric is the longest CTA of the whole launch over the launch's balanced share (the
    batch's kept tokens / the CTAs a launch aims for, ``SplitTable.launch_ctas``), for the
    static table, the length-fitted plan (balanced per row) and the batch-balanced plan (a chunk
    floor from the whole batch, ``split_table.batch_chunk_floor``), with each plan's CTAs.
    ``ctas_per_sm``: as in :func:`balance_rows`.
    """
    if ctas_per_sm is None:
        ctas_per_sm = decode_ctas_per_sm()
    num_kv_heads = profile.model.num_kv_heads
    ratios = np.ones((1, profile.grouping.num_head_groups))
    rows = []
    for bucket in buckets:
        table = build_split_table(
            profile.grouping, ratios[0], num_sms, bucket, ctas_per_sm=ctas_per_sm
        )
        splits = table.splits.numpy()[0].astype(np.int64)
        view = table.layer(0)
        for mean in means:
            lens = np.repeat(chat_batch_lengths(bucket, mean)[:, None], num_kv_heads, axis=1)
            share = lens.sum() / table.launch_ctas
            per_split = -(-lens // splits)  # ceil(L / splits) tokens
            table_chunk = -(-per_split // BLOCK_N) * BLOCK_N
            fit, fit_chunk = fitted_splits(lens, view.cta_budget, view.split_cap, BLOCK_N)
            floor = batch_chunk_floor(lens, table.launch_ctas)
            bal, bal_chunk = fitted_splits(lens, view.batch_budget, view.batch_cap, BLOCK_N, floor)
            longest = {
                "table": np.minimum(lens, table_chunk).max(),
                "lengths": np.minimum(lens, fit_chunk).max(),
                "batch": np.minimum(lens, bal_chunk).max(),
            }
            ctas = {"table": splits.sum() * bucket, "lengths": fit.sum(), "batch": bal.sum()}
            row = {"bucket": bucket, "mean": mean, "longest_row": int(lens.max()), "share": share}
            for plan in ("table", "lengths", "batch"):
                row |= {
                    f"{plan}_tokens": float(longest[plan]),
                    f"{plan}_ratio": float(longest[plan] / share),
                    f"{plan}_ctas": int(ctas[plan]),
                }
            rows.append(row)
    return rows


def format_batch_rows(rows: list[dict]) -> str:
    """A markdown table of :func:`batch_balance_rows`."""
    lines = [
        "| rows | mean length | longest row | balanced share (tokens) "
        "| table: longest/balanced (CTAs) | lengths | batch |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        cells = " | ".join(
            f"{r[f'{p}_ratio']:.2f} ({r[f'{p}_ctas']})" for p in ("table", "lengths", "batch")
        )
        lines.append(
            f"| {r['bucket']} | {r['mean']} | {r['longest_row']} | {r['share']:.0f} | {cells} |"
        )
    return "\n".join(lines)


def format_rows(rows: list[dict]) -> str:
    """A markdown table of :func:`balance_rows`."""
    lines = [
        "| shape | bucket | balanced share (tokens) | table: longest/balanced, mean (max) "
        "| longest (tokens) | CTAs/row | lengths: longest/balanced, mean (max) "
        "| longest (tokens) | CTAs/row |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['bucket']} | {r['share']:.0f} "
            f"| {r['table_mean']:.2f} ({r['table_max']:.2f}) | {r['table_tokens']:.0f} "
            f"| {r['table_ctas']:.1f} | {r['lengths_mean']:.2f} ({r['lengths_max']:.2f}) "
            f"| {r['lengths_tokens']:.0f} | {r['lengths_ctas']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (2 on a bad flag or profile, one line on stderr)."""
    from tangram_sglang.integration.profile_loader import CALIBRATION_DIR

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default=str(CALIBRATION_DIR / DEFAULT_PROFILE))
    parser.add_argument("--num-sms", type=int, default=H200_SMS)
    args = parser.parse_args(argv)
    if args.num_sms < 1:
        parser.error(f"--num-sms {args.num_sms} must be >= 1 (the device's SM count)")
    try:
        ctas_per_sm = decode_ctas_per_sm()  # read once, before any output
    except TangramError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        profile = BudgetProfile.load(args.profile)
    except TangramError as exc:
        print(f"error: --profile: {exc}", file=sys.stderr)
        return 2
    print(
        f"profile {args.profile}: {profile.model.num_layers} layers, "
        f"{profile.model.num_kv_heads} KV heads, {profile.grouping.num_head_groups} head groups; "
        f"{args.num_sms} SMs, {ctas_per_sm} CTAs per SM (TANGRAM_DECODE_CTAS_PER_SM), BLOCK_N "
        f"{BLOCK_N}, split cap {MAX_SPLITS_PER_HEAD}"
    )
    print(format_rows(balance_rows(profile, args.num_sms, ctas_per_sm=ctas_per_sm)))
    print("\nOne chat batch kept whole (ratio 1.0), rows of lognormal lengths (sigma 0.8):")
    print(format_batch_rows(batch_balance_rows(profile, args.num_sms, ctas_per_sm=ctas_per_sm)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
