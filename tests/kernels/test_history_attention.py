"""The history part of an extend through FlashInfer's paged prefill over single-head pages: the
host plan against Tangram's history kernel (CPU, through FlashInfer's semantics in torch), and
FlashInfer itself on the GPU."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from kernel_cases import DEVICE, TOL, head_slots, make_paged_layer, rel_err

from tangram_sglang.kernels.extend_attention import ragged_extend_attention
from tangram_sglang.kernels.history_attention import (
    TorchPagedHistory,
    from_head_major,
    plan_paged_history,
    to_head_major,
)
from tangram_sglang.kernels.new_token_attention import TorchNewTokens

SCALE = 0.125
PAGE, H_P = 16, 2


def _history_kernel(q, k, v, qo_indptr, paging):
    """Tangram's history-only kernel (the oracle): ``(out, lse)``."""
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), device=q.device)
    return ragged_extend_attention(q, k, v, qo_indptr, *paging, SCALE, out, lse, new_tokens=False)


def _layers(lens, num_kv_heads, num_layers, dtype, head_dim=64, seed=0):
    """One pool and page table, ``num_layers`` head maps over it (each a random draw of
    (group, column) slots): ``(layer, cluster_of [L, H_kv], column_of [L, H_kv])``."""
    layer = make_paged_layer(lens, num_kv_heads, H_P, PAGE, head_dim, dtype, seed)
    rng = np.random.default_rng(seed + 1)
    maps = [(layer.group_of_head.cpu().numpy(), layer.column_of_head.cpu().numpy())]
    for _ in range(num_layers - 1):
        maps.append(head_slots(num_kv_heads, lens.shape[1], H_P, rng))
    cluster = np.stack([m[0] for m in maps]).astype(np.int64)
    column = np.stack([m[1] for m in maps]).astype(np.int64)
    return layer, cluster, column


def _plan(layer, cluster, column, rows, extend_lens, num_qo_heads, min_work=0):
    bounds = np.cumsum([0, *extend_lens]).tolist()
    start = layer.group_len.cpu().numpy()[rows]
    return plan_paged_history(
        rows,
        bounds,
        start,
        cluster,
        column,
        H_P,
        PAGE,
        num_qo_heads,
        layer.k_pool.shape[3],
        min_work=min_work,
    )


def _inputs(extend_lens, num_kv_heads, gqa, head_dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    n = sum(extend_lens)
    q = torch.randn(n, num_kv_heads * gqa, head_dim, generator=gen).to(dtype).to(DEVICE)
    k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    qo_indptr = torch.tensor(np.cumsum([0, *extend_lens]), dtype=torch.int32, device=DEVICE)
    return q, k, v, qo_indptr


def test_head_major_layout_round_trips():
    q = torch.randn(5, 8, 3)
    hm = to_head_major(q, 2)
    assert hm.shape == (10, 4, 3)
    torch.testing.assert_close(hm[5 + 2], q[2, 4:8])  # KV head 1, token 2: query heads 4-7
    torch.testing.assert_close(from_head_major(hm, 2), q)
    torch.testing.assert_close(from_head_major(hm[..., 0], 2), q[..., 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_plan_gives_flashinfers_paged_prefill_each_heads_history_on_every_layer(dtype):
    """Three layers whose KV heads sit in different groups and columns over one pool; every
    group of a row holds the same number of tokens (ratio 1.0), one row has none, lengths are
    off page boundaries. FlashInfer's paged-prefill semantics (torch) on the plan's arrays equal
    Tangram's history kernel on each layer's head map, rows without history included."""
    lens = np.array([[37, 37, 37], [0, 0, 0], [16, 16, 16], [5, 5, 5]])
    num_kv_heads, gqa = 2, 2
    layer, cluster, column = _layers(lens, num_kv_heads, 3, dtype)
    rows, extend_lens = [2, 1, 0, 3], [3, 9, 20, 1]
    plan = _plan(layer, cluster, column, rows, extend_lens, num_kv_heads * gqa)
    assert plan is not None
    q, k, v, qo_indptr = _inputs(extend_lens, num_kv_heads, gqa, 64, dtype, seed=3)
    req_rows = torch.tensor(rows, dtype=torch.int32, device=DEVICE)
    history = TorchPagedHistory()
    ids = plan.ids_on(req_rows, layer.page_table)
    assert ids.layer(2).shape == (plan.num_entries,) and ids.layer(2).dtype == torch.int32
    assert history.plan(plan, ids, q.shape[1], q.shape[2], PAGE, dtype, SCALE)
    for lid in range(3):
        paging = list(layer.paging(req_rows))
        paging[5] = torch.tensor(cluster[lid], dtype=torch.int32, device=DEVICE)
        paging[6] = torch.tensor(column[lid], dtype=torch.int32, device=DEVICE)
        want_out, want_lse = _history_kernel(q, k, v, qo_indptr, paging)
        out, lse = history.run(q, layer.k_pool, layer.v_pool, lid)
        assert rel_err(out, want_out) < TOL[dtype]
        finite = torch.isfinite(want_lse)
        assert torch.equal(finite, torch.isfinite(lse))
        assert not finite[3:12].any()  # the request at row 1 has no history
        assert rel_err(lse[finite], want_lse[finite]) < TOL[dtype]


def test_the_page_id_kernel_writes_what_the_torch_expression_reads():
    """``kernels.history_page_ids`` (Triton; interpreted on CPU) against ``PagedHistoryIds.layer``'s
    torch path, every layer, more entries than one program's block."""
    from tangram_sglang.kernels.history_page_ids import write_layer_page_ids

    lens = np.array([[900, 900, 900], [0, 0, 0], [333, 333, 333]])
    layer, cluster, column = _layers(lens, 2, 3, torch.float32, head_dim=16)
    rows = [2, 0, 1]
    plan = _plan(layer, cluster, column, rows, [4, 5, 6], 4)
    ids = plan.ids_on(torch.tensor(rows, device=DEVICE), layer.page_table)
    assert plan.num_entries > 64  # more than one program of 64 entries
    for lid in range(3):
        src = ids.base + ids.group_offset[lid][ids.head]
        want = ids.table[src].long() * H_P + ids.column_of[lid][ids.head]
        out = torch.full((plan.num_entries,), -1, dtype=torch.int32, device=DEVICE)
        got = write_layer_page_ids(ids, lid, out, block=64)
        assert torch.equal(got.long(), want)
        if DEVICE.type != "cuda":
            assert torch.equal(ids.layer(lid), got)  # the CPU path is the same expression
        # entry 0 is KV head 0 of request 0 (row 2): its group's first page, as a single-head page
        g, c = cluster[lid, 0], column[lid, 0]
        assert int(got[0]) == int(layer.page_table[2, g, 0]) * H_P + c


def test_extend_metadata_builds_the_page_ids_of_the_batchs_rows_from_the_packed_upload():
    """The backend's wiring: ``extend_metadata`` with a plan, through ``PackedUpload`` (the
    server's one packed copy, whose views alias one buffer), gives every layer's page ids of the
    batch's own rows, in FlashInfer's request order (checked entry by entry on the host); a plan
    without the device page table is refused."""
    from tangram_sglang.backend import metadata as md
    from tangram_sglang.errors import KernelError
    from tangram_sglang.mem.page_table import PackedUpload

    lens = np.array([[37, 37, 37], [0, 0, 0], [16, 16, 16], [50, 50, 50]])
    layer, cluster, column = _layers(lens, 2, 3, torch.float32)
    rows, extend_lens = [3, 0, 2], [4, 6, 1]
    plan = _plan(layer, cluster, column, rows, extend_lens, 4)
    kept = np.ones((len(rows), lens.shape[1]), np.int64)
    hist_len = torch.zeros_like(layer.group_len)
    meta = md.extend_metadata(
        rows,
        extend_lens,
        kept,
        DEVICE,
        cluster,
        upload=PackedUpload(DEVICE).upload,
        start_lens=lens[rows],
        hist_len=hist_len,
        history=plan,
        page_table=layer.page_table,
    )
    table = layer.page_table.cpu().numpy()
    for lid in range(3):
        got = meta.history_ids.layer(lid).cpu().numpy()
        want = [
            table[rows[i], cluster[lid, h], j] * H_P + column[lid, h]
            for h in range(2)
            for i in range(len(rows))
            for j in range(-(-int(lens[rows[i], cluster[lid, h]]) // PAGE))
        ]
        assert got.tolist() == want
    with pytest.raises(KernelError, match="needs the device page_table"):
        md.extend_metadata(
            rows, extend_lens, kept, DEVICE, start_lens=lens[rows], hist_len=hist_len, history=plan
        )


def test_a_paged_history_that_cannot_plan_falls_back_for_good_and_says_why(caplog):
    """FlashInfer's plan raising (here: a wrapper whose plan fails, as a FlashInfer build that
    cannot compile the configuration would) leaves the batch, and every later one, to Tangram's
    history kernel, with the exception in the log."""
    from tangram_sglang.kernels.history_attention import FlashInferPagedHistory

    class Failing:
        def plan(self, *args, **kwargs):
            raise RuntimeError("no kernel for this configuration")

    lens = np.array([[37, 37, 37], [12, 12, 12]])
    layer, cluster, column = _layers(lens, 2, 2, torch.float32)
    plan = _plan(layer, cluster, column, [0, 1], [5, 7], 4)
    ids = plan.ids_on(torch.tensor([0, 1], device=DEVICE), layer.page_table)
    history = FlashInferPagedHistory.__new__(FlashInferPagedHistory)
    history.wrapper, history.planned_at, history.usable = Failing(), None, True
    with caplog.at_level("WARNING"):
        assert not history.plan(plan, ids, 4, 64, PAGE, torch.bfloat16, SCALE)
    assert not history.usable
    assert "cannot plan the paged history (RuntimeError" in caplog.text
    assert not history.plan(plan, ids, 4, 64, PAGE, torch.bfloat16, SCALE)  # stays off


def test_a_batch_whose_layers_differ_in_history_length_gets_no_plan():
    lens = np.array([[37, 20, 37], [8, 8, 8]])
    layer, cluster, column = _layers(lens, 2, 2, torch.float32)
    cluster[0] = [0, 2]  # layer 0 reads groups of 37 tokens on row 0
    cluster[1] = [0, 1]  # layer 1's second head reads group 1: 20 tokens
    column[1] = [0, 0]
    assert _plan(layer, cluster, column, [0, 1], [4, 4], 4) is None
    cluster[1] = [2, 0]
    column[1] = [0, 1]
    assert _plan(layer, cluster, column, [0, 1], [4, 4], 4) is not None


def test_no_plan_without_history_or_below_the_work_floor():
    lens = np.array([[0, 0, 0], [30, 30, 30]])
    layer, cluster, column = _layers(lens, 2, 2, torch.float32)
    assert _plan(layer, cluster, column, [0], [50], 4) is None  # no history at all
    # work = new * history * gqa * head_dim summed over KV heads: 10 * 30 * 2 * 64 * 2
    work = 10 * 30 * 2 * 64 * 2
    assert _plan(layer, cluster, column, [1], [10], 4, min_work=work) is not None
    assert _plan(layer, cluster, column, [1], [10], 4, min_work=work + 1) is None


def test_triton_kernels_run_the_planned_paged_history_per_layer_and_equal_the_fused_kernel(
    monkeypatch,
):
    """``TritonKernels.extend`` with torch stand-ins for both FlashInfer parts: a batch with a
    paged-history plan is split even under ``auto`` with ``split_new_tokens`` False, planned on
    its first layer only, each layer's run reads that layer's page ids, and the result is the
    fused kernel's."""
    from tangram_sglang.backend import metadata as md
    from tangram_sglang.backend.layer_ops import TritonKernels
    from tangram_sglang.profile import BudgetProfile

    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda d: SimpleNamespace(multi_processor_count=8)
    )
    profile = BudgetProfile.load("calibration/synthetic/llama3.1-8b-ada-snapkv-r0.25.json")
    kernels = TritonKernels(SimpleNamespace(profile=profile), 4, torch.device("cpu"))
    kernels.prefill, kernels.new_tokens = "auto", TorchNewTokens()
    runs, plans = [], []

    class Recorded(TorchPagedHistory):
        usable = True

        def plan(self, *args):
            plans.append(args[0])
            return super().plan(*args)

        def run(self, q, k_pool, v_pool, layer):
            runs.append(layer)
            return super().run(q, k_pool, v_pool, layer)

    kernels.history = Recorded()
    assert kernels.plans_paged_history and not kernels.history_planned
    lens = np.array([[37, 37, 37], [12, 12, 12], [0, 0, 0]])
    layer, cluster, column = _layers(lens, 2, 2, torch.float32)
    rows, extend_lens = [0, 2, 1], [5, 7, 2]
    plan = _plan(layer, cluster, column, rows, extend_lens, 4)
    q, k, v, qo_indptr = _inputs(extend_lens, 2, 2, 64, torch.float32, seed=9)
    req_rows = torch.tensor(rows, dtype=torch.int32, device=DEVICE)
    meta = md.TangramForwardMetadata(
        mode=md.EXTEND,
        req_rows=req_rows,
        qo_indptr=qo_indptr,
        bounds=qo_indptr.tolist(),
        kept_lens=None,
        kept_count=None,
        dest_page=None,
        dest_slot=None,
        max_extend_len=7,
        split_new_tokens=False,
        history=plan,
        history_ids=plan.ids_on(req_rows, layer.page_table),
    )
    for lid in range(2):
        paging = list(layer.paging(req_rows))
        paging[5] = torch.tensor(cluster[lid], dtype=torch.int32, device=DEVICE)
        paging[6] = torch.tensor(column[lid], dtype=torch.int32, device=DEVICE)
        got = kernels.extend(q, k, v, qo_indptr, *paging, SCALE, 7, meta=meta, layer=lid)
        want = ragged_extend_attention(
            q,
            k,
            v,
            qo_indptr,
            *paging,
            SCALE,
            torch.empty_like(q),
            torch.empty(q.shape[:2], device=DEVICE),
            7,
        )
        assert rel_err(got[0], want[0]) < TOL[torch.float32]
        assert rel_err(got[1], want[1]) < TOL[torch.float32]
    assert runs == [0, 1] and plans == [plan] and kernels.history_planned


def test_history_attention_reads_its_switch_and_refuses_a_split_turned_off(monkeypatch, caplog):
    from tangram_sglang.backend.layer_ops import kernels_for
    from tangram_sglang.config import (
        HISTORY_ATTENTION_ENV,
        PREFILL_ATTENTION_ENV,
        history_attention,
    )
    from tangram_sglang.errors import ConfigError

    assert history_attention({}) == "auto"
    assert history_attention({HISTORY_ATTENTION_ENV: ""}) == "auto"
    assert history_attention({HISTORY_ATTENTION_ENV: " FlashInfer "}) == "flashinfer"
    assert history_attention({HISTORY_ATTENTION_ENV: "TRITON"}) == "triton"
    # the default with the split turned off is no conflict: it resolves to Tangram's kernel
    assert history_attention({PREFILL_ATTENTION_ENV: "triton"}) == "auto"
    assert (
        history_attention({HISTORY_ATTENTION_ENV: "auto", PREFILL_ATTENTION_ENV: "triton"})
        == "auto"
    )
    with pytest.raises(ConfigError, match="TANGRAM_HISTORY_ATTENTION='fa3'"):
        history_attention({HISTORY_ATTENTION_ENV: "fa3"})
    with pytest.raises(ConfigError, match="TANGRAM_PREFILL_ATTENTION=triton"):
        history_attention({HISTORY_ATTENTION_ENV: "flashinfer", PREFILL_ATTENTION_ENV: "triton"})
    # the server reads it at start-up through kernels_for; a CPU server then plans every batch
    monkeypatch.setenv(HISTORY_ATTENTION_ENV, "flashinfer")
    kernels = kernels_for(torch.device("cpu"), None, 1)
    assert kernels.plans_paged_history and kernels.paged_history_min_work == 0
    monkeypatch.delenv(HISTORY_ATTENTION_ENV)  # auto: a CPU server keeps the fused reference
    with caplog.at_level("INFO"):
        assert not kernels_for(torch.device("cpu"), None, 1).plans_paged_history
    assert "history auto (TANGRAM_HISTORY_ATTENTION): every extend runs in the fused" in caplog.text
    monkeypatch.setenv(HISTORY_ATTENTION_ENV, "paged")
    with pytest.raises(ConfigError, match="TANGRAM_HISTORY_ATTENTION='paged'"):
        kernels_for(torch.device("cpu"), None, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashInfer's prefill needs CUDA")
@pytest.mark.parametrize("extend_lens", [[1, 70, 300], [700, 3]])
def test_flashinfer_paged_history_equals_tangrams_history_kernel(extend_lens):
    """bf16, Llama head shapes (GQA 4, head_dim 128), page 16, two layers with different head
    maps, a request without history: FlashInfer's out and natural-log LSE per layer."""
    from tangram_sglang.kernels.history_attention import FlashInferPagedHistory
    from tangram_sglang.kernels.new_token_attention import WORKSPACE_BYTES

    num_kv_heads, gqa = 2, 4
    hist = [300, 0, 1000][: len(extend_lens)] if len(extend_lens) > 2 else [0, 1000]
    lens = np.repeat(np.array(hist)[:, None], 3, axis=1)
    layer, cluster, column = _layers(lens, num_kv_heads, 2, torch.bfloat16, head_dim=128)
    rows = list(range(len(extend_lens)))
    plan = _plan(layer, cluster, column, rows, extend_lens, num_kv_heads * gqa)
    q, k, v, qo_indptr = _inputs(extend_lens, num_kv_heads, gqa, 128, torch.bfloat16, seed=5)
    workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=DEVICE)
    history = FlashInferPagedHistory(workspace, torch.bfloat16)
    req_rows = torch.tensor(rows, dtype=torch.int32, device=DEVICE)
    ids = plan.ids_on(req_rows, layer.page_table)
    assert history.plan(plan, ids, q.shape[1], 128, PAGE, torch.bfloat16, SCALE)
    for lid in range(2):
        paging = list(layer.paging(req_rows))
        paging[5] = torch.tensor(cluster[lid], dtype=torch.int32, device=DEVICE)
        paging[6] = torch.tensor(column[lid], dtype=torch.int32, device=DEVICE)
        want_out, want_lse = _history_kernel(q, k, v, qo_indptr, paging)
        out, lse = history.run(q, layer.k_pool, layer.v_pool, lid)
        assert rel_err(out, want_out) < TOL[torch.bfloat16]
        finite = torch.isfinite(want_lse)
        assert finite.any() and not finite.all()  # one request has no history
        assert torch.equal(finite, torch.isfinite(lse))
        assert (lse[~finite] == float("-inf")).all() and (out[~finite] == 0).all()
        assert rel_err(lse[finite], want_lse[finite]) < 1e-3
        assert math.isfinite(float(out.float().sum()))


class _FakePagedHistory:
    """``FlashInferPagedHistory``'s start-up surface, for ``TritonKernels`` on a CPU host."""

    usable = True

    def __init__(self, workspace, dtype):
        pass

    def warm_up(self, num_qo_heads, num_kv_heads, head_dim):
        return True


class _NoRoomPagedHistory(_FakePagedHistory):
    def warm_up(self, num_qo_heads, num_kv_heads, head_dim):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")


def _fake_flashinfer(monkeypatch, paged_history):
    """Stand in for FlashInfer's two wrappers (the new tokens' in torch, ``paged_history`` for
    the history's) and the GPU's properties, so ``TritonKernels`` starts on a CPU host; returns
    the state fields it reads (the Llama-3.1-8B-shaped synthetic profile, a bf16 pool)."""
    from tangram_sglang.kernels import history_attention, new_token_attention
    from tangram_sglang.kernels.new_token_attention import TorchNewTokens
    from tangram_sglang.profile import BudgetProfile

    class NewTokens(TorchNewTokens):
        def __init__(self, device, dtype):
            super().__init__()
            self.workspace = None

    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda d: SimpleNamespace(multi_processor_count=8)
    )
    monkeypatch.setattr(new_token_attention, "FlashInferNewTokens", NewTokens)
    monkeypatch.setattr(history_attention, "FlashInferPagedHistory", paged_history)
    profile = BudgetProfile.load("calibration/synthetic/llama3.1-8b-ada-snapkv-r0.25.json")
    pool = SimpleNamespace(k_pool=torch.zeros(1, dtype=torch.bfloat16))
    return SimpleNamespace(profile=profile, memory=SimpleNamespace(kv_pool=pool))


def test_a_paged_history_that_fails_its_start_up_run_stays_off_and_says_why(monkeypatch, caplog):
    """``FlashInferPagedHistory.warm_up`` (one query over one page at start-up, so a JIT
    FlashInfer builds the FA2 module then): a wrapper whose plan raises turns the path off with
    the exception in the log; ``TritonKernels`` then plans no paged history."""
    from tangram_sglang.backend.layer_ops import TritonKernels
    from tangram_sglang.kernels import history_attention
    from tangram_sglang.kernels.history_attention import FlashInferPagedHistory

    class Failing:
        def plan(self, *args, **kwargs):
            raise RuntimeError("no FA2 kernel for head_dim 96")

    history = FlashInferPagedHistory.__new__(FlashInferPagedHistory)
    history.wrapper, history.planned_at, history.usable = Failing(), None, True
    history.dtype, history.device = torch.bfloat16, torch.device("cpu")
    with caplog.at_level("WARNING"):
        assert not history.warm_up(32, 8, 96)
    assert not history.usable
    assert "paged prefill failed its start-up run (RuntimeError: no FA2 kernel" in caplog.text

    warmed = []

    class History(_FakePagedHistory):
        def warm_up(self, num_qo_heads, num_kv_heads, head_dim):
            warmed.append((num_qo_heads, num_kv_heads, head_dim))
            self.usable = False
            return False

    state = _fake_flashinfer(monkeypatch, History)
    kernels = TritonKernels(state, 4, torch.device("cpu"), prefill="auto", history="flashinfer")
    m = state.profile.model
    assert warmed == [(m.num_qo_heads, m.num_kv_heads, m.head_dim)]
    assert kernels.prefill == "auto" and not kernels.plans_paged_history

    monkeypatch.setattr(history_attention, "FlashInferPagedHistory", _NoRoomPagedHistory)
    kernels = TritonKernels(state, 4, torch.device("cpu"), prefill="auto", history="flashinfer")
    assert kernels.history is None and not kernels.plans_paged_history


def test_a_paged_history_whose_start_up_output_is_not_finite_stays_off(monkeypatch, caplog):
    """A FlashInfer that plans and runs but returns NaN at start-up is not used either."""
    from tangram_sglang.kernels.history_attention import FlashInferPagedHistory

    calls = []

    class NaNs:
        def plan(self, *args, **kwargs):
            calls.append(("plan", args[2].tolist(), args[2].dtype, args[4:8], kwargs["causal"]))

        def run(self, q, paged_kv, return_lse=False):
            calls.append(("run", tuple(q.shape), tuple(paged_kv[0].shape), return_lse))
            lse = torch.zeros(q.shape[:2], dtype=torch.float32)
            return torch.full_like(q, float("nan")), lse

    class Event:  # CUDA events need a GPU; the order of record and run is what matters here
        def record(self):
            calls.append(("event",))

    monkeypatch.setattr(torch.cuda, "Event", Event)
    history = FlashInferPagedHistory.__new__(FlashInferPagedHistory)
    history.wrapper, history.planned_at, history.usable = NaNs(), None, True
    history.dtype, history.device = torch.bfloat16, torch.device("cpu")
    with caplog.at_level("WARNING"):
        assert not history.warm_up(32, 8, 128)
    assert not history.usable and "non-finite start-up output" in caplog.text
    # one query head group (GQA 4) of one KV head over one 16-token page, non-causal; page 0's
    # id from PagedHistoryIds.layer (the page-id kernel on CUDA); the LSE asked for, as in run()
    assert calls == [
        ("plan", [0], torch.int32, (4, 1, 128, 16), False),
        ("event",),
        ("run", (1, 4, 128), (1, 1, 16, 128), True),
    ]


def test_the_default_history_takes_flashinfer_where_the_new_tokens_do(monkeypatch, caplog):
    """``TANGRAM_HISTORY_ATTENTION`` unset (``auto``) on a CUDA server: FlashInfer's paged history
    when the new tokens go through FlashInfer, none under ``TANGRAM_PREFILL_ATTENTION=triton``;
    its fallback is logged at info level, the named ``flashinfer``'s as a warning."""
    from tangram_sglang.backend.layer_ops import TritonKernels
    from tangram_sglang.errors import KernelError
    from tangram_sglang.kernels import history_attention, new_token_attention

    def NoFlashInfer(device, dtype):
        raise KernelError("flashinfer is not installed")

    state = _fake_flashinfer(monkeypatch, _FakePagedHistory)
    cpu = torch.device("cpu")
    with caplog.at_level("INFO"):
        kernels = TritonKernels(state, 4, cpu, prefill="auto", history="auto")
    assert isinstance(kernels.history, _FakePagedHistory) and kernels.plans_paged_history
    assert "history flashinfer where planned" in caplog.text
    kernels = TritonKernels(state, 4, cpu, prefill="triton", history="auto")
    assert kernels.history is None and not kernels.plans_paged_history
    assert not TritonKernels(state, 4, cpu, prefill="auto", history="triton").plans_paged_history

    monkeypatch.setattr(history_attention, "FlashInferPagedHistory", _NoRoomPagedHistory)
    for history, level in (("auto", "INFO"), ("flashinfer", "WARNING")):
        caplog.clear()
        with caplog.at_level("INFO"):
            kernels = TritonKernels(state, 4, cpu, prefill="auto", history=history)
        assert kernels.history is None and not kernels.plans_paged_history
        fallback = [r for r in caplog.records if "without FlashInfer's paged prefill" in r.message]
        assert [r.levelname for r in fallback] == [level]
        assert f"TANGRAM_HISTORY_ATTENTION={history} " in fallback[0].message

    # no FlashInfer for the new tokens: the default says nothing more, the named value warns
    monkeypatch.setattr(new_token_attention, "FlashInferNewTokens", NoFlashInfer)
    for history, warned in (("auto", False), ("flashinfer", True)):
        caplog.clear()
        with caplog.at_level("INFO"):
            kernels = TritonKernels(state, 4, cpu, prefill="auto", history=history)
        assert kernels.new_tokens is None and kernels.history is None
        warnings = [r.message for r in caplog.records if r.levelname == "WARNING"]
        assert any("without FlashInfer's new-token prefill" in m for m in warnings) == warned


def test_a_cuda_server_gets_the_history_switch_it_was_started_with(monkeypatch):
    """``kernels_for`` hands ``TANGRAM_HISTORY_ATTENTION`` (unset: ``auto``) and
    ``TANGRAM_DECODE_CTAS_PER_SM`` (unset: 12) to the CUDA kernels."""
    from tangram_sglang.backend import layer_ops
    from tangram_sglang.config import DECODE_CTAS_ENV, HISTORY_ATTENTION_ENV, PREFILL_ATTENTION_ENV

    seen = []
    monkeypatch.setattr(
        layer_ops,
        "TritonKernels",
        lambda state, bs, device, plan, prefill, history, ctas_per_sm: seen.append(
            (prefill, history, ctas_per_sm)
        ),
    )
    monkeypatch.delenv(HISTORY_ATTENTION_ENV, raising=False)
    monkeypatch.delenv(PREFILL_ATTENTION_ENV, raising=False)
    monkeypatch.delenv(DECODE_CTAS_ENV, raising=False)
    layer_ops.kernels_for(torch.device("cuda"), None, 1)
    monkeypatch.setenv(HISTORY_ATTENTION_ENV, "triton")
    monkeypatch.setenv(DECODE_CTAS_ENV, "28")
    layer_ops.kernels_for(torch.device("cuda"), None, 1)
    assert seen == [("auto", "auto", 12), ("auto", "triton", 28)]
