"""A request's page lifecycle costs O(pages touched): its host time does not grow with the pool.

Runs the real TangramMemory through a two-turn chat (``bench.lifecycle``: admit, extend,
decode, finish, a prefixed second turn with copy-on-write, eviction) on a 100k-page and a
3.15M-page pool (an H200's Llama-3.1-8B pool at page 16) and compares the best-of-N totals.
Before the O(touched) allocator, every free/incref ran a pool-wide bincount: the big pool's
lifecycle took ~16x the small one's on one CPU thread (84 vs 5.2 ms); now both ~4 ms.
"""

import pytest
import torch

from tangram_sglang.bench.lifecycle import CALLS, lifecycle_cost

SMALL, LARGE = 100_000, 3_154_477


@pytest.fixture
def one_thread():
    """One intra-op thread: a scheduler's host ops are small, and OpenMP spinning on a shared
    2-core box makes small-pool timings swing 5x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_lifecycle_cost_is_independent_of_pool_size(one_thread):
    small, large = float("inf"), float("inf")
    for _ in range(3):  # interleaved, so load from other processes hits both sizes alike
        small = min(small, lifecycle_cost(SMALL, repeats=3)["total"])
        large = min(large, lifecycle_cost(LARGE, repeats=3)["total"])
    assert large < 2.0 * small, f"{LARGE:,} pages: {large:.2f} ms vs {SMALL:,}: {small:.2f} ms"


def test_lifecycle_cost_reports_every_call():
    cost = lifecycle_cost(1_000, repeats=1, decode_steps=2, first_turn_tokens=40)
    assert set(cost) == {*CALLS, "total"} and all(v > 0 for v in cost.values())
