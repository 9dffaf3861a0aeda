"""The per-batch plan never reads the device and reaches it in one packed copy.

* With the page table, the layer maps and the decode buffers on the ``meta`` device (no data:
  any device-to-host read raises), a decode step (``allocate_decode`` + the graph buffers' fill)
  and an extend batch (``allocate_extend`` + ``extend_metadata``) run through:
  planning reads host copies only.
* Staged page-table writes: nothing reaches the device before ``flush``; one ``flush`` is one
  upload carrying the table deltas and the plan; the device then equals the host mirror.
* Release is host-only (a batch in flight may still read the row); the next owner's first sync
  zeroes the row on the device before writing its entries.
* The vectorised decode step keeps the segment bookkeeping: the decode tail's tokens and pages.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_backend_metadata import PAGE, make_profile

from tangram_sglang.backend import metadata as md
from tangram_sglang.backend.state import TangramState
from tangram_sglang.bench.decode_step import count_host_reads
from tangram_sglang.errors import KernelError
from tangram_sglang.mem.manager import TangramMemory
from tangram_sglang.mem.page_table import PackedUpload


def meta_state(max_rows: int = 6) -> TangramState:
    profile = make_profile()
    memory = TangramMemory(profile, PAGE, 64, max_rows, 16, kv_pool=None, device="meta")
    memory.table.deferred = True
    return TangramState(memory, full_kv_bytes_per_token=1, device="meta")


def test_a_decode_step_and_an_extend_batch_plan_without_reading_the_device():
    state = meta_state()
    table = state.memory.table
    assert table.page_table.device.type == "meta"
    with count_host_reads() as reads:
        for row, n in ((1, 9), (2, 6), (4, 13)):
            state.plan_row(row, n, 8)
        rows = [1, 2, 4]
        plan = state.allocate_extend(rows, [9, 6, 13], [0, 0, 0])
        meta = md.extend_metadata(
            rows,
            [9, 6, 13],
            plan.kept_lens,
            "meta",
            state.profile.grouping.cluster_of,
            table.flush,
            start_lens=plan.start_lens,
            hist_len=torch.zeros_like(table.group_len),
        )
        assert meta.req_rows.device.type == "meta" and meta.kept_heads.shape[1] == 3
        buffers = md.DecodeGraphBuffers.create(6, 2, 4, 16, torch.float32, "meta", num_layers=2)
        for step in range(6):
            arr = np.array(rows)
            state.allocate_decode(arr, np.array([10, 7, 14]) + step)
            plan = buffers.fill(arr, 4, table.pages, table.lens, PAGE, table.flush)
            assert plan.dest_page.device.type == "meta" and plan.batch_size == 4
    assert reads["tolist"] == reads["item"] == reads["__int__"] == 0
    assert table.lens[1].tolist() == (np.asarray(state.profile.group_kept_lens(9)) + 6).tolist()


def test_staged_writes_reach_the_device_in_one_upload_per_flush():
    state = TangramState(
        TangramMemory(make_profile(), PAGE, 64, 6, 16, kv_pool=None), 1, device="cpu"
    )
    table = state.memory.table
    table.deferred = True
    state.plan_row(3, 9, 4)
    state.allocate_extend([3], [9], [0])
    assert table.has_staged() and int(table.group_len[3].abs().sum()) == 0  # not yet
    before = table.uploader.num_uploads
    (rows,) = table.flush([np.array([3])])
    assert table.uploader.num_uploads == before + 1 and rows.tolist() == [3]
    assert torch.equal(table.page_table, torch.from_numpy(table.pages))
    assert table.group_len[3].tolist() == table.lens[3].tolist()
    state.allocate_decode([3], [10])
    state.allocate_decode([3], [11])
    buffers = md.DecodeGraphBuffers.create(6, 2, 4, 16, torch.float32, "cpu", num_layers=2)
    plan = buffers.fill([3], 2, table.pages, table.lens, PAGE, table.flush)
    assert table.uploader.num_uploads == before + 2 and not table.has_staged()
    assert torch.equal(table.page_table, torch.from_numpy(table.pages))
    assert torch.equal(table.group_len, torch.from_numpy(table.lens).to(torch.int32))
    want_page, want_slot = md.decode_destinations([3], table.pages, table.lens, PAGE)
    assert plan.dest_page[:1].tolist() == want_page.tolist()
    assert plan.dest_slot[:1].tolist() == want_slot.tolist()


def test_release_is_host_only_and_the_next_owner_overwrites_the_device_row():
    state = TangramState(
        TangramMemory(make_profile(), PAGE, 64, 6, 16, kv_pool=None), 1, device="cpu"
    )
    table = state.memory.table
    state.allocate_extend([2], [13], [0])
    state.allocate_decode([2], [14])
    old = table.page_table[2].clone()
    assert old.abs().sum() > 0
    state.release(2)
    assert torch.equal(table.page_table[2], old)  # a batch in flight may still read it
    assert table.lens[2].sum() == 0 and not table.in_tail[2]
    state.allocate_extend([2], [3], [0])  # the next owner: a shorter table
    assert torch.equal(table.page_table[2], torch.from_numpy(table.pages[2]))
    assert table.page_table[2].abs().sum() < old.abs().sum()


def test_the_decode_tail_segment_counts_every_step():
    memory = TangramMemory(make_profile(), PAGE, 64, 6, 16, kv_pool=None, debug=True)
    state = TangramState(memory, 1, device="cpu")
    state.allocate_extend([1, 2], [9, 5], [0, 0])
    for step in range(7):
        state.allocate_decode([1, 2], [10 + step, 6 + step])
    segments = memory.finish(1)
    assert [s.kind for s in segments] == ["extend", "decode"]
    tail = segments[-1]
    assert tail.num_tokens == 7 and tail.kept_len.tolist() == [7, 7]
    assert tail.start_len.tolist() == list(state.profile.group_kept_lens(9))
    for g in range(2):
        end = -(-(tail.start_len[g] + 7) // PAGE)
        assert tail.first_page_index[g] + tail.pages[g].size == end
    memory.free_pages(np.concatenate([p for s in segments for p in s.pages]))
    state.allocate_decode([2], [13])  # the other row decodes on, its tail still open
    assert memory.table.tail_tokens[2] == 8


def test_packed_upload_keeps_shapes_and_order():
    up = PackedUpload("cpu")
    a, b, c = np.arange(3), np.arange(6).reshape(2, 3) + 10, np.zeros(0, np.int64)
    got = up.upload([a, b, c])
    assert [t.shape for t in got] == [(3,), (2, 3), (0,)]
    assert got[0].tolist() == [0, 1, 2] and got[1].tolist() == b.tolist()
    assert up.num_uploads == 1


def test_planning_without_the_host_copy_of_the_rows_is_an_error():
    state = meta_state()
    with pytest.raises(KernelError, match="init_new hook"):
        state.host_batch_for(object(), 2)
    state.set_host_batch(torch.tensor([3, 1]), torch.tensor([9, 4]))
    rows, lens = state.host_batch_for(object(), 2)
    assert rows.tolist() == [3, 1] and lens.tolist() == [9, 4]
    with pytest.raises(KernelError, match="2 rows recorded"):
        state.host_batch_for(object(), 3)  # another batch than the one recorded


def test_an_extend_batch_with_a_paged_history_plan_plans_without_reading_the_device():
    """``TANGRAM_HISTORY_ATTENTION=flashinfer``'s per-batch plan and per-layer page ids: host
    arrays in the batch's one upload, the ids built and read on the device only."""
    from tangram_sglang.kernels.history_attention import plan_paged_history

    state = meta_state()
    table = state.memory.table
    grouping = state.profile.grouping
    rows = [1, 2]
    for row, n in zip(rows, (40, 24), strict=True):
        state.plan_row(row, n, 8)
    state.allocate_extend(rows, [20, 12], [0, 0])
    table.flush([])
    with count_host_reads() as reads:
        plan = state.allocate_extend(rows, [20, 12], [20, 12])
        # 16 kept tokens in every group (as at ratio 1.0): one length per head on every layer
        history = plan_paged_history(
            rows,
            [0, 20, 32],
            np.full_like(plan.start_lens, 16),
            grouping.cluster_of,
            grouping.column_of,
            grouping.heads_per_group,
            PAGE,
            4,
            16,
            min_work=0,
        )
        meta = md.extend_metadata(
            rows,
            [20, 12],
            plan.kept_lens,
            "meta",
            grouping.cluster_of,
            table.flush,
            start_lens=plan.start_lens,
            hist_len=torch.zeros_like(table.group_len),
            history=history,
            page_table=table.page_table,
        )
        ids = [meta.history_ids.layer(lid) for lid in range(grouping.num_layers)]
    assert history is not None and ids[0].device.type == "meta"
    assert ids[0].shape == (history.num_entries,)
    assert reads["tolist"] == reads["item"] == reads["__int__"] == 0
