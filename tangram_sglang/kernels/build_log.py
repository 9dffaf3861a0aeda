"""One log line per Triton build of a Tangram kernel, with how long the build took.

Triton builds a kernel (compiles it, or loads it from its disk cache, then builds its launcher
and loads it on the device) the first time a process launches it with a new specialisation:
new constexprs, argument dtypes, integer arguments that change their ``== 1`` / ``% 16 == 0``
class (unless marked ``do_not_specialize``) or pointers that change their 16-byte alignment
(unless marked ``do_not_specialize_on_alignment``). The in-memory cache is per process, so
every server start builds again (from the disk cache after the machine's first). A build
inside a serving step stalls that step for its duration (tens of milliseconds from the disk
cache, up to about a second for a compile). A server log tells which kernel built when:
builds before "The server is fired up" are start-up, any after it are stalls that a start-up
run or a ``do_not_specialize`` mark should move out of the serving path.

Triton 3.6 (``runtime/jit.py``, ``compiler/compiler.py``) calls ``knobs.runtime.jit_cache_hook``
before each build, ``jit_post_compile_hook`` after its compile or cache load, and
``kernel_load_end_hook`` once the module is on the device; hooks already installed are kept
(the first two called before this log's, the third a chain). Builds under
``TRITON_INTERPRET=1`` do not exist, so nothing is logged there.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

from triton import knobs

logger = logging.getLogger(__name__)

PACKAGE = "tangram_sglang."


class BuildLog:
    """The hooks' state: the build under way, the builds waiting for their device load, and how
    many builds each kernel had.

    A build is timed from Triton's cache miss (``jit_cache_hook``) through its compile or disk
    cache load (``jit_post_compile_hook``) to the module's load on the device
    (``kernel_load_end_hook``, which follows the launcher's build: a C compile when the launcher
    is not cached either), the whole stall of the launch that met it. Builds run one at a time
    inside a launch, so the one under way is keyed by kernel name; the wait for the load is
    keyed by the compiled kernel's hash, which the load hook receives. A build Triton makes
    without launching (its ``warmup``) is logged at its compile, with no load part.

    Args:
        previous_start, previous_end: the ``jit_cache_hook`` and ``jit_post_compile_hook``
            installed before (called first; None: none).

    Attributes:
        builds: ``module.kernel`` -> builds so far in this process.
        logged: ``(module.kernel, total ms, compile ms)`` of every build logged, in order.
    """

    def __init__(self, previous_start=None, previous_end=None) -> None:
        self.previous_start, self.previous_end = previous_start, previous_end
        self.started: dict[str, tuple[str, float]] = {}  # kernel name -> (module.kernel, t0)
        self.loading: dict[str, tuple[str, float, float]] = {}  # hash -> (label, t0, compile ms)
        self.builds: Counter[str] = Counter()
        self.logged: list[tuple[str, float, float]] = []
        self.load_hook = True  # kernel_load_end_hook chained (install); False: log at compile
        self._failed = False

    @staticmethod
    def _label(fn) -> str | None:
        """``module.kernel`` of a Tangram kernel's ``JitFunctionInfo``; None for another's."""
        name, module = getattr(fn, "name", None), getattr(fn, "module", None)
        if not name or not isinstance(module, str) or not module.startswith(PACKAGE):
            return None
        return f"{module.rsplit('.', 1)[-1]}.{name}"

    def start(self, *, key, fn, **kwargs):
        """``jit_cache_hook(key=, fn=JitFunctionInfo, ...)``: note a Tangram kernel's build
        start. Returns the previous hook's answer (a true answer skips the build: Triton's
        contract), and then notes nothing."""
        result = self.previous_start(key=key, fn=fn, **kwargs) if self.previous_start else None
        label = self._label(fn)
        if not result and label:
            self.started[fn.name] = (label, time.perf_counter())
        return result

    def end(self, *, key, fn, **kwargs) -> None:
        """``jit_post_compile_hook(key=, fn=, compile={..., "device": d}, is_manual_warmup=)``:
        the compile (or disk cache load) is done; wait for the device load under the compiled
        kernel's hash, or log now when there is no launch to wait for."""
        if self.previous_end:
            self.previous_end(key=key, fn=fn, **kwargs)
        label = self._label(fn)
        pending = self.started.pop(fn.name, None) if label else None
        if pending is None or pending[0] != label:
            return
        t0 = pending[1]
        compile_ms = 1e3 * (time.perf_counter() - t0)
        kernel_hash = None
        try:  # Triton stores the kernel in the JIT function's cache just before this hook
            device = kwargs["compile"]["device"]
            kernel_hash = fn.jit_function.device_caches[device][0][key].hash
        except (AttributeError, KeyError, IndexError, TypeError):
            pass
        if kwargs.get("is_manual_warmup") or kernel_hash is None or not self.load_hook:
            self._log(label, compile_ms, compile_ms)
        else:
            self.loading[kernel_hash] = (label, t0, compile_ms)

    def loaded(self, module, function, name, metadata_group, hash) -> None:
        """``kernel_load_end_hook`` (Triton's positional arguments; ``hash``: the compiled
        kernel's): log the build waiting for this load, if any. Called for every kernel Triton
        loads in the process, so it never raises (a failure is logged once)."""
        try:
            pending = self.loading.pop(hash, None)
            if pending is not None:
                label, t0, compile_ms = pending
                self._log(label, 1e3 * (time.perf_counter() - t0), compile_ms)
        except Exception as exc:  # a log line must not break another package's kernel load
            if not self._failed:
                self._failed = True
                logger.warning("Tangram: the Triton build log failed (%r); builds go unlogged", exc)

    def _log(self, label: str, total: float, compile_ms: float) -> None:
        self.builds[label] += 1
        self.logged.append((label, total, compile_ms))
        logger.info(
            "Tangram: Triton built %s in %.0f ms (compile or cache load %.0f ms, then launcher "
            "and device load; build %d of it in this process)",
            label,
            total,
            compile_ms,
            self.builds[label],
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
        if isinstance(knobs.runtime.kernel_load_end_hook, knobs.HookChain):
            knobs.runtime.kernel_load_end_hook.add(log.loaded)
        else:  # replaced by another library: builds are logged at their compile
            logger.warning(
                "Tangram: Triton's kernel_load_end_hook is not a HookChain; build times leave "
                "out the device load"
            )
            log.load_hook = False
        _installed = log
    return _installed


__all__ = ["BuildLog", "install"]
