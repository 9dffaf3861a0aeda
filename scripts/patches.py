#!/usr/bin/env python3
"""Apply, unapply or check Tangram's patches to the installed sglang 0.5.17 (stdlib only).

    python scripts/patches.py apply      # patch sglang, register the plugin entry point
    python scripts/patches.py unapply    # restore the pristine sglang files, byte for byte
    python scripts/patches.py check      # exit 0 applied, 1 not applied, 2 broken / wrong version

The patches are unified diffs in ``patches/*.patch`` (paths ``a/sglang/...``), applied in name
order by the strict applier below: every context and removed line must match exactly (a hunk may
move, but only to one unique place), so a patch never lands on a file it was not written for.

Safety rules:
- The installed sglang must be version 0.5.17 (its dist-info METADATA), else nothing is touched.
- The pristine bytes are known from the wheel's ``RECORD`` (sha256 of every file). ``apply``
  refuses a file that is neither pristine nor already patched by us; ``unapply`` writes a file only
  when the result's sha256 equals ``RECORD``'s, so it restores the wheel's bytes or does nothing.
- ``apply`` twice is a no-op with a message; so is ``unapply`` on a pristine package.
- Writes are atomic (temp file + rename) and drop the file's stale ``__pycache__`` entries.
- ``apply`` also makes sure the ``sglang.srt.plugins`` entry point ``tangram`` is installed (it is
  declared in pyproject.toml and installed by ``pip install -e .``; if the installed metadata
  lacks it, it is added to the tangram-sglang dist-info ``entry_points.txt``). ``unapply`` leaves
  it: on a pristine sglang the plugin finds no ``--tangram`` field and registers nothing.
"""

from __future__ import annotations

import argparse
import base64
import configparser
import csv
import hashlib
import importlib.metadata
import importlib.util
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

PINNED_VERSION = "0.5.17"
REPO = Path(__file__).resolve().parents[1]
PATCH_DIR = REPO / "patches"
ENTRY_POINT_GROUP = "sglang.srt.plugins"
ENTRY_POINT_NAME = "tangram"
ENTRY_POINT_VALUE = "tangram_sglang.integration.plugin:register"
PROJECT_DIST = "tangram-sglang"

EXIT_OK, EXIT_NOT_APPLIED, EXIT_BROKEN = 0, 1, 2


class PatchError(Exception):
    """A patch cannot be applied or reverted cleanly, or the package is not the pinned one."""


# ---- unified diff parsing and strict application --------------------------------------------
@dataclass
class Hunk:
    """One ``@@`` hunk: ``old`` and ``new`` lines (with their newlines), 1-based start lines."""

    old_start: int
    new_start: int
    old: list[str] = field(default_factory=list)
    new: list[str] = field(default_factory=list)

    def reversed(self) -> Hunk:
        return Hunk(self.new_start, self.old_start, list(self.new), list(self.old))


@dataclass
class FilePatch:
    """The hunks of one file; ``path`` is relative to site-packages (``sglang/srt/...``)."""

    path: str
    hunks: list[Hunk]


def parse_patch(text: str) -> list[FilePatch]:
    """Parse a unified diff (``--- a/X`` / ``+++ b/X`` / ``@@ -s,n +s,n @@``)."""
    files: list[FilePatch] = []
    lines = text.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            path = lines[i + 1][4:].split("\t")[0].strip()
            path = path[2:] if path.startswith("b/") else path
            files.append(FilePatch(path, []))
            i += 2
            continue
        if line.startswith("@@"):
            if not files:
                raise PatchError("hunk before any file header")
            header = line.split("@@")[1].split()
            hunk = Hunk(int(header[0][1:].split(",")[0]), int(header[1][1:].split(",")[0]))
            i += 1
            while i < len(lines) and lines[i][:1] in (" ", "-", "+", "\\"):
                body = lines[i]
                if body.startswith("\\"):  # "\ No newline at end of file": previous line
                    kind = lines[i - 1][0]
                    for side, owner in ((hunk.old, "- "), (hunk.new, "+ ")):
                        if kind in owner:
                            side[-1] = side[-1].removesuffix("\n")
                elif body[0] == " ":
                    hunk.old.append(body[1:])
                    hunk.new.append(body[1:])
                elif body[0] == "-":
                    hunk.old.append(body[1:])
                else:
                    hunk.new.append(body[1:])
                i += 1
            files[-1].hunks.append(hunk)
            continue
        i += 1
    return files


def apply_hunks(content: str, hunks: list[Hunk], path: str) -> str:
    """Apply hunks exactly; raises :class:`PatchError` naming the file and hunk on a mismatch."""
    lines = content.splitlines(keepends=True)
    offset = 0
    for number, hunk in enumerate(hunks, 1):
        pos = _locate(lines, hunk.old, hunk.old_start - 1 + offset)
        if pos is None:
            raise PatchError(f"{path}: hunk {number} (line {hunk.old_start}) does not match")
        lines[pos : pos + len(hunk.old)] = hunk.new
        offset = pos - (hunk.old_start - 1) + len(hunk.new) - len(hunk.old)
    return "".join(lines)


def _locate(lines: list[str], old: list[str], expected: int) -> int | None:
    """Start index of ``old`` in ``lines``: the expected one, else the unique match, else None."""
    n = len(old)
    if 0 <= expected <= len(lines) - n and lines[expected : expected + n] == old:
        return expected
    hits = [i for i in range(len(lines) - n + 1) if lines[i : i + n] == old]
    return hits[0] if len(hits) == 1 else None


# ---- the installed package --------------------------------------------------------------------
def default_site_packages() -> Path:
    """The site-packages folder holding the ``sglang`` this interpreter imports (not imported)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise PatchError("sglang is not installed in this interpreter; `pip install -e .` first")
    return Path(list(spec.submodule_search_locations)[0]).parent


def installed_version(site: Path) -> str:
    """``Version:`` from ``sglang-*.dist-info/METADATA`` in ``site``."""
    infos = sorted(site.glob("sglang-*.dist-info"))
    if len(infos) != 1:
        raise PatchError(f"{site}: expected one sglang-*.dist-info, found {len(infos)}")
    for line in (infos[0] / "METADATA").read_text().splitlines():
        if line.startswith("Version:"):
            return line.split(":", 1)[1].strip()
    raise PatchError(f"{infos[0]}/METADATA has no Version line")


def record_hashes(site: Path) -> dict[str, str]:
    """``{relative path: 'sha256=<urlsafe b64>'}`` from the sglang wheel's RECORD."""
    (info,) = site.glob("sglang-*.dist-info")
    with (info / "RECORD").open(newline="") as fh:
        return {row[0]: row[1] for row in csv.reader(fh) if len(row) >= 2 and row[1]}


def file_hash(data: bytes) -> str:
    """The RECORD form of a sha256: ``sha256=`` + urlsafe base64 without padding."""
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def check_version(site: Path) -> None:
    version = installed_version(site)
    if version != PINNED_VERSION:
        raise PatchError(
            f"installed sglang is {version} but Tangram's patches are written for "
            f"sglang=={PINNED_VERSION}; install it (`pip install sglang=={PINNED_VERSION}`) "
            "or port patches/ and integration/hook_targets.py to the new version. Nothing changed."
        )


def load_patches(patch_dir: Path) -> list[tuple[str, list[FilePatch]]]:
    patches = [(p.name, parse_patch(p.read_text())) for p in sorted(patch_dir.glob("*.patch"))]
    if not patches:
        raise PatchError(f"{patch_dir}: no *.patch files")
    return patches


# ---- state, apply, unapply -----------------------------------------------------------------
def read_text(path: Path) -> str:
    return path.read_bytes().decode("utf-8")


def unapplied_content(content: str, file_patches: list[FilePatch]) -> str:
    """Revert the given patches of one file (newest first); raises PatchError if one does not."""
    for fp in reversed(file_patches):
        content = apply_hunks(content, [h.reversed() for h in reversed(fp.hunks)], fp.path)
    return content


def plan(site: Path, patches: list[tuple[str, list[FilePatch]]]) -> dict[str, dict]:
    """Per touched file: current text, pristine hash, and the patch names already applied.

    Raises:
        PatchError: a file is neither pristine nor patched by a prefix of our patches.
    """
    record = record_hashes(site)
    by_file: dict[str, list[tuple[str, FilePatch]]] = {}
    for name, file_patches in patches:
        for fp in file_patches:
            by_file.setdefault(fp.path, []).append((name, fp))
    result = {}
    for path, items in by_file.items():
        if path not in record:
            raise PatchError(f"{path} is not a file of the sglang wheel (not in RECORD)")
        content = read_text(site / path)
        pristine = record[path]
        for k in range(len(items), -1, -1):  # how many of this file's patches are applied
            try:
                base = unapplied_content(content, [fp for _, fp in items[:k]])
            except PatchError:
                continue
            if file_hash(base.encode()) == pristine:
                result[path] = {"content": content, "pristine": pristine, "items": items, "k": k}
                break
        else:
            raise PatchError(
                f"{site / path} is neither pristine sglang {PINNED_VERSION} nor patched by "
                "patches/: someone changed it; reinstall sglang "
                f"(`pip install --force-reinstall --no-deps sglang=={PINNED_VERSION}`)"
            )
    return result


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` atomically, keep its mode, drop its stale bytecode."""
    mode = path.stat().st_mode
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "wb") as fh:
        fh.write(text.encode("utf-8"))
    os.chmod(tmp, mode & 0o7777)
    os.replace(tmp, path)
    for pyc in (path.parent / "__pycache__").glob(f"{path.stem}.*.pyc"):
        pyc.unlink(missing_ok=True)


def apply(site: Path, patch_dir: Path) -> str:
    check_version(site)
    state = plan(site, load_patches(patch_dir))
    changed = []
    for path, st in state.items():
        items, k = st["items"], st["k"]
        if k == len(items):
            continue
        content = st["content"]
        for _, fp in items[k:]:
            content = apply_hunks(content, fp.hunks, fp.path)
        if (
            file_hash(unapplied_content(content, [fp for _, fp in items]).encode())
            != st["pristine"]
        ):
            raise PatchError(f"{path}: patched text would not revert to pristine; not applied")
        write_atomic(site / path, content)
        changed.append(path)
    if not changed:
        return f"patches already applied to sglang {PINNED_VERSION} in {site}: nothing to do"
    return f"applied patches to {', '.join(changed)} in {site}"


def unapply(site: Path, patch_dir: Path) -> str:
    check_version(site)
    state = plan(site, load_patches(patch_dir))
    restored = []
    for path, st in state.items():
        if st["k"] == 0:
            continue
        base = unapplied_content(st["content"], [fp for _, fp in st["items"][: st["k"]]])
        if file_hash(base.encode()) != st["pristine"]:  # plan() guarantees it; never write else
            raise PatchError(f"{path}: reverting would not give the pristine bytes; untouched")
        write_atomic(site / path, base)
        restored.append(path)
    if not restored:
        return f"sglang in {site} is already pristine: nothing to do"
    return f"restored pristine {', '.join(restored)} in {site}"


def status(site: Path, patch_dir: Path) -> tuple[int, str]:
    check_version(site)
    state = plan(site, load_patches(patch_dir))
    applied = all(st["k"] == len(st["items"]) for st in state.values())
    pristine = all(st["k"] == 0 for st in state.values())
    if applied:
        return EXIT_OK, f"patches applied ({', '.join(state)})"
    if pristine:
        return EXIT_NOT_APPLIED, "patches not applied (sglang is pristine); run `make apply`"
    return EXIT_NOT_APPLIED, "patches partly applied; run `make apply`"


# ---- plugin entry point -------------------------------------------------------------------------
def metadata_dirs() -> list[Path]:
    """Every installed metadata folder of tangram-sglang that ``importlib.metadata`` may read.

    ``pip install -e .`` leaves a ``tangram_sglang.egg-info`` in the repository besides the
    ``dist-info`` in site-packages; a process started from the repository root (``python -m
    sglang.launch_server``, pytest) finds the egg-info first, so both must carry the entry point.
    """
    dirs = {
        Path(str(d._path))
        for d in importlib.metadata.distributions()
        if (d.metadata["Name"] or "").lower().replace("_", "-") == PROJECT_DIST
    }
    egg_info = REPO / "tangram_sglang.egg-info"
    if egg_info.is_dir():
        dirs.add(egg_info)
    if not dirs:
        raise PatchError(f"{PROJECT_DIST} is not installed; run `pip install -e .` first")
    return sorted(dirs)


def ensure_entry_point() -> str:
    """Make sure ``tangram = tangram_sglang.integration.plugin:register`` is installed."""
    written = []
    for info in metadata_dirs():
        parser = configparser.ConfigParser(delimiters=("=",))
        parser.optionxform = str  # keep entry-point names as written
        eps_file = info / "entry_points.txt"
        if eps_file.exists():
            parser.read(eps_file)
        if parser.has_option(ENTRY_POINT_GROUP, ENTRY_POINT_NAME) and (
            parser.get(ENTRY_POINT_GROUP, ENTRY_POINT_NAME) == ENTRY_POINT_VALUE
        ):
            continue
        if not parser.has_section(ENTRY_POINT_GROUP):
            parser.add_section(ENTRY_POINT_GROUP)
        parser.set(ENTRY_POINT_GROUP, ENTRY_POINT_NAME, ENTRY_POINT_VALUE)
        with eps_file.open("w") as fh:
            parser.write(fh)
        written.append(str(eps_file))
    if not written:
        return f"plugin entry point {ENTRY_POINT_NAME}: registered (pyproject.toml declares it)"
    return (
        f"installed plugin entry point {ENTRY_POINT_NAME} = {ENTRY_POINT_VALUE} into "
        f"{', '.join(written)}; declare it in pyproject.toml too so `pip install -e .` keeps it"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["apply", "unapply", "check"])
    parser.add_argument(
        "--site-packages",
        type=Path,
        default=None,
        help="folder holding sglang/ and sglang-*.dist-info (default: this interpreter's)",
    )
    parser.add_argument("--patch-dir", type=Path, default=PATCH_DIR)
    parser.add_argument(
        "--skip-entry-point",
        action="store_true",
        help="do not install the plugin entry point (implied with --site-packages)",
    )
    args = parser.parse_args(argv)
    try:
        site = args.site_packages or default_site_packages()
        if args.action == "check":
            code, message = status(site, args.patch_dir)
            print(message)
            return code
        if args.action == "apply":
            print(apply(site, args.patch_dir))
            if args.site_packages is None and not args.skip_entry_point:
                print(ensure_entry_point())
        else:
            print(unapply(site, args.patch_dir))
    except PatchError as exc:
        print(f"patches.py {args.action}: error: {exc}", file=sys.stderr)
        return EXIT_BROKEN
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
