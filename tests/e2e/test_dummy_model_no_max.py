"""The GPU benchmarks' setup on CPU: a dummy-weight model folder (config only) given a tokenizer
by ``bench.dummy_tokenizer``, served by stock SGLang without ``--skip-tokenizer-init``, so
requests without ``max_new_tokens`` hold their drawn lengths with ``min_new_tokens``, and
``--client sglang`` sends the conversations through SGLang's own bench_serving over
``/v1/chat/completions`` (the tokenizer's plain chat template)."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest

from tangram_sglang.bench import multiturn as mt
from tangram_sglang.bench.dummy_tokenizer import write_dummy_tokenizer
from tangram_sglang.bench.multiturn_client import no_max_length

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 2048,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-05,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
    "transformers_version": "4.43.0",  # without it transformers warns about a Mistral regex
}


def tiny_dummy_model(folder: Path) -> tuple[Path, list[Path]]:
    """A dummy-weight :data:`TINY_LLAMA` folder under ``folder`` with its generated tokenizer:
    (the model folder, the tokenizer files written)."""
    model = folder / "tiny-dummy"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))
    return model, write_dummy_tokenizer(model)


def test_no_max_workload_on_a_dummy_model_with_its_generated_tokenizer(tmp_path):
    model, written = tiny_dummy_model(tmp_path)
    assert len(written) == 2
    out = tmp_path / "r.json"
    argv = ["--model-path", str(model), "--device", "cpu", "--systems", "baseline"]
    argv += ["--workloads", "long-context:2x2:no-max", "--context-tokens", "64"]
    argv += ["--request-length", "8", "--output-length", "6", "--workload-timeout-s", "300"]
    argv += ["--server-args=--load-format dummy", "--log-dir", str(tmp_path)]
    assert mt.main([*argv, "--output", str(out)]) == 0
    entry = json.loads(out.read_text())["systems"]["baseline"]
    assert entry["error"] is None
    run = entry["workloads"]["long-context-2x2-no-max"]
    assert run["requests_ok"] == 4 and run["requests_failed"] == 0
    seed = zlib.crc32(b"long-context-2x2-no-max")  # the bench's per-workload seed (--seed 0)
    drawn = [no_max_length(6, seed, c, r) for c in range(2) for r in range(2)]
    assert run["mean_output_tokens"] == sum(drawn) / 4  # every request held its drawn length


def test_sglang_bench_serving_runs_the_conversations_over_the_chat_api(tmp_path):
    model, _ = tiny_dummy_model(tmp_path)
    out = tmp_path / "r.json"
    argv = ["--model-path", str(model), "--device", "cpu", "--systems", "baseline"]
    argv += ["--client", "sglang", "--workloads", "short-chat:2x3", "--request-length", "24"]
    argv += ["--output-length", "4", "--workload-timeout-s", "300", "--warmup-clients", "1"]
    argv += ["--server-args=--load-format dummy", "--log-dir", str(tmp_path)]
    assert mt.main([*argv, "--output", str(out)]) == 0
    entry = json.loads(out.read_text())["systems"]["baseline"]
    assert entry["error"] is None
    run = entry["workloads"]["short-chat-2x3"]
    assert run["client"] == "sglang.benchmark.serving (sglang-oai-chat)"
    assert run["requests_planned"] == 6 and run["requests_ok"] == 6
    assert run["requests_failed"] == 0 and run["output_tokens"] == 6 * 4  # ignore_eos
    assert run["output_tokens_short"] == 0 and run["first_errors"] == []
    assert run["output_tok_per_s"] > 0 and run["ttft_s"]["p50"] > 0
    # every round resends the history as text: round 3 of a client holds 24 + 4 + 128 + 4 + 128
    # words of its own, so the prompts the server counted grow round by round
    assert run["prompt_tokens"] >= 2 * (24 + (24 + 4 + 128) + (24 + 4 + 128 + 4 + 128))
    assert 0 < run["cache_hit_rate"] < 1  # rounds 2 and 3 reuse the history (radix cache)
    # /metrics is polled once a second: a sub-second run may show no request running
    assert run["peak_running_reqs"] is not None and 0 <= run["peak_running_reqs"] <= 2
    trace = json.loads((tmp_path / "baseline" / "short-chat-2x3.trace.json").read_text())
    assert [len(turns) for turns in trace["conversations"]] == [3, 3]
