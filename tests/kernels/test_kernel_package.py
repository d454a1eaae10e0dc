"""The kernels package itself: empty __init__, hub kernels stay unavailable, imports only torch and triton (and
engine.envs, the standard-library-only module where every environment variable is read)."""

import ast
import os
import pathlib
import subprocess
import sys
from types import SimpleNamespace

import pytest

import kernels

REPO = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = REPO / "kernels"
PROJECT_PACKAGES = {"engine", "workers", "cluster", "deploy", "benchmarks", "tests"}


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    """A fresh interpreter at the repo root (so `kernels` is ours), without TRITON_INTERPRET unless given."""
    environ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | env
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=environ, capture_output=True, text=True,
                          timeout=300)


def test_the_kernels_package_is_ours_and_its_init_is_empty():
    assert pathlib.Path(kernels.__file__).resolve() == PACKAGE / "__init__.py"
    assert (PACKAGE / "__init__.py").read_text().strip() == ""
    assert not hasattr(kernels, "__version__")


def test_transformers_sees_no_hub_kernels():
    """transformers probes a package named `kernels` (Hugging Face's hub kernels); ours must not pass for it."""
    result = run_python(
        "import importlib.util, transformers.utils.import_utils as iu\n"
        "print(importlib.util.find_spec('kernels').origin)\n"
        "print(iu.is_kernels_available())\n"
    )
    assert result.returncode == 0, result.stderr
    origin, available = result.stdout.split()
    assert pathlib.Path(origin).resolve() == PACKAGE / "__init__.py"
    assert available == "False"


def test_transformers_sees_no_hub_kernels_in_this_process():
    from transformers.utils import import_utils

    getattr(import_utils.is_kernels_available, "cache_clear", lambda: None)()
    assert import_utils.is_kernels_available() is False


@pytest.mark.parametrize("path", sorted(PACKAGE.glob("*.py")), ids=lambda p: p.name)
def test_imports_only_torch_triton_and_the_standard_library(path):
    allowed = set(sys.stdlib_module_names) | {"torch", "triton", "kernels"}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.name}: relative import"
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if name == "engine.envs":
                continue
            assert top in allowed and top not in PROJECT_PACKAGES, f"{path.name} imports {name}"


def test_refs_work_without_triton():
    """On a machine without triton (a macOS laptop) the kernel modules import and fall back to torch."""
    result = run_python(
        "import sys, torch\n"
        "sys.modules['triton'] = None  # makes `import triton` raise ImportError\n"
        "from kernels import activation, kv_cache, paged_attention, rms_norm, rotary\n"
        "x = torch.randn(2, 8)\n"
        "assert torch.equal(activation.silu_and_mul(x), activation.silu_and_mul_ref(x))\n"
        "assert rms_norm.rms_norm(x, torch.ones(8), 1e-6).shape == (2, 8)\n"
        "try:\n"
        "    activation.silu_and_mul_triton(x)\n"
        "except RuntimeError as e:\n"
        "    print('raised:', e)\n"
    )
    assert result.returncode == 0, result.stderr
    assert "raised: triton is not installed" in result.stdout


def test_cpu_tensors_need_the_interpreter():
    result = run_python(
        "import torch\n"
        "from kernels.activation import silu_and_mul_triton\n"
        "try:\n"
        "    silu_and_mul_triton(torch.randn(2, 8))\n"
        "except ValueError as e:\n"
        "    print('raised:', e)\n"
    )
    assert result.returncode == 0, result.stderr
    assert "TRITON_INTERPRET=1" in result.stdout


def test_pagoda_kernels_ref_forces_the_references(monkeypatch):
    """The worker reads PAGODA_KERNELS into the kernels' settings; the kernels read no environment."""
    import kernels._triton as triton_helpers
    from workers.worker import kernel_settings

    class FakeCuda:
        is_cuda = True

    monkeypatch.setattr(triton_helpers, "_settings", triton_helpers.KernelSettings())
    monkeypatch.delenv("PAGODA_KERNELS", raising=False)
    triton_helpers.configure(kernel_settings())
    assert triton_helpers.use_triton(FakeCuda())
    monkeypatch.setenv("PAGODA_KERNELS", "ref")
    assert triton_helpers.use_triton(FakeCuda())  # read by the worker, not here
    triton_helpers.configure(kernel_settings())
    assert not triton_helpers.use_triton(FakeCuda())


@pytest.mark.parametrize("capability, hip, env, expected", [
    ((9, 0), None, None, True),  # Hopper
    ((10, 0), None, None, True),  # Blackwell
    ((8, 0), None, None, False),  # Ampere: no griddepcontrol
    ((9, 0), None, "0", False),  # turned off
    ((9, 4), "6.2", None, False),  # a ROCm GPU, which torch calls "cuda" too
])
def test_programmatic_dependent_launch_only_where_the_gpu_has_it(monkeypatch, capability, hip, env, expected):
    """pdl_options' rule. No GPU here: the device query and torch's HIP version are stand-ins (the H200 runs the
    kernels with it; tests/kernels/test_kernel_compile.py checks the compiled wait)."""
    import torch

    import kernels._triton as triton_helpers

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(triton_helpers, "_PDL_OPTIONS", {})
    major, minor = capability
    monkeypatch.setattr(triton_helpers, "_properties", lambda device: SimpleNamespace(major=major, minor=minor))
    monkeypatch.setattr(torch.version, "hip", hip)
    if env is None:
        monkeypatch.delenv("PAGODA_PDL", raising=False)
    else:
        monkeypatch.setenv("PAGODA_PDL", env)
    from workers.worker import kernel_settings

    monkeypatch.setattr(triton_helpers, "_settings", triton_helpers.KernelSettings())
    triton_helpers.configure(kernel_settings())
    on = expected and triton_helpers.HAS_TRITON
    assert triton_helpers.pdl_options(torch.device("cuda", 0)) == {"PDL": on, "launch_pdl": on}
    assert triton_helpers.pdl_options(torch.device("cpu")) == {"PDL": False, "launch_pdl": False}


def test_no_programmatic_dependent_launch_under_the_interpreter(monkeypatch):
    import torch

    import kernels._triton as triton_helpers

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(triton_helpers, "_PDL_OPTIONS", {})
    monkeypatch.setattr(triton_helpers, "_properties", lambda device: SimpleNamespace(major=9, minor=0))
    assert triton_helpers.pdl_options(torch.device("cuda", 0)) == {"PDL": False, "launch_pdl": False}
