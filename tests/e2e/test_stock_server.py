"""Stock SGLang 0.5.17 serving the real embedded model on CPU through its HTTP API."""

from __future__ import annotations

import pytest
import requests
import torch
from recall_chat import KEYWORD, recall_chat

from tangram_sglang.demo import DEFAULT_TURNS, chat, report_turn, server_banner

pytestmark = pytest.mark.e2e


@pytest.fixture
def server(stock_server):
    """The session's stock server (``conftest.py``), shared with ``test_tangram_serving.py``."""
    return stock_server


def test_three_turn_chat_reuses_the_radix_cache(server):
    turns = chat(server.base_url, DEFAULT_TURNS)
    assert all(t.reply.strip() for t in turns), [t.reply for t in turns]
    assert "Paris" in turns[0].reply
    assert "Rome" in turns[1].reply
    # Turn 1 sees a cold cache; turns 2 and 3 reuse the whole previous conversation.
    assert turns[0].cached_tokens == 0
    for prev, cur in zip(turns, turns[1:], strict=False):
        assert cur.cached_tokens > 0
        assert cur.cached_tokens >= prev.prompt_tokens  # all of the previous prompt was reused
        assert cur.cached_tokens < cur.prompt_tokens


def test_demo_full_kv_report_on_the_stock_server(server, capsys):
    """``demo --full-kv``'s banner and per-turn report on stock SGLang's real server info."""
    print("\n".join(server_banner(server.server_info())))
    turn = chat(server.base_url, DEFAULT_TURNS[:1])[0]
    report_turn(server, 1000, 1, turn)
    out = capsys.readouterr().out
    assert out.startswith("server up: sglang 0.5.17") and "Tangram profile" not in out
    full = (turn.prompt_tokens + turn.completion_tokens) * 1000 / 2**20
    assert f"KV held by the request (full KV): {full:.2f} MiB" in out
    assert "compressed" not in out


def test_fact_from_turn1_is_recalled_in_turn3(server):
    """Full KV recalls the probe's fact (the reference for the Tangram 0.5 recall test)."""
    turns = recall_chat(server.base_url)
    assert KEYWORD not in turns[0].reply  # the fact is only in turn 1's prompt
    assert KEYWORD in turns[2].reply, [t.reply for t in turns]
    assert turns[2].cached_tokens > 0  # turn 3 extends the cached history


def test_greedy_tokens_match_transformers(server, smollm2_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )["input_ids"]
    resp = requests.post(
        f"{server.base_url}/generate",
        json={
            "input_ids": ids,
            "sampling_params": {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True},
        },
        timeout=120,
    ).json()
    sglang_ids = resp["output_ids"]

    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    seq = torch.tensor([ids])
    hf_ids = []
    with torch.no_grad():  # plain argmax loop: EOS is not masked, nothing stops early
        for _ in range(16):
            nxt = model(seq).logits[0, -1].argmax().item()
            hf_ids.append(nxt)
            seq = torch.cat([seq, torch.tensor([[nxt]])], dim=1)
    assert sglang_ids == hf_ids
    assert "Paris" in tok.decode(hf_ids)


def test_server_info_reports_the_cpu_setup(server):
    info = server.server_info()
    assert info["version"] == "0.5.17"
    assert info["device"] == "cpu"
    assert info["dtype"] == "float32"
