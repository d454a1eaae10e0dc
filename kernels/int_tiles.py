"""The Triton device functions of kernels/linear_int.py: a [BLOCK_K, BLOCK_N] tile of W.T unpacked from its int32
words and dequantized in registers, and the K loop that feeds such tiles to tl.dot (the layouts are in
kernels/linear_int.py's docstring).

Two ways to unpack a tile (`UNPACK_ONCE`):

    per element   each of the BLOCK_K x BLOCK_N values loads the int32 holding it (the same word P = 32 / bits
                  times, from L1) and shifts out its field: any tile, any alignment
    once          the tile's BLOCK_K x BLOCK_N / P words (AWQ) or BLOCK_K / P x BLOCK_N (GPTQ), each loaded once,
                  broadcast against the P fields and reshaped to [BLOCK_K, BLOCK_N]: a P-th of the loads and of
                  the shared memory a pipelined load stages; needs tiles starting on whole words
"""

from __future__ import annotations

from kernels._triton import tl, triton


@triton.jit
def field_shift(j, BITS: tl.constexpr, AWQ_ORDER: tl.constexpr):
    """The shift of value j (of the 32 / BITS an int32 packs): AWQ's nibble (j % 2) * 4 + j // 2 (its order
    0 2 4 6 1 3 5 7 inverted), else field j."""
    if AWQ_ORDER:
        return ((j % 2) * 4 + j // 2) * BITS
    return j * BITS


@triton.jit
def packed_values(qw_ptr, k0, ks, k_mask, n0, cols, n_mask, n_end, K, stride_qw, BITS: tl.constexpr,
                  PACKED_ALONG_K: tl.constexpr, AWQ_ORDER: tl.constexpr, UNPACK_ONCE: tl.constexpr,
                  BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """int32 [BLOCK_K, BLOCK_N]: the unsigned integers of W.T at input features ks = k0 + arange(BLOCK_K) and
    output features cols = n0 + arange(BLOCK_N) (valid below K and n_end; masked ones read 0). UNPACK_ONCE needs
    k0 (GPTQ) or n0 and n_end (AWQ) multiples of P, and BLOCK_K / BLOCK_N too."""
    P: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    if UNPACK_ONCE:
        fields = tl.arange(0, P)
        if PACKED_ALONG_K:  # [BLOCK_K / P, BLOCK_N] words: input feature P r + j in field j of word row r
            prow = k0 // P + tl.arange(0, BLOCK_K // P)
            packed = tl.load(qw_ptr + prow[:, None] * stride_qw + cols[None, :],
                             mask=(prow < K // P)[:, None] & n_mask[None, :], other=0)
            q = (packed[:, None, :] >> (fields * BITS)[None, :, None]) & MASK  # [BLOCK_K / P, P, BLOCK_N]
        else:  # [BLOCK_K, BLOCK_N / P] words: output feature P c + j in field field_shift(j) of word column c
            pcol = n0 // P + tl.arange(0, BLOCK_N // P)
            packed = tl.load(qw_ptr + ks[:, None] * stride_qw + pcol[None, :],
                             mask=k_mask[:, None] & (pcol < n_end // P)[None, :], other=0)
            q = (packed[:, :, None] >> field_shift(fields, BITS, AWQ_ORDER)[None, None, :]) & MASK  # [K, N / P, P]
        values = tl.reshape(q, (BLOCK_K, BLOCK_N))
    else:
        mask = k_mask[:, None] & n_mask[None, :]
        if PACKED_ALONG_K:  # GPTQ: qweight [K / P, N]
            packed = tl.load(qw_ptr + (ks // P)[:, None] * stride_qw + cols[None, :], mask=mask, other=0)
            values = (packed >> ((ks % P) * BITS)[:, None]) & MASK
        else:  # AWQ: qweight [K, N / P]
            packed = tl.load(qw_ptr + ks[:, None] * stride_qw + (cols // P)[None, :], mask=mask, other=0)
            values = (packed >> field_shift(cols % P, BITS, AWQ_ORDER)[None, :]) & MASK
    return values


@triton.jit
def dequantized(q, qz_ptr, s_ptr, g_ptr, ks, k_mask, cols, n_mask, stride_qz, stride_s, group_size,
                ZERO_OFFSET: tl.constexpr, BITS: tl.constexpr, AWQ_ORDER: tl.constexpr, HAS_G_IDX: tl.constexpr,
                ONE_GROUP: tl.constexpr, HAS_MINS: tl.constexpr):
    """float32 [BLOCK_K, BLOCK_N]: the integers q of W.T at input features ks, output features cols, as
    (q - zero) * scale, or with HAS_MINS q * scale + min (qz_ptr then holds the mins, float [G, N], not packed
    zeros). ONE_GROUP: the tile's inputs are one group (no g_idx, BLOCK_K divides group_size), whose zeros and
    scales are one row of BLOCK_N, not a gather per element."""
    P: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    if ONE_GROUP:  # one row of zeros (or mins) and scales: [BLOCK_N], broadcast over the tile's rows
        group = tl.min(ks, axis=0) // group_size
        scale = tl.load(s_ptr + group * stride_s + cols, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if HAS_MINS:
            low = tl.load(qz_ptr + group * stride_qz + cols, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        else:
            zp = tl.load(qz_ptr + group * stride_qz + cols // P, mask=n_mask, other=0)
            zeros = (((zp >> field_shift(cols % P, BITS, AWQ_ORDER)) & MASK) + ZERO_OFFSET)[None, :]
    else:  # gathered per element: [BLOCK_K, BLOCK_N]
        mask = k_mask[:, None] & n_mask[None, :]
        if HAS_G_IDX:
            groups = tl.load(g_ptr + ks, mask=k_mask, other=0).to(tl.int64)
        else:
            groups = ks // group_size
        scale = tl.load(s_ptr + groups[:, None] * stride_s + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_MINS:
            low = tl.load(qz_ptr + groups[:, None] * stride_qz + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        else:
            zp = tl.load(qz_ptr + groups[:, None] * stride_qz + (cols // P)[None, :], mask=mask, other=0)
            zeros = ((zp >> field_shift(cols % P, BITS, AWQ_ORDER)[None, :]) & MASK) + ZERO_OFFSET
    if HAS_MINS:  # if / else, not an early return: the compiler would still visit what follows it
        w = q.to(tl.float32) * scale + low
    else:
        w = (q - zeros).to(tl.float32) * scale
    return w


@triton.jit
def weight_tile(qw_ptr, qz_ptr, s_ptr, g_ptr, k0, ks, k_mask, n0, cols, n_mask, n_end, K, stride_qw, stride_qz,
                stride_s, group_size, ZERO_OFFSET: tl.constexpr, BITS: tl.constexpr, PACKED_ALONG_K: tl.constexpr,
                AWQ_ORDER: tl.constexpr, HAS_G_IDX: tl.constexpr, ONE_GROUP: tl.constexpr, HAS_MINS: tl.constexpr,
                UNPACK_ONCE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """float32 [BLOCK_K, BLOCK_N]: W.T dequantized at input features ks, output features cols (`packed_values`,
    then `dequantized`)."""
    q = packed_values(qw_ptr, k0, ks, k_mask, n0, cols, n_mask, n_end, K, stride_qw, BITS, PACKED_ALONG_K,
                      AWQ_ORDER, UNPACK_ONCE, BLOCK_K, BLOCK_N)
    return dequantized(q, qz_ptr, s_ptr, g_ptr, ks, k_mask, cols, n_mask, stride_qz, stride_s, group_size,
                       ZERO_OFFSET, BITS, AWQ_ORDER, HAS_G_IDX, ONE_GROUP, HAS_MINS)


@triton.jit
def rounded_tile_dot(xv, qw_ptr, qz_ptr, s_ptr, g_ptr, k0, ks, k_mask, n0, cols, n_mask, n_end, K, stride_qw,
                     stride_qz, stride_s, group_size, ZERO_OFFSET: tl.constexpr, BITS: tl.constexpr,
                     PACKED_ALONG_K: tl.constexpr, AWQ_ORDER: tl.constexpr, HAS_G_IDX: tl.constexpr,
                     ONE_GROUP: tl.constexpr, HAS_MINS: tl.constexpr, UNPACK_ONCE: tl.constexpr,
                     UPCAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """float32 [rows, BLOCK_N]: x's tile xv times `weight_tile`'s W.T rounded to xv's dtype, as the reference
    rounds it (UPCAST: both operands float32 for the dot, the interpreter's)."""
    w = weight_tile(qw_ptr, qz_ptr, s_ptr, g_ptr, k0, ks, k_mask, n0, cols, n_mask, n_end, K, stride_qw, stride_qz,
                    stride_s, group_size, ZERO_OFFSET, BITS, PACKED_ALONG_K, AWQ_ORDER, HAS_G_IDX, ONE_GROUP,
                    HAS_MINS, UNPACK_ONCE, BLOCK_K, BLOCK_N).to(xv.dtype)
    if UPCAST:
        xv = xv.to(tl.float32)
        w = w.to(tl.float32)
    return tl.dot(xv, w, input_precision=PRECISION)


# The streaming decode kernel's arithmetic (kernels/int_decode.py): no integer-to-float conversion, no per-element
# shift. A field of BITS bits that sits at bit SH < 16 of a word (the upper 16 bits shifted down once a word) is
# OR-ed into the mantissa of 2^23, giving the float 2^23 + q * 2^SH exactly; then one FMA, exact too,
#     d = v * 2^-SH + (-(2^23 + z * 2^SH) * 2^-SH) = q - z
# (both products are exact: powers of two), and q - z (|q - z| <= 2^BITS) is exact in bf16 and fp16 for the dot.
# 0x4B000000: the bits of 2^23 in float32 (a literal in the kernels: they read no Python globals)


@triton.jit
def lop3_or(a, MASK: tl.constexpr, ASM: tl.constexpr):
    """(a & MASK) | 0x4B000000 (2^23's bits), int32: one lop3 on a GPU (ASM; LLVM emits an and and an or: ptxas
    takes one immediate per instruction), plain operators under the interpreter."""
    if ASM:
        out = tl.inline_asm_elementwise("lop3.b32 $0, $1, $2, $3, 0xEA;", "=r,r,r,r",
                                        [a, tl.full(a.shape, MASK, tl.int32), tl.full(a.shape, 0x4B000000, tl.int32)],
                                        dtype=tl.int32, is_pure=True, pack=1)
    else:
        out = (a & MASK) | 0x4B000000
    return out


@triton.jit
def field_magic(words, F: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr):
    """float32 2^23 + q * 2^(BITS * (F % H)), H = 16 // BITS fields a half word: field F of each int32 word."""
    H: tl.constexpr = 16 // BITS
    if F >= H:  # the upper half first shifted down (once a word: the same expression for each such field)
        words = (words.to(tl.uint32, bitcast=True) >> 16).to(tl.int32, bitcast=True)
    return lop3_or(words, ((1 << BITS) - 1) << (BITS * (F % H)), ASM).to(tl.float32, bitcast=True)


@triton.jit
def zero_points(zero_words, F_OF_ZERO, ZERO_OFFSET: tl.constexpr, BITS: tl.constexpr):
    """int32: the zero points z = field F_OF_ZERO (a constant or a tensor) of zero_words + ZERO_OFFSET."""
    return ((zero_words >> (F_OF_ZERO * BITS)) & ((1 << BITS) - 1)) + ZERO_OFFSET


@triton.jit
def field_zero_term(zero_words, F_OF_ZERO, ZERO_OFFSET: tl.constexpr, BITS: tl.constexpr, SH: tl.constexpr):
    """float32 -(2^23 + z * 2^SH) * 2^-SH for the zero points z (`zero_points`): the additive term of
    `field_magic`'s FMA (a row of them a tile, not a per-element cost)."""
    z = zero_points(zero_words, F_OF_ZERO, ZERO_OFFSET, BITS)
    return -((z << SH) | 0x4B000000).to(tl.float32, bitcast=True) * (1.0 / (1 << SH))


@triton.jit
def minus_z(v, zterm, SH: tl.constexpr):
    """q - z from v = 2^23 + q * 2^SH and zterm = -(2^23 + z * 2^SH) * 2^-SH: one exact FMA."""
    return v * (1.0 / (1 << SH)) + zterm


# The 16-bit decode path (kernels/int_decode.py, 4-bit fields, bf16 or fp16 x): each field becomes B + q in x's
# dtype, exactly (B = 128 in bf16: 0x4300's mantissa holds q in its 7 bits; B = 1024 in fp16: 0x6400's, 10 bits),
# and B + z comes off it in the same 16-bit pair instruction: q - z, exact, no per-value conversion.


@triton.jit
def byte_fields(words, zero_low, zero_high, BYTE: tl.constexpr, FP16: tl.constexpr, ASM: tl.constexpr):
    """(low, high): q - z of the 4-bit fields 2 BYTE and 2 BYTE + 1 (byte BYTE's nibbles) of each int32 word, in
    fp16 (FP16) or bf16, zero_low / zero_high (int32, broadcast against words) their zero points. On a GPU, for each
    two neighbouring words of a thread (which the MMA's operand layout packs into one register of two 16-bit
    values, the same column's zero point): one prmt puts byte BYTE of each in bytes 0 and 2, one lop3 ORs the low
    nibbles into two B's mantissas (B + q), a shift and a second lop3 the high ones, and a 16-bit pair subtraction
    of B + z each: 6 instructions for 4 values. The interpreter takes plain integer operators (float32 out)."""
    if ASM:
        bias: tl.constexpr = 1024 if FP16 else 128
        sel = tl.full(words.shape, BYTE | (BYTE << 4) | ((4 + BYTE) << 8) | ((4 + BYTE) << 12), tl.int32)
        magic = tl.full(words.shape, 0x64006400 if FP16 else 0x43004300, tl.int32)
        mask = tl.full(words.shape, 0x000F000F, tl.int32)
        # B + z as float32 through 2^23's mantissa (no integer-to-float conversion), then x's dtype (exact)
        zl = ((zero_low + bias) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        zh = ((zero_high + bias) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        # pack=2: $0 $1 the two outputs (a 16-bit pair each), $2 $3 the two words, $4 $5 the zero points (a 16-bit
        # pair each), then sel's, mask's and magic's pairs (the first of each used)
        dtype = tl.float16 if FP16 else tl.bfloat16
        low, high = tl.inline_asm_elementwise(
            "{ .reg .b32 t; prmt.b32 t, $2, $3, $6; lop3.b32 $0, t, $8, $10, 0xEA; shr.u32 t, t, 4; "
            "lop3.b32 $1, t, $8, $10, 0xEA; " + ("sub.f16x2 $0, $0, $4; sub.f16x2 $1, $1, $5; }" if FP16 else
                                              "sub.bf16x2 $0, $0, $4; sub.bf16x2 $1, $1, $5; }"),
            "=r,=r,r,r,r,r,r,r,r,r,r,r",
            [words, tl.broadcast_to(zl.to(dtype), words.shape), tl.broadcast_to(zh.to(dtype), words.shape), sel,
             mask, magic], dtype=(dtype, dtype), is_pure=True, pack=2)
    else:
        low = (((words >> (8 * BYTE)) & 15) - zero_low).to(tl.float32)
        high = (((words >> (8 * BYTE + 4)) & 15) - zero_high).to(tl.float32)
    return low, high


# The GEMM tiles' 4-bit path (kernels/linear_int.py `_int_linear_kernel`, PAIRS): AWQ's nibble order puts columns
# 2i and 2i + 1 of a word in nibbles i and i + 4, so one lop3 with 0x000F000F (the word shifted by 4i) ORs both into
# the mantissas of a pair of B's (B = 128 in bf16, 1024 in fp16): B + q of two neighbouring columns, in order, in one
# register. Eight columns from 3 shifts and 4 lop3s, B + z off in 4 pair subtractions (q - z, exact): a word becomes
# 16 contiguous bytes of the [K, N] tile, as the tensor cores' shared-memory operand takes it.


@triton.jit
def awq_zero_pairs(zero_words, ZERO_OFFSET: tl.constexpr, FP16: tl.constexpr):
    """(B + z) of columns (0, 1), (2, 3), (4, 5), (6, 7) of each zero word, as int32 bit patterns of 16-bit pairs
    (z + ZERO_OFFSET: the integer add reaches the mantissas, which hold up to 127 in bf16)."""
    magic: tl.constexpr = 0x64006400 if FP16 else 0x43004300
    offset: tl.constexpr = ZERO_OFFSET * 0x00010001
    z01, z23, z45, z67 = tl.inline_asm_elementwise(
        "{ .reg .b32 t; lop3.b32 $0, $4, 0x000F000F, $5, 0xEA; "
        "shr.u32 t, $4, 4; lop3.b32 $1, t, 0x000F000F, $5, 0xEA; "
        "shr.u32 t, $4, 8; lop3.b32 $2, t, 0x000F000F, $5, 0xEA; "
        "shr.u32 t, $4, 12; lop3.b32 $3, t, 0x000F000F, $5, 0xEA; }",
        "=r,=r,=r,=r,r,r", [zero_words, tl.full(zero_words.shape, magic, tl.int32)],
        dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
    return z01 + offset, z23 + offset, z45 + offset, z67 + offset


@triton.jit
def awq_columns_tile(words, zero_words, ZERO_OFFSET: tl.constexpr, FP16: tl.constexpr, ASM: tl.constexpr):
    """[BLOCK_K, BLOCK_N] in fp16 (FP16) or bf16: q - z of the 4-bit words [BLOCK_K, BLOCK_N / 8] packed along N in
    AWQ's order, zero_words [BLOCK_N / 8] their group's zero points (+ ZERO_OFFSET), exactly. On a GPU (ASM) by
    the pairs above; the interpreter takes plain integer operators."""
    dtype = tl.float16 if FP16 else tl.bfloat16
    if ASM:
        z01, z23, z45, z67 = awq_zero_pairs(zero_words, ZERO_OFFSET, FP16)
        magic = tl.full(words.shape, 0x64006400 if FP16 else 0x43004300, tl.int32)
        c0, c1, c2, c3, c4, c5, c6, c7 = tl.inline_asm_elementwise(
            "{ .reg .b32 t, a, b, c, d; "
            "lop3.b32 a, $8, 0x000F000F, $13, 0xEA; "
            "shr.u32 t, $8, 4; lop3.b32 b, t, 0x000F000F, $13, 0xEA; "
            "shr.u32 t, $8, 8; lop3.b32 c, t, 0x000F000F, $13, 0xEA; "
            "shr.u32 t, $8, 12; lop3.b32 d, t, 0x000F000F, $13, 0xEA; "
            + ("sub.f16x2 a, a, $9; sub.f16x2 b, b, $10; sub.f16x2 c, c, $11; sub.f16x2 d, d, $12; " if FP16 else
               "sub.bf16x2 a, a, $9; sub.bf16x2 b, b, $10; sub.bf16x2 c, c, $11; sub.bf16x2 d, d, $12; ")
            + "mov.b32 {$0, $1}, a; mov.b32 {$2, $3}, b; mov.b32 {$4, $5}, c; mov.b32 {$6, $7}, d; }",
            "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r,r,r",
            [words, tl.broadcast_to(z01[None, :], words.shape), tl.broadcast_to(z23[None, :], words.shape),
             tl.broadcast_to(z45[None, :], words.shape), tl.broadcast_to(z67[None, :], words.shape), magic],
            dtype=(dtype, dtype, dtype, dtype, dtype, dtype, dtype, dtype), is_pure=True, pack=1)
    else:
        c0 = _minus_zero(words, zero_words, 0, ZERO_OFFSET).to(dtype)
        c1 = _minus_zero(words, zero_words, 1, ZERO_OFFSET).to(dtype)
        c2 = _minus_zero(words, zero_words, 2, ZERO_OFFSET).to(dtype)
        c3 = _minus_zero(words, zero_words, 3, ZERO_OFFSET).to(dtype)
        c4 = _minus_zero(words, zero_words, 4, ZERO_OFFSET).to(dtype)
        c5 = _minus_zero(words, zero_words, 5, ZERO_OFFSET).to(dtype)
        c6 = _minus_zero(words, zero_words, 6, ZERO_OFFSET).to(dtype)
        c7 = _minus_zero(words, zero_words, 7, ZERO_OFFSET).to(dtype)
    return interleave8(c0, c1, c2, c3, c4, c5, c6, c7)


@triton.jit
def interleave8(a0, a1, a2, a3, a4, a5, a6, a7):
    """[M, C] x 8 -> [M, 8 C], column 8c + j from a_j (tl.join adds its new dimension last: innermost)."""
    r = tl.join(tl.join(tl.join(a0, a4), tl.join(a2, a6)), tl.join(tl.join(a1, a5), tl.join(a3, a7)))
    return tl.reshape(r, (a0.shape[0], 8 * a0.shape[1]))


@triton.jit
def _minus_zero(words, zero_words, J: tl.constexpr, ZERO_OFFSET: tl.constexpr):
    """float32 q - z of column 8c + J (AWQ's nibble order: field (J % 2) * 4 + J // 2)."""
    F: tl.constexpr = (J % 2) * 4 + J // 2
    return (((words >> (4 * F)) & 15) - zero_points(zero_words, F, ZERO_OFFSET, 4)[None, :]).to(tl.float32)
