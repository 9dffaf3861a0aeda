"""The README's flag table and the version stay true to the code (patched sglang 0.5.17, no server).

- every ``--tangram*`` option of SGLang's real ``ServerArgs`` parser is a row of the README's
  ``--tangram-*`` table with argparse's default (and its choices), and the table lists no other;
- ``tangram_sglang.__version__`` is the installed distribution's version and the newest release
  of ``CHANGELOG.md``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
from pathlib import Path

import tangram_sglang

REPO = Path(__file__).resolve().parents[2]
ROW = re.compile(r"^\| `(--tangram[a-z-]*)` \| `([^`]*)` \| ([^|]*) \|", re.MULTILINE)


def readme_flag_rows() -> dict[str, tuple[str, str]]:
    """``{flag: (default cell, values cell)}`` from the README's flag table."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## `--tangram-*` flags") :]
    section = section[: section.index("\n## ", 1)]
    rows = {flag: (default, values) for flag, default, values in ROW.findall(section)}
    assert len(rows) == len(ROW.findall(section)), "a flag is listed twice"
    return rows


def tangram_actions(server_args_cls) -> dict[str, argparse.Action]:
    parser = argparse.ArgumentParser()
    server_args_cls.add_cli_args(parser)
    return {
        option: action
        for action in parser._actions
        for option in action.option_strings
        if option.startswith("--tangram")
    }


def test_readme_table_lists_every_tangram_flag_with_its_default(patched_sglang):
    actions = tangram_actions(patched_sglang)
    rows = readme_flag_rows()
    assert set(rows) == set(actions), "README flag table differs from ServerArgs' parser"
    for flag, action in actions.items():
        default, values = rows[flag]
        assert default == repr(action.default), (
            f"{flag}: README {default}, argparse {action.default!r}"
        )
        for choice in action.choices or ():
            assert f"`{choice}`" in values, f"{flag}: choice {choice} missing in README"


def test_version_matches_installed_metadata_and_changelog():
    version = tangram_sglang.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", version)
    assert importlib.metadata.version("tangram-sglang") == version
    releases = re.findall(r"^## \[(\d+\.\d+\.\d+)\]", (REPO / "CHANGELOG.md").read_text(), re.M)
    assert releases and releases[0] == version, f"CHANGELOG's newest release {releases[:1]}"
