"""``serving._flag_int``: how the CPU server helper reads an integer launch flag."""

from __future__ import annotations

import pytest

from tangram_sglang import serving
from tangram_sglang.errors import ConfigError


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--tp-size", "3"], 3),
        (["--tp-size=3"], 3),
        (["--tp-size", "2", "--tp-size=3"], 3),
        (["--port", "30000"], 1),
        (["--tp-size"], 1),
    ],
)
def test_flag_int_reads_both_flag_forms(args, expected):
    assert serving._flag_int(args, "--tp-size", 1) == expected


def test_flag_int_names_the_flag_on_a_non_integer():
    with pytest.raises(ConfigError, match=r"--tp-size 'two': expected an integer"):
        serving._flag_int(["--tp-size", "two"], "--tp-size", 1)


def test_free_port_stays_below_the_ephemeral_range():
    """SGLang's own ports come from the ephemeral range (bind to 0): ours never collide."""
    low = serving._ephemeral_low()
    ports = {serving.free_port() for _ in range(20)}
    assert all(serving._PORT_FLOOR <= p < low for p in ports), (sorted(ports), low)
    assert len(ports) > 1  # random, not one fixed port


def test_free_port_skips_a_taken_port(monkeypatch):
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        monkeypatch.setattr(serving, "_PORT_FLOOR", taken)
        monkeypatch.setattr(serving, "_ephemeral_low", lambda: taken + 1)
        # the range holds only the taken port: the kernel's pick, never the taken one
        assert serving.free_port() != taken


@pytest.mark.parametrize("failure", ["log path is a folder", "environment has a NUL byte"])
def test_a_launch_that_fails_before_the_process_gives_sigterm_back(tmp_path, failure):
    """The log cannot be opened, or the process cannot be spawned: the caller's SIGTERM action
    comes back (it would stay KeyboardInterrupt for the rest of the caller's life otherwise)."""
    import signal

    saved = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        env = {"TANGRAM_X": "a\0b"} if failure.startswith("environment") else None
        log = tmp_path if failure.startswith("log") else tmp_path / "server.log"
        server = serving.SGLangServer(tmp_path, [], "cpu", log, 5, env=env)
        with pytest.raises((OSError, ValueError)):
            server.start()
        assert server.process is None and not serving._LIVE
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, saved)
