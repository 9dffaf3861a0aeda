"""SIGTERM to a process holding an ``SGLangServer`` stops the server (its own session).

The launched command is swapped for a small stand-in child (writes its pid, optionally answers
``/health``) so the test exercises the process lifecycle in seconds; the real server's start and
stop run in every e2e test.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

CHILD = """
import http.server, os, sys
open(sys.argv[1], "w").write(str(os.getpid()))
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if sys.argv[2] == "healthy" else 503)
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[3])), H).serve_forever()
"""

HOLDER = """
import sys, time
from tangram_sglang.serving import SGLangServer
srv = SGLangServer("unused", device="gpu-not-used", startup_timeout_s=120, log_path=sys.argv[4])
srv.command = [sys.executable, "-c", sys.argv[1], sys.argv[2], sys.argv[3], str(srv.port)]
with srv:
    print("healthy", flush=True)
    time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("phase", ["healthy", "starting"])
def test_sigterm_to_the_holder_stops_the_server(tmp_path: Path, phase: str):
    pid_file, log = tmp_path / "server.pid", tmp_path / "server.log"
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(HOLDER), CHILD, str(pid_file), phase, str(log)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        if phase == "healthy":
            assert holder.stdout.readline().strip() == "healthy"
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        server_pid = int(pid_file.read_text())
        assert _alive(server_pid)
        holder.send_signal(signal.SIGTERM)
        assert holder.wait(timeout=60) != 0
        assert not _alive(server_pid), "the server outlived the SIGTERM'd holder"
        assert log.is_file()  # the server log goes to tmp_path, not /tmp/sglang-server-PORT.log
    finally:
        if holder.poll() is None:
            holder.kill()
        if pid_file.exists() and pid_file.read_text() and _alive(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)  # only when the test failed


def test_the_callers_sigterm_action_returns_when_the_last_server_stops(tmp_path: Path):
    from tangram_sglang.serving import SGLangServer

    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a CLI test may have set its own
    servers = [
        SGLangServer("unused", device="gpu-not-used", log_path=tmp_path / f"{i}.log")
        for i in range(2)
    ]
    for i, srv in enumerate(servers):
        pid_file = str(tmp_path / f"{i}.pid")
        srv.command = [sys.executable, "-c", CHILD, pid_file, "healthy", str(srv.port)]
    try:
        for srv in servers:
            srv.start()
            assert signal.getsignal(signal.SIGTERM) is signal.default_int_handler
        servers[0].stop()
        assert signal.getsignal(signal.SIGTERM) is signal.default_int_handler  # one still runs
        servers[1].stop()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        assert sorted(p.name for p in tmp_path.glob("*.log")) == ["0.log", "1.log"]
    finally:
        for srv in servers:
            srv.stop()
        signal.signal(signal.SIGTERM, previous)
