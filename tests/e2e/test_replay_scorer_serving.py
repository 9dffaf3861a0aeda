"""The query-agnostic scorers that need more than a profile's budgets, on the real ``--tangram``
server (SmolLM2, CPU).

``kvzip-replay`` rotates each segment's queries with the served model's RoPE frequencies, which
the attention backend binds at start-up; an unbound scorer raises at the first compressed
prefill. ``kvzip-gate`` scores each token from its key and value with the gate weights its
profile carries, through the backend's token-scorer path (values and layer passed in). The
demo's chat (its turns are long enough to be compressed under the demo's threshold) must
therefore run through compressed prefills, hold less KV than full KV on every turn, and report
the scorer it runs in ``/get_server_info``.

``kvzip`` scores each compressed segment by KVzip's replay, run in the same extend forward:
the scheduler adds the repeat prompt and the segment's ids again to the row, the backend scores
the segment's keys by the replay's queries and never stores the replay's K/V. The replay must
leave the segment's own forward as it is (the first reply token is the same as under another
scorer), run for every compressed segment (counted in ``/get_server_info``), and refuse
logprobs with a clear HTTP 400.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

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


def _chat_saves_on_every_turn(server, smollm2_path, capsys) -> None:
    """The demo's chat on ``server`` (cache flushed first): every turn answers and holds less KV
    than full KV would."""
    server.flush_cache().raise_for_status()
    per_token = full_kv_bytes_per_token(smollm2_path, 4)  # the CPU engine serves float32
    turns = chat(server.base_url, DEMO_TURNS, on_turn=TurnReporter(server, per_token))
    saved = [int(x) for x in re.findall(r"full KV \(saved (-?\d+)%\)", capsys.readouterr().out)]
    assert len(saved) == len(turns) == len(DEMO_TURNS)
    assert all(s > 0 for s in saved), saved
    assert all(t.reply.strip() for t in turns)


@pytest.mark.parametrize("scorer", ["kvzip-replay", "kvzip-gate", "kvzip"])
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
    assert info["tangram"]["window_share"] == 0
    _chat_saves_on_every_turn(server, smollm2_path, capsys)


def _kvzip_args(scorer: str) -> list[str]:
    return [
        "--tangram",
        "--tangram-scorer",
        scorer,
        "--tangram-min-compress-tokens",
        str(DEMO_MIN_COMPRESS_TOKENS),
    ]


def _first_token(server, messages) -> tuple[str, int]:
    """The greedy first reply token of a chat and its prompt's token count."""
    resp = requests.post(
        f"{server.base_url}/v1/chat/completions",
        json={"model": "default", "messages": messages, "temperature": 0, "max_tokens": 1},
        timeout=300,
    )
    resp.raise_for_status()
    body = resp.json()
    return body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens"]


def test_the_kvzip_replay_runs_for_each_compressed_segment_and_changes_no_reply_token(servers):
    kvzip = servers.get(_kvzip_args("kvzip"), "tangram-kvzip")
    kvzip.flush_cache().raise_for_status()
    pool = lambda: kvzip.server_info()["internal_states"][0]["tangram_pool"]  # noqa: E731
    before = pool()["replay_tokens"]
    messages = [{"role": "user", "content": DEMO_TURNS[0]}]
    token, prompt_tokens = _first_token(kvzip, messages)
    after = pool()["replay_tokens"]
    # the replay repeats the whole first turn (one segment) after KVzip's prompt
    assert prompt_tokens >= DEMO_MIN_COMPRESS_TOKENS
    assert prompt_tokens < after - before < prompt_tokens + 40
    # a short turn is kept whole: nothing to score, no replay
    short = [{"role": "user", "content": "Hi!"}]
    _first_token(kvzip, short)
    assert pool()["replay_tokens"] == after
    # the segment's own attention is the same with the replay after it
    # the demo's chat: turn 2 asks about turn 1's notes, whose tokens KVzip's replay kept
    kvzip.flush_cache().raise_for_status()
    turns = chat(kvzip.base_url, DEMO_TURNS)
    assert "Rome" in turns[1].reply, turns[1].reply
    lite = servers.get(_kvzip_args("kvzip-lite"), "tangram-kvzip-lite")
    lite.flush_cache().raise_for_status()
    assert _first_token(lite, messages)[0] == token


def test_a_kvzip_server_refuses_logprobs_with_a_clear_error(servers):
    kvzip = servers.get(_kvzip_args("kvzip"), "tangram-kvzip")
    resp = requests.post(
        f"{kvzip.base_url}/v1/chat/completions",
        json={
            "model": "default",
            "messages": [{"role": "user", "content": "Hi!"}],
            "max_tokens": 2,
            "logprobs": True,
        },
        timeout=120,
    )
    assert resp.status_code == 400, resp.text
    assert "--tangram-scorer kvzip" in resp.text and "logprobs" in resp.text
    # the server still answers
    assert _first_token(kvzip, [{"role": "user", "content": "Hi!"}])[1] > 0


@pytest.mark.parametrize("scorer", ["kvzip-lite", "kvzip-gate"])
def test_a_window_share_profile_serves_compressed_turns(
    servers, smollm2_path, tmp_path_factory, capsys, scorer
):
    """``provenance.scorer_options.window_share`` through the real server: a copy of the
    shipped profile with a share of 0.25 starts, runs the fused selection on every compressed
    prefill (kvzip-lite's own ``score``, the gate's second SnapKV call) and still holds less KV
    than full KV on every turn of the demo's chat."""
    shipped = json.loads(Path(f"calibration/smollm2/{scorer}-r0.25.json").read_text())
    shipped["provenance"]["scorer_options"]["window_share"] = 0.25
    profile = tmp_path_factory.mktemp(f"share-{scorer}") / f"{scorer}-r0.25.json"
    profile.write_text(json.dumps(shipped))
    args = ["--tangram", "--tangram-profile", str(profile)]
    args += ["--tangram-min-compress-tokens", str(DEMO_MIN_COMPRESS_TOKENS)]
    server = servers.get(args, f"tangram-{scorer}-share")
    info = requests.get(f"{server.base_url}/get_server_info", timeout=60).json()
    assert info["tangram"]["scorer"] == scorer
    assert info["tangram"]["profile_path"] == str(profile)
    assert info["tangram"]["window_share"] == 0.25
    _chat_saves_on_every_turn(server, smollm2_path, capsys)
