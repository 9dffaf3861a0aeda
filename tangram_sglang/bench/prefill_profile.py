"""Where Tangram's prefill time goes: per-stage timing of the extend path on one GPU.

    python -m tangram_sglang.bench.prefill_profile --profile PROFILE.json --target-ratio 0.25 \
        --cases 1x8192,64x384+16384 --json /tmp/prefill-profile.json --trace-table /tmp/t.txt

Runs the server's own per-layer extend code (:func:`tangram_sglang.backend.layer_ops.
extend_layer` over a real :class:`~tangram_sglang.backend.state.TangramState` and KV pool) on
random bf16 q/k/v of the profile's model shape, for every layer of the model, and times with CUDA
events (median over layers after a warm-up pass):

* ``extend_ms``: the extend attention (history + causal new tokens, with LSE), as the server's
  ``TANGRAM_PREFILL_ATTENTION`` and ``TANGRAM_HISTORY_ATTENTION`` run it (``paged_history``:
  the history part went through FlashInfer's paged prefill);
* ``select_ms``: scorer + per-head top-``k_g`` (``backend.compress.batch_kept_indices``),
  GPU time between events (includes launch gaps when the host is the bottleneck);
* ``select_host_ms``: host wall time of the same call (no sync inside): > ``select_ms`` means
  the host issues launches slower than the GPU runs them;
* ``select_ref_ms`` / ``select_ref_host_ms``: the same for ``backend.compress.
  reference_kept_indices`` (the per-request path the backend ran before),
  ``select_equals_reference``: both gave the same indices on every layer, and
  ``select_rows_differing``: the share of (layer, request, KV head) rows whose kept indices
  differ (near-ties flipped by another summation order differ in a few rows; a wrong
  selection in many);
* ``kv_write_ms``: the kept-KV write kernel;
* ``layer_ms``: the whole ``extend_layer`` (host clock, synchronised, per layer);
* ``stock_extend_ms``: SGLang's own Triton ``extend_attention_fwd`` on the same q/k/v with the
  same history length in full KV (what ``--attention-backend triton`` runs per layer), when
  sglang is importable; Tangram's per-layer overhead is ``layer_ms - stock_extend_ms``.

A case ``BxN`` is B requests of N new tokens each; ``BxN+H`` gives each request a compressed
history of H prior tokens (written by an untimed first extend). ``--trace-table`` writes
``torch.profiler``'s table (CUDA and CPU time per op) of one pass over all layers of the first
case.

Source: Tangram arXiv 2606.06302 (prefill overhead of dynamic reclaim). Timing: CUDA events
around each call after a warm-up, medians over the calls.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tangram_sglang.errors import ConfigError, TangramError


@dataclass(frozen=True, slots=True)
class Case:
    """B requests of N new tokens, each after H history tokens (0 = a fresh prefill).

    With ``min_tokens`` < N the requests have mixed lengths (ShareGPT-like prefill batches):
    drawn uniformly from ``[min_tokens, N]`` by a generator seeded from the case, so every run
    and every scorer gets the same lengths.
    """

    batch: int
    new_tokens: int
    history: int = 0
    min_tokens: int | None = None

    @property
    def label(self) -> str:
        tail = f"+{self.history}" if self.history else ""
        low = self.min_tokens
        size = f"{low}-{self.new_tokens}" if low is not None else f"{self.new_tokens}"
        return f"{self.batch}x{size}{tail}"

    @property
    def lengths(self) -> list[int]:
        """New tokens of each request (tokens; the largest is ``new_tokens`` when mixed)."""
        if self.min_tokens is None:
            return [self.new_tokens] * self.batch
        rng = np.random.default_rng([self.batch, self.min_tokens, self.new_tokens])
        drawn = rng.integers(self.min_tokens, self.new_tokens + 1, self.batch)
        drawn[0] = self.new_tokens  # the widest request is always there
        return [int(n) for n in drawn]


def parse_cases(text: str) -> list[Case]:
    """``"1x8192,64x384+16384,16x300-1500"`` -> cases (``BxLO-HI``: mixed lengths).

    Raises:
        ConfigError: a malformed or non-positive entry.
    """
    cases = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            size, _, hist = part.partition("+")
            b, n = size.split("x")
            low, dash, high = n.partition("-")
            case = Case(int(b), int(high if dash else low), int(hist or 0))
            if dash:
                case = Case(case.batch, case.new_tokens, case.history, int(low))
        except ValueError:
            raise ConfigError(
                f"--cases entry {part!r}: use BxN, BxN+H or BxLO-HI (mixed lengths), e.g. "
                "1x8192 or 16x300-1500"
            ) from None
        if case.batch < 1 or case.new_tokens < 1 or case.history < 0:
            raise ConfigError(f"--cases entry {part!r}: B, N >= 1 and H >= 0")
        if case.min_tokens is not None and not 1 <= case.min_tokens <= case.new_tokens:
            raise ConfigError(f"--cases entry {part!r}: mixed lengths need 1 <= LO <= HI")
        cases.append(case)
    if not cases:
        raise ConfigError("--cases is empty; e.g. 1x8192,64x384+16384")
    return cases


def _build_state(profile, case: Case, device: torch.device, page_size: int):
    """A TangramState over a fresh pool sized for ``case`` (rows 1..B; row 0 is padding)."""
    from tangram_sglang.backend.state import TangramState, chunked_footprint_pages
    from tangram_sglang.mem.kv_pool import bytes_per_page
    from tangram_sglang.mem.manager import TangramMemory
    from tangram_sglang.scoring import RopeShift, bind_rope, needs_rope

    context = case.history + case.new_tokens
    per_row = chunked_footprint_pages(profile, page_size, case.new_tokens, 1, 0)
    if case.history:
        per_row += chunked_footprint_pages(profile, page_size, case.history, 1, 0)
    need_pages = case.batch * (per_row + profile.grouping.num_head_groups) + 1024
    budget = need_pages * bytes_per_page(
        profile.grouping.heads_per_group, page_size, profile.model.head_dim, torch.bfloat16
    )
    memory = TangramMemory.create(
        profile,
        budget,
        page_size,
        max_rows=case.batch + 1,
        max_context_tokens=context + 64,
        dtype=torch.bfloat16,
        device=device,
    )
    full = 2 * profile.model.num_layers * profile.model.num_kv_heads * profile.model.head_dim * 2
    state = TangramState(memory, full, device, 0)
    if needs_rope(state.scorer):  # kvzip-replay: timing does not depend on the frequencies
        rope = RopeShift.standard(profile.model.head_dim, theta=500000.0)  # Llama-3's base
        state.scorer = bind_rope(state.scorer, rope)
    return state


def _qkv(profile, tokens: int, device: torch.device, seed: int):
    m = profile.model
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(tokens, m.num_qo_heads, m.head_dim, device=device, generator=gen)
    k = torch.randn(tokens, m.num_kv_heads, m.head_dim, device=device, generator=gen)
    v = torch.randn(tokens, m.num_kv_heads, m.head_dim, device=device, generator=gen)
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


def _events(fn, repeats: int) -> list[float]:
    """GPU ms of ``fn(i)`` for i in range(repeats), one event pair each."""
    times = []
    for i in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(i)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return times


def _host_ms(fn, repeats: int) -> list[float]:
    """Host wall ms per ``fn(i)`` (no sync inside; one sync before and after the series)."""
    torch.cuda.synchronize()
    out = []
    for i in range(repeats):
        t = time.perf_counter()
        fn(i)
        out.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    return out


def _stock_extend(profile, case: Case, q, k, v, sm_scale: float):
    """SGLang's Triton extend over full KV (history in a token pool), or None without sglang."""
    try:
        from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd
    except ImportError:
        return None
    m, dev = profile.model, q.device
    hist, n, bs = case.history, case.new_tokens, case.batch
    lengths = torch.tensor([0, *case.lengths], device=dev, dtype=torch.int32)
    pool_tokens = bs * (hist + n) + 1
    kb = torch.randn(pool_tokens, m.num_kv_heads, m.head_dim, device=dev).bfloat16()
    vb = torch.randn_like(kb)
    qo = torch.cumsum(lengths, 0, dtype=torch.int32)
    kv_indptr = torch.arange(0, bs + 1, device=dev, dtype=torch.int32) * hist
    kv_idx = torch.randperm(pool_tokens - 1, device=dev)[: bs * hist].to(torch.int64) + 1
    o = torch.empty_like(q)

    def run(_i: int) -> None:
        extend_attention_fwd(
            q, k, v, o, kb, vb, qo, kv_indptr, kv_idx, None, True, None, n, 1.0, 1.0, sm_scale
        )

    return run


def profile_case(
    profile, case: Case, device: torch.device, page_size: int, trace_table: str | None
) -> dict[str, Any]:
    """Time every stage of ``case`` over all layers (see the module docstring)."""
    from tangram_sglang.backend import metadata as md
    from tangram_sglang.backend.compress import batch_kept_indices, reference_kept_indices
    from tangram_sglang.backend.layer_ops import batch_history_plan, extend_layer, kernels_for

    state = _build_state(profile, case, device, page_size)
    layers = profile.model.num_layers
    kernels = kernels_for(device, state, case.batch + 1)
    rows = list(range(1, case.batch + 1))
    sm_scale = profile.model.head_dim**-0.5
    if case.history:  # untimed first extend: the history every timed query attends to
        plan = state.allocate_extend(rows, [case.history] * case.batch, [0] * case.batch)
        meta = md.extend_metadata(
            rows,
            [case.history] * case.batch,
            plan.kept_lens,
            device,
            start_lens=plan.start_lens,
            hist_len=torch.zeros_like(state.memory.table.group_len),
        )
        qh, kh, vh = _qkv(profile, case.batch * case.history, device, 1)
        for lid in range(layers):
            extend_layer(kernels, state, meta, qh, kh, vh, lid, sm_scale)
        del qh, kh, vh
    lens, prefix = case.lengths, [case.history] * case.batch
    plan = state.allocate_extend(rows, lens, prefix)
    history = batch_history_plan(kernels, state, rows, lens, plan.start_lens)
    meta = md.extend_metadata(
        rows,
        lens,
        plan.kept_lens,
        device,
        profile.grouping.cluster_of,
        start_lens=plan.start_lens,
        hist_len=torch.zeros_like(state.memory.table.group_len),
        history=history,
        page_table=state.memory.table.page_table,
    )
    q, k, v = _qkv(profile, sum(lens), device, 2)
    mem, table = state.memory, state.memory.table
    pools = (mem.kv_pool.k_pool, mem.kv_pool.v_pool)

    def ext(i: int):
        lid = i % layers
        return kernels.extend(
            q,
            k,
            v,
            meta.qo_indptr,
            *pools,
            table.page_table,
            meta.hist_len,
            meta.req_rows,
            state.group_of_head[lid],
            state.column_of_head[lid],
            sm_scale,
            meta.max_extend_len,
            meta=meta,
            layer=lid,
        )

    _, lse = ext(0)

    def select(i: int):
        lid = i % layers
        kept_host, kept_dev = meta.layer_kept(lid, profile.grouping.cluster_of[lid])
        return batch_kept_indices(
            state.scorer,
            q,
            k,
            lse,
            meta.bounds,
            kept_host,
            sm_scale,
            profile.sink_tokens,
            profile.recent_window,
            kept_dev,
            v_new=v,
            layer_id=lid,
        )

    # kv_write of layer l reads the kept indices of layer l (its heads map to other groups, so
    # another layer's indices can be narrower than its counts): one per layer, computed once.
    idx = [select(i) for i in range(layers)]

    def select_ref(i: int):
        lid = i % layers
        kept_host, _ = meta.layer_kept(lid, profile.grouping.cluster_of[lid])
        return reference_kept_indices(
            state.scorer,
            q,
            k,
            lse,
            meta.bounds,
            kept_host,
            sm_scale,
            profile.sink_tokens,
            profile.recent_window,
            v_new=v,
            layer_id=lid,
        )

    differ = [(select(i) != select_ref(i)).any(-1).float().mean().item() for i in range(layers)]
    res_same = not any(differ)

    def write(i: int) -> None:
        lid = i % layers
        kernels.kv_write(
            k,
            v,
            meta.qo_indptr,
            idx[lid],
            meta.kept_count,
            *pools,
            table.page_table,
            meta.hist_len,
            meta.req_rows,
            state.group_of_head[lid],
            state.column_of_head[lid],
        )

    def layer(i: int) -> None:
        extend_layer(kernels, state, meta, q, k, v, i % layers, sm_scale)

    res: dict[str, Any] = {
        "case": case.label,
        "tokens": sum(case.lengths),
        "select_equals_reference": res_same,
        "select_rows_differing": sum(differ) / layers,
    }
    stages = (
        ("extend_ms", ext),
        ("select_ms", select),
        ("select_ref_ms", select_ref),
        ("kv_write_ms", write),
    )
    for name, fn in stages:
        _events(fn, layers)  # warm-up (Triton JIT, allocator)
        res[name] = statistics.median(_events(fn, layers))
    # the batch's history part ran through FlashInfer's paged prefill (extend_ms includes it;
    # False where the batch had no plan or FlashInfer refused it)
    res["paged_history"] = kernels.history_planned
    res["select_host_ms"] = statistics.median(_host_ms(select, layers))
    res["select_ref_host_ms"] = statistics.median(_host_ms(select_ref, layers))
    for _ in range(2):  # warm: allocator growth of the whole layer's tensors stays out
        for i in range(layers):
            layer(i)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(layers):
        layer(i)
    torch.cuda.synchronize()
    res["layer_ms"] = (time.perf_counter() - t) * 1e3 / layers
    stock = _stock_extend(profile, case, q, k, v, sm_scale)
    if stock is not None:
        _events(stock, 3)
        res["stock_extend_ms"] = statistics.median(_events(stock, layers))
        res["overhead_per_layer_ms"] = res["layer_ms"] - res["stock_extend_ms"]
        res["overhead_all_layers_ms"] = res["overhead_per_layer_ms"] * layers
    if trace_table:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as tprof

        with tprof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for i in range(layers):
                layer(i)
            torch.cuda.synchronize()
        avg = prof.key_averages()
        with open(trace_table, "a") as fh:
            fh.write(f"== case {case.label}: {layers} layers of extend_layer\n")
            fh.write(avg.table(sort_by="cuda_time_total", row_limit=25) + "\n")
            fh.write(avg.table(sort_by="cpu_time_total", row_limit=25) + "\n")
    return res


def _load_profile(path: str, target_ratio: float):
    """``BudgetProfile.load(path).rescaled(target_ratio)``; ConfigError names the flag."""
    from tangram_sglang.profile import BudgetProfile

    try:
        profile = BudgetProfile.load(path)
    except TangramError as exc:
        raise ConfigError(f"--profile: {exc}") from None
    try:
        return profile.rescaled(target_ratio)
    except TangramError as exc:
        raise ConfigError(f"--target-ratio: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    """CLI (see the module docstring); prints one line per case and a table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--profile", required=True, help="budget profile JSON (the server's)")
    p.add_argument("--target-ratio", type=float, default=0.25, help="mean kept fraction")
    p.add_argument("--cases", default="1x8192,64x384+16384", help="BxN[+H],...")
    p.add_argument("--page-size", type=int, default=16, help="tokens per page (the server's)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--trace-table", default=None, help="torch.profiler tables (first case)")
    args = p.parse_args(argv)
    try:  # every flag checked before the GPU is touched
        cases = parse_cases(args.cases)
        if args.page_size < 1:
            raise ConfigError(f"--page-size must be >= 1 (tokens), got {args.page_size}")
        profile = _load_profile(args.profile, args.target_ratio)
    except TangramError as exc:
        print(f"prefill_profile: {exc}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("prefill_profile: needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    results = []
    for i, case in enumerate(cases):
        res = profile_case(
            profile, case, device, args.page_size, args.trace_table if i == 0 else None
        )
        print(json.dumps(res), flush=True)
        results.append(res)
        torch.cuda.empty_cache()
    cols = [
        "case",
        "extend_ms",
        "stock_extend_ms",
        "select_ms",
        "select_host_ms",
        "select_ref_ms",
        "select_ref_host_ms",
        "kv_write_ms",
        "layer_ms",
        "overhead_all_layers_ms",
        "select_equals_reference",
        "select_rows_differing",
    ]
    print(" | ".join(cols))
    for r in results:
        print(
            " | ".join(
                f"{r[c]:.3f}" if isinstance(r.get(c), float) else str(r.get(c)) for c in cols
            )
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {"target_ratio": args.target_ratio, "profile": args.profile, "results": results},
                fh,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
