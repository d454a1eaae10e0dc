"""The int linear for a few rows (decode): a kernel that streams the packed weight at the memory's speed.

What made the first kernel (linear_int.py's `_int_linear_kernel` under `decode_config`) 0.4-3% of copy
bandwidth on the H200, read in its sm_90 PTX / SASS (tests/kernels/test_kernel_compile.py keeps the properties):

    - tiles of 32 columns x 64 input features: 1 KB of packed words a step (16 bytes of each K row, at a stride
      of N / 2 bytes), 192 programs for Llama-3-8B's qkv: ~200 KB in flight where ~4 MB hides the memory's latency
    - num_stages 2: one shared-memory buffer (`memdesc<1x...>`), its cp.async waited for at the top of the next step
      (wait_group 0): no overlap; and the scales read by a plain load in the loop, a second round trip a step
    - per element: a word loaded per value (`UNPACK_ONCE` off, 8 loads of each word), int64 indices making the
      zero points int64 (the dequantization's integer-to-float conversion became I2F.S64), the dequantized bf16 tile
      written to shared memory one 16-bit value at a time (STS.U16) to reach the MMA's operand layout

Here (`_int_decode_kernel`), each program owns BLOCK_N output features and a slice of K (split-K when the layer
has fewer column tiles than SMs, the slices added up by the last program of a tile), and each packed word is loaded
once (cp.async, 8-16 bytes a thread) and unpacked in the MMA's operand layout itself, one dot per field of the word:

    packed along N (AWQ)    value j of word (k, c) is output feature 8c + j: dot j is x [M, BLOCK_K] against the
                            [BLOCK_K, BLOCK_N / 8] values of field j, into accumulator j (columns 8c + j); the
                            accumulators interleave once, at the end
    packed along K (GPTQ,   value j of word (r, n) is input feature P r + j: dot j is x's columns P r + j against
    offset binary)          field j, all into one accumulator

so the unpacking is elementwise on the loaded words (no reshape, no layout conversion of the dequantized values).
With 4-bit fields, zero points and bf16 / fp16 x (`BIASED`, the serving case and the default where it applies:
`PAIR_UNPACK`) a value costs a quarter of a prmt, a quarter of a shift, half a lop3 and half a 16-bit pair
subtraction (`int_tiles.byte_fields`: two words' byte pairs into one register of two 16-bit values, each nibble
OR-ed into the mantissa of B = 128 in bf16, 1024 in fp16, then B + z subtracted from the pair: q - z, exact): on the
sm_90 SASS of Llama-3-8B's down, 2.8 instructions a value in the K loop and 168 registers, where the path below took
3.9 and 211. (A first version dotted B + q and took (B + z) * sum(x) off the result instead: 2.75 a value, but x's
sum crossed the warps through shared memory and a barrier each K tile, and on the H200 the kernel ran 1.3-1.6x
slower than before: benchmarks/results/h200-kernels-tune-int4-biased.json.) The default path (the only one for 8
bits, GGUF's mins and float32 x): a value costs one lop3 (its field OR-ed into the mantissa of 2^23), one FMA giving
q - z exactly, and half a conversion to x's dtype (`int_tiles.field_magic`). Neither converts integers to floats.
The scale multiplies the dot's result (a K tile lies in one group), and GGUF Q4_1's min adds min * sum(x) there. So
W is not rounded to x's dtype before the dot, as `dequantize_ref` rounds it: the result is the exact-weight product,
which differs from the reference by that rounding (a bf16 unit in the last place of W, averaged over K).

Groups smaller than a K tile (`ROW_SCALES`: along K, a group of whole word rows dividing the tile's 16 or more
words: GGUF's 32 and Q6_K's 16, GPTQ's 32) cannot scale a tile's sum: each word row's group's scales (and zero
points, or mins) are read beside its words (a [BLOCK_K / P, BLOCK_N] gather of a few rows, from L1) and W
itself is dequantized before the dots, (q - z) * scale or q * scale + min, rounded to x's dtype as the reference
rounds it: one more FMA a value (two with mins) and the scale loads. Not yet timed on a GPU; what it replaced at
decode sizes is dequantize + cuBLAS, which reads and writes W in x's dtype each step.

`linear_int_triton` takes this kernel for up to linear_int.STREAM_MAX_ROWS rows (past 16 in row tiles of 16, each
unpacking the words again) when the layout allows (no g_idx; a K tile inside one group, or whole groups a K tile
along K), the first kernel otherwise.
"""

from __future__ import annotations

import functools

import torch

from kernels._triton import (
    cdiv,
    is_interpreting,
    next_power_of_2,
    num_sms,
    pdl_options,
    shared_memory_per_block,
    split_counts,
    tl,
    triton,
    wait_for_prior,
)
from kernels.int_tiles import byte_fields, field_magic, field_zero_term, interleave8, minus_z, zero_points
from kernels.linear import store_output, store_split_k_slice

# Rows a program (past 16: several row tiles a column tile, K split over them all). 16: on an H100 tiles of 32 and
# 64 rows (4 or 8 warps) took 1.0-7x its time at 32 and 64 rows on each of Llama-3-8B's and 70B's AWQ linears
# (benchmarks/results/h100-kernels-tune-int4-row-tiles-split.json; kernels/linear_int.py's STREAM_MAX_ROWS)
ROW_TILE = 16
MAX_SPLIT_K = 16  # slices of K at most (a float32 [SPLIT_K, 2, row tiles x 16, N] workspace, read back from L2)
# The B + q unpacking (`BIASED`, where `can_pair_unpack`) is the default: on an H100 (2026-12-05,
# benchmarks/results/h100-kernels-tune-int4-pair.json) it was faster than the q - z path on each of Llama-3-8B's and
# 70B's AWQ linears at 1 row (5-18%), and 8B AWQ decode at batch 1 took 3.59 ms/token against 3.97
# (h100-latency-llama3-8b-awq-pair-{on,off}.json). `BIASED=False` in a config (or this flag) takes the q - z path.
PAIR_UNPACK = True


@triton.jit
def _n_field_dot(xv, words, zero_words, s_row, m_row, xsum, c, c_mask, J: tl.constexpr, BITS: tl.constexpr,
                 AWQ_ORDER: tl.constexpr, ZERO_OFFSET: tl.constexpr, HAS_MINS: tl.constexpr, UPCAST: tl.constexpr,
                 PRECISION: tl.constexpr, ASM: tl.constexpr):
    """float32 [BLOCK_M, BLOCK_C]: x times the dequantized values j of words [BLOCK_K, BLOCK_C] (packed along N),
    i.e. output features 8c + j of this K tile (one group: s_row, m_row point at its scales' / mins' row)."""
    P: tl.constexpr = 32 // BITS
    H: tl.constexpr = 16 // BITS
    F: tl.constexpr = (J % 2) * 4 + J // 2 if AWQ_ORDER else J
    SH: tl.constexpr = BITS * (F % H)
    v = field_magic(words, F, BITS, ASM)
    if HAS_MINS:
        zterm = tl.full([1], -(1 << (23 - SH)), tl.float32)
    else:
        zterm = field_zero_term(zero_words, F, ZERO_OFFSET, BITS, SH)
    d = minus_z(v, zterm[None, :], SH).to(xv.dtype)
    part = tl.dot(xv, d, input_precision=PRECISION)
    part = part * tl.load(s_row + c * P + J, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_MINS:
        part += xsum[:, None] * tl.load(m_row + c * P + J, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    return part


@triton.jit
def _n_byte_dots(acc_low, acc_high, xv, words, zero_words, s_row, c, c_mask, BYTE: tl.constexpr,
                 AWQ_ORDER: tl.constexpr, ZERO_OFFSET: tl.constexpr, FP16: tl.constexpr, PRECISION: tl.constexpr,
                 ASM: tl.constexpr):
    """The accumulators of fields 2 BYTE and 2 BYTE + 1 (byte BYTE's nibbles) of the words (4 bits, packed along
    N, zero points), each plus x times its dequantized values (`byte_fields`: q - z), scaled."""
    F0: tl.constexpr = 2 * BYTE
    F1: tl.constexpr = 2 * BYTE + 1
    low, high = byte_fields(words, zero_points(zero_words, F0, ZERO_OFFSET, 4)[None, :],
                            zero_points(zero_words, F1, ZERO_OFFSET, 4)[None, :], BYTE, FP16, ASM)
    acc_low += tl.dot(xv, low.to(xv.dtype), input_precision=PRECISION) * _n_scales(s_row, c, c_mask, F0, AWQ_ORDER)
    acc_high += tl.dot(xv, high.to(xv.dtype), input_precision=PRECISION) * _n_scales(s_row, c, c_mask, F1, AWQ_ORDER)
    return acc_low, acc_high


@triton.jit
def _n_scales(s_row, c, c_mask, F: tl.constexpr, AWQ_ORDER: tl.constexpr):
    """float32 [1, BLOCK_C]: the scales of field F's output features 8c + J, J = F's place in AWQ's order
    (0 2 4 6 1 3 5 7) or F."""
    J: tl.constexpr = 2 * (F % 4) + F // 4 if AWQ_ORDER else F
    return tl.load(s_row + c * 8 + J, mask=c_mask, other=0.0).to(tl.float32)[None, :]


@triton.jit
def _n_packed_tile(x_ptr, qw_ptr, qz_ptr, s_ptr, rows, row_mask, stride_x, stride_qw, stride_qz, stride_s, c0, NC,
                   k_begin, k_end, group_size, BITS: tl.constexpr, AWQ_ORDER: tl.constexpr,
                   ZERO_OFFSET: tl.constexpr, HAS_MINS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                   ASM: tl.constexpr, BIASED: tl.constexpr, FP16: tl.constexpr, EVEN_N: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr):
    """float32 [BLOCK_M, 8 BLOCK_C]: x's rows times W.T's columns 8 c0 .. 8 (c0 + BLOCK_C), K from k_begin to k_end
    (whole K tiles), for qweight packed along N (4 bits, 8 a word)."""
    c = c0 + tl.arange(0, BLOCK_C)
    c_mask = c < NC
    a0 = tl.zeros([BLOCK_M, BLOCK_C], tl.float32)
    a1 = tl.zeros([BLOCK_M, BLOCK_C], tl.float32)
    a2 = tl.zeros([BLOCK_M, BLOCK_C], tl.float32)
    a3 = tl.zeros([BLOCK_M, BLOCK_C], tl.float32)
    a4 = tl.zeros([BLOCK_M, BLOCK_C], tl.float32)
    a5 = tl.zeros([BLOCK_M, BLOCK_C], tl.float32)
    a6 = tl.zeros([BLOCK_M, BLOCK_C], tl.float32)
    a7 = tl.zeros([BLOCK_M, BLOCK_C], tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        xv = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=row_mask[:, None], other=0.0)
        xsum = tl.sum(xv.to(tl.float32), axis=1)
        if UPCAST:
            xv = xv.to(tl.float32)
        if EVEN_N:  # no mask: 16-byte loads (a mask on c < NC, of unknown divisibility, allowed 8)
            words = tl.load(qw_ptr + ks[:, None] * stride_qw + c[None, :])
        else:
            words = tl.load(qw_ptr + ks[:, None] * stride_qw + c[None, :], mask=c_mask[None, :], other=0)
        g = k0 // group_size
        zero_words = tl.load(qz_ptr + g * stride_qz + c, mask=c_mask, other=0)
        s_row = s_ptr + g * stride_s
        m_row = qz_ptr + g * stride_qz
        if BIASED:  # accumulator F: field F (AWQ's order undone at the end)
            a0, a1 = _n_byte_dots(a0, a1, xv, words, zero_words, s_row, c, c_mask, 0, AWQ_ORDER, ZERO_OFFSET, FP16,
                                  PRECISION, ASM)
            a2, a3 = _n_byte_dots(a2, a3, xv, words, zero_words, s_row, c, c_mask, 1, AWQ_ORDER, ZERO_OFFSET, FP16,
                                  PRECISION, ASM)
            a4, a5 = _n_byte_dots(a4, a5, xv, words, zero_words, s_row, c, c_mask, 2, AWQ_ORDER, ZERO_OFFSET, FP16,
                                  PRECISION, ASM)
            a6, a7 = _n_byte_dots(a6, a7, xv, words, zero_words, s_row, c, c_mask, 3, AWQ_ORDER, ZERO_OFFSET, FP16,
                                  PRECISION, ASM)
        else:  # accumulator j: output features 8c + j
            a0 += _n_field_dot(xv, words, zero_words, s_row, m_row, xsum, c, c_mask, 0, BITS, AWQ_ORDER, ZERO_OFFSET,
                               HAS_MINS, UPCAST, PRECISION, ASM)
            a1 += _n_field_dot(xv, words, zero_words, s_row, m_row, xsum, c, c_mask, 1, BITS, AWQ_ORDER, ZERO_OFFSET,
                               HAS_MINS, UPCAST, PRECISION, ASM)
            a2 += _n_field_dot(xv, words, zero_words, s_row, m_row, xsum, c, c_mask, 2, BITS, AWQ_ORDER, ZERO_OFFSET,
                               HAS_MINS, UPCAST, PRECISION, ASM)
            a3 += _n_field_dot(xv, words, zero_words, s_row, m_row, xsum, c, c_mask, 3, BITS, AWQ_ORDER, ZERO_OFFSET,
                               HAS_MINS, UPCAST, PRECISION, ASM)
            a4 += _n_field_dot(xv, words, zero_words, s_row, m_row, xsum, c, c_mask, 4, BITS, AWQ_ORDER, ZERO_OFFSET,
                               HAS_MINS, UPCAST, PRECISION, ASM)
            a5 += _n_field_dot(xv, words, zero_words, s_row, m_row, xsum, c, c_mask, 5, BITS, AWQ_ORDER, ZERO_OFFSET,
                               HAS_MINS, UPCAST, PRECISION, ASM)
            a6 += _n_field_dot(xv, words, zero_words, s_row, m_row, xsum, c, c_mask, 6, BITS, AWQ_ORDER, ZERO_OFFSET,
                               HAS_MINS, UPCAST, PRECISION, ASM)
            a7 += _n_field_dot(xv, words, zero_words, s_row, m_row, xsum, c, c_mask, 7, BITS, AWQ_ORDER, ZERO_OFFSET,
                               HAS_MINS, UPCAST, PRECISION, ASM)
    if BIASED and AWQ_ORDER:  # output j is field (j % 2) * 4 + j // 2
        return interleave8(a0, a4, a1, a5, a2, a6, a3, a7)
    return interleave8(a0, a1, a2, a3, a4, a5, a6, a7)


@triton.jit
def _k_field_dot(acc, x_ptr, rows, row_mask, stride_x, k0, words, zterm_words, zero_fields, s_rows, m_rows,
                 J: tl.constexpr, BITS: tl.constexpr, ZERO_OFFSET: tl.constexpr, HAS_MINS: tl.constexpr,
                 ROW_SCALES: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, ASM: tl.constexpr,
                 BLOCK_R: tl.constexpr):
    """acc + x's input features P r + j times the dequantized values j of words [BLOCK_R, BLOCK_N] (packed along
    K): unscaled (q - z: the caller scales a K tile's sum), or with ROW_SCALES (several groups a K tile) scaled
    here, a group's scales (and mins) a word row of s_rows (m_rows), zterm_words then [BLOCK_R, BLOCK_N]."""
    H: tl.constexpr = 16 // BITS
    SH: tl.constexpr = BITS * (J % H)
    xj = _k_field_x(x_ptr, rows, row_mask, stride_x, k0, J, 32 // BITS, UPCAST, BLOCK_R)
    v = field_magic(words, J, BITS, ASM)
    if HAS_MINS:
        zterm = tl.full([1, 1], -(1 << (23 - SH)), tl.float32)
    elif ROW_SCALES:
        zterm = field_zero_term(zterm_words, zero_fields[None, :], ZERO_OFFSET, BITS, SH)
    else:
        zterm = field_zero_term(zterm_words, zero_fields, ZERO_OFFSET, BITS, SH)[None, :]
    d = minus_z(v, zterm, SH)
    if ROW_SCALES:  # W itself, as the reference dequantizes it: (q - z) * scale, or q * scale + min
        d = d * s_rows
        if HAS_MINS:
            d = d + m_rows
    return tl.dot(xj, d.to(xj.dtype), acc, input_precision=PRECISION)


@triton.jit
def _k_field_x(x_ptr, rows, row_mask, stride_x, k0, J: tl.constexpr, P: tl.constexpr, UPCAST: tl.constexpr,
               BLOCK_R: tl.constexpr):
    """x's input features P r + J of the K tile at k0 (field J of its BLOCK_R word rows), the dot's operand."""
    ks = k0 + tl.arange(0, BLOCK_R) * P + J
    xj = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=row_mask[:, None], other=0.0)
    if UPCAST:
        xj = xj.to(tl.float32)
    return xj


@triton.jit
def _k_byte_field_dot(acc, x_ptr, rows, row_mask, stride_x, k0, d, J: tl.constexpr, UPCAST: tl.constexpr,
                      PRECISION: tl.constexpr, BLOCK_R: tl.constexpr):
    """acc + x's input features 8r + J times d = q - z of field J of the words [BLOCK_R, BLOCK_N] (4 bits, packed
    along K; `byte_fields`), unscaled."""
    xj = _k_field_x(x_ptr, rows, row_mask, stride_x, k0, J, 8, UPCAST, BLOCK_R)
    return tl.dot(xj, d.to(xj.dtype), acc, input_precision=PRECISION)


@triton.jit
def _k_packed_tile(x_ptr, qw_ptr, qz_ptr, s_ptr, rows, row_mask, stride_x, stride_qw, stride_qz, stride_s, n0, N,
                   k_begin, k_end, group_size, BITS: tl.constexpr, ZERO_OFFSET: tl.constexpr, HAS_MINS: tl.constexpr,
                   ROW_SCALES: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, ASM: tl.constexpr,
                   BIASED: tl.constexpr, FP16: tl.constexpr, EVEN_N: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """float32 [BLOCK_M, BLOCK_N]: x's rows times W.T's columns n0 .. n0 + BLOCK_N, K from k_begin to k_end (whole
    K tiles), for qweight packed along K (P = 32 / BITS a word) with zero points packed along N (or mins).
    ROW_SCALES: groups smaller than the K tile (GGUF's 32 and 16; whole word rows, whole groups a tile), each word
    row's group's zeros, scales and mins read with its words and applied before the dots."""
    P: tl.constexpr = 32 // BITS
    BLOCK_R: tl.constexpr = BLOCK_K // P
    cols = n0 + tl.arange(0, BLOCK_N)
    n_mask = cols < N
    zero_fields = cols % P
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        prow = k0 // P + tl.arange(0, BLOCK_R)
        if EVEN_N:
            words = tl.load(qw_ptr + prow[:, None] * stride_qw + cols[None, :])
        else:
            words = tl.load(qw_ptr + prow[:, None] * stride_qw + cols[None, :], mask=n_mask[None, :], other=0)
        g = k0 // group_size
        s_rows = zero_fields  # (ROW_SCALES only)
        m_rows = zero_fields
        if ROW_SCALES:  # the group of each word row: group_size / P rows a group
            groups = (k0 // P + tl.arange(0, BLOCK_R)) // (group_size // P)
            s_rows = tl.load(s_ptr + groups[:, None] * stride_s + cols[None, :], mask=n_mask[None, :],
                             other=0.0).to(tl.float32)
            if HAS_MINS:
                zterm_words = zero_fields
                m_rows = tl.load(qz_ptr + groups[:, None] * stride_qz + cols[None, :], mask=n_mask[None, :],
                                 other=0.0).to(tl.float32)
            else:
                zterm_words = tl.load(qz_ptr + groups[:, None] * stride_qz + (cols // P)[None, :],
                                      mask=n_mask[None, :], other=0)
        elif HAS_MINS:
            zterm_words = zero_fields
        else:
            zterm_words = tl.load(qz_ptr + g * stride_qz + cols // P, mask=n_mask, other=0)
        part = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if BIASED:  # q - z of each field: the zero point is the column's, the same for its 8 fields
            z = zero_points(zterm_words, zero_fields, ZERO_OFFSET, 4)[None, :]
            for byte in tl.static_range(4):  # unrolled: a byte's two fields each
                lo, hi = byte_fields(words, z, z, byte, FP16, ASM)
                part = _k_byte_field_dot(part, x_ptr, rows, row_mask, stride_x, k0, lo, 2 * byte, UPCAST, PRECISION,
                                         BLOCK_R)
                part = _k_byte_field_dot(part, x_ptr, rows, row_mask, stride_x, k0, hi, 2 * byte + 1, UPCAST,
                                         PRECISION, BLOCK_R)
        else:
            for j in tl.static_range(P):  # unrolled: field j of every word
                part = _k_field_dot(part, x_ptr, rows, row_mask, stride_x, k0, words, zterm_words, zero_fields, s_rows,
                                    m_rows, j, BITS, ZERO_OFFSET, HAS_MINS, ROW_SCALES, UPCAST, PRECISION, ASM, BLOCK_R)
        if ROW_SCALES:
            acc += part
        else:
            acc += part * tl.load(s_ptr + g * stride_s + cols, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if HAS_MINS and not ROW_SCALES:
            ks = k0 + tl.arange(0, BLOCK_K)
            xv = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=row_mask[:, None], other=0.0)
            mins = tl.load(qz_ptr + g * stride_qz + cols, mask=n_mask, other=0.0).to(tl.float32)
            acc += tl.sum(xv.to(tl.float32), axis=1)[:, None] * mins[None, :]
    return acc


@triton.jit(do_not_specialize=["M"])  # a batch's rows pick no new variant (1 and multiples of 16 would)
def _int_decode_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, M, N, K, group_size,
    stride_x, stride_qw, stride_qz, stride_s, stride_o, up_col, up_word,
    BITS: tl.constexpr, PACKED_ALONG_K: tl.constexpr, AWQ_ORDER: tl.constexpr, ZERO_OFFSET: tl.constexpr,
    HAS_MINS: tl.constexpr, ROW_SCALES: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, ASM: tl.constexpr, BIASED: tl.constexpr, FP16: tl.constexpr,
    EVEN_N: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """out [M, N] = x @ W.T (gated: silu(gate) * up of columns n and up_col + n; up_word = up_col / P) for the tile
    of output features column_tile * BLOCK_N on and the rows row_tile * BLOCK_M on, over the program_id(1)-th of
    SPLIT_K slices of K (K and the slices whole K tiles). program_id(0) = column_tile * row tiles + row_tile: a
    column tile's row tiles are neighbours, so they run together and read its packed words from the L2 once
    fetched; split K counts each (column tile, row tile) apart."""
    tl.static_assert(not (BIASED and HAS_MINS), "the B + q path has zero points, not mins")
    tl.static_assert(not (BIASED and ROW_SCALES), "the B + q path scales a K tile's sum")
    wait_for_prior(PDL)
    row_tiles = tl.cdiv(M, BLOCK_M)
    n0 = tl.program_id(0) // row_tiles * BLOCK_N
    row0 = tl.program_id(0) % row_tiles * BLOCK_M
    x_ptr += row0 * stride_x  # the K loop indexes the tile's rows from 0, as with one row tile
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < M - row0
    per_slice = tl.cdiv(K // BLOCK_K, SPLIT_K) * BLOCK_K
    k_begin = tl.program_id(1) * per_slice
    k_end = tl.minimum(K, k_begin + per_slice)
    P: tl.constexpr = 32 // BITS
    if PACKED_ALONG_K:
        acc = _k_packed_tile(x_ptr, qw_ptr, qz_ptr, s_ptr, rows, row_mask, stride_x, stride_qw, stride_qz, stride_s,
                             n0, N, k_begin, k_end, group_size, BITS, ZERO_OFFSET, HAS_MINS, ROW_SCALES, UPCAST,
                             PRECISION, ASM, BIASED, FP16, EVEN_N, BLOCK_M, BLOCK_N, BLOCK_K)
        acc_up = acc
        if GATED:
            acc_up = _k_packed_tile(x_ptr, qw_ptr, qz_ptr, s_ptr, rows, row_mask, stride_x, stride_qw, stride_qz,
                                    stride_s, up_col + n0, up_col + N, k_begin, k_end, group_size, BITS, ZERO_OFFSET,
                                    HAS_MINS, ROW_SCALES, UPCAST, PRECISION, ASM, BIASED, FP16, EVEN_N, BLOCK_M,
                                    BLOCK_N, BLOCK_K)
    else:
        c0 = tl.program_id(0) // row_tiles * (BLOCK_N // P)  # a product, not n0 // P: 16-byte loads
        acc = _n_packed_tile(x_ptr, qw_ptr, qz_ptr, s_ptr, rows, row_mask, stride_x, stride_qw, stride_qz, stride_s,
                             c0, N // P, k_begin, k_end, group_size, BITS, AWQ_ORDER, ZERO_OFFSET, HAS_MINS,
                             UPCAST, PRECISION, ASM, BIASED, FP16, EVEN_N, BLOCK_M, BLOCK_N // P, BLOCK_K)
        acc_up = acc
        if GATED:
            acc_up = _n_packed_tile(x_ptr, qw_ptr, qz_ptr, s_ptr, rows, row_mask, stride_x, stride_qw, stride_qz,
                                    stride_s, up_word + c0, up_word + N // P, k_begin, k_end, group_size,
                                    BITS, AWQ_ORDER, ZERO_OFFSET, HAS_MINS, UPCAST, PRECISION, ASM, BIASED, FP16,
                                    EVEN_N, BLOCK_M, BLOCK_N // P, BLOCK_K)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows += row0
    if SPLIT_K == 1:
        store_output(acc, acc_up, out_ptr, bias_ptr, rows, row_mask, offs_n, n_mask, stride_o, up_col, HAS_BIAS,
                     GATED)
    else:
        tile = rows[:, None] * N + offs_n[None, :]
        mask = row_mask[:, None] & n_mask[None, :]
        slot = row_tiles * BLOCK_M * N  # a slice's half of the workspace: [SPLIT_K, 2, row tiles x BLOCK_M, N]
        if store_split_k_slice(acc, acc_up, part_ptr, count_ptr, tile, mask, slot, GATED, SPLIT_K):
            _sum_slices(part_ptr, out_ptr, bias_ptr, row0, tl.minimum(row0 + BLOCK_M, M), N, offs_n, n_mask,
                        stride_o, up_col, slot, HAS_BIAS, GATED, SPLIT_K)


@triton.jit
def _sum_slices(part_ptr, out_ptr, bias_ptr, row_begin, row_end, N, offs_n, n_mask, stride_o, up_col, slot,
                HAS_BIAS: tl.constexpr, GATED: tl.constexpr, SPLIT_K: tl.constexpr):
    """Split K's last program: the tile's SPLIT_K slices added up (in slice order: the same sums whichever program
    is last) and stored, a row at a time, the tile's real rows (row_begin to row_end) only. A row's slices are
    independent loads from L2 (unrolled: all in flight at once), one round trip a row. The loop it replaced
    (2026-12-06) added the padded 16-row tile a slice at a time, not unrolled (unrolled, SPLIT_K such tiles were
    live at once: spills), so it waited for a round trip a slice; on an H100 this made Llama-3-8B's o 11.9 -> 8.5
    us at 1 row and its AWQ decode 3.60 -> 3.22 ms/token (benchmarks/results/h100-kernels-tune-int4-sum-rows.json,
    h100-latency-llama3-8b-awq-sum-rows-{before,after}.json)."""
    for m in range(row_begin, row_end):
        acc, acc_up = row_of_slices(part_ptr + m * N + offs_n, n_mask, slot, GATED, SPLIT_K)
        row = tl.full([1], m, tl.int32)
        store_output(acc[None, :], acc_up[None, :], out_ptr, bias_ptr, row, row < row_end, offs_n, n_mask,
                     stride_o, up_col, HAS_BIAS, GATED)


@triton.jit
def row_of_slices(row_ptr, n_mask, slot, GATED: tl.constexpr, SPLIT_K: tl.constexpr):
    """(acc, acc_up) float32 [BLOCK_N]: one output row's SPLIT_K slices of a split-K workspace ([SPLIT_K, 2, ...],
    `slot` elements a half) added in slice order, from the L2."""
    acc = tl.zeros(n_mask.shape, tl.float32)
    acc_up = tl.zeros(n_mask.shape, tl.float32)
    for split in tl.static_range(SPLIT_K):
        acc += tl.load(row_ptr + split * 2 * slot, mask=n_mask, other=0.0, cache_modifier=".cg")
        if GATED:
            acc_up += tl.load(row_ptr + split * 2 * slot + slot, mask=n_mask, other=0.0, cache_modifier=".cg")
    return acc, acc_up


def can_stream(packing, g_idx, group_size: int, in_features: int, out_features: int, num_rows: int,
               max_rows: int) -> bool:
    """Whether `_int_decode_kernel` takes this layer: no g_idx, 4 or 8 bits; along N (AWQ, 4 bits, whole words of
    output features in each half) K tiles inside one group, groups of a multiple of 32; along K groups of a multiple
    of 16 words (K tiles inside one group), or whole word rows dividing 16 words (several groups a K tile,
    `ROW_SCALES`: GGUF's 32 and 16, GPTQ's 32)."""
    if g_idx is not None or num_rows > max_rows or packing.bits not in (4, 8) or in_features % group_size:
        return False
    if packing.is_packed_along_k:  # a dot of each field spans BLOCK_K / P >= 16 input features
        tile, p = 16 * packing.pack_factor, packing.pack_factor
        return group_size % tile == 0 or (group_size % p == 0 and tile % group_size == 0 and in_features % tile == 0)
    return packing.bits == 4 and group_size % 32 == 0 and out_features % 8 == 0


def has_row_scales(packed_along_k: bool, group_size: int, pack_factor: int) -> bool:
    """Whether a K tile of 16 words or more holds several of a streamed layer's groups (`ROW_SCALES`: each word
    row's scales applied before the dots); `can_stream` must hold."""
    return packed_along_k and group_size < 16 * pack_factor


def can_pair_unpack(packing, x_dtype: torch.dtype, has_mins: bool) -> bool:
    """Whether the B + q unpacking (`int_tiles.byte_fields`) can take this layer: 4-bit fields with zero points
    (not GGUF's mins), bf16 or fp16 x."""
    return packing.bits == 4 and not has_mins and x_dtype in (torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=None)
def stream_config(num_rows: int, out_features: int, in_features: int, group_size: int, packed_along_k: bool,
                  gated: bool, x_itemsize: int, device: torch.device, pack_factor: int,
                  row_tile: int | None = None) -> dict:
    """Launch settings: BLOCK_N output features (256 packed along N: 32 words a K row, 8 per warp; 128 along K),
    K tiles of up to 128 inside one group (whole groups of 32 / 64 along N; along K, 16 words a field's dot), 4
    stages of cp.async (3 tiles of 16 KB in flight a program), and split-K until the column tiles times the slices
    cover the SMs (slices of at least 4 K tiles). A float32 x (the GPU oracle tests'; its dot in float32) takes 64
    columns, K tiles of 32 along N. Past 16 rows: tiles of `row_tile` (ROW_TILE) rows, the split counting every
    (column tile, row tile).

    The split: about two programs an SM (2 x SMs // column tiles, at most MAX_SPLIT_K, slices of at least 2 K
    tiles), then as few slices as give the same slice length (none empty). On the H200 this was the best or within
    6% of the best of splits 2-16 for each of Llama-3-8B's and 70B's linears at 1 row (`python -m benchmarks.kernels
    --only int4 --tune`, benchmarks/results/h200-kernels-tune-int4-splits.json), 1.0-1.5x faster than the first
    rule (enough programs to cover the SMs once); the tiles were the best of those swept (`-tiles.json`)."""
    if x_itemsize == 4:  # its dot without tensor cores holds wide float32 operands in registers: 256 x 64 spilled KBs
        block_n, block_k = 64, 128 if packed_along_k else 32
    else:
        block_n, block_k = (128, 128) if packed_along_k else (256, 128)
    if has_row_scales(packed_along_k, group_size, pack_factor):
        while in_features % block_k:  # K whole tiles (can_stream: of 16 words)
            block_k //= 2
    else:
        while group_size % block_k:  # the largest power of two dividing the group (can_stream: >= 32, >= 16 words)
            block_k //= 2
    block_m = 16 if num_rows <= 16 else min(row_tile or ROW_TILE, next_power_of_2(num_rows))
    split = split_k(cdiv(out_features, block_n) * cdiv(num_rows, block_m), in_features // block_k, device)
    stages = 3 if x_itemsize == 4 else 4  # float32 x (the GPU oracle tests'): 4 spilled its gated tiles along K
    row_bytes = block_m * x_itemsize + block_n // 2 * (2 if gated else 1)  # x's tile and the packed words, a K row
    while stages > 2 and stages * block_k * row_bytes > shared_memory_per_block(device) // 2:
        stages -= 1
    # several groups a K tile, gated: gate's and up's scale (and min) tiles live beside their words (4 warps
    # spilled); 64 rows: eight [64, 32] float32 accumulators, 128 registers a thread over 4 warps
    warps = 8 if (gated and group_size < block_k) or block_m >= 64 else 4
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split, "num_warps": warps,
            "num_stages": stages}


def split_k(num_tiles: int, k_tiles: int, device: torch.device) -> int:
    """Slices of K for `num_tiles` column tiles (the rule in `stream_config`'s docstring): about two programs an
    SM, at most MAX_SPLIT_K, slices of at least 2 of the k_tiles K tiles, then as few as give the same length."""
    split = max(1, min(MAX_SPLIT_K, 2 * num_sms(device) // max(num_tiles, 1), k_tiles // 2))
    return cdiv(k_tiles, cdiv(k_tiles, split))


def linear_int_stream(x, qweight, zero_term, scales, group_size: int, packing, bias, gated: bool, has_mins: bool,
                      upcast: bool, precision: str, config: dict | None = None) -> torch.Tensor:
    """Launches `_int_decode_kernel` on checked inputs (linear_int_triton checks them; `can_stream` must hold)."""
    num_rows, k = x.shape
    n = (qweight.shape[1] if packing.is_packed_along_k else qweight.shape[1] * packing.pack_factor)
    out_features = n // 2 if gated else n
    out = torch.empty(num_rows, out_features, dtype=x.dtype, device=x.device)
    cfg = stream_config(num_rows, out_features, k, group_size, packing.is_packed_along_k, gated, x.dtype.itemsize,
                        x.device, packing.pack_factor) | (config or {})
    row_scales = group_size < cfg["BLOCK_K"]
    assert (cfg["BLOCK_K"] % group_size == 0 and packing.is_packed_along_k if row_scales
            else group_size % cfg["BLOCK_K"] == 0), (group_size, cfg)
    assert max(qweight.numel(), x.numel(), out.numel()) < 2**31, "int32 offsets"
    can_biased = can_pair_unpack(packing, x.dtype, has_mins) and not row_scales
    biased = cfg.get("BIASED", PAIR_UNPACK and can_biased)
    if biased and not can_biased:
        raise ValueError(f"BIASED needs 4-bit fields with zero points, a K tile inside one group and bf16 / fp16 x, "
                         f"not {packing}, groups of {group_size} and {x.dtype}")
    num_tiles, row_tiles = cdiv(out_features, cfg["BLOCK_N"]), cdiv(num_rows, cfg["BLOCK_M"])
    split = cfg["SPLIT_K"]
    counts = split_counts(x.device, num_tiles * row_tiles) if split > 1 else None
    if counts is None:
        split = 1
    parts = (torch.empty(split, 2, row_tiles * cfg["BLOCK_M"], out_features, dtype=torch.float32, device=x.device)
             if split > 1 else out)
    _int_decode_kernel[(num_tiles * row_tiles, split)](
        x, qweight, zero_term, scales, bias if bias is not None else scales, out, parts,
        counts if counts is not None else qweight, num_rows, out_features, k, group_size,
        x.stride(0), qweight.stride(0), zero_term.stride(0), scales.stride(0), out.stride(0), out_features,
        out_features // packing.pack_factor, BITS=packing.bits, PACKED_ALONG_K=packing.is_packed_along_k,
        AWQ_ORDER=packing.fields is not None,
        ZERO_OFFSET=packing.zero_offset, HAS_MINS=has_mins, ROW_SCALES=row_scales, HAS_BIAS=bias is not None,
        GATED=gated,
        UPCAST=upcast, PRECISION=precision, ASM=not is_interpreting(),
        BIASED=biased,
        FP16=x.dtype == torch.float16,
        EVEN_N=out_features % cfg["BLOCK_N"] == 0, SPLIT_K=split, BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], **pdl_options(x.device), num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return out
