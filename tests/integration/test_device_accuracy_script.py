"""``scripts/device_pieces.sh`` through ``device_accuracy.sh stash`` / ``restore``: model pieces
kept between device calls.

On the GPU machine a carried path lasts for its own call only, so each call that carries one
``.carry/qwen05/pNN`` stashes it, and ``restore`` (run by ``setup``) copies the stash back and
lists the pieces in join order. These tests run the real script with bash on fake pieces.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "device_accuracy.sh"


def run(cwd: Path, stash: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "STASH": str(stash), "R": str(cwd / "r"), "OUT": str(cwd / "out")}
    return subprocess.run(
        ["bash", str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60
    )


def carry(cwd: Path, piece: int, data: str, sha: str | None = None) -> None:
    """What one device call carries: .carry/qwen05/pNN/chunkNN (and SHA256), nothing else."""
    root = cwd / ".carry" / "qwen05"
    if root.exists():
        subprocess.run(["rm", "-rf", str(root)], check=True)
    folder = root / f"p{piece:02d}"
    folder.mkdir(parents=True)
    (folder / f"chunk{piece:02d}").write_text(data)
    if sha is not None:
        (root / "SHA256").write_text(sha + "\n")


def test_pieces_carried_one_per_call_are_restored_in_join_order(tmp_path):
    stash = tmp_path / "stash"
    for i, data in enumerate(["a", "b", "c"]):
        carry(tmp_path, i, data, sha="s1" if i == 0 else None)
        assert run(tmp_path, stash, "stash").returncode == 0
    carry(tmp_path, 2, "c")  # the last call carries its piece and restores the rest
    out = run(tmp_path, stash, "restore")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [f".carry/qwen05/p{i:02d}/chunk{i:02d}" for i in range(3)]
    assert (tmp_path / ".carry/qwen05/SHA256").read_text().strip() == "s1"
    assert (tmp_path / ".carry/qwen05/p01/chunk01").read_text() == "b"


def test_a_carried_piece_wins_over_the_stashed_one(tmp_path):
    stash = tmp_path / "stash"
    carry(tmp_path, 0, "old", sha="s1")
    run(tmp_path, stash, "stash")
    carry(tmp_path, 0, "new")
    assert run(tmp_path, stash, "restore").returncode == 0
    assert (tmp_path / ".carry/qwen05/p00/chunk00").read_text() == "new"


def test_a_gap_in_the_pieces_is_refused_naming_the_stash(tmp_path):
    stash = tmp_path / "stash"
    for i in (0, 2):
        carry(tmp_path, i, "x", sha="s1" if i == 0 else None)
        run(tmp_path, stash, "stash")
    out = run(tmp_path, stash, "restore")
    assert out.returncode != 0
    assert "p00 p02 are not p00..pNN" in out.stderr and str(stash) in out.stderr


def test_another_ggufs_sha256_starts_the_stash_afresh(tmp_path):
    stash = tmp_path / "stash"
    carry(tmp_path, 0, "a", sha="s1")
    run(tmp_path, stash, "stash")
    carry(tmp_path, 1, "b")
    run(tmp_path, stash, "stash")
    carry(tmp_path, 0, "z", sha="s2")  # a new cut: its p01 must not mix with the old one
    out = run(tmp_path, stash, "stash")
    assert out.returncode == 0 and "afresh" in out.stdout
    assert sorted(p.name for p in stash.iterdir()) == ["SHA256", "p00"]


def test_bad_stash_input_gets_one_clear_error(tmp_path):
    stash = tmp_path / "stash"
    nothing = run(tmp_path, stash, "stash")
    assert nothing.returncode != 0 and "nothing under .carry/qwen05" in nothing.stderr
    stash.write_text("not a folder")
    carry(tmp_path, 0, "a", sha="s1")
    for mode in ("restore", "stash"):
        as_file = run(tmp_path, stash, mode)
        assert as_file.returncode != 0 and f"STASH={stash} is not a folder" in as_file.stderr
    bogus = run(tmp_path, stash, "bogus")
    assert bogus.returncode == 2 and "usage: device_accuracy.sh" in bogus.stderr


def test_device_pieces_serves_any_carry_folder_with_its_own_default_stash(tmp_path):
    """device_sanity.sh's folder (.carry/qwen15): the stash defaults to /tmp/<name>-pieces."""
    pieces = SCRIPT.parent / "device_pieces.sh"
    env = {k: v for k, v in os.environ.items() if k != "STASH"}
    folder = tmp_path / ".carry" / "qwen15-test-pieces-default"
    (folder / "p00").mkdir(parents=True)
    (folder / "p00" / "chunk00").write_text("a")
    default_stash = Path("/tmp") / f"{folder.name}-pieces"
    try:
        stashed = subprocess.run(
            ["bash", str(pieces), "stash", str(folder)], env=env, capture_output=True, text=True
        )
        assert stashed.returncode == 0 and str(default_stash) in stashed.stdout
        subprocess.run(["rm", "-rf", str(folder)], check=True)
        restored = subprocess.run(
            ["bash", str(pieces), "restore", str(folder)], env=env, capture_output=True, text=True
        )
        assert restored.stdout.split() == [f"{folder}/p00/chunk00"]
    finally:
        subprocess.run(["rm", "-rf", str(default_stash)], check=True)
    usage = subprocess.run(["bash", str(pieces), "stash"], capture_output=True, text=True)
    assert usage.returncode == 2 and "usage: device_pieces.sh" in usage.stderr


def test_a_bad_mode_gets_usage_and_makes_no_folder(tmp_path):
    result = run(tmp_path, tmp_path / "stash", "strat")
    assert result.returncode == 2
    assert "usage: device_accuracy.sh setup|start|poll|fg|stash|restore" in result.stderr
    assert not (tmp_path / "r").exists() and not (tmp_path / "out").exists()
