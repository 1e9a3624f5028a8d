"""gpt-oss's fused expert tensors, seen as one tensor per expert under the names a Qwen3-MoE
checkpoint uses (`model.layers.L.mlp.experts.E.{gate,up,down}_proj.{weight,bias}`), so the
model's weight sources, the shape checks and the loader are the same for both.

A gpt-oss checkpoint stores each layer's experts fused: `experts.gate_up_proj` [E, H, 2I]
(input-major, gate and up interleaved: gate in the even columns), `experts.down_proj`
[E, I, H], their biases [E, 2I] and [E, H]; or, as OpenAI ships it, the two weights in MXFP4
(`*_blocks` [E, out, in/32, 16] bytes of 4-bit E2M1 values, low nibble first, and `*_scales`
[E, out, in/32] E8M0 exponents biased by 127), dequantized here one expert at a time as it
is read, exactly as transformers' `convert_moe_packed_tensors` does (every value is a power
of two times a 4-bit float: exact in bf16 and fp32). Peak memory stays at one expert.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate|up|down)_proj\.(?P<attr>weight|bias)$")


@dataclass(frozen=True)
class _Virtual:
    source: str            # the fused tensor (or the MXFP4 blocks)
    expert: int
    proj: str              # gate / up / down
    attr: str              # weight / bias
    mxfp4: bool
    shape: tuple[int, ...]


class FusedExpertTensors:
    """A Checkpoint with gpt-oss's fused (or MXFP4) expert tensors presented per expert; every
    other tensor passes through."""

    source = None           # no tensor of it is served as stored (the loader's GGUF/AWQ hook)

    def __init__(self, checkpoint):
        self.checkpoint = checkpoint
        self.folder = checkpoint.folder
        self.virtual: dict[str, _Virtual] = {}
        self.fused: set[str] = set()
        for name in list(checkpoint.tensors):
            self._add(name)
        self.tensors = {n: None for n in checkpoint.tensors if n not in self.fused}
        self.tensors.update(dict.fromkeys(self.virtual))
        self.mxfp4 = any(v.mxfp4 for v in self.virtual.values())

    def _add(self, name: str) -> None:
        match = re.match(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$", name)
        if not match:
            return
        prefix, fused, suffix = match.group(1), match.group(2), match.group(3) or ""
        self.fused.add(name)
        if suffix == "_scales":
            return
        shape = self.checkpoint.shape(name)
        mxfp4 = suffix == "_blocks"
        projs = ("gate", "up") if fused == "gate_up_proj" else ("down",)
        attr = "bias" if suffix == "_bias" else "weight"
        for e in range(shape[0]):
            for proj in projs:
                if attr == "bias":
                    size = shape[1] // len(projs)
                    vshape = (size,)
                elif mxfp4:                               # [E, out, in/32, 16]: rows are outputs
                    vshape = (shape[1] // len(projs), shape[2] * shape[3] * 2)
                else:                                     # [E, in, out]
                    vshape = (shape[2] // len(projs), shape[1])
                self.virtual[f"{prefix}.{e}.{proj}_proj.{attr}"] = _Virtual(name, e, proj, attr, mxfp4, vshape)

    @property
    def files(self):
        return self.checkpoint.files

    def __contains__(self, name: str) -> bool:
        return name in self.virtual or (name in self.checkpoint and name not in self.fused)

    def shape(self, name: str) -> tuple[int, ...]:
        v = self.virtual.get(name)
        return v.shape if v is not None else self.checkpoint.shape(name)

    def file_of(self, name: str):
        v = self.virtual.get(name)
        return self.checkpoint.file_of(v.source if v is not None else name)

    def nbytes(self, name: str) -> int:
        v = self.virtual.get(name)
        if v is None:
            return self.checkpoint.nbytes(name)
        whole = self.checkpoint.nbytes(v.source)
        if v.mxfp4:
            whole += self.checkpoint.nbytes(v.source.removesuffix("_blocks") + "_scales")
        split = 2 if v.proj in ("gate", "up") else 1
        return whole // (self.checkpoint.shape(v.source)[0] * split)

    def read(self, name: str) -> torch.Tensor:
        v = self.virtual.get(name)
        if v is None:
            return self.checkpoint.read(name)
        t = self.checkpoint.read(v.source)[v.expert]
        pick = {"gate": slice(0, None, 2), "up": slice(1, None, 2), "down": slice(None)}[v.proj]
        if v.attr == "bias":
            return t[pick].clone()
        if v.mxfp4:
            scales = self.checkpoint.read(v.source.removesuffix("_blocks") + "_scales")[v.expert]
            return dequantize_mxfp4(t[pick], scales[pick])
        return t[:, pick].t().contiguous()                # [in, out] -> our [out, in]

    def read_all(self) -> dict[str, torch.Tensor]:
        return {name: self.read(name) for name in self.tensors}


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """MXFP4 blocks [rows, G, 16] (uint8, two E2M1 values a byte, the low nibble first) and
    E8M0 scales [rows, G] -> [rows, G * 32] in `dtype`: value · 2^(scale − 127)."""
    blocks = blocks.to(torch.uint8)
    lut = torch.tensor(FP4_VALUES, dtype=dtype)
    rows, groups, width = blocks.shape
    out = torch.empty(rows, groups, width * 2, dtype=dtype)
    out[..., 0::2] = lut[(blocks & 0x0F).long()]
    out[..., 1::2] = lut[(blocks >> 4).long()]
    out = torch.ldexp(out, (scales.to(torch.int32) - 127).unsqueeze(-1).to(dtype))
    return out.reshape(rows, groups * width * 2)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, in] float -> (blocks [rows, in/32, 16] uint8, scales [rows, in/32] uint8): the
    nearest E2M1 value of each weight under a per-32 power-of-two scale (for synthetic
    checkpoints in the tests; dequantize_mxfp4 inverts it exactly on the values it yields)."""
    rows, k = w.shape
    g = w.float().reshape(rows, k // 32, 32)
    amax = g.abs().amax(-1).clamp(min=2.0 ** -126)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = g / torch.exp2(exponent).unsqueeze(-1)
    magnitudes = torch.tensor(FP4_VALUES[:8])
    codes = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(-1)
    codes = codes + 8 * (scaled < 0).long() * (codes > 0).long()
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return packed, (exponent + 127).to(torch.uint8)
