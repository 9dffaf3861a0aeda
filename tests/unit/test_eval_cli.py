"""``python -m tangram_sglang.eval``: every bad flag exits 2 naming the flag, before any model."""

from __future__ import annotations

import pytest

from tangram_sglang.eval.cli import main


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--num-samples", "0"], "--num-samples"),
        (["--num-turns", "-1"], "--num-turns"),
        (["--lengths", "1024,0"], "--lengths"),
        (["--depths", "0.5,7"], "--depths"),
        (["--threads", "-1"], "--threads"),
        (["--skip", "4", "--num-samples", "4"], "--skip must lie in"),
        (["--server-args", '"x'], "--server-args '\"x': No closing quotation"),
        (["--ratios", "0"], "--ratios must lie in (0, 1]"),
        (["--task", "nope"], "--task 'nope' is unknown"),
        (["--systems", "nope"], "--systems 'nope'"),
        (["--server-args", "--chunked-prefill-size 64"], "--chunked-prefill-size is set by"),
        (["--lengths", "1024,16000"], "--lengths 16000: contexts must stay under"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(capsys, argv, match):
    assert main(["--model", "smollm2", *argv]) == 2
    assert match in capsys.readouterr().err


def test_unknown_model_is_named_as_such(capsys):
    assert main(["--model", "nosuch"]) == 2
    assert "--model 'nosuch': not an embedded model" in capsys.readouterr().err
