"""How an int layer holds each GGUF block type it serves (quantization="gguf"), exactly: pure Python, read by the
engine (engine/quantization.py: each linear's QuantConfig) and by checkpoints/gguf_blocks.py (the repacking).

Every type becomes integers q packed in int32 along K (4 bits, or 8 bits holding 5- and 6-bit values), a scale
per group and either a zero point of 2^(bits - 1) or an additive minimum per group:

    type   bits (stored)   group  scale                      w =                   gguf's own arithmetic
    Q4_0   4 (q)           32     d            fp16          (q - 8) * scale       d * (q - 8)
    Q8_0   8 (q + 128)     32     d            fp16          (q - 128) * scale     d * q
    Q5_0   8 (q + 112)     32     d            fp16          (q - 128) * scale     d * (q - 16)
    Q4_1   4 (q)           32     d, min m     fp16          q * scale + min       d * q + m
    Q5_1   8 (q)           32     d, min m     fp16          q * scale + min       d * q + m
    Q4_K   4 (q)           32     d * sc, -(dmin * m)  fp32  q * scale + min       (d * sc) * q - dmin * m
    Q5_K   8 (q)           32     d * sc, -(dmin * m)  fp32  q * scale + min       (d * sc) * q - dmin * m
    Q6_K   8 (q + 96)      16     d * sc       fp32          (q - 128) * scale     (d * sc) * (q - 32)

Each product of an integer and a scale is exact in float32 (at most 11 bits of d, 8 of sc, 6 of q), so the one
rounding left is the addition of a minimum, the same one gguf makes (and a fused multiply-add in the Triton
kernel makes, its product being exact): the result equals gguf's dequantization bit for bit. The k-quants'
scales d * sc (fp16 d times a 6-bit or int8 sc) and minimums need float32: fp16 would round them.

The trade-off: 5- and 6-bit values sit in 8 bits, so Q5_0 / Q5_1 / Q5_K / Q6_K linears read 8 bits a weight
(plus their scales: 8.5 for Q5_0, 9 for Q5_1, 10 for Q5_K and Q6_K, whose float32 scales and minimums cost 2 bits
a weight at groups of 32 and 16), against 5.5 to 6.6 in the file; Q4_K reads 6 (4 + float32 scale and minimum a
32), against 4.5. Still well under the 16 of a dequantized fp16 / bf16 weight.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GGUFIntLayout:
    bits: int  # the int layer's field width: 4, or 8 for 5- and 6-bit values
    group_size: int  # weights a scale covers: a block of 32, or a k-quant sub-block (32; Q6_K's 16)
    has_mins: bool  # w = q * scale + min; else w = (q - 2^(bits - 1)) * scale
    scale_dtype: str  # "float16" (d as stored) or "float32" (the k-quants' products, exactly)


INT_LAYOUTS = {
    "Q4_0": GGUFIntLayout(4, 32, False, "float16"),
    "Q8_0": GGUFIntLayout(8, 32, False, "float16"),
    "Q5_0": GGUFIntLayout(8, 32, False, "float16"),
    "Q4_1": GGUFIntLayout(4, 32, True, "float16"),
    "Q5_1": GGUFIntLayout(8, 32, True, "float16"),
    "Q4_K": GGUFIntLayout(4, 32, True, "float32"),
    "Q5_K": GGUFIntLayout(8, 32, True, "float32"),
    "Q6_K": GGUFIntLayout(8, 16, False, "float32"),
}
