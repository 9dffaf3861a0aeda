"""How much of KVzip's kept set a same-pass scorer keeps: recall of the oracle's top-k (HF model).

    python -m tangram_sglang.eval.scorer_recall --model-path qwen2.5-0.5b --num-samples 6 \\
        --lengths 1024,2048 --keep 0.25,0.5 --output recall.json

A quick, generation-free check for scorer work on the multi-turn task (``multiturn-squad``
contexts, the document a conversation's later questions are about). For each sample's context
it computes, on the real HF model (transformers, float32):

* the **oracle**: kvpress ``KVzipPress`` scores (KVzip, arXiv 2505.23416: the model re-reads
  the context after "repeat the previous context" and each KV pair scores the largest attention
  any reconstruction query and any query head of its GQA group pays it);
* each named Tangram scorer's scores (``--scorers``, the serving scorers' own code run on the
  same post-RoPE queries and keys through ``calibrate.observe.ScoreObserver``);
  ``kvzip-replay`` is the segment's own queries moved to where KVzip's replay puts them
  (``scoring.replay``); it gets the HF model's RoPE, as in calibration.

and reports, per kept fraction ``keep``, the mean over samples, layers and KV heads of
``|top_k(oracle) & top_k(scores)| / k`` with ``k = keep * m`` (``m`` the scored tokens: the
context after the chat template's head, which KVzip does not score). A random ranking scores
``keep``; the oracle scores 1. ``later_answer_kept_share``: for the tokens of the gold answers
of questions 2+ (found verbatim in the context), the share of (layer, KV head) whose top-k
holds them, for each scorer and the oracle (chance: ``keep``).

``later_answer_kept_share_by_allocation``: the same share, ``{keep: {scorer: {key: mean}}}``,
under several ways to spend the memory (the oracle judged under the shipped ``kvzip-lite``
profile's budgets):

* ``uniform``: every (layer, KV head) keeps ``keep * m`` tokens, its own top scores;
* ``global``: the same total, spent on the request's top scores over all heads together;
* ``profile``: each head keeps the shipped profile's budget for an ``m``-token segment
  (sinks and the recent window first, as the server selects), at the profile's kept fraction;
* ``profile_global``: the profile's total spent on the request's top scores over all heads;
* ``profile_kept_fraction``: that total over ``L * H * m`` (``profile`` and ``profile_global``
  are measured at this fraction, not exactly at ``keep``).

The ``profile`` keys are present only where a profile for that scorer ships at target ``keep``
(a line on stderr names each one that does not). Each ``per_sample`` row holds the sample's own
shares under ``"allocation"`` so their spread can be read.

Recall is a proxy: it weighs every layer and head alike, while Tangram's per-head budgets keep
different fractions per head. Accuracy is judged by the harness (``python -m tangram_sglang.eval``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tangram_sglang.errors import ConfigError, TangramError

if TYPE_CHECKING:
    from tangram_sglang.profile import BudgetProfile

ORACLE = "kvzip (oracle)"  # the oracle's own entry in later_answer_kept_share
ORACLE_PROFILE = "kvzip-lite"  # whose shipped budgets the oracle's scores are judged under
REPLAY_MARGIN_TOKENS = 512  # chat template, instructions and KVzip's repeat prompt (tokens)


def topk_recall(oracle: np.ndarray, scores: np.ndarray, keep: float) -> float:
    """Mean recall of the oracle's top-k by ``scores``, over every leading index.

    Args:
        oracle: float ``[..., m]`` reference scores (higher = keep).
        scores: float ``[..., m]`` scores to judge, same shape.
        keep: kept fraction in (0, 1]; ``k = max(1, round(keep * m))``.

    Returns:
        Mean of ``|top_k(oracle) & top_k(scores)| / k`` over the leading indices, in [0, 1].

    Raises:
        ConfigError: shapes differ, or ``keep`` outside (0, 1].
    """
    oracle, scores = np.asarray(oracle), np.asarray(scores)
    if oracle.shape != scores.shape or oracle.ndim < 1:
        raise ConfigError(
            f"oracle {oracle.shape} and scores {scores.shape} must have one shape [..., m]"
        )
    if not 0.0 < keep <= 1.0:
        raise ConfigError(f"keep={keep} must be in (0, 1] (a kept fraction)")
    m = oracle.shape[-1]
    k = max(1, round(keep * m))
    a = np.argpartition(-oracle.reshape(-1, m), k - 1, axis=-1)[:, :k]
    b = np.argpartition(-scores.reshape(-1, m), k - 1, axis=-1)[:, :k]
    hits = [np.intersect1d(x, y).size for x, y in zip(a, b, strict=True)]
    return float(np.mean(hits) / k)


def kept_share(scores: np.ndarray, positions: list[int], keep: float) -> float:
    """Share of (leading index, position) pairs whose position is in that index's top-k.

    Args:
        scores: float ``[..., m]`` (per layer and KV head).
        positions: token indices into the last axis (e.g. an answer span).
        keep: kept fraction in (0, 1]; ``k = max(1, round(keep * m))``.

    Returns:
        Mean over leading indices and ``positions`` of "kept", in [0, 1]; NaN without positions.
    """
    if not positions:
        return float("nan")
    m = scores.shape[-1]
    k = max(1, round(keep * m))
    flat = scores.reshape(-1, m)
    top = np.argpartition(-flat, k - 1, axis=-1)[:, :k]
    kept = np.zeros(flat.shape, bool)
    np.put_along_axis(kept, top, True, axis=-1)
    return float(kept[:, positions].mean())


def kept_share_budgets(
    scores: np.ndarray, positions: list[int], budgets: np.ndarray, sink: int, window: int
) -> float:
    """Like :func:`kept_share`, with one kept length per (layer, KV head), as a server keeps.

    Each (layer, KV head) keeps the same token set as
    :func:`tangram_sglang.scoring.select.select_kept` with ``k = budgets[l, h]``: its first
    ``sink`` and last ``window`` positions, then its top ``budgets - sink - window`` of the rest by
    ``scores``. Scores are compared in float32, as ``select_kept``'s ``priority_key`` does:
    ties break towards the lower index (a stable sort); NaN scores rank last (as -inf, below
    an infinite score, which counts as the largest finite float32 of its sign). When a budget
    is smaller than the protected set, the sinks are kept first, then the oldest window
    tokens. A budget of 0 keeps nothing (``select_kept`` itself refuses ``k = 0``).

    Args:
        scores: float ``[L, H, m]`` (layers, KV heads, tokens).
        positions: token indices into the last axis.
        budgets: int ``[L, H]`` kept lengths (tokens, each in ``[0, m]``).
        sink: always-kept first positions (tokens, >= 0).
        window: always-kept last positions (tokens, >= 0).

    Returns:
        Mean over ``(l, h)`` and ``positions`` of "kept", in [0, 1]; NaN without positions.

    Raises:
        ConfigError: ``budgets``' shape is not ``scores``' leading shape ``[L, H]``, or a
            budget is outside ``[0, m]``.
    """
    scores, budgets = np.asarray(scores), np.asarray(budgets)
    m = scores.shape[-1]
    if budgets.shape != scores.shape[:-1]:
        raise ConfigError(
            f"budgets {budgets.shape} must have scores' leading shape {scores.shape[:-1]} "
            "(one kept length per layer and KV head)"
        )
    if budgets.size and (budgets.min() < 0 or budgets.max() > m):
        raise ConfigError(
            f"budgets must be kept lengths in [0, m={m}] tokens; got "
            f"[{budgets.min()}, {budgets.max()}]"
        )
    if not positions:
        return float("nan")
    # as select_kept's priority_key: float32, NaN -> -inf, +-inf -> the largest finite values
    flat = np.nan_to_num(scores.reshape(-1, m).astype(np.float32), nan=-np.inf)
    flat[:, : min(sink, m)] = np.inf
    flat[:, max(m - window, 0) :] = np.inf
    order = np.argsort(-flat, axis=-1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(m)[None, :].repeat(len(flat), 0), axis=-1)
    kept = rank < budgets.reshape(-1, 1)
    return float(kept[:, positions].mean())


def kept_share_global(scores: np.ndarray, positions: list[int], total: int) -> float:
    """Share kept when one request's ``total`` kept pairs go to its top scores over every head.

    A per-request allocation (KVzip's non-uniform budget): the top ``total`` entries of
    ``scores`` over all leading indices and positions together, so a head whose scores are
    high keeps more of this context. Ties at the cut break arbitrarily (``np.argpartition``);
    a head may keep 0 tokens; no sinks or recent window are reserved. It is thus an optimistic
    upper bound for what a per-request allocation of ``total`` tokens could keep.

    Args:
        scores: float ``[..., m]``.
        positions: token indices into the last axis.
        total: kept (index, position) pairs, in ``[1, scores.size]``.

    Returns:
        Mean over leading indices and ``positions`` of "kept"; NaN without positions.

    Raises:
        ConfigError: ``total`` outside ``[1, scores.size]``.
    """
    scores = np.asarray(scores)
    if not 1 <= total <= scores.size:
        raise ConfigError(
            f"total={total} must be in [1, scores.size={scores.size}] (kept (head, token) pairs)"
        )
    if not positions:
        return float("nan")
    m = scores.shape[-1]
    flat = scores.reshape(-1)
    top = np.argpartition(-flat, total - 1)[:total]
    kept = np.zeros(flat.shape, bool)
    kept[top] = True
    return float(kept.reshape(-1, m)[:, positions].mean())


def shipped_profile(config: Any, scorer: str, keep: float) -> BudgetProfile | None:
    """The shipped profile calibrated for this model with ``scorer`` at target ``keep``, or None.

    Args:
        config: the model's transformers config.
        scorer: a Tangram scorer name.
        keep: the profile's target ratio.

    Returns:
        The profile (``calibration/*/*.json``, as the server finds it) whose scorer is
        ``scorer`` and whose target ratio is ``keep``; None when none ships for this model,
        scorer and target (the nearest other target does not count).
    """
    from tangram_sglang.integration.profile_loader import find_shipped_profile
    from tangram_sglang.profile import BudgetProfile, ModelIdentity

    try:
        path = find_shipped_profile(
            ModelIdentity.from_hf_config(config), scorer=scorer, target_ratio=keep
        )
    except ConfigError:
        return None
    profile = BudgetProfile.load(path)
    return profile if abs(profile.target_ratio - keep) < 1e-9 else None


def profile_budgets(profile: BudgetProfile, m: int) -> np.ndarray:
    """Kept lengths per (layer, KV head) that ``profile`` gives one ``m``-token segment.

    The server's own formula: each head keeps its head group's
    :meth:`tangram_sglang.profile.BudgetProfile.group_kept_array` (``kept_len`` with the
    profile's sinks and recent window).

    Not modelled: ``m`` here excludes the chat template's head (KVzip does not score it), so the
    sinks land on the first document tokens, where the server's land on the template; the
    server's ``--tangram-min-compress-tokens`` is not applied (the profile's own value is, 0 as
    shipped), and the prompt is one segment, not the server's chunked-prefill or grid segments.
    At 1k-2k tokens these move the budgets by about 1%.

    Args:
        profile: a loaded budget profile (e.g. :func:`shipped_profile`).
        m: scored tokens of the segment (tokens, >= 0).

    Returns:
        int64 ``[num_layers, num_kv_heads]`` kept lengths (tokens, each in ``[min(m, 1), m]``).
    """
    return profile.group_kept_array(m)[profile.grouping.cluster_of]


def answer_positions(tokenizer: Any, ids: list[int], answers: tuple[str, ...]) -> list[int]:
    """Token indices of the first gold answer found verbatim in the decoded ``ids`` ([] if none).

    Tokens are decoded one by one and joined, so character offsets map back to tokens. Limits:
    the first occurrence counts (a short answer may also occur in another document), and a
    character split across byte-level tokens decodes as U+FFFD, so such answers are not found.
    """
    pieces = [tokenizer.decode([t]) for t in ids]
    starts = np.cumsum([0] + [len(p) for p in pieces])
    text = "".join(pieces)
    for answer in answers:
        at = text.find(answer)
        if answer and at >= 0:
            first = int(np.searchsorted(starts, at, side="right")) - 1
            end = int(np.searchsorted(starts, at + len(answer), side="left"))
            return list(range(first, max(end, first + 1)))
    return []


def kvzip_scores(model: Any, context_ids: list[int]) -> tuple[np.ndarray, int]:
    """kvpress ``KVzipPress`` scores of one context, before it compresses anything.

    Args:
        model: a transformers causal LM loaded with SDPA attention (kvpress's requirement).
        context_ids: the context (tokens), chat-template head included.

    Returns:
        ``(scores, head)``: float32 ``[num_layers, num_kv_heads, n]`` and the chat template's
        head length (tokens) that KVzip leaves unscored (its scores there are 0).
    """
    import kvpress
    import torch
    from transformers import DynamicCache

    press = kvpress.KVzipPress(compression_ratio=0.5)  # any ratio > 0 runs the scoring
    seen: dict[str, Any] = {}

    def capture(_model: Any) -> None:  # replaces the eviction: keep the scores, drop nothing
        seen["scores"] = press.score_val[:, 0].float().cpu().numpy().copy()
        seen["head"] = int(press.prefix_length)

    press.compress_post = capture
    ids = torch.tensor([context_ids], device=next(model.parameters()).device)
    pos = torch.arange(ids.shape[1], device=ids.device)
    with torch.inference_mode(), press(model):
        model(
            input_ids=ids,
            past_key_values=DynamicCache(config=model.config),
            use_cache=True,
            cache_position=pos,
            position_ids=pos[None],
            logits_to_keep=1,
        )
    return seen["scores"], seen["head"]


def recall_report(
    model_path: str,
    num_samples: int,
    lengths: tuple[int, ...],
    keeps: tuple[float, ...],
    scorers: tuple[str, ...],
    seed: int = 0,
) -> dict[str, Any]:
    """Recall of KVzip's top-k per scorer and kept fraction (see the module docstring).

    Returns:
        ``{"settings": ..., "recall": {keep: {scorer: mean}}, "later_answer_kept_share":
        {keep: {scorer: mean}}, "later_answer_kept_share_by_allocation": {keep: {scorer:
        {key: mean}}}, "per_sample": [...]}``. The allocation keys: ``uniform`` and ``global``
        at ``keep``; ``profile`` (the shipped profile's per-head budgets) and ``profile_global``
        (its total over all heads) at the profile's kept fraction, reported as
        ``profile_kept_fraction`` (module docstring). Each ``per_sample`` row: ``sample``,
        ``tokens``, ``recall`` and ``allocation`` (``{keep: {scorer: {key: share}}}``, this
        sample's shares; absent for a sample without a later answer found).

    Raises:
        ConfigError: an unknown scorer, bad sizes, or the data package is missing.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from tangram_sglang.calibrate.observe import ScoreObserver
    from tangram_sglang.eval.tasks import build_samples, check_sizes, conversation_ids
    from tangram_sglang.models import model_path as resolve
    from tangram_sglang.scoring import get_scorer

    # every check before the model loads: a bad flag must not cost a load
    check_sizes(("multiturn-squad",), num_samples, lengths, (0.5,), 3)
    for keep in keeps:
        topk_recall(np.zeros(2), np.zeros(2), keep)
    judged = {name: get_scorer(name) for name in scorers}
    path = str(resolve(model_path)) if "/" not in model_path else model_path
    if not Path(path, "config.json").is_file():
        raise ConfigError(
            f"--model-path {model_path}: no config.json there; give an HF model folder or an "
            "embedded model name (smollm2, qwen2.5-0.5b)"
        )
    context = getattr(AutoConfig.from_pretrained(path), "max_position_embeddings", None)
    if context and 2 * max(lengths) + REPLAY_MARGIN_TOKENS > context:
        raise ConfigError(
            f"--lengths {max(lengths)}: KVzip re-reads the context after it, so 2 x length + "
            f"{REPLAY_MARGIN_TOKENS} tokens must fit the model's {context}-token context; use "
            f"lengths up to {(context - REPLAY_MARGIN_TOKENS) // 2}"
        )
    config = AutoConfig.from_pretrained(path)
    # the oracle's scores under kvzip-lite's budgets (ORACLE_PROFILE): what KVzip ranking keeps
    profiles = {
        (name, keep): shipped_profile(config, name, keep)
        for name in {*scorers, ORACLE_PROFILE}
        for keep in keeps
    }
    for (name, keep), profile in sorted(profiles.items()):
        if profile is None:
            whose = "its" if name in scorers else "the oracle's"
            print(
                f"[scorer_recall] no shipped {name} profile at target {keep}: "
                f"{whose} profile columns are left out",
                file=sys.stderr,
                flush=True,
            )
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = model.eval()
    observers = {name: ScoreObserver(model, s) for name, s in judged.items()}
    samples = build_samples("multiturn-squad", tok, num_samples, lengths, seed=seed)
    sums = {keep: dict.fromkeys(observers, 0.0) for keep in keeps}
    shares: dict[float, dict[str, list[float]]] = {
        keep: {name: [] for name in [*observers, ORACLE]} for keep in keeps
    }
    allocation: dict[float, dict[str, dict[str, list[float]]]] = {keep: {} for keep in keeps}
    per_sample = []
    for sample in samples:
        ids = conversation_ids(sample, tok).context_ids
        oracle, head = kvzip_scores(model, ids)
        later = [
            p - head
            for turn in sample.turns[1:]
            for p in answer_positions(tok, ids, turn.answers)
            if p >= head
        ]
        row: dict[str, Any] = {"sample": sample.sample_id, "tokens": len(ids), "recall": {}}
        all_scores = {name: o.scores(ids)[..., head:] for name, o in observers.items()}
        for keep in keeps:
            for name, scores in all_scores.items():
                value = topk_recall(oracle[..., head:], scores, keep)
                row["recall"].setdefault(str(keep), {})[name] = round(value, 4)
                sums[keep][name] += value
            for name, scores in [*all_scores.items(), (ORACLE, oracle[..., head:])]:
                if later:
                    shares[keep][name].append(kept_share(scores, later, keep))
                    one = _allocation_shares(
                        profiles[(ORACLE_PROFILE if name == ORACLE else name, keep)],
                        scores,
                        later,
                        keep,
                    )
                    into = allocation[keep].setdefault(name, {})
                    for what, value in one.items():
                        into.setdefault(what, []).append(value)
                    row.setdefault("allocation", {}).setdefault(str(keep), {})[name] = {
                        what: round(value, 4) for what, value in one.items()
                    }
        per_sample.append(row)
        print(f"[scorer_recall] {row}", file=sys.stderr, flush=True)
    settings = {
        "model_path": model_path,
        "num_samples": num_samples,
        "lengths": list(lengths),
        "keep": list(keeps),
        "scorers": list(scorers),
        "seed": seed,
        "oracle": "kvpress KVzipPress",
    }
    recall = {
        str(keep): {name: round(total / len(samples), 4) for name, total in by.items()}
        for keep, by in sums.items()
    }
    answers = {
        str(keep): {name: round(float(np.mean(v)), 4) if v else None for name, v in by.items()}
        for keep, by in shares.items()
    }
    by_allocation = {
        str(keep): {
            name: {what: round(float(np.mean(v)), 4) for what, v in kinds.items()}
            for name, kinds in by.items()
        }
        for keep, by in allocation.items()
    }
    return {
        "settings": settings,
        "recall": recall,
        "later_answer_kept_share": answers,
        "later_answer_kept_share_by_allocation": by_allocation,
        "per_sample": per_sample,
    }


def _allocation_shares(
    profile: BudgetProfile | None,
    scores: np.ndarray,
    later: list[int],
    keep: float,
) -> dict[str, float]:
    """One sample's later-answer kept shares under several allocations of its memory.

    Args:
        profile: the shipped profile for this scorer at target ``keep``, or None.
        scores: float ``[L, H, m]`` (layers, KV heads, scored tokens).
        later: the later answers' token indices into the last axis (non-empty).
        keep: kept fraction in (0, 1].

    Returns:
        ``uniform``: every head keeps ``keep * m`` (:func:`kept_share`); ``global``: the same
        total, spent on the request's top scores over all heads (:func:`kept_share_global`);
        and with a ``profile``: ``profile``, the profile's per-head budgets
        (:func:`profile_budgets`, :func:`kept_share_budgets`), ``profile_global``, exactly the
        profile's total spent per request, and ``profile_kept_fraction``, that total over
        ``L * H * m`` (the fraction the two profile keys are measured at).
    """
    m = scores.shape[-1]
    total = max(1, round(keep * m)) * (scores.size // m)
    out = {
        "uniform": kept_share(scores, later, keep),
        "global": kept_share_global(scores, later, total),
    }
    if profile is None:
        return out
    budgets = profile_budgets(profile, m)
    out["profile"] = kept_share_budgets(
        scores, later, budgets, profile.sink_tokens, profile.recent_window
    )
    out["profile_global"] = kept_share_global(scores, later, int(budgets.sum()))
    out["profile_kept_fraction"] = float(budgets.sum()) / scores.size
    return out


def _check_writable(path: Path) -> None:
    """``--output``'s folder exists and takes files (checked before the run, not after it)."""
    if path.is_dir():
        raise ConfigError(f"--output {path} is a folder; give a file path, e.g. {path}/recall.json")
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise ConfigError(f"--output {path}: folder {folder} does not exist or is not writable")


def _items(text: str, flag: str, example: str) -> tuple[str, ...]:
    """The comma-separated items of ``flag``'s value, stripped; an empty item is refused.

    Raises:
        ConfigError: no item at all, or an empty one (``0.25,,0.5``), naming ``flag``.
    """
    items = tuple(x.strip() for x in text.split(","))
    if not any(items):
        raise ConfigError(f"{flag} {text!r}: name at least one, e.g. {example}")
    if not all(items):
        pos = items.index("") + 1
        raise ConfigError(f"{flag} {text!r}: item {pos} is empty; e.g. {example}")
    return items


def _numbers(text: str, flag: str, example: str, kind: type = float) -> tuple:
    """The comma-separated numbers of ``flag``'s value, each parsed by ``kind`` (float or int:
    ``1024.5`` is refused for an int, not truncated).

    Raises:
        ConfigError: an empty or unparsable item, naming ``flag`` and an example.
    """
    items = _items(text, flag, example)
    try:
        return tuple(kind(x) for x in items)
    except ValueError:
        what = "integers" if kind is int else "numbers"
        raise ConfigError(f"{flag} {text!r}: give comma-separated {what}, e.g. {example}") from None


def _keeps(text: str) -> tuple[float, ...]:
    """``--keep``: kept fractions, each in (0, 1].

    Raises:
        ConfigError: a bad list or a fraction outside (0, 1], naming ``--keep``.
    """
    keeps = _numbers(text, "--keep", "0.25,0.5")
    for keep in keeps:
        if not 0.0 < keep <= 1.0:
            raise ConfigError(
                f"--keep {text!r}: {keep} must be in (0, 1] (a kept fraction), e.g. 0.25,0.5"
            )
    return keeps


def _scorers(text: str) -> tuple[str, ...]:
    """``--scorers``: registered scorer names.

    Raises:
        ConfigError: an empty item or an unregistered name, naming ``--scorers`` and the
            registered ones.
    """
    from tangram_sglang.scoring import available_scorers

    names = _items(text, "--scorers", "kvzip-lite,snapkv")
    for name in names:
        if name not in available_scorers():
            raise ConfigError(
                f"--scorers {text!r}: scorer {name!r} is not registered; registered: "
                f"{', '.join(available_scorers())}"
            )
    return names


def main(argv: list[str] | None = None) -> int:
    """CLI: print (and with ``--output`` write) the recall table as JSON."""
    parser = argparse.ArgumentParser(prog="python -m tangram_sglang.eval.scorer_recall")
    parser.add_argument("--model-path", default="qwen2.5-0.5b", help="HF folder or embedded name")
    parser.add_argument("--num-samples", type=int, default=4, help="contexts (>= 1)")
    parser.add_argument(
        "--lengths", default="1024", help="context lengths, tokens (e.g. 1024,2048)"
    )
    parser.add_argument("--keep", default="0.25,0.5", help="kept fractions in (0, 1]")
    parser.add_argument(
        "--scorers", default="kvzip-lite,snapkv,kvzip-replay", help="Tangram scorers to judge"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", help="write the JSON here too")
    args = parser.parse_args(argv)
    try:
        if args.output:
            _check_writable(Path(args.output))
        lengths = _numbers(args.lengths, "--lengths", "1024,2048", int)
        keeps, scorers = _keeps(args.keep), _scorers(args.scorers)
        report = recall_report(
            args.model_path,
            args.num_samples,
            lengths,
            keeps,
            scorers,
            seed=args.seed,
        )
    except TangramError as err:  # ConfigError, ModelError (an unknown embedded model), ...
        print(f"scorer_recall: {err}", file=sys.stderr)
        return 2
    text = json.dumps(report, indent=1)
    if args.output:
        with open(args.output, "w") as fh:
            fh.write(text + "\n")
    keys = ("recall", "later_answer_kept_share", "later_answer_kept_share_by_allocation")
    print(json.dumps({k: report[k] for k in keys}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
