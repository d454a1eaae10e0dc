"""The kernels compile for sm_90 with the real Triton compiler, without spilling registers.

The interpreter runs kernels as Python and never lowers them, so it cannot catch what only the compiler rejects
(a loop-carried value changing type, an unsupported layout) nor how a kernel fits the hardware. This test
compiles every kernel for an H100/H200 in a subprocess (compile_sm90.py, a stand-in driver, nothing launched).
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).with_name("compile_sm90.py")
SHARED_MEMORY_PER_BLOCK = 227 * 1024  # sm_90's opt-in limit
# The 256 x 64 prefill tile (16 warps) spills 72 bytes per thread and is still the fastest on the H200
# (`python -m benchmarks.kernels --tune`); more than this would be a real regression.
MAX_SPILL_BYTES = 128
# Compiling every case takes 6 minutes on a quiet 2-core machine, past 10 beside other work (the int stream
# kernel's cases added ~3): the subprocess and this module get 20 / 25.
# slow: compiling every kernel for sm_90 takes over 3 minutes on 2 cores (make test-slow and CI run it)
pytestmark = [pytest.mark.timeout(1500), pytest.mark.slow]


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9's default, stated to silence its warning
    result = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=1200)
    if result.returncode == 3:
        pytest.skip(f"this triton does not take the stand-in sm_90 driver: {result.stdout.strip()}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def test_every_kernel_compiles_for_sm90(compiled):
    kernels = {row["kernel"] for row in compiled}
    assert kernels == {"_align_count_kernel", "_align_kernel", "_align_scan_kernel", "_align_scatter_kernel",
                       "_append_kernel", "_decode_kernel", "_decode_merge_kernel", "_fix_up_kernel",
                       "_fp8_linear_kernel", "_fp8_linear_swap_kernel", "_int_decode_kernel", "_int_dequantize_kernel",
                       "_int_linear_kernel", "_linear_kernel", "_lora_expand_kernel", "_lora_shrink_kernel",
                       "_mla_decode_kernel", "_mla_merge_kernel", "_mla_prefill_kernel", "_moe_gemm_kernel",
                       "_moe_int_stream_kernel", "_moe_quant_gemm_kernel", "_ngram_kernel", "_prefill_kernel",
                       "_quantize_per_token_kernel",
                       "_rejection_kernel", "_rms_norm_kernel", "_rotary_kernel", "_sample_kernel",
                       "_silu_and_mul_kernel", "_topk_route_kernel", "_silu_and_mul_quant_kernel",
                       "_write_kv_cache_kernel", "_write_latent_kernel"}


def test_every_kernel_waits_for_the_previous_one_before_touching_memory(compiled):
    """On Hopper every kernel is launched with programmatic dependent launch (kernels/_triton.py `pdl_options`):
    it may start while the kernel before it still runs, so its first global load or store must come after
    `griddepcontrol.wait` (the stand-in compiles them as a Hopper GPU launches them)."""
    late = [(row["kernel"], row["case"]) for row in compiled if not row["waits_before_memory"]]
    assert not late, late


def test_batch_shape_compiles_no_new_variant(compiled):
    """A step's number of sequences and query blocks must not pick a new compiled variant (a compile of seconds
    while requests wait): two batch shapes, one kernel."""
    by_case = {row["case"]: row["hash"] for row in compiled}
    assert by_case["prefill llama3-8b bf16 16 seqs"] == by_case["prefill llama3-8b bf16"]
    assert by_case["mla prefill v2-lite 16 heads 16 seqs"] == by_case["mla prefill v2-lite 16 heads"]
    # the int linear: 1 and 16 rows share the decode tiles, 200 and 256 rows the GEMM tiles (gemm_config's)
    assert by_case["int4 linear awq qkv, 1 rows"] == by_case["int4 linear awq qkv, 16 rows"]
    assert by_case["int4 gemm awq qkv, 200 rows"] == by_case["int4 gemm awq qkv, 256 rows"]
    # a step launched ahead: its history width, its fix-up's counts, its rows' widths
    assert by_case["n-gram lookup, k 4, max_n 3"] == by_case["n-gram lookup, k 4, max_n 3, another width"]
    assert by_case["fix-up of a step's inputs"] == by_case["fix-up of a step's inputs, other counts"]
    # what start-up compiles is what a step launches: its tables' stride and block size (4 and 2 at start-up)
    assert by_case["fix-up of a step's inputs"] == by_case["fix-up of a step's inputs, the start-up's tables"]
    # a verify step's most drafts a row (K) varies step to step: one rejection sampling variant for all
    assert (by_case["rejection sample 128256, k 4"] == by_case["rejection sample 128256, k 2"]
            == by_case["rejection sample 128256, k 1"])
    assert (by_case["append to the token histories, 5 a row"] == by_case["append to the token histories, 3 a row"]
            == by_case["append to the token histories, the start-up's dummy"])
    # MoE: the router for 1 and 256 tokens, the chunked alignment for decode steps of 256 and 200
    assert by_case["moe router qwen3-30b-a3b, 1 tokens"] == by_case["moe router qwen3-30b-a3b, 256 tokens"]
    for kernel in ("_align_count_kernel", "_align_scan_kernel", "_align_scatter_kernel"):
        hashes = {row["hash"] for row in compiled if row["kernel"] == kernel
                  and row["case"] in ("moe qwen3-30b-a3b bf16, 256 tokens", "moe qwen3-30b-a3b bf16, 200 tokens")}
        assert len(hashes) == 1, (kernel, hashes)
    for kernel in ("shrink", "expand"):  # LoRA: 64 and 80 rows share their tiles (and shrink's K split)
        assert by_case[f"lora {kernel} qkv r16, 64 rows"] == by_case[f"lora {kernel} qkv r16, 80 rows"]


def test_lora_shrink_pipelines_its_k_loop(compiled):
    """Shrink's K loop runs inside a walk over the tile's slots; its loads are pipelined (multi-buffered in shared
    memory) only while the compiler can see each K block's start is a multiple of BLOCK_K: without that it fell back
    to plain loads, one round trip to memory per K step. 32 rows x 128 of x and 16 x 128 of A, two buffers or more."""
    row = next(row for row in compiled if row["case"] == "lora shrink qkv r16, 2048 rows")
    assert row["shared_bytes"] >= 2 * (32 + 16) * 128 * 2, row


def test_no_register_spills_and_shared_memory_fits(compiled):
    for row in compiled:
        assert row["shared_bytes"] <= SHARED_MEMORY_PER_BLOCK, row
        if "spill_bytes" in row:  # cuobjdump ships with triton's NVIDIA backend
            assert row["spill_bytes"] <= (MAX_SPILL_BYTES if row["num_warps"] == 16 else 0), row


def test_fp8_decode_kernel_multiplies_e4m3_on_hopper_tensor_cores(compiled):
    """The swap kernel's point: x's few rows as the MMA's narrow side, so Triton emits FP8 wgmma (m64 n16) with
    both operands e4m3. The 16-row tiles of _fp8_linear_kernel convert the FP8 weights to f16 for Ampere's mma.sync
    instead, which held it below the bf16 kernel's speed on the H200 (benchmarks/results/h200-kernels-fp8.json)."""
    swap = [row for row in compiled if row["kernel"] == "_fp8_linear_swap_kernel"]
    assert swap and all(any(m.startswith("wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3") for m in row["mma"])
                        for row in swap), [(row["case"], row["mma"]) for row in swap]


def test_fp8_experts_multiply_e4m3_on_hopper_tensor_cores(compiled):
    """W8A8 experts (kernels/moe_quant.py): the FP8 MoE GEMMs' 64-row tiles (prefill, large batches) are FP8 wgmma
    with both operands e4m3; their 16-row tiles take mma.sync on f16 (Triton converts both operands), as the FP8
    linear's 16-row tiles do."""
    rows = [row for row in compiled if row["kernel"] == "_moe_quant_gemm_kernel" and "moe fp8" in row["case"]]
    wide = [row for row in rows if row["BLOCK_M"] == 64]
    assert wide and all(any(m.startswith("wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3") for m in row["mma"])
                        for row in wide), [(row["case"], row["mma"]) for row in rows]


def test_fp8_linear_of_float32_x_multiplies_in_float32(compiled):
    """float32 x takes the precise dot (FP8 values multiplied and summed in float32, no tensor-core MMA: Hopper's
    FP8 MMA accumulates imprecisely, and the float32 GPU oracle test failed with it); bf16 x the FP8 MMA."""
    by_case = {row["case"]: row for row in compiled}
    assert by_case["fp8 linear fp32 x, 4 rows"]["mma"] == []
    assert by_case["fp8 linear qkv, 1 rows"]["mma"]


def test_int_stream_kernel_reads_words_wide_and_unpacks_them_cheaply(compiled):
    """What made the first int decode kernel 0.4-3% of copy bandwidth, absent from the streaming one (kernels/
    int_decode.py's docstring): packed words copied 16 bytes a thread (cp.async.cg 16; packed along K, whose columns
    are a word each, x's gathered columns aside), no int-to-float conversion, no local memory, bf16 tensor-core
    MMAs, and a short K loop a weight value: the q - z path (one lop3 and one FMA a value; GGUF's mins, int8 and
    BIASED=False) 4.5 SASS instructions a value for AWQ's layout and 5.5 along K (x's columns gathered; measured 4.0
    and 5.0 with Triton 3.6, 3.9 and 5.1 with 3.9); the B + q unpacking in 16-bit pairs (the default for 4-bit fields
    with zero points: a prmt, a shift, a lop3 and a subtraction for two values' pair of registers) 3.0 and 4.0 (2.8
    and 3.5 with Triton 3.9; along N in K tiles of 64 / 32, a tile's scales over fewer values, 4.0 / 5.5: measured
    3.7 / 5.4 with 3.9); several groups a K tile (ROW_SCALES: GGUF's 32 and 16, GPTQ's 32), where each word row's
    scales and zeros or mins are loaded and applied before the dots, 9. At the H200's ~30 T thread-
    instructions a second, 3.0 allow ~10 T values (5 TB/s of int4) from issue alone, 4.5 ~6.7 T (3.4 TB/s)."""
    stream = [row for row in compiled if row["kernel"] == "_int_decode_kernel"]
    assert len(stream) >= 15, [row["case"] for row in stream]
    for row in stream:
        assert row["cp_async_16"] >= 1 and row["int_to_float"] == 0 and row["local_memory"] == 0, row
        if "float32 x" in row["case"]:  # the GPU oracle tests' x: a float32 dot of FMAs, no MMA, no speed target
            assert row["mma"] == [], row
            continue
        assert row["mma"] == ["mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"], row
        if "loop_instructions" in row:
            values = row["BLOCK_K"] * row["BLOCK_N"] * (2 if row["GATED"] else 1) / (32 * row["num_warps"])
            along_k = "gptq" in row["case"] or "gguf" in row["case"]
            if row.get("ROW_SCALES"):  # several groups a K tile: each word row's scales (zeros, mins) loaded and
                budget = 9.0  # applied before the dots (measured 3.0-8.6 with Triton 3.6: Q6_K's 16s the most)
            elif row["BIASED"]:  # the B + q unpacking (the default for 4-bit fields with zero points); K tiles of
                # 32 (groups of 32 along N) pay a tile's scales and zero points over a quarter of the values
                budget = 4.0 if along_k else {128: 3.0, 64: 4.0, 32: 5.5}[row["BLOCK_K"]]
            else:
                budget = 5.5 if along_k or "int8" in row["case"] else 4.5
            assert row["loop_instructions"] <= budget * values, (row["case"], row["loop_instructions"] / values)


def test_int_gemm_pairs_unpack_words_into_wgmma_tiles_cheaply(compiled):
    """The GEMM tiles' PAIRS path (kernels/linear_int.py `pair_tiles`, 4-bit AWQ order): Hopper wgmma on bf16, no
    int-to-float conversion, and a K loop of at most 2.1 warp instructions a thousand multiply-adds at its own tiles
    (measured 1.83-2.02 here with Triton 3.9), where the float path of the same tiles' kernel took 2.7-5.4 at 256
    rows and more (each value shifted, converted, scaled and rounded, then stored 2 bytes at a time)."""
    pairs = [row for row in compiled if row["case"].startswith("int4 gemm pairs")]
    assert len(pairs) == 9, [row["case"] for row in pairs]
    for row in pairs:
        assert row["int_to_float"] == 0 and row["local_memory"] == 0, row
        assert all(m.startswith("wgmma.mma_async.sync.aligned.") and m.endswith(".f32.bf16.bf16")
                   for m in row["mma"]) and row["mma"], row
        if "loop_instructions" in row:
            products = row["BLOCK_M"] * row["BLOCK_N"] * row["BLOCK_K"] * (2 if row["GATED"] else 1)
            assert row["loop_instructions"] * row["num_warps"] <= 2.1e-3 * products, (row["case"], row)


def test_first_int_kernel_took_what_the_h200_could_not_run(compiled):
    """The float32-x launches of test_kernel_linear_int.py (its GPU failures: 'out of resources: shared memory'
    at 245-1,441 KB against 227) now fit, as do the old kernel's 16-bit decode and GEMM tiles."""
    rows = [row for row in compiled if row["kernel"] == "_int_linear_kernel"]
    assert any(row["case"].startswith("int float32 x") for row in rows)
    for row in rows:
        assert row["shared_bytes"] <= SHARED_MEMORY_PER_BLOCK, row
