"""``bench.turn_host``: rounds of later turns on the real tree, state and SGLang pools."""

from __future__ import annotations

import numpy as np
import pytest

from tangram_sglang.bench import turn_host


@pytest.mark.parametrize("batch_size", [None, 1, 3], ids=["one-batch", "by-1", "by-3"])
def test_later_turns_reuse_the_cached_history_and_leave_the_pool_consistent(batch_size):
    rng = np.random.default_rng(0)
    world = turn_host.build_world(num_rows=5, context_tokens=1024, num_pages=20_000)
    convs = [rng.integers(100, 30000, 300).tolist() for _ in range(4)]
    _, convs = turn_host.play_round(world, convs, 4, rng)
    assert [len(c) for c in convs] == [304] * 4  # each prompt plus its 4 outputs
    convs = [c + rng.integers(100, 30000, 40).tolist() for c in convs]
    matched = []
    world.tree.inc_lock_ref = lambda node, f=world.tree.inc_lock_ref: (
        matched.append(node) or f(node)
    )
    allocated = []
    world.state.allocate_extend = lambda rows, *rest, f=world.state.allocate_extend: (
        allocated.append(len(rows)) or f(rows, *rest)
    )
    times, convs = turn_host.play_round(world, convs, 4, rng, batch_size)
    assert allocated == {None: [4], 1: [1, 1, 1, 1], 3: [3, 1]}[batch_size]
    assert all(node is not world.tree.root_node for node in matched)  # history reused
    assert set(times) == set(turn_host.STAGES) and all(t > 0 for t in times.values())
    world.state.memory.check_invariants()
    assert world.tree.evictable_pages() == world.tree.evictable_pages_scan()
    world.tree.evict_pages(10**9)
    assert world.state.memory.allocator.num_used() == 0  # every page came back


def test_cost_table_and_bad_counts():
    out = turn_host.turn_host_cost(2, 64, 16, 2, rounds=1)
    assert set(out) == {*turn_host.STAGES, "per_turn"}
    assert out["per_turn"] == pytest.approx(out["allocate"] + out["plan"] + out["finish"], abs=1e-3)
    with pytest.raises(ValueError, match="must be >= 1"):
        turn_host.turn_host_cost(0)
    with pytest.raises(ValueError, match="must be >= 1"):
        turn_host.turn_host_cost(2, batch_size=0)
    assert set(turn_host.turn_host_cost(2, 64, 16, 2, rounds=1, batch_size=1)) == set(out)
    with pytest.raises(ValueError, match="use fewer conversations"):
        turn_host.turn_host_cost(100_000)


@pytest.mark.parametrize("flag", ["--conversations", "--output-tokens", "--rounds", "--batch-size"])
def test_cli_names_the_bad_flag_before_any_work(flag, capsys):
    with pytest.raises(SystemExit) as exc:
        turn_host.main([flag, "0"])
    assert exc.value.code == 2 and f"{flag} 0: must be >= 1" in capsys.readouterr().err
