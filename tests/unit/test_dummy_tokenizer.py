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
        ({"vocab_size": "big"}, "vocab_size must be an int in 2..2097152"),
        ({"vocab_size": True}, "vocab_size must be an int in 2..2097152, got True"),
        ({"vocab_size": (1 << 21) + 1}, "vocab_size must be an int in 2..2097152"),
        ({"eos_token_id": None}, "eos_token_id must be a token id"),
        ({"eos_token_id": []}, r"eos_token_id must be a token id .* got \[\]; set it"),
        ({"bos_token_id": True}, "bos_token_id must be a token id"),
        ({"bos_token_id": 300}, "bos_token_id 300 is outside the vocabulary 0..299"),
        ({"max_position_embeddings": "x"}, "max_position_embeddings must be a positive int"),
        ({"max_position_embeddings": None}, "max_position_embeddings must be a positive int"),
    ],
)
def test_bad_config_is_named(tmp_path, over, message):
    with pytest.raises(ConfigError, match=message):
        write_dummy_tokenizer(_config(tmp_path, **over))
    assert not (tmp_path / "tokenizer.json").exists()


@pytest.mark.parametrize("text", ["[1, 2]", '"llama"', "null"])
def test_a_config_that_is_not_an_object_is_named(tmp_path, text, capsys):
    (tmp_path / "config.json").write_text(text)
    assert main([str(tmp_path)]) == 2
    assert "config.json: must be a JSON object" in capsys.readouterr().err


def test_unreadable_config_and_unwritable_folder_are_named(tmp_path, capsys):
    unreadable = tmp_path / "a"
    (unreadable / "config.json").mkdir(parents=True)  # a folder where the file should be
    assert main([str(unreadable)]) == 2
    assert "a/config.json: cannot read it" in capsys.readouterr().err
    folder = tmp_path / "m"
    folder.mkdir()
    _config(folder)
    assert main([str(folder / "config.json")]) == 2  # the config file given as the folder
    assert "cannot read it (Not a directory)" in capsys.readouterr().err
    (folder / "tokenizer.json").mkdir()  # a folder where the file is written
    assert main([str(folder)]) == 2
    assert "cannot write the tokenizer files" in capsys.readouterr().err
