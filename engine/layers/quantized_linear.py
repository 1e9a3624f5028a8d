"""Weight-only quantized linears: 4-bit weights in groups of 32 along the input dim, 8-bit
weights in groups (Q8_0, Q5_0, Q5_1, Q5_K: 32; Q6_K: 16) or per output channel. Which stored
format is served in which form, on which device, is engine.loading.stored_formats' table;
this module only builds, checks and runs the forms.

Two kernels, each tried before it serves:
  - ours (engine.kernels.cpu_quant, `workbench_cpu::linear_q`): every kind, fp32 or bf16
    activations, which it quantizes per row to int8 in blocks of 32; each group's dot an exact
    integer, the floats in order, so a row's bits do not depend on the row count or the ISA.
    Its cost stays nearly flat as rows grow (the weights are read and decoded once per call).
  - torch's (`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`): int4 groups and int8 per
    channel only, fast with bf16 activations only, and its cost climbs with rows (it works in
    4-row tiles and dequantizes the weights again for each). It serves where ours does not
    build (no compiler) or cannot take a shape.
On CUDA a third kernel serves the weights as stored (engine.kernels.gpu_quant, Triton): a GGUF's
blocks byte for byte (`gpu_blocks`: "Q4_K blocks", ...) and an AWQ/GPTQ checkpoint's int4 with
its zero points (GPU_INT4_ZP), tried at load on the device.
A kind no kernel takes here is served as float by the loader, which says why
(`unsupported`). The forms the loaders hand over:
  - int4: q 0..15 with w = (q - 8) * scale + zero per group (llama.cpp's Q4_1, w = d * q + m:
    scale = d, zero = m + 8d; Q4_0, w = d * (q - 8): scale = d, zero = 0);
  - int8 groups: q -128..127 with w = q * scale per group, or, for a format with a zero point
    (Q5_K widened), q 0..255 with w = q * scale + zero;
  - int5 groups (Q5_0, Q5_1): q 0..31 with w = q * scale + zero per group of 32, held in 5
    bits a weight (the 4-bit nibbles and a bit plane) with the scale and zero (our kernel only);
  - int8 per channel: q -128..127 with w = q * scale per output row;
  - a K-quant (Q4_K, Q5_K, Q6_K): the file's rows of super-blocks as stored, which our kernel
    reads in their own bits (engine.kernels.cpu_kquant); no other kernel takes them.
Quantization of a float weight is round-to-nearest, as gpt-fast's: int8 symmetric per
channel, int4 asymmetric per group (min/max over the group), its scale and minimum rounded to
fp16 first so that our kernel stores them in 2 bytes exactly.
Each row's result does not depend on the row count (checked at load, `check_rows`), so a
quantized model stays batch-invariant.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from engine.errors import first_line
from engine.kernels import cpu_kquant, cpu_quant, gpu_quant

INT4, INT8 = "int4", "int8"
INT8_GROUPS = "int8-groups"     # 8-bit weights with a float scale (and zero) per group (Q6_K: 16; others 32)
INT5_GROUPS = "int5-groups"     # 5-bit weights (Q5_0, Q5_1) with a scale and zero per group of 32
KQUANTS = {f"{name} super-blocks": bits for name, bits in cpu_kquant.TYPES.items()}    # kind -> the op's bits
Q4_K, Q5_K, Q6_K = KQUANTS
BITS = {INT4: 4, INT8: 8, INT8_GROUPS: 8, INT5_GROUPS: 5, **KQUANTS}
INT4_GROUP = 32                 # llama.cpp's Q4 block; gpt-fast's default is 32 too
OURS, TORCH, TRITON = "ours", "torch", "triton"      # TRITON: the GPU kernel on weights as stored (gpu_quant)
GPU_INT4_ZP = "int4 zero-point groups"      # an AWQ / GPTQ checkpoint's int4 on the GPU (gpu_quant.INT4_ZP)
GPU_FORMS = {**{f"{name} blocks": name for name in gpu_quant.BLOCKS}, GPU_INT4_ZP: gpu_quant.INT4_ZP}   # form -> gpu_quant's
INNER_K_TILES = 1               # torch's int4 kernel takes any in_features divisible by the group
CHECK_TILES = 8                 # check_rows runs a weight's first tiles (128 rows), not the whole of it
CHECK_ROWS = (1, 2, 3, 16, 64)
# Activations torch's kernels are fast for. In float32 both run a per-row loop: a 128-row pass
# of a 1536 x 576 int4 weight took 196 ms against 6.8 ms in bf16 (int8: 98 ms).
FAST_DTYPES = (torch.bfloat16,)

AVAILABLE = hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(torch.ops.aten, "_weight_int8pack_mm")


@dataclass
class QuantizedWeight:
    """One linear's weight [out, in] in a kernel's layout (see the module docstring)."""
    kind: str                   # INT4 | INT8 | INT8_GROUPS: what the weight is
    data: torch.Tensor          # ours: cpu_quant.pack's bytes; torch: its packed int4 / int8 [out, in]
    scales: torch.Tensor        # ours: cpu_quant.pack's scales; torch int4: [in / group, out, 2]; int8: [out]
    shape: tuple[int, int]      # (out, in)
    group_size: int = 0         # 0: per channel
    kernel: str = TORCH         # OURS | TORCH | TRITON
    dtype: torch.dtype = torch.bfloat16     # the activations it was made for
    zeros: torch.Tensor | None = None       # TRITON's int4 zero-point groups: z per group

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scales, self.zeros) if t is not None)

    def stored(self) -> gpu_quant.StoredWeight:
        """A TRITON weight as gpu_quant takes it."""
        return gpu_quant.StoredWeight(GPU_FORMS[self.kind], self.data, self.shape, self.scales, self.zeros,
                                      self.group_size)

    def describe(self) -> str:
        if self.kind == GPU_INT4_ZP:
            return f"int4 with zero points (group {self.group_size}), as stored"
        if self.kind in GPU_FORMS:
            return f"{GPU_FORMS[self.kind]} blocks as stored"
        if self.kind in KQUANTS:
            return f"{self.kind.split()[0]} as stored ({cpu_kquant.BLOCK_BYTES[BITS[self.kind]] * 8 / 256:g} bits a weight)"
        if self.kind == INT8:
            return "int8 (per channel)"
        return f"{WIDTHS[self.kind]} (group {self.group_size})"


def _our_refusal(kind: str, shape: tuple[int, int], group_size: int) -> str | None:
    """Why our kernel cannot take this weight here (None: it can)."""
    if kind in KQUANTS:
        return cpu_kquant.refusal() or cpu_kquant.packable(shape)
    return cpu_quant.refusal() or cpu_quant.packable(shape, BITS[kind], group_size or cpu_quant.XBLOCK)


def gpu_blocks(type_name: str) -> str:
    """The form a GGUF type's blocks are served in on the GPU, as stored."""
    return f"{type_name} blocks"


def looks_up(kind: str, shape: tuple[int, int], group_size: int, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a weight of this kind is served on `device` by a kernel whose layout `rows` can
    read (ours on the CPU, the GPU kernel's): an embedding then needs no float table."""
    if kind in GPU_FORMS:
        return unsupported(kind, shape, device, dtype, group_size) is None
    return device.type == "cpu" and _our_refusal(kind, shape, group_size if kind != INT8 else 0) is None


def unsupported(kind: str, shape: tuple[int, int], device: torch.device, dtype: torch.dtype,
                group_size: int = INT4_GROUP) -> str | None:
    """Why a weight of this shape cannot take this kind here, with activations in `dtype`
    (None: a kernel takes it)."""
    if kind in GPU_FORMS:
        return gpu_quant.refusal(GPU_FORMS[kind], shape, device, dtype, group_size)
    if device.type != "cpu":
        return f"{kind} weights run on the CPU only in this release ({device.type} keeps them dequantized)"
    ours = _our_refusal(kind, shape, group_size if kind != INT8 else 0)
    if ours is None:
        return None
    if kind in (INT8_GROUPS, INT5_GROUPS):
        return f"no kernel takes {BITS[kind]}-bit groups here ({ours})"
    if kind in KQUANTS:
        return f"no kernel reads {kind} here ({ours})"
    if not AVAILABLE:
        return f"{ours}; this torch ({torch.__version__}) has no weight-only {kind} kernels"
    if kind == INT4 and shape[1] % group_size:
        return f"in_features {shape[1]} is not a multiple of the int4 group {group_size}"
    return refusal(kind, dtype)


def refusal(kind: str, dtype: torch.dtype) -> str | None:
    """Why torch's `kind` kernel cannot run with `dtype` activations on this CPU (None: it ran
    on a tiny weight and matched the float reference). Tests replace this to force the fallback."""
    return _tried(kind, dtype)


@functools.cache
def _tried(kind: str, dtype: torch.dtype) -> str | None:
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(16, 64, generator=gen), torch.randn(3, 64, generator=gen).to(dtype)
    try:
        qw = _torch_weight(kind, w, dtype)
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
    """Why the kernels are slow with activations in `dtype` (None: they are fast). Ours is fast
    in fp32 and bf16; torch's in bf16 only."""
    if dtype in FAST_DTYPES or cpu_quant.refusal() is None:
        return None
    return (f"torch's CPU int4/int8 kernels have no fast {str(dtype).removeprefix('torch.')} path (a 128-row pass "
            f"took 30x the bfloat16 time here), and ours does not run: {cpu_quant.refusal()}")


def path() -> str:
    """Which kernel serves quantized weights here, for "In effect"."""
    ours = cpu_quant.refusal()
    if ours is None:
        return (f"ours ({cpu_quant.plan().describe(lambda isa: isa + ' VNNI' if isa == 'avx512' else isa)}), "
                "int8 activations per 32")
    torch_says = refusal(INT4, FAST_DTYPES[0])
    return f"torch's int4/int8 kernels ({ours})" if torch_says is None else f"float ({ours}; {torch_says})"


def from_int4_groups(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype) -> QuantizedWeight:
    """q [out, in] integers 0..15; scale, zero [out, in / group] with w = (q - 8) * scale + zero."""
    out, inp = q.shape
    group = inp // scale.shape[1]
    if _our_refusal(INT4, (out, inp), group) is None:
        scale32 = scale.float()
        w, scales = cpu_quant.pack(q, scale32, zero.float() - 8 * scale32, 4)
        return QuantizedWeight(INT4, w, scales, (out, inp), group, OURS, dtype)
    data = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), INNER_K_TILES)
    scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(dtype)
    return QuantizedWeight(INT4, data, scales_and_zeros, (out, inp), group, TORCH, dtype)


def from_int8_groups(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                     zero: torch.Tensor | None = None) -> QuantizedWeight:
    """q [out, in]; scale (and zero) [out, in / group] with w = q * scale (+ zero). Without a
    zero q is int8 -128..127 (Q8_0: group 32; Q6_K: group 16, scale d * sc and q the 6-bit
    value minus 32); with one q is uint8 0..255 (Q5_0: q the 5-bit value, zero -16 d; Q5_K:
    scale d * sc, zero -dmin * m). Only our kernel takes it (`unsupported` says where it does
    not)."""
    out, inp = q.shape
    group = inp // scale.shape[1]
    why = _our_refusal(INT8_GROUPS, (out, inp), group)
    if why:
        raise ValueError(f"8-bit groups cannot be served here: {why}")
    w, scales = _pack8(q, scale.float(), None if zero is None else zero.float())
    return QuantizedWeight(INT8_GROUPS, w, scales, (out, inp), group, OURS, dtype)


def from_int5_groups(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype) -> QuantizedWeight:
    """q [out, in] 0..31; scale, zero [out, in / 32] with w = q * scale + zero (Q5_0: zero
    -16 d; Q5_1: zero m), held in 5 bits a weight. Only our kernel takes it."""
    out, inp = q.shape
    group = inp // scale.shape[1]
    why = _our_refusal(INT5_GROUPS, (out, inp), group)
    if why:
        raise ValueError(f"5-bit groups cannot be served here: {why}")
    w, scales = cpu_quant.pack(q, scale.float(), zero.float(), 5)
    return QuantizedWeight(INT5_GROUPS, w, scales, (out, inp), group, OURS, dtype)


def from_kquant(raw: torch.Tensor, kind: str, dtype: torch.dtype, into: torch.Tensor | None = None) -> QuantizedWeight:
    """The file's rows of `kind` super-blocks [out, in / 256 * bytes] uint8, read as stored
    (packed into `into` when given: a slice of a larger weight's tiles, Joined's)."""
    bits = BITS[kind]
    out, inp = raw.shape[0], raw.shape[1] // cpu_kquant.BLOCK_BYTES[bits] * cpu_kquant.SUPER
    why = _our_refusal(kind, (out, inp), cpu_kquant.SUPER)
    if why:
        raise ValueError(f"{kind} cannot be read as stored here: {why}")
    return QuantizedWeight(kind, cpu_kquant.pack(raw, bits, into), torch.empty(0, dtype=torch.uint8), (out, inp),
                           cpu_kquant.SUPER, OURS, dtype)


def from_gpu_blocks(raw: torch.Tensor, type_name: str, dtype: torch.dtype, device: torch.device) -> QuantizedWeight:
    """A GGUF tensor's rows of blocks [out, bytes a row] uint8, held on `device` byte for byte."""
    layout = gpu_quant.BLOCKS[type_name]
    shape = (raw.shape[0], raw.shape[1] // layout.bytes * layout.values)
    return QuantizedWeight(gpu_blocks(type_name), raw.to(device), torch.empty(0, dtype=torch.uint8), shape,
                           layout.values, TRITON, dtype)


def from_int4_zero_points(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, dtype: torch.dtype,
                          device: torch.device) -> QuantizedWeight:
    """An AWQ / GPTQ linear's q [out, in], z and s [out, groups] (w = (q - z) s) on `device`."""
    w = gpu_quant.int4_zp_weight(q, z, s).to(device)
    return QuantizedWeight(GPU_INT4_ZP, w.data, w.scales, w.shape, w.group, TRITON, dtype, w.zeros)


def _pack8(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """8-bit q, a scale (and zero) per group -> our kernel's bytes, w = d * u + m."""
    return cpu_quant.pack(*unsigned8(q, scale, zero), 8)


def unsigned8(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """8-bit groups as (u uint8 0..255, scale, zero) with w = u * scale + zero, our kernel's
    form: an unsigned q as it is; a signed one (int8) as u = q + 128, zero - 128 * scale
    (-128 * scale without a zero: the bytes Q8_0 and Q6_K have always had). Parts of both
    kinds (a Q5_0 q/k with a Q8_0 v) concatenate in this form into one weight."""
    if q.dtype == torch.uint8:
        return q, scale, torch.zeros_like(scale) if zero is None else zero
    offset = -cpu_quant.OFFSET8 * scale
    return (q.to(torch.int16) + cpu_quant.OFFSET8).to(torch.uint8), scale, offset if zero is None else zero + offset


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


class Joined:
    """One weight of `rows` output rows from consecutive slices of its rows packed apart (a
    large linear is decoded and packed a slice at a time, engine.loading.weight_quant): our
    kernel's slices of one kind are copied into one tensor as they come (its tiles are along
    the rows), so the model calls one kernel, whose fusions (a norm, a SwiGLU gate) apply, and
    the load holds the whole weight plus one slice. Slices another kernel holds stay apart."""

    def __init__(self, rows: int):
        self.rows, self.done, self.whole, self.apart = rows, 0, None, []

    def add_kquant(self, raw: torch.Tensor, kind: str, dtype: torch.dtype) -> None:
        """A slice of a K-quant's file rows, packed straight into the whole weight's tiles (no
        copy: the load holds the weight and one slice of the file's bytes)."""
        if self.whole is None and raw.shape[0] == self.rows:      # whole already: packed as it is
            self.apart.append(from_kquant(raw, kind, dtype))
            return
        if self.whole is None:
            block_bytes = cpu_kquant.BLOCK_BYTES[BITS[kind]]
            blocks = raw.shape[1] // block_bytes
            data = raw.new_empty((self.rows // cpu_quant.COLS, blocks, cpu_quant.COLS * block_bytes))
            self.whole = QuantizedWeight(kind, data, torch.empty(0, dtype=torch.uint8), (self.rows, blocks * cpu_kquant.SUPER),
                                         cpu_kquant.SUPER, OURS, dtype)
        at, n = self.done // cpu_quant.COLS, raw.shape[0] // cpu_quant.COLS
        from_kquant(raw, kind, dtype, into=self.whole.data[at:at + n])
        self.done += raw.shape[0]

    def add(self, qw: QuantizedWeight) -> None:
        if qw.kernel == TRITON:
            self._add_rows(qw)
            return
        first = self.whole is None and not self.apart
        if first and (qw.kernel != OURS or qw.shape[0] == self.rows):
            self.apart.append(qw)
            return
        if first:
            tiles = self.rows // cpu_quant.COLS
            self.whole = QuantizedWeight(qw.kind, qw.data.new_empty((tiles, *qw.data.shape[1:])),
                                         qw.scales.new_empty((tiles, *qw.scales.shape[1:])) if qw.scales.numel() else qw.scales,
                                         (self.rows, qw.shape[1]), qw.group_size, OURS, qw.dtype)
        if self.whole is None:
            self.apart.append(qw)
            return
        at, n = self.done // cpu_quant.COLS, qw.shape[0] // cpu_quant.COLS
        self.whole.data[at:at + n] = qw.data
        if qw.scales.numel():
            if qw.scales.dtype != self.whole.scales.dtype:      # fp16 where exact, else fp32: the same values
                self.whole.scales = self.whole.scales.float()
            self.whole.scales[at:at + n] = qw.scales
        self.done += qw.shape[0]

    def _add_rows(self, qw: QuantizedWeight) -> None:
        """The GPU kernel's slices: its tensors are along the output rows, copied in as they come."""
        if self.whole is None and qw.shape[0] == self.rows:
            self.apart.append(qw)
            return
        if self.whole is None:
            self.whole = _rowwise(qw, lambda t: t.new_empty((self.rows, *t.shape[1:])), self.rows)
        at, n = self.done, qw.shape[0]
        for mine, theirs in ((self.whole.data, qw.data), (self.whole.scales, qw.scales), (self.whole.zeros, qw.zeros)):
            if theirs is not None and theirs.numel():
                mine[at:at + n] = theirs
        self.done += n

    def weights(self) -> list[QuantizedWeight]:
        return [self.whole] if self.whole is not None else self.apart


WIDTHS = {INT4: "int4", INT5_GROUPS: "int5", INT8_GROUPS: "int8", INT8: "int8"}     # a form's name in reports


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
    scale, low = _fp16_where_exact(((high - low) / 15).clamp(min=1e-6)), _fp16_where_exact(low)
    q = ((g - low[..., None]) / scale[..., None]).round().clamp(0, 15).reshape(out, inp)
    return q, scale, low + 8 * scale


def _fp16_where_exact(t: torch.Tensor) -> torch.Tensor:
    """t rounded to fp16 where fp16 holds it (finite, normal), else as it was."""
    half = t.half().float()
    return torch.where(torch.isfinite(half) & ((half.abs() >= 2 ** -14) | (t == 0)), half, t)


def int8_rtn(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest, symmetric, per output channel: (q [out, in] int8, scale [out] float32)."""
    w32 = w.detach().float()
    scale = (w32.abs().amax(1) / 127).clamp(min=1e-8)
    return (w32 / scale[:, None]).round().clamp(-128, 127).to(torch.int8), scale


def quantize_int4(w: torch.Tensor, dtype: torch.dtype, group_size: int = INT4_GROUP) -> QuantizedWeight:
    return from_int4_groups(*int4_rtn(w, group_size), dtype)


def quantize_int8(w: torch.Tensor, dtype: torch.dtype) -> QuantizedWeight:
    q, scale = int8_rtn(w)
    if _our_refusal(INT8, tuple(w.shape), 0) is None:       # per channel: the same scale in each group
        data, scales = _pack8(q, scale[:, None].expand(-1, w.shape[1] // cpu_quant.XBLOCK).contiguous())
        return QuantizedWeight(INT8, data, scales, tuple(w.shape), 0, OURS, dtype)
    return QuantizedWeight(INT8, q.contiguous(), scale.to(dtype), tuple(w.shape), 0, TORCH, dtype)


def quantize(w: torch.Tensor, kind: str, dtype: torch.dtype) -> QuantizedWeight:
    return quantize_int4(w, dtype) if kind == INT4 else quantize_int8(w, dtype)


def _torch_weight(kind: str, w: torch.Tensor, dtype: torch.dtype) -> QuantizedWeight:
    """`w` quantized for torch's kernel (its trial)."""
    if kind == INT4:
        q, scale, zero = int4_rtn(w)
        data = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), INNER_K_TILES)
        scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(dtype)
        return QuantizedWeight(INT4, data, scales_and_zeros, tuple(w.shape), INT4_GROUP, TORCH, dtype)
    q, scale = int8_rtn(w)
    return QuantizedWeight(INT8, q.contiguous(), scale.to(dtype), tuple(w.shape), 0, TORCH, dtype)


def fuses(qw) -> bool:
    """Whether `linear` and `graph_linear` take a cpu_quant.Fused for `qw` (our kernel, whole)."""
    return getattr(qw, "kernel", None) == OURS


def linear(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None,
           fused: cpu_quant.Fused = cpu_quant.NOTHING_FUSED) -> torch.Tensor:
    """x [M, in] -> [M, out] (`fused`: what our kernel folds around the product, where `fuses`)."""
    if fused is not cpu_quant.NOTHING_FUSED:
        return cpu_quant.linear(x, qw.data, qw.scales, bias, BITS[qw.kind], fused)
    if isinstance(qw, StackedWeight):
        y = torch.cat([linear(x, part, None) for part in qw.parts], dim=-1)
        return y if bias is None else y + bias
    if qw.kernel == OURS:
        return cpu_quant.linear(x, qw.data, qw.scales, bias, BITS[qw.kind])
    if qw.kernel == TRITON:
        return gpu_quant.linear(x, qw.stored(), bias)
    if qw.kind == INT4:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, qw.data, qw.group_size, qw.scales)
    else:
        y = torch.ops.aten._weight_int8pack_mm(x, qw.data, qw.scales)
    return y if bias is None else y + bias


def graph_linear(x: torch.Tensor, qw, indices: tuple[int, ...], bias: torch.Tensor | None,
                 fused: cpu_quant.Fused = cpu_quant.NOTHING_FUSED) -> torch.Tensor:
    """`linear` inside a compiled graph, for a weight registered by register_graph_weights (its
    parts' `indices`): the graph names each part by index, never reads its tensors."""
    if fused is not cpu_quant.NOTHING_FUSED:
        return cpu_quant.linear_at(x, indices[0], qw.shape[0], bias, fused)
    parts = getattr(qw, "parts", [qw])
    ys = [cpu_quant.linear_at(x, index, part.shape[0], None if len(parts) > 1 else bias)
          for part, index in zip(parts, indices)]
    if len(ys) == 1:
        return ys[0]
    y = torch.cat(ys, dim=-1)
    return y if bias is None else y + bias


def register_graph_weights(linears: list) -> int | None:
    """Give each of a model's quantized linears (modules with `quant`, in module order) that our
    kernel serves whole the indices of its parts (`quant_indices`, model-local: the same model
    gives the same graph in every process), register their tensors with the kernel library, and
    return the key a step passes to `use` (None: no such weight). The caller forgets the key
    when the model goes (cpu_quant.forget)."""
    weights, next_index = [], 0
    for module in linears:
        parts = getattr(module.quant, "parts", [module.quant])
        if not all(part.kernel == OURS for part in parts):
            continue
        module.quant_indices = tuple(range(next_index, next_index + len(parts)))
        next_index += len(parts)
        weights += [(part.data, part.scales, BITS[part.kind]) for part in parts]
    return cpu_quant.register(weights) if weights else None


def use(key: int | None) -> None:
    """The registered weights a step's graph reads (register_graph_weights' key)."""
    if key is not None:
        cpu_quant.use(key)


def dequantize(qw: QuantizedWeight) -> torch.Tensor:
    """The float weight [out, in] the kernel computes with, in the activations' dtype. Ours:
    d * u + m from its packed bytes; torch's: the identity matrix through the kernel, so it is
    the kernel's own arithmetic."""
    if isinstance(qw, StackedWeight):
        return torch.cat([dequantize(part) for part in qw.parts])
    if qw.kernel == TRITON:
        return gpu_quant.rows(qw.stored(), torch.arange(qw.shape[0], device=qw.data.device)).to(qw.dtype)
    if qw.kind in KQUANTS:
        return cpu_kquant.unpack(qw.data, BITS[qw.kind]).to(qw.dtype)
    if qw.kernel == OURS:
        return cpu_quant.unpack(qw.data, qw.scales, BITS[qw.kind]).to(qw.dtype)
    eye = torch.eye(qw.shape[1], dtype=qw.scales.dtype)
    return linear(eye, qw, None).t().contiguous()


def can_look_up(qw) -> bool:
    """Whether `rows` can read this weight's rows (our kernel's layout or the GPU kernel's: an
    embedding tied to a head served as stored needs no float table)."""
    return all(part.kernel in (OURS, TRITON) for part in getattr(qw, "parts", [qw]))


def rows(qw, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the weight [out, in] (fp32, the values `dequantize` gives), for lookups, on
    the weight's device."""
    if isinstance(qw, StackedWeight):
        ids = ids.to(qw.parts[0].data.device)
        out, start = torch.empty(len(ids), qw.shape[1], device=ids.device), 0
        for part in qw.parts:
            inside = (ids >= start) & (ids < start + part.shape[0])
            if inside.any():
                out[inside] = rows(part, ids[inside] - start)
            start += part.shape[0]
        return out
    if qw.kernel == TRITON:
        return gpu_quant.rows(qw.stored(), ids)
    ids = ids.cpu()
    if qw.kind in KQUANTS:
        return cpu_kquant.rows(qw.data, BITS[qw.kind], ids)
    return cpu_quant.rows(qw.data, qw.scales, BITS[qw.kind], ids)


def _rowwise(qw: QuantizedWeight, per_tensor, rows: int) -> QuantizedWeight:
    """A TRITON weight of `rows` output rows whose tensors (all along the rows; the empty or
    missing ones kept) are per_tensor(each of qw's)."""
    def each(t):
        return per_tensor(t) if t is not None and t.numel() else t
    return QuantizedWeight(qw.kind, each(qw.data), each(qw.scales), (rows, qw.shape[1]), qw.group_size, TRITON,
                           qw.dtype, each(qw.zeros))


def _first_tiles(qw: QuantizedWeight, tiles: int) -> QuantizedWeight:
    """Our kernel's weight cut to its first `tiles` tiles of 16 output rows (each row is
    computed alone, so a row's bits are the same in the whole weight); torch's as it is."""
    rows = tiles * cpu_quant.COLS
    if qw.kernel not in (OURS, TRITON) or qw.shape[0] <= rows:
        return qw
    if qw.kernel == TRITON:
        return _rowwise(qw, lambda t: t[:rows], rows)
    return QuantizedWeight(qw.kind, qw.data[:tiles], qw.scales[:tiles] if qw.scales.numel() else qw.scales,
                           (tiles * cpu_quant.COLS, qw.shape[1]), qw.group_size, qw.kernel, qw.dtype)


def check_rows(weights: list[QuantizedWeight]) -> str | None:
    """None when each row's result is the same for every row count in CHECK_ROWS, per
    weight shape and kind (batch invariance); else what differed."""
    gen = torch.Generator().manual_seed(0)
    seen = set()
    for qw in weights:
        key = (qw.kind, qw.kernel, qw.shape, qw.group_size, qw.scales.dtype, qw.dtype, qw.data.device)
        if key in seen:
            continue
        seen.add(key)
        qw = _first_tiles(qw, CHECK_TILES)
        x = torch.randn(max(CHECK_ROWS), qw.shape[1], generator=gen).to(device=qw.data.device, dtype=qw.dtype)
        full = linear(x, qw, None)
        for n in CHECK_ROWS[:-1]:
            if not torch.equal(linear(x[:n], qw, None), full[:n]):
                return f"{qw.describe()} {qw.shape}: {n} rows round differently from {max(CHECK_ROWS)}"
    return None
