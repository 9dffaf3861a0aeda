"""A second load generator for ``bench.multiturn``: SGLang's ``bench_serving``, over the chat API.

``bench.multiturn``'s own client (:mod:`multiturn_client`) sends token ids to ``/generate``.
``--client sglang`` runs the same conversations through ``python -m sglang.bench_serving``
instead, the client SGLang's developers measure with, the way a chat user's requests arrive:
text messages to ``/v1/chat/completions`` (backend ``sglang-oai-chat``), the server applying
the chat template and tokenizing, every round resending the whole history with the model's
previous answers as text. A figure that holds under both clients does not depend on how one
client talks to the server.

The conversations become a trace of bench_serving's ``agentic-trace`` dataset (one
conversation per entry, each turn's new user message); bench_serving replays each
conversation round by round, at most ``--max-concurrency`` conversations at a time, with
``ignore_eos`` and ``max_tokens`` = the round's output length, so every system generates the
same tokens. A round's text is the decoded form of random token ids (seeded as the own
client's); with the GPU benchmarks' word-level tokenizer (:mod:`dummy_tokenizer`) it encodes
back to the same ids, with a BPE tokenizer to about as many.

What differs from the own client: bench_serving has one output length for every turn (so
workloads whose rounds differ in output length, ``sharegpt`` and ``system-prompt``, are
refused), no pacing by rate between rounds, no round barrier and no requests without
``max_tokens``.

Source: sglang 0.5.17 ``sglang/benchmark/datasets/agentic_trace.py`` (the trace format) and
``sglang/benchmark/serving.py`` (multi-turn replay, the result line of ``--output-file``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tangram_sglang.bench.multiturn_workloads import ID_LOW, Conversation, WorkloadSpec
from tangram_sglang.errors import ConfigError, TangramError

BACKEND = "sglang-oai-chat"


def uniform_output_length(conversations: list[Conversation], label: str) -> int:
    """The one output length (tokens) every round of every conversation has.

    Raises:
        ConfigError: the rounds differ in output length (bench_serving takes one).
    """
    lengths = {out for conv in conversations for _, out in conv.rounds}
    if len(lengths) != 1:
        raise ConfigError(
            f"{label}: --client sglang needs one output length for every round (bench_serving "
            f"takes one), but its rounds have {len(lengths)} ({sorted(lengths)[:5]}...); use "
            "short-chat, mixed, cliff, long-context or prefill, or --client tangram"
        )
    return lengths.pop()


def agentic_trace(
    conversations: list[Conversation], vocab_size: int, decode, seed: int
) -> tuple[dict, int]:
    """The conversations as a bench_serving ``agentic-trace`` dataset.

    Args:
        conversations: the workload's conversations (:func:`make_conversations`).
        vocab_size: the model's vocabulary (ids are drawn in ``[ID_LOW, vocab_size - ID_LOW)``).
        decode: token ids (list of int) -> text, e.g. a tokenizer's ``decode``.
        seed: seeds the ids; leading ``shared_prefix`` ids of round 1 are the same for every
            conversation, as in the own client.

    Returns:
        (the trace: ``{"metadata": ..., "conversations": [[{"messages": [...],
        "prompt_tokens": int}, ...], ...]}``, the rounds' output length in tokens).

    Raises:
        ConfigError: the rounds differ in output length (:func:`uniform_output_length`).
    """
    output_len = uniform_output_length(conversations, "workload")
    rng = np.random.default_rng(seed)
    shared = max((c.shared_prefix for c in conversations), default=0)
    shared_ids = rng.integers(ID_LOW, vocab_size - ID_LOW, shared).tolist()
    entries = []
    for conv in conversations:
        turns = []
        for r, (new_tokens, _) in enumerate(conv.rounds):
            ids = rng.integers(ID_LOW, vocab_size - ID_LOW, new_tokens).tolist()
            if r == 0 and conv.shared_prefix:
                ids[: conv.shared_prefix] = shared_ids[: conv.shared_prefix]
            text = decode(ids)
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
    """The ``python -m sglang.bench_serving`` command line for one workload (no warm-up: the
    bench warms the server with its own client first)."""
    return [
        sys.executable,
        "-m",
        "sglang.benchmark.serving",
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
        "--output-file",
        str(result_path),
    ]


@dataclass
class ClientRun:
    """One system's ``--client sglang`` runs: the model (its tokenizer decodes the rounds) and
    the folder for each workload's trace, result line and bench_serving log."""

    model_path: str
    work_dir: Path
    _decode: object = field(default=None, repr=False)

    def prepare(
        self,
        base_url: str,
        spec: WorkloadSpec,
        conversations: list[Conversation],
        vocab_size: int,
        seed: int,
        max_parallel: int,
    ) -> tuple[list[str], Path, Path]:
        """Write ``spec``'s trace and return (the bench_serving command, its result file, its
        log file), all under ``work_dir``.

        Raises:
            ConfigError: the rounds differ in output length, or the model has no tokenizer.
        """
        if self._decode is None:
            from transformers import AutoTokenizer

            try:
                tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            except (OSError, ValueError) as exc:
                raise ConfigError(
                    f"--model-path {self.model_path}: --client sglang needs the model's "
                    f"tokenizer ({exc}); a folder without one gets it from python -m "
                    "tangram_sglang.bench.dummy_tokenizer MODEL_DIR"
                ) from None
            self._decode = tokenizer.decode
        trace, output_len = agentic_trace(conversations, vocab_size, self._decode, seed)
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
        return command, result_path, self.work_dir / f"{spec.label}.bench_serving.log"


def run_bench_serving(command: list[str], result_path: Path, timeout_s: float, log: Path) -> dict:
    """Run bench_serving and return its result line (the last JSON line of ``result_path``).

    Raises:
        TangramError: it failed, ran past ``timeout_s`` or wrote no result (the error names
            ``log``, which holds its output).
    """
    result_path.unlink(missing_ok=True)
    with open(log, "w") as out:
        try:
            proc = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise TangramError(
                f"sglang.bench_serving ran past {timeout_s:.0f} s (--workload-timeout-s); "
                f"its output is in {log}"
            ) from None
    lines = result_path.read_text().splitlines() if result_path.is_file() else []
    if proc.returncode != 0 or not lines:
        tail = log.read_text(errors="replace")[-1500:]
        raise TangramError(
            f"sglang.bench_serving exited {proc.returncode} with "
            f"{'no result' if not lines else 'a result'} ({log}): {tail}"
        )
    return json.loads(lines[-1])


def _ms_pcts(raw: dict, what: str) -> dict[str, float | None]:
    keys = {"p50": f"median_{what}_ms", "p90": f"p90_{what}_ms", "p99": f"p99_{what}_ms"}
    return {p: (raw[k] / 1000 if raw.get(k) is not None else None) for p, k in keys.items()}


def summarize_bench_serving(
    raw: dict,
    planned: int,
    peaks: dict[str, float],
    timeout_s: float,
    prompt_tokens: int,
    cached_tokens: int,
) -> dict:
    """bench_serving's result line in the keys of ``multiturn.summarize_run`` (seconds, tokens),
    plus ``client`` and the raw line under ``bench_serving``.

    Args:
        prompt_tokens, cached_tokens: the run's prompt tokens and those served from the prefix
            cache, as the server counted them (the growth of its ``sglang:prompt_tokens_total``
            and ``sglang:cached_tokens_total`` over the run): bench_serving counts neither for a
            multi-turn run.

    ``requests_failed`` counts the rounds planned that did not complete.
    """
    completed = int(raw.get("completed", 0))
    wall = float(raw.get("duration", 0.0))
    out_tokens = int(raw.get("total_output_tokens", 0))
    prompt = prompt_tokens
    cached = cached_tokens
    return {
        "client": f"sglang.bench_serving ({BACKEND})",
        "requests_planned": planned,
        "requests_ok": completed,
        "requests_failed": planned - completed,
        "timed_out": wall >= timeout_s,
        "first_errors": [],
        "wall_s": wall,
        "output_tokens": out_tokens,
        "prompt_tokens": prompt,
        "output_tok_per_s": float(raw.get("output_throughput", 0.0)),
        "mean_output_tokens": out_tokens / completed if completed else None,
        "total_tok_per_s": (out_tokens + prompt) / wall if wall else 0.0,
        "cache_hit_rate": cached / prompt if prompt else 0.0,
        "ttft_s": _ms_pcts(raw, "ttft"),
        "tpot_s": _ms_pcts(raw, "tpot"),
        "latency_s": _ms_pcts(raw, "e2e_latency"),
        "peak_running_reqs": peaks.get("sglang:num_running_reqs"),
        "peak_token_usage": peaks.get("sglang:token_usage"),
        "peak_used_tokens": peaks.get("sglang:num_used_tokens"),
        "peak_tangram_pages_used": peaks.get("tangram:pages_used"),
        "peak_tangram_kv_bytes_held": peaks.get("tangram:kv_bytes_held"),
        "retracted_requests_total": peaks.get("sglang:num_retracted_requests_total"),
        "bench_serving": {k: v for k, v in raw.items() if k != "server_info"},
    }
