"""The README's main job: a real Tangram server on the embedded model and a 3-turn chat against it.

``python -m tangram_sglang.demo`` (what ``make demo`` runs) converts the embedded SmolLM2 on first
use, starts ``python -m sglang.launch_server --tangram`` on CPU with the shipped budget profile,
holds a multi-turn conversation through the OpenAI client (each turn sends the whole history, as
chat clients do), prints every reply with the prompt tokens served from the radix cache and the
KV-cache bytes the turn's request held in Tangram's ragged pages against what stock SGLang's full
KV holds for the same tokens, then stops the server. ``--full-kv`` runs stock SGLang instead.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import openai

from tangram_sglang.errors import ConfigError, ProfileError, TangramError
from tangram_sglang.integration.profile_loader import CALIBRATION_DIR
from tangram_sglang.models import model_path
from tangram_sglang.profile import BudgetProfile
from tangram_sglang.serving import CUDA_STOCK_FLAGS, SGLangServer

# A long first turn: compression keeps sinks and a recent window whole, so savings show on
# segments of a few hundred tokens, not on one-line prompts.
NOTES = (
    "Here are my travel notes. Paris is the capital of France and sits on the Seine; its museums "
    "include the Louvre and the Musee d'Orsay. Lyon, the third largest French city, is known for "
    "its food and lies where the Rhone meets the Saone. Marseille is an old port on the "
    "Mediterranean. Rome is the capital of Italy; the Colosseum and the Forum stand in its "
    "centre, and the Vatican lies within the city. Milan is the business capital of northern "
    "Italy, with its cathedral and its fashion houses. Naples, further south, faces Mount "
    "Vesuvius and is said to be the home of pizza. Madrid is the capital of Spain, high on the "
    "central plateau, with the Prado museum. Barcelona, on the coast of Catalonia, is famous for "
    "the buildings of Gaudi. Lisbon is the capital of Portugal, built on hills above the Tagus "
    "river, with yellow trams and tiled facades. Berlin is the capital of Germany and Vienna the "
    "capital of Austria, on the Danube. "
)
DEMO_TURNS = (
    NOTES + "Using my notes, what is the capital of France?",
    "And what is the capital of Italy?",
    "Which of those two cities is further south?",
)
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
    base_url: str,
    turns: tuple[str, ...] | list[str],
    max_tokens: int = 64,
    on_turn: Callable[[int, TurnResult], None] | None = None,
) -> list[TurnResult]:
    """Hold a greedy multi-turn chat through the OpenAI-compatible API.

    Args:
        base_url: server root, e.g. ``http://127.0.0.1:30000``.
        turns: user messages, one per turn; each request carries the whole history.
        max_tokens: reply cap per turn (tokens).
        on_turn: called with (turn number from 1, result) as soon as each turn is answered.

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
        if on_turn is not None:
            on_turn(len(results), results[-1])
    return results


def tangram_pool(server: SGLangServer) -> dict | None:
    """The live Tangram pool numbers (``/server_info``), or None on a stock server."""
    states = server.server_info().get("internal_states") or [{}]
    return states[0].get("tangram_pool")


def full_kv_bytes_per_token(model_dir: Path, dtype_bytes: int) -> int:
    """Bytes stock SGLang stores per token: K and V for every layer and KV head."""
    cfg = json.loads((model_dir / "config.json").read_text())
    heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * heads * head_dim * dtype_bytes


def report_turn(
    server: SGLangServer,
    per_token_bytes: int,
    i: int,
    turn: TurnResult,
    before: tuple[int, int] = (0, 0),
) -> tuple[int, int]:
    """Print one answered turn: the reply, radix-cache reuse, KV bytes held vs full KV.

    Under ``--tangram`` the finished turn's compressed segments stay in the radix tree, so the
    next turn reports them as cached tokens (reused, not recomputed); the tree's pages are the
    whole conversation's KV (the demo flushes the cache first, so nothing else is in it).

    Args:
        per_token_bytes: full KV bytes of one token (K and V, all layers).
        before: ``(held, full)`` bytes after the previous turn (what this returned then), so the
            report can say what this turn added; ``(0, 0)`` for the first turn.

    Returns:
        ``(held, full)``: bytes the conversation holds now (Tangram pages in the radix tree; the
        full-KV figure on a stock server) and what full KV would hold.
    """
    pool = tangram_pool(server)
    kind = "compressed KV" if pool else "KV"
    print(f"\n--- turn {i} ---\nuser:      ...{turn.user[-60:]}\nassistant: {turn.reply}")
    print(
        f"prompt tokens {turn.prompt_tokens}, served from the radix cache {turn.cached_tokens}"
        f" (earlier turns' {kind}, reused without recomputation)"
    )
    full = (turn.prompt_tokens + turn.completion_tokens) * per_token_bytes
    if not (pool and pool.get("last_release")):
        print(f"KV held by the request (full KV): {full / 2**20:.2f} MiB")
        return full, full
    radix = pool.get("radix") or {}
    held = radix.get("pages_held", 0) * pool["bytes_per_page"] or pool["last_release"]["bytes_held"]
    added, added_full = held - before[0], full - before[1]
    print(
        f"whole conversation held: {held / 2**20:.2f} MiB vs {full / 2**20:.2f} MiB full KV "
        f"(saved {1 - held / full:.0%}); this turn added {added / 2**20:.2f} MiB vs "
        f"{added_full / 2**20:.2f} MiB full KV; pool pages free "
        f"{pool['pages_free']}/{pool['pages_total']}"
    )
    return held, full


class TurnReporter:
    """``chat``'s ``on_turn`` callback: :func:`report_turn` with the previous turn's figures.

    Args:
        server: the running server (its ``/server_info`` pool figures).
        per_token_bytes: full KV bytes of one token (K and V, all layers).
    """

    def __init__(self, server: SGLangServer, per_token_bytes: int) -> None:
        self.server = server
        self.per_token_bytes = per_token_bytes
        self.before = (0, 0)
        self.explained = False

    def __call__(self, i: int, turn: TurnResult) -> None:
        held, full = report_turn(self.server, self.per_token_bytes, i, turn, self.before)
        if not self.explained and _mib(held - self.before[0]) > _mib(full - self.before[1]):
            print(SHORT_TURN_NOTE)  # once, when the printed figures show a turn over full KV
            self.explained = True
        self.before = (held, full)


def _mib(num_bytes: int) -> float:
    """Bytes as the report prints them (MiB, 2 decimals)."""
    return round(num_bytes / 2**20, 2)


SHORT_TURN_NOTE = (
    "(a turn shorter than --tangram-min-compress-tokens is kept whole, and each head group's "
    "tokens fill whole pages, so a short turn holds about its full KV, a little more with the "
    "pages' rounding; the saving comes from the long segments, here the first turn's notes)"
)


DEMO_MIN_COMPRESS_TOKENS = 128  # the demo's first turn (~250 tokens) is compressed


def demo_server_args(full_kv: bool, device: str, profile: str | None) -> list[str]:
    """``launch_server`` flags for the demo: ``--tangram`` (+ ``--tangram-profile``) or stock.

    Under ``--tangram`` segments of :data:`DEMO_MIN_COMPRESS_TOKENS` tokens or more are
    compressed (the server's default, 256, would keep this short chat's turns whole and show no
    saving). Stock SGLang on CUDA gets :data:`~tangram_sglang.serving.CUDA_STOCK_FLAGS` (triton:
    the ``sgl_kernel`` of the GPU wheelhouse has no FA3, SGLang's Hopper default).
    """
    if full_kv:
        return [x for kv in CUDA_STOCK_FLAGS.items() for x in kv] if device == "cuda" else []
    threshold = ["--tangram-min-compress-tokens", str(DEMO_MIN_COMPRESS_TOKENS)]
    return ["--tangram", *threshold] + (["--tangram-profile", profile] if profile else [])


def server_banner(info: dict) -> list[str]:
    """Lines about a started server from its ``/get_server_info`` dict.

    Under ``--tangram`` the plugin reports a dict under ``tangram`` (profile path, mean kept
    ratio, head groups); a stock server reports the ``tangram`` flag itself (False).
    """
    lines = [
        f"server up: sglang {info.get('version')}, attention backend "
        f"{info.get('attention_backend')}, KV dtype {info.get('dtype')}"
    ]
    t = info.get("tangram")
    if isinstance(t, dict):
        ratio, groups = t.get("mean_kept_ratio", 0.0), t.get("num_head_groups")
        lines.append(
            f"Tangram profile {t.get('profile_path')}: mean kept ratio {ratio:.3f}, "
            f"{groups} head groups"
        )
        target = t.get("profile_target_ratio")
        if isinstance(target, (int, float)) and ratio > target:
            lines.append(
                f"  (calibrated at {target:g}: each KV head keeps its mean need + 2 std over the "
                "calibration samples, so no request runs short; each segment's sinks and last "
                "window tokens, and segments too short to score, are kept on top)"
            )
    return lines


DESCRIPTION = """\
Start a real Tangram server (python -m sglang.launch_server --tangram) on an embedded model,
hold a 3-turn chat with it through the OpenAI client, print each reply with the KV-cache memory
the conversation holds against stock SGLang's full KV, then stop the server.
The model is converted from its installed wheel on first use."""


def this_python() -> str:
    """The running interpreter as a user would type it here: relative to the working folder
    when inside it (``.venv/bin/python`` after ``make demo``), else its absolute path."""
    path = os.path.relpath(sys.executable)
    if path.startswith(".."):
        path = sys.executable
    elif os.sep not in path:
        path = os.path.join(".", path)
    return shlex.quote(path)


def main(argv: list[str] | None = None) -> int:
    from tangram_sglang.models import MODELS

    parser = argparse.ArgumentParser(
        prog="python -m tangram_sglang.demo",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--model",
        default="smollm2",
        choices=sorted(MODELS),
        help="embedded model (default: smollm2)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="where the server runs (default: cpu)",
    )
    parser.add_argument("--full-kv", action="store_true", help="run stock SGLang (no --tangram)")
    parser.add_argument("--profile", help="Tangram budget profile (default: the shipped one)")
    parser.add_argument(
        "--log",
        help="server log file, kept (default: tangram-demo-server-PID.log in the temp folder, "
        "removed after a run that succeeds, kept when it fails)",
    )
    args = parser.parse_args(argv)
    temp_log = args.log is None
    if temp_log:
        args.log = os.path.join(tempfile.gettempdir(), f"tangram-demo-server-{os.getpid()}.log")
    try:
        code = run_demo(args)
    except TangramError as exc:
        print(f"error: {exc}", file=sys.stderr)
        if os.path.exists(args.log) and args.log not in str(exc):  # start-up errors name it
            print(f"the server's log: {args.log}", file=sys.stderr)
        return 2
    except BaseException:  # e.g. the server lost mid-chat, Ctrl-C: say where its log is
        if os.path.exists(args.log):
            print(f"the server's log: {args.log}", file=sys.stderr)
        raise
    if temp_log and code == 0:
        with contextlib.suppress(FileNotFoundError):
            os.remove(args.log)
    return code


def check_demo_args(args: argparse.Namespace) -> None:
    """Refuse flag combinations that would waste a server start-up.

    Raises:
        ConfigError: ``--profile`` with ``--full-kv`` (stock SGLang takes no profile),
            ``--device cuda`` where torch sees no GPU (the server would die in start-up), or a
            Tangram run of a ``--model`` with no shipped profile and no ``--profile`` (checked
            before the model is converted); an empty ``--log`` or ``--profile``, a ``--log``
            that is a folder or whose folder does not exist.
    """
    if args.profile is not None and not args.profile.strip():
        raise ConfigError("--profile is empty; give a path or leave --profile out")
    if args.full_kv and args.profile:
        raise ConfigError(
            f"--profile {args.profile}: --full-kv runs stock SGLang, which takes "
            "no profile; drop one of the two flags"
        )
    if not args.full_kv and not args.profile:
        shipped = CALIBRATION_DIR / args.model
        if not any(shipped.glob("*.json")):
            raise ConfigError(
                f"--model {args.model}: no Tangram profile ships for it ({shipped}/ holds "
                "none); pass --profile PATH, run stock SGLang with --full-kv, or calibrate one "
                f"with `python -m tangram_sglang.calibrate --model-path {args.model} --scorer "
                f"kvzip-gate --target-ratio 0.25 --output {shipped}/kvzip-gate-r0.25.json`"
            )
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: torch sees no GPU here; use --device cpu")

    if args.log is not None:
        if not args.log.strip():
            raise ConfigError("--log is empty; give a path or leave --log out")
        folder = os.path.dirname(os.path.abspath(args.log))
        if os.path.isdir(args.log):
            raise ConfigError(f"--log {args.log} is a folder; give a file path inside it")
        if not os.path.isdir(folder):
            raise ConfigError(
                f"--log {args.log}: folder {folder} does not exist; create it or give another path"
            )


def run_demo(args: argparse.Namespace) -> int:
    """Start the server, chat, report; raises TangramError on a bad model, profile or start."""
    check_demo_args(args)
    if args.profile:  # never with --full-kv (check_demo_args)
        try:  # fail before a minute of server start-up
            profile = BudgetProfile.load(args.profile)
        except ProfileError as exc:
            raise ProfileError(
                f"--profile: {exc}; pass a profile JSON (the shipped ones are "
                "calibration/<model>/*.json), leave --profile out for the shipped default, or "
                "calibrate one with python -m tangram_sglang.calibrate"
            ) from None
        from tangram_sglang.backend.state import build_scorer  # torch: only with --profile

        try:  # its scorer options too (names and values), as the server's start-up checks them
            build_scorer(profile)
        except ConfigError as exc:
            raise ConfigError(f"--profile {args.profile}: {exc}") from None
    folder = model_path(args.model)
    server_args = demo_server_args(args.full_kv, args.device, args.profile)
    print(f"model: {folder}")
    shown = " ".join(["SGLang", *server_args])
    print(f"starting {shown} (about a minute on CPU; log {args.log}) ...", flush=True)
    with SGLangServer(folder, server_args, device=args.device, log_path=args.log) as server:
        info = server.server_info()
        print("\n".join(server_banner(info)))
        server.flush_cache()  # drop the warm-up request
        per_token = full_kv_bytes_per_token(folder, 4 if info.get("dtype") == "float32" else 2)
        chat(
            server.base_url,
            DEMO_TURNS,
            on_turn=TurnReporter(server, per_token),
        )
    print("\nserver stopped")
    if not args.full_kv:
        print(
            f"(to tell the model's own mistakes from compression's, run the same chat on stock "
            f"SGLang: {this_python()} -m tangram_sglang.demo --model {args.model} --full-kv)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
