"""How each stored weight format is served, on each device, and why: the one table.

A row names a format (a GGUF block type, an AWQ/GPTQ checkpoint's int4, a float weight, or
`weight_dtype` int4 / int8 quantizing a float weight at load), the kernel form it is served
in on the CPU and on CUDA (engine.layers.quantized_linear: INT4 groups, INT8_GROUPS, INT8 per
channel; None: the compute dtype), the form's group along the input, and why. Everything
else reads this table: the plan (engine.loading.weight_quant), the GGUF reader
(engine.loading.gguf_tensors, whose decoders give each GGUF row's form exactly, its block
layouts beside them), the loader's report. The kernels stay leaf ops: they say whether they
take a weight of a shape here (quantized_linear.unsupported), never which format they serve.

  format   CPU                                   CUDA                  group  why
  Q4_0     int4 groups                           Q4_0 blocks           32     w = d(q - 8): 4-bit as stored
  Q4_1     int4 groups                           Q4_1 blocks           32     w = dq + m: 4-bit as stored
  Q4_K     Q4_K super-blocks (else int4 groups)  Q4_K blocks           256    4.5 bits a weight as stored
  Q5_0     int5 groups, u = q5, zero -16d        Q5_0 blocks           32     5-bit as stored (6 bits a weight held)
  Q5_1     int5 groups, u = q5, zero m           Q5_1 blocks           32     the same, with its min (6 bits, as stored)
  Q5_K     Q5_K super-blocks (else int8 groups)  Q5_K blocks           256    5.5 bits a weight as stored
  Q6_K     Q6_K super-blocks (else int8 groups)  Q6_K blocks           256    6.5625 bits a weight as stored
  Q8_0     int8 groups                           Q8_0 blocks           32     8-bit as stored
  MXFP4    dequantized (exact)                   dequantized           -      no MXFP4 kernel yet
  AWQ      int4 groups                           int4 zero-point grps  ckpt   w = (q - z)s: 4-bit as stored
  GPTQ     int4 groups                           int4 zero-point grps  ckpt   the same (no act-order)
  int4     int4 groups, round-to-nearest         dequantized           32     weight_dtype int4 on a float weight
  int8     int8 per channel, round-to-nearest    dequantized           0      weight_dtype int8 on any weight
  float, F32, F16, BF16: the compute dtype everywhere.
Any other GGUF type (Q2_K, Q3_K, the IQ types, ...) has no row: it is dequantized to the
compute dtype at load, "no kernel takes" it (`format_of`).
A K-quant is read in its super-blocks (engine.kernels.cpu_kquant) wherever that kernel passed its
trial and the tensor's columns are the file's; elsewhere (a kernel refused, a hybrid file's
reordered columns) it is served in its `widened` form, exactly, at more bytes a weight:
Q4_K in int4 groups of 32 (scale d·sc, zero 8·d·sc - dmin·m), Q5_K in int8 groups of 32
(u = q5, zero -dmin·m), Q6_K in int8 groups of 16 (q - 32).

On the CPU a form is served by our kernel (engine.kernels.cpu_quant), or for int4 groups and
int8 per channel by torch's weight-only kernels where ours does not run; a form no kernel
takes there, for a shape, falls back to the compute dtype and the report says why. On CUDA a
GGUF's blocks are held byte for byte as the file has them and an AWQ/GPTQ checkpoint's int4 in
4 bits with its fp16 scale and integer zero per group (engine.kernels.gpu_quant), read by the
Triton kernel where it passed its trial at load on the device; where it did not (no triton, a
shape), the weight is dequantized to the compute dtype and "In effect" says why. The int4 /
int8 a float weight is quantized to at load run on the CPU only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.layers.quantized_linear import (GPU_FORMS, GPU_INT4_ZP, INT4, INT5_GROUPS, INT8, INT8_GROUPS, KQUANTS, Q4_K, Q5_K,
                                           Q6_K, WIDTHS, gpu_blocks)
from engine.loading.awq_gptq import AWQ, GPTQ

GGUF, CHECKPOINT, AT_LOAD, FLOAT = "GGUF", "AWQ/GPTQ", "at load", "float"      # where a format comes from
FLOAT_SOURCE = "float"          # a tensor of a float checkpoint (the source type the report names)
INT4_AT_LOAD, INT8_AT_LOAD = "int4 at load", "int8 at load"
CHECKPOINT_GROUP = None         # the group the checkpoint's config says (AWQ/GPTQ's group_size)
PER_CHANNEL = 0


@dataclass(frozen=True)
class Serving:
    """How a format is served on one device."""
    form: str | None            # INT4 | INT8_GROUPS | INT8; None: in the compute dtype (dequantized)
    why: str


@dataclass(frozen=True)
class StoredFormat:
    name: str                   # "Q5_K", "AWQ", "int4 at load", "F16"
    source: str                 # GGUF | CHECKPOINT | AT_LOAD | FLOAT
    group: int | None           # the form's group along the input (CHECKPOINT_GROUP; PER_CHANNEL)
    zero: bool                  # the form carries a zero point per group (w = u * scale + zero)
    cpu: Serving
    cuda: Serving
    widened: tuple[str, int] | None = None     # a K-quant's form and group where its super-blocks are not read

    def on(self, device: torch.device) -> Serving:
        """How it is served on `device` (any accelerator as CUDA)."""
        return self.cpu if torch.device(device).type == "cpu" else self.cuda

    def describe(self, form: str, group: int) -> str:
        """How the report names it when served in `form`: "int8 as stored (group 32)",
        "Q4_K super-blocks as stored"; a K-quant widened: "int4 groups of 32, widened"; on the
        GPU "Q4_K blocks as stored (GPU)"."""
        if form in KQUANTS:
            return f"{form} as stored"
        if form in GPU_FORMS:
            return f"{form} as stored (GPU)" + (f", group {group}" if form == GPU_INT4_ZP else "")
        width = WIDTHS[form]
        if self.widened:
            return f"{width} groups of {group}, widened"
        return f"{width} as stored (group {group})"


def _gpu(name: str, source: str, form: str | None) -> Serving | None:
    """On CUDA: a GGUF type the CPU serves quantized in its blocks as stored, an AWQ/GPTQ
    checkpoint's int4 in zero-point groups; int4 / int8 at load dequantized (None: as on the
    CPU, already float)."""
    if form is None:
        return None
    if source == GGUF:
        return Serving(gpu_blocks(name), "as stored: the file's blocks byte for byte, read by the Triton kernel")
    if source == CHECKPOINT:
        return Serving(GPU_INT4_ZP, "as stored: 4-bit values, the fp16 scale and integer zero per group")
    return Serving(None, f"{WIDTHS[form]} weights quantized at load run on the CPU only (CUDA keeps them dequantized)")


def _row(name: str, source: str, form: str | None, group: int | None, why: str, zero: bool = False,
         widened: tuple[str, int] | None = None) -> StoredFormat:
    cpu = Serving(form, why)
    return StoredFormat(name, source, group, zero, cpu, _gpu(name, source, form) or cpu, widened)


FORMATS: dict[str, StoredFormat] = {f.name: f for f in (
    _row("Q4_0", GGUF, INT4, 32, "4-bit as stored: w = d(q - 8) is int4 groups of 32 exactly"),
    _row("Q4_1", GGUF, INT4, 32, "4-bit as stored: w = dq + m is int4 groups of 32 exactly"),
    _row("Q4_K", GGUF, Q4_K, 256, "as stored, 4.5 bits a weight: w = d·sc·q - dmin·m per sub-block of 32",
         widened=(INT4, 32)),
    _row("Q5_0", GGUF, INT5_GROUPS, 32, "5-bit as stored: w = d(q - 16) is int5 groups of 32 exactly (u = q, "
         "scale d, zero -16d)", zero=True),
    _row("Q5_1", GGUF, INT5_GROUPS, 32, "5-bit as stored: w = dq + m is int5 groups of 32 exactly (u = q, "
         "scale d, zero m)", zero=True),
    _row("Q5_K", GGUF, Q5_K, 256, "as stored, 5.5 bits a weight: w = d·sc·q - dmin·m per sub-block of 32",
         zero=True, widened=(INT8_GROUPS, 32)),
    _row("Q6_K", GGUF, Q6_K, 256, "as stored, 6.5625 bits a weight: w = d·sc·(q - 32) per sub-block of 16",
         widened=(INT8_GROUPS, 16)),
    _row("Q8_0", GGUF, INT8_GROUPS, 32, "8-bit as stored: w = dq, int8 groups of 32"),
    _row("MXFP4", GGUF, None, None, "no MXFP4 kernel yet"),
    _row(AWQ, CHECKPOINT, INT4, CHECKPOINT_GROUP, "4-bit as stored: w = (q - z)s is int4 groups exactly"),
    _row(GPTQ, CHECKPOINT, INT4, CHECKPOINT_GROUP, "4-bit as stored: w = (q - z)s is int4 groups exactly"),
    _row(INT4_AT_LOAD, AT_LOAD, INT4, 32, "weight_dtype int4: round-to-nearest per group of 32 (gpt-fast's)"),
    _row(INT8_AT_LOAD, AT_LOAD, INT8, PER_CHANNEL, "weight_dtype int8: round-to-nearest per output channel"),
    *(_row(name, FLOAT, None, None, "a float weight: the compute dtype") for name in (FLOAT_SOURCE, "F32", "F16", "BF16")),
)}
FLOAT_TYPES = tuple(name for name, f in FORMATS.items() if f.source == FLOAT)
AT_LOAD_FORMATS = {INT4: FORMATS[INT4_AT_LOAD], INT8: FORMATS[INT8_AT_LOAD]}    # weight_dtype -> its row


def format_of(name: str) -> StoredFormat:
    """The row of a stored type; a type with none (a GGUF's Q2_K, IQ4_XS, ...) is dequantized."""
    if name in FORMATS:
        return FORMATS[name]
    no_kernel = Serving(None, f"no kernel takes {name}")
    return StoredFormat(name, GGUF, None, False, no_kernel, no_kernel)


def form_on(name: str, device: torch.device) -> str | None:
    """The kernel form a stored type is served in on `device` (None: the compute dtype)."""
    return format_of(name).on(device).form


def gguf_forms() -> dict[str, StoredFormat]:
    """The GGUF types served in a kernel's form on the CPU (gguf_tensors decodes each)."""
    return {name: f for name, f in FORMATS.items() if f.source == GGUF and f.cpu.form is not None}
