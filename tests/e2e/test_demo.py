"""``make demo``'s Tangram chat against the real ``--tangram`` server: it must show a saving.

The demo is the first thing a user runs; its report says how much KV the conversation holds in
Tangram pages against full KV. With the demo's own flags (``demo_server_args``) and the shipped
default profile (query-agnostic ``kvzip-gate``) every turn must hold less than full KV, and turn 2
("And what is the capital of Italy?", answered from turn 1's compressed notes) must answer Rome,
as stock SGLang with full KV does (a SnapKV-family profile dropped it: "Italy is the capital of
Italy").
"""

from __future__ import annotations

import re

import pytest

from tangram_sglang.demo import (
    DEMO_TURNS,
    SHORT_TURN_NOTE,
    TurnReporter,
    chat,
    demo_server_args,
    full_kv_bytes_per_token,
)

pytestmark = pytest.mark.e2e


def test_the_demo_chat_holds_less_than_full_kv_every_turn(servers, smollm2_path, capsys):
    server = servers.get(demo_server_args(False, "cpu", None), "demo-tangram")
    server.flush_cache().raise_for_status()
    per_token = full_kv_bytes_per_token(smollm2_path, 4)  # the CPU engine serves float32
    turns = chat(server.base_url, DEMO_TURNS, on_turn=TurnReporter(server, per_token))
    out = capsys.readouterr().out
    saved = [int(x) for x in re.findall(r"full KV \(saved (-?\d+)%\)", out)]
    added = [float(x) for x in re.findall(r"this turn added (-?[\d.]+) MiB vs", out)]
    assert len(added) == len(DEMO_TURNS) and all(a > 0 for a in added), added
    assert len(saved) == len(turns) == len(DEMO_TURNS)
    assert all(s > 0 for s in saved), saved
    assert "Rome" in turns[1].reply, turns[1].reply
    assert turns[1].cached_tokens > 0  # turn 1's compressed history was reused, not recomputed
    pairs = re.findall(r"this turn added ([\d.]+) MiB vs ([\d.]+) MiB full KV", out)
    over = any(float(a) > float(b) for a, b in pairs)  # a short turn kept whole, pages rounded
    assert (SHORT_TURN_NOTE in out) == over and out.count(SHORT_TURN_NOTE) <= 1
