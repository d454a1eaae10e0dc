"""The KV-cache scales of a float8 pool (kv_cache_dtype="fp8"), fixed at load by a calibration forward.

Each layer's K and V get one power-of-two scale per KV head (kernels/fp8.py `pow2_scale(amax, KV_EXP)`: the
head's largest calibration value maps into [56, 112], leaving 4x headroom below e4m3's 448). The calibration
batch is `CALIBRATION_SEQS` sequences of `CALIBRATION_LEN` tokens: the BOS token, then ids drawn from a fixed
seed over the vocabulary. Its K/V go into a temporary pool in the model's dtype, and the scales are the maxima
over what was written, per layer and head. So the scales depend only on the weights (and this fixed batch):

- every request sees the same cache encoding, whatever arrived first: prefix caching, preemption and
  recomputation stay exact, and runs repeat;
- each rank calibrates its own KV heads (no collective beyond the model's own), and a head's scale is the same
  at any tensor-parallel degree (up to float rounding of the amax).

Per head rather than per layer: heads of one layer differ in size, and a per-head scale is free (each attention
program reads one head). A latent pool (workers/kv_pool.py KVLayout) has one "head": a scale for the layer's latents
and one for its rope keys. `granularity="layer"` gives one scale per layer (the max over heads and ranks) to compare
(benchmarks/quality.py --kv-scales layer).
"""

from __future__ import annotations

import torch

from kernels.fp8 import KV_EXP, pow2_scale
from workers.kv_pool import allocate_kv_caches
from workers.layers.attention import AttentionMetadata, KVScaledAttention

CALIBRATION_SEQS = 4
CALIBRATION_LEN = 128
CALIBRATION_SEED = 1234


def calibration_token_ids(vocab_size: int, bos_token_id: int | None) -> list[list[int]]:
    """The fixed calibration batch: BOS (when the model has one), then seeded random ids."""
    generator = torch.Generator().manual_seed(CALIBRATION_SEED)
    ids = torch.randint(0, vocab_size, (CALIBRATION_SEQS, CALIBRATION_LEN), generator=generator)
    if bos_token_id is not None:
        ids[:, 0] = bos_token_id
    return ids.tolist()


def attention_layers(model: torch.nn.Module) -> list[KVScaledAttention]:
    layers = [m for m in model.modules() if isinstance(m, KVScaledAttention)]
    assert len(layers) == model.num_layers, f"{len(layers)} Attention modules for {model.num_layers} layers"
    return layers


@torch.inference_mode()
def calibrate_kv_scales(model: torch.nn.Module, device: torch.device, dtype: torch.dtype, bos_token_id: int | None,
                        granularity: str = "head") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Runs the calibration batch, sets every layer's (k_scale, v_scale) and returns them."""
    if granularity not in ("head", "layer"):
        raise ValueError(f"granularity must be 'head' or 'layer', got {granularity!r}")
    seqs = calibration_token_ids(model.vocab_size, bos_token_id)
    num_tokens = CALIBRATION_SEQS * CALIBRATION_LEN
    caches = allocate_kv_caches(model.kv_layout, CALIBRATION_SEQS, CALIBRATION_LEN, dtype, device)  # a block a seq
    meta = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens, device=device),
        query_start_loc=torch.arange(0, num_tokens + 1, CALIBRATION_LEN, dtype=torch.int32, device=device),
        seq_lens=torch.full((CALIBRATION_SEQS,), CALIBRATION_LEN, dtype=torch.int32, device=device),
        block_tables=torch.arange(CALIBRATION_SEQS, dtype=torch.int32, device=device)[:, None],
        max_query_len=CALIBRATION_LEN, is_decode_only=False)
    ids = torch.tensor(seqs, device=device).flatten()
    positions = torch.arange(CALIBRATION_LEN, device=device).repeat(CALIBRATION_SEQS)
    model(ids, positions, caches, meta)
    scales = []
    for attn, (k_cache, v_cache) in zip(attention_layers(model), caches):
        k_amax, v_amax = (c.float().abs().amax(dim=(0, 1, 3)) for c in (k_cache, v_cache))  # [H_kv]
        if granularity == "layer":
            from workers import parallel

            k_amax = parallel.all_reduce_max(k_amax.max().expand_as(k_amax).contiguous())
            v_amax = parallel.all_reduce_max(v_amax.max().expand_as(v_amax).contiguous())
        k_scale, v_scale = pow2_scale(k_amax, KV_EXP), pow2_scale(v_amax, KV_EXP)
        attn.set_kv_scales(k_scale, v_scale)
        scales.append((k_scale, v_scale))
    return scales
