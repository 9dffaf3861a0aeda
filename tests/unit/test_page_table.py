"""Ragged per-(row, group) page tables through TangramMemory: exact ids, COW tails, segments.

Profile used throughout: one layer, 4 KV heads, H_p = 2 -> group 0 (ratio 1.0) keeps every token,
group 1 (ratio 0.5) keeps ceil(n / 2); no sink or window; page_size 4; 15 usable pages.
"""

import numpy as np
import pytest
import torch
from factories import make_memory

from tangram_sglang.mem.manager import PrefixMatch
from tangram_sglang.mem.page_table import PageTable


def table(mem, row):
    return [mem.group_pages(row, g).tolist() for g in range(mem.num_head_groups)]


def run_prefill(mem, row, rid, n, max_new, prefix=None):
    assert mem.admit(row, rid, n, max_new, prefix) is not None
    plan = mem.alloc_extend(row, n)
    mem.commit_extend(row)
    return plan


def prefix_of(segments):
    pages = [np.concatenate([s.pages[g] for s in segments]) for g in range(2)]
    lens = segments[-1].start_len + segments[-1].kept_len
    return PrefixMatch(pages, lens)


def test_extend_allocates_per_group_and_group_len_waits_for_commit():
    mem = make_memory()
    mem.admit(0, "a", 10, 1)
    plan = mem.alloc_extend(0, 10)
    assert plan.kept_len.tolist() == [10, 5] and plan.start_len.tolist() == [0, 0]
    assert table(mem, 0) == [[1, 2, 3], [4, 5]]
    assert mem.table.page_table[0].tolist() == [[1, 2, 3, 0, 0, 0, 0, 0], [4, 5, 0, 0, 0, 0, 0, 0]]
    assert mem.table.group_len[0].tolist() == [0, 0]  # the extend kernel reads the history
    mem.commit_extend(0)
    assert mem.table.group_len[0].tolist() == [10, 5]
    assert mem.table.page_table.dtype == torch.int32 and mem.table.group_len.dtype == torch.int32


def test_decode_touches_only_groups_whose_last_page_is_full():
    mem = make_memory()
    run_prefill(mem, 0, "a", 4, 3)  # group 0: 4 tokens (full page), group 1: 2 (partial)
    assert table(mem, 0) == [[1], [2]]
    assert mem.decode_pages_needed([0]) == 1
    assert mem.alloc_decode([0]) == 1
    assert table(mem, 0) == [[1, 3], [2]]
    assert mem.table.group_len[0].tolist() == [5, 3]  # includes the decoded token
    assert mem.alloc_decode([0]) == 0
    assert mem.table.group_len[0].tolist() == [6, 4]
    res = mem.ledger.by_row[0]
    assert res.used_pages == res.reserved_pages == 3 and res.overflow_pages == 0


def test_batched_decode_updates_each_row():
    mem = make_memory()
    run_prefill(mem, 0, "a", 4, 2)
    run_prefill(mem, 2, "b", 3, 2)
    assert mem.alloc_decode([2, 0]) == 1
    assert table(mem, 0) == [[1, 5], [2]] and table(mem, 2) == [[3], [4]]
    assert mem.table.group_len[[0, 2]].tolist() == [[5, 3], [4, 3]]


def test_shared_partial_tail_is_copied_before_append():
    mem = make_memory()
    run_prefill(mem, 0, "a", 6, 1)  # group 0: [1, 2] (6 tokens), group 1: [3] (3 tokens)
    mem.kv_pool.k_pool[3] = torch.randn(2, 4, 8)
    segs = mem.finish(0)
    assert [[p.tolist() for p in s.pages] for s in segs] == [[[1, 2], [3]]]
    prefix = prefix_of(segs)
    assert mem.footprint(2, 1, prefix) == 2  # one copy per group, the appends fit in it
    plan = run_prefill(mem, 1, "b", 2, 1, prefix)
    assert plan.cow_src.tolist() == [2, 3] and plan.cow_dst.tolist() == [4, 5]
    assert table(mem, 1) == [[1, 4], [5]]
    assert torch.equal(mem.kv_pool.k_pool[5, :, :3], mem.kv_pool.k_pool[3, :, :3])
    assert mem.allocator.ref_count[[1, 2, 3, 4, 5]].tolist() == [2, 1, 1, 1, 1]
    seg_b = mem.finish(1)[0]
    assert seg_b.first_page_index.tolist() == [1, 0] and seg_b.start_len.tolist() == [6, 3]
    assert [p.tolist() for p in seg_b.pages] == [[4], [5]]
    assert mem.allocator.ref_count[[1, 2, 3, 4, 5]].tolist() == [1, 1, 1, 1, 1]  # prefix unlocked


def test_decode_on_shared_tail_copies_once_then_appends_in_place():
    mem = make_memory()
    run_prefill(mem, 0, "a", 5, 1)  # group 0: [1, 2] (5), group 1: [3] (3)
    mem.kv_pool.v_pool[3] = torch.randn(2, 4, 8)
    prefix = prefix_of(mem.finish(0))
    assert mem.admit(1, "b", 0, 3, prefix) is not None  # nothing to extend, 2 decode tokens
    assert mem.ledger.by_row[1].reserved_pages == 3  # 2 copies + group 1 overflows page 3
    assert mem.alloc_decode([1]) == 2
    assert table(mem, 1) == [[1, 4], [5]]
    assert torch.equal(mem.kv_pool.v_pool[5, :, :3], mem.kv_pool.v_pool[3, :, :3])
    assert mem.alloc_decode([1]) == 1
    assert table(mem, 1) == [[1, 4], [5, 6]]
    res = mem.ledger.by_row[1]
    assert res.used_pages == res.reserved_pages


def test_aligned_shared_prefix_appends_without_copy():
    mem = make_memory()
    run_prefill(mem, 0, "a", 8, 1)  # group 0: [1, 2] full, group 1: [3] full
    prefix = prefix_of(mem.finish(0))
    plan = run_prefill(mem, 1, "b", 4, 1, prefix)
    assert plan.cow_src.size == 0
    assert table(mem, 1) == [[1, 2, 4], [3, 5]]


def test_chunked_prefill_segments_share_the_row_tail_page():
    mem = make_memory()
    run_prefill(mem, 0, "a", 6, 0)  # chunk 1: group 0 [1, 2] (6), group 1 [3] (3)
    assert mem.admit_chunk(0, 4, 2) is not None  # chunk 2 + 1 decode token
    plan = mem.alloc_extend(0, 4)
    mem.commit_extend(0)
    assert plan.cow_src.size == 0 and plan.start_len.tolist() == [6, 3]
    assert table(mem, 0) == [[1, 2, 4], [3, 5]]
    mem.alloc_decode([0])
    segs = mem.finish(0)
    assert [s.kind for s in segs] == ["extend", "extend", "decode"]
    assert [s.first_page_index.tolist() for s in segs] == [[0, 0], [2, 1], [3, 2]]
    assert [[p.tolist() for p in s.pages] for s in segs] == [[[1, 2], [3]], [[4], [5]], [[], []]]
    assert [s.kept_len.tolist() for s in segs] == [[6, 3], [4, 2], [1, 1]]


def test_detach_keeps_row_reading_pages_and_transfers_ownership():
    mem = make_memory()
    run_prefill(mem, 0, "a", 4, 0)
    segs = mem.detach_segments(0)
    assert mem.allocator.ref_count[[1, 2]].tolist() == [2, 2]
    assert table(mem, 0) == [[1], [2]]
    mem.abort(0)
    assert mem.allocator.ref_count[[1, 2]].tolist() == [1, 1]
    for ids in segs[0].pages:
        mem.free_pages(ids)
    assert mem.allocator.num_free() == 15


def test_page_table_rejects_bad_sizes():
    with pytest.raises(Exception, match="max_pages_per_group=0"):
        PageTable(1, 1, 0, 4)
