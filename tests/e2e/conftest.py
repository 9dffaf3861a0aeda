"""Real SGLang servers for the end-to-end tests, one per configuration for the whole session.

A server start costs 1-3 minutes on 2 CPU cores, so tests never start their own server for a
configuration another test already uses: they ask the session's :class:`ServerPool` for one by
its flags (``servers.get(args)``), and every test file with the same flags gets the same running
server. At most ``MAX_ALIVE`` servers run at once (each holds a model and a KV pool in RAM); the
least recently used one is stopped when another starts, and started again if a later test asks
for it. Server logs go to pytest's temporary folder (``servers/<name>.log``), never to fixed paths.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import pytest

from tangram_sglang.serving import SGLangServer

MAX_ALIVE = 2  # servers up at once (RAM on a 2-core, 24 GB CI machine shared with other jobs)


class ServerPool:
    """Running servers keyed by their flags; see the module docstring.

    Args:
        model_path: HF model folder every server serves (the embedded SmolLM2).
        log_dir: folder for the servers' logs.
    """

    def __init__(self, model_path: Path, log_dir: Path) -> None:
        self.model_path = model_path
        self.log_dir = log_dir
        self._alive: OrderedDict[tuple[str, ...], SGLangServer] = OrderedDict()
        self._starts: dict[str, int] = {}

    def get(
        self,
        args: list[str],
        name: str,
        startup_timeout_s: float = 900.0,
        env: dict[str, str] | None = None,
    ) -> SGLangServer:
        """The running server started with ``args`` and ``env`` (started now if none is).

        Args:
            args: ``launch_server`` flags (``[]`` = stock SGLang with the CPU defaults).
            name: a readable name for its log file (``<log_dir>/<name>.log``).
            startup_timeout_s: seconds to wait for ``/health``.
            env: extra environment variables of the server process (part of its key).
        """
        key = (*args, *sorted(f"{k}={v}" for k, v in (env or {}).items()))
        server = self._alive.get(key)
        if server is not None:
            self._alive.move_to_end(key)
            return server
        while len(self._alive) >= MAX_ALIVE:
            _, oldest = self._alive.popitem(last=False)
            oldest.stop()
        count = self._starts.get(name, 0)
        self._starts[name] = count + 1
        log = self.log_dir / (f"{name}.log" if count == 0 else f"{name}-{count}.log")
        server = SGLangServer(
            self.model_path,
            args=list(args),
            log_path=log,
            startup_timeout_s=startup_timeout_s,
            env=env,
        )
        server.start()
        self._alive[key] = server
        return server

    def stop_all(self) -> None:
        while self._alive:
            _, server = self._alive.popitem(last=False)
            server.stop()


@pytest.fixture(scope="session")
def servers(smollm2_path, tmp_path_factory):
    """The session's :class:`ServerPool` on the embedded SmolLM2."""
    pool = ServerPool(smollm2_path, tmp_path_factory.mktemp("servers"))
    yield pool
    pool.stop_all()


@pytest.fixture
def stock_server(servers) -> SGLangServer:
    """Stock SGLang 0.5.17 (no ``--tangram``) with the CPU defaults of ``SGLangServer``."""
    return servers.get([], "stock")


@pytest.fixture
def server_log_dir(tmp_path_factory) -> Path:
    """A fresh folder under pytest's temporary root for logs of servers a test starts itself."""
    return tmp_path_factory.mktemp("server-logs")
