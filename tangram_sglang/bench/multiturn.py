"""Multi-turn serving benchmark: stock SGLang (full KV) vs ``--tangram``, back to back.

    python -m tangram_sglang.bench.multiturn --model-path calibration/synthetic/llama3.1-8b-dummy \
        --device cuda --server-args "--load-format dummy ..." \
        --profile calibration/synthetic/llama3.1-8b-ada-snapkv-r0.25.json \
        --systems baseline,tangram:0.25,tangram:0.5 --workloads cliff:32,cliff:64,prefill:16x8192 \
        --output benchmarks/results/multiturn-h200.json
    python -m tangram_sglang.bench.multiturn merge a.json b.json --output merged.json

Each system is one server (``baseline``: the same flags without ``--tangram``; ``tangram:R``:
``--tangram --tangram-profile P --tangram-target-ratio R``), started, loaded with every
workload in turn (:mod:`multiturn_workloads`, :mod:`multiturn_client`), and stopped. While a
workload runs, ``/metrics`` is polled once a second (``--enable-metrics``): peak running
requests, token usage, Tangram pages/bytes held, retractions. The JSON is rewritten after every
workload, so a run cut short keeps what it measured. ``merge`` joins runs made separately (one
GPU each) and recomputes the ``summary``:

* ``throughput_ratio_at_25pct`` / ``_50pct``: output tok/s of ``tangram:0.25`` / ``0.5`` over
  the baseline's on the main workload (``--main-workload``, default ``cliff-64``);
* ``prefill_time_ratio``: wall time of the prefill workload, Tangram (0.25) / baseline (same
  requests sent at once, so the same batches);
* ``max_concurrency_ratio``: peak running requests on the main workload, Tangram / baseline;
* ``cliff_throughput_ratio_64_clients``: output tok/s on ``cliff-64``, Tangram (0.25) / baseline;
* ``kv_capacity_ratio``: ``max_total_num_tokens`` (logical token slots), Tangram / baseline;
* ``concurrency``: peak running requests per system and workload (``--no-max-tokens``: requests
  that set no ``max_tokens``, each exactly its drawn length, the round's output length as mean).
* ``shared_context_ratio_vs_stock`` / ``system_prompt_ratio_vs_stock``: output tok/s of
  ``tangram:0.25`` over the best stock system on ``long-context-shared-*`` (``--shared-context``)
  / ``system-prompt-*`` (``--system-prompt-tokens``), with each run's hit rate under
  ``shared_prefix``.
A ratio whose runs are missing is null and ``missing`` says why.

``--client sglang`` sends the measured conversations through SGLang's own ``bench_serving``
over the chat API instead of this bench's client (:mod:`sglang_client`): the same figures, from
a second, independent client.

``--trace-steps N`` repeats each workload once more under SGLang's profiler (its first ``N``
forward steps) and stores where the time went under the workload's ``trace`` key
(:mod:`multiturn_trace`); the measured figures stay those of the untraced run.

Each measured run also keeps its server's decode log lines (``decode_log``: requests running,
tokens held and generation tok/s every 40 decode steps), and ``vs_best_stock`` pairs a Tangram
run's windows with the stock run's (:mod:`decode_windows`): which of a workload's phases (round
starts with many requests, tails with a few) it loses or wins. ``triton_builds`` lists the
Triton builds of Tangram's kernels the server logged during the measured run
(``kernels.build_log``: each stalled a measured step; with tensor parallelism each rank logs
its own).

Source: issue 7; SGLang ``benchmark/hicache/bench_multiturn.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import json
import shlex
import signal
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

from tangram_sglang.bench import decode_windows, multiturn_trace, sglang_client
from tangram_sglang.bench.multiturn_client import (
    PEAK_KEYS,
    LoadSettings,
    RequestRecord,
    model_eos_ids,
    run_conversations,
    token_figures,
)
from tangram_sglang.bench.multiturn_workloads import (
    DEFAULT_SYSTEM_PROMPT_TOKENS,
    WORKLOADS,
    WorkloadSpec,
    make_conversations,
    warmup_conversations,
)
from tangram_sglang.errors import ConfigError, ProfileError, TangramError
from tangram_sglang.profile import BudgetProfile, ModelIdentity

SCHEMA = "tangram-multiturn/1"
# config.json keys check_profile needs written out (not filled by a transformers class default)
EXPLICIT_SHAPE_KEYS = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads")
WARMUP_SEED = 7919  # offsets the warm-up's token ids from the workload's
GAUGES = (
    "sglang:num_running_reqs",
    "sglang:token_usage",
    "sglang:num_used_tokens",
    "sglang:num_retracted_requests_total",
    "tangram:pages_used",
    "tangram:kv_bytes_held",
)
# Cumulative token counters, read before and after a ``--client sglang`` run (bench_serving
# does not count a multi-turn run's prompt or cached tokens): summed over their label sets.
COUNTERS = {
    "prompt": "sglang:prompt_tokens_total",
    "cached": "sglang:cached_tokens_total",
    "generated": "sglang:generation_tokens_total",
}


# ---- parsing ----------------------------------------------------------------------------------
def parse_systems(text: str) -> list[tuple[str, float | None]]:
    """``baseline,tangram:0.25`` -> [("baseline", None), ("tangram-r0.25", 0.25)].

    ``baseline-<label>`` names another stock run. When ``<label>`` is an attention backend
    (:data:`STOCK_BACKENDS`, e.g. ``baseline-flashinfer``) that server runs with
    ``--attention-backend <label>`` instead of the one in ``--baseline-args``; otherwise with
    ``--baseline-args`` as given. The issue-7 ratios use ``baseline``; the "never slower than
    stock" ratios use the best of every ``baseline*`` system.

    Raises:
        ConfigError: an unknown system or a ratio outside (0, 1].
    """
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        if item == "baseline" or item.startswith("baseline-"):  # baseline-<label>: another run
            out.append((item, None))
            continue
        name, _, ratio = item.partition(":")
        try:
            r = float(ratio)
        except ValueError:
            r = -1.0
        if name != "tangram" or not 0 < r <= 1:
            raise ConfigError(f"--systems item {item!r}: use baseline or tangram:R, 0 < R <= 1")
        out.append((f"tangram-r{r:g}", r))
    if not out:
        raise ConfigError("--systems is empty; e.g. baseline,tangram:0.25")
    return out


STOCK_BACKENDS = ("triton", "flashinfer", "fa3", "torch_native")


def stock_backend_args(name: str, baseline_args: list[str]) -> list[str]:
    """``--baseline-args`` of a stock system, its attention backend set by its name.

    ``baseline-flashinfer`` -> ``baseline_args`` without any ``--attention-backend X`` plus
    ``--attention-backend flashinfer``; ``baseline`` and other labels -> ``baseline_args``.
    """
    label = name.removeprefix("baseline-") if name.startswith("baseline-") else None
    if label not in STOCK_BACKENDS:
        return list(baseline_args)
    out, skip = [], False
    for i, flag in enumerate(baseline_args):
        if skip:
            skip = False
            continue
        if flag == "--attention-backend":
            skip = i + 1 < len(baseline_args)
            continue
        if flag.startswith("--attention-backend="):
            continue
        out.append(flag)
    return [*out, "--attention-backend", label]


def parse_workload(item: str, args: argparse.Namespace) -> WorkloadSpec:
    """``cliff:64``, ``sharegpt:32x4``, ``long-context:16x3``, ``prefill:16x8192``.

    A trailing ``:no-max`` (``cliff:64:no-max``) sends that workload's requests without
    ``max_new_tokens`` (as ``--no-max-tokens`` does for every workload); its label ends in
    ``-no-max``, so one server run can measure a workload both ways.

    Raises:
        ConfigError: unknown name or a malformed size (not N or NxM, or a part below 1).
    """
    no_max = item.endswith(":no-max")
    name, _, size = item.removesuffix(":no-max").partition(":")
    if name not in WORKLOADS:
        raise ConfigError(f"--workloads item {item!r}: choose from {', '.join(WORKLOADS)}")
    try:
        parts = [int(p) for p in size.split("x")] if size else [args.num_clients]
    except ValueError:
        parts = []
    if not 1 <= len(parts) <= 2 or min(parts) < 1:
        raise ConfigError(
            f"--workloads item {item!r}: size must be N or NxM, whole numbers >= 1 "
            "(e.g. mixed:120x4: 120 clients, 4 rounds)"
        )
    clients = parts[0]
    second = parts[1] if len(parts) > 1 else None
    common = {
        "num_clients": clients,
        "seed": args.seed,
        "output_length": args.output_length,
        "context_tokens": args.context_tokens,
        "shared_context": args.shared_context,
        "system_prompt_tokens": args.system_prompt_tokens,
    }
    if name == "prefill":
        if no_max:
            raise ConfigError(f"--workloads item {item!r}: prefill generates 1 token; drop :no-max")
        return WorkloadSpec(name, request_length=second or args.request_length or 8192, **common)
    rounds = second or args.num_rounds
    return WorkloadSpec(
        name,
        num_rounds=rounds,
        request_length=args.request_length,
        no_max_tokens=no_max,
        **common,
    )


# ---- measuring --------------------------------------------------------------------------------
def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {metric name: value summed over label sets} for :data:`GAUGES` and
    :data:`COUNTERS`.

    Counters are cumulative since the server started (``retracted_requests_total``).
    """
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        key = name if name in GAUGES or name in COUNTERS.values() else None
        if key is None:
            continue
        try:
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
        except ValueError:
            continue
    return out


async def _read_metrics(base_url: str) -> dict[str, float]:
    """One read of ``/metrics`` (:func:`parse_metrics`).

    Raises:
        TangramError: the server did not answer (``--enable-metrics`` is on for every system).
    """
    import aiohttp

    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session,
            session.get(f"{base_url}/metrics") as resp,
        ):
            return parse_metrics(await resp.text())
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise TangramError(f"{base_url}/metrics did not answer ({exc!r})") from None


async def _poll_metrics(base_url: str, peaks: dict[str, float], stop: asyncio.Event) -> None:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while not stop.is_set():
            try:
                async with session.get(f"{base_url}/metrics") as resp:
                    for k, v in parse_metrics(await resp.text()).items():
                        peaks[k] = max(peaks.get(k, v), v)
            except (aiohttp.ClientError, TimeoutError):
                pass
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)


async def measure(
    base_url: str,
    spec: WorkloadSpec,
    vocab: int,
    settings: LoadSettings,
    trace: tuple[Path, int, int] | None = None,
    on_start: Callable[[], None] | None = None,
    sglang: sglang_client.ClientRun | None = None,
) -> dict:
    """Run one workload on a running server: ``settings.warmup_clients`` warm-up conversations
    (:func:`multiturn_workloads.warmup_conversations`, other token ids, not measured), the cache
    flushed, then the workload (token ids seeded by label).

    Args:
        trace: ``(folder, num_steps, top)``: SGLang's profiler records the run's first
            ``num_steps`` forward steps into ``folder``, and the analysis (``top``: how many
            host functions and kernels it lists)
            (:func:`multiturn_trace.collect_trace`) is returned under ``trace``, with the run's
            wall time as ``traced_wall_s`` (no other figure: the profiler slows the host). Pass
            ``settings.warmup_clients == 0`` for a repeat on a warm server.
        on_start: called once right before the measured conversations start (after the
            warm-up and the cache flush): ``run_system`` marks the server log there.
        sglang: the measured conversations go through SGLang's ``bench_serving`` over the
            chat API (``--client sglang``, :mod:`sglang_client`) instead of the own client;
            the warm-up still uses the own client. Not with ``trace``.

    Returns:
        Its metrics (:func:`summarize_run`), or ``{"traced_wall_s", "trace"}`` with ``trace``.

    Raises:
        TangramError: the server refused to flush its cache (the run would not start cold), to
            start the profiler, or wrote no trace.
    """
    import aiohttp

    conversations = make_conversations(spec)
    warmup = warmup_conversations(conversations, settings.warmup_clients)
    if warmup:
        await run_conversations(
            base_url,
            warmup,
            vocab,
            dataclasses.replace(settings, seed=settings.seed + WARMUP_SEED, no_max_tokens=False),
        )
    async with (
        aiohttp.ClientSession() as session,  # start cold: no prefix from earlier runs
        session.post(f"{base_url}/flush_cache", params={"timeout": 30}) as resp,
    ):
        body = await resp.text()
        if resp.status != 200:  # the cache would still hold the warm-up's (or a run's) KV
            raise TangramError(
                f"{spec.label}: /flush_cache answered HTTP {resp.status} ({body[:200]!r}), so "
                "the workload would not start cold; see the server log"
            )
    settings = dataclasses.replace(
        settings,
        seed=settings.seed + zlib.crc32(spec.label.encode()),
        no_max_tokens=settings.no_max_tokens or spec.no_max_tokens,
    )
    prepared = None
    if sglang is not None:  # the trace is written before the mark: only the run is measured
        prepared = sglang.prepare(
            base_url, spec, conversations, vocab, settings.seed, settings.max_parallel
        )
    if on_start is not None:
        on_start()
    if trace is not None:
        folder, num_steps, top = trace
        since = await multiturn_trace.start_profile(base_url, folder, num_steps)
        _, wall = await run_conversations(base_url, conversations, vocab, settings)
        await multiturn_trace.stop_profile(base_url)
        analysis = await asyncio.to_thread(multiturn_trace.collect_trace, folder, since, top)
        return {"traced_wall_s": wall, "trace": analysis}
    peaks: dict[str, float] = {}
    planned = sum(len(c.rounds) for c in conversations)
    before = await _read_metrics(base_url) if prepared is not None else {}
    stop = asyncio.Event()
    poller = asyncio.create_task(_poll_metrics(base_url, peaks, stop))
    try:
        if prepared is not None:
            command, result_path, log, output_len = prepared
            raw = await asyncio.to_thread(
                sglang_client.run_bench_serving, command, result_path, settings.timeout_s, log
            )
        else:
            records, wall = await run_conversations(base_url, conversations, vocab, settings)
    finally:
        stop.set()
        await poller
    if prepared is None:
        return summarize_run(records, wall, planned, peaks, wall >= settings.timeout_s)
    after = await _read_metrics(base_url)
    counted = {k: int(after.get(n, 0.0) - before.get(n, 0.0)) for k, n in COUNTERS.items()}
    return sglang_client.summarize_bench_serving(
        raw, planned, output_len, peaks, settings.timeout_s, counted
    )


def _pcts(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    arr = np.asarray(values, float)
    return {f"p{q}": float(np.percentile(arr, q)) for q in (50, 90, 99)}


def summarize_run(
    records: list[RequestRecord],
    wall_s: float,
    planned: int,
    peaks: dict[str, float],
    timed_out: bool,
) -> dict:
    """Throughput, latency percentiles, cache hit rate and server peaks of one workload run."""
    ok = [r for r in records if r.error is None]
    out_tokens = sum(r.output_tokens for r in ok)
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    return {
        "requests_planned": planned,
        "requests_ok": len(ok),
        "requests_failed": len(records) - len(ok),
        "timed_out": bool(timed_out),
        "first_errors": [r.error for r in records if r.error][:3],
        "wall_s": wall_s,
        **token_figures(out_tokens, prompt, cached, wall_s, len(ok)),
        "ttft_s": _pcts([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_s": _pcts([r.tpot_s for r in ok if r.tpot_s is not None]),
        "latency_s": _pcts([r.latency_s for r in ok]),
        **{key: peaks.get(name) for key, name in PEAK_KEYS.items()},
    }


# ---- summary ----------------------------------------------------------------------------------
def _metric(systems: dict, system: str, workload: str, key: str) -> float | None:
    run = systems.get(system, {}).get("workloads", {}).get(workload)
    if not run or run.get("requests_ok", 0) == 0:
        return None
    return run.get(key)


def _ratio(systems, num, den, workload, key, missing, name) -> float | None:
    a, b = _metric(systems, num, workload, key), _metric(systems, den, workload, key)
    if a is None or b in (None, 0):
        missing[name] = f"needs {key} of {workload} on {num} and {den}"
        return None
    return a / b


def summarize(systems: dict, main: str, prefill: str | None) -> dict:
    """The issue-7 ratios from the systems' runs (null + ``missing`` entry when not measured)."""
    missing: dict[str, str] = {}
    t25, t50 = "tangram-r0.25", "tangram-r0.5"
    out = {
        "main_workload": main,
        "throughput_ratio_at_25pct": _ratio(
            systems, t25, "baseline", main, "output_tok_per_s", missing, "throughput_ratio_at_25pct"
        ),
        "throughput_ratio_at_50pct": _ratio(
            systems, t50, "baseline", main, "output_tok_per_s", missing, "throughput_ratio_at_50pct"
        ),
        "prefill_time_ratio": _ratio(
            systems, t25, "baseline", prefill or "", "wall_s", missing, "prefill_time_ratio"
        ),
        "max_concurrency_ratio": _ratio(
            systems, t25, "baseline", main, "peak_running_reqs", missing, "max_concurrency_ratio"
        ),
        "cliff_throughput_ratio_64_clients": _ratio(
            systems,
            t25,
            "baseline",
            "cliff-64",
            "output_tok_per_s",
            missing,
            "cliff_throughput_ratio_64_clients",
        ),
    }
    caps = [systems.get(s, {}).get("max_total_num_tokens") for s in (t25, "baseline")]
    out["kv_capacity_ratio"] = caps[0] / caps[1] if all(caps) else None
    out["cliff"] = {
        name: {
            w: {
                k: run.get(k)
                for k in ("output_tok_per_s", "cache_hit_rate", "wall_s", "peak_running_reqs")
            }
            for w, run in sys_.get("workloads", {}).items()
            if w.startswith("cliff-")
        }
        for name, sys_ in systems.items()
    }
    out["concurrency"] = {
        name: {w: run.get("peak_running_reqs") for w, run in sys_.get("workloads", {}).items()}
        for name, sys_ in systems.items()
    }
    out.update(never_slower_ratios(systems, missing))
    out.update(shared_prefix_ratios(systems, missing))
    out["missing"] = missing
    return out


def _best_stock(systems: dict, workload: str) -> tuple[str | None, float | None]:
    """The stock system (``baseline*``) with the highest output tok/s on ``workload``."""
    best: tuple[str | None, float | None] = (None, None)
    for name in systems:
        if name == "baseline" or name.startswith("baseline-"):
            value = _metric(systems, name, workload, "output_tok_per_s")
            if value is not None and (best[1] is None or value > best[1]):
                best = (name, value)
    return best


SHARED_WORKLOADS = {  # summary key -> label prefix of its workload (issue targets: 64x4)
    "shared_context_ratio_vs_stock": "long-context-shared-",
    "system_prompt_ratio_vs_stock": "system-prompt-",
}


def shared_prefix_ratios(systems: dict, missing: dict[str, str]) -> dict:
    """Tangram (0.25) over the best stock backend on the shared-prefix workloads.

    * ``shared_context_ratio_vs_stock``: output tok/s of ``tangram-r0.25`` on the
      ``long-context-shared-*`` run (``64x4`` when several were run) over the best ``baseline*``
      system's on the same workload (target >= 1.0);
    * ``system_prompt_ratio_vs_stock``: the same on ``system-prompt-*`` (target >= 0.95);
    * ``shared_prefix``: per system and shared-prefix workload, output tok/s and cache hit rate
      (the prefix hit rate target: Tangram within 2 points of stock's).
    """
    t25 = "tangram-r0.25"
    out: dict = {}
    for key, prefix in SHARED_WORKLOADS.items():
        labels = sorted(
            w for w in systems.get(t25, {}).get("workloads", {}) if w.startswith(prefix)
        )
        label = next((w for w in labels if w.endswith("-64x4")), labels[0] if labels else None)
        stock, value = _best_stock(systems, label) if label else (None, None)
        mine = _metric(systems, t25, label, "output_tok_per_s") if label else None
        if mine is None or not value:
            missing[key] = f"needs output_tok_per_s of {prefix}* on {t25} and a baseline* system"
            out[key] = None
        else:
            out[key] = mine / value
    out["shared_prefix"] = {
        name: {
            w: {k: run.get(k) for k in ("output_tok_per_s", "cache_hit_rate")}
            for w, run in sys_.get("workloads", {}).items()
            if w.startswith(tuple(SHARED_WORKLOADS.values()))
        }
        for name, sys_ in systems.items()
    }
    return out


def never_slower_ratios(systems: dict, missing: dict[str, str]) -> dict:
    """Tangram over the best stock backend (issue 18's bar: >= 0.95 on every workload).

    * ``sharegpt_ratio_vs_best_stock``: output tok/s of ``tangram-r0.25`` on ``sharegpt-64x4``
      over the best ``baseline*`` system on it;
    * ``ratio1_min_ratio_vs_stock``: the lowest, over the workloads ``tangram-r1`` ran, of its
      output tok/s over the best stock system on that workload (``ratio1_per_workload``
      holds each);
    * ``vs_best_stock``: per Tangram system and workload, that ratio and the stock system it
      was taken against, and, where both runs kept their decode log lines (``decode_log``),
      ``decode_windows``: the two servers' decode windows paired in order and their wall time
      summed by requests running (:func:`decode_windows.paired_seconds`; ``speed`` above 1:
      Tangram faster in those windows).
    Output tok/s throughout; a ratio whose runs are missing is null with a ``missing`` entry.
    """
    per: dict[str, dict[str, dict]] = {}
    for name, run in systems.items():
        if not name.startswith("tangram-"):
            continue
        for workload in run.get("workloads", {}):
            stock, value = _best_stock(systems, workload)
            mine = _metric(systems, name, workload, "output_tok_per_s")
            if stock is None or not value or mine is None:
                continue
            entry = {"ratio": mine / value, "stock": stock}
            base_log = systems[stock]["workloads"][workload].get("decode_log")
            my_log = run["workloads"][workload].get("decode_log")
            if base_log and my_log:
                entry["decode_windows"] = decode_windows.paired_seconds(base_log, my_log)
            per.setdefault(name, {})[workload] = entry
    share = per.get("tangram-r0.25", {}).get("sharegpt-64x4")
    if share is None:
        missing["sharegpt_ratio_vs_best_stock"] = (
            "needs output_tok_per_s of sharegpt-64x4 on tangram-r0.25 and a baseline* system"
        )
    ratio1 = {w: v["ratio"] for w, v in per.get("tangram-r1", {}).items()}
    if not ratio1:
        missing["ratio1_min_ratio_vs_stock"] = "needs tangram:1.0 and a baseline* system run"
    return {
        "sharegpt_ratio_vs_best_stock": None if share is None else share["ratio"],
        "ratio1_min_ratio_vs_stock": min(ratio1.values()) if ratio1 else None,
        "ratio1_per_workload": ratio1,
        "vs_best_stock": per,
    }


# ---- servers ----------------------------------------------------------------------------------
def server_flags(
    ratio: float | None, profile: str | None, common: list[str], baseline_only: list[str] = ()
) -> list[str]:
    """Launch flags of one system: the common flags + the Tangram ones (or the baseline's own).

    ``baseline_only`` holds flags that ``--tangram`` rejects, e.g. the stock attention backend
    (``--attention-backend triton``: FA3, SGLang's default on Hopper, is not in the
    GPU machine's ``sgl_kernel``).
    """
    flags = list(common) + ["--enable-metrics"]
    if ratio is None:
        flags += list(baseline_only)
    else:
        if not profile:
            raise ConfigError("a tangram:R system needs --profile PATH")
        flags += ["--tangram", "--tangram-profile", profile, "--tangram-target-ratio", str(ratio)]
    return flags


def run_system(name: str, flags: list[str], specs: list[WorkloadSpec], args, result: dict) -> None:
    """Start one server, run every workload, stop it; ``result['systems'][name]`` filled."""
    from tangram_sglang.serving import SGLangServer

    entry = {"server_args": flags, "workloads": {}, "error": None}
    result["systems"][name] = entry
    log = Path(args.log_dir) / f"multiturn-{name}.server.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    server = SGLangServer(args.model_path, flags, args.device, log, args.startup_timeout_s)
    try:
        server.start()
        entry["startup_s"] = time.perf_counter() - t0
        info = server.server_info()
        entry["max_total_num_tokens"] = info.get("max_total_num_tokens")
        entry["tangram"] = info.get("tangram")
        settings = LoadSettings(
            args.max_parallel,
            args.request_rate,
            args.round_barrier,
            args.workload_timeout_s,
            args.seed,
            args.no_max_tokens,
            model_eos_ids(args.model_path),
            args.warmup_clients,
        )
        client = None
        if args.client == "sglang":
            decode = sglang_client.check_chat_tokenizer(args.model_path).decode
            client = sglang_client.ClientRun(args.model_path, Path(args.log_dir) / name, decode)
        for spec in specs:
            print(f"[multiturn] {name}: {spec.label} ...", flush=True)
            mark = _LogMark(log)
            run = asyncio.run(
                measure(
                    server.base_url,
                    spec,
                    args.vocab_size,
                    settings,
                    on_start=mark,
                    sglang=client,
                )
            )
            run["decode_log"] = run_decode_lines(log, mark.offset)
            run["triton_builds"] = run_build_lines(log, mark.offset)
            entry["workloads"][spec.label] = run
            print(
                f"[multiturn] {name}: {spec.label}: {run['output_tok_per_s']:.1f} out tok/s, "
                f"wall {run['wall_s']:.1f} s, cache hit {run['cache_hit_rate']:.3f}, peak "
                f"running {run['peak_running_reqs']}, mean out {run['mean_output_tokens']}, "
                f"failed {run['requests_failed']}",
                flush=True,
            )
            write_result(result, args)
            if args.trace_steps:
                run.update(traced_repeat(server.base_url, name, spec, run, settings, args))
                write_result(result, args)
    except TangramError as exc:
        entry["error"] = str(exc)[-3000:]
        print(f"[multiturn] {name}: FAILED: {str(exc)[-1500:]}", flush=True)
    finally:
        server.stop()
        write_result(result, args)


class _LogMark:
    """Called at a run's start: remembers the server log's size then (bytes)."""

    def __init__(self, log: Path) -> None:
        self.log, self.offset = log, 0

    def __call__(self) -> None:
        self.offset = self.log.stat().st_size if self.log.exists() else 0


def run_decode_lines(log: Path, offset: int) -> list[list[float]]:
    """The measured run's decode log lines (``decode_windows.parse_decode_lines``): those the
    server wrote after byte ``offset`` of its log, the first one dropped (its window reaches back
    before the run: warm-up or idle time)."""
    return decode_windows.parse_decode_lines(_log_after(log, offset))[1:]


def _log_after(log: Path, offset: int) -> str:
    """The server log's text after byte ``offset`` ("" when there is no log)."""
    if not log.exists():
        return ""
    with log.open("rb") as f:
        f.seek(offset)
        return f.read().decode("utf-8", errors="replace")


def run_build_lines(log: Path, offset: int) -> list[str]:
    """The Triton builds of Tangram's kernels during the measured run (``kernels.build_log``'s
    lines after byte ``offset`` of the server log, from "Triton built" on): each one stalled a
    measured step. Empty for a stock server, or when nothing was built."""
    text = _log_after(log, offset)
    return [
        line[line.index("Triton built") :] for line in text.splitlines() if "Triton built" in line
    ]


def traced_repeat(
    base_url: str, name: str, spec: WorkloadSpec, run: dict, settings: LoadSettings, args
) -> dict:
    """``--trace-steps``: the workload once more under SGLang's profiler, after its measured run.

    Skipped when the measured run timed out or answered no request (the repeat would only wait
    out the same failure). A profiler or trace failure is recorded under ``trace.error`` and
    leaves the measured figures and the system's other workloads alone.

    Returns:
        ``{"traced_wall_s": s, "trace": analysis}`` (:func:`measure`), or ``{"trace":
        {"error": why}}``.
    """
    import aiohttp

    if run["timed_out"] or run["requests_ok"] == 0:
        return {"trace": {"error": "not traced: the measured run timed out or answered nothing"}}
    folder = Path(args.log_dir).resolve() / f"trace-{name}-{spec.label}"
    repeat = dataclasses.replace(settings, warmup_clients=0)
    trace = (folder, args.trace_steps, args.trace_top)
    try:
        return asyncio.run(measure(base_url, spec, args.vocab_size, repeat, trace))
    except (TangramError, aiohttp.ClientError, TimeoutError) as exc:  # e.g. the server died
        print(f"[multiturn] {name}: {spec.label}: trace failed: {exc}", flush=True)
        return {"trace": {"error": str(exc)[-1500:]}}


def write_result(result: dict, args) -> None:
    """Recompute the summary and (re)write the JSON."""
    result["summary"] = summarize(result["systems"], args.main_workload, args.prefill_label)
    _write_json(result, args.output)


def _write_json(result: dict, output: str) -> None:
    """Write ``result`` to ``output``, creating its folder; raises OSError when it cannot."""
    path = Path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=float) + "\n")


def _load_result(path: str) -> dict:
    """One result file for ``merge``, checked; raises ConfigError naming ``path``."""
    try:
        result = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"merge input {path}: no such file") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"merge input {path}: not JSON or unreadable ({exc})") from None
    systems = result.get("systems") if isinstance(result, dict) else None
    if not isinstance(systems, dict):
        raise ConfigError(f"merge input {path}: no 'systems' object; not a multiturn result file")
    if not isinstance(result.get("settings", {}), dict):
        raise ConfigError(f"merge input {path}: settings is not an object")
    for name, run in systems.items():
        if not isinstance(run, dict):
            raise ConfigError(f"merge input {path}: systems.{name} is not an object")
        workloads = run.get("workloads", {})
        if not isinstance(workloads, dict):
            raise ConfigError(f"merge input {path}: systems.{name}.workloads is not an object")
        for label, entry in workloads.items():
            if not isinstance(entry, dict):
                raise ConfigError(
                    f"merge input {path}: systems.{name}.workloads.{label} is not an object"
                )
    return result


def merge(paths: list[str], output: str) -> dict:
    """Join the ``systems`` of several result files and recompute the summary.

    Per system, workloads are joined (a later file's run of the same workload replaces the
    earlier one) and the later file's other fields (server args, start-up, pool) win, so a
    system measured on different workloads in separate runs keeps all of them. Each joined
    workload names the file its run came from (``source_file``) and each system the file its
    server record came from (``server_source_file``; a merged input keeps the names it holds),
    so a workload kept from an earlier run can be told apart from the later run's server
    record. The summary pairs whatever runs the merge holds: merge only side-by-side runs.

    Raises:
        ConfigError: an input that is missing, not JSON, or not a result file (no ``systems``
            object of per-system objects with a ``workloads`` object of objects, a
            ``settings`` that is not an object), names the file; or inputs whose fields have
            types the summary cannot read (e.g. a throughput that is not a number).
        OSError: ``output`` cannot be written.
    """
    results = [_load_result(p) for p in paths]
    merged = dict(results[0])
    merged["systems"] = {}
    for path, result in zip(paths, results, strict=True):
        for name, run in result["systems"].items():
            earlier = merged["systems"].get(name, {})
            joined = {w: {"source_file": path, **r} for w, r in run.get("workloads", {}).items()}
            workloads = {**earlier.get("workloads", {}), **joined}
            merged["systems"][name] = {
                **earlier,
                **run,
                "workloads": workloads,
                "server_source_file": run.get("server_source_file", path),
            }
    merged["merged_from"] = list(paths)
    settings = merged.get("settings", {})
    try:
        merged["summary"] = summarize(
            merged["systems"],
            settings.get("main_workload", "cliff-64"),
            settings.get("prefill_label"),
        )
    except (TypeError, AttributeError, KeyError) as exc:
        raise ConfigError(
            f"merge inputs {', '.join(paths)}: a field has a type the summary cannot read "
            f"({type(exc).__name__}: {exc}); check the files are bench.multiturn results"
        ) from None
    _write_json(merged, output)
    return merged


# ---- CLI --------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tangram_sglang.bench.multiturn", description=__doc__.splitlines()[0]
    )
    p.add_argument("--model-path", required=True, help="HF folder or a models.py name (smollm2)")
    p.add_argument(
        "--device",
        default=None,
        choices=["cuda", "cpu"],
        help="default: cuda when torch sees a GPU, else cpu",
    )
    p.add_argument("--profile", help="Tangram budget profile (for tangram:R systems)")
    p.add_argument(
        "--systems",
        default="baseline,tangram:0.25,tangram:0.5",
        help="servers to run in turn, comma-separated: baseline (stock SGLang, full KV), "
        f"baseline-BACKEND (stock with --attention-backend BACKEND: {', '.join(STOCK_BACKENDS)}), "
        "tangram:R (--tangram at mean kept ratio R in (0, 1]; needs --profile); e.g. "
        "baseline,baseline-flashinfer,tangram:0.25 (default: %(default)s)",
    )
    p.add_argument("--server-args", default="", help="flags for every server (one string)")
    p.add_argument("--baseline-args", default="", help="flags for the baseline server only")
    p.add_argument(
        "--workloads",
        default="cliff:32,cliff:64,prefill:16x8192,sharegpt:64x4",
        help="comma-separated NAME[:N[xM]][:no-max], NAME one of "
        f"{', '.join(WORKLOADS)}: N clients (default --num-clients), M rounds (default "
        "--num-rounds; cliff's are fixed); prefill:NxM is N one-round requests of M tokens "
        "(default --request-length, else 8192); :no-max sends that workload without "
        "max_new_tokens (not prefill); e.g. cliff:64,sharegpt:64x4,mixed:120x4,"
        "prefill:16x8192,cliff:64:no-max (default: %(default)s)",
    )
    p.add_argument(
        "--main-workload",
        default=None,
        help="label the throughput ratios use (default: cliff-64 if run, else the "
        "first of --workloads)",
    )
    p.add_argument(
        "--num-clients",
        type=int,
        default=32,
        help="clients of a --workloads item without N (default: %(default)s)",
    )
    p.add_argument(
        "--num-rounds",
        type=int,
        default=4,
        help="rounds of a --workloads item without M (default: %(default)s)",
    )
    p.add_argument("--request-length", type=int, default=None, help="tokens (see workloads)")
    p.add_argument("--output-length", type=int, default=None, help="tokens per round")
    p.add_argument("--context-tokens", type=int, default=8192, help="long-context round 1")
    p.add_argument("--shared-context", action="store_true", help="one long context for all")
    p.add_argument(
        "--system-prompt-tokens",
        type=int,
        default=DEFAULT_SYSTEM_PROMPT_TOKENS,
        help="system-prompt workload: tokens of the system prompt every conversation shares",
    )
    p.add_argument(
        "--max-parallel",
        type=int,
        default=128,
        help="requests in flight at most, over all clients (default: %(default)s)",
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="new requests per second, Poisson arrivals (default: inf, no pacing)",
    )
    p.add_argument(
        "--round-barrier",
        action="store_true",
        help="every client finishes round r before any client sends round r + 1",
    )
    p.add_argument(
        "--workload-timeout-s",
        type=float,
        default=600.0,
        help="wall-clock cap of one workload run, seconds (default: %(default)s)",
    )
    p.add_argument(
        "--startup-timeout-s",
        type=float,
        default=600.0,
        help="how long a server may take to start, seconds (default: %(default)s)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seeds the token ids, the ShareGPT conversations picked, the request pacing and "
        "the --no-max-tokens lengths: each system gets the same requests (default: %(default)s)",
    )
    p.add_argument(
        "--no-max-tokens",
        action="store_true",
        help="requests leave max_new_tokens unset (null); each ends at a length drawn per "
        "(seed, client, round), geometric with the round's output length as mean "
        "(min_new_tokens, then one stop id with a logit bias): the same lengths on every "
        "system (temperature 1)",
    )
    p.add_argument(
        "--warmup-clients",
        type=int,
        default=8,
        help="before each workload, this many of its conversations (first 2 rounds, 8 tokens "
        "out, other token ids) run unmeasured and the cache is flushed, so no system pays "
        "its kernels' first-use compilation inside the timed run (0: none)",
    )
    p.add_argument(
        "--trace-steps",
        type=int,
        default=0,
        help="> 0: after each workload's measured run, run it again (cache flushed, same token "
        "ids, no warm-up) with SGLang's profiler on for its first N forward steps; the "
        "workload's 'trace' key holds GPU busy/idle time, the host functions the GPU waited "
        "for and GPU time per kernel (bench.prefill_trace's analysis; the trace files under "
        "--log-dir). Not a throughput figure (default: 0, no trace)",
    )
    p.add_argument(
        "--trace-top",
        type=int,
        default=40,
        help="host functions and kernels listed per trace (default: %(default)s)",
    )
    p.add_argument(
        "--client",
        default="tangram",
        choices=["tangram", "sglang"],
        help="load generator of the measured runs: tangram (this bench's own: token ids to "
        "/generate) or sglang (SGLang's bench_serving, python -m sglang.benchmark.serving, over "
        "/v1/chat/completions: conversations of the same lengths as text; one output length "
        "per workload, at most --max-parallel clients, no --request-rate, --round-barrier, "
        ":no-max or --trace-steps) (default: %(default)s)",
    )
    p.add_argument(
        "--log-dir",
        default="/tmp/tangram-multiturn",
        help="server logs, multiturn-SYSTEM.server.log each, and the --trace-steps traces, "
        "trace-SYSTEM-WORKLOAD/ each (default: %(default)s)",
    )
    p.add_argument(
        "--output",
        default=None,
        help="result JSON (default: "
        "benchmarks/results/multiturn-h200.json on CUDA, /tmp/... on CPU)",
    )
    return p


def _resolve_model(path: str) -> Path:
    if Path(path).is_dir():
        return Path(path).resolve()
    from tangram_sglang.models import model_path

    return Path(model_path(path))


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status: 0, 1 when a system failed (its ``error`` is set in
    the JSON, which is still written with the summary), 2 on a bad flag or merge input."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["merge"]:
        mp = argparse.ArgumentParser(prog="python -m tangram_sglang.bench.multiturn merge")
        mp.add_argument("inputs", nargs="+")
        mp.add_argument("--output", required=True)
        margs = mp.parse_args(argv[1:])
        try:
            print(json.dumps(merge(margs.inputs, margs.output)["summary"], indent=1))
        except (TangramError, OSError) as exc:  # OSError: the --output path
            print(f"multiturn merge: error: {exc}", file=sys.stderr)
            return 2
        return 0
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)  # `timeout` / kill: stop the server, keep the JSON
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        args.model_path = str(_resolve_model(args.model_path))
        config = json.loads((Path(args.model_path) / "config.json").read_text())
        args.vocab_size = int(config["vocab_size"])
        systems = parse_systems(args.systems)
        specs = [parse_workload(w, args) for w in args.workloads.split(",") if w.strip()]
        check_args(args, systems, specs)
    except (TangramError, OSError, KeyError, ValueError) as exc:
        print(f"multiturn: error: {exc}", file=sys.stderr)
        return 2
    args.prefill_label = next((s.label for s in specs if s.name == "prefill"), None)
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    command = " ".join(["python -m tangram_sglang.bench.multiturn", *map(shlex.quote, argv)])
    result = {
        "schema": SCHEMA,
        "date": now,
        "machine": _machine(args.device),
        "command": command,
        "model_path": args.model_path,
        "profile": args.profile,
        "settings": {k: v for k, v in vars(args).items() if k not in ("output", "log_dir")},
        "systems": {},
    }
    common = shlex.split(args.server_args)
    for name, ratio in systems:
        stock = stock_backend_args(name, shlex.split(args.baseline_args))
        flags = server_flags(ratio, args.profile, common, stock)
        run_system(name, flags, specs, args, result)
    print(json.dumps(result["summary"], indent=1))
    failed = [name for name, entry in result["systems"].items() if entry.get("error")]
    if failed:
        print(
            f"multiturn: error: {len(failed)} system(s) failed: {', '.join(failed)}; the "
            f"messages are under systems.<name>.error in {args.output} (server logs in "
            f"{args.log_dir})",
            file=sys.stderr,
        )
        return 1
    return 0


MAX_CLIENTS = 10_000  # conversations per workload (a bench, not a soak test)
CUDA_OUTPUT = "benchmarks/results/multiturn-h200.json"  # default --output on CUDA
CPU_OUTPUT = "/tmp/tangram-multiturn/multiturn-cpu.json"  # on CPU: never the committed results


def check_args(args: argparse.Namespace, systems: list, specs: list[WorkloadSpec]) -> None:
    """Every flag checked before a server starts (and before the output file is touched).

    ``--profile`` comes last (:func:`check_profile`), so a run without one still hears about
    its other bad flags first.

    Also fills the default ``--output``: :data:`CUDA_OUTPUT`
    (``benchmarks/results/multiturn-h200.json``) on CUDA, :data:`CPU_OUTPUT`
    (``/tmp/tangram-multiturn/multiturn-cpu.json``) on CPU (a toy run never overwrites results).

    Raises:
        ConfigError: names the flag, the value and the allowed range.
    """
    positive = {
        "--max-parallel": args.max_parallel,
        "--request-rate": args.request_rate,
        "--workload-timeout-s": args.workload_timeout_s,
        "--startup-timeout-s": args.startup_timeout_s,
        "--num-rounds": args.num_rounds,
        "--context-tokens": args.context_tokens,
        "--request-length": args.request_length,
        "--output-length": args.output_length,
        "--system-prompt-tokens": args.system_prompt_tokens,
    }
    for flag, value in positive.items():
        if value is not None and not value > 0:
            raise ConfigError(f"{flag} {value}: must be > 0")
    if not specs:
        raise ConfigError("--workloads is empty; e.g. cliff:64,prefill:16x8192")
    if not 0 <= args.trace_steps <= 100_000:
        raise ConfigError(f"--trace-steps {args.trace_steps}: must be 0..100000 (0: no trace)")
    if args.trace_top < 1:
        raise ConfigError(f"--trace-top {args.trace_top}: list at least 1 function / kernel")
    if not 0 <= args.warmup_clients <= MAX_CLIENTS:
        raise ConfigError(
            f"--warmup-clients {args.warmup_clients}: must be 0..{MAX_CLIENTS} (0: no warm-up)"
        )
    if not 1 <= args.num_clients <= MAX_CLIENTS:
        raise ConfigError(f"--num-clients {args.num_clients}: must be 1..{MAX_CLIENTS}")
    for spec in specs:
        if not 1 <= spec.num_clients <= MAX_CLIENTS or not 1 <= spec.num_rounds <= 1000:
            raise ConfigError(
                f"--workloads {spec.label}: clients must be 1..{MAX_CLIENTS} and rounds 1..1000"
            )
    labels = [spec.label for spec in specs]
    if args.main_workload is None:
        args.main_workload = "cliff-64" if "cliff-64" in labels else labels[0]
    if args.main_workload not in labels:
        raise ConfigError(
            f"--main-workload {args.main_workload!r}: not one of --workloads ({', '.join(labels)})"
        )
    for flag, text in (
        ("--server-args", args.server_args),
        ("--baseline-args", args.baseline_args),
    ):
        try:
            shlex.split(text)
        except ValueError as exc:
            raise ConfigError(f"{flag} {text!r}: {exc}; quote it as one shell word") from None
    no_max = [s.label for s in specs if s.no_max_tokens]
    source = "--no-max-tokens" if args.no_max_tokens else f"--workloads {','.join(no_max)}"
    flags = [("--server-args", args.server_args)]
    if any(ratio is None for _, ratio in systems):  # only stock systems get --baseline-args
        flags.append(("--baseline-args", args.baseline_args))
    for flag, text in flags:
        skips = any(_skips_tokenizer(word) for word in shlex.split(text))
        if skips and (args.no_max_tokens or no_max):
            raise ConfigError(
                f"{source}: requests without max_new_tokens hold their lengths with "
                "min_new_tokens, which SGLang refuses under --skip-tokenizer-init (HTTP 400 on "
                f"every request); drop --skip-tokenizer-init from {flag} (a model folder without "
                "a tokenizer gets one from python -m tangram_sglang.bench.dummy_tokenizer "
                "MODEL_DIR)"
            )
    if args.client == "sglang":
        check_sglang_client(args, systems, specs)
    check_profile(args, systems)  # last: every other flag is named first
    if args.output is None:
        args.output = CUDA_OUTPUT if args.device == "cuda" else CPU_OUTPUT
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)


def check_sglang_client(args: argparse.Namespace, systems: list, specs: list[WorkloadSpec]) -> None:
    """``--client sglang``'s limits, before a server starts.

    Raises:
        ConfigError: a flag bench_serving cannot honour (names it and the way out), a workload
            whose rounds differ in output length or with more clients than ``--max-parallel``,
            or a model without a tokenizer and chat template (or a server told to skip it).
    """
    unsupported = {
        "--request-rate": args.request_rate != float("inf"),
        "--round-barrier": args.round_barrier,
        "--no-max-tokens": args.no_max_tokens,
        "--trace-steps": args.trace_steps > 0,
    }
    for spec in specs:
        unsupported[f"--workloads {spec.label}"] = spec.no_max_tokens
    for flag, used in unsupported.items():
        if used:
            raise ConfigError(
                f"{flag}: --client sglang (bench_serving) cannot run it; drop it or use "
                "--client tangram"
            )
    for spec in specs:
        conversations = make_conversations(spec)
        sglang_client.uniform_output_length(conversations, spec.label)
        multi_round = any(len(c.rounds) > 1 for c in conversations)
        if spec.num_clients > args.max_parallel and multi_round:
            raise ConfigError(
                f"--workloads {spec.label}: {spec.num_clients} clients but --max-parallel "
                f"{args.max_parallel}; under --client sglang a conversation holds its slot "
                "through all its rounds (the own client's bound is on requests), so raise "
                f"--max-parallel to {spec.num_clients} or use fewer clients"
            )
    flags = [("--server-args", args.server_args)]
    if any(ratio is None for _, ratio in systems):  # only stock systems get --baseline-args
        flags.append(("--baseline-args", args.baseline_args))
    for flag, text in flags:
        if any(_skips_tokenizer(word) for word in shlex.split(text)):
            raise ConfigError(
                f"{flag}: --skip-tokenizer-init leaves the server no chat API, which --client "
                "sglang talks to; drop it (a model folder without a tokenizer gets one from "
                "python -m tangram_sglang.bench.dummy_tokenizer MODEL_DIR)"
            )
    sglang_client.check_chat_tokenizer(args.model_path)  # last: it loads the tokenizer


def check_profile(args: argparse.Namespace, systems: list) -> None:
    """``--profile`` of the ``tangram:R`` systems: an existing, valid profile for the model.

    When ``--model-path`` (resolved to a folder) has a readable ``config.json`` that writes out
    the layer and head counts (:data:`EXPLICIT_SHAPE_KEYS`), the profile's model is checked
    against it (:meth:`BudgetProfile.check_model`: layers, KV and query heads, and head_dim
    where the file gives it) before any server starts, so a profile for another model does not
    wait for the stock systems to run first. The config fingerprint is left to the server's own
    check.

    Raises:
        ConfigError: no ``--profile`` while a ``tangram:R`` system is asked for, a missing or
            invalid file, or a profile made for another model; names ``--profile`` and the fix.
    """
    tangram = [name for name, ratio in systems if ratio is not None]
    if not tangram:
        return
    if not args.profile or not Path(args.profile).is_file():
        what = "is missing" if not args.profile else f"{args.profile!r}: no such file"
        raise ConfigError(
            f"--profile {what}: the tangram:R systems ({', '.join(tangram)}) need a budget "
            "profile JSON for the model (the shipped ones are calibration/<model>/*.json); pass "
            "one, or leave tangram:R out of --systems"
        )
    try:
        profile = BudgetProfile.load(args.profile)
    except ProfileError as exc:
        raise ConfigError(
            f"--profile: {exc}; pass a profile JSON (calibration/<model>/*.json) or calibrate "
            "one with `python -m tangram_sglang.calibrate --model-path ...`"
        ) from None
    try:
        config = json.loads((Path(args.model_path) / "config.json").read_text())
        config = config.get("text_config") or config  # the server reads a VLM's text config
        if any(key not in config for key in EXPLICIT_SHAPE_KEYS):
            return  # transformers would fill a class default the raw file does not show
        model = ModelIdentity.from_hf_config(config)
    except (OSError, ValueError, TypeError, KeyError, AttributeError, ZeroDivisionError):
        return  # no readable config here: the server checks the profile when it starts
    if "head_dim" not in config:  # derived per model class; the server's check has it
        model = dataclasses.replace(model, head_dim=profile.model.head_dim)
    try:
        profile.check_model(dataclasses.replace(model, config_fingerprint=""))
    except ProfileError as exc:
        raise ConfigError(f"--profile {args.profile}: {exc}") from None


def _skips_tokenizer(word: str) -> bool:
    """``word`` turns on ``--skip-tokenizer-init``: the flag or an abbreviation that SGLang's
    argparse takes for it (``--skip-t`` is the shortest one no other flag starts with)."""
    return len(word) >= len("--skip-t") and "--skip-tokenizer-init".startswith(word)


def _interrupt(signum, frame) -> None:
    """SIGTERM -> KeyboardInterrupt, so ``run_system``'s ``finally`` stops the server."""
    raise KeyboardInterrupt(f"signal {signum}")


def _machine(device: str) -> str:
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cuda (absent)"
    import platform

    return f"cpu ({platform.processor() or platform.machine()})"


if __name__ == "__main__":
    sys.exit(main())
