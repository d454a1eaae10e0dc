"""What every kernel file shares: the Triton import (optional), dispatch, and small launch helpers.

Triton is a Linux-only dependency. Without it (a macOS laptop) the kernel files still import: `@triton.jit`
becomes a stub that raises when launched, and every public function takes its torch reference.
"""

import functools
import os
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised by a subprocess test that hides triton
    HAS_TRITON = False

    class _MissingKernel:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            raise RuntimeError(f"{self.fn.__name__}: triton is not installed; use the torch reference")

    class _TritonStub:
        """Just enough of `triton` / `triton.language` for the kernel modules to define their kernels."""

        constexpr = object()  # only ever used as an annotation

        @staticmethod
        def jit(fn=None, **_kwargs):
            return _MissingKernel(fn) if fn is not None else _MissingKernel

    triton = tl = _TritonStub()

# torch dtype -> dtypes the kernels take.
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def is_interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (tests on a machine without a GPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclass(frozen=True)
class KernelSettings:
    """What the caller decides for every kernel of the process (the worker, from `PAGODA_KERNELS` and `PAGODA_PDL`:
    the kernels read no settings themselves)."""

    # the torch references everywhere, also on a GPU (debugging, bisecting a numerical difference); they sync the
    # host (boolean indexing), so the worker captures no CUDA graphs then
    force_references: bool = False
    pdl: bool = True  # programmatic dependent launch where the GPU has it (pdl_options)


_settings = KernelSettings()


def configure(settings: KernelSettings) -> None:
    """Sets the process's kernel settings (before its first launch: a device's launch options are kept)."""
    global _settings
    _settings = settings
    _PDL_OPTIONS.clear()


def references_forced() -> bool:
    return _settings.force_references


def use_triton(tensor: torch.Tensor) -> bool:
    """The public functions' choice: the Triton launcher for CUDA tensors, else the torch reference. While
    torch.compile traces a model the reference, which inductor compiles and fuses with the code around it (the
    kernels it must not see into are kernels/ops.py's custom ops)."""
    return HAS_TRITON and tensor.is_cuda and not references_forced() and not torch.compiler.is_compiling()


def check_launchable(*tensors: torch.Tensor) -> None:
    """A Triton launcher runs on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed: call the public function, which falls back to torch")
    device = tensors[0].device
    for t in tensors:
        if t.device != device:
            raise ValueError(f"all tensors must be on one device, got {device} and {t.device}")
    if device.type != "cuda" and not is_interpreting():
        raise ValueError(
            f"Triton kernels need CUDA tensors (got {device}); CPU tensors run only under TRITON_INTERPRET=1, "
            "which must be set before the kernel modules are imported"
        )


def check_dtype(name: str, t: torch.Tensor, allowed: tuple) -> None:
    if t.dtype not in allowed:
        raise ValueError(f"{name} must have dtype in {[str(d) for d in allowed]}, got {t.dtype}")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {tuple(t.stride())}")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def is_power_of_2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@functools.lru_cache(maxsize=None)
def _cuda_properties(index: int):
    return torch.cuda.get_device_properties(index)


def _properties(device: torch.device):
    return _cuda_properties(device.index if device.index is not None else torch.cuda.current_device())


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device`; under the interpreter, an H200's 132 (the heuristics stay testable)."""
    return _properties(device).multi_processor_count if device.type == "cuda" else 132


def shared_memory_per_sm(device: torch.device) -> int:
    """Shared memory of one SM in bytes (228 KiB on Hopper, 164 KiB on A100, ~100 KiB on Ada); H200's on CPU."""
    return _properties(device).shared_memory_per_multiprocessor if device.type == "cuda" else 228 * 1024


def shared_memory_per_block(device: torch.device) -> int:
    """The most shared memory one program may use (227 KiB on Hopper); an H200's under the interpreter."""
    if device.type != "cuda":
        return 227 * 1024
    return _properties(device).shared_memory_per_block_optin


def pdl_options(device: torch.device) -> dict:
    """A launch's programmatic-dependent-launch arguments: the kernel's `PDL` constexpr and Triton's `launch_pdl`
    option, both True on NVIDIA Hopper and later GPUs unless KernelSettings.pdl is off (`PAGODA_PDL=0`),
    never under the interpreter. A kernel launched so is scheduled while the kernel before it still runs: each of its
    programs starts with `wait_for_prior`, which lets the next kernel be scheduled the same way and then waits
    for the previous kernel to finish and its writes to be visible. The next kernel's launch and set-up overlap
    the previous kernel's tail; it holds inside CUDA graphs (captured as programmatic edges)."""
    options = _PDL_OPTIONS.get(device)
    if options is None:
        on = (device.type == "cuda" and torch.version.hip is None and HAS_TRITON and not is_interpreting()
              and _settings.pdl)  # griddepcontrol is NVIDIA's (a ROCm device is "cuda" to torch too)
        if on:
            props = _properties(device)
            on = (props.major, props.minor) >= (9, 0)
        options = _PDL_OPTIONS[device] = {"PDL": bool(on), "launch_pdl": bool(on)}
    return options


_PDL_OPTIONS: dict = {}  # device -> its launches' options (a dict lookup: launchers run on every eager step)


@triton.jit
def wait_for_prior(PDL: tl.constexpr):
    """A kernel's first statement (before it touches global memory) when launched with PDL (`pdl_options`): lets
    the next kernel be scheduled, then waits until the previous kernel has finished and its writes are visible
    (griddepcontrol, sm_90+). Nothing when PDL is False."""
    if PDL:
        tl.inline_asm_elementwise("griddepcontrol.launch_dependents; griddepcontrol.wait; // $0", "=r", [],
                                  dtype=tl.int32, is_pure=False, pack=1)


# Split-K kernels' arrival counts: int32 zeros, one per tile, that each tile's last program resets to 0 (so a CUDA
# graph replays the same counts). One array per device and owner: kernels that may run side by side on two streams
# (workers/side_stream.py: the LoRA shrink beside a layer's int4 / FP8 matmul) count in different ones.
_SPLIT_COUNTS: dict[tuple[torch.device, str], torch.Tensor] = {}


def split_counts(device: torch.device, num_tiles: int, owner: str = "linear") -> torch.Tensor | None:
    """`owner`'s counts on `device`, at least num_tiles of them (grown outside CUDA graph capture only: None during
    one, and the launcher then does not split K)."""
    counts = _SPLIT_COUNTS.get((device, owner))
    if counts is None or counts.numel() < num_tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counts = _SPLIT_COUNTS[(device, owner)] = torch.zeros(max(num_tiles, 1024), dtype=torch.int32, device=device)
    return counts


def upcast_dot_operands(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a kernel must feed tl.dot float32 operands instead of `dtype`.

    Triton 3.9's interpreter multiplies bfloat16 operands of tl.dot as their raw uint16 bit patterns (it stores
    bf16 as uint16 and hands them to np.matmul). On CPU tensors we therefore upcast bf16 to float32 before each dot;
    on a GPU the dots stay bf16 with float32 accumulation.
    """
    return dtype == torch.bfloat16 and device.type != "cuda"


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: exact IEEE for float32 tensors (tf32 would lose ~3 digits), irrelevant for 16-bit."""
    return "ieee" if dtype == torch.float32 else "tf32"
