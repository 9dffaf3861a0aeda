"""The demo's server flags and banner without a server (the real servers: tests/e2e)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tangram_sglang.demo import demo_server_args, server_banner

REPO = Path(__file__).resolve().parents[2]


def test_full_kv_on_cuda_picks_triton_and_never_tangram():
    assert demo_server_args(True, "cuda", "p.json") == ["--attention-backend", "triton"]
    assert demo_server_args(True, "cpu", "p.json") == []  # serving.py adds torch_native on CPU


def test_tangram_args_carry_the_profile_when_given():
    threshold = ["--tangram-min-compress-tokens", "128"]  # the demo's ~250-token turn compresses
    assert demo_server_args(False, "cuda", None) == ["--tangram", *threshold]
    assert demo_server_args(False, "cpu", "p.json") == [
        "--tangram",
        *threshold,
        "--tangram-profile",
        "p.json",
    ]


def test_banner_names_the_profile_only_for_a_tangram_server():
    base = {"version": "0.5.17", "attention_backend": "triton", "dtype": "auto"}
    stock = server_banner({**base, "tangram": False})  # a stock server reports the flag
    assert stock == ["server up: sglang 0.5.17, attention backend triton, KV dtype auto"]
    info = {
        **base,
        "tangram": {"profile_path": "p.json", "mean_kept_ratio": 0.31, "num_head_groups": 14},
    }
    assert server_banner(info)[1] == "Tangram profile p.json: mean kept ratio 0.310, 14 head groups"
    assert len(server_banner(info)) == 2  # no calibration target reported: no note
    info["tangram"]["profile_target_ratio"] = 0.25  # the kept mean above the target: explained
    assert server_banner(info)[2].startswith("  (calibrated at 0.25: each KV head keeps its mean")


def test_a_profile_with_full_kv_is_refused_before_any_server(capsys):
    from tangram_sglang.demo import main

    assert main(["--full-kv", "--profile", "/nonexistent/p.json"]) == 2
    err = capsys.readouterr().err
    assert "--profile /nonexistent/p.json" in err and "--full-kv" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_without_a_gpu_fails_before_a_server_starts(capsys):
    from tangram_sglang.demo import main

    assert main(["--device", "cuda", "--log", "/nonexistent/dir/log"]) == 2
    err = capsys.readouterr().err
    assert "--device cuda" in err and "--device cpu" in err and "server" not in err.lower()


def test_a_missing_profile_names_the_flag_and_the_fix_before_any_server(capsys):
    from tangram_sglang.demo import main

    assert main(["--profile", "/nonexistent/p.json"]) == 2
    err = capsys.readouterr().err
    assert "--profile: /nonexistent/p.json: profile file not found" in err
    assert err.count("/nonexistent/p.json") == 1  # the path once
    assert "python -m tangram_sglang.calibrate" in err


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"window_share": 2.0}, "window_share"),
        ({"window_shar": 0.25}, "did you mean 'window_share'"),
    ],
)
def test_a_profile_with_a_bad_scorer_option_is_refused_before_any_server(
    tmp_path, capsys, options, expected
):
    """A bad value or name under ``provenance.scorer_options`` stops the demo before the model
    is converted or the server starts (the server's start-up would refuse it a minute later)."""
    import json

    from tangram_sglang.demo import main

    data = json.loads((REPO / "calibration/smollm2/kvzip-lite-r0.25.json").read_text())
    data["provenance"]["scorer_options"].update(options)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    assert main(["--profile", str(path)]) == 2
    captured = capsys.readouterr()
    assert f"--profile {path}:" in captured.err and expected in captured.err
    assert "starting SGLang" not in captured.out


def test_a_misspelt_model_lists_the_embedded_models(capsys):
    from tangram_sglang.demo import main

    with pytest.raises(SystemExit):
        main(["--model", "smollm"])
    err = capsys.readouterr().err
    assert "invalid choice: 'smollm'" in err and "smollm2" in err and "qwen2.5-0.5b" in err


def test_a_model_without_a_shipped_profile_is_refused_before_conversion(capsys):
    from tangram_sglang.demo import main

    assert main(["--model", "qwen2.5-1.5b", "--log", "/nonexistent/dir/log"]) == 2
    err = capsys.readouterr().err
    assert "--model qwen2.5-1.5b: no Tangram profile ships for it" in err
    assert "--profile PATH" in err and "--full-kv" in err
    assert "python -m tangram_sglang.calibrate --model-path qwen2.5-1.5b" in err


def test_the_full_kv_hint_names_the_interpreter_that_runs_the_demo(tmp_path, monkeypatch):
    """The closing hint must work when pasted: the demo's own interpreter (the project's venv
    after ``make demo``), not a bare ``python`` that lacks the dependencies."""
    import os
    import shlex
    import sys

    from tangram_sglang.demo import this_python

    venv = tmp_path / ".venv" / "bin"
    venv.mkdir(parents=True)
    monkeypatch.setattr(sys, "executable", str(venv / "python"))
    monkeypatch.chdir(tmp_path)
    assert this_python() == os.path.join(".venv", "bin", "python")
    monkeypatch.chdir(venv)
    assert this_python() == os.path.join(".", "python")
    elsewhere = tmp_path / "other dir"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert this_python() == shlex.quote(str(venv / "python"))  # outside: the absolute path


def test_the_default_server_log_is_removed_after_a_clean_run_and_kept_after_a_failure(
    tmp_path, monkeypatch, capsys
):
    """``make demo`` leaves nothing in the temp folder when it succeeds; when it fails the log
    stays and its path is printed. A ``--log`` the user names is always kept. (The real run is
    tests/e2e/test_demo.py; here ``run_demo`` only writes the log, to test ``main``'s policy.)"""
    import tempfile

    from tangram_sglang import demo
    from tangram_sglang.errors import TangramError

    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    outcome = {"code": 0}

    def fake_run(args):
        with open(args.log, "w") as f:
            f.write("server output\n")
        if outcome["code"] == "fail":
            raise TangramError("the server exited during start-up")
        return outcome["code"]

    monkeypatch.setattr(demo, "run_demo", fake_run)
    assert demo.main([]) == 0
    assert list(tmp_path.iterdir()) == []
    outcome["code"] = "fail"
    assert demo.main([]) == 2
    kept = list(tmp_path.iterdir())
    assert len(kept) == 1 and f"the server's log: {kept[0]}" in capsys.readouterr().err
    named = tmp_path / "mine.log"
    outcome["code"] = 0
    assert demo.main(["--log", str(named)]) == 0
    assert named.read_text() == "server output\n"


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--log", ""], "--log is empty; give a path or leave --log out"),
        (["--full-kv", "--profile", " "], "--profile is empty"),
        (["--log", "{tmp}"], "is a folder; give a file path inside it"),
        (["--log", "{tmp}/no/such/x.log"], "/no/such does not exist; create it"),
    ],
)
def test_a_bad_log_or_empty_profile_is_refused_before_any_server(tmp_path, capsys, argv, match):
    from tangram_sglang.demo import main

    assert main([a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err


def test_a_failure_that_is_not_tangrams_names_the_kept_server_log(tmp_path, monkeypatch, capsys):
    """The server lost mid-chat (an HTTP error, not a TangramError) or Ctrl-C: the error goes up
    as it is, and the temp-folder log it leaves is named."""
    import tempfile

    from tangram_sglang import demo

    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))

    def lost(args):
        with open(args.log, "w") as f:
            f.write("server output\n")
        raise ConnectionError("the server went away")

    monkeypatch.setattr(demo, "run_demo", lost)
    with pytest.raises(ConnectionError):
        demo.main([])
    (kept,) = tmp_path.iterdir()
    assert f"the server's log: {kept}" in capsys.readouterr().err
