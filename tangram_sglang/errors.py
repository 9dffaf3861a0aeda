"""Error classes of Tangram for SGLang.

Every error raised on purpose by this package derives from :class:`TangramError`. Messages name
the offending field (or file, flag, request) and say how to fix it, so that a user reading a
server's start-up failure knows what to change without reading a traceback.
"""

from __future__ import annotations


class TangramError(Exception):
    """Base class of every error this package raises on purpose."""


class ProfileError(TangramError):
    """A budget profile is malformed or does not match the model it is used with."""


class ConfigError(TangramError):
    """A Tangram option or an SGLang flag combined with ``--tangram`` is invalid."""


class ModelError(TangramError):
    """An embedded model cannot be found, installed or converted."""


class PoolError(TangramError):
    """A page-pool contract was broken (double free, page not owned, out-of-range group)."""


class KernelError(TangramError):
    """A kernel launcher got tensors of the wrong shape, dtype, device or layout."""
