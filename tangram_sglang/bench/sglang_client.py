"""A second load generator for ``bench.multiturn``: SGLang's ``bench_serving``, over the chat API.

``bench.multiturn``'s own client (:mod:`multiturn_client`) sends token ids to ``/generate``.
``--client sglang`` runs the workload's conversations through SGLang's ``bench_serving``
(``python -m sglang.benchmark.serving``, formerly ``sglang.bench_serving``) instead, the client
SGLang's developers measure with, the way a chat user's requests arrive: text messages to
``/v1/chat/completions`` (backend ``sglang-oai-chat``), the server applying the chat template
and tokenizing, every round resending the whole history with the model's earlier answers as
text. A figure that holds under both clients does not depend on how one client talks to the
server.

The conversations become a trace of bench_serving's ``agentic-trace`` dataset (one
conversation per entry, each turn's new user message); bench_serving replays each
conversation round by round, at most ``--max-concurrency`` conversations at a time, with
``ignore_eos`` and ``max_completion_tokens`` = the round's output length, so every system
generates the same number of tokens. The rounds have the own client's lengths; their text is
the decoded form of random token ids (seeded; not the own client's ids, which it draws in the
order its tasks run). With the GPU benchmarks' word-level tokenizer (:mod:`dummy_tokenizer`,
whose plain chat template joins the messages) the words encode back to the same ids; with a
BPE tokenizer the round trip gives 4-10% more tokens (SmolLM2, Qwen2.5; 128-1,024 tokens), and
their chat templates add a default system prompt (about 30 tokens) to every request.

What differs from the own client:
- one output length for every turn (workloads whose rounds differ, ``sharegpt`` and
  ``system-prompt`` unless ``--output-length`` caps every round to one length, are refused);
- ``--max-parallel`` bounds conversations, each holding its slot through all its rounds (the
  own client bounds requests), so a multi-round workload with more clients than
  ``--max-parallel`` is refused rather than run under a different load;
- no pacing by rate, no round barrier, no requests without ``max_tokens``;
- output and prompt tokens are the server's own counts (bench_serving counts no prompt
  tokens of a multi-turn run and takes an answer the server aborted mid-stream for a whole
  one); a run past ``--workload-timeout-s`` (plus a start-up allowance) is stopped and
  recorded as timed out, and one that gives no result (no request succeeded, or the server
  went away) is recorded with every request failed and the reason under ``first_errors``.

Source: sglang 0.5.17 ``sglang/benchmark/datasets/agentic_trace.py`` (the trace format) and
``sglang/benchmark/serving.py`` (multi-turn replay, the result line of ``--output-file``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tangram_sglang.bench.multiturn_client import (
    PEAK_KEYS,
    round_ids,
    shared_prefix_ids,
    token_figures,
)
from tangram_sglang.bench.multiturn_workloads import Conversation, WorkloadSpec
from tangram_sglang.errors import ConfigError

MODULE = "sglang.benchmark.serving"  # bench_serving (``sglang.bench_serving`` is its old name)
BACKEND = "sglang-oai-chat"


def uniform_output_length(conversations: list[Conversation], label: str) -> int:
    """The one output length (tokens) every round of every conversation has.

    Raises:
        ConfigError: the rounds differ in output length (bench_serving takes one).
    """
    lengths = {out for conv in conversations for _, out in conv.rounds}
    if len(lengths) != 1:
        shown = ", ".join(map(str, sorted(lengths)[:5])) + (", ..." if len(lengths) > 5 else "")
        raise ConfigError(
            f"{label}: --client sglang needs one output length for every round (bench_serving "
            f"takes one), but its rounds have {len(lengths)} different ones ({shown} tokens); "
            "give --output-length that every round reaches (mixed: 128, its long clients' length), "
            "use short-chat, cliff, long-context or prefill, or --client tangram"
        )
    return lengths.pop()


def agentic_trace(
    conversations: list[Conversation],
    vocab_size: int,
    decode: Callable[[list[int]], str],
    seed: int,
    label: str = "workload",
) -> tuple[dict, int]:
    """The conversations as a bench_serving ``agentic-trace`` dataset.

    Args:
        conversations: the workload's conversations (:func:`make_conversations`).
        vocab_size: the model's vocabulary (ids are drawn in ``[ID_LOW, vocab_size - ID_LOW)``).
        decode: token ids (list of int) -> text, e.g. a tokenizer's ``decode``.
        seed: seeds the ids; leading ``shared_prefix`` ids of round 1 are the same for every
            conversation, as in the own client (:func:`multiturn_client.round_ids`).
        label: the workload's name, for the error.

    Returns:
        (the trace: ``{"metadata": ..., "conversations": [[{"messages": [...],
        "prompt_tokens": int}, ...], ...]}``, the rounds' output length in tokens).

    Raises:
        ConfigError: the rounds differ in output length (:func:`uniform_output_length`).
    """
    output_len = uniform_output_length(conversations, label)
    rng = np.random.default_rng(seed)
    shared_ids = shared_prefix_ids(rng, conversations, vocab_size)
    entries = []
    for conv in conversations:
        turns = []
        for r, (new_tokens, _) in enumerate(conv.rounds):
            text = decode(round_ids(rng, conv, r, new_tokens, shared_ids, vocab_size))
            turns.append(
                {"messages": [{"role": "user", "content": text}], "prompt_tokens": new_tokens}
            )
        entries.append(turns)
    metadata = {"source": "tangram_sglang.bench.sglang_client", "seed": seed}
    return {"metadata": metadata, "conversations": entries}, output_len


def bench_serving_command(
    base_url: str,
    model_path: str,
    trace_path: Path,
    num_conversations: int,
    max_concurrency: int,
    output_len: int,
    result_path: Path,
) -> list[str]:
    """The bench_serving command line for one workload (no warm-up: the bench warms the server
    with its own client first; ``--output-details`` for the requests' errors)."""
    return [
        sys.executable,
        "-m",
        MODULE,
        "--backend",
        BACKEND,
        "--base-url",
        base_url,
        "--model",
        model_path,
        "--tokenizer",
        model_path,
        "--dataset-name",
        "agentic-trace",
        "--dataset-path",
        str(trace_path),
        "--num-prompts",
        str(num_conversations),
        "--max-concurrency",
        str(max_concurrency),
        "--sharegpt-output-len",
        str(output_len),
        "--request-rate",
        "inf",
        "--warmup-requests",
        "0",
        "--disable-tqdm",
        "--output-details",
        "--output-file",
        str(result_path),
    ]


def check_chat_tokenizer(model_path: str):
    """Load ``model_path``'s tokenizer and check it has a chat template (the chat API needs it).

    Returns:
        The tokenizer (transformers ``PreTrainedTokenizerBase``).

    Raises:
        ConfigError: no tokenizer, or one without a chat template; names the dummy tokenizer's
            command, which writes both.
    """
    from transformers import AutoTokenizer

    fix = f"python -m tangram_sglang.bench.dummy_tokenizer {model_path} --overwrite"
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(
            f"--model-path {model_path}: --client sglang needs the model's tokenizer and "
            f"cannot load it ({exc}); for a dummy-weight folder: {fix}"
        ) from None
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            f"--model-path {model_path}: its tokenizer has no chat template, which the chat "
            f"API that --client sglang talks to needs (a dummy tokenizer written before the "
            f"template was added has none): {fix}, or give a model with a chat template"
        )
    return tokenizer


@dataclass
class ClientRun:
    """One system's ``--client sglang`` runs: the model, its tokenizer's ``decode`` (token ids
    -> text, for the rounds; :func:`check_chat_tokenizer`) and the folder for each workload's
    trace, result line and bench_serving log."""

    model_path: str
    work_dir: Path
    decode: Callable[[list[int]], str]

    def prepare(
        self,
        base_url: str,
        spec: WorkloadSpec,
        conversations: list[Conversation],
        vocab_size: int,
        seed: int,
        max_parallel: int,
    ) -> tuple[list[str], Path, Path, int]:
        """Write ``spec``'s trace and return (the bench_serving command, its result file, its
        log file, the rounds' output length in tokens); the files are under ``work_dir``.

        Raises:
            ConfigError: the rounds differ in output length.
        """
        trace, output_len = agentic_trace(conversations, vocab_size, self.decode, seed, spec.label)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        trace_path = self.work_dir / f"{spec.label}.trace.json"
        trace_path.write_text(json.dumps(trace))
        result_path = self.work_dir / f"{spec.label}.bench_serving.jsonl"
        command = bench_serving_command(
            base_url,
            self.model_path,
            trace_path,
            len(conversations),
            min(len(conversations), max_parallel),
            output_len,
            result_path,
        )
        return command, result_path, self.work_dir / f"{spec.label}.bench_serving.log", output_len


DETAIL_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors")


STARTUP_ALLOWANCE_S = 120.0  # bench_serving's own start-up (imports, tokenizer): not the run's


def run_bench_serving(command: list[str], result_path: Path, timeout_s: float, log: Path) -> dict:
    """Run bench_serving and return its result line (the last JSON line of ``result_path``).

    It is stopped after ``timeout_s`` + :data:`STARTUP_ALLOWANCE_S` (its start-up imports
    SGLang, 5-30 s on a loaded CPU). Where it stops with no result, the returned line is
    ``{"completed": 0, "failure": ...}``: ``failure`` says why (the time limit, or its exit
    status and the tail of ``log``, its output: bench_serving stops with a traceback when no
    request succeeded, e.g. prompts longer than the server's context, or when the server went
    away).
    """
    result_path.unlink(missing_ok=True)
    with open(log, "w") as out:
        try:
            proc = subprocess.run(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=timeout_s + STARTUP_ALLOWANCE_S,
            )
        except subprocess.TimeoutExpired:
            return {
                "completed": 0,
                "timed_out": True,
                "failure": f"{MODULE} ran past {timeout_s:.0f} s (--workload-timeout-s) + "
                f"{STARTUP_ALLOWANCE_S:.0f} s for its start-up and was stopped ({log})",
            }
    lines = result_path.read_text().splitlines() if result_path.is_file() else []
    if proc.returncode != 0 or not lines:
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        return {
            "completed": 0,
            "failure": f"{MODULE} exited {proc.returncode} with no result: no request "
            f"succeeded, or the server went away ({log}): {' | '.join(tail)[-600:]}",
        }
    return json.loads(lines[-1])


def _ms_pcts(raw: dict, what: str) -> dict[str, float | None]:
    keys = {"p50": f"median_{what}_ms", "p90": f"p90_{what}_ms", "p99": f"p99_{what}_ms"}
    return {p: (raw[k] / 1000 if raw.get(k) is not None else None) for p, k in keys.items()}


def summarize_bench_serving(
    raw: dict,
    planned: int,
    output_len: int,
    peaks: dict[str, float],
    timeout_s: float,
    counted: dict[str, int],
) -> dict:
    """bench_serving's result line in the keys of ``multiturn.summarize_run`` (seconds, tokens),
    plus ``client``, ``output_tokens_short`` and the line's figures under ``bench_serving``.

    Args:
        raw: the result line (:func:`run_bench_serving`; with ``failure`` when it gave none).
        planned: the rounds of the workload (requests); ``output_len``: tokens each asks for.
        counted: what the server counted over the run (the growth of its counters):
            ``prompt``, ``cached`` and ``generated`` tokens. bench_serving counts prompt and
            cached tokens of no multi-turn run, and takes a request the server aborted inside
            an HTTP 200 stream for a success of full length; so the output tokens and the
            throughput are the server's count, and ``output_tokens_short`` (completed requests
            times ``output_len``, less the tokens generated) is above 0 when answers were cut.

    ``requests_failed`` counts the rounds planned that did not complete.
    """
    timed_out = bool(raw.get("timed_out"))
    wall = float(raw.get("duration", timeout_s if timed_out else 0.0))
    completed = int(raw.get("completed", 0))
    out_tokens, prompt, cached = counted["generated"], counted["prompt"], counted["cached"]
    errors = [e for e in raw.get("errors", []) if e][:3]
    if "failure" in raw:
        errors = [raw["failure"]]
    return {
        "client": f"{MODULE} ({BACKEND})",
        "requests_planned": planned,
        "requests_ok": completed,
        "requests_failed": planned - completed,
        "timed_out": timed_out,
        "first_errors": errors,
        "wall_s": wall,
        **token_figures(out_tokens, prompt, cached, wall, completed),
        "output_tokens_short": max(0, completed * output_len - out_tokens),
        "ttft_s": _ms_pcts(raw, "ttft"),
        "tpot_s": _ms_pcts(raw, "tpot"),
        "latency_s": _ms_pcts(raw, "e2e_latency"),
        **{key: peaks.get(name) for key, name in PEAK_KEYS.items()},
        "bench_serving": {
            k: v for k, v in raw.items() if k != "server_info" and k not in DETAIL_KEYS
        },
    }
