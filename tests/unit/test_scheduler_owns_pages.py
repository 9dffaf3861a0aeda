"""The scheduler owns the pages; the attention backend only reads them.

``TangramState.allocate_extend`` / ``allocate_decode`` run when SGLang schedules a batch
(``alloc_for_extend`` / ``alloc_for_decode``): they allocate the batch's pages and advance each
head group's kept length at once. The backend's plan reads the lengths before an extend segment
from the scheduler's plan (``extend_plan_for`` -> ``metadata.hist_len``), runs the deferred
copy-on-write copies, and uploads the page-table deltas. These tests drive that split on the
reference kernels, and the overlap-scheduling order in which a finished row is released and
reused while the batch that still reads it is in flight.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tangram_sglang.backend import metadata as md
from tangram_sglang.backend.compress import batch_kept_indices
from tangram_sglang.backend.state import TangramState
from tangram_sglang.errors import KernelError
from tangram_sglang.grouping import HeadGrouping
from tangram_sglang.kernels import reference
from tangram_sglang.mem.manager import TangramMemory
from tangram_sglang.mem.prefix import PrefixMatch
from tangram_sglang.profile import BudgetProfile, ModelIdentity

PAGE = 4
D = 16
MODEL = ModelIdentity("LlamaForCausalLM", num_layers=2, num_kv_heads=2, num_qo_heads=4, head_dim=D)


def make_state(ratio: float = 1.0, num_pages: int = 64, deferred: bool = True) -> TangramState:
    ratios = np.full((2, 2), ratio)
    profile = BudgetProfile(
        model=MODEL,
        scorer="snapkv",
        target_ratio=ratio,
        ratio=ratios,
        sink_tokens=1,
        recent_window=2,
        grouping=HeadGrouping.build(ratios, 2, "global"),
        provenance={"scorer_options": {"obs_window": 3, "kernel_size": 1}},
    )
    mem = TangramMemory.create(
        profile,
        memory_bytes=num_pages * 2 * 2 * PAGE * D * 4,
        page_size=PAGE,
        max_rows=4,
        max_context_tokens=256,
        dtype=torch.float32,
    )
    mem.table.deferred = deferred  # as the attention backend sets them
    mem.defer_copies = deferred
    return TangramState(mem, full_kv_bytes_per_token=2 * 2 * 2 * D * 4, device="cpu")


def test_allocate_extend_advances_the_lengths_at_schedule_time():
    state = make_state(ratio=0.5)
    table = state.memory.table
    first = state.allocate_extend([1], [9], [0])
    assert first.start_lens.tolist() == [[0, 0]]
    assert table.lens[1].tolist() == first.kept_lens[0].tolist()  # no commit step left
    second = state.allocate_extend([1], [6], [9])  # the next chunk of a chunked prefill
    assert second.start_lens[0].tolist() == first.kept_lens[0].tolist()
    assert table.lens[1].tolist() == (first.kept_lens[0] + second.kept_lens[0]).tolist()
    start, kept = state.extend_plan_for(np.array([1]), [6])
    assert start.tolist() == second.start_lens.tolist()
    assert kept.tolist() == second.kept_lens.tolist()
    state.allocate_decode([1], [16])
    assert table.lens[1].tolist() == (first.kept_lens[0] + second.kept_lens[0] + 1).tolist()
    state.release(1)
    with pytest.raises(KernelError, match="alloc_for_extend hook"):
        state.extend_plan_for(np.array([1]), [6])  # the row's plan left with the row


def test_the_backend_plan_names_a_batch_the_scheduler_did_not_allocate():
    state = make_state()
    state.allocate_extend([2], [5], [0])
    with pytest.raises(KernelError, match=r"row 2 extends 7 tokens .* allocated 5 tokens"):
        state.extend_plan_for(np.array([2]), [7])
    with pytest.raises(KernelError, match="allocated none"):
        state.extend_plan_for(np.array([3]), [4])


def _extend(state: TangramState, rows, lens, prefix, q, k, v, layer: int = 1) -> torch.Tensor:
    """Schedule (allocate) then run one extend layer as the backend does: plan, attend, write."""
    mem = state.memory
    plan = state.allocate_extend(rows, lens, prefix)
    mem.run_copies()
    meta = md.extend_metadata(
        rows,
        lens,
        plan.kept_lens,
        "cpu",
        state.profile.grouping.cluster_of,
        upload=mem.table.flush,
        start_lens=plan.start_lens,
        hist_len=torch.zeros_like(mem.table.group_len),
    )
    goh, coh = state.group_of_head[layer], state.column_of_head[layer]
    pools = (mem.kv_pool.k_pool, mem.kv_pool.v_pool, mem.table.page_table, meta.hist_len)
    out, lse = reference.extend_reference(
        q, k, v, meta.qo_indptr, *pools, meta.req_rows, goh, coh, 0.35
    )
    per_head, dev = meta.layer_kept(layer, state.profile.grouping.cluster_of[layer])
    p = state.profile
    kept = batch_kept_indices(
        state.scorer, q, k, lse, meta.bounds, per_head, 0.35, p.sink_tokens, p.recent_window, dev
    )
    reference.kv_write_reference(
        k, v, meta.qo_indptr, kept, meta.kept_count, *pools, meta.req_rows, goh, coh
    )
    return out


def causal_attention(q, k, v, start: int) -> torch.Tensor:
    """Oracle: ``[n, H_q, D]`` causal GQA softmax attention of queries at ``start + i``."""
    gqa = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for i in range(q.shape[0]):
        for hq in range(q.shape[1]):
            keys, vals = k[: start + i + 1, hq // gqa], v[: start + i + 1, hq // gqa]
            out[i, hq] = torch.softmax(q[i, hq] @ keys.T * 0.35, dim=-1) @ vals
    return out


def test_a_chunked_prefill_attends_to_the_history_the_scheduler_planned():
    """Ratio 1.0 keeps every token: chunk 2 must attend to all of chunk 1 (the lengths before
    its segment), though the scheduler already counted chunk 2 in the live lengths."""
    torch.manual_seed(0)
    state = make_state(ratio=1.0)
    n1, n2 = 9, 6
    q, k, v = torch.randn(n1 + n2, 4, D), torch.randn(n1 + n2, 2, D), torch.randn(n1 + n2, 2, D)
    _extend(state, [1], [n1], [0], q[:n1], k[:n1], v[:n1])
    out = _extend(state, [1], [n2], [n1], q[n1:], k[n1:], v[n1:])
    torch.testing.assert_close(out, causal_attention(q[n1:], k, v, n1))
    mem = state.memory
    assert mem.table.group_len[1].tolist() == [n1 + n2] * 2  # flushed: the advanced lengths
    col = state.column_of_head[1]
    for h, g in enumerate(state.group_of_head[1].tolist()):
        pages = mem.group_pages(1, g)
        held = mem.kv_pool.k_pool[pages, int(col[h])].reshape(-1, D)[: n1 + n2]
        torch.testing.assert_close(held, k[:, h])  # chunk 2 went after chunk 1, in order


def test_copy_on_write_waits_for_the_batch_plan():
    """A shared partial tail page is copied when the backend plans the batch, not when the
    scheduler allocates (the fresh page's last owner may still be written by the batch in
    flight under overlap scheduling)."""
    state = make_state(ratio=1.0)
    mem = state.memory
    state.allocate_extend([1], [9], [0])  # 9 tokens: a partial third page per group
    mem.table.flush()
    mem.kv_pool.k_pool.normal_()
    mem.kv_pool.v_pool.normal_()
    segments = mem.finish(1)  # a radix node now holds the pages
    lens = np.array([9, 9])
    match = PrefixMatch([np.concatenate([s.pages[g] for s in segments]) for g in range(2)], lens)
    tails = [int(p[-1]) for p in match.pages]
    mem.admit(2, "turn2", 3, 0, prefix=match)
    plan = mem.alloc_extend(2, 3)
    mem.commit_extend(2)
    assert plan.cow_src.tolist() == tails and len(mem._copies) == 1
    fresh = plan.cow_dst.tolist()
    assert all(mem.kv_pool.k_pool[p].abs().sum() != 0 for p in fresh)  # untouched so far
    before = [mem.kv_pool.k_pool[p].clone() for p in fresh]
    assert mem.run_copies() == 2 and mem.run_copies() == 0
    for src, dst, old in zip(tails, fresh, before, strict=True):
        torch.testing.assert_close(mem.kv_pool.k_pool[dst, :, :1], mem.kv_pool.k_pool[src, :, :1])
        torch.testing.assert_close(mem.kv_pool.k_pool[dst, :, 1:], old[:, 1:])  # only filled


def test_a_row_released_and_reused_does_not_disturb_the_batch_in_flight():
    """Overlap scheduling's order: batch N+1 is scheduled and planned while batch N runs; a
    request that finished in N is still in N+1; its row is released while N+1 is in flight,
    and the next request takes the row and its pages when N+2 is scheduled."""
    state = make_state(ratio=0.5, num_pages=10)  # small: B must take pages A released
    mem, table = state.memory, state.memory.table
    state.allocate_extend([1], [9], [0])  # request A on row 1
    state.allocate_extend([2], [7], [0])  # request C on row 2, decoding next to A
    table.flush()
    rows = np.array([1, 2])
    state.allocate_decode(rows, [10, 8])  # batch N (A's last token is sampled here)
    md.decode_metadata(rows, table.pages, table.lens, PAGE, "cpu", table.flush)
    state.allocate_decode(rows, [11, 9])  # batch N+1: scheduled before N's results
    plan_n1 = md.decode_metadata(rows, table.pages, table.lens, PAGE, "cpu", table.flush)
    in_flight = table.page_table.clone(), table.group_len.clone()
    dest = plan_n1.dest_page.clone(), plan_n1.dest_slot.clone()
    a_pages = set(np.concatenate([mem.group_pages(1, g) for g in range(2)]).tolist())

    free_before = mem.allocator.num_free()
    state.release(1)  # N's results: A finished; its pages go back while N+1 runs
    assert mem.allocator.num_free() == free_before + len(a_pages)
    assert torch.equal(table.page_table, in_flight[0])  # N+1 still reads A's row as it was
    assert torch.equal(table.group_len, in_flight[1])

    b = state.allocate_extend([1], [13], [0])  # batch N+2: request B takes row 1
    state.allocate_decode([2], [10])
    b_pages = set(np.concatenate([mem.group_pages(1, g) for g in range(2)]).tolist())
    assert b_pages & a_pages, "B reuses pages A released"
    assert torch.equal(table.page_table, in_flight[0])  # nothing reaches the device before
    assert torch.equal(plan_n1.dest_page, dest[0]) and torch.equal(plan_n1.dest_slot, dest[1])
    mem.run_copies()
    md.extend_metadata(
        [1],
        [13],
        b.kept_lens,
        "cpu",
        upload=table.flush,
        start_lens=b.start_lens,
        hist_len=torch.zeros_like(table.group_len),
    )  # N+2's plan: the deltas of B's row and C's step, in stream order after N+1
    for g in range(2):
        n = table.num_pages[1, g]
        assert table.page_table[1, g, :n].tolist() == table.pages[1, g, :n].tolist()
        assert table.page_table[1, g, n:].abs().sum() == 0  # A's longer table is gone
    assert table.group_len[1].tolist() == b.kept_lens[0].tolist()
    assert table.group_len[2].tolist() == table.lens[2].tolist()
    state.release(1)
    state.release(2)
    assert mem.allocator.num_used() == 0
    mem.check_invariants()
