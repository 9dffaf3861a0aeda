"""Calibration maths and data readers (numpy/scipy only, no model)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from tangram_sglang.calibrate.data import _jsonl_texts, read_sharegpt_records
from tangram_sglang.calibrate.fit import (
    expected_kept_fraction,
    fit_ratios,
    padding_waste,
    rank_stability,
    stability_report,
)
from tangram_sglang.calibrate.observe import head_retention
from tangram_sglang.errors import ConfigError
from tangram_sglang.grouping import HeadGrouping


def test_fit_is_mean_plus_alpha_std_clipped():
    retention = np.array([[[0.1, 0.5, 0.0]], [[0.3, 0.9, 0.0]]])  # 2 samples, 1 layer, 3 heads
    fit = fit_ratios(retention, alpha=2.0, floor=0.05)
    std = np.std([0.1, 0.3], ddof=1)
    assert fit.ratio[0, 0] == pytest.approx(0.2 + 2 * std)
    assert fit.ratio[0, 1] == 1.0  # 0.7 + 2 * 0.28 clipped at 1
    assert fit.ratio[0, 2] == 0.05  # floor
    assert fit.std[0, 2] == 0.0


def test_fit_rejects_nan_and_bad_floor():
    with pytest.raises(ConfigError, match="NaN"):
        fit_ratios(np.full((2, 1, 1), np.nan))
    with pytest.raises(ConfigError, match="floor"):
        fit_ratios(np.zeros((2, 1, 1)), floor=0.0)


def test_rank_stability():
    base = np.linspace(0, 1, 12).reshape(3, 4)
    noisy = np.stack([base + 0.001 * i for i in range(5)])  # same ranking every sample
    assert rank_stability(noisy) == pytest.approx((1.0, 1.0))
    shuffled = np.stack([np.random.default_rng(i).permutation(12).reshape(3, 4) for i in range(6)])
    rho_mean, rho_min = rank_stability(shuffled.astype(float))
    assert rho_mean < 0.5 and rho_min < rho_mean
    assert all(math.isnan(x) for x in rank_stability(np.full((3, 2, 2), 0.25)))  # uniform


def test_padding_waste():
    ratio = np.array([[1.0, 0.5], [0.5, 0.25]])
    assert padding_waste(ratio, 1, "global") == 0.0
    # H_p=2 global: groups {1.0, 0.5} and {0.5, 0.25} allocate 2 * (1.0 + 0.5) = 3.0 for 2.25.
    assert padding_waste(ratio, 2, "global") == pytest.approx(1 - 2.25 / 3.0)
    # per_layer: {1.0, 0.5} and {0.5, 0.25} again, same answer; H_p=4 cannot divide 2 heads.
    assert padding_waste(ratio, 2, "per_layer") == pytest.approx(1 - 2.25 / 3.0)
    assert padding_waste(ratio, 4, "per_layer") is None
    # H_p=8 global: one group of 8 columns, 4 empty: 8 * 1.0 allocated.
    assert padding_waste(ratio, 8, "global") == pytest.approx(1 - 2.25 / 8)


def test_expected_kept_fraction_uses_group_lengths():
    ratio = np.array([[1.0, 0.5]])
    grouping = HeadGrouping.build(ratio, 2, "global")
    assert expected_kept_fraction(ratio, None, [100], 0, 0) == pytest.approx(0.75)
    assert expected_kept_fraction(ratio, grouping, [100], 0, 0) == pytest.approx(1.0)


def test_stability_report_fields():
    retention = np.random.default_rng(0).uniform(0.1, 0.4, size=(6, 3, 2))
    fit = fit_ratios(retention)
    grouping = HeadGrouping.build(fit.ratio, 2, "global")
    report = stability_report(retention, fit, [1000, 2000], 0.25, 4, 32, grouping)
    assert set(report["padding_waste"]) == {"per_layer", "global"}
    assert report["padding_waste"]["per_layer"]["4"] is None
    assert report["expected_kept_fraction_groups"] >= report["expected_kept_fraction_heads"]
    assert np.asarray(report["split_half_mean"][0]).shape == (3, 2)
    json.dumps(report)  # JSON-ready


def test_head_retention_inverts_kept_len():
    rng = np.random.default_rng(0)
    scores = rng.random((2, 3, 300)).astype(np.float32)
    for allocation in ("layer", "global", "uniform", "pyramid", "duo"):
        r = head_retention(scores, allocation, 0.25, 4, 32, 32)
        assert r.shape == (2, 3) and (r >= 0).all() and (r <= 1).all()
        if allocation in ("layer", "global", "uniform"):  # same total budget, redistributed
            assert r.mean() == pytest.approx(0.25, abs=0.01)
    assert (head_retention(scores, "uniform", 0.5, 4, 32, 32) == 0.5).all()
    with pytest.raises(ConfigError, match="allocation"):
        head_retention(scores, "h2o", 0.5, 4, 32, 32)


def test_truncated_sharegpt_file_is_read_record_by_record(tmp_path):
    records = [
        {"id": str(i), "conversations": [{"from": "human", "value": "x" * i}]} for i in range(3)
    ]
    text = json.dumps(records)
    path = tmp_path / "sharegpt.json"
    path.write_text(text[: len(text) - 20])  # cut inside the last record
    assert [r["id"] for r in read_sharegpt_records(path)] == ["0", "1"]


class _Tok:
    def apply_chat_template(self, messages, tokenize=False):
        return "|".join(f"{m['role']}:{m['content']}" for m in messages)


def test_jsonl_rows(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [
        {"text": "plain"},
        {"messages": [{"role": "user", "content": "hi"}]},
        {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    texts = sorted(t for _, t in _jsonl_texts(path, _Tok(), 1, 0))
    assert texts == ["plain", "user:a|assistant:b", "user:hi"]
    path.write_text('{"other": 1}\n')
    with pytest.raises(ConfigError, match="d.jsonl:1"):
        list(_jsonl_texts(path, _Tok(), 1, 0))


@pytest.mark.parametrize(
    "line",
    [
        '{"conversations": [{"from": "human"}]}',  # no value: was a raw KeyError
        '{"conversations": ["x"]}',  # was AttributeError
        '{"messages": ["x"]}',  # was a jinja2 UndefinedError from the chat template
        '{"messages": [{"role": "user", "content": 3}]}',
        '["text"]',
    ],
)
def test_jsonl_malformed_rows_name_the_line(tmp_path, line):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "ok"}\n' + line + "\n")
    with pytest.raises(ConfigError, match=r"d.jsonl:2: a row needs"):
        list(_jsonl_texts(path, _Tok(), 1, 0))


def test_jsonl_not_utf8_is_a_config_error(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\xff\xfe\n")
    with pytest.raises(ConfigError, match="d.jsonl: cannot read it as UTF-8"):
        list(_jsonl_texts(path, _Tok(), 1, 0))
