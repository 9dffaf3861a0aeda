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
    new = FlashInferNewTokens(q.device)
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
