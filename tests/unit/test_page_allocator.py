"""PageAllocator: exact page ids, free order, reference counts, errors leave state unchanged."""

import random
from collections import Counter, deque

import pytest
import torch

from tangram_sglang.errors import PoolError
from tangram_sglang.mem.page_allocator import DEBUG_ENV, PageAllocator


def ids(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def state(alloc: PageAllocator) -> tuple[list[int], list[int]]:
    return alloc.free_pages.tolist(), alloc.ref_count.tolist()


def test_alloc_takes_head_and_never_page_zero():
    alloc = PageAllocator(num_pages=8, debug=True)
    assert alloc.num_usable_pages == 7
    assert alloc.alloc(3).tolist() == [1, 2, 3]
    assert alloc.alloc(2).tolist() == [4, 5]
    assert alloc.num_free() == 2 and alloc.num_used() == 5
    assert alloc.ref_count.tolist() == [0, 1, 1, 1, 1, 1, 0, 0]


def test_alloc_too_many_is_none_and_takes_nothing():
    alloc = PageAllocator(num_pages=4, debug=True)
    before = state(alloc)
    assert alloc.alloc(4) is None
    assert state(alloc) == before
    assert alloc.alloc(3).tolist() == [1, 2, 3]
    assert alloc.alloc(1) is None
    assert alloc.alloc(0).tolist() == []


def test_free_appends_in_listed_order_and_reuses_fifo():
    alloc = PageAllocator(num_pages=8, debug=True)
    alloc.alloc(5)
    assert alloc.free(ids(4, 2)) == 2
    assert alloc.free_pages.tolist() == [6, 7, 4, 2]
    assert alloc.alloc(3).tolist() == [6, 7, 4]


def test_shared_page_returns_only_when_last_holder_frees():
    alloc = PageAllocator(num_pages=4, debug=True)
    alloc.alloc(2)
    alloc.incref(ids(1, 1))
    assert alloc.ref_count[1] == 3
    assert alloc.free(ids(1)) == 0
    assert alloc.free(ids(1, 2)) == 1  # page 2 freed, page 1 still held once
    assert alloc.free_pages.tolist() == [3, 2]
    assert alloc.free(ids(1)) == 1
    assert alloc.free_pages.tolist() == [3, 2, 1]


def test_repeated_id_in_one_free_drops_two_holders_and_frees_once():
    alloc = PageAllocator(num_pages=4, debug=True)
    alloc.alloc(1)
    alloc.incref(ids(1))
    assert alloc.free(ids(1, 1)) == 1
    assert alloc.free_pages.tolist() == [2, 3, 1]


@pytest.mark.parametrize(
    ("pages", "match"),
    [
        ((2,), "double free"),  # page 2 never allocated
        ((1, 1), "listed 2x"),  # one holder, freed twice in one batch
        ((0,), "padding page 0"),
        ((9,), "outside"),
        ((1, 2), "double free"),  # the bad id makes the whole batch fail, page 1 stays held
    ],
    ids=["never-allocated", "twice-in-batch", "padding", "out-of-range", "mixed-batch"],
)
def test_bad_free_raises_and_changes_nothing(pages, match):
    alloc = PageAllocator(num_pages=4, debug=True)
    alloc.alloc(1)
    before = state(alloc)
    with pytest.raises(PoolError, match=match):
        alloc.free(ids(*pages), owner="request 'r7' (row 3), group 2")
    assert state(alloc) == before


def test_free_error_names_the_owner():
    alloc = PageAllocator(num_pages=4)
    with pytest.raises(PoolError, match=r"request 'r7' \(row 3\), group 2"):
        alloc.free(ids(3), owner="request 'r7' (row 3), group 2")


def test_incref_of_free_page_raises():
    alloc = PageAllocator(num_pages=4)
    with pytest.raises(PoolError):
        alloc.incref(ids(2))
    assert alloc.ref_count.tolist() == [0, 0, 0, 0]


def test_check_invariants_collects_every_violation():
    alloc = PageAllocator(num_pages=6)
    alloc.alloc(2)
    alloc.ref_count[0] = 1  # padding page held
    alloc.ref_count[4] = 2  # held and free
    alloc.ref_count[2] = 0  # leaked: no holder, not free
    with pytest.raises(PoolError) as info:
        alloc.check_invariants()
    msg = str(info.value)
    assert "padding page 0 has 1 holders" in msg
    assert "pages [2] have no holder" in msg
    assert "pages [4] are free but still have holders" in msg


def test_check_invariants_finds_duplicate_free_entries():
    alloc = PageAllocator(num_pages=4)
    alloc.ring[1] = 3  # the free list reads [1, 3, 3]: page 3 twice, page 2 lost
    with pytest.raises(PoolError, match=r"pages \[3\] are on the free list more than once"):
        alloc.check_invariants()


def test_debug_env_read_at_construction(monkeypatch):
    monkeypatch.setenv(DEBUG_ENV, "1")
    alloc = PageAllocator(num_pages=4)
    monkeypatch.setenv(DEBUG_ENV, "0")
    assert alloc.debug
    alloc.ref_count[3] = 5  # corrupt: free page with holders; the next mutation notices
    with pytest.raises(PoolError, match="after alloc"):
        alloc.alloc(1)
    assert not PageAllocator(num_pages=4).debug


def test_pool_needs_a_usable_page():
    with pytest.raises(PoolError, match="num_pages=1"):
        PageAllocator(num_pages=1)


def test_ring_free_list_is_fifo_through_wraparound():
    """Against a deque model: hand-out order, holder counts and errors over many wraps."""
    rng = random.Random(3)
    alloc = PageAllocator(num_pages=9, debug=True)
    model, held = deque(range(1, 9)), Counter()
    for _ in range(600):
        if rng.random() < 0.5 and model:
            got = alloc.alloc(rng.randint(0, len(model))).tolist()
            assert got == [model.popleft() for _ in got]
            held.update(got)
        elif held:
            ids_ = rng.sample(sorted(held.elements()), rng.randint(1, min(3, sum(held.values()))))
            if rng.random() < 0.3:
                alloc.incref(torch.tensor(ids_))
                held.update(ids_)
                continue
            held.subtract(ids_)
            released = list(dict.fromkeys(p for p in ids_ if held[p] == 0))  # listed order
            assert alloc.free(torch.tensor(ids_)) == len(released)
            model.extend(released)
            held = +held
        assert alloc.free_pages.tolist() == list(model)
        assert alloc.num_free() == len(model)
    assert alloc.head != 0  # the ring wrapped


def test_mutations_skip_the_pool_wide_check_unless_debug(monkeypatch):
    """alloc / incref / free never run the O(num_pages) self-check outside debug mode."""

    def whole_pool_check(self):
        raise AssertionError("O(num_pages) check ran")

    monkeypatch.setattr(PageAllocator, "check_invariants", whole_pool_check)
    alloc = PageAllocator(num_pages=16, debug=False)
    pages = alloc.alloc(4)
    alloc.incref(pages[:2])
    assert alloc.free(pages) == 2 and alloc.free(pages[:2]) == 2
    with pytest.raises(PoolError, match="double free"):  # held-checks still run, on the ids
        alloc.free(pages[:1])
    with pytest.raises(AssertionError, match="O\\(num_pages\\) check ran"):
        PageAllocator(num_pages=16, debug=True).alloc(1)
