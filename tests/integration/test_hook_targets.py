"""Every SGLang path in integration/hook_targets.py resolves on the installed sglang 0.5.17."""

from __future__ import annotations

import inspect
import pkgutil
from importlib.metadata import version

import pytest

from tangram_sglang.integration import plugin
from tangram_sglang.integration.hook_targets import (
    HOOK_TYPES,
    HOOKS,
    REGISTRATIONS,
    SEAMS,
    SGLANG_VERSION,
    HookTarget,
    all_targets,
)


def test_pinned_version_is_installed():
    assert version("sglang") == SGLANG_VERSION


def test_targets_are_unique():
    targets = [row.target for row in HOOKS]
    assert len(targets) == len(set(targets))


@pytest.mark.parametrize("path", all_targets(), ids=str)
def test_target_resolves(path):
    assert pkgutil.resolve_name(path) is not None


@pytest.mark.parametrize("path", list(SEAMS), ids=str)
def test_seam_signature(path):
    params = SEAMS[path]
    obj = pkgutil.resolve_name(path)
    if not callable(obj) or inspect.ismodule(obj):
        assert params == ()
        return
    if params:
        assert tuple(inspect.signature(obj).parameters) == params


@pytest.mark.parametrize("row", HOOKS, ids=lambda row: row.target)
def test_hook_row_is_well_formed(row):
    assert row.hook_type in HOOK_TYPES
    body = plugin.load_body(row.body)
    assert callable(body) and row.purpose
    owner_path, attr = row.target.rsplit(".", 1)
    assert hasattr(pkgutil.resolve_name(owner_path), attr)


@pytest.mark.parametrize("reg", REGISTRATIONS, ids=lambda reg: f"{reg.registry}[{reg.key}]")
def test_registration_row_is_well_formed(reg):
    assert isinstance(pkgutil.resolve_name(reg.registry), dict) and reg.key


def test_plugin_applies_and_verifies_every_hook(patched_sglang):
    from sglang.srt.plugins import load_plugins

    load_plugins()  # idempotent; runs plugin.register via the entry point
    assert plugin.state().active
    assert plugin.verify() == []
    for row in HOOKS:
        current = plugin.resolve_raw(row.target)
        assert current is not inspect.unwrap(current)  # really wrapped


def test_verify_reports_a_hook_that_is_not_applied(patched_sglang):
    row = HookTarget(
        target="sglang.srt.managers.schedule_batch.ScheduleBatch.check_decode_mem",
        hook_type="around",
        body="tangram_sglang.integration.hooks:add_tangram_init_info",
        purpose="never registered",
    )
    assert "around hook" in plugin._check_hook(row) and "not applied" in plugin._check_hook(row)
    missing = HookTarget(
        "sglang.srt.managers.scheduler.Scheduler.no_such_method", "after", row.body, "typo"
    )
    assert "does not resolve" in plugin._check_hook(missing)


def test_integration_readme_lists_every_hook():
    """integration/README.md's hook table names each HOOKS row's target, type and body."""
    from pathlib import Path

    readme = (Path(plugin.__file__).parent / "README.md").read_text()
    rows = [line for line in readme.splitlines() if line.startswith("| `")]
    for hook in HOOKS:
        target = hook.target.removeprefix("sglang.srt.")
        body = hook.body.removeprefix("tangram_sglang.integration.")
        cells = [f"| `{target}` |", f"| {hook.hook_type.upper()} |", f"| `{body}` |"]
        assert any(all(c in row for c in cells) for row in rows), f"README lacks {hook.target}"
    assert f"`hook_targets.HOOKS`, {len(HOOKS)} rows" in readme
