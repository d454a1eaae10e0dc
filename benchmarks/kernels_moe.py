"""The fused MoE kernel's benchmark cases, for `python -m benchmarks.kernels --only moe` (and `--tune --only moe`).

A Mixtral-8x7B layer's experts (8 x [2 x 14336 | 14336] x 4096, top-2; `--moe-shape qwen3-30b-a3b`: 128 x [2 x 768 |
768] x 2048, top-8) at decode and prefill batch sizes, the Triton grouped GEMMs against the torch reference
(transformers' loop over the chosen experts, cuBLAS per expert) and, at prefill sizes, against the same layer through
torch._grouped_mm (`fused_moe_grouped_mm`: CUTLASS's grouped GEMMs on sm_90).
Decode-sized batches are scored in bytes (the weights of the experts the batch routes to: a good step reads only
those, once) against the copy ceiling; prefill-sized ones in FLOPs (2 x T x top_k x 3 x H x I) against bf16 peak.
The experts' 2.8 GB are far past the L2, so every call reads them cold.
"""

import torch

from kernels.moe import fused_moe_grouped_mm, fused_moe_ref, fused_moe_triton, topk_route

GPU_MOE = dict(hidden=4096, inter=14336, num_experts=8, top_k=2, rows=[1, 8, 64, 512, 1024, 2048, 4096, 8192])
GPU_MOE_SHAPES = {"mixtral-8x7b": GPU_MOE,
                  "qwen3-30b-a3b": dict(hidden=2048, inter=768, num_experts=128, top_k=8,
                                        rows=[1, 8, 64, 256, 512, 2048, 4096, 8192])}
SMOKE_MOE = dict(hidden=256, inter=512, num_experts=4, top_k=2, rows=[1, 16])
BYTES_UP_TO_ROWS = 64  # decode-sized batches: scored by the weight bytes they must read
TUNE_ROWS = [1, 8, 64, 512, 4096]
# GROUP_M=1: the tiles of pairs in the order before grouped_tile (each tile's n-blocks in turn), beside the default
TUNE_CONFIGS = [dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=st)
                for n, k, w, st in [(32, 128, 4, 4), (64, 128, 4, 3), (64, 256, 4, 3), (128, 64, 4, 3),
                                    (64, 64, 4, 4), (128, 64, 8, 3), (128, 128, 8, 3)]] + [
                dict(GROUP_M=1), dict(GROUP_M=16), dict(BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3, GROUP_M=1)]


def moe_inputs(rows: int, cfg: dict, dtype, device, seed: int = 0):
    """x, w13, w2 and a routing of `rows` tokens from random router logits."""
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden, inter, experts = cfg["hidden"], cfg["inter"], cfg["num_experts"]
    x = torch.randn(rows, hidden, generator=gen, device=device).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen, device=device) * hidden ** -0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen, device=device) * inter ** -0.5).to(dtype)
    weights, ids = topk_route(torch.randn(rows, experts, generator=gen, device=device), cfg["top_k"], True)
    return x, w13, w2, weights, ids


def moe_work(rows: int, ids: torch.Tensor, w13: torch.Tensor, cfg: dict) -> dict:
    if rows <= BYTES_UP_TO_ROWS:
        per_expert = 3 * cfg["hidden"] * cfg["inter"] * w13.element_size()
        return dict(bytes=int(ids.unique().numel()) * per_expert)
    return dict(flops=2 * rows * cfg["top_k"] * 3 * cfg["hidden"] * cfg["inter"])


def bench_moe(runner, cfg: dict, moe_cfg: dict):
    """The default launch settings against the torch reference."""
    for rows in moe_cfg["rows"]:

        def build(rows=rows):
            args = moe_inputs(rows, moe_cfg, cfg["dtype"], runner.device)

            def ref():
                return fused_moe_ref(*args)

            ref.eager = True  # transformers' loop picks experts by data (nonzero): no CUDA graph captures it
            impls = {"torch ref": ref}
            if runner.use_triton:
                impls["triton"] = lambda: fused_moe_triton(*args)
                if rows > BYTES_UP_TO_ROWS and hasattr(torch, "_grouped_mm"):
                    impls["grouped_mm"] = lambda: fused_moe_grouped_mm(*args)

            def check():
                ref = fused_moe_ref(*args).float()
                errors = []
                for impl in [fused_moe_triton] + ([fused_moe_grouped_mm] if "grouped_mm" in impls else []):
                    out = impl(*args).float()
                    torch.testing.assert_close(out, ref, atol=3e-2, rtol=3e-2)
                    errors.append((out - ref).abs().max().item())
                return max(errors)

            return impls, moe_work(rows, args[4], args[1], moe_cfg), check if runner.use_triton else None

        runner.case("moe", f"rows {rows} top{moe_cfg['top_k']} of {moe_cfg['num_experts']} x {moe_cfg['inter']}", build)


def bench_tune_moe(runner, cfg: dict, moe_cfg: dict):
    """TUNE_CONFIGS for both GEMMs at a few batch sizes: kernels/moe.py's moe_config should be the best row."""
    for rows in TUNE_ROWS:

        def build(rows=rows):
            args = moe_inputs(rows, moe_cfg, cfg["dtype"], runner.device)
            impls = {"default": lambda: fused_moe_triton(*args)}
            for c in TUNE_CONFIGS:
                name = " ".join(f"{k}={v}" for k, v in c.items())
                impls[name] = lambda c=c: fused_moe_triton(*args, config=c)
            return impls, moe_work(rows, args[4], args[1], moe_cfg), None

        runner.case("tune moe", f"rows {rows}", build)
