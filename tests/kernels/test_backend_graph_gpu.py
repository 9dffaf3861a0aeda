"""The backend's CUDA-graph decode plan on a GPU (run on the device: ``pytest -m gpu``).

One decode step as ``TangramAttnBackend.forward_decode`` runs it (new token's K/V into its group
slots, then the AOT-split ragged decode), captured in a ``torch.cuda.CUDAGraph`` over the views
of :class:`~tangram_sglang.backend.metadata.DecodeGraphBuffers` while every entry is padding
(SGLang's capture), then replayed for real batches of different rows and lengths refilled in
place (SGLang's replay): the real entries match the torch reference, padded entries are zeros.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from factories import make_profile

from tangram_sglang.backend import metadata as md
from tangram_sglang.backend.state import TangramState
from tangram_sglang.kernels.decode_attention import (
    BLOCK_N,
    decode_scratch,
    ragged_decode_attention,
)
from tangram_sglang.kernels.reference import decode_reference
from tangram_sglang.kernels.split_table import build_split_tables, fitted_splits
from tangram_sglang.mem.manager import TangramMemory

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

DEV = torch.device("cuda")
PAGE, HQ, HKV, D, BS, LAYER = 16, 8, 4, 64, 4, 1


def make_state() -> TangramState:
    ratio = np.array([[1.0, 0.5, 0.3, 0.1], [0.8, 0.25, 0.6, 0.05]])
    profile = make_profile(
        ratio, 2, "global", sink_tokens=4, recent_window=16, head_dim=D, gqa_size=HQ // HKV
    )
    mem = TangramMemory.create(
        profile,
        memory_bytes=64 << 20,
        page_size=PAGE,
        max_rows=8,
        max_context_tokens=2048,
        dtype=torch.bfloat16,
        device=DEV,
    )
    state = TangramState(mem, full_kv_bytes_per_token=2 * 2 * HKV * D * 2, device=DEV)
    for row, n in ((1, 300), (2, 45), (3, 700)):
        state.allocate_extend([row], [n], [0])
    mem.kv_pool.k_pool.normal_()
    mem.kv_pool.v_pool.normal_()
    return state


@pytest.mark.parametrize("plan", ["table", "batch"])
def test_decode_step_captured_on_padding_replays_real_batches(plan):
    """Under ``batch`` each replay reads the floors its fill uploaded (the step's lengths): on a
    launch budget of one SM the floor binds, and the split slots stage 1 writes match the numpy
    twin with that step's floor."""
    state = make_state()
    mem = state.memory
    pools = (mem.kv_pool.k_pool, mem.kv_pool.v_pool, mem.table.page_table, mem.table.group_len)
    goh, coh = state.group_of_head[LAYER], state.column_of_head[LAYER]
    profile = state.profile
    # batch: one SM's launch budget (12 CTAs), so the floor, not the row budget, sets the chunk
    sms = 1 if plan == "batch" else torch.cuda.get_device_properties(0).multi_processor_count
    tables = build_split_tables(profile.grouping, profile.group_ratios, sms, 8).to(DEV)
    mid_o, mid_lse = decode_scratch(8, HQ, tables.scratch_splits, D, DEV)
    buf = md.DecodeGraphBuffers.create(
        8, mem.num_head_groups, HQ, D, torch.bfloat16, DEV, num_layers=profile.model.num_layers
    )
    heads_of_layer = md.heads_per_group_of_layer(profile.grouping.cluster_of, mem.num_head_groups)
    launch = tables.tables[0].launch_ctas

    def floors(rows):
        if plan != "batch":
            return None
        return md.decode_chunk_floors(
            mem.table.lens, np.asarray(rows, np.int64), heads_of_layer, launch
        )

    q = torch.zeros(BS, HQ, D, dtype=torch.bfloat16, device=DEV)
    k = torch.zeros(BS, HKV, D, dtype=torch.bfloat16, device=DEV)
    v = torch.zeros_like(k)

    def step(meta):
        md.write_decode_token(pools[0], pools[1], k, v, meta, goh, coh)
        return ragged_decode_attention(
            q,
            *pools,
            meta.req_rows,
            goh,
            coh,
            tables.for_batch(BS).layer(LAYER),
            0.125,
            meta.out,
            mid_o,
            mid_lse,
            plan,
            None if meta.chunk_floor is None else meta.chunk_floor[LAYER],
        )

    # capture: all padding
    meta = buf.fill([], BS, mem.table.pages, mem.table.lens, PAGE, chunk_floor=floors([]))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(meta)  # warm-up (Triton compiles outside the capture)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(meta)
    for rows, lens in (([1, 3], [301, 701]), ([2], [46]), ([3, 2, 1], [702, 47, 302])):
        state.allocate_decode(rows, lens)  # host: pages for the new token (outside the graph)
        buf.fill(rows, BS, mem.table.pages, mem.table.lens, PAGE, chunk_floor=floors(rows))
        if plan == "batch":
            assert buf.chunk_floor.tolist() == floors(rows).tolist()
        for t in (q, k, v):
            t.copy_(torch.randn_like(t, dtype=torch.float32))
        mid_lse.fill_(float("nan"))  # poisoned: stage 1 writes only its splits' slots
        graph.replay()
        torch.cuda.synchronize()
        n = len(rows)
        if plan == "batch":
            head_lens = mem.table.lens[rows][:, profile.grouping.cluster_of[LAYER]]
            view = tables.for_batch(BS).layer(LAYER)
            floor = int(floors(rows)[LAYER])
            assert floor > -(-int(head_lens.sum(axis=1).max()) // view.batch_budget)  # binds
            twin = fitted_splits(head_lens, view.batch_budget, view.batch_cap, BLOCK_N, floor)[0]
            written = (~mid_lse[:n].isnan()).sum(dim=2).cpu().numpy()
            assert (written == np.repeat(twin, HQ // HKV, axis=1)).all(), "kernel != numpy twin"
        want = decode_reference(
            q[:n].float(),
            pools[0].float(),
            pools[1].float(),
            *pools[2:],
            buf.req_rows[:n],
            goh,
            coh,
            0.125,
        )
        torch.testing.assert_close(out[:n].float(), want, atol=2e-2, rtol=2e-2)
        assert out[n:].abs().sum().item() == 0  # padded entries read row 0: zeros, not NaN
        assert torch.isfinite(out).all()
