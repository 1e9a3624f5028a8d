"""The layouts the GPU quantized kernels read (engine.kernels.gpu_quant: their entry points;
engine.kernels.gpu_quant_linear: the Triton code), and a weight in one of them.

On the device no weight is widened to more bits than its file gives it:
  - a GGUF type in BLOCKS: the file's rows of blocks [out, in / values * bytes] uint8, byte for
    byte (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 in blocks of 32 values; Q4_K, Q5_K, Q6_K in
    super-blocks of 256). llama.cpp's CUDA build and vLLM's GGUF kernels read the same bytes.
  - INT4_ZP (an AWQ / GPTQ checkpoint's int4, w = (q - z) * s per group of g inputs): the
    4-bit values [out, in / 2] uint8, each 32 inputs in 16 bytes as a Q4_0 block's (value l
    in the low nibble of byte l, value l + 16 in its high nibble), s [out, in / g] fp16 as the
    checkpoint stores it, z [out, in / g] uint8: 4 + 24 / g bits a weight (4.19 at g = 128).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

@dataclass(frozen=True)
class Layout:
    values: int                 # weights a block holds along the input
    bytes: int                  # bytes a block takes
    sub: int                    # weights that share one scale (the kernel's step along the input)


# GGUF's block layouts (ggml-common.h), read as stored
BLOCKS = {"Q4_0": Layout(32, 18, 32), "Q4_1": Layout(32, 20, 32), "Q5_0": Layout(32, 22, 32),
          "Q5_1": Layout(32, 24, 32), "Q8_0": Layout(32, 34, 32), "Q4_K": Layout(256, 144, 32),
          "Q5_K": Layout(256, 176, 32), "Q6_K": Layout(256, 210, 16)}
INT4_ZP = "int4-zp"             # AWQ / GPTQ: 4-bit values, fp16 scale and uint8 zero per group
FORMATS = (*BLOCKS, INT4_ZP)
ROWS_PER_PROGRAM = 16           # the tile of activation rows (tl.dot's least); fixed: batch invariance
OUTPUTS_PER_PROGRAM = 32        # the tile of output features (untuned: bench gpu-check measures it)
DOT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def stored_bytes(fmt: str, shape: tuple[int, int], group: int = 0) -> int:
    """Bytes a weight [out, in] takes on the device in `fmt`'s layout (`group`: INT4_ZP's)."""
    out, inp = shape
    if fmt == INT4_ZP:
        return out * inp // 2 + out * (inp // group) * 3
    layout = BLOCKS[fmt]
    return out * inp // layout.values * layout.bytes


def shape_refusal(fmt: str, shape: tuple[int, int], group: int = 0) -> str | None:
    """Why the kernel cannot take a weight of this shape in `fmt` (None: it can)."""
    out, inp = shape
    if fmt not in FORMATS:
        return f"no GPU kernel reads {fmt}"
    if fmt == INT4_ZP:
        if group <= 0 or group % 32 or inp % group:
            return f"int4 groups of {group} over {inp} inputs (the GPU kernel takes groups of a multiple of 32)"
        return None
    if inp % BLOCKS[fmt].values:
        return f"in_features {inp} is not a multiple of {fmt}'s {BLOCKS[fmt].values}-value blocks"
    return None


@dataclass
class StoredWeight:
    """A weight [out, in] in a layout of the module docstring, on its device."""
    fmt: str                    # a BLOCKS type or INT4_ZP
    data: torch.Tensor          # blocks [out, bytes a row] uint8; INT4_ZP: the 4-bit values [out, in / 2]
    shape: tuple[int, int]
    scales: torch.Tensor | None = None      # INT4_ZP: s [out, in / group] fp16
    zeros: torch.Tensor | None = None       # INT4_ZP: z [out, in / group] uint8
    group: int = 0                          # INT4_ZP: inputs a scale covers

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scales, self.zeros) if t is not None)

    def to(self, device) -> "StoredWeight":
        def move(t):
            return None if t is None else t.to(device)
        return StoredWeight(self.fmt, self.data.to(device), self.shape, move(self.scales), move(self.zeros), self.group)


def int4_zp_weight(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor) -> StoredWeight:
    """An AWQ / GPTQ linear's q [out, in] 0..15, z [out, groups] and s [out, groups] (w = (q - z)
    * s, s an fp16 value) in INT4_ZP's layout, on q's device."""
    out, inp = q.shape
    runs = q.to(torch.uint8).view(out, inp // 32, 2, 16)
    data = (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(out, inp // 2).contiguous()
    return StoredWeight(INT4_ZP, data, (out, inp), s.to(torch.float16).contiguous(), z.to(torch.uint8).contiguous(),
                        inp // s.shape[1])
