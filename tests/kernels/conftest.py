"""Kernel tests run every Triton launcher against its torch reference.

Without a GPU the launchers run on CPU tensors in Triton's interpreter. TRITON_INTERPRET is read when triton is
imported and when each `@triton.jit` kernel is defined, so it is set here, at the top, before any test module of
this folder imports the kernels. It changes only how Triton runs kernels; on a machine without a GPU nothing else
in the session runs Triton, and on a GPU machine it is left unset (the tests then run natively on CUDA tensors,
and the `gpu` tests at real sizes run too). If tests collected before this folder import triton first (through
workers/ -> kernels/), the kernel tests fail with a message saying so: set TRITON_INTERPRET=1 in tests/conftest.py.
"""

import os
import sys

import torch

# Set before triton is first imported: triton.language's own helpers (tl.sum, tl.cdiv...) are defined as
# interpreted or compiled functions at that moment, and cannot be redefined later in the same process.
TRITON_IMPORTED_TOO_EARLY = False
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    TRITON_IMPORTED_TOO_EARLY = "triton" in sys.modules
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where the Triton launchers run: CPU under the interpreter, else the GPU."""
    if TRITON_IMPORTED_TOO_EARLY:
        pytest.fail("triton was imported (by tests collected before tests/kernels) before this conftest could set "
                    "TRITON_INTERPRET=1; set it in the environment or at the top of tests/conftest.py", pytrace=False)
    if INTERPRETING:
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    pytest.skip("neither TRITON_INTERPRET=1 nor a GPU")


@pytest.fixture
def cuda() -> torch.device:
    """For the `gpu` tests at real sizes: a CUDA device with native (not interpreted) Triton."""
    if INTERPRETING or not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU and TRITON_INTERPRET unset")
    return torch.device("cuda")


@pytest.fixture
def poisoned_allocations(monkeypatch):
    """Make torch.empty / empty_like return NaN-filled float tensors (outputs and split-K workspaces alike).

    A launcher's output then holds NaN wherever its kernel did not write, and any unwritten partial result
    that gets merged shows up as NaN too.
    """
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poison(empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: poison(empty_like(*a, **kw)))
