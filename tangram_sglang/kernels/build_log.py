"""One log line per Triton build of a Tangram kernel, with how long the build took.

Triton builds a kernel (compiles it, or loads it from its disk cache) the first time a process
launches it with a new specialisation: new constexprs, argument dtypes, or integer arguments
that change their ``== 1`` / ``% 16 == 0`` class (unless marked ``do_not_specialize``). A build
inside a serving step stalls that step for its duration (tens of milliseconds from the disk
cache, up to about a second for a compile). With the log on, a server log tells which kernel
built when: builds before "The server is fired up" are start-up, any after it are stalls a
warm-up or a ``do_not_specialize`` mark should move out of the serving path.

Triton's ``knobs.runtime.jit_cache_hook`` is called before each build and
``jit_post_compile_hook`` after it (Triton 3.6, ``runtime/jit.py``); hooks already installed
are kept and called first. Builds under ``TRITON_INTERPRET=1`` do not exist, so nothing is
logged there.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

from triton import knobs

logger = logging.getLogger(__name__)

PACKAGE = "tangram_sglang."


class BuildLog:
    """The hooks' state: when each pending build started and how many builds each kernel had.

    Attributes:
        builds: kernel name -> builds so far in this process.
        logged: ``(kernel name, milliseconds)`` of every build logged, in order.
    """

    def __init__(self, previous_start=None, previous_end=None) -> None:
        self.previous_start, self.previous_end = previous_start, previous_end
        self.started: dict[tuple[str, str], float] = {}
        self.builds: Counter[str] = Counter()
        self.logged: list[tuple[str, float]] = []

    def start(self, *, key, fn, **kwargs):
        """``jit_cache_hook``: note the build's start; returns the previous hook's answer (a
        true answer skips the build, Triton's contract)."""
        result = self.previous_start(key=key, fn=fn, **kwargs) if self.previous_start else None
        if not result and fn.module.startswith(PACKAGE):
            self.started[(fn.name, str(key))] = time.perf_counter()
        return result

    def end(self, *, key, fn, **kwargs) -> None:
        """``jit_post_compile_hook``: log the build with its duration."""
        if self.previous_end:
            self.previous_end(key=key, fn=fn, **kwargs)
        start = self.started.pop((fn.name, str(key)), None)
        if start is None:
            return
        ms = 1e3 * (time.perf_counter() - start)
        self.builds[fn.name] += 1
        self.logged.append((fn.name, ms))
        logger.info(
            "Tangram: Triton built %s in %.0f ms (build %d of it in this process)",
            fn.name,
            ms,
            self.builds[fn.name],
        )


_installed: BuildLog | None = None


def install() -> BuildLog:
    """Install the hooks once per process (later calls return the same :class:`BuildLog`).

    Returns:
        The installed log (its ``builds`` and ``logged`` are what the lines said).
    """
    global _installed
    if _installed is None:
        log = BuildLog(knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
        knobs.runtime.jit_cache_hook = log.start
        knobs.runtime.jit_post_compile_hook = log.end
        _installed = log
    return _installed


__all__ = ["BuildLog", "install"]
