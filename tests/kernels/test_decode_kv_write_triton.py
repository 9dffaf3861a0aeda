"""Triton decode-token K/V write (one launch per layer) against the torch path, on CPU too.

The torch path (``backend.metadata.write_decode_token``) is the oracle: both write the same
pool elements, for K/V given as strided views of one fused QKV tensor (no copies), padded batch
entries included (page 0, slot 0).
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE

from tangram_sglang.backend import metadata as md
from tangram_sglang.errors import KernelError
from tangram_sglang.kernels.decode_kv_write import write_decode_kv

DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def decode_case(dtype, bs=5, num_kv_heads=4, num_groups=3, h_p=2, page_size=8, head_dim=32):
    gen = torch.Generator().manual_seed(7)
    num_pages = 1 + bs * num_groups
    pools = [
        torch.randn(num_pages, h_p, page_size, head_dim, generator=gen).to(dtype).to(DEVICE)
        for _ in range(2)
    ]
    goh = torch.tensor([0, 2, 1, 2], dtype=torch.int32, device=DEVICE)[:num_kv_heads]
    coh = torch.tensor([0, 0, 1, 1], dtype=torch.int32, device=DEVICE)[:num_kv_heads]
    # Distinct (page, slot) per group and entry; the last entry is CUDA-graph padding.
    page = torch.randperm(num_pages - 1, generator=gen)[: bs * num_groups].view(bs, num_groups) + 1
    slot = torch.randint(0, page_size, (bs, num_groups), generator=gen)
    page[-1], slot[-1] = 0, 0
    q_width, kv_width = 8 * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(bs, q_width + 2 * kv_width, generator=gen).to(dtype).to(DEVICE)
    k = qkv[:, q_width : q_width + kv_width].view(bs, num_kv_heads, head_dim)
    v = qkv[:, q_width + kv_width :].view(bs, num_kv_heads, head_dim)
    return pools, k, v, page.to(DEVICE), slot.to(DEVICE), goh, coh


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=DTYPE_IDS.get)
def test_one_launch_writes_what_the_torch_path_writes(dtype):
    (k_pool, v_pool), k, v, page, slot, goh, coh = decode_case(dtype)
    assert not k.is_contiguous()  # strided views of the fused QKV output
    want_k, want_v = k_pool.clone(), v_pool.clone()
    plan = md.TangramForwardMetadata(
        mode=md.DECODE,
        req_rows=torch.zeros(k.shape[0], dtype=torch.int32),
        qo_indptr=None,
        bounds=[],
        kept_lens=None,
        kept_count=None,
        dest_page=page,
        dest_slot=slot,
        max_extend_len=0,
    )
    md.write_decode_token(want_k, want_v, k, v, plan, goh, coh)
    write_decode_kv(k, v, k_pool, v_pool, page, slot, goh, coh)
    # Page 0 is the padding page: the padded entry's heads all write its slot 0, in an order
    # neither path fixes on a GPU (its content is never read), so it is left out of the check.
    assert torch.equal(k_pool[1:], want_k[1:]) and torch.equal(v_pool[1:], want_v[1:])
    assert not torch.equal(want_k, decode_case(dtype)[0][0])  # something was written


def test_bad_arguments_name_the_field():
    (k_pool, v_pool), k, v, page, slot, goh, coh = decode_case(torch.float32)
    with pytest.raises(KernelError, match="dest_slot"):
        write_decode_kv(k, v, k_pool, v_pool, page, slot.to(torch.int32), goh, coh)
    with pytest.raises(KernelError, match="k has dtype"):
        write_decode_kv(k.half(), v, k_pool, v_pool, page, slot, goh, coh)
