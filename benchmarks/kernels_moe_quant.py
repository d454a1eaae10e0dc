"""The fused MoE over quantized experts (kernels/moe_quant.py), for `python -m benchmarks.kernels --only moe-quant`.

A Mixtral-8x7B layer's experts (benchmarks/kernels_moe.py's GPU_MOE) as AWQ int4 (group 128), FP8 with a scale per
row (quantization="fp8") and FP8 in 128 x 128 blocks (an FP8 checkpoint; both W8A8), each against the bf16 fused
kernel on the same routing ("bf16 triton", the baseline) and the torch reference that dequantizes the chosen
experts; AWQ also by kernels/moe_quant.py's GEMM where the decode-sized stream (kernels/moe_int_decode.py) runs
("triton gemm, no stream"). Decode-sized batches are scored in the quantized bytes of the experts the batch routes
to (so the bf16 row's fraction is of those bytes too: compare its time), larger ones in FLOPs.
"""

import torch

from benchmarks.kernels_moe import BYTES_UP_TO_ROWS, moe_inputs
from kernels import moe_int_decode
from kernels.fp8 import quantize_weight, quantize_weight_blocks
from kernels.linear_int import AWQ_GEMM
from kernels.moe import fused_moe_triton
from kernels.moe_quant import Fp8Experts, IntExperts, fused_moe_quant_ref, fused_moe_quant_triton

FORMATS = ("awq g128", "fp8 per-row", "fp8 128x128")


def random_awq(w: torch.Tensor, group: int = 128) -> IntExperts:
    """Random packed int4 experts of w's shape [E, N, K] (the values do not matter for speed; the check compares
    the kernel with the reference on the same integers)."""
    e, n, k = w.shape
    gen = torch.Generator(device=w.device).manual_seed(1)
    qweight = torch.randint(-2**31, 2**31 - 1, (e, k, n // 8), generator=gen, device=w.device, dtype=torch.int32)
    qzeros = torch.full((e, k // group, n // 8), 0x77777777, dtype=torch.int32, device=w.device)
    scales = torch.full((e, k // group, n), w.std().item() / 4.6, dtype=torch.float16, device=w.device)
    return IntExperts(qweight, qzeros, scales, None, group, AWQ_GEMM)


def fp8(w: torch.Tensor, block_size=None, parts: int = 1) -> Fp8Experts:
    weights, scales = [], []
    for expert in w:
        pieces = [quantize_weight(p) if block_size is None else quantize_weight_blocks(p, block_size)
                  for p in expert.chunk(parts)]
        weights.append(torch.cat([p[0] for p in pieces]))
        scales.append(torch.cat([p[1] for p in pieces]))
    return Fp8Experts(torch.stack(weights), torch.stack(scales), block_size, parts)


def quantized(fmt: str, w13: torch.Tensor, w2: torch.Tensor):
    if fmt == "awq g128":
        return random_awq(w13), random_awq(w2)
    block = (128, 128) if fmt == "fp8 128x128" else None
    return fp8(w13, block, 2), fp8(w2, block)


def expert_bytes(experts) -> int:
    return sum(t.numel() * t.element_size() for t in experts.tensors()) // experts.num_experts


def _without_stream(args):
    """kernels/moe_quant.py's int GEMM where kernels/moe_int_decode.py's stream would run (16-row tiles)."""
    moe_int_decode.STREAM = False
    try:
        return fused_moe_quant_triton(*args)
    finally:
        moe_int_decode.STREAM = True


def bench_moe_quant(runner, cfg: dict, moe_cfg: dict):
    for fmt in FORMATS:
        for rows in moe_cfg["rows"]:

            def build(rows=rows, fmt=fmt):
                x, w13, w2, weights, ids = moe_inputs(rows, moe_cfg, cfg["dtype"], runner.device)
                q13, q2 = quantized(fmt, w13, w2)
                args = (x, q13, q2, weights, ids)
                impls = {}
                if runner.use_triton:
                    impls["bf16 triton"] = lambda: fused_moe_triton(x, w13, w2, weights, ids)
                    impls["triton"] = lambda: fused_moe_quant_triton(*args)
                    if fmt == "awq g128" and runner.device.type == "cuda":  # the stream (above) against the GEMM
                        impls["triton gemm, no stream"] = lambda: _without_stream(args)

                def ref():
                    return fused_moe_quant_ref(*args)

                ref.eager = True  # picks experts by data: no CUDA graph captures it
                impls["torch ref"] = ref
                if rows <= BYTES_UP_TO_ROWS:
                    work = dict(bytes=int(ids.unique().numel()) * (expert_bytes(q13) + expert_bytes(q2)))
                else:
                    work = dict(flops=2 * rows * moe_cfg["top_k"] * 3 * moe_cfg["hidden"] * moe_cfg["inter"])

                def check():
                    out, expected = fused_moe_quant_triton(*args).float(), fused_moe_quant_ref(*args).float()
                    if fmt.startswith("fp8"):  # W8A8: an h that rounds otherwise in bf16 may land on the next
                        # e4m3 value for down (tests/kernels/test_kernel_moe_quant.py's assert_fp8_moe_close)
                        far = ~torch.isclose(out, expected, atol=3e-2, rtol=3e-2)
                        assert far.float().mean() < 0.01, f"{far.float().mean():.2%} of the outputs differ"
                    else:
                        torch.testing.assert_close(out, expected, atol=3e-2, rtol=3e-2)
                    return (out - expected).abs().max().item()

                return impls, work, check if runner.use_triton else None

            runner.case("moe quant", f"{fmt} rows {rows}", build)
