"""KVPool: layout, byte sizing, kept-KV write at (page, column, slot), COW page copy."""

import numpy as np
import pytest
import torch
from factories import make_pool, make_profile

from tangram_sglang.errors import PoolError
from tangram_sglang.mem.kv_pool import KVPool, bytes_per_page, filled_slots, num_pages_for_budget


def test_layout_and_bytes_per_page():
    pool = make_pool()
    assert pool.k_pool.shape == (16, 2, 4, 8) and pool.v_pool.shape == (16, 2, 4, 8)
    assert pool.k_pool.is_contiguous()
    assert pool.bytes_per_page == 2 * 2 * 4 * 8 * 4
    assert bytes_per_page(4, 16, 128, torch.bfloat16) == 2 * 4 * 16 * 128 * 2
    # One (page, column) is one contiguous single-head block of page_size * D elements.
    assert pool.k_pool[3, 1].is_contiguous()
    assert pool.k_pool[3, 1].data_ptr() - pool.k_pool[3, 0].data_ptr() == 4 * 8 * 4


def test_from_memory_budget_floors_to_whole_pages():
    prof = make_profile([[1.0, 0.5, 0.5, 0.25]], heads_per_group=2, head_dim=8)
    page = bytes_per_page(2, 4, 8, torch.float16)
    pool = KVPool.from_memory_budget(10 * page + page - 1, prof, torch.float16, page_size=4)
    assert pool.num_pages == 10 and pool.heads_per_group == 2 and pool.head_dim == 8
    assert pool.k_pool.dtype == torch.float16
    with pytest.raises(PoolError, match="holds 1 pages"):
        num_pages_for_budget(page, page)


def test_write_lands_at_page_column_slot_and_gather_reads_it_back():
    pool = make_pool()
    k = torch.arange(3 * 8, dtype=torch.float32).view(3, 8)
    pages, cols, slots = torch.tensor([5, 5, 9]), torch.tensor([1, 1, 0]), torch.tensor([2, 3, 0])
    pool.write(pages, cols, slots, k, -k)
    assert torch.equal(pool.k_pool[5, 1, 2], k[0])
    assert torch.equal(pool.v_pool[9, 0, 0], -k[2])
    assert pool.k_pool[5, 0].abs().sum() == 0  # the other column untouched
    got_k, got_v = pool.gather(torch.tensor([7, 5, 9]), column=1, num_tokens=8)
    assert torch.equal(got_k[6:8], k[:2]) and torch.equal(got_v[6:8], -k[:2])


@pytest.mark.parametrize(
    ("pages", "cols", "slots"),
    [([0], [0], [0]), ([16], [0], [0]), ([1], [2], [0]), ([1], [0], [4])],
    ids=["padding-page", "page-out-of-range", "column-beyond-hp", "slot-beyond-page"],
)
def test_write_rejects_bad_destination(pages, cols, slots):
    pool = make_pool()
    row = torch.ones(1, 8)
    with pytest.raises(PoolError):
        pool.write(torch.tensor(pages), torch.tensor(cols), torch.tensor(slots), row, row)
    assert pool.k_pool.abs().sum() == 0


def test_copy_pages_copies_filled_slots_of_all_columns():
    pool = make_pool()
    pool.k_pool[3] = torch.randn(2, 4, 8)
    pool.v_pool[3] = torch.randn(2, 4, 8)
    copy_pages(pool, [3], [7], [3])
    assert torch.equal(pool.k_pool[7, :, :3], pool.k_pool[3, :, :3])
    assert torch.equal(pool.v_pool[7, :, :3], pool.v_pool[3, :, :3])
    assert pool.k_pool[7, :, 3].abs().sum() == 0


def test_copy_pages_matches_a_page_by_page_copy():
    """Many pages in one call (repeated sources, every fill) equal the page-by-page copy, and
    the slots past each fill keep the destination's contents."""
    pool = KVPool.create(64, 2, 4, 8, torch.float32)
    pool.k_pool.copy_(torch.randn_like(pool.k_pool))
    pool.v_pool.copy_(torch.randn_like(pool.v_pool))
    src = torch.tensor([5, 5, 6, 7, 5, 8, 9])  # one shared tail page copied for several rows
    dst = torch.tensor([20, 21, 22, 23, 24, 25, 26])
    fill = torch.tensor([1, 4, 2, 3, 4, 1, 2])
    want_k, want_v = pool.k_pool.clone(), pool.v_pool.clone()
    for s, d, n in zip(src.tolist(), dst.tolist(), fill.tolist(), strict=True):
        want_k[d, :, :n] = want_k[s, :, :n]
        want_v[d, :, :n] = want_v[s, :, :n]
    copy_pages(pool, src, dst, fill)
    assert torch.equal(pool.k_pool, want_k) and torch.equal(pool.v_pool, want_v)
    copy_pages(pool, src[:0], dst[:0], fill[:0])  # nothing to copy
    assert torch.equal(pool.k_pool, want_k)


def test_meta_device_sizes_without_memory():
    pool = KVPool.create(1 << 20, 4, 16, 128, torch.bfloat16, device="meta")
    assert pool.num_pages == 1 << 20 and pool.k_pool.device.type == "meta"


def test_a_chained_or_doubled_copy_is_refused_in_debug_mode():
    """One gather then one scatter cannot chain copies (S -> D, D -> D2) or write a slot twice;
    the debug pool check refuses such a batch instead of copying stale slots."""
    from radix_world import build_tree  # a real memory manager with debug pool checks

    memory = build_tree()[1].memory
    src, dst, fill = np.array([5, 7]), np.array([7, 9]), np.array([2, 2])
    with pytest.raises(PoolError, match="written twice or is also a source"):
        memory._copy_now(src, dst, fill)
    with pytest.raises(PoolError, match="written twice"):
        memory._copy_now(np.array([5, 6]), np.array([9, 9]), np.array([1, 1]))
    memory._copy_now(np.array([5, 5]), np.array([8, 9]), np.array([2, 1]))  # a shared source


def copy_pages(pool, src, dst, fill):
    """Copy-on-write of whole tail pages through the pool's slot copy (as the manager does)."""
    pool.copy_slots(*(torch.from_numpy(a) for a in filled_slots(src, dst, fill)))
