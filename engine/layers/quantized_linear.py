"""Weight-only quantized linears: int4 in groups along the input dim, int8 per output channel.

Formats are those of torch's CPU kernels, so a weight is stored once, in the layout its
kernel reads:
  - int4: `_weight_int4pack_mm_for_cpu`, w = (q - 8) * scale + zero per group of `group_size`
    input elements, q in 0..15; scales_and_zeros [in / group, out, 2] in the activations'
    dtype. llama.cpp's Q4_1 (w = d * q + m per 32) maps exactly: scale = d, zero = m + 8d;
    Q4_0 (w = d * (q - 8)): scale = d, zero = 0.
  - int8: `_weight_int8pack_mm`, w = q * scale per output row, q in -128..127.
Quantization of a float weight is round-to-nearest, as gpt-fast's: int8 symmetric per
channel, int4 asymmetric per group (min/max over the group).

Activations must be bf16 (or fp16): in float32 torch's kernels loop per row (FAST_DTYPES).
Measured on this 2-core CPU (the default model's 30 layers of linears, one row, 2 threads):
packed bf16 7.1-11 ms, int8 5.5 ms, int4 4.8 ms; from 4 rows up int4 is slower than bf16
(8 rows: 14 ms against 10), int8 slower still. Each row's result does not depend on the
row count (checked at quantize time, `check_rows`), so a quantized model stays
batch-invariant. A kernel serves a model only after it has run here on a tiny weight and
matched the float reference (`refusal`, once per kind and dtype a process); a refused kind
is served as float, and the weights report says why.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from engine.errors import first_line

INT4, INT8 = "int4", "int8"
INT8_GROUPS = "int8-groups"     # 8-bit weights with a float scale per group (Q8_0: 32, Q6_K: 16)
INT4_GROUP = 32                 # llama.cpp's Q4 block; gpt-fast's default is 32 too
INNER_K_TILES = 1               # the CPU kernel takes any in_features divisible by the group
CHECK_ROWS = (1, 2, 3, 16, 64)
# Activations the kernels are fast for. In float32 both run a per-row loop: a 128-row pass of
# a 1536 x 576 int4 weight took 196 ms against 6.8 ms in bf16 (int8: 98 ms), so a quantized
# fp32 model would prefill 30x slower than the same model dequantized.
FAST_DTYPES = (torch.bfloat16,)

AVAILABLE = hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(torch.ops.aten, "_weight_int8pack_mm")


@dataclass
class QuantizedWeight:
    """One linear's weight [out, in] in a kernel's format (see the module docstring)."""
    kind: str
    data: torch.Tensor          # int4: packed uint8 (the kernel's layout); int8: int8 [out, in]
    scales: torch.Tensor        # int4: scales_and_zeros [in / group, out, 2]; int8: [out]
    shape: tuple[int, int]      # (out, in)
    group_size: int = 0         # int4 only

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scales.numel() * self.scales.element_size()

    def describe(self) -> str:
        if self.kind == INT8_GROUPS:
            return f"int8 (group {self.group_size})"
        return f"int4 (group {self.group_size})" if self.kind == INT4 else "int8 (per channel)"


def unsupported(kind: str, shape: tuple[int, int], device: torch.device, dtype: torch.dtype,
                group_size: int = INT4_GROUP) -> str | None:
    """Why a weight of this shape cannot take this kind here, with activations in `dtype`
    (None: it can)."""
    if not AVAILABLE:
        return f"this torch ({torch.__version__}) has no weight-only {kind} kernels"
    if device.type != "cpu":
        return f"{kind} weights run on the CPU only in this release ({device.type} keeps them dequantized)"
    if kind == INT4 and shape[1] % group_size:
        return f"in_features {shape[1]} is not a multiple of the int4 group {group_size}"
    return refusal(kind, dtype)


def refusal(kind: str, dtype: torch.dtype) -> str | None:
    """Why the `kind` kernel cannot run with `dtype` activations on this CPU (None: it ran on
    a tiny weight and matched the float reference). Tests replace this to force the fallback."""
    return _tried(kind, dtype)


@functools.cache
def _tried(kind: str, dtype: torch.dtype) -> str | None:
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(16, 64, generator=gen), torch.randn(3, 64, generator=gen).to(dtype)
    try:
        qw = quantize(w, kind, dtype)
        got = linear(x, qw, None).float()
        want = x.float() @ _reference_weight(w, kind).t()
    except RuntimeError as error:
        return f"torch's {kind} kernel failed here: {first_line(error)}"
    if not torch.allclose(got, want, rtol=3e-2, atol=3e-2 * want.abs().max().item()):
        return f"torch's {kind} kernel gave wrong results here"
    return None


def _reference_weight(w: torch.Tensor, kind: str) -> torch.Tensor:
    """The float weight quantize() rounds `w` to, computed without the kernels."""
    if kind == INT8:
        q, scale = int8_rtn(w)
        return q.float() * scale[:, None]
    q, scale, zero = int4_rtn(w)
    groups = scale.shape[1]
    return ((q.view(w.shape[0], groups, -1) - 8) * scale[..., None] + zero[..., None]).view(w.shape)


def slow_in(dtype: torch.dtype) -> str | None:
    """Why the kernels are slow with activations in `dtype` (None: they are fast)."""
    if dtype in FAST_DTYPES:
        return None
    return (f"torch's CPU int4/int8 kernels have no fast {str(dtype).removeprefix('torch.')} path (a 128-row pass "
            "took 30x the bfloat16 time here)")


def from_int4_groups(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype) -> QuantizedWeight:
    """q [out, in] integers 0..15; scale, zero [out, in / group] with w = (q - 8) * scale + zero."""
    out, inp = q.shape
    group = inp // scale.shape[1]
    data = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), INNER_K_TILES)
    scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(dtype)
    return QuantizedWeight(INT4, data, scales_and_zeros, (out, inp), group)


def from_int8_groups(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> QuantizedWeight:
    """q [out, in] integers -128..127; scale [out, in / group] with w = q * scale (Q8_0: group
    32; Q6_K: group 16, scale d * sc and q the 6-bit value minus 32)."""
    out, inp = q.shape
    group = inp // scale.shape[1]
    return QuantizedWeight(INT8_GROUPS, q.to(torch.int8).contiguous(), scale.float().contiguous(), (out, inp), group)


@dataclass
class StackedWeight:
    """A linear whose output rows come from parts of different kinds (a fused q/k/v whose v is
    stored as Q6_K and q, k as Q4_K): each part runs its own kernel, outputs concatenated."""
    parts: list[QuantizedWeight]

    @property
    def kind(self) -> str:
        return "+".join(dict.fromkeys(p.kind for p in self.parts))

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def describe(self) -> str:
        return " + ".join(dict.fromkeys(p.describe() for p in self.parts))


def stack(parts: list[QuantizedWeight]) -> QuantizedWeight | StackedWeight:
    """One weight from parts stacked along the output rows (a fused linear)."""
    if len(parts) == 1:
        return parts[0]
    return StackedWeight(list(parts))


def int4_rtn(w: torch.Tensor, group_size: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest, asymmetric, per group of `group_size` input elements (gpt-fast):
    (q [out, in] 0..15, scale, zero [out, in / group] float32), w ~ (q - 8) * scale + zero."""
    out, inp = w.shape
    g = w.detach().float().reshape(out, inp // group_size, group_size)
    low, high = g.amin(-1), g.amax(-1)
    scale = ((high - low) / 15).clamp(min=1e-6)
    q = ((g - low[..., None]) / scale[..., None]).round().clamp(0, 15).reshape(out, inp)
    return q, scale, low + 8 * scale


def int8_rtn(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest, symmetric, per output channel: (q [out, in] int8, scale [out] float32)."""
    w32 = w.detach().float()
    scale = (w32.abs().amax(1) / 127).clamp(min=1e-8)
    return (w32 / scale[:, None]).round().clamp(-128, 127).to(torch.int8), scale


def quantize_int4(w: torch.Tensor, dtype: torch.dtype, group_size: int = INT4_GROUP) -> QuantizedWeight:
    return from_int4_groups(*int4_rtn(w, group_size), dtype)


def quantize_int8(w: torch.Tensor, dtype: torch.dtype) -> QuantizedWeight:
    q, scale = int8_rtn(w)
    return QuantizedWeight(INT8, q.contiguous(), scale.to(dtype), tuple(w.shape))


def quantize(w: torch.Tensor, kind: str, dtype: torch.dtype) -> QuantizedWeight:
    return quantize_int4(w, dtype) if kind == INT4 else quantize_int8(w, dtype)


def linear(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, in] -> [M, out]."""
    if isinstance(qw, StackedWeight):
        y = torch.cat([linear(x, part, None) for part in qw.parts], dim=-1)
        return y if bias is None else y + bias
    if qw.kind == INT8_GROUPS:      # placeholder until the kernel lands: dequantized per call
        w = (qw.data.float().view(qw.shape[0], -1, qw.group_size) * qw.scales[..., None]).view(qw.shape)
        y = (x.float() @ w.t()).to(x.dtype)
    elif qw.kind == INT4:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, qw.data, qw.group_size, qw.scales)
    else:
        y = torch.ops.aten._weight_int8pack_mm(x, qw.data, qw.scales)
    return y if bias is None else y + bias


def dequantize(qw: QuantizedWeight) -> torch.Tensor:
    """The float weight [out, in] the kernel computes with (in the scales' dtype): the
    identity matrix through the kernel, so it is the kernel's own arithmetic."""
    if isinstance(qw, StackedWeight):
        return torch.cat([dequantize(part) for part in qw.parts])
    eye = torch.eye(qw.shape[1], dtype=qw.scales.dtype)
    return linear(eye, qw, None).t().contiguous()


def check_rows(weights: list[QuantizedWeight]) -> str | None:
    """None when each row's result is the same for every row count in CHECK_ROWS, per
    weight shape and kind (batch invariance); else what differed."""
    gen = torch.Generator().manual_seed(0)
    seen = set()
    for qw in weights:
        key = (qw.kind, qw.shape, qw.group_size, qw.scales.dtype)
        if key in seen:
            continue
        seen.add(key)
        x = torch.randn(max(CHECK_ROWS), qw.shape[1], generator=gen).to(qw.scales.dtype)
        full = linear(x, qw, None)
        for n in CHECK_ROWS[:-1]:
            if not torch.equal(linear(x[:n], qw, None), full[:n]):
                return f"{qw.describe()} {qw.shape}: {n} rows round differently from {max(CHECK_ROWS)}"
    return None
