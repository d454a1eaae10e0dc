"""RoPE frequencies for each `rope_type` of a Hugging Face config, as transformers' `modeling_rope_utils` computes
them, line for line (the cos/sin caches match bit for bit): `(inv_freq [head_dim / 2] float32, attention_factor)`.

attention_factor (YaRN's and LongRoPE's "mscale") multiplies cos and sin, as transformers multiplies them.

`rope_scaling` is the config's dict with `rope_type` and its fields; `original_max_position_embeddings`, where the
type uses it, already resolved (`workers.models.args.rope_settings` does it as transformers' config does).

Two types depend on the sequence length in transformers, which recomputes them in every forward pass from the
longest position in that pass. A paged engine cannot: a key is rotated once, when it is written to the cache, and
all sequences of a batch share one cos/sin cache. Pagoda fixes both from `max_model_len`, the longest sequence the
engine admits:

    dynamic   NTK-aware base scaling for seq_len = max(max_model_len, max_position_embeddings): none while
              max_model_len <= max_position_embeddings (transformers' result for every sequence that fits), else
              transformers' result for a sequence of exactly max_model_len tokens. vLLM fixes it at
              max_position_embeddings * factor: the same cache at the default max_model_len of such a config
              (engine/config.py's model_context_length).
    longrope  the long factors when max_model_len > original_max_position_embeddings, else the short ones (as vLLM
              decides); transformers picks them per forward pass by its longest position, so the two agree on
              every sequence when max_model_len <= original, and on sequences longer than original otherwise.
"""

from __future__ import annotations

import math

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn", "longrope")


def _base_inv_freq(head_dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def _llama3(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """transformers' `_compute_llama3_parameters` (Llama 3.1+ long-context scaling)."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


def _dynamic(head_dim: int, base: float, scaling: dict, max_position_embeddings: int, seq_len: int) -> torch.Tensor:
    """transformers' `_compute_dynamic_ntk_parameters` at `seq_len`."""
    factor = scaling["factor"]
    seq_len = max(seq_len, max_position_embeddings)
    base = base * ((factor * seq_len / max_position_embeddings) - (factor - 1)) ** (head_dim / (head_dim - 2))
    return _base_inv_freq(head_dim, base)


def _yarn(head_dim: int, base: float, scaling: dict, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """transformers' `_compute_yarn_parameters`: interpolation for low frequencies, extrapolation for high ones,
    a linear ramp between (beta_fast / beta_slow rotations), and an attention factor from the scale."""
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position_embeddings / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = (float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
                            if mscale and mscale_all_dim else _yarn_mscale(factor))
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(num_rotations):
        return (head_dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, attention_factor


def _yarn_mscale(scale: float, mscale: float = 1) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _longrope(head_dim: int, base: float, scaling: dict, max_position_embeddings: int,
              max_model_len: int) -> tuple[torch.Tensor, float]:
    """transformers' `_compute_longrope_parameters` with the factors chosen by max_model_len (module docstring)."""
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position_embeddings / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext_factors = scaling["long_factor"] if max_model_len > original else scaling["short_factor"]
    if len(ext_factors) != head_dim // 2:
        raise ValueError(f"rope_scaling long_factor / short_factor must have head_dim / 2 = {head_dim // 2} entries, "
                         f"got {len(ext_factors)}")
    inv_freq_shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (torch.tensor(ext_factors, dtype=torch.float32) * base ** inv_freq_shape), attention_factor


def compute_inv_freq(head_dim: int, base: float, rope_scaling: dict | None = None,
                     max_position_embeddings: int = 2048, max_model_len: int | None = None
                     ) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim / 2] float32, attention_factor) for `rope_scaling` (None: plain RoPE).

    max_position_embeddings is the checkpoint's (config.json's); max_model_len (default: the same) fixes the
    length-dependent types as the module docstring says."""
    max_model_len = max_model_len or max_position_embeddings
    rope_type = "default" if rope_scaling is None else rope_scaling.get("rope_type", rope_scaling.get("type"))
    if rope_type == "default":
        return _base_inv_freq(head_dim, base), 1.0
    if rope_type == "linear":  # transformers scales inv_freq: the same as positions / factor
        return _base_inv_freq(head_dim, base) / rope_scaling["factor"], 1.0
    if rope_type == "llama3":
        return _llama3(_base_inv_freq(head_dim, base), rope_scaling), 1.0
    if rope_type == "dynamic":
        return _dynamic(head_dim, base, rope_scaling, max_position_embeddings, max_model_len), 1.0
    if rope_type == "yarn":
        return _yarn(head_dim, base, rope_scaling, max_position_embeddings)
    if rope_type == "longrope":
        return _longrope(head_dim, base, rope_scaling, max_position_embeddings, max_model_len)
    raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
