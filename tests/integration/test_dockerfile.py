"""The serving image: docker/Dockerfile, docker/entrypoint.sh, docker/compose.yaml (no Docker here).

Docker cannot run on the CPU machines, so these tests check what can be checked without it:
- one source of truth: the Dockerfile installs only through the ``make`` targets the docs
  (README.md, docs/reference.md) document, and they document every install command of those
  Makefile recipes;
- the base image is the official SGLang image of the pinned version;
- the entrypoint really builds ``python -m sglang.launch_server --tangram ...`` from its
  environment (its ``DRY_RUN=1`` mode prints the command it would exec) and refuses a missing
  model folder or profile;
- compose.yaml parses and mounts the model folder and the profile where the entrypoint reads them.
``make lint`` runs hadolint on the Dockerfile.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "docker" / "Dockerfile"
ENTRYPOINT = REPO / "docker" / "entrypoint.sh"
COMPOSE = REPO / "docker" / "compose.yaml"
PIP_INSTALL = re.compile(r"\b(pip3?|uv pip|-m pip) install\b")


def instructions(path: Path) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` of a Dockerfile, continuation lines joined, comments dropped."""
    result: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pending += line.removesuffix("\\").strip() + " "
        if not line.endswith("\\"):
            keyword, _, args = pending.strip().partition(" ")
            result.append((keyword.upper(), args.strip()))
            pending = ""
    return result


def make_recipe(target: str) -> list[str]:
    """The recipe lines of one Makefile rule (``target:`` up to the next blank line)."""
    lines = (REPO / "Makefile").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{target}:"))
    recipe = []
    for line in lines[start + 1 :]:
        if not line.startswith("\t"):
            break
        recipe.append(line.strip())
    return recipe


def readme() -> str:
    """README.md and docs/reference.md (the install details live there), joined."""
    return (REPO / "README.md").read_text() + (REPO / "docs" / "reference.md").read_text()


def pinned_sglang() -> str:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (pin,) = [d for d in deps if d.startswith("sglang==")]
    return pin.split("==")[1]


# ---- one source of truth -----------------------------------------------------------------------
def test_dockerfile_installs_only_through_documented_make_targets():
    runs = [args for keyword, args in instructions(DOCKERFILE) if keyword == "RUN"]
    targets = {t for run in runs for t in re.findall(r"\bmake (\w+)", run)}
    assert targets == {"apply"}, targets
    documented = set(re.findall(r"`make (\w+)", readme()))
    assert targets <= documented, f"README does not document make {targets - documented}"
    for run in runs:
        assert not PIP_INSTALL.search(run), f"install outside the Makefile: RUN {run}"


def test_readme_documents_every_install_command_of_the_make_recipes():
    commands = [line for line in make_recipe("$(STAMP)") if PIP_INSTALL.search(line)]
    assert commands, "the install recipe has no pip install line"
    text = readme()
    for line in commands:
        if "--upgrade pip" in line:
            continue
        args = line.split("pip install", 1)[1].replace("-q", "").split()
        assert f"pip install {' '.join(args)}" in text, f"README lacks: pip install {args}"
    assert any("scripts/install_calibrate_deps.sh" in line for line in make_recipe("$(STAMP)"))
    assert "scripts/install_calibrate_deps.sh" in text
    assert make_recipe("apply") == ["$(PY) scripts/patches.py apply"]


def test_base_image_is_the_official_sglang_image_of_the_pinned_version():
    args = dict(a.split("=", 1) for k, a in instructions(DOCKERFILE) if k == "ARG" and "=" in a)
    froms = [a for k, a in instructions(DOCKERFILE) if k == "FROM"]
    assert froms == ["${SGLANG_IMAGE}"]
    assert args["SGLANG_IMAGE"] == f"lmsysorg/sglang:v{pinned_sglang()}-cu130"
    assert 'PINNED_VERSION = "' + pinned_sglang() + '"' in (REPO / "scripts/patches.py").read_text()


def test_image_runs_the_entrypoint_as_non_root_with_a_health_check():
    found = dict(instructions(DOCKERFILE))
    assert found["USER"] not in ("root", "0")
    assert f"--uid {found['USER']} " in found["RUN"]
    entry = "/opt/tangram-sglang/docker/entrypoint.sh"
    assert found["ENTRYPOINT"] == f'["{entry}"]'
    assert found["HEALTHCHECK"].endswith(f'CMD ["{entry}", "--healthcheck"]')
    assert found["COPY"] == ". ."  # the sources only; .dockerignore keeps the venv out
    assert ".venv" in (REPO / ".dockerignore").read_text().split()
    assert "TANGRAM_MODEL_PATH=/models/model" in found["ENV"].split()


def test_make_targets_build_and_lint_the_dockerfile():
    assert make_recipe("docker") == ["docker build -f docker/Dockerfile -t tangram-sglang:latest ."]
    assert "$(VENV)/bin/hadolint docker/Dockerfile" in make_recipe("lint")


# ---- entrypoint --------------------------------------------------------------------------------
def run_entrypoint(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    keep = {k: v for k, v in os.environ.items() if not k.startswith("TANGRAM_")}
    return subprocess.run(
        ["bash", str(ENTRYPOINT), *args],
        env={**keep, **env},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


@pytest.fixture
def model_dir(tmp_path):
    """A folder the entrypoint accepts as an HF model folder (it holds config.json)."""
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


def test_entrypoint_is_valid_bash():
    subprocess.run(["bash", "-n", str(ENTRYPOINT)], check=True, timeout=30)
    assert os.access(ENTRYPOINT, os.X_OK)


def test_entrypoint_passes_tangram_and_the_environment_through(model_dir):
    tmp_path = model_dir
    profile = tmp_path / "profile.json"
    profile.write_text("{}")
    env = {
        "DRY_RUN": "1",
        "TANGRAM_MODEL_PATH": str(tmp_path),
        "TANGRAM_PROFILE": str(profile),
        "TANGRAM_PORT": "31000",
        "TANGRAM_HOST": "127.0.0.1",
        "TANGRAM_PYTHON": "python3",
    }
    result = run_entrypoint(env, "--tangram-target-ratio", "0.3", "--mem-fraction-static", "0.8")
    assert result.returncode == 0, result.stderr
    assert shlex.split(result.stdout) == [
        "python3",
        "-m",
        "sglang.launch_server",
        "--tangram",
        "--model-path",
        str(tmp_path),
        "--tangram-profile",
        str(profile),
        "--host",
        "127.0.0.1",
        "--port",
        "31000",
        "--tangram-target-ratio",
        "0.3",
        "--mem-fraction-static",
        "0.8",
    ]


def test_entrypoint_without_profile_uses_the_shipped_default(model_dir):
    result = run_entrypoint({"DRY_RUN": "1", "TANGRAM_MODEL_PATH": str(model_dir)})
    assert result.returncode == 0, result.stderr
    command = shlex.split(result.stdout)
    assert "--tangram" in command and "--tangram-profile" not in command
    assert command[-4:] == ["--host", "0.0.0.0", "--port", "30000"]


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"TANGRAM_MODEL_PATH": "/nonexistent/model"}, "TANGRAM_MODEL_PATH=/nonexistent/model"),
        ({"TANGRAM_PROFILE": "/nonexistent/p.json"}, "TANGRAM_PROFILE=/nonexistent/p.json"),
        ({"TANGRAM_PORT": "http"}, "TANGRAM_PORT must be a port number"),
        ({"TANGRAM_PORT": "0"}, "TANGRAM_PORT must be a port number in 1..65535, got '0'"),
        ({"TANGRAM_PORT": "99999"}, "TANGRAM_PORT must be a port number in 1..65535"),
        ({"TANGRAM_PORT": " 8080"}, "TANGRAM_PORT must be a port number"),
        ({"TANGRAM_MODEL_PATH": "/"}, "TANGRAM_MODEL_PATH=/ has no config.json"),
    ],
    ids=[
        "missing-model",
        "missing-profile",
        "bad-port",
        "port-0",
        "port-too-big",
        "port-space",
        "model-without-config",
    ],
)
def test_entrypoint_refuses_bad_settings(model_dir, env, message):
    result = run_entrypoint({"DRY_RUN": "1", "TANGRAM_MODEL_PATH": str(model_dir), **env})
    assert result.returncode == 2
    assert message in result.stderr and result.stdout == ""


def test_healthcheck_fails_when_no_server_answers():
    result = run_entrypoint({"TANGRAM_PORT": "9", "TANGRAM_PYTHON": "python3"}, "--healthcheck")
    assert result.returncode == 1
    assert "unhealthy: http://127.0.0.1:9/health" in result.stderr


# ---- compose -----------------------------------------------------------------------------------
def test_compose_mounts_the_model_and_profile_on_one_gpu():
    compose = yaml.safe_load(COMPOSE.read_text())
    ((name, service),) = compose["services"].items()
    assert service["build"] == {"context": "..", "dockerfile": "docker/Dockerfile"}
    assert (COMPOSE.parent / ".." / service["build"]["dockerfile"]).is_file()
    assert service["image"] == "tangram-sglang:latest"
    mounts = {m["target"]: m for m in service["volumes"]}
    env = service["environment"]
    for variable in ("TANGRAM_MODEL_PATH", "TANGRAM_PROFILE"):
        mount = mounts[env[variable]]
        assert mount["type"] == "bind" and mount["read_only"] is True
        assert mount["source"].startswith("${") and ":?" in mount["source"]  # required variable
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert device == {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}
    assert service["ports"][0].endswith(":" + env["TANGRAM_PORT"])
