"""A system prompt shared by many conversations is held once (CPU, SmolLM2, 0.5 profile).

One ``--tangram`` server with the default ``--tangram-min-compress-tokens`` (256): a first turn
of a system prompt + a short question is shorter than that, so it is one segment kept whole.
A second conversation with the same system prompt and another question matches the first one's
segment up to the token where the two prompts differ (the segment is split there, as SGLang's
tree splits a node): it reuses the system prompt's pages instead of prefilling and holding its
own copy, and the pool holds one copy (idle: pages used = pages the tree holds, and the second
conversation added only its own tokens' pages).
"""

from __future__ import annotations

import pytest
import requests

from tangram_sglang.serving import SGLangServer

pytestmark = pytest.mark.e2e

PROFILE_05 = "calibration/smollm2/ada-snapkv-r0.5.json"
SYSTEM = (
    "You are the help desk of the Port Avel ferry company. Answer in one short sentence. "
    "Ferries leave the north pier at 7, 9, 12 and 17 o'clock on weekdays and at 10 and 15 "
    "o'clock on weekends. A single ticket costs 4 euros, a return ticket 7 euros, children "
    "under 12 travel free, bicycles cost 2 euros and dogs travel free on a lead. The ticket "
    "office opens thirty minutes before the first departure and closes after the last one."
)
QUESTIONS = ("When is the first ferry on a Monday?", "How much is a return ticket?")


@pytest.fixture(scope="module")
def server(servers) -> SGLangServer:
    """The session's server of this configuration (``conftest.py``)."""
    return servers.get(["--tangram", "--tangram-profile", PROFILE_05], "tangram-r0.5-default")


def chat(server: SGLangServer, question: str) -> dict:
    resp = requests.post(
        f"{server.base_url}/v1/chat/completions",
        json={
            "model": "default",
            "temperature": 0,
            "max_tokens": 8,
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": question},
            ],
        },
        timeout=900,
    )
    assert resp.status_code == 200, resp.text
    usage = resp.json()["usage"]
    return {
        "prompt": usage["prompt_tokens"],
        "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
    }


def pool(server: SGLangServer) -> dict:
    return server.server_info()["internal_states"][0]["tangram_pool"]


def test_two_conversations_with_one_system_prompt_share_its_pages(server, smollm2_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    ids = [
        tokenizer.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
            add_generation_prompt=True,
        )["input_ids"]
        for q in QUESTIONS
    ]
    common = next(i for i, (a, b) in enumerate(zip(*ids, strict=False)) if a != b)
    assert common < 256 and len(ids[0]) < 256  # one segment kept whole
    resp = server.flush_cache()
    assert resp.status_code == 200
    first = chat(server, QUESTIONS[0])
    after_one = pool(server)
    second = chat(server, QUESTIONS[1])
    after_two = pool(server)
    assert first["cached"] == 0
    assert second["cached"] == common  # the shared part of the first segment, to the token
    held_one, held_two = after_one["radix"]["pages_held"], after_two["radix"]["pages_held"]
    assert after_two["radix"]["whole_segments_split"] >= 1
    # One copy: idle, the pool holds exactly the tree's pages, and the second conversation
    # added about its own tokens' pages (its question and reply), far from a second copy.
    assert after_two["pages_used"] == held_two
    own_share = (second["prompt"] - common + 8) / first["prompt"]
    assert held_two - held_one < held_one * (own_share + 0.25), (held_one, held_two, own_share)
