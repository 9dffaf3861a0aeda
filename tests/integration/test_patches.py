"""scripts/patches.py on a temp copy of the installed sglang files (the venv is left as it is)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "patches.py"
sys.path.insert(0, str(SCRIPT.parent))
import patches  # noqa: E402  (scripts/ is not a package)


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, check=False
    )


def touched_files() -> list[str]:
    return sorted({fp.path for _, fps in patches.load_patches(patches.PATCH_DIR) for fp in fps})


@pytest.fixture
def site(tmp_path):
    """A pristine copy of the patched files + the wheel's METADATA and RECORD."""
    real = patches.default_site_packages()
    record = patches.record_hashes(real)
    (info,) = real.glob("sglang-*.dist-info")
    (tmp_path / info.name).mkdir()
    for name in ("METADATA", "RECORD"):
        shutil.copy(info / name, tmp_path / info.name / name)
    for path in touched_files():
        dest = tmp_path / path
        dest.parent.mkdir(parents=True, exist_ok=True)
        text = (real / path).read_text()
        patched = patches.plan(real, patches.load_patches(patches.PATCH_DIR))[path]
        base = patches.unapplied_content(text, [fp for _, fp in patched["items"][: patched["k"]]])
        dest.write_bytes(base.encode())
        assert patches.file_hash(dest.read_bytes()) == record[path]
    return tmp_path


def hashes(site: Path) -> dict[str, str]:
    return {p: patches.file_hash((site / p).read_bytes()) for p in touched_files()}


def test_apply_is_idempotent_and_unapply_restores_pristine_bytes(site):
    pristine = hashes(site)
    assert run("check", "--site-packages", str(site)).returncode == patches.EXIT_NOT_APPLIED
    first = run("apply", "--site-packages", str(site))
    assert first.returncode == 0 and "applied patches to sglang/srt/server_args.py" in first.stdout
    patched = hashes(site)
    assert patched != pristine
    assert "tangram_profile: A[" in (site / "sglang/srt/server_args.py").read_text()
    second = run("apply", "--site-packages", str(site))
    assert second.returncode == 0 and "already applied" in second.stdout
    assert hashes(site) == patched
    assert run("check", "--site-packages", str(site)).returncode == patches.EXIT_OK
    undo = run("unapply", "--site-packages", str(site))
    assert undo.returncode == 0 and "restored pristine" in undo.stdout
    assert hashes(site) == pristine == {p: patches.record_hashes(site)[p] for p in pristine}
    again = run("unapply", "--site-packages", str(site))
    assert again.returncode == 0 and "already pristine" in again.stdout


def test_wrong_version_is_refused_and_nothing_changes(site):
    (info,) = site.glob("sglang-*.dist-info")
    meta = info / "METADATA"
    meta.write_text(meta.read_text().replace("Version: 0.5.17", "Version: 0.5.23", 1))
    before = hashes(site)
    result = run("apply", "--site-packages", str(site))
    assert result.returncode == patches.EXIT_BROKEN
    assert "installed sglang is 0.5.23" in result.stderr and "sglang==0.5.17" in result.stderr
    assert hashes(site) == before


def test_foreign_edit_is_refused(site):
    target = site / "sglang/srt/server_args.py"
    target.write_text(target.read_text() + "# someone else's edit\n")
    before = hashes(site)
    for action in ("apply", "unapply"):
        result = run(action, "--site-packages", str(site))
        assert result.returncode == patches.EXIT_BROKEN
        assert "neither pristine" in result.stderr
    assert hashes(site) == before


def test_venv_is_patched_and_entry_point_installed():
    assert run("check").returncode == patches.EXIT_OK
    from importlib.metadata import entry_points

    names = {ep.name: ep.value for ep in entry_points(group=patches.ENTRY_POINT_GROUP)}
    assert names.get(patches.ENTRY_POINT_NAME) == patches.ENTRY_POINT_VALUE


def test_parser_round_trip():
    (name, file_patches), *_ = patches.load_patches(patches.PATCH_DIR)
    text = "".join(f"line {i}\n" for i in range(10))
    hunk = patches.Hunk(3, 3, ["line 2\n", "line 3\n"], ["line 2\n", "new\n", "line 3\n"])
    patched = patches.apply_hunks(text, [hunk], "t")
    assert "line 2\nnew\nline 3\n" in patched
    assert patches.apply_hunks(patched, [hunk.reversed()], "t") == text
    with pytest.raises(patches.PatchError, match="does not match"):
        patches.apply_hunks(text, [hunk.reversed()], "t")
    assert name.endswith(".patch") and all(fp.hunks for fp in file_patches)
