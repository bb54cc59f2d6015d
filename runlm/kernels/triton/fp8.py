"""float8 e4m3 ("fn": no infinities, +-448 the largest finite) in Triton as bits, encoded and decoded with integer
arithmetic: the same bits on a GPU and under TRITON_INTERPRET=1 (whose own fp32 -> fp8 cast drops the carry of a
mantissa that rounds up into the next exponent: 31.3 became 16), and the same as torch's cast (round to nearest
even, saturating at +-448). Used by the fp8 KV cache (kv_store, fused.rope_store, attention) and the FP8
checkpoints' matmul (quant_matmul)."""
from __future__ import annotations

import triton
import triton.language as tl

E4M3_MAX = 448.0


@triton.jit
def e4m3_bits(x):
    """x (any float) as e4m3 bits [uint8]: rounded to nearest even, saturated at +-448; below e4m3's smallest
    normal (2^-6) in steps of its subnormals (2^-9)."""
    x = tl.minimum(tl.maximum(x.to(tl.float32), -448.0), 448.0)
    a = tl.abs(x)
    b = a.to(tl.int32, bitcast=True)
    # a normal value's exponent and top 3 mantissa bits, rounded (a carry moves into the exponent), rebiased 127 -> 7
    normal = ((b + 0x7FFFF + ((b >> 20) & 1)) >> 20) - (120 << 3)
    sub = ((a * 512.0 + 12582912.0) - 12582912.0).to(tl.int32)  # (1.5 * 2^23: fp32 rounds to a whole number, even)
    code = tl.where(a < 0.015625, sub, normal)  # (8 subnormal steps is the smallest normal's own code)
    return (code | tl.where(x < 0, 0x80, 0)).to(tl.uint8)


@triton.jit
def e4m3_value(bits):
    """e4m3 bits [uint8] as float32: normal values built as float32 bits, subnormals as m * 2^-9 (NaN reads as
    480)."""
    b = bits.to(tl.int32)
    e = (b >> 3) & 0xF
    normal = (((b & 0x80) << 24) | ((e + 120) << 23) | ((b & 7) << 20)).to(tl.float32, bitcast=True)
    sub = (b & 7).to(tl.float32) * 0.001953125
    return tl.where(e == 0, tl.where((b & 0x80) != 0, -sub, sub), normal)


