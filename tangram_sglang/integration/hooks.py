"""Thin hook bodies registered by the plugin (one per row of ``hook_targets.HOOKS``).

Each body does nothing unless the server runs with ``--tangram`` and delegates the work to the
module that owns it. Signatures follow SGLang's ``HookRegistry`` (``hook_registry._wrap_fn``):
BEFORE ``fn(*args, **kwargs) -> (args, kwargs) | None``, AFTER ``fn(result, *args, **kwargs) ->
new_result | None``, AROUND ``fn(original_fn, *args, **kwargs)``.
"""

from __future__ import annotations

from typing import Any

from tangram_sglang.integration.server_args import (
    require_compressing_backend,
    summary_from_server_args,
)


def add_tangram_init_info(result: dict[str, Any], scheduler: Any) -> dict[str, Any] | None:
    """AFTER ``Scheduler.get_init_info``: add key ``tangram`` (the start-up summary).

    Runs once per scheduler process at start-up. The scheduler sends this dict to the HTTP
    server, which merges it into ``/server_info`` (``http_server.server_info``). Later pieces
    (mem/) add their pool numbers to the same key.

    Returns:
        The dict with ``tangram`` added, or None (unchanged) without ``--tangram``.

    Raises:
        ConfigError: no ``tangram`` attention backend in this build (the scheduler, and with it
            the server, stops instead of serving uncompressed KV under ``--tangram``).
    """
    if not getattr(scheduler.server_args, "tangram", False):
        return None
    require_compressing_backend()
    result["tangram"] = summary_from_server_args(scheduler.server_args)
    return result
