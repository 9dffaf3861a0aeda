"""The server helper survives its HTTP port being taken during start-up (real CPU server)."""

from __future__ import annotations

import socket

import pytest
import requests

from tangram_sglang.serving import SGLangServer

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_server_starts_on_a_new_port_when_its_port_was_taken(smollm2_path, tmp_path):
    """Another process binds the chosen port before uvicorn does (seen on an H200, where
    SGLang's own dist-init port landed on it): the helper starts the server again on another
    port instead of failing the benchmark."""
    server = SGLangServer(smollm2_path, [], "cpu", tmp_path / "server.log", 300)
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        server._set_port(taken)
        with server:
            assert server.port != taken
            assert requests.get(f"{server.base_url}/health", timeout=10).status_code == 200
            assert f"--port {server.port}" in " ".join(server.command)
