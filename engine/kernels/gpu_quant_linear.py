"""The Triton kernels of engine.kernels.gpu_quant (its docstring: layouts, arithmetic, batch
invariance): a linear over weights as stored, and an embedding's row lookups in them.

`_decode` reads one (sub-)block of SUB inputs for a tile of output rows, in the format's own
bits, as (integer values [SUB, rows], scale [rows], minimum [rows]) with w = value * scale +
minimum; a format whose values are centred (Q4_0's q - 8, Q6_K's q - 32, AWQ's q - z) has no
minimum. The block layouts are ggml-common.h's (block_q4_0 ... block_q6_K).

The linear is a torch custom op (workbench_gpu::stored_linear), so a compiled step or a CUDA
graph records one opaque call per linear.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from engine.kernels import interpreting, mend_interpreter
from engine.kernels.gpu_quant_layouts import (BLOCKS, FORMATS, INT4_ZP, OUTPUTS_PER_PROGRAM, ROWS_PER_PROGRAM, Layout,
                                              StoredWeight, int4_zp_weight)

mend_interpreter()          # the loops below have runtime bounds

FORMAT_IDS = {name: i for i, name in enumerate(FORMATS)}
LAYOUTS = {**BLOCKS, INT4_ZP: Layout(32, 16, 32)}          # INT4_ZP's values: 32 in 16 bytes, scales apart
WITH_MINIMUM = ("Q4_1", "Q5_1", "Q4_K", "Q5_K")
LOOKUP_ROWS = 16            # ids a lookup program decodes at once
_DOT = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _half(ptr, ok):
    """The fp16 stored little-endian at byte pointers `ptr`, as fp32."""
    lo = tl.load(ptr, mask=ok, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=ok, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _bytes(ptr, ok):
    return tl.load(ptr, mask=ok, other=0).to(tl.int32)


@triton.jit
def _nibbles16(blk, at, l, ok):
    """Values l of a run of 32 held in 16 bytes at `at`: l < 16 in the low nibble of byte l,
    l >= 16 in the high nibble of byte l - 16 (Q4_0's, Q5_0's and INT4_ZP's order)."""
    b = _bytes(blk[None, :] + at + (l % 16)[:, None], ok[None, :])
    return (b >> ((l // 16) * 4)[:, None]) & 15


@triton.jit
def _high_bits(blk, at, l, ok):
    """Bit l of the 32-bit little-endian word at `at` (Q5_0's and Q5_1's fifth bits)."""
    b = _bytes(blk[None, :] + at + (l // 8)[:, None], ok[None, :])
    return (b >> (l % 8)[:, None]) & 1


@triton.jit
def _k_scale_min(blk, ok, s: tl.constexpr):
    """Sub-block s's 6-bit scale and minimum from a Q4_K / Q5_K super-block's 12 bytes at 4."""
    if s < 4:
        sc = _bytes(blk + 4 + s, ok) & 63
        m = _bytes(blk + 8 + s, ok) & 63
    else:
        mix = _bytes(blk + 8 + s, ok)
        sc = (mix & 15) | ((_bytes(blk + s, ok) >> 6) << 4)
        m = (mix >> 4) | ((_bytes(blk + 4 + s, ok) >> 6) << 4)
    return sc.to(tl.float32), m.to(tl.float32)


@triton.jit
def _decode(blk, ok, l, s: tl.constexpr, k0, scale_at, zero_at, FMT: tl.constexpr):
    """(values [SUB, rows] int32, scale [rows], minimum [rows]) of sub-block `s` of each row's
    block at byte pointers `blk` (inputs k0 .. k0 + SUB). INT4_ZP reads its scale and zero at
    `scale_at` / `zero_at` (pointers [rows] to the group's)."""
    if FMT == 0:        # Q4_0: d, 16 bytes of nibbles; w = d (q - 8)
        d = _half(blk, ok)
        return _nibbles16(blk, 2, l, ok) - 8, d, d * 0.0
    elif FMT == 1:      # Q4_1: d, m, nibbles; w = d q + m
        return _nibbles16(blk, 4, l, ok), _half(blk, ok), _half(blk + 2, ok)
    elif FMT == 2:      # Q5_0: d, qh (4 bytes), nibbles; w = d (q - 16)
        d = _half(blk, ok)
        return (_nibbles16(blk, 6, l, ok) | (_high_bits(blk, 2, l, ok) << 4)) - 16, d, d * 0.0
    elif FMT == 3:      # Q5_1: d, m, qh, nibbles; w = d q + m
        return _nibbles16(blk, 8, l, ok) | (_high_bits(blk, 4, l, ok) << 4), _half(blk, ok), _half(blk + 2, ok)
    elif FMT == 4:      # Q8_0: d, 32 int8; w = d q
        q = tl.load(blk[None, :] + 2 + l[:, None], mask=ok[None, :], other=0).to(tl.int8, bitcast=True)
        d = _half(blk, ok)
        return q.to(tl.int32), d, d * 0.0
    elif FMT == 5:      # Q4_K: d, dmin, 12 bytes of scales, 128 of nibbles (runs of 32 bytes: sub-blocks 2j, 2j+1)
        sc, m = _k_scale_min(blk, ok, s)
        b = _bytes(blk[None, :] + 16 + 32 * (s // 2) + l[:, None], ok[None, :])
        return (b >> (4 * (s % 2))) & 15, _half(blk, ok) * sc, -(_half(blk + 2, ok) * m)
    elif FMT == 6:      # Q5_K: as Q4_K, with 32 bytes of fifth bits (bit s of byte l) before the nibbles
        sc, m = _k_scale_min(blk, ok, s)
        b = _bytes(blk[None, :] + 48 + 32 * (s // 2) + l[:, None], ok[None, :])
        hb = (_bytes(blk[None, :] + 16 + l[:, None], ok[None, :]) >> s) & 1
        return ((b >> (4 * (s % 2))) & 15) | (hb << 4), _half(blk, ok) * sc, -(_half(blk + 2, ok) * m)
    elif FMT == 7:      # Q6_K: 128 bytes of low nibbles, 64 of high pairs, 16 int8 scales, d; sub-blocks of 16
        half: tl.constexpr = s // 8
        quarter: tl.constexpr = (s % 8) // 2
        at = 16 * (s % 2) + l
        lo = (_bytes(blk[None, :] + 64 * half + 32 * (quarter % 2) + at[:, None], ok[None, :]) >> (4 * (quarter // 2))) & 15
        hi = (_bytes(blk[None, :] + 128 + 32 * half + at[:, None], ok[None, :]) >> (2 * quarter)) & 3
        sc = tl.load(blk + 192 + s, mask=ok, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        scale = _half(blk + 208, ok) * sc
        return (lo | (hi << 4)) - 32, scale, scale * 0.0
    else:               # INT4_ZP: 16 bytes of nibbles per 32 inputs, s (fp16) and z (uint8) per group
        z = tl.load(zero_at, mask=ok, other=0).to(tl.int32)
        scale = tl.load(scale_at, mask=ok, other=0.0).to(tl.float32)
        return _nibbles16(blk, 0, l, ok) - z[None, :], scale, scale * 0.0


@triton.jit
def _linear_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_ym, row_bytes, row_groups, group,
                   FMT: tl.constexpr, VALUES: tl.constexpr, BYTES: tl.constexpr, SUB: tl.constexpr,
                   HAS_MIN: tl.constexpr, HAS_BIAS: tl.constexpr, DOT: tl.constexpr, IEEE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm < M, rn < N
    rows = w_ptr + rn.to(tl.int64) * row_bytes
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    groups_at = rn.to(tl.int64) * row_groups
    l = tl.arange(0, SUB)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for b in range(0, K // VALUES):
        blk = rows + b * BYTES
        for s in tl.static_range(VALUES // SUB):
            k0 = b * VALUES + s * SUB
            g = groups_at + k0 // group
            q, scale, minimum = _decode(blk, n_ok, l, s, k0, s_ptr + g, z_ptr + g, FMT)
            x = tl.load(x_rows + (k0 + l)[None, :], mask=m_ok[:, None], other=0.0)
            if IEEE:
                part = tl.dot(x.to(DOT), q.to(DOT), input_precision="ieee")
            else:
                part = tl.dot(x.to(DOT), q.to(DOT))
            acc += part * scale[None, :]
            if HAS_MIN:
                acc += tl.sum(x.to(tl.float32), axis=1)[:, None] * minimum[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _rows_kernel(ids_ptr, w_ptr, s_ptr, z_ptr, out_ptr, T, K, row_bytes, row_groups, group,
                 FMT: tl.constexpr, VALUES: tl.constexpr, BYTES: tl.constexpr, SUB: tl.constexpr,
                 BLOCK_T: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    b = tl.program_id(1)
    t_ok = t < T
    ids = tl.load(ids_ptr + t, mask=t_ok, other=0).to(tl.int64)
    blk = w_ptr + ids * row_bytes + b * BYTES
    l = tl.arange(0, SUB)
    for s in tl.static_range(VALUES // SUB):
        k0 = b * VALUES + s * SUB
        g = ids * row_groups + k0 // group
        q, scale, minimum = _decode(blk, t_ok, l, s, k0, s_ptr + g, z_ptr + g, FMT)
        w = q.to(tl.float32) * scale[None, :] + minimum[None, :]
        tl.store(out_ptr + t.to(tl.int64)[None, :] * K + (k0 + l)[:, None], w, mask=t_ok[None, :])


def _args(w: StoredWeight) -> tuple:
    """The weight's tensors and strides as both kernels take them."""
    layout = LAYOUTS[w.fmt]
    scales = w.scales if w.scales is not None else w.data
    zeros = w.zeros if w.zeros is not None else w.data
    group = w.group or layout.values
    return (w.data, scales, zeros), (w.data.stride(0), w.shape[1] // group, group), layout


@torch.library.custom_op("workbench_gpu::stored_linear", mutates_args=())
def stored_linear(x: torch.Tensor, data: torch.Tensor, scales: Optional[torch.Tensor], zeros: Optional[torch.Tensor],
                  bias: Optional[torch.Tensor], fmt: str, out_features: int, group: int) -> torch.Tensor:
    w = StoredWeight(fmt, data, (out_features, x.shape[1]), scales, zeros, group)
    x = x.contiguous()
    m, k = x.shape
    y = torch.empty(m, out_features, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    tensors, (row_bytes, row_groups, group), layout = _args(w)
    grid = (triton.cdiv(m, ROWS_PER_PROGRAM), triton.cdiv(out_features, OUTPUTS_PER_PROGRAM))
    _linear_kernel[grid](x, *tensors, bias if bias is not None else x, y, m, out_features, k, x.stride(0), y.stride(0),
                         row_bytes, row_groups, group, FMT=FORMAT_IDS[fmt], VALUES=layout.values, BYTES=layout.bytes,
                         SUB=layout.sub, HAS_MIN=fmt in WITH_MINIMUM, HAS_BIAS=bias is not None, DOT=_dot(x.dtype),
                         IEEE=_dot(x.dtype) == tl.float32, BLOCK_M=ROWS_PER_PROGRAM, BLOCK_N=OUTPUTS_PER_PROGRAM)
    return y


@stored_linear.register_fake
def _(x, data, scales, zeros, bias, fmt, out_features, group):
    return x.new_empty(x.shape[0], out_features)


def _dot(dtype: torch.dtype):
    """The dot's input dtype: the activations'. The Triton interpreter's tl.dot gets bf16 wrong
    (numpy has no bf16: 3e10 off on a 16 x 16 product), so there it takes fp32, the same exact
    values (an activation widened, an integer weight value), summed in fp32 either way."""
    return tl.float32 if interpreting() else _DOT[dtype]


def linear(x: torch.Tensor, w: StoredWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if x.dtype not in _DOT:
        raise ValueError(f"the GPU quantized kernels take bf16, fp16 or fp32 activations, not {x.dtype}")
    return stored_linear(x, w.data, w.scales, w.zeros, bias, w.fmt, w.shape[0], w.group)


def rows(w: StoredWeight, ids: torch.Tensor) -> torch.Tensor:
    ids = ids.reshape(-1).to(device=w.data.device, dtype=torch.int64).contiguous()
    out = torch.empty(len(ids), w.shape[1], dtype=torch.float32, device=w.data.device)
    if len(ids) == 0:
        return out
    tensors, strides, layout = _args(w)
    grid = (triton.cdiv(len(ids), LOOKUP_ROWS), w.shape[1] // layout.values)
    _rows_kernel[grid](ids, *tensors, out, len(ids), w.shape[1], *strides, FMT=FORMAT_IDS[w.fmt],
                       VALUES=layout.values, BYTES=layout.bytes, SUB=layout.sub, BLOCK_T=LOOKUP_ROWS)
    return out


def dequantize(w: StoredWeight) -> torch.Tensor:
    """The whole weight [out, in] in fp32, exactly (the lookups of every row)."""
    return rows(w, torch.arange(w.shape[0], device=w.data.device))


def random_weight(fmt: str, out: int, inp: int, gen: torch.Generator, group: int = 128) -> StoredWeight:
    """A weight of random blocks in `fmt` (scales drawn small and finite), on the CPU: the
    trial's and the tests'."""
    if fmt == INT4_ZP:
        q = torch.randint(0, 16, (out, inp), generator=gen)
        z = torch.randint(0, 16, (out, inp // group), generator=gen)
        s = (torch.rand(out, inp // group, generator=gen) * 0.02 + 0.001).half()
        return int4_zp_weight(q, z, s)
    layout = BLOCKS[fmt]
    blocks = torch.randint(0, 256, (out, inp // layout.values, layout.bytes), generator=gen, dtype=torch.uint8)
    for at in _HALVES[fmt]:         # each fp16 a small finite value
        blocks[..., at:at + 2] = (torch.rand(out, inp // layout.values, generator=gen) * 0.01 + 1e-3
                                  ).half().view(torch.uint8).view(out, -1, 2)
    return StoredWeight(fmt, blocks.reshape(out, -1).contiguous(), (out, inp))


# where each block holds its fp16 scales (d, and m / dmin)
_HALVES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2),
           "Q6_K": (208,)}
