"""``--tangram --tp-size 3`` on CPU: SmolLM2's 3 KV heads, one per TP rank (gloo all-reduce).

SGLang's CPU engine runs tensor parallelism with gloo (``serving.cpu_tp_env`` sets the per-rank
core binding and keeps SGLang off the venv's NCCL library). Each rank builds its own Tangram pool
from its rank profile (``tangram_sglang/tp.py``):

* a ratio-1.0 profile keeps every token on every rank: greedy tokens of a 3-turn chat (turns 2-3
  reuse the radix-cached history) equal stock SGLang's at the same ``--tp-size``;
* every rank logs a pool of the same number of pages, the start-up summary names the shard
  (``tp_size``, ``kv_heads_per_rank``), and the pages come back once the tree is flushed.
"""

from __future__ import annotations

import re

import pytest
import requests
from factories import ratio_one_profile

from tangram_sglang.serving import SGLangServer

pytestmark = pytest.mark.e2e

TP = ["--tp-size", "3"]
TURNS = (
    "My name is Ada and I live in Lyon. What is the capital of France?",
    "And what is the capital of Italy?",
    "What is my name, and which city do I live in?",
)
POOL_LINE = re.compile(r"\[[^\]]* TP(\d)\] Tangram KV pool: (\d+) pages")


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


def greedy_chat(base_url: str, tokenizer, max_new_tokens: int = 24) -> tuple[list, list]:
    """Token ids of each greedy reply of :data:`TURNS` and each turn's cached tokens."""
    messages, outputs, cached = [], [], []
    for user in TURNS:
        messages.append({"role": "user", "content": user})
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        resp = requests.post(
            f"{base_url}/generate",
            json={
                "input_ids": ids,
                "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens},
            },
            timeout=600,
        ).json()
        outputs.append(resp["output_ids"])
        cached.append(resp["meta_info"]["cached_tokens"])
        reply = tokenizer.decode(resp["output_ids"], skip_special_tokens=True)
        messages.append({"role": "assistant", "content": reply})
    return outputs, cached


def test_ratio_one_profile_at_tp3_is_token_identical_to_stock_tp3(
    smollm2_path, tokenizer, tmp_path, servers
):
    # One TP server at a time and nothing else of the session alive: each rank's gloo
    # all-reduce waits for the other ranks, and on 2 shared cores busy-polling schedulers of
    # other servers starved a warm-up forward past SGLang's 300 s watchdog.
    servers.stop_all()
    with SGLangServer(
        smollm2_path, TP, log_path=tmp_path / "stock-tp3.log", startup_timeout_s=900
    ) as stock:
        expected, _ = greedy_chat(stock.base_url, tokenizer)
    profile = ratio_one_profile(tmp_path / "ratio1.json", smollm2_path)
    args = ["--tangram", "--tangram-profile", profile, *TP]
    with SGLangServer(
        smollm2_path, args, log_path=tmp_path / "tangram-tp3.log", startup_timeout_s=900
    ) as server:
        got, cached = greedy_chat(server.base_url, tokenizer)
        info = server.server_info()
        server.flush_cache().raise_for_status()
        pool = server.server_info()["internal_states"][0]["tangram_pool"]
    pages = {int(rank): int(n) for rank, n in POOL_LINE.findall(server.log_path.read_text())}

    assert got == expected
    assert all(c > 0 for c in cached[1:]), cached  # turns 2-3 extend the reused history
    summary = info["tangram"]
    assert (summary["tp_size"], summary["kv_heads_per_rank"]) == (3, 1)
    assert summary["tp_budget_overhead"] == 0.0  # ratio 1.0: nothing to share
    assert sorted(pages) == [0, 1, 2] and len(set(pages.values())) == 1, pages
    assert pool["pages_free"] == pool["pages_free_at_start"]
