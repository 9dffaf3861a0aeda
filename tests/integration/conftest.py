"""Fixtures for tests against the installed, patched sglang 0.5.17 (CPU, no server).

Importing SGLang's scheduler takes ~30 s on 2 cores; the fixtures are session-scoped so one
pytest process pays it once.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from factories import random_profile

from tangram_sglang.profile import ModelIdentity

REPO = Path(__file__).resolve().parents[2]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@pytest.fixture(autouse=True)
def cpu_engine_environ(monkeypatch):
    """These tests build a CPU server's ServerArgs in this process, where SGLang's CPU engine
    is off (turning it on here would need the sgl_kernel stand-in imported into pytest): the
    check that ``--device cpu`` comes with ``SGLANG_USE_CPU_ENGINE=1`` sees the environment a
    CPU server is launched with. ``test_server_args`` tests that check on the real one."""
    from tangram_sglang.integration import server_args

    monkeypatch.setattr(server_args, "ENVIRON", {**os.environ, "SGLANG_USE_CPU_ENGINE": "1"})


@pytest.fixture(scope="session")
def make_profile():
    """Factory: ``make_profile(model_identity, target=0.25, seed=0) -> BudgetProfile``.

    ``factories.random_profile``: ratios uniform in [0.1, 0.6], global groups of H_kv.
    """
    return random_profile


@pytest.fixture(scope="session")
def patched_sglang():
    """The venv's sglang must be patched (`make apply`); fail with the fix otherwise."""
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "patches.py"), "check"],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        pytest.fail(f"sglang is not patched ({result.stdout.strip()}): run `make apply`")
    from sglang.srt.server_args import ServerArgs

    return ServerArgs


@pytest.fixture(scope="session")
def smollm2_identity(smollm2_path):
    return ModelIdentity.from_hf_config(json.loads((smollm2_path / "config.json").read_text()))


@pytest.fixture(scope="session")
def smollm2_profile(tmp_path_factory, smollm2_identity):
    """Path of a valid synthetic profile for SmolLM2 (30 layers x 3 KV heads)."""
    path = tmp_path_factory.mktemp("profiles") / "smollm2-r0.25.json"
    random_profile(smollm2_identity).save(path)
    return str(path)


@pytest.fixture(scope="session")
def fake_model(tmp_path_factory, smollm2_path):
    """Factory: a config-only model folder (SmolLM2's config with overrides + its tokenizer)."""
    root = tmp_path_factory.mktemp("models")
    base = json.loads((smollm2_path / "config.json").read_text())

    def make(name: str, **overrides) -> str:
        folder = root / name
        folder.mkdir(exist_ok=True)
        (folder / "config.json").write_text(json.dumps({**base, **overrides}))
        for file in TOKENIZER_FILES:
            if (smollm2_path / file).exists():
                shutil.copy(smollm2_path / file, folder / file)
        return str(folder)

    return make
