"""Accuracy-task construction (tangram_sglang.eval.tasks) on the real RULER data and tokenizer."""

from __future__ import annotations

import pytest

from tangram_sglang.errors import ConfigError
from tangram_sglang.eval.tasks import (
    build_samples,
    check_sizes,
    conversation_ids,
    squad_paragraphs,
)


@pytest.fixture(scope="module")
def tok(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.mark.parametrize("depth", [0.0, 0.5, 0.9], ids=["d0", "d0.5", "d0.9"])
def test_needle_is_hidden_at_its_depth_in_a_haystack_of_the_asked_length(tok, depth):
    (sample,) = build_samples("needle", tok, 1, (400,), depths=(depth,))
    (turn,) = sample.turns
    (number,) = turn.answers
    assert len(number) == 7 and number.isdigit()
    context = sample.context.split("afterwards.\n", 1)[1].removesuffix("\n")
    pos = context.index(f"is: {number}.")
    assert abs(pos / len(context) - depth) < 0.1
    assert sample.meta["key"] in turn.user and turn.user.startswith("What is the special")
    assert sample.meta["key"] not in sample.context.replace(f"for {sample.meta['key']} is:", "")
    assert 380 <= len(tok(context, add_special_tokens=False)["input_ids"]) <= 420


def test_samples_are_deterministic_and_cycle_lengths_and_depths(tok):
    a = build_samples("needle", tok, 4, (200, 300), depths=(0.1, 0.9), seed=3)
    b = build_samples("needle", tok, 4, (200, 300), depths=(0.1, 0.9), seed=3)
    assert a == b
    assert [s.context_tokens for s in a] == [200, 300, 200, 300]
    assert [s.meta["depth"] for s in a] == [0.1, 0.1, 0.9, 0.9]
    assert len({s.sample_id for s in a}) == 4
    assert build_samples("needle", tok, 1, (200,), seed=4)[0] != a[0]


def test_squad_sample_holds_the_gold_paragraph_and_its_answers(tok):
    (sample,) = build_samples("squad", tok, 1, (500,))
    (turn,) = sample.turns
    (qid,) = sample.meta["squad_ids"]
    context, qas = next((c, q) for c, q in squad_paragraphs() if any(x[0] == qid for x in q))
    assert context in sample.context and context not in turn.user
    question, answers = next((x[1], x[2]) for x in qas if x[0] == qid)
    assert turn.user == f"Question: {question}" and question not in sample.context
    assert turn.answers == answers and all(a in context for a in answers)
    assert sample.meta["num_documents"] > 1 and sample.meta["document_tokens"] <= 500


def test_multiturn_shares_one_document_and_each_turn_extends_the_last(tok):
    (sample,) = build_samples("multiturn-squad", tok, 1, (500,), num_turns=3)
    assert len(sample.turns) == 3
    assert "Document 1:" in sample.context
    assert all("Document 1:" not in t.user for t in sample.turns)
    for qid in sample.meta["squad_ids"]:  # every question's gold paragraph is in the context
        context = next(c for c, q in squad_paragraphs() if any(x[0] == qid for x in q))
        assert context in sample.context
    conv = conversation_ids(sample, tok)
    ids = [conv.context_ids, *conv.turn_ids]
    for earlier, later in zip(ids, ids[1:], strict=False):  # a radix prefix of the next turn
        assert later[: len(earlier)] == earlier and len(later) > len(earlier)
    ids = conv.turn_ids
    gold = tok(sample.turns[0].answers[0], add_special_tokens=False)["input_ids"]
    assert ids[1][len(ids[0]) : len(ids[0]) + len(gold)] == gold  # history = gold answer


@pytest.mark.parametrize("task", ["needle", "squad"])
def test_the_context_ids_hold_no_question_and_the_whole_prompt_is_the_chat_template(tok, task):
    (sample,) = build_samples(task, tok, 1, (300,))
    conv = conversation_ids(sample, tok)
    (ids,) = conv.turn_ids
    context_text = tok.decode(conv.context_ids)
    assert context_text.endswith(sample.context) and sample.turns[0].user not in context_text
    question_text = tok.decode(ids[len(conv.context_ids) :])
    assert question_text.startswith(sample.turns[0].user)
    messages = [{"role": "user", "content": sample.context + sample.turns[0].user}]
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tok.decode(ids) == rendered  # the split changes no text, only where tokens are cut


@pytest.mark.parametrize(
    ("task", "kwargs", "field"),
    [
        ("sudoku", {}, "--task"),
        ("needle", {"num_samples": 0}, "--num-samples"),
        ("needle", {"lengths": (64,)}, "--lengths"),
        ("needle", {"depths": (1.5,)}, "--depths"),
        ("multiturn-squad", {"num_turns": 1}, "--num-turns"),
    ],
    ids=["task", "num-samples", "lengths", "depths", "num-turns"],
)
def test_bad_sizes_are_config_errors_naming_the_flag(tok, task, kwargs, field):
    args = {"num_samples": 1, "lengths": (200,)} | kwargs
    with pytest.raises(ConfigError, match=field):
        build_samples(task, tok, **args)
    with pytest.raises(ConfigError, match=field):  # the CLI's check, before any model loads
        check_sizes(
            (task,),
            args["num_samples"],
            args["lengths"],
            args.get("depths", (0.5,)),
            args.get("num_turns", 3),
        )


@pytest.mark.parametrize("task", ["needle", "multiturn-squad"])
def test_query_aware_compresses_the_whole_first_prompt(tok, task):
    from tangram_sglang.eval.tasks import for_protocol

    (sample,) = build_samples(task, tok, 1, (200,), num_turns=2)
    conv = conversation_ids(sample, tok)
    assert for_protocol(conv, "query-agnostic") is conv
    aware = for_protocol(conv, "query-aware")
    assert aware.context_ids == conv.turn_ids[0] and aware.turn_ids == conv.turn_ids
    question = tok.decode(aware.context_ids[len(conv.context_ids) :])
    assert sample.turns[0].user in question  # the question is inside the compressed part
    for ids in aware.turn_ids[1:]:
        assert ids[: len(aware.context_ids)] == aware.context_ids
    with pytest.raises(ConfigError, match="--protocol 'nope'"):
        for_protocol(conv, "nope")
