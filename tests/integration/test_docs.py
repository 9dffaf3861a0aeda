"""The docs' flag table and the version stay true to the code (patched sglang 0.5.17, no server).

- every ``--tangram*`` option of SGLang's real ``ServerArgs`` parser is a row of the
  ``--tangram-*`` table in ``docs/reference.md`` with argparse's default (and its choices), and
  the table lists no other;
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


def reference_flag_rows() -> dict[str, tuple[str, str]]:
    """``{flag: (default cell, values cell)}`` from docs/reference.md's flag table."""
    text = (REPO / "docs" / "reference.md").read_text()
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


def test_reference_table_lists_every_tangram_flag_with_its_default(patched_sglang):
    actions = tangram_actions(patched_sglang)
    rows = reference_flag_rows()
    assert set(rows) == set(actions), "docs/reference.md flag table differs from the parser"
    for flag, action in actions.items():
        default, values = rows[flag]
        assert default == repr(action.default), (
            f"{flag}: docs {default}, argparse {action.default!r}"
        )
        for choice in action.choices or ():
            assert f"`{choice}`" in values, f"{flag}: choice {choice} missing in docs/reference.md"


def test_version_matches_installed_metadata_and_changelog():
    version = tangram_sglang.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", version)
    assert importlib.metadata.version("tangram-sglang") == version
    releases = re.findall(r"^## \[(\d+\.\d+\.\d+)\]", (REPO / "CHANGELOG.md").read_text(), re.M)
    assert releases and releases[0] == version, f"CHANGELOG's newest release {releases[:1]}"
