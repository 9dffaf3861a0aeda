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
