"""The embedded-model helper: verification, rebuild of a broken cache, clear errors."""

from __future__ import annotations

import shutil

import pytest

from tangram_sglang import models
from tangram_sglang.errors import ModelError


def test_unknown_model_lists_the_valid_names():
    with pytest.raises(ModelError) as err:
        models.model_path("llama-70b")
    for name in models.MODELS:
        assert name in str(err.value)


def test_cli_rejects_unknown_model(capsys):
    assert models.main(["path", "nope"]) == 2
    assert "valid names" in capsys.readouterr().err


@pytest.fixture
def cache_copy(smollm2_path, tmp_path, monkeypatch):
    """A private copy of the converted cache so a test can damage it."""
    monkeypatch.setenv("TANGRAM_CACHE_DIR", str(tmp_path))
    folder = models.cache_dir() / "smollm2"
    shutil.copytree(smollm2_path, folder)
    assert models.verify(folder) is None
    return folder


def test_verify_detects_a_missing_and_a_corrupt_file(cache_copy):
    (cache_copy / "tokenizer.json").unlink()
    assert "tokenizer.json is missing" in models.verify(cache_copy)
    shutil.copy(cache_copy / "config.json", cache_copy / "tokenizer.json")
    assert "tokenizer.json" in models.verify(cache_copy)


@pytest.mark.slow
def test_truncated_cache_is_rebuilt(cache_copy, capsys):
    weights = cache_copy / "model.safetensors"
    with weights.open("r+b") as f:
        f.truncate(1000)
    assert models.model_path("smollm2") == cache_copy
    assert models.verify(cache_copy) is None
    assert "rebuilding" in capsys.readouterr().err


@pytest.mark.slow
def test_deleted_cache_is_rebuilt(cache_copy):
    shutil.rmtree(cache_copy)
    assert models.model_path("smollm2", verbose=False) == cache_copy
    assert models.verify(cache_copy) is None
