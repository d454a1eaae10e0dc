"""deploy/Dockerfile, read as text (no Docker engine here to build it): the essentials are in place.

The pins must be the versions installed here, which the tests run against.
"""

import json
import re
import tomllib
from importlib import metadata

import pytest

SERVING_PACKAGES = ["engine", "workers", "kernels", "cluster", "deploy"]


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
    pins = dict(re.findall(r'"?([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?==([0-9][^\s"]*)"?', " ".join(_args(instructions, "RUN"))))
    pins = {name.lower().replace("_", "-"): version for name, version in pins.items()}
    pyproject = tomllib.loads((repo / "pyproject.toml").read_text())
    for requirement in pyproject["project"]["dependencies"]:
        name = re.match(r"[A-Za-z0-9_.\-]+", requirement).group(0).lower().replace("_", "-")
        if name == "triton":  # torch pins its own Triton
            continue
        assert name in pins, f"{name} is not pinned in the Dockerfile"
        installed = metadata.version(name).split("+")[0]
        assert pins[name] == installed, f"Dockerfile pins {name}=={pins[name]}, the tests run {installed}"


def test_image_runs_the_ingress_mode_of_pagoda_serve(instructions):
    from deploy.cli import DIRECT_INGRESS_ENV

    env = dict(item.split("=", 1) for line in _args(instructions, "ENV") for item in line.split())
    assert {k: env.get(k) for k in DIRECT_INGRESS_ENV} == DIRECT_INGRESS_ENV
