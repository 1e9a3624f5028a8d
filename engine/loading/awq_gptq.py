"""Safetensors AWQ and GPTQ checkpoints (int4, as vLLM and transformers load them): each
quantized linear's packed tensors, read as int4 groups for the CPU kernel or dequantized.

config.json's `quantization_config` says which (`quant_method` "awq" or "gptq"; an AutoGPTQ
folder may have quantize_config.json instead, which vLLM reads too). For a linear W [out, in]
in groups of g input elements (g = in when group_size is -1), the layouts AutoAWQ's and
AutoGPTQ's pack functions write and vLLM's awq / gptq linear methods read:
  AWQ, version "gemm": qweight int32 [in, out / 8], nibble i (bits 4i..4i+3) of column c
      holding output 8c + AWQ_ORDER[i]; qzeros int32 [in / g, out / 8], packed the same way;
      scales fp16 [in / g, out]. w = (q - z) * s.
  GPTQ: qweight int32 [in / 8, out], nibble j of row r holding input 8r + j; qzeros int32
      [in / g, out / 8], nibble j of column c holding output 8c + j; scales fp16 [in / g, out];
      g_idx int32 [in], which must be i // g (act-order, desc_act, is refused). The
      checkpoint format "gptq" (the default, AutoGPTQ's) stores z - 1, "gptq_v2" z itself
      (vLLM's zero_offset). w = (q - z) * s.
Our int4 kernel's groups are w = (q - 8) * scale + zero, so scale = s and zero = (8 - z) * s.
Both sides are small integers times an fp16 scale, exact in fp32: the mapping is exact.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from engine.errors import CheckpointError, UnsupportedModelError

AWQ, GPTQ = "AWQ", "GPTQ"       # the source types the weight report names
METHODS = (AWQ, GPTQ)
GPTQ_CONFIG_FILE = "quantize_config.json"
GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 0}        # checkpoint_format -> what to add to a stored zero
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)            # output 8c + AWQ_ORDER[i] sits in nibble i
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)    # nibble holding output 8c + k
PACK = 8                                        # int4 values per int32
SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)
FLOAT_HINT = "choose a 4-bit AWQ or GPTQ checkpoint, or the float model (weight_dtype int8/int4 quantizes it at load)"


@dataclass(frozen=True)
class QuantizationConfig:
    method: str             # AWQ | GPTQ
    group_size: int         # -1: one group over the whole input
    zero_offset: int        # added to each stored zero
    source: Path            # the file that said so, for messages

    def group_of(self, in_features: int) -> int:
        return in_features if self.group_size <= 0 else self.group_size


def read_quantization_config(folder: Path, fields: dict) -> QuantizationConfig | None:
    """The folder's AWQ/GPTQ settings (None for a float checkpoint), or an
    UnsupportedModelError naming what cannot be served."""
    settings, source = fields.get("quantization_config"), folder / "config.json"
    if settings is None and (folder / GPTQ_CONFIG_FILE).is_file():
        source = folder / GPTQ_CONFIG_FILE
        settings = {"quant_method": "gptq", **json.loads(source.read_text(encoding="utf-8"))}
    if settings is None:
        return None
    method = str(settings.get("quant_method", "")).lower()
    if method not in ("awq", "gptq"):
        raise UnsupportedModelError(f"{source}: quant_method {method or 'missing'!r} is not supported; "
                                    f"this workbench loads AWQ and GPTQ int4 checkpoints: {FLOAT_HINT}")
    bits = settings.get("bits", settings.get("w_bit"))
    if bits != 4:
        raise UnsupportedModelError(f"{source}: {method.upper()} with {bits}-bit weights is not supported, "
                                    f"only 4-bit: {FLOAT_HINT}")
    group = int(settings.get("group_size", settings.get("q_group_size", 128)))
    if method == "awq":
        return _awq_config(settings, group, source)
    return _gptq_config(settings, group, source)


def _awq_config(settings: dict, group: int, source: Path) -> QuantizationConfig:
    version = str(settings.get("version", "gemm")).lower()
    if version != "gemm":
        raise UnsupportedModelError(f"{source}: AWQ version {version!r} packs its weights in another layout; "
                                    f"only AWQ's \"gemm\" layout (AutoAWQ's default) is supported: {FLOAT_HINT}")
    if not settings.get("zero_point", True):
        raise UnsupportedModelError(f"{source}: AWQ without zero points is not supported: {FLOAT_HINT}")
    return QuantizationConfig(AWQ, group, 0, source)


def _gptq_config(settings: dict, group: int, source: Path) -> QuantizationConfig:
    if settings.get("desc_act"):
        raise UnsupportedModelError(f"{source}: this GPTQ checkpoint uses act-order (desc_act true): its groups "
                                    "follow a permutation of the input (g_idx) that the int4 kernel cannot "
                                    f"follow; choose a GPTQ checkpoint quantized with desc_act false, or {FLOAT_HINT}")
    checkpoint_format = str(settings.get("checkpoint_format", "gptq")).lower()
    if checkpoint_format not in GPTQ_FORMATS:
        raise UnsupportedModelError(f"{source}: GPTQ checkpoint_format {checkpoint_format!r} is not supported "
                                    f"(only {' or '.join(GPTQ_FORMATS)}): {FLOAT_HINT}")
    return QuantizationConfig(GPTQ, group, GPTQ_FORMATS[checkpoint_format], source)


class AWQGPTQTensors:
    """A checkpoint's AWQ/GPTQ linears, under transformers' names: "...q_proj.weight" names
    the linear whose "...q_proj.qweight", ".qzeros", ".scales" (and GPTQ's ".g_idx") the
    checkpoint holds. `find(name)` is the checkpoint's own name for a tensor, or None."""

    def __init__(self, checkpoint, config: QuantizationConfig, find: Callable[[str], str | None]):
        self.checkpoint, self.config, self.find = checkpoint, config, find

    def type_of(self, hf_name: str) -> str | None:
        """AWQ or GPTQ for a quantized linear's weight, None for any other tensor."""
        if not hf_name.endswith(".weight") or self.find(_base(hf_name) + ".qweight") is None:
            return None
        return self.config.method

    def int4_group(self, in_features: int) -> int:
        return self.config.group_of(in_features)

    def expected_shapes(self, hf_name: str, shape: tuple[int, int]) -> dict[str, tuple[int, ...]]:
        """The packed tensors' names (suffixes) and shapes for a weight [out, in]."""
        out, inp = shape
        group = self.config.group_of(inp)
        if inp % group or out % PACK or (self.config.method == GPTQ and inp % PACK):
            raise CheckpointError(f"{self.config.source}: {self.config.method} group_size {group} does not fit "
                                  f"{_base(hf_name)}, a [{out}, {inp}] weight (in must be a multiple of the group, "
                                  "out of 8); the weights and config.json belong to different models")
        packed = (inp, out // PACK) if self.config.method == AWQ else (inp // PACK, out)
        shapes = {".qweight": packed, ".qzeros": (inp // group, out // PACK), ".scales": (inp // group, out)}
        return shapes if self.config.method == AWQ else {**shapes, ".g_idx": (inp,)}

    def names(self, hf_name: str) -> list[str]:
        """The checkpoint tensors a quantized linear is read from."""
        found = (self.find(_base(hf_name) + s) for s in (".qweight", ".qzeros", ".scales", ".g_idx"))
        return [name for name in found if name is not None]

    def check_g_idx(self, hf_name: str, in_features: int) -> None:
        """GPTQ's g_idx must be the plain i // group (a checkpoint may also leave it out)."""
        name = self.find(_base(hf_name) + ".g_idx")
        if name is None:
            return
        trivial = torch.arange(in_features, dtype=torch.int32) // self.config.group_of(in_features)
        if not torch.equal(self.checkpoint.read(name).to(torch.int32), trivial):
            raise UnsupportedModelError(f"{self.checkpoint.file_of(name)}: {name} is not i // group_size, so this "
                                        "GPTQ checkpoint's groups follow a permutation of the input (act-order) "
                                        "that the int4 kernel cannot follow; choose one quantized with desc_act "
                                        f"false, or {FLOAT_HINT}")

    def int4_groups(self, hf_name: str, rows: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q [out, in] int32 0..15, scale, zero [out, in / group] float32) with
        w = (q - 8) * scale + zero, exactly the stored w = (q - z) * s (`rows`: of the out
        features, only those; a multiple of 8 where it starts and stops inside)."""
        q, z, s = self._unpacked(hf_name, rows)
        return q, s, (8 - z) * s

    def moves_columns(self, hf_name: str) -> bool:
        """False: a checkpoint's columns are the model's (a hybrid GGUF's may be reordered)."""
        return False

    def int4_zero_points(self, hf_name: str, rows: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q [out, in] int32 0..15, z [out, groups] int32, s [out, groups]) with w = (q - z) * s,
        as stored (the GPU kernel's form; `rows` as int4_groups)."""
        return self._unpacked(hf_name, rows)

    def dequantized(self, hf_name: str, rows: slice = slice(None)) -> torch.Tensor:
        """The weight [out, in] in float32, w = (q - z) * s (exact); `rows`: only those (as int4_groups)."""
        q, z, s = self._unpacked(hf_name, rows)
        out, groups = s.shape
        w = (q.view(out, groups, -1) - z[..., None]) * s[..., None]
        return w.view(out, -1)

    def _unpacked(self, hf_name: str, rows: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q [out, in], z [out, groups] int32, s [out, groups] float32), zero offset applied
        (`rows`: of out, only those; the packed columns that hold them sliced before unpacking)."""
        base = _base(hf_name)
        qweight, qzeros, scales = (self.checkpoint.read(self.find(base + s)) for s in (".qweight", ".qzeros", ".scales"))
        start, stop = rows.start or 0, rows.stop if rows.stop is not None else scales.shape[1]
        lo, hi = start // PACK * PACK, -(-stop // PACK) * PACK          # whole packed columns
        if rows != slice(None):
            packed = slice(lo // PACK, hi // PACK)
            qweight = qweight[:, packed] if self.config.method == AWQ else qweight[:, lo:hi]
            qzeros, scales = qzeros[:, packed], scales[:, lo:hi]
        if self.config.method == AWQ:
            q = _unpack_columns(qweight, AWQ_REVERSE_ORDER)         # [in, out]
            z = _unpack_columns(qzeros, AWQ_REVERSE_ORDER)          # [in / g, out]
        else:
            q = _unpack_rows(qweight)                               # [in, out]
            z = _unpack_columns(qzeros) + self.config.zero_offset   # [in / g, out]
        keep = slice(start - lo, stop - lo)
        return q.t()[keep].contiguous(), z.t()[keep].contiguous(), scales.float().t()[keep].contiguous()


def _base(hf_name: str) -> str:
    return hf_name.removesuffix(".weight")


def _unpack_columns(packed: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 [r, c] -> int32 [r, 8c]: nibble i of column j is value 8j + i, or, with `order`,
    value 8j + k is nibble order[k]."""
    nibbles = (packed.to(torch.int32)[..., None] >> SHIFTS) & 0xF       # [r, c, 8]
    if order is not None:
        nibbles = nibbles[..., list(order)]
    return nibbles.reshape(packed.shape[0], -1)


def _unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [r, c] -> int32 [8r, c]: nibble i of row j is row 8j + i."""
    nibbles = (packed.to(torch.int32)[:, None, :] >> SHIFTS[None, :, None]) & 0xF     # [r, 8, c]
    return nibbles.reshape(-1, packed.shape[1])
