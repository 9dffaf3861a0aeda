"""The query-agnostic scorers that need more than a profile's budgets, on the real ``--tangram``
server (SmolLM2, CPU).

``kvzip-replay`` rotates each segment's queries with the served model's RoPE frequencies, which
the attention backend binds at start-up; an unbound scorer raises at the first compressed
prefill. ``kvzip-gate`` scores each token from its key and value with the gate weights its
profile carries, through the backend's token-scorer path (values and layer passed in). The
demo's chat (its turns are long enough to be compressed under the demo's threshold) must
therefore run through compressed prefills, hold less KV than full KV on every turn, and report
the scorer it runs in ``/get_server_info``.
"""

from __future__ import annotations

import re

import pytest
import requests

from tangram_sglang.demo import (
    DEMO_MIN_COMPRESS_TOKENS,
    DEMO_TURNS,
    TurnReporter,
    chat,
    full_kv_bytes_per_token,
)

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("scorer", ["kvzip-replay", "kvzip-gate"])
def test_a_query_agnostic_scorer_server_compresses_every_turn(
    servers, smollm2_path, capsys, scorer
):
    args = [
        "--tangram",
        "--tangram-scorer",
        scorer,
        "--tangram-min-compress-tokens",
        str(DEMO_MIN_COMPRESS_TOKENS),
    ]
    server = servers.get(args, f"tangram-{scorer}")
    info = requests.get(f"{server.base_url}/get_server_info", timeout=60).json()
    assert info["tangram"]["scorer"] == scorer
    assert info["tangram"]["profile_path"].endswith(f"smollm2/{scorer}-r0.25.json")
    server.flush_cache().raise_for_status()
    per_token = full_kv_bytes_per_token(smollm2_path, 4)  # the CPU engine serves float32
    turns = chat(server.base_url, DEMO_TURNS, on_turn=TurnReporter(server, per_token))
    saved = [int(x) for x in re.findall(r"full KV \(saved (-?\d+)%\)", capsys.readouterr().out)]
    assert len(saved) == len(turns) == len(DEMO_TURNS)
    assert all(s > 0 for s in saved), saved
    assert all(t.reply.strip() for t in turns)
