"""A traced repeat of a ``bench.multiturn`` workload: where a real workload's time goes.

``bench.multiturn --trace-steps N`` runs each workload a second time after its measured run
(the cache flushed again, the same conversations and token ids, no warm-up), with SGLang's own
torch profiler on for the first ``N`` forward steps of the scheduler (``POST /start_profile``
with ``num_steps``: SGLang stops it by itself after ``N`` steps; CPU + GPU activities, Python
stacks). The Chrome trace it writes is read by :func:`tangram_sglang.bench.prefill_trace.analyse`
(GPU busy and idle time, the host functions the GPU waited for, GPU time per kernel), and the
analysis is stored under the workload's ``trace`` key. The measured figures come from the
untraced run only: the profiler slows the host, so the traced run's wall time is reported as
``traced_wall_s`` and is not a throughput figure.

Two systems' traces of the same workload, side by side, say which kernels and which host work
make the difference (issue 18: ShareGPT's busy first rounds).
"""

from __future__ import annotations

import time
from pathlib import Path

from tangram_sglang.errors import TangramError

PROFILE_TIMEOUT_S = 60.0  # /start_profile answers once the scheduler has taken the request
STOP_TIMEOUT_S = 600.0  # /stop_profile answers after the trace file is written


async def start_profile(base_url: str, output_dir: Path, num_steps: int) -> float:
    """Start SGLang's profiler for the next ``num_steps`` forward steps.

    Args:
        base_url: the server's ``http://host:port``.
        output_dir: where SGLang writes the trace (created if missing).
        num_steps: forward steps to record (>= 1); SGLang stops the profiler after them.

    Returns:
        The wall-clock time (``time.time()``, s) just before the request: trace files written
        after it belong to this run (:func:`collect_trace`).

    Raises:
        TangramError: the server refused (HTTP status and body in the message).
    """
    import aiohttp

    output_dir.mkdir(parents=True, exist_ok=True)
    since = time.time()
    body = {
        "output_dir": str(output_dir),
        "num_steps": int(num_steps),
        "activities": ["CPU", "GPU"],
        "with_stack": True,
        "record_shapes": False,  # shapes multiply a long trace's size; the analysis reads none
    }
    timeout = aiohttp.ClientTimeout(total=PROFILE_TIMEOUT_S)
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.post(f"{base_url}/start_profile", json=body) as resp,
        ):
            text = await resp.text()
            status = resp.status
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise TangramError(
            f"/start_profile failed ({type(exc).__name__}: {exc}); see the server log"
        ) from exc
    if status != 200:
        raise TangramError(
            f"/start_profile answered HTTP {status} ({text[:300]!r}); run without "
            "--trace-steps, or see the server log"
        )
    return since


async def stop_profile(base_url: str) -> None:
    """Stop the profiler if it is still on (fewer forward steps than asked for ran).

    SGLang answers an error when the profiler already stopped after its ``num_steps``; that is
    the normal case and is ignored, as is a server that does not answer within
    ``STOP_TIMEOUT_S`` (:func:`collect_trace` then finds no trace and says so). Raises nothing.
    """
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=STOP_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        try:
            async with session.post(f"{base_url}/stop_profile") as resp:
                await resp.read()
        except (aiohttp.ClientError, TimeoutError):
            pass


def collect_trace(output_dir: Path, since: float, top: int, wait_s: float = 300.0) -> dict:
    """Read the trace SGLang wrote under ``output_dir`` after ``since`` and analyse it.

    Args:
        output_dir: the folder given to :func:`start_profile`.
        since: its return value.
        top: host functions and kernels listed (``prefill_trace.analyse``).
        wait_s: how long to wait for the file to appear and settle (s).

    Returns:
        ``trace`` (the file's path) and the keys of
        :func:`tangram_sglang.bench.prefill_trace.analyse`; on a trace without GPU events (a
        CPU server) ``trace`` and ``error`` only. Under tensor parallelism each rank writes a
        file; rank 0's (``*-TP-0*``) is read.

    Raises:
        TangramError: no trace file appeared in ``wait_s``, or it cannot be read.
    """
    from tangram_sglang.bench.prefill_trace import analyse, load_trace, newest_trace

    try:
        path = newest_trace(output_dir, since, wait_s)
    except SystemExit as exc:  # prefill_trace's CLI wording: no trace in wait_s
        raise TangramError(str(exc)) from None
    rank0 = sorted(p for p in path.parent.glob("*-TP-0*") if p.stat().st_mtime >= since)
    path = rank0[-1] if rank0 else path
    try:
        trace = load_trace(path)
    except (OSError, EOFError, ValueError) as exc:  # truncated gzip, partial JSON
        raise TangramError(f"{path}: not a readable trace ({exc})") from exc
    try:
        return {"trace": str(path), **analyse(trace, top)}
    except SystemExit as exc:  # no GPU events: a CPU server's trace
        return {"trace": str(path), "error": str(exc)}
