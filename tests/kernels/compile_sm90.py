"""Compile every kernel with the real Triton compiler for an H100/H200 (sm_90), on a machine without a GPU.

Run by test_kernel_compile.py in a subprocess without TRITON_INTERPRET. A stand-in driver reports an sm_90
target; each launcher runs on empty CPU tensors with its launch turned into a compile-only warmup. Prints one
JSON line per compiled kernel: name, case, registers, spilled bytes, shared memory. Exits 3 when this Triton's
internals do not fit the stand-in (the caller skips), 1 when a kernel fails to compile.
"""

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

assert os.environ.get("TRITON_INTERPRET", "0") != "1", "run without the interpreter"
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase
    from triton.runtime.jit import JITFunction

    class Sm90Driver(DriverBase):
        """The least of a driver the JIT needs to compile (never to launch)."""

        def __init__(self):
            pass

        @classmethod
        def is_active(cls):
            return True

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_device_interface(self):
            return torch.cuda

        def get_benchmarker(self):
            return None

        def get_empty_cache_for_benchmark(self):
            return None

        def clear_cache(self, cache):
            pass

        def map_python_to_cpp_type(self, ty):
            return ty

    triton.runtime.driver.set_active(Sm90Driver())
    CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
except Exception as exc:  # noqa: BLE001
    print(f"stand-in driver unavailable: {exc!r}")
    sys.exit(3)

import kernels.activation as activation  # noqa: E402
import kernels.fp8 as fp8  # noqa: E402
import kernels.int_decode as int_decode  # noqa: E402
import kernels.kv_cache as kv_cache  # noqa: E402
import kernels.linear as linear  # noqa: E402
import kernels.linear_fp8 as linear_fp8  # noqa: E402
import kernels.linear_int as linear_int  # noqa: E402
import kernels.lora as lora  # noqa: E402
import kernels.mla_attention as mla_attention  # noqa: E402
import kernels.moe as moe  # noqa: E402
import kernels.moe_int_decode as moe_int_decode  # noqa: E402
import kernels.moe_quant as moe_quant  # noqa: E402
import kernels.ngram as ngram  # noqa: E402
import kernels.paged_attention as paged_attention  # noqa: E402
import kernels.rejection_sampler as rejection_sampler  # noqa: E402
import kernels.rms_norm as rms_norm  # noqa: E402
import kernels.rotary as rotary  # noqa: E402
import kernels.run_ahead as run_ahead  # noqa: E402
import kernels.sampling as sampling  # noqa: E402

for module in (activation, fp8, int_decode, kv_cache, linear, linear_fp8, linear_int, lora, mla_attention, moe,
               moe_int_decode, moe_quant, ngram, paged_attention, rms_norm, rotary, sampling, rejection_sampler,
               run_ahead):
    module.check_launchable = lambda *tensors: None  # CPU tensors stand in for CUDA ones: nothing runs
    module.pdl_options = lambda device: {"PDL": True, "launch_pdl": True}  # as on a Hopper GPU
paged_attention.upcast_dot_operands = linear.upcast_dot_operands = moe.upcast_dot_operands = lambda *args: False
linear_int.upcast_dot_operands = moe_quant.upcast_dot_operands = lora.upcast_dot_operands = lambda *args: False
mla_attention.upcast_dot_operands = lambda *args: False

CASE = ["?"]


def resources(compiled) -> dict:
    """Registers and spills from the cubin (cuobjdump), shared memory from Triton's metadata, MMA kinds from the
    PTX."""
    usage = {"shared_bytes": compiled.metadata.shared, "hash": compiled.hash,
             # the tensor-core instructions in the PTX: Hopper's wgmma (with its operand types) or Ampere's mma.sync
             "mma": sorted(set(re.findall(r"\b(?:wgmma\.mma_async\.sync|mma\.sync)\.aligned\.[\w.]+",
                                          compiled.asm.get("ptx", ""))))}
    ptx = compiled.asm.get("ptx", "")
    wait = ptx.find("griddepcontrol.wait")
    memory = re.search(r"\b(?:ld|st|atom|red)\.global|\bcp\.async\.(?:c[ag]|bulk)", ptx)
    # programmatic dependent launch: the wait comes before the kernel's first global memory access
    usage["waits_before_memory"] = wait >= 0 and (memory is None or wait < memory.start())
    # how the memory is read: 16-byte cp.async copies, int-to-float conversions, local memory (spills, arrays)
    usage |= {"cp_async_16": len(re.findall(r"cp\.async\.c[ag]\.shared\.global[^;]*,\s*(?:16|0x10)\s*[,;]", ptx)),
              "int_to_float": len(re.findall(r"\bcvt\.rn\.f32\.[su](?:8|16|32|64)\b", ptx)),
              "local_memory": len(re.findall(r"\b(?:ld|st)\.local\b", ptx))}
    if CUOBJDUMP.exists():
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            text = subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", f.name], capture_output=True,
                                  text=True).stdout
            sass = subprocess.run([str(CUOBJDUMP), "--dump-sass", f.name], capture_output=True, text=True).stdout
        match = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", text)
        if match:
            usage |= {"registers": int(match[1]), "spill_bytes": int(match[2]) + int(match[3])}
        usage["loop_instructions"] = main_loop_length(sass)
    return usage


def main_loop_length(sass: str) -> int:
    """SASS instructions from the target of the longest backward branch to the branch: a kernel's K loop."""
    addresses, longest = [], 0
    for line in sass.splitlines():
        match = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if not match:
            continue
        address = int(match[1], 16)
        addresses.append(address)
        branch = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", match[2])
        if branch and int(branch[1], 16) < address:
            target = int(branch[1], 16)
            longest = max(longest, sum(1 for a in addresses if target <= a <= address))
    return longest


def compile_only(self, *args, grid, warmup, **kwargs):
    compiled = ORIGINAL_RUN(self, *args, grid=grid, warmup=True, **kwargs)
    tiles = {k: kwargs[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GATED", "BIASED", "ROW_SCALES") if k in kwargs}
    print(json.dumps({"kernel": self.fn.__name__, "case": CASE[0], "num_warps": compiled.metadata.num_warps,
                      **tiles, **resources(compiled)}), flush=True)
    return compiled


ORIGINAL_RUN = JITFunction.run
JITFunction.run = compile_only


def empty(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype)


def int32(*shape):
    return torch.zeros(shape, dtype=torch.int32)


FP8 = torch.float8_e4m3fn


def _kv(kv_heads, dim, dtype, kv_fp8):
    cache = empty(8, 16, kv_heads, dim, dtype=FP8 if kv_fp8 else dtype)
    scales = dict(k_scale=empty(kv_heads, dtype=torch.float32), v_scale=empty(kv_heads, dtype=torch.float32))
    return cache, scales if kv_fp8 else {}


def decode(name, seqs, heads, kv_heads, dim, dtype, splits, fused_merge=None, config=None, window=None, kv_fp8=False):
    CASE[0] = name
    q, (cache, scales) = empty(seqs, heads, dim, dtype=dtype), _kv(kv_heads, dim, dtype, kv_fp8)
    paged_attention.paged_attention_decode_triton(q, cache, cache, int32(seqs, 512), int32(seqs), 0.1,
                                                  num_splits=splits, config=config, fused_merge=fused_merge,
                                                  sliding_window=window, **scales)


def prefill(name, tokens, heads, kv_heads, dim, dtype, max_query_len=None, num_seqs=2, window=None, kv_fp8=False):
    CASE[0] = name
    q, (cache, scales) = empty(tokens, heads, dim, dtype=dtype), _kv(kv_heads, dim, dtype, kv_fp8)
    paged_attention.paged_attention_prefill_triton(q, cache, cache, int32(num_seqs, 512), int32(num_seqs + 1),
                                                   int32(num_seqs), 0.1, max_query_len, sliding_window=window,
                                                   **scales)


def fused_moe(name, tokens, hidden, inter, experts, top_k, dtype=torch.bfloat16):
    CASE[0] = name
    ids = torch.zeros(tokens, top_k, dtype=torch.int64)
    moe.fused_moe_triton(empty(tokens, hidden, dtype=dtype), empty(experts, 2 * inter, hidden, dtype=dtype),
                         empty(experts, hidden, inter, dtype=dtype), torch.zeros(tokens, top_k), ids)


def int_experts(experts, n, k, group, packing, act_order=False, mins=False):
    """Empty packed experts of [n, k] each (K-first, as the int layers hold them); mins: GGUF's, float32."""
    p = packing.pack_factor
    qweight = int32(experts, k // p, n) if packing.is_packed_along_k else int32(experts, k, n // p)
    if mins:
        return moe_quant.IntExperts(qweight, None, empty(experts, k // group, n, dtype=torch.float32), None, group,
                                    packing, empty(experts, k // group, n, dtype=torch.float32))
    return moe_quant.IntExperts(qweight, int32(experts, k // group, n // p),
                                empty(experts, k // group, n, dtype=torch.float16),
                                int32(experts, k) if act_order else None, group, packing)


def fp8_experts(experts, n, k, block=None, parts=1):
    scale = (empty(experts, n, dtype=torch.float32) if block is None else
             empty(experts, parts * -(-n // parts // block[0]), -(-k // block[1]), dtype=torch.float32))
    return moe_quant.Fp8Experts(empty(experts, n, k, dtype=FP8), scale, block, parts)


def fused_moe_quant(name, tokens, hidden, inter, experts, top_k, make):
    """make(n, k, parts) -> one projection's quantized experts."""
    CASE[0] = name
    moe_quant.fused_moe_quant_triton(empty(tokens, hidden), make(2 * inter, hidden, 2), make(hidden, inter, 1),
                                     torch.zeros(tokens, top_k), torch.zeros(tokens, top_k, dtype=torch.int64))


def compile_moe_quant() -> None:
    """The fused MoE over int4 (AWQ, GPTQ act-order), int8 and FP8 (per row, 128 x 128 blocks) experts, at decode
    (16-row tiles; int layouts without act-order streamed by kernels/moe_int_decode.py) and prefill (64-row tiles)
    sizes of Mixtral-8x7B, Qwen3-30B-A3B and DeepSeek-V2-Lite."""
    awq = lambda n, k, parts: int_experts(8, n, k, 128, linear_int.AWQ_GEMM)  # noqa: E731
    for tokens in (1, 4096):
        fused_moe_quant(f"moe awq mixtral, {tokens} tokens", tokens, 4096, 14336, 8, 2, awq)
    gptq_act = lambda n, k, parts: int_experts(128, n, k, 128, linear_int.gptq_v1(4), act_order=True)  # noqa: E731
    for tokens in (8, 2048):  # 16-row tiles; 64-row ones, each packed word loaded once
        fused_moe_quant(f"moe gptq act-order qwen3-30b-a3b, {tokens} tokens", tokens, 2048, 768, 128, 8, gptq_act)
    int8 = lambda n, k, parts: int_experts(128, n, k, 128, linear_int.gptq_v1(8))  # noqa: E731
    fused_moe_quant("moe gptq int8 qwen3-30b-a3b, 8 tokens", 8, 2048, 768, 128, 8, int8)  # streamed (along K)
    gptq = lambda n, k, parts: int_experts(128, n, k, 128, linear_int.gptq_v1(4))  # noqa: E731
    fused_moe_quant("moe gptq qwen3-30b-a3b, 1 tokens", 1, 2048, 768, 128, 8, gptq)  # streamed, K split
    awq64 = lambda n, k, parts: int_experts(64, n, k, 64, linear_int.AWQ_GEMM)  # noqa: E731
    fused_moe_quant("moe awq deepseek-v2-lite, 1 tokens", 1, 2048, 1408, 64, 6, awq64)  # streamed, K split
    gguf = lambda n, k, parts: int_experts(128, n, k, 32, linear_int.offset_binary(4), mins=True)  # noqa: E731
    for tokens in (1, 2048):  # GGUF Q4_K experts: streamed (groups of 32 in its K tiles), and the GEMM's tiles
        fused_moe_quant(f"moe gguf q4_k qwen3-30b-a3b, {tokens} tokens", tokens, 2048, 768, 128, 8, gguf)
    fp8_rows = lambda n, k, parts: fp8_experts(8, n, k)  # noqa: E731
    for tokens in (1, 4096):
        fused_moe_quant(f"moe fp8 per-row mixtral, {tokens} tokens", tokens, 4096, 14336, 8, 2, fp8_rows)
    fp8_blocks = lambda n, k, parts: fp8_experts(128, n, k, (128, 128), parts)  # noqa: E731
    for tokens in (16, 2048):
        fused_moe_quant(f"moe fp8 128x128 blocks qwen3-30b-a3b, {tokens} tokens", tokens, 2048, 768, 128, 8,
                        fp8_blocks)


def fp8_linear(name, rows, out_rows, in_features, gated=False, **kwargs):
    CASE[0] = name
    linear_fp8.linear_fp8_triton(empty(rows, in_features, dtype=kwargs.pop("x_dtype", torch.bfloat16)),
                                 empty(out_rows, in_features, dtype=FP8), empty(out_rows, dtype=torch.float32),
                                 gated=gated, **kwargs)


def compile_fp8() -> None:
    """The FP8 kernels: the linear in each activation mode and launch-setting family, the per-token quantize,
    the FP8 KV write (alone and fused with rotary) and attention over an e4m3 pool."""
    for rows in (1, 16, 256):  # decode-sized; GEMM tiles from 17 rows on
        fp8_linear(f"fp8 linear qkv, {rows} rows", rows, 6144, 4096)
        fp8_linear(f"fp8 linear gate_up + silu, {rows} rows", rows, 2 * 14336, 4096, gated=True)
        fp8_linear(f"fp8 linear down, {rows} rows", rows, 4096, 14336)
    for rows in (1, 16):  # the decode-sized swap kernel (linear_fp8's choice up to 16 rows), 8B and 70B layers
        for name, out_rows, in_features, gated in [("qkv", 6144, 4096, False), ("gate_up", 2 * 14336, 4096, True),
                                                   ("down", 4096, 14336, False), ("70b gate_up", 2 * 28672, 8192, True),
                                                   ("70b down", 8192, 28672, False)]:
            CASE[0] = f"fp8 swap {name}, {rows} rows"
            linear_fp8.linear_fp8_swap(empty(rows, in_features, dtype=FP8), empty(rows, dtype=torch.float32),
                                       empty(out_rows, in_features, dtype=FP8), empty(out_rows, dtype=torch.float32),
                                       gated=gated)
    for name, out_rows, in_features, gated, split in [("down", 4096, 14336, False, "auto"),
                                                      ("gate_up", 2 * 14336, 4096, True, 2)]:  # split-K variants
        CASE[0] = f"fp8 swap {name} split {split}, 16 rows"
        linear_fp8.linear_fp8_swap(empty(16, in_features, dtype=FP8), empty(16, dtype=torch.float32),
                                   empty(out_rows, in_features, dtype=FP8), empty(out_rows, dtype=torch.float32),
                                   gated=gated, config={"SPLIT_K": split})
    fp8_linear("fp8 linear fp32 x, 4 rows", 4, 4096, 4096, x_dtype=torch.float32)
    fp8_linear("fp8 linear static input scale, 64 rows", 64, 4096, 4096, input_scale=empty(1, dtype=torch.float32))
    fp8_linear("fp8 linear pre-quantized x, 2048 rows", 2048, 4096, 4096, x_dtype=FP8,
               x_scale=empty(2048, dtype=torch.float32))
    CASE[0] = "fp8 linear 128 x 128 blocks, 256 rows"
    linear_fp8.linear_fp8_triton(empty(256, 4096), empty(6144, 4096, dtype=FP8), empty(48, 32, dtype=torch.float32),
                                 block_size=(128, 128))
    CASE[0] = "quantize_per_token 14336"
    fp8.quantize_per_token_triton(empty(8, 14336))
    CASE[0] = "silu_and_mul -> fp8 14336"  # SiLU-and-mul quantizing its output for the FP8 down projection
    activation.silu_and_mul_triton(empty(64, 2 * 14336), quantize=True)
    for hidden in (4096, 8192):  # RMSNorm quantizing its output for the FP8 q/k/v and gate/up (8B, 70B)
        CASE[0] = f"rms_norm+residual -> fp8 {hidden}"
        x = empty(4, hidden)
        rms_norm.rms_norm_triton(x, empty(hidden), 1e-5, x, quantize=True)
    scales = (empty(8, dtype=torch.float32), empty(8, dtype=torch.float32))
    CASE[0] = "rotary + fp8 kv write 32/8 x 128"
    rotary.rotary_embedding_triton(torch.zeros(4, dtype=torch.int64), empty(4, 4096), empty(4, 1024),
                                   empty(64, 128, dtype=torch.float32), 128,
                                   (empty(4, 1024), empty(8, 16, 8, 128, dtype=FP8), empty(8, 16, 8, 128, dtype=FP8),
                                    torch.zeros(4, dtype=torch.int64), *scales))
    CASE[0] = "write_kv_cache fp8 8 x 128"
    kv_cache.write_kv_cache_triton(empty(4, 8, 128), empty(4, 8, 128), empty(8, 16, 8, 128, dtype=FP8),
                                   empty(8, 16, 8, 128, dtype=FP8), torch.zeros(4, dtype=torch.int64), *scales)
    decode("decode llama3-8b bf16 fp8 kv fused", 1, 32, 8, 128, torch.bfloat16, 32, kv_fp8=True)
    decode("decode llama3-8b bf16 fp8 kv", 64, 32, 8, 128, torch.bfloat16, 1, kv_fp8=True)
    decode("decode llama3-8b bf16 fp8 kv 256", 256, 32, 8, 128, torch.bfloat16, 1, kv_fp8=True)  # 128-key tiles
    prefill("prefill llama3-8b bf16 fp8 kv", 4096, 32, 8, 128, torch.bfloat16, kv_fp8=True)
    # A sliding window over an e4m3 pool (Mistral / Qwen3 / Phi-3 with kv_cache_dtype="fp8"): both options at once.
    decode("decode mistral window bf16 fp8 kv fused", 1, 32, 8, 128, torch.bfloat16, 16, window=4096, kv_fp8=True)
    decode("decode mistral window bf16 fp8 kv", 64, 32, 8, 128, torch.bfloat16, 1, window=4096, kv_fp8=True)
    prefill("prefill mistral window bf16 fp8 kv", 4096, 32, 8, 128, torch.bfloat16, window=4096, kv_fp8=True)


def compile_mla() -> None:
    """DeepSeek-V2's latent attention (512 latent + 64 rope dims): the write, decode (one split and four, with the
    merge) at V2-Lite's 16 heads a rank and V2's 128 (tp 1), an e4m3 pool, and packed prefill."""
    def pool(kv_fp8=False):
        dtype = FP8 if kv_fp8 else torch.bfloat16
        scales = (empty(1, dtype=torch.float32), empty(1, dtype=torch.float32)) if kv_fp8 else (None, None)
        return empty(64, 16, 1, 512, dtype=dtype), empty(64, 16, 1, 64, dtype=dtype), scales

    for kv_fp8 in (False, True):
        latent_cache, rope_cache, scales = pool(kv_fp8)
        CASE[0] = f"mla write 512 + 64{' fp8' if kv_fp8 else ''}"
        mla_attention.write_latent_cache_triton(empty(4, 512), empty(4, 64), latent_cache, rope_cache,
                                                torch.zeros(4, dtype=torch.int64), *scales)
    for name, seqs, heads, splits, kv_fp8 in [("v2-lite 16 heads", 64, 16, 1, False),
                                             ("v2-lite 16 heads split", 1, 16, 4, False),
                                             ("v2 128 heads", 64, 128, 1, False),
                                             ("v2-lite 16 heads fp8", 64, 16, 1, True)]:
        CASE[0] = f"mla decode {name}"
        latent_cache, rope_cache, scales = pool(kv_fp8)
        mla_attention.mla_decode_triton(empty(seqs, heads, 512), empty(seqs, heads, 64), latent_cache, rope_cache,
                                        int32(seqs, 512), int32(seqs), 0.1, *scales, num_splits=splits)
    for name, tokens, heads, seqs, kv_fp8 in [("v2-lite 16 heads", 4096, 16, 2, False),
                                             ("v2-lite 16 heads 16 seqs", 64, 16, 16, False),
                                             ("v2-lite 16 heads fp8", 4096, 16, 2, True)]:
        CASE[0] = f"mla prefill {name}"
        latent_cache, rope_cache, scales = pool(kv_fp8)
        mla_attention.mla_prefill_triton(empty(tokens, heads, 512), empty(tokens, heads, 64), latent_cache,
                                         rope_cache, int32(seqs, 512), int32(seqs + 1), int32(seqs), 0.1, None,
                                         *scales)


def int_linear(name, rows, x_features, qweight_shape, qzeros_shape, groups, out_features, packing, group_size=128,
               act_order=False, mins=False, gated=False, gemm=False, pairs=False):
    """linear_int_triton's launch for these rows; `gemm`: its GEMM tiles (gemm_config), where up to STREAM_MAX_ROWS
    rows it would stream; `pairs`: their PAIRS path (pair_gemm_config)."""
    CASE[0] = name
    zeros = None if mins else empty(*qzeros_shape, dtype=torch.int32)
    x = empty(rows, x_features)
    n = out_features // (2 if gated else 1)
    config = (linear_int.pair_gemm_config(rows, n, gated, group_size, x.device) if pairs
              else linear_int.gemm_config(rows, n, gated, x.dtype, x.device) if gemm else None)
    linear_int.linear_int_triton(x, empty(*qweight_shape, dtype=torch.int32), zeros,
                                 empty(groups, out_features, dtype=torch.float16),
                                 empty(x_features, dtype=torch.int32) if act_order else None, group_size, packing,
                                 gated=gated, mins=empty(groups, out_features, dtype=torch.float16) if mins else None,
                                 config=config)


def compile_int_stream() -> None:
    """The streaming decode kernel (kernels/int_decode.py) on Llama-3-8B's layers (AWQ's above: qkv), and the
    float32-x launches of tests/kernels/test_kernel_linear_int.py that overflowed shared memory on the H200."""
    awq, q4 = linear_int.AWQ_GEMM, linear_int.offset_binary(4)
    gptq4, gptq8 = linear_int.gptq_v1(4), linear_int.gptq_v1(8)
    for rows in (1, 16):
        int_linear(f"int4 stream awq gate_up + silu, {rows} rows", rows, 4096, (4096, 2 * 14336 // 8),
                   (32, 2 * 14336 // 8), 32, 2 * 14336, awq, gated=True)
        int_linear(f"int4 stream awq down, {rows} rows", rows, 14336, (14336, 4096 // 8), (112, 4096 // 8), 112,
                   4096, awq)
        int_linear(f"int4 stream gptq qkv, {rows} rows", rows, 4096, (512, 6144), (32, 6144 // 8), 32, 6144, gptq4)
    int_linear("int8 stream gptq qkv, 1 rows", 1, 4096, (1024, 6144), (32, 6144 // 4), 32, 6144, gptq8)
    int_linear("int4 stream awq 70b down, 1 rows", 1, 28672, (28672, 8192 // 8), (224, 8192 // 8), 224, 8192, awq)
    int_linear("int4 stream gptq 70b gate_up + silu, 1 rows", 1, 8192, (1024, 2 * 28672), (64, 2 * 28672 // 8), 64,
               2 * 28672, gptq4, gated=True)
    for name, qweight, qzeros, packing in [("awq", (384, 96 // 8), (3, 96 // 8), awq),
                                           ("gptq", (384 // 8, 96), (3, 96 // 8), gptq4)]:
        for gated in (False, True):  # the GPU oracle tests' float32 x, streamed
            CASE[0] = f"int4 stream float32 x {name}{' gated' if gated else ''}, 5 rows"
            linear_int.linear_int_triton(empty(5, 384, dtype=torch.float32), empty(*qweight, dtype=torch.int32),
                                         empty(*qzeros, dtype=torch.int32), empty(3, 96, dtype=torch.float32), None,
                                         128, packing, gated=gated)
    int_linear("int4 stream gguf q4_1 g128 qkv, 1 rows", 1, 4096, (512, 6144), None, 32, 6144, q4, mins=True)
    # groups under the K tile (ROW_SCALES): GGUF's 32 (Q4_K / Q4_1, mins) and Q6_K's 16 (8 bits), GPTQ's 32
    int_linear("int4 stream gguf q4_k g32 gate_up + silu, 1 rows", 1, 4096, (512, 2 * 14336), None, 128, 2 * 14336,
               q4, group_size=32, mins=True, gated=True)
    int_linear("int8 stream gguf q6_k g16 down, 1 rows", 1, 14336, (14336 // 4, 4096), (896, 4096 // 4), 896, 4096,
               linear_int.offset_binary(8), group_size=16)
    int_linear("int4 stream gptq g32 qkv, 16 rows", 16, 4096, (512, 6144), (128, 6144 // 8), 128, 6144, gptq4,
               group_size=32)
    # GPTQ v1 as a served layer holds it (repacked along N in AWQ's order, v1's zero offset kept), and a group of 32
    # along N (K tiles of 32: GPTQ g32 served so, AWQ g32)
    v1_along_n = linear_int.IntPacking(bits=4, is_packed_along_k=False, fields=linear_int.AWQ_FIELDS, zero_offset=1)
    int_linear("int4 stream v1 zeros along n gate_up + silu, 1 rows", 1, 4096, (4096, 2 * 14336 // 8),
               (32, 2 * 14336 // 8), 32, 2 * 14336, v1_along_n, gated=True)
    int_linear("int4 stream v1 zeros along n g32 qkv, 1 rows", 1, 4096, (4096, 6144 // 8), (128, 6144 // 8), 128,
               6144, v1_along_n, group_size=32)
    for name, k, qweight, qzeros, groups, n, packing, gated in [  # the q - z path (BIASED=False; B + q: default)
            ("awq down", 14336, (14336, 4096 // 8), (112, 4096 // 8), 112, 4096, awq, False),
            ("awq gate_up + silu", 4096, (4096, 2 * 14336 // 8), (32, 2 * 14336 // 8), 32, 2 * 14336, awq, True),
            ("gptq qkv", 4096, (512, 6144), (32, 6144 // 8), 32, 6144, gptq4, False)]:
        CASE[0] = f"int4 stream q - z {name}, 1 rows"
        int_decode.linear_int_stream(empty(1, k), empty(*qweight, dtype=torch.int32), empty(*qzeros, dtype=torch.int32),
                                     empty(groups, n, dtype=torch.float16), 128, packing, None, gated, False, False,
                                     "tf32", {"BIASED": False})
    for name, rows, k, qweight, qzeros, groups, packing, group, gated, config in [
            ("awq g32 gated", 5, 192, (192, 12), (6, 12), 6, awq, 32, True,
             dict(BLOCK_N=64, BLOCK_K=128, num_stages=3)),
            ("gptq g32 gated", 5, 192, (24, 96), (6, 12), 6, gptq4, 32, True, None),
            ("gemm awq g128", 130, 384, (384, 12), (3, 12), 3, awq, 128, True,
             dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=256, GROUP_M=1, UNPACK_ONCE=False))]:
        CASE[0] = f"int float32 x {name}"
        linear_int.linear_int_triton(empty(rows, k, dtype=torch.float32), empty(*qweight, dtype=torch.int32),
                                     empty(*qzeros, dtype=torch.int32), empty(groups, 96, dtype=torch.float32),
                                     None, group, packing, gated=gated, config=config)


def compile_int_gemm() -> None:
    """The int linear's GEMM tiles (gemm_config, 17 rows and more) for Llama-3-8B's and 70B's layers in each layout
    family, and the kernel that dequantizes W for cuBLAS."""
    awq, gptq4, gptq8 = linear_int.AWQ_GEMM, linear_int.gptq_v1(4), linear_int.gptq_v1(8)
    for rows in (32, 64, 256, 2048):  # each row tile of GEMM_ROW_TILES, and 2048 (the benchmark's largest)
        int_linear(f"int4 gemm awq qkv, {rows} rows", rows, 4096, (4096, 6144 // 8), (32, 6144 // 8), 32, 6144,
                   awq, gemm=True)
        int_linear(f"int4 gemm gptq act-order gate_up + silu, {rows} rows", rows, 4096, (512, 2 * 14336),
                   (32, 2 * 14336 // 8), 32, 2 * 14336, gptq4, act_order=True, gated=True)
        int_linear(f"int4 gemm gptq down, {rows} rows", rows, 14336, (14336 // 8, 4096), (112, 4096 // 8), 112,
                   4096, gptq4, gemm=True)
    int_linear("int4 gemm awq qkv, 200 rows", 200, 4096, (4096, 6144 // 8), (32, 6144 // 8), 32, 6144, awq)
    # the PAIRS path at its own tiles: 8B's AWQ linears (GPTQ held along N is the same layout, its zero offset aside)
    for rows in (128, 256, 2048):
        int_linear(f"int4 gemm pairs awq qkv, {rows} rows", rows, 4096, (4096, 6144 // 8), (32, 6144 // 8), 32,
                   6144, awq, pairs=True)
        int_linear(f"int4 gemm pairs awq gate_up + silu, {rows} rows", rows, 4096, (4096, 2 * 14336 // 8),
                   (32, 2 * 14336 // 8), 32, 2 * 14336, awq, gated=True, pairs=True)
        int_linear(f"int4 gemm pairs awq down, {rows} rows", rows, 14336, (14336, 4096 // 8), (112, 4096 // 8), 112,
                   4096, awq, pairs=True)
    int_linear("int4 gemm awq 70b gate_up + silu, 2048 rows", 2048, 8192, (8192, 2 * 28672 // 8),
               (64, 2 * 28672 // 8), 64, 2 * 28672, awq, gated=True)
    int_linear("int8 gemm gptq group 32 o, 128 rows", 128, 4096, (1024, 4096), (128, 4096 // 4), 128, 4096, gptq8,
               group_size=32)
    int_linear("int4 gemm gguf q4_1 (mins) qkv, 64 rows", 64, 4096, (512, 6144), None, 128, 6144,
               linear_int.offset_binary(4), group_size=32, mins=True, gemm=True)
    for name, qweight, qzeros, groups, n, packing, act_order, mins in [
            ("awq qkv", (4096, 6144 // 8), (32, 6144 // 8), 32, 6144, awq, False, False),
            ("gptq act-order gate_up", (512, 2 * 14336), (32, 2 * 14336 // 8), 32, 2 * 14336, gptq4, True, False),
            ("gguf q4_1 qkv", (512, 6144), None, 128, 6144, linear_int.offset_binary(4), False, True)]:
        CASE[0] = f"int4 dequantize {name}"
        linear_int.dequantize_triton(empty(*qweight, dtype=torch.int32),
                                     None if mins else empty(*qzeros, dtype=torch.int32),
                                     empty(groups, n, dtype=torch.float16),
                                     empty(4096, dtype=torch.int32) if act_order else None, 32 if mins else 128,
                                     packing, torch.bfloat16, mins=empty(groups, n, dtype=torch.float16) if mins
                                     else None)


LORA_8B = {"qkv": (4096, (4096, 1024, 1024)), "gate_up": (4096, (14336, 14336)), "down": (14336, (4096,))}


def lora_layer(name, rows, layer, rank, dtype=torch.bfloat16, slots=8, is_sorted=False, expand_config=None):
    """Shrink then expand of one Llama-3-8B projection's LoRA (`slots` adapters stacked; is_sorted: tiling the rows
    sorted by slot, as the engine runs them; expand_config over the expand's default)."""
    in_features, widths = LORA_8B[layer]
    starts = tuple(sum(widths[:i]) for i in range(len(widths)))
    order = int32(rows) if is_sorted else None
    CASE[0] = f"lora shrink {name}"
    lora.lora_shrink_triton(empty(rows, in_features, dtype=dtype),
                            empty(slots, len(widths), rank, in_features, dtype=dtype), int32(rows), order=order)
    CASE[0] = f"lora expand {name}"
    lora.lora_expand_triton(empty(rows, sum(widths), dtype=dtype), empty(len(widths), rows, rank,
                                                                         dtype=torch.float32),
                            empty(slots, sum(widths), rank, dtype=dtype), int32(rows), starts,
                            config=expand_config, order=order)


def compile_lora() -> None:
    """The LoRA shrink (split-K atomics at decode sizes) and expand at Llama-3-8B's projections, ranks 16 and 64,
    decode (16- and 32-row tiles) and prefill (32- and 64-row tiles) batches; float32 and the largest rank; the
    tiles of rows sorted by slot (a decode batch of 256, every projection at rank 16, qkv at 64 and 128)."""
    for rank in (16, 32, 64):
        for layer in LORA_8B:
            for rows in (1, 256, 2048):
                lora_layer(f"{layer} r{rank}, {rows} rows", rows, layer, rank)
    lora_layer("qkv r16, 80 rows", 80, "qkv", 16)  # the 64-row case's variant: batch sizes share it
    lora_layer("qkv r16, 64 rows", 64, "qkv", 16)
    lora_layer("down r16, 8192 rows", 8192, "down", 16)
    for rows in (1, 256, 8192):
        lora_layer(f"qkv r128, {rows} rows", rows, "qkv", 128)
    lora_layer("qkv r16 fp32, 4 rows", 4, "qkv", 16, dtype=torch.float32)
    lora_layer("gate_up r16 fp16, 512 rows", 512, "gate_up", 16, dtype=torch.float16)
    for layer in LORA_8B:
        lora_layer(f"{layer} r16, 256 rows sorted", 256, layer, 16, is_sorted=True)
    for rank in (64, 128):
        lora_layer(f"qkv r{rank}, 256 rows sorted", 256, "qkv", rank, is_sorted=True)
    for layer in ("gate_up", "down"):  # out's tile loaded before the slot walk (OUT_FIRST, off by default)
        lora_layer(f"{layer} r16, 8192 rows out first", 8192, layer, 16, expand_config={"OUT_FIRST": True})


def main() -> int:
    try:
        decode("decode llama3-8b bf16", 8, 32, 8, 128, torch.bfloat16, 1)
        decode("decode llama3-8b bf16 split", 8, 32, 8, 128, torch.bfloat16, 4, fused_merge=False)  # + merge kernel
        # The fused merge (the default; unrolled over the splits) at batch 1, and for 8 query heads a KV head.
        decode("decode llama3-8b bf16 fused", 1, 32, 8, 128, torch.bfloat16, 32)
        decode("decode llama3-8b bf16 fused 66", 1, 32, 8, 128, torch.bfloat16, 66)
        decode("decode gqa-8 fp16 d64 fused", 1, 64, 8, 64, torch.float16, 5)
        decode("decode mha fp16 d64", 4, 8, 8, 64, torch.float16, 1)
        decode("decode fp32", 4, 8, 2, 128, torch.float32, 1)
        prefill("prefill llama3-8b bf16", 4096, 32, 8, 128, torch.bfloat16)
        # The same tiles for another batch shape (16 sequences: multiples of 16 in the scalar arguments).
        prefill("prefill llama3-8b bf16 16 seqs", 4096, 32, 8, 128, torch.bfloat16, max_query_len=4096, num_seqs=16)
        prefill("prefill decode rows bf16", 8, 32, 8, 128, torch.bfloat16, max_query_len=1)
        prefill("prefill d256 bf16", 4096, 16, 8, 256, torch.bfloat16)
        prefill("prefill fp32", 512, 8, 2, 128, torch.float32)
        decode("decode mistral window bf16 fused", 1, 32, 8, 128, torch.bfloat16, 16, window=4096)
        decode("decode mistral window bf16", 64, 32, 8, 128, torch.bfloat16, 1, window=4096)
        prefill("prefill mistral window bf16", 4096, 32, 8, 128, torch.bfloat16, window=4096)
        prefill("prefill window fp32", 512, 8, 2, 128, torch.float32, window=100)
        fused_moe("moe mixtral bf16, 1 token", 1, 4096, 14336, 8, 2)  # 16-row tiles: gate/up + silu, then down
        fused_moe("moe mixtral bf16, 4096 tokens", 4096, 4096, 14336, 8, 2)  # 64-row tiles
        fused_moe("moe qwen3-30b-a3b bf16, 8 tokens", 8, 2048, 768, 128, 8)
        # The one-program alignment at its limit (MAX_ALIGN_ONEHOT pairs x experts): 16 x 8 of 128, 1024 x 2 of 8.
        fused_moe("moe qwen3-30b-a3b bf16, 16 tokens", 16, 2048, 768, 128, 8)
        fused_moe("moe mixtral bf16, 1024 tokens", 1024, 4096, 14336, 8, 2)
        # past it, the chunked alignment (three kernels): decode steps of 256 and 200, a prefill of 4096 tokens
        fused_moe("moe qwen3-30b-a3b bf16, 256 tokens", 256, 2048, 768, 128, 8)
        fused_moe("moe qwen3-30b-a3b bf16, 200 tokens", 200, 2048, 768, 128, 8)
        fused_moe("moe qwen3-30b-a3b bf16, 4096 tokens", 4096, 2048, 768, 128, 8)
        for tokens in (1, 256):  # the router: softmax, top-k and renormalization in one kernel
            CASE[0] = f"moe router qwen3-30b-a3b, {tokens} tokens"
            moe.topk_route_triton(empty(tokens, 128), 8, True, torch.bfloat16)
        CASE[0] = "moe router deepseek-v2 group-limited, 160 experts"
        moe.topk_route_triton(empty(4, 160, dtype=torch.float32), 6, False, scale=16.0, groups=(8, 3))
        CASE[0] = "moe router deepseek-v2-lite, 64 experts"
        moe.topk_route_triton(empty(4, 64, dtype=torch.float32), 6, False, scale=1.0)
        fused_moe("moe fp32", 4, 1024, 512, 4, 2, dtype=torch.float32)
        CASE[0] = "rms_norm+residual 4096"
        x = empty(4, 4096)
        rms_norm.rms_norm_triton(x, empty(4096), 1e-5, x)
        CASE[0] = "rotary 32/8 x 128"
        rotary.rotary_embedding_triton(torch.zeros(4, dtype=torch.int64), empty(4, 4096), empty(4, 1024),
                                       empty(64, 128, dtype=torch.float32), 128)
        CASE[0] = "rotary + kv write 32/8 x 128"
        rotary.rotary_embedding_triton(torch.zeros(4, dtype=torch.int64), empty(4, 4096), empty(4, 1024),
                                       empty(64, 128, dtype=torch.float32), 128,
                                       (empty(4, 1024), empty(8, 16, 8, 128), empty(8, 16, 8, 128),
                                        torch.zeros(4, dtype=torch.int64)))
        CASE[0] = "rotary + kv write + head norms, qwen3 32/4 x 128"
        rotary.rotary_embedding_triton(torch.zeros(4, dtype=torch.int64), empty(4, 4096), empty(4, 512),
                                       empty(64, 128, dtype=torch.float32), 128,
                                       (empty(4, 512), empty(8, 16, 4, 128), empty(8, 16, 4, 128),
                                        torch.zeros(4, dtype=torch.int64)), (empty(128), empty(128), 1e-6))
        CASE[0] = "silu_and_mul 14336"
        activation.silu_and_mul_triton(empty(4, 2 * 14336))
        CASE[0] = "linear fp32 gate_up + silu, 4 rows"  # tiles shrink to fit shared memory
        linear.linear_triton(empty(4, 1024, dtype=torch.float32), empty(2 * 2048, 1024, dtype=torch.float32),
                             gated=True)
        for rows in (1, 16):  # decode batches: x padded to 16 rows either way
            CASE[0] = f"linear qkv, {rows} rows"
            linear.linear_triton(empty(rows, 4096), empty(6144, 4096))
            CASE[0] = f"linear gate_up + silu, {rows} rows"
            linear.linear_triton(empty(rows, 4096), empty(2 * 14336, 4096), gated=True)
            CASE[0] = f"linear down, {rows} rows"
            linear.linear_triton(empty(rows, 14336), empty(4096, 14336))
        for rows in (1, 16):  # the int4 decode kernel: AWQ qkv, GPTQ act-order gate_up + silu (8B shapes)
            CASE[0] = f"int4 linear awq qkv, {rows} rows"
            linear_int.linear_int_triton(empty(rows, 4096), empty(4096, 6144 // 8, dtype=torch.int32),
                                         empty(32, 6144 // 8, dtype=torch.int32), empty(32, 6144, dtype=torch.float16),
                                         None, 128, linear_int.AWQ_GEMM)
            CASE[0] = f"int4 linear gptq act-order gate_up + silu, {rows} rows"
            linear_int.linear_int_triton(empty(rows, 4096), empty(512, 2 * 14336, dtype=torch.int32),
                                         empty(32, 2 * 14336 // 8, dtype=torch.int32),
                                         empty(32, 2 * 14336, dtype=torch.float16), empty(4096, dtype=torch.int32),
                                         128, linear_int.gptq_v1(4), gated=True)
            CASE[0] = f"int4 linear gguf q4_1 (mins) qkv, {rows} rows"
            linear_int.linear_int_triton(empty(rows, 4096), empty(512, 6144, dtype=torch.int32), None,
                                         empty(128, 6144, dtype=torch.float16), None, 32,
                                         linear_int.offset_binary(4), mins=empty(128, 6144, dtype=torch.float16))
            CASE[0] = f"int8 linear gguf q6_k (groups of 16, float32 scales) down, {rows} rows"
            linear_int.linear_int_triton(empty(rows, 14336), empty(14336 // 4, 4096, dtype=torch.int32),
                                         empty(896, 4096 // 4, dtype=torch.int32),
                                         empty(896, 4096, dtype=torch.float32), None, 16, linear_int.offset_binary(8))
        compile_int_stream()
        compile_int_gemm()
        CASE[0] = "sample 128256"
        rows = [torch.zeros(4) for _ in range(5)]
        sampling.sample_triton(empty(4, 128256, dtype=torch.float32), *rows, torch.zeros(4, dtype=torch.int64))
        CASE[0] = "sample 128256, top-82 subsets"
        sampling.sample_triton(empty(4, 128256, dtype=torch.float32), *rows, torch.zeros(4, dtype=torch.int64),
                               (empty(4, 82, dtype=torch.float32), torch.zeros(4, 82, dtype=torch.int64)))
        CASE[0] = "rejection sample 128256, k 4"
        rejection_sampler.rejection_sample_triton(empty(4, 5, 128256, dtype=torch.float32),
                                                  torch.zeros(4, 4, dtype=torch.int64),
                                                  torch.zeros(4, dtype=torch.int64),
                                                  torch.zeros(4, 5, dtype=torch.int64))
        CASE[0] = "rejection sample 128256, k 2"  # (a step whose rows have at most 2 drafts: the same variant)
        rejection_sampler.rejection_sample_triton(empty(4, 3, 128256, dtype=torch.float32),
                                                  torch.zeros(4, 2, dtype=torch.int64),
                                                  torch.zeros(4, dtype=torch.int64),
                                                  torch.zeros(4, 3, dtype=torch.int64))
        CASE[0] = "rejection sample 128256, k 1"
        rejection_sampler.rejection_sample_triton(empty(1, 2, 128256, dtype=torch.float32),
                                                  torch.zeros(1, 1, dtype=torch.int64),
                                                  torch.zeros(1, dtype=torch.int64),
                                                  torch.zeros(1, 2, dtype=torch.int64))
        CASE[0] = "rejection sample 128256, k 4, draft probabilities"
        rejection_sampler.rejection_sample_triton(empty(4, 5, 128256, dtype=torch.float32),
                                                  torch.zeros(4, 4, dtype=torch.int64),
                                                  torch.zeros(4, dtype=torch.int64),
                                                  torch.zeros(4, 5, dtype=torch.int64),
                                                  empty(4, 4, 128256, dtype=torch.float32))
        CASE[0] = "n-gram lookup, k 4, max_n 3"
        ngram.ngram_lookup_triton(int32(32, 8193), torch.zeros(32, dtype=torch.int64), 4, 1, 3)
        CASE[0] = "n-gram lookup, k 4, max_n 3, another width"
        ngram.ngram_lookup_triton(int32(1, 1001), torch.zeros(1, dtype=torch.int64), 4, 1, 3)
        CASE[0] = "fix-up of a step's inputs"
        longs = [torch.zeros(512, dtype=torch.int64) for _ in range(3)]
        run_ahead.fix_up_inputs_triton(*longs, int32(65), int32(65, 512), 16, torch.zeros(64, dtype=torch.int64),
                                       torch.zeros(64, dtype=torch.int64), torch.zeros(600, dtype=torch.int64),
                                       (16, 64, 160, 64), torch.zeros(64, dtype=torch.int64))
        CASE[0] = "fix-up of a step's inputs, other counts"
        run_ahead.fix_up_inputs_triton(*longs, int32(65), int32(65, 512), 16, torch.zeros(64, dtype=torch.int64),
                                       torch.zeros(64, dtype=torch.int64), torch.zeros(600, dtype=torch.int64),
                                       (1, 4, 5, 1), torch.zeros(65, dtype=torch.int64)[1:])
        CASE[0] = "fix-up of a step's inputs, the start-up's tables"  # (kernels/run_ahead.py warm_up_run_ahead)
        run_ahead.fix_up_inputs_triton(*longs, int32(2), int32(2, 2), 4, torch.zeros(64, dtype=torch.int64),
                                       torch.zeros(64, dtype=torch.int64), torch.zeros(600, dtype=torch.int64),
                                       (1, 1, 1, 1), torch.zeros(64, dtype=torch.int64))
        CASE[0] = "append to the token histories, 5 a row"
        run_ahead.append_tokens_triton(int32(256, 8193), torch.zeros(256, dtype=torch.int64),
                                       torch.zeros(32, dtype=torch.int64), torch.zeros(32, 5, dtype=torch.int64),
                                       torch.zeros(32, dtype=torch.int64))
        CASE[0] = "append to the token histories, the start-up's dummy"  # (warm_up_run_ahead's arguments)
        index = torch.zeros(8, dtype=torch.int64)
        run_ahead.append_tokens_triton(int32(2, 9), index[:2], index[:1], torch.full((1, 2), -1, dtype=torch.int64),
                                       index[:1])
        CASE[0] = "append to the token histories, 3 a row"
        index = torch.zeros(4, dtype=torch.int64)  # (slots a view 8 bytes in: not 16-byte aligned)
        run_ahead.append_tokens_triton(int32(256, 8193), torch.zeros(256, dtype=torch.int64), index[1:2],
                                       torch.zeros(1, 3, dtype=torch.int64), index[:1])
        CASE[0] = "write_kv_cache 8 x 128"
        kv_cache.write_kv_cache_triton(empty(4, 8, 128), empty(4, 8, 128), empty(8, 16, 8, 128),
                                       empty(8, 16, 8, 128), torch.zeros(4, dtype=torch.int64))
        compile_fp8()
        compile_moe_quant()
        compile_mla()
        compile_lora()
    except Exception as exc:  # noqa: BLE001
        print(f"compile failed in {CASE[0]}: {type(exc).__name__}: {exc} {exc.__cause__!r}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
