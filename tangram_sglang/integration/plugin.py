"""The ``sglang.srt.plugins`` entry point: register every Tangram hook, then verify each one.

SGLang calls :func:`register` from ``sglang.srt.plugins.load_plugins()`` in every process it
starts (HTTP server / Engine, scheduler, detokenizer). SGLang's loader and
``HookRegistry.apply_hooks`` only LOG failures, so this plugin applies the hooks itself and then
checks every row of ``hook_targets.HOOKS`` (the attribute really is a wrapper chain holding our
body) and ``hook_targets.REGISTRATIONS`` (our key really is in the registry dict). A failure
raises ``SystemExit`` with the list of broken targets: ``load_plugins`` catches ``Exception``
only, so the process stops instead of serving without compression.

With the patch, :func:`register` also installs :func:`install_excepthook`, so a start-up
refusal (``ConfigError``, ``ProfileError``) prints its one-line message without a traceback.

Without the ServerArgs patch (``make apply``) the plugin is inert: there is no ``--tangram`` flag
to turn it on, so it registers nothing and stock SGLang runs unchanged.

``--tangram`` start-up (``server_args.check_model``) calls :func:`ensure_active`, which fails
with a ConfigError when the plugin did not run in that process (entry point missing, excluded by
``SGLANG_PLUGINS``, import error).

Entry point (pyproject.toml)::

    [project.entry-points."sglang.srt.plugins"]
    tangram = "tangram_sglang.integration.plugin:register"
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import pkgutil
import sys
from dataclasses import dataclass, field
from typing import Any

from tangram_sglang.errors import ConfigError, TangramError
from tangram_sglang.integration.hook_targets import HOOKS, REGISTRATIONS, HookTarget, Registration

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class PluginState:
    """What :func:`register` did in this process."""

    active: bool = False  # hooks registered, applied and verified
    inert_reason: str = ""  # why register() did nothing (empty when it ran)
    verified: list[str] = field(default_factory=list)  # targets checked OK


_STATE = PluginState()  # per process: SGLang calls register() once per process


def state() -> PluginState:
    """This process's plugin state (read-only use)."""
    return _STATE


def register() -> None:
    """Entry point: register Tangram's hooks and registry entries, apply, verify.

    Raises:
        SystemExit: a hook or registration did not take effect (message lists each target).
    """
    if _STATE.active:
        return
    if not _patch_applied():
        _STATE.inert_reason = "sglang ServerArgs has no `tangram` field (patches not applied)"
        logger.info(
            "Tangram plugin inert: %s; run `make apply` to enable --tangram", _STATE.inert_reason
        )
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    install_excepthook()
    for row in HOOKS:
        HookRegistry.register(row.target, load_body(row.body), HookType(row.hook_type))
    for reg in REGISTRATIONS:
        importlib.import_module(reg.module)
    HookRegistry.apply_hooks()  # idempotent; load_plugins() calls it again after all plugins
    failures = verify()
    if failures:
        raise SystemExit(
            "Tangram plugin: these SGLang hooks/registrations did not take effect, so the "
            "server would run without compression:\n  " + "\n  ".join(failures) + "\nCheck "
            "that sglang==0.5.17 is installed and patched (`make apply`), or uninstall "
            "tangram-sglang / leave `tangram` out of SGLANG_PLUGINS to run stock SGLang."
        )
    _STATE.active = True
    _STATE.inert_reason = ""
    logger.info(
        "Tangram plugin active: %d hooks, %d registrations verified", len(HOOKS), len(REGISTRATIONS)
    )


def install_excepthook() -> None:
    """An uncaught :class:`TangramError` prints one line, ``Name: message``; exit status 1.

    Start-up refusals (``ConfigError`` / ``ProfileError`` raised from the patched
    ``ServerArgs.__post_init__`` under ``python -m sglang.launch_server`` or ``sglang serve``)
    already name the flag and the fix; the traceback through SGLang's argument handling above
    them says nothing more. Other exceptions go to the previous hook unchanged. Idempotent.
    """
    previous = sys.excepthook
    if getattr(previous, "tangram_one_line", False):
        return

    def one_line(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        if isinstance(exc, TangramError):
            print(f"{exc_type.__name__}: {exc}", file=sys.stderr, flush=True)
            return
        previous(exc_type, exc, tb)

    one_line.tangram_one_line = True
    sys.excepthook = one_line


def ensure_active() -> None:
    """Load SGLang's plugins (idempotent) and check that Tangram's ran and verified.

    Raises:
        ConfigError: the plugin is not active in this process, with the reason and the fix.
    """
    from sglang.srt.plugins import load_plugins

    load_plugins()
    if not _STATE.active:
        reason = _STATE.inert_reason or (
            "it was not loaded (entry point `tangram` in group sglang.srt.plugins missing, "
            "excluded by SGLANG_PLUGINS, or failed to import: see the log above)"
        )
        raise ConfigError(
            f"--tangram needs the Tangram SGLang plugin, but {reason}. Run `make apply` (it "
            "patches sglang and installs the entry point) and, if SGLANG_PLUGINS is set, add "
            "`tangram` to it."
        )


def verify() -> list[str]:
    """Check every hook and registration; returns one line per failure (empty = all good)."""
    failures = []
    _STATE.verified.clear()
    for row in HOOKS:
        problem = _check_hook(row)
        (
            failures.append(f"{row.target}: {problem}")
            if problem
            else _STATE.verified.append(row.target)
        )
    for reg in REGISTRATIONS:
        problem = _check_registration(reg)
        (
            failures.append(f"{reg.registry}[{reg.key!r}]: {problem}")
            if problem
            else _STATE.verified.append(f"{reg.registry}[{reg.key!r}]")
        )
    return failures


def load_body(spec: str) -> Any:
    """The object named by ``"package.module:attribute"``."""
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)


def resolve_raw(target: str) -> Any:
    """The attribute at ``target`` as stored (classmethod/staticmethod unwrapped).

    Raises:
        ImportError, AttributeError, ValueError: the path does not resolve.
    """
    owner_path, attr = target.rsplit(".", 1)
    owner = pkgutil.resolve_name(owner_path)
    raw = (
        owner.__dict__[attr]
        if isinstance(owner, type) and attr in owner.__dict__
        else getattr(owner, attr)
    )
    return raw.__func__ if isinstance(raw, classmethod | staticmethod) else raw


def _check_hook(row: HookTarget) -> str:
    try:
        current, body = resolve_raw(row.target), load_body(row.body)
    except (ImportError, AttributeError, ValueError) as exc:
        return f"does not resolve ({type(exc).__name__}: {exc})"
    if row.hook_type == "replace" and isinstance(body, type):
        return "" if current is body else "class not replaced"
    return "" if _chain_holds(current, body) else f"{row.hook_type} hook {row.body} not applied"


def _chain_holds(obj: Any, body: Any) -> bool:
    """True if ``body`` is ``obj`` or in the closure of a wrapper on its ``__wrapped__`` chain."""
    seen: set[int] = set()
    while obj is not None and id(obj) not in seen:
        seen.add(id(obj))
        if obj is body:
            return True
        for cell in getattr(obj, "__closure__", None) or ():
            try:
                if cell.cell_contents is body:
                    return True
            except ValueError:  # empty cell
                continue
        obj = getattr(obj, "__wrapped__", None)
    return False


def _check_registration(reg: Registration) -> str:
    try:
        registry = pkgutil.resolve_name(reg.registry)
    except (ImportError, AttributeError, ValueError) as exc:
        return f"registry does not resolve ({type(exc).__name__}: {exc})"
    return "" if reg.key in registry else f"not registered by {reg.module}"


def _patch_applied() -> bool:
    from sglang.srt.server_args import ServerArgs

    return "tangram" in {f.name for f in dataclasses.fields(ServerArgs)}
