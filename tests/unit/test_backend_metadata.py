"""Backend pieces without SGLang: per-batch metadata, kept-token choice, TangramState lifecycle."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tangram_sglang.backend import metadata as md
from tangram_sglang.backend.compress import batch_kept_indices
from tangram_sglang.backend.state import (
    RowRecord,
    TangramState,
    build_scorer,
    chunked_footprint_pages,
)
from tangram_sglang.errors import KernelError
from tangram_sglang.grouping import HeadGrouping
from tangram_sglang.kernels import reference
from tangram_sglang.mem.manager import TangramMemory
from tangram_sglang.profile import BudgetProfile, ModelIdentity
from tangram_sglang.scoring.select import select_kept

PAGE = 4
MODEL = ModelIdentity("LlamaForCausalLM", num_layers=2, num_kv_heads=2, num_qo_heads=4, head_dim=16)
RATIOS = np.array([[1.0, 0.5], [0.25, 0.5]])


def make_profile(ratio=RATIOS, sink=1, window=2) -> BudgetProfile:
    return BudgetProfile(
        model=MODEL,
        scorer="snapkv",
        target_ratio=0.5,
        ratio=np.asarray(ratio, float),
        sink_tokens=sink,
        recent_window=window,
        grouping=HeadGrouping.build(np.asarray(ratio, float), 2, "global"),
        provenance={"scorer_options": {"obs_window": 3, "kernel_size": 1}},
    )


def make_state(profile=None, num_pages=64, max_rows=4) -> TangramState:
    profile = profile or make_profile()
    mem = TangramMemory.create(
        profile,
        memory_bytes=num_pages * 2 * 2 * PAGE * 16 * 4,
        page_size=PAGE,
        max_rows=max_rows,
        max_context_tokens=256,
        dtype=torch.float32,
    )
    return TangramState(mem, full_kv_bytes_per_token=2 * 2 * 2 * 16 * 4, device="cpu")


def test_extend_metadata_builds_indptr_and_counts_once():
    kept = np.array([[5, 3], [2, 1]])
    meta = md.extend_metadata([3, 1], [7, 2], kept, "cpu")
    assert meta.mode == md.EXTEND and meta.batch_size == 2
    assert meta.bounds == [0, 7, 9]
    assert meta.qo_indptr.tolist() == [0, 7, 9] and meta.qo_indptr.dtype == torch.int32
    assert meta.req_rows.tolist() == [3, 1] and meta.req_rows.dtype == torch.int32
    assert meta.kept_count.tolist() == kept.tolist() and meta.kept_count.dtype == torch.int32
    assert meta.max_extend_len == 7
    assert meta.layer_kept(0, np.array([1, 0]))[0].tolist() == [[3, 5], [1, 2]]


def test_decode_metadata_points_at_the_new_token_slot():
    pages = np.zeros((3, 2, 4), np.int64)
    pages[2, 0, :2], pages[2, 1, :1] = [7, 9], [4]
    lens = np.zeros((3, 2), np.int64)
    lens[2] = [5, 4]  # including the new token
    meta = md.decode_metadata([2], pages, lens, PAGE, "cpu")
    assert meta.dest_page.tolist() == [[9, 4]]
    assert meta.dest_slot.tolist() == [[0, 3]]


def test_ratio_one_keeps_the_whole_segment_without_scoring():
    scorer = build_scorer(make_profile())
    q, k = torch.randn(6, 4, 16), torch.randn(6, 2, 16)
    idx = batch_kept_indices(scorer, q, k, torch.zeros(6, 4), [0, 6], [[6, 6]], 0.35, 1, 2)[0]
    assert idx.tolist() == [list(range(6))] * 2


def test_each_head_keeps_its_own_top_k():
    scorer = build_scorer(make_profile())
    assert scorer.obs_window == 3 and scorer.kernel_size == 1  # calibration options
    q, k = torch.randn(10, 4, 16), torch.randn(10, 2, 16)
    lse = torch.randn(10, 4)
    idx = batch_kept_indices(scorer, q, k, lse, [0, 10], [[4, 7]], 0.35, 1, 2)[0]
    scores = scorer.score(q[7:].transpose(0, 1), k.transpose(0, 1), 0.35, lse[7:].transpose(0, 1))
    assert idx.shape == (2, 7)
    assert idx[0, :4].tolist() == select_kept(scores[:1], 4, 1, 2)[0].tolist()
    assert idx[1].tolist() == select_kept(scores[1:], 7, 1, 2)[0].tolist()
    assert idx[0, 4:].tolist() == [0, 0, 0]  # padding past k
    for h, kh in enumerate([4, 7]):
        assert {0, 8, 9} <= set(idx[h, :kh].tolist())  # sink and window survive


def test_batch_kept_indices_pads_per_request():
    scorer = build_scorer(make_profile())
    q, k, lse = torch.randn(9, 4, 16), torch.randn(9, 2, 16), torch.zeros(9, 4)
    out = batch_kept_indices(scorer, q, k, lse, [0, 3, 9], [[3, 3], [6, 4]], 0.35, 1, 2)
    assert out.shape == (2, 2, 6)
    assert out[0, :, :3].tolist() == [[0, 1, 2]] * 2 and out[1, 0].tolist() == list(range(6))


def test_state_lifecycle_pages_match_the_footprint_and_return():
    state = make_state()
    start = state.memory.allocator.num_free()
    plan = state.allocate_extend([1], [9], [0])  # first chunk
    assert plan.kept_lens.tolist() == [state.profile.group_kept_lens(9)]
    assert plan.start_lens.tolist() == [[0] * state.memory.num_head_groups]
    assert state.memory.table.lens[1].tolist() == plan.kept_lens[0].tolist()  # advanced now
    state.allocate_extend([1], [5], [9])  # second chunk of a chunked prefill: admit_chunk
    for step in range(3):
        state.allocate_decode([1], [15 + step])
    used = start - state.memory.allocator.num_free()
    assert used == chunked_footprint_pages(state.profile, PAGE, 14, 4, 9)
    assert state.pool_info()["live_logical_tokens"] == 17
    record = state.release(1)
    assert record.pages == used and record.logical_tokens == 17
    assert record.bytes_held == used * state.memory.bytes_per_page
    assert record.borrowed_pages == 0  # no cached prefix
    want = used * state.memory.bytes_per_page / (17 * state.full_kv_bytes_per_token)
    assert record.to_dict()["held_fraction"] == pytest.approx(want)
    assert state.memory.allocator.num_free() == start
    assert state.release(1) is None  # already free
    info = state.pool_info()
    assert info["pages_free"] == info["pages_free_at_start"] and info["requests_released"] == 1


def test_release_record_compares_every_page_read_with_full_kv_of_all_tokens():
    # 2 own pages of 1,000 bytes and 3 borrowed from the radix tree, 10,000 bytes of full KV
    record = RowRecord(
        7, 100, pages=2, borrowed_pages=3, bytes_per_page=1_000, full_kv_bytes=10_000
    )
    out = record.to_dict()
    assert out["pages"] == 2 and out["borrowed_pages"] == 3 and out["bytes_held"] == 2_000
    assert out["held_fraction"] == pytest.approx(0.5)
    # a request that wrote no page of its own still reads its borrowed prefix
    only_borrowed = RowRecord(7, 100, 0, 3, 1_000, 10_000).to_dict()
    assert only_borrowed["bytes_held"] == 0 and only_borrowed["held_fraction"] == pytest.approx(0.3)
    assert RowRecord(7, 0, 0, 0, 1_000, 0).to_dict()["held_fraction"] == 0.0


def test_extend_plan_says_whether_any_request_has_history():
    """``any_history``: from the host's start lengths (a later chunk has history, a first one
    none); without them the live lengths are the history, so it must be assumed."""
    state = make_state()
    first = state.allocate_extend([1, 2], [9, 4], [0, 0])
    hist = torch.zeros_like(state.memory.table.group_len)
    meta = md.extend_metadata(
        [1, 2], [9, 4], first.kept_lens, "cpu", start_lens=first.start_lens, hist_len=hist
    )
    assert not meta.any_history
    later = state.allocate_extend([1, 3], [5, 6], [9, 0])  # row 1's second chunk, row 3 new
    meta = md.extend_metadata(
        [1, 3], [5, 6], later.kept_lens, "cpu", start_lens=later.start_lens, hist_len=hist
    )
    assert meta.any_history
    assert md.extend_metadata([3], [6], later.kept_lens[1:], "cpu").any_history


def test_split_pays_without_history_or_for_long_new_segments():
    """The rule TANGRAM_PREFILL_ATTENTION=auto splits by: no history, or a mean of at least
    SPLIT_MIN_CAUSAL_PAIRS_PER_TOKEN causal pairs per new token (sum n(n+1)/2 >= C * sum n)."""
    c = md.SPLIT_MIN_CAUSAL_PAIRS_PER_TOKEN
    assert md.split_pays([8192], no_history=True)  # a first turn: no second pass at all
    assert md.split_pays([1, 3], no_history=True)
    assert not md.split_pays([128] * 64, no_history=False)  # short turns over histories
    assert md.split_pays([8192], no_history=False)  # a long prompt's second chunk
    n = 2 * c - 1  # the boundary: n (n + 1) / 2 == c * n
    assert md.split_pays([n], no_history=False)
    assert not md.split_pays([n - 1], no_history=False)
    # a batch: one long segment outweighs many short ones, or does not
    assert md.split_pays([8192, 10, 10], no_history=False)
    assert not md.split_pays([2048] + [100] * 64, no_history=False)


def test_extend_plan_says_whether_to_split():
    """From the host's start lengths; without them the history is unknown (assumed there)."""
    state = make_state()
    hist = torch.zeros_like(state.memory.table.group_len)
    first = state.allocate_extend([1, 2], [9, 4], [0, 0])
    meta = md.extend_metadata(
        [1, 2], [9, 4], first.kept_lens, "cpu", start_lens=first.start_lens, hist_len=hist
    )
    assert meta.split_new_tokens
    later = state.allocate_extend([1], [1], [9])  # one token over row 1's kept history
    meta = md.extend_metadata(
        [1], [1], later.kept_lens, "cpu", start_lens=later.start_lens, hist_len=hist
    )
    assert later.start_lens.sum() > 1 and not meta.split_new_tokens
    assert not md.extend_metadata([3], [6], later.kept_lens, "cpu").split_new_tokens


def test_reused_row_without_release_is_freed_first():
    state = make_state()
    start = state.memory.allocator.num_free()
    state.allocate_extend([2], [6], [0])
    state.allocate_extend([2], [3], [0])  # a new request on the same row (prefix 0)
    state.release(2)
    assert state.memory.allocator.num_free() == start


@pytest.mark.parametrize("ratio", [1.0, 0.5], ids=["ratio1", "ratio0.5"])
def test_extend_then_decode_matches_attention_over_the_kept_tokens(ratio):
    """The backend's per-layer flow (extend, keep, write, decode) on the reference kernels."""
    profile = make_profile(ratio=np.full((2, 2), ratio), sink=1, window=2)
    state = make_state(profile)
    n, layer = 12, 1
    q, k, v = torch.randn(n, 4, 16), torch.randn(n, 2, 16), torch.randn(n, 2, 16)
    plan = state.allocate_extend([1], [n], [0])
    hist = torch.zeros_like(state.memory.table.group_len)
    meta = md.extend_metadata(
        [1], [n], plan.kept_lens, "cpu", start_lens=plan.start_lens, hist_len=hist
    )
    mem, goh, coh = state.memory, state.group_of_head[layer], state.column_of_head[layer]
    assert meta.hist_len[1].tolist() == [0, 0]  # the live lengths already include k_g
    assert not meta.any_history  # a first segment: a split extend launches no history pass
    hist = (mem.kv_pool.k_pool, mem.kv_pool.v_pool, mem.table.page_table, meta.hist_len)
    pools = (mem.kv_pool.k_pool, mem.kv_pool.v_pool, mem.table.page_table, mem.table.group_len)
    out, lse = reference.extend_reference(
        q, k, v, meta.qo_indptr, *hist, meta.req_rows, goh, coh, 0.35
    )
    per_head, _ = meta.layer_kept(layer, profile.grouping.cluster_of[layer])
    kept = batch_kept_indices(state.scorer, q, k, lse, meta.bounds, per_head, 0.35, 1, 2)
    reference.kv_write_reference(
        k, v, meta.qo_indptr, kept, meta.kept_count, *hist, meta.req_rows, goh, coh
    )
    state.allocate_decode([1], [n + 1])
    dmeta = md.decode_metadata([1], mem.table.pages, mem.table.lens, PAGE, "cpu")
    qd, kd, vd = torch.randn(1, 4, 16), torch.randn(1, 2, 16), torch.randn(1, 2, 16)
    md.write_decode_token(mem.kv_pool.k_pool, mem.kv_pool.v_pool, kd, vd, dmeta, goh, coh)
    got = reference.decode_reference(qd, *pools, dmeta.req_rows, goh, coh, 0.35)
    for h in range(2):  # oracle: plain softmax attention over the head's kept tokens + new one
        count = int(per_head[0][h])
        sel = kept[0, h, :count]
        keys = torch.cat([k[sel, h], kd[:, h]])
        vals = torch.cat([v[sel, h], vd[:, h]])
        probs = torch.softmax(qd[0, 2 * h : 2 * h + 2] @ keys.T * 0.35, dim=-1)
        torch.testing.assert_close(got[0, 2 * h : 2 * h + 2], probs @ vals)
        assert count == (n if ratio == 1.0 else profile.group_kept_lens(n)[0])


def test_graph_buffers_pad_to_the_captured_size_in_place():
    pages = np.zeros((4, 2, 4), np.int64)
    pages[2, 0, :2], pages[2, 1, :1] = [7, 9], [4]
    lens = np.zeros((4, 2), np.int64)
    lens[2] = [5, 4]
    buf = md.DecodeGraphBuffers.create(6, 2, 4, 16, torch.float32, "cpu", num_layers=2)
    addresses = [t.data_ptr() for t in (buf.req_rows, buf.dest_page, buf.dest_slot, buf.out)]
    meta = buf.fill([2], 3, pages, lens, PAGE)
    assert meta.mode == md.DECODE and meta.batch_size == 3 and meta.out.shape == (3, 4, 16)
    assert meta.req_rows.tolist() == [2, md.PADDING_ROW, md.PADDING_ROW]
    assert meta.dest_page.tolist() == [[9, 4], [0, 0], [0, 0]]
    assert meta.dest_slot.tolist() == [[0, 3], [0, 0], [0, 0]]
    again = buf.fill([], 3, pages, lens, PAGE)  # capture: all padding, same memory
    assert again.req_rows.tolist() == [0, 0, 0] and again.dest_page.abs().sum() == 0
    views = (again.req_rows, again.dest_page, again.dest_slot, again.out)
    assert [t.data_ptr() for t in views] == addresses


@pytest.mark.parametrize("rows,padded", [([1, 2], 1), ([1], 7)], ids=["below-batch", "over-max"])
def test_graph_buffers_reject_a_bad_padded_size(rows, padded):
    buf = md.DecodeGraphBuffers.create(6, 2, 4, 16, torch.float32, "cpu", num_layers=2)
    lens = np.ones((4, 2), np.int64)
    with pytest.raises(KernelError, match="--cuda-graph-max-bs|max_bs"):
        buf.fill(rows, padded, np.zeros((4, 2, 4), np.int64), lens, PAGE)


def test_padded_decode_entries_touch_only_the_padding_page():
    """A padded graph batch: real rows decode as unpadded, padding writes only page 0."""
    state = make_state(make_profile(ratio=np.full((2, 2), 0.5)))
    mem, layer = state.memory, 0
    goh, coh = state.group_of_head[layer], state.column_of_head[layer]
    for row, n in ((1, 9), (3, 6)):
        state.allocate_extend([row], [n], [0])
    mem.kv_pool.k_pool.normal_()
    mem.kv_pool.v_pool.normal_()
    state.allocate_decode([1, 3], [10, 7])
    buf = md.DecodeGraphBuffers.create(
        mem.table.max_rows, 2, 4, 16, torch.float32, "cpu", num_layers=2
    )
    padded = buf.fill([1, 3], 4, mem.table.pages, mem.table.lens, PAGE)
    plain = md.decode_metadata([1, 3], mem.table.pages, mem.table.lens, PAGE, "cpu")
    qd, kd, vd = torch.randn(4, 4, 16), torch.randn(4, 2, 16), torch.randn(4, 2, 16)
    k_before = mem.kv_pool.k_pool.clone()
    md.write_decode_token(mem.kv_pool.k_pool, mem.kv_pool.v_pool, kd, vd, padded, goh, coh)
    changed = (mem.kv_pool.k_pool != k_before).flatten(1).any(1).nonzero().flatten().tolist()
    assert set(changed) - {0} == set(plain.dest_page[:, goh.long()].flatten().tolist())
    pools = (mem.kv_pool.k_pool, mem.kv_pool.v_pool, mem.table.page_table, mem.table.group_len)
    got = reference.decode_reference(qd, *pools, padded.req_rows, goh, coh, 0.35)
    want = reference.decode_reference(qd[:2], *pools, plain.req_rows, goh, coh, 0.35)
    torch.testing.assert_close(got[:2], want)
    assert got[2:].abs().sum() == 0  # row 0 holds nothing: zeros, never NaN


def test_chunk_floors_of_every_layer_match_the_kernel_rule():
    """decode_chunk_floors = split_table.batch_chunk_floor of each layer's heads, from the host
    lengths of the batch's rows only; fill uploads them into the per-layer views."""
    from tangram_sglang.kernels.split_table import batch_chunk_floor

    cluster_of = np.array([[0, 0, 1, 1], [2, 3, 3, 3]])  # 2 layers, 4 KV heads, 4 groups
    heads = md.heads_per_group_of_layer(cluster_of, 4)
    assert heads.tolist() == [[2, 0], [2, 0], [0, 1], [0, 3]]
    lens = np.array([[5, 9, 0, 0], [0, 0, 0, 0], [300, 20, 7, 1], [1, 2, 3, 4]], np.int64)
    rows = np.array([2, 0])
    got = md.decode_chunk_floors(lens, rows, heads, 16)
    for layer in range(2):
        head_lens = lens[rows][:, cluster_of[layer]]
        assert got[layer] == batch_chunk_floor(head_lens, 16)
    assert md.decode_chunk_floors(lens, np.zeros(0, np.int64), heads, 16).tolist() == [0, 0]
    buf = md.DecodeGraphBuffers.create(6, 4, 4, 16, torch.float32, "cpu", num_layers=2)
    pages = np.zeros((4, 4, 400), np.int64)
    meta = buf.fill(rows, 3, pages, lens, PAGE, chunk_floor=got)
    assert buf.chunk_floor.tolist() == got.tolist()
    assert [v.tolist() for v in meta.chunk_floor] == [[int(f)] for f in got]
    assert meta.chunk_floor[1].data_ptr() == buf.chunk_floor[1:].data_ptr()  # views, not copies
    assert buf.fill(rows, 3, pages, lens, PAGE).chunk_floor is None  # other plans: no floor


def test_cpu_decode_plan_carries_each_layers_floor_and_the_reference_checks_it():
    """The CPU server's decode path under the default ``batch`` plan: decode_metadata carries one
    int32 [1] floor per layer, and the reference decode refuses a missing or malformed one (a
    GPU kernel would read it), so the e2e tests check the wiring on every decode step."""
    from tangram_sglang.backend.layer_ops import ReferenceKernels

    state = make_state(make_profile(ratio=np.full((2, 2), 0.5)))
    mem, layer = state.memory, 1
    for row, n in ((1, 9), (3, 6)):
        state.allocate_extend([row], [n], [0])
    state.allocate_decode([1, 3], [10, 7])
    cluster_of = state.profile.grouping.cluster_of
    heads = md.heads_per_group_of_layer(cluster_of, mem.num_head_groups)
    floors = md.decode_chunk_floors(mem.table.lens, np.array([1, 3]), heads, 16)
    meta = md.decode_metadata([1, 3], mem.table.pages, mem.table.lens, PAGE, "cpu", None, floors)
    assert [f.tolist() for f in meta.chunk_floor] == [[int(f)] for f in floors]
    assert all(f.dtype == torch.int32 for f in meta.chunk_floor)
    kernels = ReferenceKernels(plan="batch")
    goh, coh = state.group_of_head[layer], state.column_of_head[layer]
    pools = (mem.kv_pool.k_pool, mem.kv_pool.v_pool, mem.table.page_table, mem.table.group_len)
    q = torch.randn(2, 4, 16)
    args = (q, *pools, meta.req_rows, goh, coh, 0.25, layer)
    got = kernels.decode(*args, chunk_floor=meta.chunk_floor[layer])
    torch.testing.assert_close(got, ReferenceKernels(plan="table").decode(*args))
    with pytest.raises(KernelError, match="TANGRAM_DECODE_PLAN=batch got no chunk floor"):
        kernels.decode(*args)
    with pytest.raises(KernelError, match="chunk_floor"):
        kernels.decode(*args, chunk_floor=meta.chunk_floor[layer].long())


def test_chunk_floors_of_the_wrong_length_or_launch_are_kernel_errors():
    buf = md.DecodeGraphBuffers.create(6, 2, 4, 16, torch.float32, "cpu", num_layers=3)
    lens = np.ones((4, 2), np.int64)
    pages = np.zeros((4, 2, 4), np.int64)
    for floors in (np.zeros(1, np.int64), np.zeros(4, np.int64), np.zeros((3, 1), np.int64)):
        with pytest.raises(KernelError, match=r"chunk_floor has shape .* expected \[3\]"):
            buf.fill([1], 2, pages, lens, PAGE, chunk_floor=floors)
    for floors in (np.array([1.5, 2, 3]), np.array([-1, 0, 0]), np.array([2**40, 0, 0])):
        with pytest.raises(KernelError, match="chunk_floor"):
            buf.fill([1], 2, pages, lens, PAGE, chunk_floor=floors)
    heads = md.heads_per_group_of_layer(np.array([[0, 1]]), 2)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(KernelError, match="launch_ctas"):
            md.decode_chunk_floors(lens, np.array([1]), heads, bad)
    for rows, match in (([-1], "rows must lie"), ([4], "rows must lie"), ([1.5], "rows must be")):
        with pytest.raises(KernelError, match=match):
            md.decode_chunk_floors(lens, np.array(rows), heads, 8)
    with pytest.raises(KernelError, match="rows must be 1-D"):
        md.decode_chunk_floors(lens, np.array([[1]]), heads, 8)
    with pytest.raises(KernelError, match=r"heads_of_layer must be \[G, L\]"):
        md.decode_chunk_floors(lens, np.array([1]), heads.T, 8)
