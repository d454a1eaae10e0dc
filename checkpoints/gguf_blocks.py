"""A GGUF linear's blocks repacked, once at load, into an int layer's N-first tensors (quantization="gguf"; the
layouts and why they are exact: checkpoints/gguf_types.py):

    qweight  int32 [N, K / p]   the stored integers of inputs p c .. p c + p - 1 in fields 0..p-1 (p = 32 / bits)
    scales   fp16 / fp32 [N, K / group]
    mins     the same [N, K / group] (types with a minimum)

the layout of compressed-tensors' pack-quantized, N first (workers/layers/quantization_int.py holds it
transposed). The blocks, as ggml stores them (each row of a tensor a run of blocks; fp16 d, dmin, m):

    Q4_0  d | qs[16]                weight j: qs[j] & 15, weight j + 16: qs[j] >> 4
    Q4_1  d m | qs[16]              as Q4_0
    Q5_0  d | qh u32 | qs[16]       as Q4_0, plus bit j of qh as bit 4 of weight j
    Q5_1  d m | qh u32 | qs[16]     as Q5_0
    Q8_0  d | q int8[32]
    Q4_K  d dmin | sc[12] | qs[128]         256 weights, 8 sub-blocks of 32; qs in 4 runs of 32 bytes: run c holds
                                            sub-block 2c in its low nibbles and 2c + 1 in its high ones; sc packs
                                            8 six-bit scales and 8 six-bit minimums (`_k_scales_and_mins`)
    Q5_K  d dmin | sc[12] | qh[32] | qs[128] as Q4_K, plus bit i of qh[j] as bit 4 of sub-block i's weight j
    Q6_K  ql[128] | qh[64] | sc int8[16] | d 256 weights, 16 sub-blocks of 16; in each half h (128 weights),
                                            weight 64 s + j (s 0, 1; j < 64) has low bits (ql[64 h + j] >> 4 s)
                                            & 15 and weight 32 t + j (t < 4; j < 32) high bits
                                            (qh[32 h + j] >> 2 t) & 3

`GGUFIntSlice` reads only the rows and blocks a tensor-parallel rank asks for (a k-quant's whole 256-weight
super-blocks, cut to the rank's groups after decoding).
"""

from __future__ import annotations

import numpy as np
import torch

from checkpoints.gguf_types import INT_LAYOUTS

_F16, _F32 = np.float16, np.float32


def _halves(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 at byte `at` of every block: [R, nb]."""
    return np.ascontiguousarray(blocks[:, :, at:at + 2]).view(_F16)[:, :, 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., n] bytes -> [..., 2n]: the low nibbles, then the high ones."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """[R, nb, 4] bytes of a little-endian u32 -> [R, nb, 32]: bit j of it, for weight j."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _q4_0(b):
    return _nibbles(b[:, :, 2:]), _halves(b, 0), None


def _q4_1(b):
    return _nibbles(b[:, :, 4:]), _halves(b, 0), _halves(b, 2)


def _q5_0(b):  # q - 16 stored + 128 in 8 bits
    return (_nibbles(b[:, :, 6:]) | _high_bits(b[:, :, 2:6]) << 4) + np.uint8(112), _halves(b, 0), None


def _q5_1(b):
    return _nibbles(b[:, :, 8:]) | _high_bits(b[:, :, 4:8]) << 4, _halves(b, 0), _halves(b, 2)


def _q8_0(b):  # int8 q -> q + 128
    return b[:, :, 2:] ^ np.uint8(0x80), _halves(b, 0), None


def _k_scales_and_mins(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[R, nb, 12] -> the 8 six-bit scales and minimums [R, nb, 8]: bytes 0-3 hold scales 0-3 in their low 6 bits
    (and bits 4-5 of scales 4-7 in their top 2), bytes 4-7 the minimums likewise, bytes 8-11 the low 4 bits of
    scale 4 + i (low nibble) and minimum 4 + i (high nibble)."""
    low_sc, low_m, rest = sc[..., 0:4], sc[..., 4:8], sc[..., 8:12]
    scales = np.concatenate([low_sc & 63, (rest & 15) | (low_sc >> 6) << 4], axis=-1)
    mins = np.concatenate([low_m & 63, (rest >> 4) | (low_m >> 6) << 4], axis=-1)
    return scales, mins


def _k_scale_and_min(b) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: d * sc and -(dmin * m) per sub-block of 32, float32 [R, nb * 8], as gguf computes them."""
    sc, m = _k_scales_and_mins(b[:, :, 4:16])
    d, dmin = _halves(b, 0).astype(_F32), _halves(b, 2).astype(_F32)
    scale = d[:, :, None] * sc.astype(_F32)
    low = -(dmin[:, :, None] * m.astype(_F32))
    return scale.reshape(b.shape[0], -1), low.reshape(b.shape[0], -1)


def _q4_k(b):
    runs = b[:, :, 16:].reshape(b.shape[0], b.shape[1], 4, 32)  # [R, nb, run, 32 bytes]
    q = np.stack([runs & 15, runs >> 4], axis=3)  # [R, nb, run, low / high, 32]: sub-block 2 run + half
    return (q.reshape(b.shape[0], -1), *_k_scale_and_min(b))


def _q5_k(b):
    runs = b[:, :, 48:].reshape(b.shape[0], b.shape[1], 4, 32)
    low = np.stack([runs & 15, runs >> 4], axis=3).reshape(b.shape[0], b.shape[1], 8, 32)
    qh = b[:, :, 16:48]  # [R, nb, 32]: bit i of byte j is sub-block i's weight j
    high = (qh[:, :, None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [R, nb, 8, 32]
    return ((low | high << 4).reshape(b.shape[0], -1), *_k_scale_and_min(b))


def _q6_k(b):  # q - 32 stored + 128 in 8 bits
    rows, nb = b.shape[:2]
    ql = b[:, :, :128].reshape(rows, nb, 2, 1, 64)  # [R, nb, half, 1, 64]
    low = ((ql >> np.array([0, 4], dtype=np.uint8)[:, None]) & 15).reshape(rows, nb, 2, 128)
    qh = b[:, :, 128:192].reshape(rows, nb, 2, 1, 32)
    high = ((qh >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3).reshape(rows, nb, 2, 128)
    q = (low | high << 4).reshape(rows, -1) + np.uint8(96)
    sc = np.ascontiguousarray(b[:, :, 192:208]).view(np.int8).astype(_F32)  # [R, nb, 16]
    d = _halves(b, 208).astype(_F32)
    return q, (d[:, :, None] * sc).reshape(rows, -1), None


_DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0, "Q4_K": _q4_k,
             "Q5_K": _q5_k, "Q6_K": _q6_k}
assert set(_DECODERS) == set(INT_LAYOUTS), "a decoder for every served type"


def decode_blocks(qtype: str, blocks: np.ndarray):
    """blocks uint8 [R, nb, type_size] -> (stored integers uint8 [R, nb * block], scales [R, groups], mins or
    None), the scales and minimums in the layout's dtype."""
    q, scale, low = _DECODERS[qtype](blocks)
    rows, dtype = blocks.shape[0], np.dtype(INT_LAYOUTS[qtype].scale_dtype)
    scale = scale.reshape(rows, -1).astype(dtype, copy=False)
    return q.reshape(rows, -1), scale, None if low is None else low.reshape(rows, -1).astype(dtype, copy=False)


def pack_along_k(q: np.ndarray, bits: int) -> torch.Tensor:
    """uint8 [R, K] (each < 2^bits) -> int32 [R, K / p]: input p c + j in field j of word c."""
    p = 32 // bits
    q = q.reshape(q.shape[0], -1, p).astype(np.uint32)
    words = np.zeros(q.shape[:2], dtype=np.uint32)
    for field in range(p):
        words |= q[:, :, field] << np.uint32(bits * field)
    return torch.from_numpy(words.view(np.int32))


class GGUFIntSlice:
    """A served GGUF linear's `qweight`, `scales` or `mins` (see the module docstring), read like a safetensors
    slice: `[a:b]` rows, `[a:b, c:d]` rows and columns of the part (c, d whole groups). `base` is the tensor's
    checkpoints.gguf.GGUFSlice (its rows in Hugging Face order)."""

    def __init__(self, base, part: str):
        self.qtype = base.qtype.name
        assert self.qtype in INT_LAYOUTS and part in ("qweight", "scales", "mins"), (self.qtype, part)
        self.layout = INT_LAYOUTS[self.qtype]
        self.base, self.part = base, part
        rows, cols = base.shape
        # weights per column of this part
        self.per_column = 32 // self.layout.bits if part == "qweight" else self.layout.group_size
        self.shape = (rows, cols // self.per_column)

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, key) -> torch.Tensor:
        rows, cols = (key, slice(None)) if not isinstance(key, tuple) else (key + (slice(None),))[:2]
        start, stop, _ = cols.indices(self.shape[1])
        first, last = start * self.per_column, stop * self.per_column  # weights
        group = self.layout.group_size
        if first % group or last % group:
            raise ValueError(f"GGUF tensor {self.base.name!r}: columns [{first}, {last}) are not whole groups of "
                             f"{group}")
        block, size = self.base.block_size, self.base.type_size
        first_block, end_block = first // block, -(-last // block)  # whole blocks (a k-quant's 256), then cut
        raw = self.base._rows(rows)[:, first_block * size: end_block * size]
        blocks = np.ascontiguousarray(raw).reshape(raw.shape[0], -1, size)
        q, scale, low = decode_blocks(self.qtype, blocks)
        offset = first_block * block
        if self.part == "qweight":
            return pack_along_k(q[:, first - offset: last - offset], self.layout.bits)
        values = scale if self.part == "scales" else low
        assert values is not None, f"GGUF {self.qtype} has no {self.part}"
        return torch.from_numpy(np.ascontiguousarray(values[:, (first - offset) // group: (last - offset) // group]))
