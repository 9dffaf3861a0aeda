"""The README's main job: a real SGLang server on the embedded model and a 3-turn chat against it.

``python -m tangram_sglang.demo`` (what ``make demo`` runs) converts the embedded SmolLM2 on first
use, starts ``python -m sglang.launch_server`` on CPU, holds a multi-turn conversation through the
OpenAI client (each turn sends the whole history, as chat clients do), prints every reply with the
prompt tokens the server served from its radix cache and the KV-cache bytes the conversation
holds, then stops the server.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import openai

from tangram_sglang.models import model_path
from tangram_sglang.serving import SGLangServer

DEFAULT_TURNS = (
    "What is the capital of France?",
    "And what is the capital of Italy?",
    "Which of those two cities is further south?",
)


@dataclass(slots=True)
class TurnResult:
    """One chat turn as the server answered it."""

    user: str
    reply: str
    prompt_tokens: int  # tokens
    completion_tokens: int  # tokens
    cached_tokens: int  # prompt tokens served from the radix cache (None from the API -> 0)


def chat(
    base_url: str, turns: tuple[str, ...] | list[str], max_tokens: int = 64
) -> list[TurnResult]:
    """Hold a greedy multi-turn chat through the OpenAI-compatible API.

    Args:
        base_url: server root, e.g. ``http://127.0.0.1:30000``.
        turns: user messages, one per turn; each request carries the whole history.
        max_tokens: reply cap per turn (tokens).

    Returns:
        One :class:`TurnResult` per turn.
    """
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none")
    messages: list[dict[str, str]] = []
    results = []
    for user in turns:
        messages.append({"role": "user", "content": user})
        resp = client.chat.completions.create(
            model="default", messages=messages, temperature=0, max_tokens=max_tokens
        )
        reply = resp.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": reply})
        details = resp.usage.prompt_tokens_details
        results.append(
            TurnResult(
                user=user,
                reply=reply,
                prompt_tokens=resp.usage.prompt_tokens,
                completion_tokens=resp.usage.completion_tokens,
                cached_tokens=(details.cached_tokens or 0) if details else 0,
            )
        )
    return results


def full_kv_bytes_per_token(model_dir: Path, dtype_bytes: int) -> int:
    """Bytes stock SGLang stores per token: K and V for every layer and KV head."""
    cfg = json.loads((model_dir / "config.json").read_text())
    heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * heads * head_dim * dtype_bytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tangram_sglang.demo", description=__doc__)
    parser.add_argument("--model", default="smollm2", help="embedded model name")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--log", default="/tmp/tangram-demo-server.log", help="server log file")
    args = parser.parse_args(argv)

    folder = model_path(args.model)
    print(f"model: {folder}")
    print("starting SGLang (about a minute on CPU) ...", flush=True)
    with SGLangServer(folder, device=args.device, log_path=args.log) as server:
        info = server.server_info()
        print(
            f"server up: sglang {info.get('version')}, attention backend "
            f"{info.get('attention_backend')}, KV dtype {info.get('dtype')}"
        )
        per_token = full_kv_bytes_per_token(folder, 4 if info.get("dtype") == "float32" else 2)
        for i, turn in enumerate(chat(server.base_url, DEFAULT_TURNS), start=1):
            held = (turn.prompt_tokens + turn.completion_tokens) * per_token
            print(f"\n--- turn {i} ---\nuser:      {turn.user}\nassistant: {turn.reply}")
            print(
                f"prompt tokens {turn.prompt_tokens}, served from the radix cache "
                f"{turn.cached_tokens}, KV held by the conversation {held / 2**20:.2f} MiB"
            )
    print("\nserver stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
