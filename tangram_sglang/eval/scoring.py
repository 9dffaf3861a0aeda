"""Answer scoring: contains-answer (the headline metric) and exact match, SQuAD-normalised.

``contains_answer`` is RULER's ``string_match_part`` (Hsieh et al., arXiv 2404.06654, App. B):
1 if any gold answer occurs in the prediction, after SQuAD's normalisation (Rajpurkar et al.,
SQuAD v1.1 evaluation script: lower case, punctuation and articles removed, whitespace
collapsed). ``exact_match`` is SQuAD's EM on the same normalisation. Scores are 0/1 per turn;
aggregates are means in points (0-100).
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterable

METRIC = "contains_answer"
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize(text: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    text = _ARTICLES.sub(" ", text.lower().translate(_PUNCT))
    return " ".join(text.split())


def contains_answer(prediction: str, answers: Iterable[str]) -> float:
    """1.0 if any normalised gold answer is a substring of the normalised prediction, else 0.0.

    An answer that normalises to "" (only punctuation/articles) never matches.
    """
    pred = f" {normalize(prediction)} "
    return float(any(a and f" {a} " in pred for a in map(normalize, answers)))


def exact_match(prediction: str, answers: Iterable[str]) -> float:
    """1.0 if the normalised prediction equals any normalised gold answer, else 0.0."""
    pred = normalize(prediction)
    return float(any(pred == normalize(a) for a in answers))


def score(prediction: str, answers: Iterable[str]) -> dict[str, float]:
    """Both metrics of one prediction: ``{"contains_answer": x, "exact_match": y}``."""
    answers = tuple(answers)
    return {
        "contains_answer": contains_answer(prediction, answers),
        "exact_match": exact_match(prediction, answers),
    }
