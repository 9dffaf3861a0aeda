"""``bench.dummy_tokenizer``: a word-level tokenizer for a config-only (dummy-weight) model."""

from __future__ import annotations

import json

import pytest

from tangram_sglang.bench.dummy_tokenizer import main, write_dummy_tokenizer
from tangram_sglang.errors import ConfigError


def _config(tmp_path, **over):
    cfg = {"vocab_size": 300, "bos_token_id": 1, "eos_token_id": [2, 7]} | over
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_every_id_round_trips_and_the_special_ids_come_from_the_config(tmp_path):
    from transformers import AutoTokenizer

    written = write_dummy_tokenizer(_config(tmp_path))
    assert [p.name for p in written] == ["tokenizer.json", "tokenizer_config.json"]
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == 300
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)  # first of the config's EOS list
    ids = [0, 5, 150, 299]
    assert tok.decode(ids) == "<t0> <t5> <t150> <t299>"
    assert tok(tok.decode(ids), add_special_tokens=False).input_ids == ids


def test_existing_files_are_kept_unless_overwrite(tmp_path):
    folder = _config(tmp_path)
    write_dummy_tokenizer(folder)
    (folder / "tokenizer_config.json").write_text("{}")
    assert write_dummy_tokenizer(folder) == []
    assert (folder / "tokenizer_config.json").read_text() == "{}"
    assert len(write_dummy_tokenizer(folder, overwrite=True)) == 2
    assert json.loads((folder / "tokenizer_config.json").read_text())["eos_token"] == "<t2>"


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"vocab_size": "big"}, "vocab_size must be an int >= 2"),
        ({"eos_token_id": None}, "eos_token_id must be a token id"),
        ({"bos_token_id": 300}, "bos_token_id 300 is outside the vocabulary 0..299"),
    ],
)
def test_bad_config_is_named(tmp_path, over, message):
    with pytest.raises(ConfigError, match=message):
        write_dummy_tokenizer(_config(tmp_path, **over))


def test_cli_names_a_missing_config(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert "config.json: no such file" in capsys.readouterr().err
