"""``TANGRAM_HISTORY_ATTENTION=flashinfer`` on a real CPU server (SmolLM2, ratio 1.0).

The GPU runs the history part of such batches through FlashInfer's paged prefill; a CPU server
runs the same per-batch plans (``kernels.history_attention.plan_paged_history``: each layer's
single-head page ids read from the page table, head-major queries) through FlashInfer's
semantics in torch. Greedy multi-turn chats, several at once, whose later turns reuse their
history through the radix tree, give the same tokens as the server without the switch: the
plans hand every layer's KV heads exactly their history. The ratio-1.0 profile groups 4 KV
heads per page across layers (SmolLM2 has 3 per layer), so a layer's heads sit in columns of
groups shared with other layers: each layer's page ids differ.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from chats import conversation
from factories import ratio_one_profile

from tangram_sglang.serving import SGLangServer

pytestmark = pytest.mark.e2e

CHUNK_TOKENS = 4096  # as tests/e2e/test_overlap.py: the pool then shares its ratio-1.0 server
NOTES = "My name is Ada and I live in Lyon, near the river, with two cats and a piano. " * 4
TOPICS = ("rivers of Europe", "the history of tea", "how bridges stand")
FOLLOW_UPS = ("Tell me one more detail.", "What is my name and where do I live?")


def all_conversations(server: SGLangServer) -> list[list[str]]:
    with ThreadPoolExecutor(len(TOPICS)) as pool:
        return list(
            pool.map(
                lambda topic: conversation(
                    server, f"{NOTES} Tell me about {topic}.", FOLLOW_UPS, 10
                ),
                TOPICS,
            )
        )


def test_paged_history_plans_give_the_same_tokens_as_tangrams_history(
    servers, tmp_path_factory, smollm2_path
):
    profile = ratio_one_profile(tmp_path_factory.mktemp("paged") / "ratio1.json", smollm2_path)
    args = ["--tangram", "--tangram-profile", profile, "--chunked-prefill-size", str(CHUNK_TOKENS)]
    plain = servers.get(args, "overlap-1.0-on")
    want = all_conversations(plain)
    paged = servers.get(args, "paged-history", env={"TANGRAM_HISTORY_ATTENTION": "flashinfer"})
    got = all_conversations(paged)
    assert got == want
    assert all(len(a) > 0 for answers in got for a in answers)
    assert "first extend batch with a paged-history plan" in paged.log_path.read_text()
    assert "history flashinfer (TANGRAM_HISTORY_ATTENTION)" in paged.log_path.read_text()
    assert "paged-history plan" not in plain.log_path.read_text()
