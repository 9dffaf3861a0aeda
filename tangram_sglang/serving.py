"""Start and stop a real ``python -m sglang.launch_server`` process (demo, tests, benchmarks).

This is tooling around SGLang, not part of the serving path. On ``device="cpu"`` it sets what the
CPU engine needs (``SGLANG_USE_CPU_ENGINE=1``, the ``sgl_kernel`` stand-in first on
``PYTHONPATH``, ``--attention-backend torch_native`` unless another is given, ``--dtype
float32``, a bounded ``--max-total-tokens``, and with ``--tp-size N`` the gloo settings of
:func:`cpu_tp_env`); on a GPU it adds nothing. The server runs in its
own process session so that stopping it never leaves children behind: SIGTERM to the launcher
(it drains and kills its tree), then SIGKILL to the whole process group if it lingers.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import requests

from tangram_sglang.errors import ConfigError, TangramError

STANDIN_DIR = Path(__file__).resolve().parent / "cpu_standin"
CPU_DEFAULTS = {
    "--attention-backend": "torch_native",
    "--dtype": "float32",
    "--max-total-tokens": "16384",
}
# Stock (non --tangram) servers on CUDA: SGLang's Hopper default attention backend is FA3, which
# sgl_kernel wheels built without it (the wheelhouse's 0.4.5 one) cannot import.
CUDA_STOCK_FLAGS = {"--attention-backend": "triton"}


_BIND_RETRIES = 2  # new ports tried when the HTTP port was taken during start-up
_LIVE: set[int] = set()  # id() of servers that turned SIGTERM into KeyboardInterrupt
_SAVED_SIGTERM: list = []  # the caller's SIGTERM action while _LIVE is not empty


def _sigterm_as_interrupt(server: object, on: bool) -> None:
    """While any server runs, SIGTERM raises ``KeyboardInterrupt`` (main thread, default action).

    The server lives in its own session, so a SIGTERM to the caller (``timeout``, CI) would
    otherwise kill the caller and leave the server running; the caller's action comes back when
    the last server stops.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    if on and not _LIVE and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        _SAVED_SIGTERM.append(signal.signal(signal.SIGTERM, signal.default_int_handler))
    if on and _SAVED_SIGTERM:
        _LIVE.add(id(server))
    elif not on and id(server) in _LIVE:
        _LIVE.discard(id(server))
        if not _LIVE:
            signal.signal(signal.SIGTERM, _SAVED_SIGTERM.pop())


# Where free_port looks: below the kernel's ephemeral range (Linux default 32768-60999), from
# which SGLang draws its own internal ports (``get_open_port`` binds port 0). A port taken from
# that range can be handed out again to the server's own dist-init or NCCL port between our
# check and uvicorn's bind at the end of start-up ("address already in use"; seen on an H200).
_PORT_FLOOR = 20000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 when it cannot be read)."""
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, below the ephemeral range.

    Tries random ports in ``[20000, first ephemeral port)``; falls back to one the kernel picks
    (bind to port 0) when that range is empty or every try is taken.
    """
    low, high = _PORT_FLOOR, _ephemeral_low()
    rng = random.Random()
    for _ in range(64 if high - low > 64 else 0):
        port = rng.randrange(low, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for SGLang's CPU engine: the CPU flag and the stand-in first on PYTHONPATH.

    ``OMP_NUM_THREADS`` defaults to 1 (a caller's value is kept): on a loaded 2-core machine a
    server's scheduler was seen stalling inside OpenMP's thread pool until SGLang's 300 s
    watchdog killed it; one thread per server serves the embedded models faster there too.
    """
    env = dict(os.environ if base is None else base)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    env["HF_HUB_OFFLINE"] = "1"
    env.pop("TRITON_INTERPRET", None)  # a test-process setting; the server compiles nothing
    paths = [str(STANDIN_DIR)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def cpu_tp_env(tp_size: int, base: dict[str, str]) -> dict[str, str]:
    """What SGLang's CPU engine needs to run ``--tp-size N > 1`` (gloo all-reduce), on ``base``.

    * ``SGLANG_CPU_OMP_THREADS_BIND``: one core list per rank (``"0|1|0"`` for 3 ranks on 2
      cores, cycling). Without it SGLang wants one NUMA node per rank (``numa_utils``).
    * ``SGLANG_NCCL_SO_PATH`` pointing at no file: the venv's torch ships an NCCL library, which
      makes SGLang build a CUDA communicator for the TP group and fail on the CPU ("Expected a
      cuda device"); without NCCL it falls back to gloo, as on a CPU-only host.

    A caller's values are kept.
    """
    env = dict(base)
    cores = max(os.cpu_count() or 1, 1)
    env.setdefault(
        "SGLANG_CPU_OMP_THREADS_BIND", "|".join(str(r % cores) for r in range(int(tp_size)))
    )
    env.setdefault("SGLANG_NCCL_SO_PATH", "/nonexistent/no-nccl-on-cpu/libnccl.so")
    return env


def _flag_int(args: list[str], flag: str, default: int) -> int:
    """The integer value of ``flag`` in a launch_server argument list (``--flag V`` or
    ``--flag=V``; the last one given wins, as with argparse).

    Raises:
        ConfigError: the value is not an integer (names the flag).
    """
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1 :]
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{flag} {value!r}: expected an integer, e.g. {flag} 2") from None


class SGLangServer:
    """A running SGLang HTTP server; use as a context manager.

    Args:
        model_path: HF model folder.
        args: extra ``launch_server`` flags (``["--tangram", ...]``).
        device: ``"cpu"`` (adds the CPU engine settings) or ``"cuda"``.
        log_path: file that receives the server's stdout+stderr (default: a temp file).
        startup_timeout_s: seconds to wait for ``/health`` (imports alone take ~40 s on CPU).
        env: extra environment variables of the server process (e.g.
            ``{"TANGRAM_GRID_SEGMENTS": "1"}``), over this process's environment.

    Raises:
        TangramError: the server exits or is not healthy in time; the message holds the log tail.
    """

    def __init__(
        self,
        model_path: str | Path,
        args: list[str] | None = None,
        device: str = "cpu",
        log_path: str | Path | None = None,
        startup_timeout_s: float = 300.0,
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path or f"/tmp/sglang-server-{self.port}.log")
        args = list(args or [])
        env = {**os.environ, **(env or {})}
        if device == "cpu":
            env = cpu_env(env)
            tp_size = _flag_int(args, "--tp-size", 1)
            if tp_size > 1:
                env = cpu_tp_env(tp_size, env)
            for flag, value in CPU_DEFAULTS.items():
                # --tangram selects its own attention backend; an explicit one is rejected.
                skip = flag == "--attention-backend" and "--tangram" in args
                if flag not in args and not skip:
                    args += [flag, value]
        self.command = [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(model_path),
            "--device",
            device,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--enable-cache-report",
            *args,
        ]
        self._env = env
        self._timeout = startup_timeout_s
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> SGLangServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        """Launch and wait until ``/health`` answers 200 (the server's warm-up has run).

        The server runs in its own session, so signals to the caller never reach it: SIGTERM
        to the caller (``timeout``, CI) becomes ``KeyboardInterrupt`` like Ctrl-C (when the
        caller runs on the main thread and kept the default SIGTERM action), and an interrupt
        during start-up stops the server before it propagates; afterwards ``with`` blocks and
        pytest fixture teardowns stop it.
        """
        _sigterm_as_interrupt(self, True)
        for attempt in range(_BIND_RETRIES + 1):
            try:
                with self.log_path.open("w") as log:  # the server holds its own copy
                    self.process = subprocess.Popen(
                        self.command,
                        env=self._env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                    )
                self._wait_healthy()
                return
            except TangramError:
                self.stop()
                if attempt == _BIND_RETRIES or not self._lost_port():
                    raise
                self._set_port(free_port())  # another process took the port: start again
                _sigterm_as_interrupt(self, True)
            except BaseException:
                self.stop()
                raise

    def _lost_port(self) -> bool:
        """The server exited because its HTTP port was taken (uvicorn's bind error)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return False
        return f"address ('127.0.0.1', {self.port}): address already in use" in text

    def _set_port(self, port: int) -> None:
        """Use ``port`` for the next start (command line and base URL)."""
        i = self.command.index("--port")
        self.command[i + 1] = str(port)
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self._timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise TangramError(
                    f"SGLang server exited with code {self.process.returncode} during start-up; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                if requests.get(f"{self.base_url}/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if self._lost_port():  # uvicorn logs the bind error, but the server stays up
                raise TangramError(
                    f"SGLang server could not bind port {self.port}; log {self.log_path}:\n"
                    f"{self.log_tail()}"
                )
            time.sleep(1.0)
        raise TangramError(
            f"SGLang server not healthy after {self._timeout:.0f} s; log {self.log_path}:\n"
            f"{self.log_tail()}"
        )

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM the launcher, wait, then SIGKILL its whole process group. Idempotent."""
        proc = self.process
        if proc is None:  # never started, or its launch failed: only the SIGTERM action
            _sigterm_as_interrupt(self, False)
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=grace_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # children that outlived the launcher
        proc.wait()
        self.process = None
        _sigterm_as_interrupt(self, False)

    def log_tail(self, num_lines: int = 40) -> str:
        """The last lines of the server log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])
        except FileNotFoundError:
            return "(no log)"

    def flush_cache(self, wait_s: float = 30.0) -> requests.Response:
        """``POST /flush_cache?timeout=wait_s``: free the radix tree's cached prefixes.

        SGLang waits up to ``wait_s`` seconds for the scheduler to go idle (a request that just
        answered may not be released yet), then flushes.

        Returns:
            The response (status 200 when flushed).
        """
        return requests.post(
            f"{self.base_url}/flush_cache", params={"timeout": wait_s}, timeout=wait_s + 30
        )

    def server_info(self) -> dict:
        """``GET /server_info`` as a dict."""
        return requests.get(f"{self.base_url}/server_info", timeout=30).json()

    def kv_tail_tokens(self, completion_tokens: int) -> int:
        """Decoded tokens of a finished request that have K/V in the cache (its decode tail).

        ``T`` with SGLang's overlap scheduler (the default: it runs one more decode step for a
        request before it processes the step that finished it, so the last sampled token is fed
        back too), ``T - 1`` with ``--disable-overlap-schedule``.
        """
        overlap = not self.server_info()["disable_overlap_schedule"]
        return max(int(completion_tokens) - (0 if overlap else 1), 0)
