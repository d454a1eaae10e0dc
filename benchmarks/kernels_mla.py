"""The MLA attention kernels' benchmark cases, for `python -m benchmarks.kernels --only mla`.

DeepSeek-V2-Lite's attention at one rank: 16 heads over a latent pool of 512 + 64 values a token (bf16). Decode
(batch 1 / 64 / 256 at 2k and 16k tokens) is scored in the pool bytes it must read, batch x context x 576 x 2,
against the copy ceiling: the latents at copy speed are its floor. Every head block reads the whole context, so
heads past one block (V2's 128 heads at tp 1) read it several times (`--mla-heads 128`). Prefill (one sequence of
1k-8k tokens) is scored in the absorbed form's causal FLOPs, 2 x T^2 / 2 x heads x (2 x 512 + 64), against bf16
peak; the torch reference (one einsum over the whole sequence) is the baseline. Pools larger than the L2 are read
cold as a model reads them (the smaller cases cycle through copies, as benchmarks/kernels.py's decode).
"""

import itertools

import torch

from kernels._triton import cdiv
from kernels.mla_attention import mla_attention_ref, mla_decode_triton, mla_prefill_triton

GPU_MLA = dict(heads=16, latent=512, rope=64, block_size=16, decode_batches=[1, 64, 256],
               decode_contexts=[2048, 16384], prefill_tokens=[1024, 4096, 8192])
SMOKE_MLA = dict(heads=4, latent=32, rope=16, block_size=16, decode_batches=[1, 4], decode_contexts=[64, 256],
                 prefill_tokens=[64])
COLD_BYTES = 256 * 2**20


def latent_pool(batch: int, ctx: int, cfg: dict, dtype, device):
    """A shuffled paged pool of `batch` sequences of `ctx` tokens, their block tables and lengths."""
    blocks_per_seq = cdiv(ctx, cfg["block_size"])
    num_blocks = batch * blocks_per_seq
    latent = torch.randn(num_blocks, cfg["block_size"], 1, cfg["latent"], dtype=dtype, device=device)
    rope = torch.randn(num_blocks, cfg["block_size"], 1, cfg["rope"], dtype=dtype, device=device)
    tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq).int()
    return latent, rope, tables, torch.full((batch,), ctx, dtype=torch.int32, device=device)


def bench_mla(runner, cfg: dict, mla_cfg: dict) -> None:
    dtype, device = cfg["dtype"], runner.device
    heads, latent_dim, rope_dim = mla_cfg["heads"], mla_cfg["latent"], mla_cfg["rope"]
    scale = (128 + rope_dim) ** -0.5
    for batch, ctx in itertools.product(mla_cfg["decode_batches"], mla_cfg["decode_contexts"]):

        def build(batch=batch, ctx=ctx):
            pool_bytes = batch * ctx * (latent_dim + rope_dim) * dtype.itemsize
            copies = cdiv(COLD_BYTES, pool_bytes) if device.type == "cuda" else 1
            pools = [latent_pool(batch, ctx, mla_cfg, dtype, device) for _ in range(copies)]
            turn = itertools.cycle(pools)
            q_lat = torch.randn(batch, heads, latent_dim, dtype=dtype, device=device) / latent_dim ** 0.5
            q_pe = torch.randn(batch, heads, rope_dim, dtype=dtype, device=device)

            def ref():
                return mla_attention_ref(q_lat, q_pe, *pools[0][:3], None, pools[0][3], scale)

            ref.eager = True  # a loop over the sequences on the host
            impls = {"torch ref": ref}
            if runner.use_triton:
                impls["triton"] = lambda: mla_decode_triton(q_lat, q_pe, *next(turn), scale)
                impls["triton split=1"] = lambda: mla_decode_triton(q_lat, q_pe, *next(turn), scale, num_splits=1)

            def check():
                out = mla_decode_triton(q_lat, q_pe, *pools[0], scale).float()
                expected = ref().float()
                torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
                return (out - expected).abs().max().item()

            return impls, dict(bytes=pool_bytes), check if runner.use_triton else None

        runner.case("mla decode", f"batch {batch} ctx {ctx}", build)
    for tokens in mla_cfg["prefill_tokens"]:

        def build(tokens=tokens):
            latent, rope, tables, lens = latent_pool(1, tokens, mla_cfg, dtype, device)
            q_lat = torch.randn(tokens, heads, latent_dim, dtype=dtype, device=device) / latent_dim ** 0.5
            q_pe = torch.randn(tokens, heads, rope_dim, dtype=dtype, device=device)
            starts = torch.tensor([0, tokens], dtype=torch.int32, device=device)
            args = (q_lat, q_pe, latent, rope, tables, starts, lens, scale)
            def ref():
                return mla_attention_ref(*args)

            ref.eager = True  # its sequence loop reads lengths on the host: no graph can capture it
            impls = {"torch ref": ref}
            if runner.use_triton:
                impls["triton"] = lambda: mla_prefill_triton(*args, tokens)

            def check():
                out, expected = mla_prefill_triton(*args, tokens).float(), mla_attention_ref(*args).float()
                torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
                return (out - expected).abs().max().item()

            flops = 2 * tokens * tokens // 2 * heads * (2 * latent_dim + rope_dim)
            return impls, dict(flops=flops), check if runner.use_triton else None

        runner.case("mla prefill", f"{tokens} tokens", build)
