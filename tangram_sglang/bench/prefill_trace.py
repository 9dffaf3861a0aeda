"""``python -m tangram_sglang.bench.prefill_trace``: where a server's prefill wall time goes.

Starts one real SGLang server (stock, or ``--tangram`` with a profile), warms it with one round
of prompts, then records a second round (``N`` prompts of ``L`` random token ids, 1 output token,
sent at once) under SGLang's own torch profiler (``POST /start_profile``, CPU + GPU activities,
Python stacks) and reads the Chrome trace it writes:

* GPU busy time: the union of all kernel and memcpy intervals (ms);
* GPU idle time inside the round: span minus busy, and its largest gaps;
* which host functions ran while the GPU was idle (each Python function's overlap with the idle
  intervals, ms). A host function that the GPU waits for shows up here; one that runs while
  kernels are queued does not.

Two systems' idle times, side by side, are the host-side cost of one over the other at equal
batch (issue 7's ``prefill_time_ratio``). Needs CUDA: the trace's GPU side is CUPTI's.

``--turn-tokens E`` records later turns instead: each round first sends its ``N`` prompts as
histories (1 output token each, cached in the radix tree), then sends every history again with
``E`` new tokens appended, one request every ``--stagger-ms`` (each arrives alone while the
earlier ones decode, as a conversation's next turn does when output lengths differ). Only the
later turns are timed and traced (the profiler starts after the histories are cached; the
JSON's ``trace_covers`` says so and ``history_wall_s`` times the histories' prefill): what one
turn with a long cached prefix costs, prefill and the decode steps it interrupts.

Example (device machine, after ``source scripts/device_setup.sh``)::

    python3 -m tangram_sglang.bench.prefill_trace --model-path $MODEL --label tangram \\
        --server-args "--load-format dummy ... --tangram --tangram-profile $PROFILE" \\
        --num-prompts 16 --prompt-len 8192 --json $OUT/trace-tangram.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shlex
import sys
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import requests

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def send_round(
    base_url: str, num_prompts: int, prompt_len: int, seed: int, output_len: int = 1
) -> float:
    """Send ``num_prompts`` prompts of ``prompt_len`` random token ids at once; wall seconds.

    Each prompt generates exactly ``output_len`` tokens (``ignore_eos``): 1 times the prefill
    alone, more records that many decode steps of a batch of ``num_prompts``.
    """
    rng = np.random.default_rng(seed)
    prompts = rng.integers(100, 20000, size=(num_prompts, prompt_len)).tolist()

    def one(ids: list[int]) -> None:
        params = {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True}
        body = {"input_ids": ids, "sampling_params": params}
        requests.post(f"{base_url}/generate", json=body, timeout=600).raise_for_status()

    t0 = time.perf_counter()
    with ThreadPoolExecutor(num_prompts) as pool:
        list(pool.map(one, prompts))
    return time.perf_counter() - t0


def send_turns(
    base_url: str,
    num_prompts: int,
    prompt_len: int,
    seed: int,
    output_len: int,
    turn_tokens: int,
    stagger_ms: float,
) -> float:
    """Send later turns on cached histories, staggered; wall seconds of the turns alone.

    The histories are :func:`send_round`'s prompts of the same ``seed``, sent before (with 1
    output token, so that they are in the radix tree: :func:`run_round`). Sends each history
    plus ``turn_tokens`` new random ids, one request every ``stagger_ms`` milliseconds,
    ``output_len`` tokens each (``ignore_eos``), and returns the wall time from the first turn
    sent to the last answered.
    """
    rng = np.random.default_rng(seed)
    histories = rng.integers(100, 20000, size=(num_prompts, prompt_len)).tolist()
    extra = np.random.default_rng(seed + 1000).integers(100, 20000, (num_prompts, turn_tokens))

    def one(i: int) -> None:
        time.sleep(i * stagger_ms / 1e3)
        params = {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True}
        body = {"input_ids": histories[i] + extra[i].tolist(), "sampling_params": params}
        requests.post(f"{base_url}/generate", json=body, timeout=600).raise_for_status()

    t0 = time.perf_counter()
    with ThreadPoolExecutor(num_prompts) as pool:
        list(pool.map(one, range(num_prompts)))
    return time.perf_counter() - t0


def run_round(
    base_url: str, args: argparse.Namespace, seed: int, before_timed: Callable[[], None] | None
) -> dict:
    """One round of the CLI: prompts at once, or (``--turn-tokens``) histories then later turns.

    ``before_timed`` (e.g. start the profiler) runs right before the timed part: with
    ``--turn-tokens`` after the histories are cached, so a trace covers the later turns alone.

    Returns:
        ``{"wall_s": timed part (s)}``, plus ``"history_wall_s"`` (the histories' prefill, s)
        with ``--turn-tokens``.
    """
    times = {}
    if args.turn_tokens:
        times["history_wall_s"] = send_round(base_url, args.num_prompts, args.prompt_len, seed, 1)
    if before_timed is not None:
        before_timed()
    if args.turn_tokens:
        times["wall_s"] = send_turns(
            base_url,
            args.num_prompts,
            args.prompt_len,
            seed,
            args.output_len,
            args.turn_tokens,
            args.stagger_ms,
        )
    else:
        times["wall_s"] = send_round(
            base_url, args.num_prompts, args.prompt_len, seed, args.output_len
        )
    return times


def union(intervals: np.ndarray) -> np.ndarray:
    """Merge ``[n, 2]`` (start, end) intervals (any order) into disjoint sorted ones.

    Vectorised: after sorting by start, an interval opens a new merged one where its start lies
    past every earlier interval's end (running maximum); touching intervals merge.
    """
    if len(intervals) == 0:
        return np.asarray(intervals, float).reshape(0, 2)
    iv = np.asarray(intervals, float)
    iv = iv[np.argsort(iv[:, 0], kind="stable")]
    reach = np.maximum.accumulate(iv[:, 1])  # the furthest end so far
    first = np.ones(len(iv), bool)
    first[1:] = iv[1:, 0] > reach[:-1]
    last = np.append(first[1:], True)  # a merged interval ends where the next one starts
    return np.stack([iv[first, 0], reach[last]], axis=1)


def idle_before(t: np.ndarray, idle: np.ndarray) -> np.ndarray:
    """Idle time (same unit) covered by ``idle`` before each time in ``t``.

    Args:
        t: float ``[m]`` times (microseconds in a trace).
        idle: disjoint sorted intervals ``[n, 2]``.

    Returns:
        float ``[m]``: the length of ``idle`` inside ``(-inf, t]``: the lengths of the intervals
        that start at or before ``t``, less the part of the last of them past ``t``.
    """
    t = np.asarray(t, float)
    if len(idle) == 0:
        return np.zeros_like(t)
    start, end = idle[:, 0], idle[:, 1]
    total = np.concatenate([[0.0], np.cumsum(end - start)])
    k = np.searchsorted(start, t, side="right")  # intervals starting at or before t
    past = np.where(k > 0, np.clip(end[np.maximum(k - 1, 0)] - t, 0.0, None), 0.0)
    return total[k] - past


def overlaps(a0: np.ndarray, a1: np.ndarray, idle: np.ndarray) -> np.ndarray:
    """Length of each ``[a0[i], a1[i]]`` covered by the disjoint sorted intervals ``idle``.

    One pass for every event of a trace (:func:`idle_before` at both ends), so a trace of
    millions of host frames is read in seconds.
    """
    return np.clip(idle_before(a1, idle) - idle_before(a0, idle), 0.0, None)


def overlap(a0: float, a1: float, idle: np.ndarray) -> float:
    """Length of ``[a0, a1]`` covered by the disjoint sorted intervals ``idle`` [n, 2]."""
    return float(overlaps(np.array([a0]), np.array([a1]), idle)[0])


def self_idle(events: list[dict], idle: np.ndarray) -> Counter:
    """Exclusive GPU-idle time (ms) per ``"cat: name"`` of the host frames in ``events``.

    Python frames and CPU ops nest per thread (``tid``): a frame's exclusive idle time is its
    overlap with ``idle`` minus that of the frames directly inside it. A frame that starts
    inside another and ends after it (clock jitter) counts as inside it.

    Args:
        events: complete (``"ph": "X"``) trace events, ``ts``/``dur`` in microseconds.
        idle: disjoint sorted GPU-idle intervals ``[n, 2]`` (microseconds).
    """
    frames = [e for e in events if e.get("cat") in ("python_function", "cpu_op")]
    if not frames:
        return Counter()
    start = np.array([e["ts"] for e in frames], float)
    dur = np.array([e["dur"] for e in frames], float)
    end = start + dur
    _, thread = np.unique(
        np.array([f"{e.get('pid')}/{e.get('tid')}" for e in frames]), return_inverse=True
    )
    # per thread, by start, the longer (outer) frame first: -dur, not start - end, which ties
    # frames a fraction of a microsecond apart at trace timestamps near 1e15 us
    order = np.lexsort((-dur, start, thread))
    ov = overlaps(start, end, idle).tolist()  # Python floats: the sums round as before
    out: Counter = Counter()
    stack: list[list] = []  # [thread, end, name, exclusive idle (us)]
    for i in order.tolist():
        e = frames[i]
        th, s, t_end = thread[i], start[i], end[i]
        while stack and (stack[-1][0] != th or stack[-1][1] <= s):
            _, _, name, own = stack.pop()
            out[name] += own / 1e3
        if stack:
            stack[-1][3] -= ov[i]  # the parent's idle time under this frame is this frame's
        stack.append([th, t_end, f"{e.get('cat')}: {e['name']}", ov[i]])
    for _, _, name, own in stack:
        out[name] += own / 1e3
    return Counter({k: v for k, v in out.items() if v > 1e-9})


def analyse(trace: dict, top: int = 40) -> dict:
    """GPU busy/idle times (ms) and the host functions overlapping idle time in one trace.

    Args:
        trace: a Chrome trace (``traceEvents``; ``ts``/``dur`` in microseconds), as SGLang's
            torch profiler writes it.
        top: how many host functions to list (largest overlap first).

    Returns:
        ``span_ms`` (first to last GPU event), ``gpu_busy_ms``, ``gpu_idle_ms``,
        ``idle_gaps_over_1ms``, ``largest_gaps_ms``, ``host_during_idle_ms`` (per
        ``"cat: name"``, inclusive: a frame counts the idle time of the frames it calls),
        ``host_self_during_idle_ms`` (the same, exclusive: only the idle time no frame it calls
        covers, so the functions that hold the GPU up come first; :func:`self_idle`) and
        ``gpu_time_by_kernel_ms`` (summed duration per GPU event name, largest first, with
        ``gpu_launches_by_kernel`` the count of each).

    Raises:
        SystemExit: the trace holds no GPU (kernel / memcpy / memset) event.
    """
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    gpu = np.array(
        [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in GPU_CATEGORIES], float
    )
    if len(gpu) == 0:
        raise SystemExit("prefill_trace: the trace holds no GPU events (CUPTI off?)")
    busy = union(gpu)
    span = (busy[0, 0], busy[-1, 1])
    idle = np.stack([busy[:-1, 1], busy[1:, 0]], axis=1)
    idle = idle[idle[:, 1] > idle[:, 0]]
    host = [e for e in events if e.get("cat") in ("python_function", "cpu_op", "user_annotation")]
    start = np.array([e["ts"] for e in host], float)
    ov = overlaps(start, start + np.array([e["dur"] for e in host], float), idle)
    by_func: Counter = Counter()
    for i in np.flatnonzero(ov > 0).tolist():
        by_func[f"{host[i].get('cat')}: {host[i]['name']}"] += float(ov[i]) / 1e3
    by_self = self_idle(events, idle)
    gaps = np.sort(idle[:, 1] - idle[:, 0])[::-1] / 1e3
    kernel_ms: Counter = Counter()
    kernel_count: Counter = Counter()
    for e in events:
        if e.get("cat") in GPU_CATEGORIES:
            kernel_ms[e["name"][:120]] += e["dur"] / 1e3
            kernel_count[e["name"][:120]] += 1
    return {
        "span_ms": float(span[1] - span[0]) / 1e3,
        "gpu_busy_ms": float((busy[:, 1] - busy[:, 0]).sum() / 1e3),
        "gpu_idle_ms": float(gaps.sum()),
        "idle_gaps_over_1ms": int((gaps > 1.0).sum()),
        "largest_gaps_ms": [round(float(g), 3) for g in gaps[:20]],
        "host_during_idle_ms": {k: round(v, 3) for k, v in by_func.most_common(top)},
        "host_self_during_idle_ms": {k: round(v, 3) for k, v in by_self.most_common(top)},
        "gpu_time_by_kernel_ms": {k: round(v, 3) for k, v in kernel_ms.most_common(top)},
        "gpu_launches_by_kernel": {k: kernel_count[k] for k, _ in kernel_ms.most_common(top)},
    }


def newest_trace(folder: Path, since: float, wait_s: float = 300.0) -> Path:
    """The trace file SGLang writes after ``/stop_profile`` (waits until its size settles)."""
    deadline = time.time() + wait_s
    last = -1
    while time.time() < deadline:
        files = [p for p in folder.rglob("*.json*") if p.stat().st_mtime >= since]
        if files:
            path = max(files, key=lambda p: p.stat().st_mtime)
            size = path.stat().st_size
            if size == last and size > 0:
                return path
            last = size
        time.sleep(2.0)
    raise SystemExit(f"prefill_trace: no trace appeared under {folder} in {wait_s:.0f} s")


def load_trace(path: Path) -> dict:
    """Read a Chrome trace (``.json`` or ``.json.gz``)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> int:
    """CLI entry (see the module docstring); bad flags exit 2 naming the flag."""
    p = argparse.ArgumentParser(
        prog="python -m tangram_sglang.bench.prefill_trace",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model-path", required=True)
    p.add_argument("--label", required=True, help="name of this system in the output")
    p.add_argument("--server-args", default="", help="launch_server flags (one string)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=8192, help="tokens per prompt")
    p.add_argument(
        "--output-len",
        type=int,
        default=1,
        help="tokens generated per prompt (> 1: the trace covers decode steps too)",
    )
    p.add_argument(
        "--turn-tokens",
        type=int,
        default=0,
        help="> 0: trace later turns (each cached prompt plus this many new tokens, staggered)",
    )
    p.add_argument(
        "--stagger-ms",
        type=float,
        default=50.0,
        help="later turns: milliseconds between two turns' arrivals",
    )
    p.add_argument("--trace-dir", default="/tmp/prefill-trace", help="where SGLang writes")
    p.add_argument("--json", default=None, help="write the analysis here")
    p.add_argument("--no-trace", action="store_true", help="wall times only (no profiler round)")
    p.add_argument("--top", type=int, default=40, help="host functions / kernels listed")
    args = p.parse_args(argv)
    flags = check_args(p, args)

    from tangram_sglang.serving import SGLangServer

    trace_dir = Path(args.trace_dir) / args.label
    trace_dir.mkdir(parents=True, exist_ok=True)

    turns = {"turn_tokens": args.turn_tokens, "stagger_ms": args.stagger_ms}
    with SGLangServer(args.model_path, flags, "cuda", trace_dir / "server.log", 600) as server:
        warm = run_round(server.base_url, args, 1, None)
        plain = run_round(server.base_url, args, 2, None)
        result = {
            "label": args.label,
            "server_args": flags,
            "num_prompts": args.num_prompts,
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            **(turns if args.turn_tokens else {}),
            "warmup_wall_s": warm["wall_s"],
            "wall_s": plain["wall_s"],
            **({"history_wall_s": plain["history_wall_s"]} if args.turn_tokens else {}),
        }
        if args.no_trace:
            return finish(args, result)
        since = time.time()
        body = {"output_dir": str(trace_dir), "activities": ["CPU", "GPU"], "with_stack": True}

        def start_profile() -> None:
            url = f"{server.base_url}/start_profile"
            requests.post(url, json=body, timeout=60).raise_for_status()

        traced = run_round(server.base_url, args, 3, start_profile)
        requests.post(f"{server.base_url}/stop_profile", timeout=600).raise_for_status()
        path = newest_trace(trace_dir, since)
    result.update(
        traced_wall_s=traced["wall_s"],
        trace_covers=(
            "later turns only (histories cached before the profiler started)"
            if args.turn_tokens
            else "the whole round"
        ),
        trace=str(path),
        **analyse(load_trace(path), args.top),
    )
    return finish(args, result)


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The ``--server-args`` flags; a bad flag exits 2 naming it (``p.error``), before a server."""
    if args.num_prompts < 1 or args.prompt_len < 1 or args.output_len < 1:
        p.error("--num-prompts, --prompt-len and --output-len must be >= 1")
    if args.turn_tokens < 0 or not 0 <= args.stagger_ms < float("inf"):
        p.error("--turn-tokens and --stagger-ms must be >= 0 (and finite)")
    if args.top < 1:
        p.error(f"--top {args.top}: list at least 1 host function / kernel")
    if not Path(args.model_path).is_dir():
        p.error(f"--model-path {args.model_path!r}: no such folder (give a local model folder)")
    config = Path(args.model_path) / "config.json"
    limit = json.loads(config.read_text()).get("max_position_embeddings") if config.is_file() else 0
    need = args.prompt_len + args.turn_tokens + args.output_len
    if limit and need > limit:
        p.error(
            f"--prompt-len {args.prompt_len} + --turn-tokens {args.turn_tokens} + --output-len "
            f"{args.output_len} = {need} tokens, over the model's {limit}; use shorter prompts"
        )
    if args.json and not Path(args.json).parent.is_dir():
        p.error(f"--json {args.json!r}: no folder {str(Path(args.json).parent)!r}; create it")
    existing = next(d for d in (Path(args.trace_dir), *Path(args.trace_dir).parents) if d.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        p.error(f"--trace-dir {args.trace_dir!r}: {str(existing)!r} is not a writable folder")
    try:
        flags = shlex.split(args.server_args)
    except ValueError as exc:
        p.error(f"--server-args {args.server_args!r}: {exc}")
    import torch

    if not torch.cuda.is_available():
        p.error("no CUDA GPU: the trace's GPU side is CUPTI's; run it on a GPU machine")
    return flags


def finish(args: argparse.Namespace, result: dict) -> int:
    """Print ``result`` as JSON and write it to ``--json``."""
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
