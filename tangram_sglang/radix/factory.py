"""Registers :class:`TangramRadixCache` as SGLang's radix cache backend ``"tangram"`` (on import).

``integration.server_args.select_tangram_backends`` sets ``--radix-cache-backend tangram`` under
``--tangram`` unless ``--disable-radix-cache`` is given (then SGLang's ``ChunkCache`` runs and
every row's pages are freed when SGLang frees the row). The plugin's ``REGISTRATIONS`` row
imports this module and checks the key is in ``registry._RADIX_CACHE_REGISTRY``.

Source: SGLang 0.5.17 ``mem_cache/registry.py`` (``register_radix_cache_backend``,
``create_tree_cache`` calls the factory with a ``TreeCacheBuildContext``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sglang.srt.mem_cache.registry import (
    register_radix_cache_backend,
    registered_radix_cache_backends,
)

from tangram_sglang.radix.cache import TangramRadixCache

if TYPE_CHECKING:
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext

BACKEND_NAME = "tangram"


def create_tangram_radix_cache(ctx: TreeCacheBuildContext) -> TangramRadixCache:
    """SGLang radix-cache factory for ``--radix-cache-backend tangram`` (scheduler start-up)."""
    return TangramRadixCache(ctx.params)


if BACKEND_NAME not in registered_radix_cache_backends():  # the registry rejects duplicates
    register_radix_cache_backend(BACKEND_NAME, create_tangram_radix_cache)
