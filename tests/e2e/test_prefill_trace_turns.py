"""``bench.prefill_trace --turn-tokens`` against the real ``--tangram`` server (CPU, no profiler).

The later-turn round caches the histories first and only then runs the timed part (where the
CLI starts the profiler): at that moment a history plus one new token is served from the tree.
"""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import requests

from tangram_sglang.bench.prefill_trace import run_round
from tangram_sglang.demo import demo_server_args

pytestmark = pytest.mark.e2e


def test_later_turns_run_after_their_histories_are_cached(servers):
    server = servers.get(demo_server_args(False, "cpu", None), "demo-tangram")
    args = argparse.Namespace(
        num_prompts=3, prompt_len=300, output_len=4, turn_tokens=20, stagger_ms=20.0
    )
    seed = 7
    history = np.random.default_rng(seed).integers(100, 20000, (3, 300))[0].tolist()
    cached_when_timed: list[int] = []

    def before_timed() -> None:  # where the CLI starts the profiler
        body = {"input_ids": [*history, 5], "sampling_params": {"max_new_tokens": 1}}
        reply = requests.post(f"{server.base_url}/generate", json=body, timeout=300).json()
        cached_when_timed.append(int(reply["meta_info"]["cached_tokens"]))

    times = run_round(server.base_url, args, seed, before_timed)
    assert cached_when_timed == [300]  # the whole history segment, before the timed turns
    assert set(times) == {"history_wall_s", "wall_s"}
    assert times["history_wall_s"] > 0 and times["wall_s"] > 0
