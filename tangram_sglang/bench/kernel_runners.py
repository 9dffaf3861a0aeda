"""GPU side of ``bench/kernels.py``: build each case's buffers, run and time every method.

Timing: Tangram (length-fitted plan, batch-balanced plan, AOT table, uniform table) and SGLang's
Triton decode are captured in one CUDA graph per method (the replicas in sequence, repeated to
at least ``MIN_CALLS`` launches) and replayed; the median replay time over the launches is the
per-call time (CUDA events). FlashInfer's ``plan()`` + ``run()`` cannot be captured (plan is
host work), so it is timed eagerly with ``triton.testing.do_bench`` (median; do_bench flushes L2
between calls). SGLang and FlashInfer are imported lazily; a missing one leaves its column empty
with a note.

Ragged rows (``skewed``): the pool holds every request row at the longest request's pages per
KV head, and ``group_len[row, group]`` is that row's kept tokens (the kernels and the reference
read only those); FlashInfer gets per-(request, KV head) page counts and last-page lengths, and
SGLang per-request sequence lengths over each request's own slots.
"""

from __future__ import annotations

import statistics
import time
from functools import partial
from typing import Any

import numpy as np
import torch
import triton

from tangram_sglang.bench.kernels import HEAD_DIM, NUM_KV_HEADS, NUM_QO_HEADS, PAGE_SIZE, Case
from tangram_sglang.config import decode_ctas_per_sm
from tangram_sglang.grouping import HeadGrouping
from tangram_sglang.kernels.decode_attention import decode_scratch, ragged_decode_attention
from tangram_sglang.kernels.reference import decode_reference
from tangram_sglang.kernels.split_table import build_split_table

MIN_CALLS = 16  # launches per captured graph: amortises replay overhead for tiny cases
TARGET_REPLAY_MS = 400.0  # total replay time per measurement (bounds the slow large cases)
REFERENCE_CHECK_BYTES = 512 << 20  # check against the torch reference below this KV size
TIME_BUDGET_S = 7.5 * 60  # stop starting new cases after this (the run must end in ~8 min)
GQA = NUM_QO_HEADS // NUM_KV_HEADS
SM_SCALE = HEAD_DIM**-0.5


def cuda_available() -> bool:
    return torch.cuda.is_available()


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy bandwidth of a 4 GiB bf16 tensor (bytes read + written), GB/s."""
    src = torch.empty(2 << 30, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)

    def copy() -> None:
        dst.copy_(src)

    ms = triton.testing.do_bench(copy, warmup=50, rep=300, return_mode="median")
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9


def time_graph(calls: list) -> float:
    """Median per-call time (ms) of ``calls`` (cycled) captured in one CUDA graph and replayed."""
    seq = [calls[i % len(calls)] for i in range(max(MIN_CALLS, len(calls)))]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (JIT compile) outside the capture
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in seq:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    while len(times) < 3 or (sum(times) * len(seq) < TARGET_REPLAY_MS and len(times) < 20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(seq))
    del graph
    return statistics.median(times)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


class RaggedState:
    """The ragged pool of one case: ``replicas`` x ``batch`` rows, H_p = 1, pages shuffled."""

    def __init__(self, case: Case, num_sms: int) -> None:
        ratios = np.asarray(case.ratios)[None, :]
        self.grouping = HeadGrouping.build(ratios, 1, "per_layer")
        self.group_ratios = self.grouping.group_ratios(ratios)
        self.num_sms = num_sms
        dev = "cuda"
        groups = self.grouping.cluster_of[0]
        # pages per KV head of the longest request; each row reads its own group_len of them
        pages = [-(-k // PAGE_SIZE) for k in case.kept_tokens]
        rows = case.batch * case.replicas_kept
        num_pages = 1 + rows * sum(pages)
        shape = (num_pages, 1, PAGE_SIZE, HEAD_DIM)
        self.k_pool = torch.empty(shape, dtype=torch.bfloat16, device=dev).normal_()
        self.v_pool = torch.empty(shape, dtype=torch.bfloat16, device=dev).normal_()
        perm = (torch.randperm(num_pages - 1, device=dev) + 1).to(torch.int32)
        self.page_table = torch.zeros(rows, NUM_KV_HEADS, max(pages), dtype=torch.int32, device=dev)
        offset = 0
        for h, num in enumerate(pages):
            ids = perm[offset : offset + rows * num].view(rows, num)
            self.page_table[:, int(groups[h]), :num] = ids
            offset += rows * num
        self.kept = case.row_kept()  # [batch, H_kv], request b's row is b of every replica
        kept = torch.as_tensor(np.tile(self.kept, (case.replicas_kept, 1)), device=dev)
        self.group_len = torch.zeros(rows, NUM_KV_HEADS, dtype=torch.int32, device=dev)
        self.group_len[:, torch.as_tensor(groups, device=dev)] = kept.int()
        self.group_of_head = torch.as_tensor(groups, dtype=torch.int32, device=dev)
        self.column_of_head = torch.zeros(NUM_KV_HEADS, dtype=torch.int32, device=dev)
        self.req_rows = [
            torch.arange(r * case.batch, (r + 1) * case.batch, dtype=torch.int32, device=dev)
            for r in range(case.replicas_kept)
        ]
        self.q = torch.randn(case.batch, NUM_QO_HEADS, HEAD_DIM, device=dev).to(torch.bfloat16)
        self.case = case
        self.chunk_floor: int | None = None  # plan="batch": tokens per CTA, set by decode_calls

    def decode_calls(self, uniform: bool, plan: str = "table") -> tuple[list, torch.Tensor]:
        """One decode launch per replica and the output they write.

        ``plan="table"`` with the AOT (or ``uniform``) table, ``plan="lengths"`` (the split
        fitted to the real lengths in the kernel; the AOT table gives its CTA budget), or
        ``plan="batch"`` (the batch-balanced plan; its chunk floor, from the batch's kept tokens
        and the table's ``launch_ctas``, goes in as an int32 [1] tensor).
        """
        # the table of the batch's bucket, as a server picks it (the smallest power of two >=
        # the batch: build_split_tables), so a 23-row case gets the 32-row bucket's budgets
        bucket = 1 << (self.case.batch - 1).bit_length()
        host = build_split_table(
            self.grouping,
            self.group_ratios,
            self.num_sms,
            bucket,
            uniform=uniform,
            ctas_per_sm=decode_ctas_per_sm(),
        )
        table = host.to("cuda")
        view = table.layer(0)
        extra: dict[str, torch.Tensor] = {}
        if plan == "batch":
            from tangram_sglang.kernels.split_table import batch_chunk_floor

            self.chunk_floor = int(batch_chunk_floor(self.kept, host.launch_ctas))
            floor = torch.tensor([self.chunk_floor], dtype=torch.int32, device="cuda")
            extra["chunk_floor"] = floor
        mid_o, mid_lse = decode_scratch(
            self.case.batch, NUM_QO_HEADS, table.scratch_splits, HEAD_DIM, "cuda"
        )
        out = torch.empty_like(self.q)
        calls = [
            partial(
                ragged_decode_attention,
                self.q,
                self.k_pool,
                self.v_pool,
                self.page_table,
                self.group_len,
                rows,
                self.group_of_head,
                self.column_of_head,
                view,
                SM_SCALE,
                out,
                mid_o,
                mid_lse,
                plan,
                **extra,
            )
            for rows in self.req_rows
        ]
        return calls, out

    def reference(self) -> torch.Tensor:
        """Torch reference output of replica 0 (fp32)."""
        args = (self.k_pool.float(), self.v_pool.float(), self.page_table, self.group_len)
        return decode_reference(
            self.q.float(),
            *args,
            self.req_rows[0],
            self.group_of_head,
            self.column_of_head,
            SM_SCALE,
        )


def run_flashinfer(state: RaggedState, aot_out: torch.Tensor) -> dict[str, Any]:
    """FlashInfer paged decode over the ragged heads, per-step plan() counted; run() alone."""
    try:
        import flashinfer
    except ImportError as exc:
        return {"flashinfer_note": f"flashinfer not importable ({exc}); column skipped"}
    case, dev = state.case, "cuda"
    workspace = torch.zeros(128 << 20, dtype=torch.uint8, device=dev)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, kv_layout="HND", use_tensor_cores=True
    )
    # one sequence per (request, KV head), request-major: its own kept tokens and pages
    kept = torch.as_tensor(state.kept, device=dev).int()  # [batch, H_kv]
    pages = (kept + PAGE_SIZE - 1) // PAGE_SIZE
    max_pages = state.page_table.shape[2]
    mask = torch.arange(max_pages, device=dev) < pages[..., None]  # [batch, H_kv, max_pages]
    indptr = torch.zeros(case.batch * NUM_KV_HEADS + 1, dtype=torch.int32, device=dev)
    indptr[1:] = torch.cumsum(pages.flatten(), 0)
    last_len = (kept - (pages - 1) * PAGE_SIZE).flatten().int()
    groups = state.group_of_head.long()
    indices = [state.page_table[rows.long()][:, groups][mask].int() for rows in state.req_rows]
    q = state.q.view(case.batch * NUM_KV_HEADS, GQA, HEAD_DIM)
    out = torch.empty_like(q)
    plan = partial(
        wrapper.plan,
        num_qo_heads=GQA,
        num_kv_heads=1,
        head_dim=HEAD_DIM,
        page_size=PAGE_SIZE,
        q_data_type=torch.bfloat16,
        kv_data_type=torch.bfloat16,
        sm_scale=SM_SCALE,
    )
    counter = [0]

    def plan_run() -> None:
        i = counter[0] = (counter[0] + 1) % len(indices)
        plan(indptr, indices[i], last_len)
        wrapper.run(q, (state.k_pool, state.v_pool), out=out)

    plan(indptr, indices[0], last_len)
    wrapper.run(q, (state.k_pool, state.v_pool), out=out)
    err = rel_err(out.view_as(aot_out), aot_out)
    run_ms = triton.testing.do_bench(
        lambda: wrapper.run(q, (state.k_pool, state.v_pool), out=out), return_mode="median"
    )
    plan_run_ms = triton.testing.do_bench(plan_run, return_mode="median")
    return {
        "flashinfer_ms": plan_run_ms,
        "flashinfer_run_ms": run_ms,
        "flashinfer_vs_aot_rel_err": err,
    }


def run_sglang_full_kv(case: Case, num_sms: int) -> dict[str, Any]:
    """SGLang 0.5.17's Triton decode on the full KV (page_size 1, shuffled slots).

    Each request owns ``case.context`` shuffled slots of each replica's region and reads its
    first ``case.contexts()[b]`` of them (all of them except under ``skewed``).
    """
    try:
        from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd
        from sglang.kernels.ops.attention.metadata import get_num_kv_splits_triton
    except ImportError as exc:
        return {"sglang_note": f"sglang kernels not importable ({exc}); column skipped"}
    dev, tokens = "cuda", case.batch * case.context
    shape = (tokens * case.replicas_full + 1, NUM_KV_HEADS, HEAD_DIM)
    if shape[0] * NUM_KV_HEADS * HEAD_DIM >= 2**31:
        # SGLang's Triton decode computes KV offsets in int32 (an illegal memory access was
        # measured at 32 x 128k tokens). SGLang never builds such a per-layer buffer: its whole
        # H200 capacity for this model is 788,603 tokens over all 32 layers.
        return {"sglang_note": f"{shape[0]} slots overflow SGLang's int32 KV offsets; skipped"}
    k_buf = torch.empty(shape, dtype=torch.bfloat16, device=dev).normal_()
    v_buf = torch.empty(shape, dtype=torch.bfloat16, device=dev).normal_()
    seq_lens = torch.tensor(case.contexts(), dtype=torch.int32, device=dev)
    indptr = torch.zeros(case.batch + 1, dtype=torch.int32, device=dev)
    indptr[1:] = torch.cumsum(seq_lens, 0)
    used = torch.arange(case.context, device=dev) < seq_lens[:, None]  # [batch, context]
    indices = [
        (torch.randperm(tokens, device=dev) + 1 + r * tokens).view(case.batch, -1)[used].int()
        for r in range(case.replicas_full)
    ]
    max_kv_splits = 8  # sglang 0.5.17 --triton-attention-num-kv-splits default (CUDA)
    num_kv_splits = torch.empty(case.batch, dtype=torch.int32, device=dev)
    get_num_kv_splits_triton[(1,)](
        num_kv_splits,
        seq_lens,
        case.batch,
        1,
        NUM_QO_HEADS,
        NUM_KV_HEADS,
        max_kv_splits,
        num_sms,
        MAX_NUM_SEQ=max(256, triton.next_power_of_2(case.batch)),
    )
    logits = torch.empty(case.batch, NUM_QO_HEADS, max_kv_splits, HEAD_DIM, device=dev)
    lse = torch.empty(case.batch, NUM_QO_HEADS, max_kv_splits, device=dev)
    q = torch.randn(case.batch, NUM_QO_HEADS, HEAD_DIM, device=dev).to(torch.bfloat16)
    out = torch.empty_like(q)
    calls = [
        partial(
            decode_attention_fwd,
            q,
            k_buf,
            v_buf,
            out,
            indptr,
            idx,
            logits,
            lse,
            num_kv_splits,
            max_kv_splits,
            SM_SCALE,
            1.0,
            1.0,
        )
        for idx in indices
    ]
    return {"sglang_full_kv_ms": time_graph(calls)}


def run_case(case: Case, num_sms: int, copy_gbs: float, full_cache: dict) -> None:
    """Fill ``case.results`` (times in ms, GB/s, checks)."""
    r = case.results
    state = RaggedState(case, num_sms)
    aot_calls, aot_out = state.decode_calls(uniform=False)
    r["aot_ms"] = time_graph(aot_calls)
    aot_calls[0]()
    if case.kept_kv_bytes <= REFERENCE_CHECK_BYTES:
        r["aot_vs_reference_rel_err"] = rel_err(aot_out, state.reference())
    uni_calls, uni_out = state.decode_calls(uniform=True)
    r["uniform_ms"] = time_graph(uni_calls)
    uni_calls[0]()
    r["uniform_vs_aot_rel_err"] = rel_err(uni_out, aot_out)
    fit_calls, fit_out = state.decode_calls(uniform=False, plan="lengths")
    r["lengths_ms"] = time_graph(fit_calls)
    fit_calls[0]()
    r["lengths_vs_aot_rel_err"] = rel_err(fit_out, aot_out)
    r["aot_has_nan"] = bool(aot_out.isnan().any())
    r["lengths_has_nan"] = bool(fit_out.isnan().any())
    batch_calls, batch_out = state.decode_calls(uniform=False, plan="batch")
    r["batch_chunk_floor"] = state.chunk_floor
    r["batch_ms"] = time_graph(batch_calls)
    batch_calls[0]()
    r["batch_vs_aot_rel_err"] = rel_err(batch_out, aot_out)
    r["batch_has_nan"] = bool(batch_out.isnan().any())
    r |= run_flashinfer(state, aot_out)
    del state, aot_calls, uni_calls, fit_calls, batch_calls
    torch.cuda.empty_cache()
    key = (case.batch, case.context, tuple(case.row_contexts))
    if key not in full_cache:
        full_cache[key] = run_sglang_full_kv(case, num_sms)
        torch.cuda.empty_cache()
    r |= full_cache[key]
    r["roofline_ms"] = case.kept_kv_bytes / (copy_gbs * 1e9) * 1e3
    for name in ("lengths", "batch", "aot", "uniform"):
        if r.get(f"{name}_ms"):
            r[f"{name}_gbs"] = case.kept_kv_bytes / (r[f"{name}_ms"] * 1e-3) / 1e9
    r["aot_bw_fraction"] = r["aot_gbs"] / copy_gbs
    if r.get("sglang_full_kv_ms"):
        r["sglang_full_kv_gbs"] = case.full_kv_bytes / (r["sglang_full_kv_ms"] * 1e-3) / 1e9


def run_all(cases: list[Case], on_case=None) -> dict[str, Any]:
    """Run every non-skipped case (within ``TIME_BUDGET_S``); returns the run's metadata."""
    props = torch.cuda.get_device_properties(0)
    num_sms = props.multi_processor_count
    copy_gbs = copy_bandwidth_gbs()
    torch.cuda.empty_cache()
    started, full_cache = time.monotonic(), {}
    for case in cases:
        if case.skipped:
            continue
        if time.monotonic() - started > TIME_BUDGET_S:
            case.skipped = f"time budget of {TIME_BUDGET_S:.0f} s used up"
            continue
        try:
            run_case(case, num_sms, copy_gbs, full_cache)
        except torch.OutOfMemoryError as exc:
            case.skipped = f"CUDA out of memory: {str(exc).splitlines()[0]}"
            torch.cuda.empty_cache()
        print(
            f"{case.shape} batch {case.batch} context {case.context} budget {case.budget}: "
            f"{case.results or case.skipped}",
            flush=True,
        )
        if on_case is not None:
            on_case()
    return {
        "device": props.name,
        "num_sms": num_sms,
        "copy_bandwidth_gbs": copy_gbs,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "versions": _versions(),
        "seconds": time.monotonic() - started,
    }


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("sglang", "flashinfer-python"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "missing"
    return out
