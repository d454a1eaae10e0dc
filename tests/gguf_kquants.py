"""Q4_K / Q5_K / Q6_K blocks for test files: the gguf package dequantizes the k-quants but has no quantizer for
them, so these write ggml's block layouts (ggml-common.h's block_q4_K, block_q5_K, block_q6_K) from a plain
round-to-nearest per sub-block, with none of llama.cpp's scale search. What Pagoda must reproduce is gguf's
dequantization of these bytes, whatever quantizer chose them.

    block_q4_K: d fp16, dmin fp16, scales[12] (8 six-bit scales and mins), qs[128]    w = d sc q - dmin m
    block_q5_K: as q4_K, then qh[32] before qs: bit i of qh[j] is bit 4 of sub-block i's weight j
    block_q6_K: ql[128], qh[64], scales int8[16], d fp16                               w = d sc (q - 32)
"""

from __future__ import annotations

import numpy as np

QK = 256


def _fp16_bytes(x: np.ndarray) -> np.ndarray:
    """[n] float -> [n, 2] bytes of its fp16."""
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _pack_six_bits(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """8 scales and 8 mins (< 64) of each super-block [n, 8] -> [n, 12]: bytes 0-3 scales 0-3 (their top 2 bits
    carrying bits 4-5 of scales 4-7), bytes 4-7 mins likewise, bytes 8-11 the low nibbles of scale / min 4 + i."""
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    first = sc[:, :4] | (sc[:, 4:] >> 4) << 6
    second = m[:, :4] | (m[:, 4:] >> 4) << 6
    third = (sc[:, 4:] & 15) | (m[:, 4:] & 15) << 4
    return np.concatenate([first, second, third], axis=1)


def _scale_and_min_k(x: np.ndarray, maxq: int):
    """x [n, 8, 32] -> (d, dmin [n], six-bit sc, m [n, 8], q [n, 8, 32]) with w = d sc q - dmin m."""
    lo = np.minimum(x.min(axis=2), 0)
    scale = (x.max(axis=2) - lo) / maxq  # [n, 8]
    d = (scale.max(axis=1) / 63).astype(np.float16).astype(np.float32)
    dmin = (-lo.min(axis=1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / np.where(d == 0, 1, d)[:, None]), 0, 63)
    m = np.clip(np.round(-lo / np.where(dmin == 0, 1, dmin)[:, None]), 0, 63)
    step = d[:, None] * sc
    q = np.round((x + (dmin[:, None] * m)[..., None]) / np.where(step == 0, 1, step)[..., None])
    return d, dmin, sc, m, np.clip(q, 0, maxq).astype(np.uint8)


def _nibble_runs(q: np.ndarray) -> np.ndarray:
    """[n, 8, 32] four-bit values -> qs [n, 128]: run c's low nibbles sub-block 2c, high nibbles 2c + 1."""
    return (q[:, 0::2] | q[:, 1::2] << 4).reshape(q.shape[0], 128)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """x [n, 256] -> blocks [n, 144]."""
    d, dmin, sc, m, q = _scale_and_min_k(x.reshape(-1, 8, 32), 15)
    return np.concatenate([_fp16_bytes(d), _fp16_bytes(dmin), _pack_six_bits(sc, m), _nibble_runs(q)], axis=1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """x [n, 256] -> blocks [n, 176]."""
    d, dmin, sc, m, q = _scale_and_min_k(x.reshape(-1, 8, 32), 31)
    qh = np.zeros((q.shape[0], 32), dtype=np.uint8)
    for i in range(8):
        qh |= (q[:, i] >> 4) << i
    return np.concatenate([_fp16_bytes(d), _fp16_bytes(dmin), _pack_six_bits(sc, m), qh, _nibble_runs(q & 15)],
                          axis=1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """x [n, 256] -> blocks [n, 210]; sub-blocks of 16 with signed int8 scales."""
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    scale = np.abs(sub).max(axis=2) / 31  # [n, 16]
    scale = np.where(sub.max(axis=2) < -sub.min(axis=2), -scale, scale)  # sign: most negative maps to +31
    d = (np.abs(scale).max(axis=1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / np.where(d == 0, 1, d)[:, None]), -128, 127)
    step = d[:, None] * sc
    q = np.clip(np.round(sub / np.where(step == 0, 1, step)[..., None]) + 32, 0, 63).astype(np.uint8)
    q = q.reshape(n, 2, 128)  # two halves of 128 weights
    ql = (q[:, :, :64] & 15) | (q[:, :, 64:] & 15) << 4  # [n, 2, 64]: weights 64 s + j, s in the nibble
    qh = np.zeros((n, 2, 32), dtype=np.uint8)
    for t in range(4):
        qh |= (q[:, :, 32 * t: 32 * t + 32] >> 4) << (2 * t)
    return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.astype(np.int8).view(np.uint8),
                           _fp16_bytes(d)], axis=1)


QUANTIZERS = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}


def quantize(w: np.ndarray, qtype: str) -> np.ndarray:
    """w [rows, cols] float32 (cols a multiple of 256) -> the tensor's bytes [rows, cols / 256 * type_size]."""
    rows, cols = w.shape
    assert cols % QK == 0, f"a k-quant row is whole super-blocks of {QK}, got {cols}"
    return QUANTIZERS[qtype](w.reshape(-1, QK).astype(np.float32)).reshape(rows, -1)
