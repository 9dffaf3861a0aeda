"""Host time of one decode step (``allocate_decode`` + the decode plan), no model.

Measures the host work of every decode step: the scheduler allocates one decode token per head
group of each row (``TangramState.allocate_decode``, from SGLang's ``alloc_for_decode``; under
overlap scheduling this runs while the previous batch is on the GPU) and the attention backend
writes the plan into the static decode buffers (``DecodeGraphBuffers.fill``, the CUDA-graph
path; under the default ``batch`` plan with the per-layer chunk floors,
``metadata.decode_chunk_floors``). Both are timed, apart and together. It also counts the
device-to-host reads (``Tensor.tolist`` / ``item`` / ``__int__``) the step makes (none is the
goal: they would wait for the GPU and stop overlap scheduling; ``numpy`` counts the host
allocator's own tensors) and the host-to-device uploads (one packed copy per step).

Setup: the given profile, ``--batch`` rows prefilled with ``--prompt`` tokens each (one segment),
then ``--steps`` decode steps timed with ``time.perf_counter`` (median and p90, ms per step).

Run::

    python -m tangram_sglang.bench.decode_step \
        --profile calibration/synthetic/llama3.1-8b-ada-snapkv-r0.25.json --batch 64
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from tangram_sglang.backend.metadata import (
    DecodeGraphBuffers,
    decode_chunk_floors,
    heads_per_group_of_layer,
)
from tangram_sglang.backend.state import TangramState
from tangram_sglang.config import decode_ctas_per_sm
from tangram_sglang.errors import TangramError
from tangram_sglang.mem.manager import TangramMemory
from tangram_sglang.profile import BudgetProfile


@contextmanager
def count_host_reads() -> Iterator[dict[str, int]]:
    """Count ``Tensor.tolist`` / ``item`` / ``__int__`` / ``numpy`` calls inside the block.

    Each of them is a device-to-host read (a GPU sync) when the tensor lives on a GPU. Yields a
    dict ``{method name: calls}`` filled when the block exits.
    """
    names = ("tolist", "item", "__int__", "numpy")
    counts = dict.fromkeys(names, 0)
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def counting(name):
        original = saved[name]

        def wrapper(self, *args, **kwargs):
            counts[name] += 1
            return original(self, *args, **kwargs)

        return wrapper

    for n in names:
        setattr(torch.Tensor, n, counting(n))
    try:
        yield counts
    finally:
        for n, fn in saved.items():
            setattr(torch.Tensor, n, fn)


def build(profile: BudgetProfile, batch: int, prompt: int, page_size: int, steps: int):
    """A state with ``batch`` rows (1..batch) prefilled with ``prompt`` tokens (no K/V storage)."""
    kept = int(np.max(profile.group_kept_lens(prompt))) + steps + 1
    width = math.ceil((prompt + steps + 1) / page_size)
    groups = profile.grouping.num_head_groups
    num_pages = 1 + batch * groups * (math.ceil(kept / page_size) + 2)
    memory = TangramMemory(
        profile, page_size, num_pages, batch + 1, width, kv_pool=None, device="cpu", debug=False
    )
    state = TangramState(memory, full_kv_bytes_per_token=1, device="cpu")
    rows = list(range(1, batch + 1))
    for row in rows:
        state.plan_row(row, prompt, steps + 1)
        state.allocate_extend([row], [prompt], [0])
    m = profile.model
    buffers = DecodeGraphBuffers.create(
        batch + 1, groups, m.num_qo_heads, m.head_dim, torch.float32, "cpu", m.num_layers
    )
    return state, buffers, rows


def run(
    profile_path: str,
    batch: int,
    prompt: int,
    steps: int,
    page_size: int,
    plan: str = "batch",
    num_sms: int = 132,
) -> dict:
    """Time ``steps`` decode steps; returns ms per step (median, p90) and host reads per step.

    ``plan="batch"`` (the serving default) adds the per-layer chunk floors the backend computes
    every step (``metadata.decode_chunk_floors`` for ``num_sms`` SMs, at
    ``TANGRAM_DECODE_CTAS_PER_SM`` CTAs per SM) to the plan's host work.

    Raises:
        ConfigError: ``TANGRAM_DECODE_CTAS_PER_SM`` is set to something a server would refuse
            (checked for every plan, as a server checks it at start-up).
        TangramError: the profile cannot be read.
    """
    launch = decode_ctas_per_sm() * num_sms  # read once, as a server reads it at start-up
    profile = BudgetProfile.load(profile_path)
    state, buffers, rows = build(profile, batch, prompt, page_size, steps)
    table = state.memory.table
    heads = heads_per_group_of_layer(profile.grouping.cluster_of, profile.grouping.num_head_groups)
    table.deferred = True  # as the attention backend: one packed flush per step
    table.flush()
    rows = np.asarray(rows, np.int64)
    seq = np.full(batch, prompt, np.int64)
    times, alloc_times = [], []
    uploads = table.uploader.num_uploads
    with count_host_reads() as reads:
        for _ in range(steps):
            seq += 1
            t0 = time.perf_counter()
            state.allocate_decode(rows, seq)  # scheduler (alloc_for_decode)
            t1 = time.perf_counter()
            floor = None
            if plan == "batch":
                floor = decode_chunk_floors(table.lens, rows, heads, launch)
            buffers.fill(rows, batch, table.pages, table.lens, page_size, table.flush, floor)
            times.append((time.perf_counter() - t0) * 1e3)
            alloc_times.append((t1 - t0) * 1e3)
    skip = min(5, steps - 1)
    ms = np.asarray(times[skip:])
    alloc_ms = np.asarray(alloc_times[skip:])
    return {
        "batch": batch,
        "prompt_tokens": prompt,
        "head_groups": profile.grouping.num_head_groups,
        "steps": steps,
        "plan": plan,
        "ms_per_step_median": round(float(np.median(ms)), 4),
        "ms_per_step_p90": round(float(np.percentile(ms, 90)), 4),
        "ms_allocate_median": round(float(np.median(alloc_ms)), 4),
        "ms_plan_median": round(float(np.median(ms - alloc_ms)), 4),
        "host_reads_per_step": {k: v / steps for k, v in reads.items()},
        "uploads_per_step": (table.uploader.num_uploads - uploads) / steps,
    }


def at_least(low: int):
    """An argparse ``type``: a whole number >= ``low`` (a clear usage error otherwise)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{text!r}: want a whole number >= {low}") from exc
        if value < low:
            raise argparse.ArgumentTypeError(f"{text!r}: want a whole number >= {low}")
        return value

    return parse


def _power_of_two(text: str) -> int:
    """An argparse ``type``: a page size, a power of two >= 1 (as the server requires)."""
    value = at_least(1)(text)
    if value & (value - 1):
        raise argparse.ArgumentTypeError(f"{text!r}: want a power of two (tokens per page)")
    return value


def main(argv: list[str] | None = None) -> None:
    """CLI: print the JSON result of :func:`run`."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", required=True, help="budget profile JSON")
    ap.add_argument("--batch", type=at_least(1), default=64, help="rows decoding together")
    ap.add_argument("--prompt", type=at_least(1), default=1000, help="prefilled tokens per row")
    ap.add_argument("--steps", type=at_least(2), default=200, help="decode steps timed")
    ap.add_argument("--page-size", type=_power_of_two, default=16, help="tokens per page")
    ap.add_argument(
        "--plan",
        choices=["batch", "lengths", "table"],
        default="batch",
        help="decode split plan (TANGRAM_DECODE_PLAN); batch adds the per-layer chunk floors "
        "(TANGRAM_DECODE_CTAS_PER_SM CTAs per SM, default 12)",
    )
    args = ap.parse_args(argv)
    try:
        result = run(args.profile, args.batch, args.prompt, args.steps, args.page_size, args.plan)
    except TangramError as exc:
        ap.error(str(exc))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
