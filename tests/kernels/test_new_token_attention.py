"""The split extend (new tokens apart, history by Tangram's kernel, merged by LSE) against the
fused extend kernel and the torch reference; FlashInfer's ragged prefill on the GPU."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from kernel_cases import DEVICE, TOL, extend_inputs, rel_err

from tangram_sglang.kernels.extend_attention import ragged_extend_attention
from tangram_sglang.kernels.new_token_attention import (
    TorchNewTokens,
    causal_new_token_reference,
    merge_states,
    split_extend,
)
from tangram_sglang.kernels.reference import extend_reference

SCALE = 0.125


def _fused(q, k, v, qo_indptr, paging, new_tokens=True):
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), device=DEVICE)
    return ragged_extend_attention(
        q, k, v, qo_indptr, *paging, SCALE, out, lse, new_tokens=new_tokens
    )


def test_causal_new_token_reference_is_the_extend_without_history():
    _, q, k, v, qo_indptr, paging = extend_inputs(torch.float32, 4, 16, [5, 33, 0], seed=2)
    empty = list(paging)
    empty[3] = torch.zeros_like(paging[3])  # group_len: no history anywhere
    bounds = qo_indptr.tolist()
    out, lse = causal_new_token_reference(q, k, v, bounds, SCALE)
    want_out, want_lse = extend_reference(q, k, v, qo_indptr, *empty, SCALE)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-6)


def test_merge_states_of_two_key_halves_is_the_whole_attention():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(7, 3, 8, generator=gen)
    keys, values = torch.randn(3, 20, 8, generator=gen), torch.randn(3, 20, 8, generator=gen)

    def attend(lo, hi):
        logits = torch.einsum("thd,hnd->thn", q, keys[:, lo:hi]) * SCALE
        lse = torch.logsumexp(logits, -1)
        return torch.einsum("thn,hnd->thd", torch.softmax(logits, -1), values[:, lo:hi]), lse

    out, lse = merge_states(*attend(0, 6), *attend(6, 20))
    want_out, want_lse = attend(0, 20)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-6)
    # a side without keys (output 0, LSE -inf) drops out
    nothing = (torch.zeros_like(want_out), torch.full_like(want_lse, float("-inf")))
    out, lse = merge_states(*nothing, want_out, want_lse)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_history_only_kernel_plus_new_tokens_equals_the_fused_kernel(dtype):
    """Rows with and without history (random_lens puts zeros in); a 70-token segment spans two
    query blocks; an empty segment."""
    _, q, k, v, qo_indptr, paging = extend_inputs(dtype, 16, 64, [1, 70, 0], seed=4)
    want_out, want_lse = _fused(q, k, v, qo_indptr, paging)
    new = TorchNewTokens()
    new.plan(qo_indptr.tolist(), q.shape[1], k.shape[1], q.shape[2], q.dtype)
    out, lse = split_extend(
        new, lambda: _fused(q, k, v, qo_indptr, paging, new_tokens=False), q, k, v, SCALE
    )
    assert rel_err(out, want_out) < TOL[dtype]
    assert rel_err(lse, want_lse) < TOL[dtype]


def test_history_only_kernel_gives_nothing_to_a_request_without_history():
    layer, q, k, v, qo_indptr, paging = extend_inputs(torch.float32, 4, 16, [6, 9, 3], seed=1)
    group_len = paging[3].clone()
    group_len[0] = 0  # row 0 (the second request) has no history
    paging = (*paging[:3], group_len, *paging[4:])
    out, lse = _fused(q, k, v, qo_indptr, paging, new_tokens=False)
    second = slice(6, 15)
    assert (out[second] == 0).all() and (lse[second] == float("-inf")).all()
    assert torch.isfinite(lse[:6]).all()  # row 2 has history in every group (random_lens)


def test_no_history_anywhere_needs_no_history_pass():
    _, q, k, v, qo_indptr, paging = extend_inputs(torch.float32, 4, 16, [12, 30], seed=3)
    empty = list(paging)
    empty[3] = torch.zeros_like(paging[3])
    new = TorchNewTokens()
    new.plan(qo_indptr.tolist(), q.shape[1], k.shape[1], q.shape[2], q.dtype)
    out, lse = split_extend(new, None, q, k, v, SCALE)
    want_out, want_lse = _fused(q, k, v, qo_indptr, empty)
    assert rel_err(out, want_out) < TOL[torch.float32]
    assert rel_err(lse, want_lse) < TOL[torch.float32]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashInfer's prefill needs CUDA")
@pytest.mark.parametrize("lengths", [[1, 70, 0], [512, 3, 1000]])
def test_flashinfer_new_tokens_equal_the_reference_and_the_split_equals_the_fused(lengths):
    """bf16, Llama head shapes (GQA 4, head_dim 128): FlashInfer's out and natural-log LSE."""
    from tangram_sglang.kernels.new_token_attention import FlashInferNewTokens

    _, q, k, v, qo_indptr, paging = extend_inputs(
        torch.bfloat16, 16, 128, lengths, gqa=4, num_kv_heads=2, seed=5
    )
    new = FlashInferNewTokens(q.device, q.dtype)
    bounds = np.cumsum([0, *lengths]).tolist()
    new.plan(bounds, q.shape[1], k.shape[1], q.shape[2], q.dtype)
    out, lse = new.run(q, k, v, SCALE)
    want_out, want_lse = causal_new_token_reference(q, k, v, bounds, SCALE)
    assert rel_err(out, want_out) < TOL[torch.bfloat16]
    assert rel_err(lse, want_lse) < 1e-3 and math.isfinite(float(lse.sum()))
    split = split_extend(
        new, lambda: _fused(q, k, v, qo_indptr, paging, new_tokens=False), q, k, v, SCALE
    )
    fused = _fused(q, k, v, qo_indptr, paging)
    assert rel_err(split[0], fused[0]) < TOL[torch.bfloat16]
    assert rel_err(split[1], fused[1]) < TOL[torch.bfloat16]


def test_triton_kernels_split_extend_plans_once_per_batch_and_runs_history_when_needed(
    monkeypatch,
):
    """``TritonKernels.extend`` with a new-token attention (the torch one standing in for
    FlashInfer on CPU): planned on each batch's first layer only, the history pass run when
    the plan says some request has history, and equal to the fused kernel either way."""
    from types import SimpleNamespace

    from tangram_sglang.backend import metadata as md
    from tangram_sglang.backend.layer_ops import TritonKernels
    from tangram_sglang.profile import BudgetProfile

    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda d: SimpleNamespace(multi_processor_count=8)
    )
    profile = BudgetProfile.load("calibration/synthetic/llama3.1-8b-ada-snapkv-r0.25.json")
    kernels = TritonKernels(SimpleNamespace(profile=profile), 4, torch.device("cpu"))
    plans = []

    class Counted(TorchNewTokens):
        def plan(self, bounds, *args):
            plans.append(list(bounds))
            super().plan(bounds, *args)

    kernels.new_tokens = Counted()

    def meta_of(qo_indptr, req_rows, any_history, split_new_tokens=False):
        bounds = qo_indptr.tolist()
        return md.TangramForwardMetadata(
            mode=md.EXTEND,
            req_rows=req_rows,
            qo_indptr=qo_indptr,
            bounds=bounds,
            kept_lens=None,
            kept_count=None,
            dest_page=None,
            dest_slot=None,
            max_extend_len=max(np.diff(bounds)),
            any_history=any_history,
            split_new_tokens=split_new_tokens,
        )

    _, q, k, v, qo_indptr, paging = extend_inputs(torch.float32, 16, 64, [1, 70, 0], seed=4)
    meta = meta_of(qo_indptr, paging[4], any_history=True)
    want = _fused(q, k, v, qo_indptr, paging)
    for _ in range(2):  # two layers of one batch
        got = kernels.extend(q, k, v, qo_indptr, *paging, SCALE, meta.max_extend_len, meta=meta)
        assert rel_err(got[0], want[0]) < TOL[torch.float32]
        assert rel_err(got[1], want[1]) < TOL[torch.float32]
    assert plans == [[0, 1, 71, 71]]
    # a first turn (no history anywhere): one new-token pass, a new plan for the new batch
    _, q, k, v, qo_indptr, paging = extend_inputs(torch.float32, 16, 64, [70, 1], seed=6)
    empty = (*paging[:3], torch.zeros_like(paging[3]), *paging[4:])
    meta = meta_of(qo_indptr, paging[4], any_history=False)
    got = kernels.extend(q, k, v, qo_indptr, *empty, SCALE, meta.max_extend_len, meta=meta)
    want = _fused(q, k, v, qo_indptr, empty)
    assert rel_err(got[0], want[0]) < TOL[torch.float32]
    assert rel_err(got[1], want[1]) < TOL[torch.float32]
    assert plans == [[0, 1, 71, 71], [0, 70, 71]]
    # auto: the fused kernel unless the plan says the split pays
    kernels.prefill = "auto"
    _, q, k, v, qo_indptr, paging = extend_inputs(torch.float32, 16, 64, [3, 5], seed=7)
    for split in (False, True):
        meta = meta_of(qo_indptr, paging[4], True, split_new_tokens=split)
        got = kernels.extend(q, k, v, qo_indptr, *paging, SCALE, meta.max_extend_len, meta=meta)
        want = _fused(q, k, v, qo_indptr, paging)
        assert rel_err(got[0], want[0]) < TOL[torch.float32]
        assert rel_err(got[1], want[1]) < TOL[torch.float32]
        assert plans[2:] == ([[0, 3, 8]] if split else [])


def test_auto_prefill_attention_falls_back_to_tangrams_kernel_where_flashinfer_cannot_run(
    monkeypatch,
):
    """``auto`` keeps Tangram's kernel for a float32 pool (FlashInfer's prefill takes none),
    without the flashinfer package and without room for FlashInfer's workspace; an explicit
    ``flashinfer`` refuses all three."""
    from types import SimpleNamespace

    from tangram_sglang.backend.layer_ops import TritonKernels
    from tangram_sglang.errors import ConfigError, KernelError
    from tangram_sglang.kernels import new_token_attention
    from tangram_sglang.profile import BudgetProfile

    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda d: SimpleNamespace(multi_processor_count=8)
    )
    profile = BudgetProfile.load("calibration/synthetic/llama3.1-8b-ada-snapkv-r0.25.json")

    def kernels(dtype, prefill):
        pool = SimpleNamespace(k_pool=torch.zeros(1, dtype=dtype))
        state = SimpleNamespace(profile=profile, memory=SimpleNamespace(kv_pool=pool))
        return TritonKernels(state, 4, torch.device("cpu"), prefill=prefill, history="triton")

    k = kernels(torch.float32, "auto")
    assert k.prefill == "triton" and k.new_tokens is None
    with pytest.raises(ConfigError, match="TANGRAM_PREFILL_ATTENTION=flashinfer .* bfloat16"):
        kernels(torch.float32, "flashinfer")

    class Missing:
        def __init__(self, device, dtype):
            raise KernelError("TANGRAM_PREFILL_ATTENTION=flashinfer needs the flashinfer package")

    monkeypatch.setattr(new_token_attention, "FlashInferNewTokens", Missing)
    k = kernels(torch.bfloat16, "auto")
    assert k.prefill == "triton" and k.new_tokens is None
    with pytest.raises(KernelError, match="needs the flashinfer package"):
        kernels(torch.bfloat16, "flashinfer")

    class NoRoom:  # the KV pool took the memory FlashInfer's workspace needs
        def __init__(self, device, dtype):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 384.00 MiB")

    monkeypatch.setattr(new_token_attention, "FlashInferNewTokens", NoRoom)
    k = kernels(torch.bfloat16, "auto")
    assert k.prefill == "triton" and k.new_tokens is None
    with pytest.raises(torch.OutOfMemoryError):
        kernels(torch.bfloat16, "flashinfer")


def test_flashinfer_new_tokens_refuse_a_float32_model_with_the_fix():
    from tangram_sglang.errors import ConfigError
    from tangram_sglang.kernels.new_token_attention import FlashInferNewTokens

    with pytest.raises(
        ConfigError, match="TANGRAM_PREFILL_ATTENTION=flashinfer .* --dtype bfloat16"
    ):
        FlashInferNewTokens(torch.device("cpu"), torch.float32)


def test_flashinfers_prefill_is_run_once_at_start_up_and_a_failing_one_keeps_tangrams_kernel(
    monkeypatch, caplog
):
    """A JIT FlashInfer builds its prefill module on first use: ``TritonKernels`` runs the
    new-token attention once on a one-token batch at start-up (not inside the first long
    prompt's forward). A FlashInfer whose run raises there leaves ``auto`` on Tangram's kernel
    with the exception in the log, and stops an explicit ``flashinfer`` with the fix."""
    from types import SimpleNamespace

    from tangram_sglang.backend.layer_ops import TritonKernels
    from tangram_sglang.errors import KernelError
    from tangram_sglang.kernels import new_token_attention
    from tangram_sglang.profile import BudgetProfile

    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda d: SimpleNamespace(multi_processor_count=8)
    )
    profile = BudgetProfile.load("calibration/synthetic/llama3.1-8b-ada-snapkv-r0.25.json")
    m = profile.model
    runs = []

    class Recorded(TorchNewTokens):
        def __init__(self, device, dtype):
            super().__init__()
            self.workspace = None

        def run(self, q, k, v, sm_scale):
            runs.append((self.bounds, tuple(q.shape), tuple(k.shape), q.dtype, sm_scale))
            return super().run(q, k, v, sm_scale)

    def kernels(prefill):
        pool = SimpleNamespace(k_pool=torch.zeros(1, dtype=torch.bfloat16))
        state = SimpleNamespace(profile=profile, memory=SimpleNamespace(kv_pool=pool))
        return TritonKernels(state, 4, torch.device("cpu"), prefill=prefill, history="triton")

    monkeypatch.setattr(new_token_attention, "FlashInferNewTokens", Recorded)
    k = kernels("auto")
    assert k.prefill == "auto" and isinstance(k.new_tokens, Recorded)
    assert runs == [
        (
            [0, 1],
            (1, m.num_qo_heads, m.head_dim),
            (1, m.num_kv_heads, m.head_dim),
            torch.bfloat16,
            m.head_dim**-0.5,
        )
    ]

    class Broken(Recorded):
        def run(self, q, k, v, sm_scale):
            raise RuntimeError("ninja: build stopped")

    monkeypatch.setattr(new_token_attention, "FlashInferNewTokens", Broken)
    with caplog.at_level("WARNING"):
        k = kernels("auto")
    assert k.prefill == "triton" and k.new_tokens is None
    assert "failed its start-up run (RuntimeError: ninja: build stopped)" in caplog.text
    with pytest.raises(KernelError, match="=flashinfer: FlashInfer's prefill failed its start-up"):
        kernels("flashinfer")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashInfer's prefill needs CUDA")
def test_flashinfers_start_up_runs_pass_on_the_gpu():
    from tangram_sglang.backend.layer_ops import warm_up_new_tokens
    from tangram_sglang.kernels.history_attention import FlashInferPagedHistory
    from tangram_sglang.kernels.new_token_attention import FlashInferNewTokens
    from tangram_sglang.profile import BudgetProfile

    profile = BudgetProfile.load("calibration/synthetic/llama3.1-8b-ada-snapkv-r0.25.json")
    m = profile.model
    new = FlashInferNewTokens(torch.device("cuda"), torch.bfloat16)
    assert warm_up_new_tokens(new, m, torch.bfloat16, torch.device("cuda"))
    history = FlashInferPagedHistory(new.workspace, torch.bfloat16)
    assert history.warm_up(m.num_qo_heads, m.num_kv_heads, m.head_dim) and history.usable


def test_no_room_for_flashinfers_start_up_run_keeps_tangrams_kernel_under_auto(monkeypatch):
    """An out-of-memory in the start-up run is treated like one in FlashInfer's workspace: ``auto``
    keeps Tangram's kernel, an explicit ``flashinfer`` stops with the error."""
    from types import SimpleNamespace

    from tangram_sglang.backend.layer_ops import TritonKernels
    from tangram_sglang.kernels import new_token_attention
    from tangram_sglang.profile import BudgetProfile

    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda d: SimpleNamespace(multi_processor_count=8)
    )
    profile = BudgetProfile.load("calibration/synthetic/llama3.1-8b-ada-snapkv-r0.25.json")

    class Full(TorchNewTokens):
        def __init__(self, device, dtype):
            super().__init__()

        def run(self, q, k, v, sm_scale):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")

    def kernels(prefill, history="triton"):
        pool = SimpleNamespace(k_pool=torch.zeros(1, dtype=torch.bfloat16))
        state = SimpleNamespace(profile=profile, memory=SimpleNamespace(kv_pool=pool))
        return TritonKernels(state, 4, torch.device("cpu"), prefill=prefill, history=history)

    monkeypatch.setattr(new_token_attention, "FlashInferNewTokens", Full)
    k = kernels("auto", history="flashinfer")
    assert k.prefill == "triton" and k.new_tokens is None and not k.plans_paged_history
    with pytest.raises(torch.OutOfMemoryError):
        kernels("flashinfer")
