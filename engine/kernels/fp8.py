"""FP8 E4M3 (`torch.float8_e4m3fn`) encode/decode in integer arithmetic.

The cache holds FP8 as raw bytes (a uint8 view). Converting bits by hand instead of
casting to `tl.float8e4nv`:
- is exact and identical everywhere: the Triton interpreter's float->fp8 cast rounds
  wrongly (no carry into the exponent, ties away from zero), and GPUs before sm_89
  have no native e4m3 conversion;
- costs a handful of integer ops per element, small next to the memory traffic.
"""
import triton
import triton.language as tl


@triton.jit
def e4m3_encode(x):
    """float32 with |x| <= 448 -> uint8 E4M3 bits, round to nearest even (as torch's cast)."""
    u = x.to(tl.int32, bitcast=True)
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    # Normal range: rebias the exponent 127 -> 7 and round 23 mantissa bits to 3, ties to
    # even. A carry out of the mantissa bumps the exponent, which is the right answer.
    normal = (a - (120 << 23) + 0x7FFFF + ((a >> 20) & 1)) >> 20
    # Subnormal range (|x| < 2^-6): |x| in units of 2^-9, rounded to the nearest even integer.
    shift = tl.minimum(141 - (a >> 23), 31)
    mant = (a & 0x7FFFFF) | 0x800000
    sub = (mant + (1 << (shift - 1)) - 1 + ((mant >> shift) & 1)) >> shift
    return (tl.where(a < (121 << 23), sub, normal) | sign).to(tl.uint8)


@triton.jit
def e4m3_decode_div256(b):
    """uint8 E4M3 bits -> float16 holding value / 256, exactly.

    Moving the sign and the 7 exponent+mantissa bits into float16's layout gives the same
    number with float16's exponent bias (15 instead of 7), i.e. scaled by 2^-8; this holds
    for subnormals too. Callers fold the 256 into the per-token scale."""
    b = b.to(tl.int32)
    bits = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True)
