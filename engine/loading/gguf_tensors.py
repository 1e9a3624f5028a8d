"""A GGUF file's tensors as stored, under transformers' names: which quantization each one
has, its blocks decoded exactly into the quantized kernels' forms (engine.layers.quantized_linear;
which form each type is served in is engine.loading.stored_formats' table), and a per-tensor
float read for what no kernel takes.

The file's header is parsed here (`read_header`: the tensors' names, types, shapes and
offsets, and the scalar metadata; the tokenizer's arrays are skipped, where the `gguf`
package's reader would hold 150k tokens as 300k numpy arrays, 360 MB). Names map through
gguf's tensor-name table, and the row order through transformers' own tensor processor (llama.cpp
permutes the rows of Llama's q and k projections; transformers undoes it on load, and so do
we, on the row index, so both agree by construction). Tensor bytes are read with plain file
reads, a slice of rows at a time, never through a memory map: a mapping keeps every page it
has touched resident (and counted in the process's RSS) for as long as it lives, so a
mapped 1 GB file would cost 1 GB of RSS on top of the weights built from it.

Block layouts (ggml-common.h), forms given to the kernels:
  Q4_0  fp16 d, 16 bytes of nibbles: w = d * (q - 8)          int4: scale d, zero 0
  Q4_1  fp16 d, fp16 m, nibbles: w = d * q + m                int4: scale d, zero m + 8d
        (byte j holds element j in its low nibble and element j + 16 in its high one)
  Q4_K  super-block of 256: fp16 d, fp16 dmin, 12 bytes of 6-bit (sc, m) for 8 sub-blocks
        of 32, 128 bytes of nibbles; w = d*sc * q - dmin*m    int4 (group 32): scale d*sc,
        zero 8*d*sc - dmin*m. Bytes 32j..32j+31 hold sub-block 2j in their low nibbles and
        sub-block 2j + 1 in their high ones.
  Q5_0  fp16 d, 4 bytes qh, 16 bytes of nibbles: w = d * (q - 16), q 0..31: the low 4 bits
        as Q4_0's nibbles, bit 4 of element j in bit j of qh (a little-endian uint32)
                                                              int8 groups of 32: q, scale d,
                                                              zero -16d
  Q5_1  fp16 d, fp16 m, qh, nibbles as Q5_0: w = d * q + m    int8 groups of 32: q, scale d,
                                                              zero m
  Q5_K  super-block of 256: Q4_K's d, dmin and 12 bytes of (sc, m), 32 bytes qh, 128 bytes
        of nibbles as Q4_K's; bit 4 of value l of sub-block j in bit j of qh[l];
        w = d*sc * q - dmin*m, q 0..31                        int8 groups of 32: q, scale
                                                              d*sc, zero -dmin*m
  Q8_0  fp16 d, 32 int8: w = d * q                            int8 groups of 32: scale d
  Q6_K  super-block of 256: ql 128 bytes (low 4 bits), qh 64 bytes (high 2 bits), int8
        scales[16], fp16 d; w = d*sc * (q - 32)               int8 groups of 16: q - 32 in
        -32..31, scale d*sc.
  MXFP4 block of 32: E8M0 exponent byte e, 16 bytes of E2M1 codes (byte j: value j in its
        low nibble, value j + 16 in its high one); w = fp4 * 2^(e - 127). No kernel takes
        it: dequantized as read (gpt-oss's experts), exactly (a 4-bit float times a power of two).
Every product above is exact in float32 (an fp16 times a 5-, 6- or 8-bit integer, d*sc times
a 5-bit q), so the kernel's form gives the same float32 weights as `gguf.quants.dequantize`,
which rounds once where the form adds its zero (Q4_K's zero is one float32 subtraction,
exact while d*sc and dmin*m are within 2^7 of each other, as llama.cpp's quantizer makes
them). Any other type is read through `gguf.quants.dequantize`.

Mixture-of-experts files (qwen3moe, gpt-oss) stack each layer's experts into one 3-D tensor
per projection, `blk.N.ffn_{gate,up,down}_exps` ([E, out, in] in torch's order; gpt-oss's
biases [E, out]). Seen as its rows [E*out, in], expert e's weight is the contiguous slab of
rows e*out .. (e+1)*out: each is presented as its own tensor under the per-expert name the
model's weight sources use (`model.layers.N.mlp.experts.E.gate_proj.weight`), with the
stacked tensor's type, so a Q4_K expert is served as stored as one linear and an MXFP4 one
is read (and dequantized) one expert at a time. Neither architecture's q/k rows are permuted
(llama.cpp permutes only Llama's).
"""
from __future__ import annotations

import dataclasses
import math
import mmap
import re
import struct
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from engine.errors import CheckpointError
from engine.layers.quantized_linear import INT4, INT5_GROUPS, INT8_GROUPS
from engine.loading.gguf_gemma import norm_shift
from engine.loading.gguf_qwen35 import check_hybrid_tensors, hybrid_layout
from engine.models.gemma import sandwich_norms
from engine.loading.stored_formats import format_of

FLOAT_READS = {"F32": np.float32, "F16": np.float16}      # float types read as they are
BLOCK = 32
READ_BYTES = 16 * 2**20         # stored bytes decoded per slice of rows
SPARSE = 8                      # rows wanted fewer than 1 in this many of their span: read one by one
# transformers' names of the tensors a Llama-family GGUF may hold (per layer: the rest)
GLOBAL_NAMES = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
LAYER_NAMES = ("input_layernorm.weight", "post_attention_layernorm.weight",
               *(f"self_attn.{p}_proj.{w}" for p in "qkvo" for w in ("weight", "bias")),
               "self_attn.q_norm.weight", "self_attn.k_norm.weight", "self_attn.sinks",
               *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")))
# Gemma's two more norms per layer (their gguf names would match a Llama file's ffn_norm too)
SANDWICH_NAMES = ("pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight")
# Gemma 4's per-layer inputs (whole model, then per layer) and layer scalars (engine.models.gemma4)
GEMMA4_GLOBAL_NAMES = ("model.embed_tokens_per_layer.weight", "model.per_layer_model_projection.weight",
                       "model.per_layer_projection_norm.weight")
GEMMA4_LAYER_NAMES = ("per_layer_input_gate.weight", "per_layer_projection.weight", "post_per_layer_input_norm.weight",
                      "layer_scalar")
# the router (ffn_gate_inp in the file) under the names the model type gives it
ROUTER_NAMES = {"qwen3_moe": ("mlp.gate.weight",), "gpt_oss": ("mlp.router.weight", "mlp.router.bias"),
                "qwen3_next": ("mlp.gate.weight",), "qwen3_5_moe_text": ("mlp.gate.weight",)}
# Qwen3.5's and Qwen3-Next's linear-attention layers and shared expert (engine.loading.gguf_qwen35)
HYBRID_LAYER_NAMES = (*(f"linear_attn.{n}" for n in ("A_log", "dt_bias", "conv1d.weight", "norm.weight", "out_proj.weight",
                                                     "in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight",
                                                     "in_proj_a.weight", "in_proj_qkvz.weight", "in_proj_ba.weight")),
                      *(f"mlp.shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")), "mlp.shared_expert_gate.weight")
EXPERT_NAMES = tuple(f"{p}_proj.{w}" for p in ("gate", "up", "down") for w in ("weight", "bias"))
_EXPERT = re.compile(r"^(?P<experts>model\.layers\.\d+\.mlp\.experts)\.(?P<e>\d+)"
                     r"\.(?P<proj>(gate|up|down)_proj\.(weight|bias))$")


class GGUFTensors:
    def __init__(self, path: Path, hf_config):
        import gguf
        self.path = Path(path)
        self._gguf = gguf
        self.metadata, tensors = read_header(self.path)
        self.arch = self.metadata["general.architecture"]
        arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == self.arch)
        self.names = gguf.get_tensor_name_map(arch, hf_config.num_hidden_layers)
        self.by_name = {t.name: t for t in tensors}
        self.hf_config = hf_config
        self.num_experts = int(self.metadata.get(f"{self.arch}.expert_count", 0))
        self._resolved: dict[str, StoredTensor | None] = {}
        check_stored(self.path, tensors, self.num_experts, f"{self.arch}.expert_count")
        self.layout = hybrid_layout(self.arch, hf_config, self.by_name)     # Qwen3.5 / Qwen3-Next: None otherwise
        if self.layout is not None:
            check_hybrid_tensors(self.path, self.layout, {t.name: t.shape for t in tensors})

    def source_of(self, hf_name: str):
        """A hybrid file's tensor: where it is and what undoes the converter (gguf_qwen35.Source), or None."""
        return None if self.layout is None else self.layout.source(hf_name)

    def _tensor(self, hf_name: str) -> "StoredTensor | None":
        if hf_name not in self._resolved:
            expert = _EXPERT.match(hf_name)
            self._resolved[hf_name] = self._expert_slab(expert) if expert else self._stored(hf_name)
        return self._resolved[hf_name]

    def _stored(self, hf_name: str) -> "StoredTensor | None":
        source = self.source_of(hf_name)
        if source is not None and source.parts:
            parts = [self.by_name.get(n) for n in source.parts]
            return None if None in parts else parts[0] if len(parts) == 1 else _concatenated(parts)
        name = self.names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            return None
        # gpt-oss's sinks have no suffix in transformers; llama.cpp names them attn_sinks.weight
        return self.by_name.get(name) or self.by_name.get(name + ".weight")

    def _expert_slab(self, match) -> "StoredTensor | None":
        """Expert e's rows of its layer's stacked tensor (`ffn_gate_exps.weight` [E, out, in],
        `ffn_gate_exps.bias` [E, out]): the contiguous e-th of its bytes, as a tensor of its own."""
        stacked = self._stored(f"{match['experts']}.{match['proj']}")
        e = int(match["e"])
        if stacked is None or len(stacked.shape) < 2 or e >= stacked.shape[-1]:
            return None
        share = stacked.n_bytes // stacked.shape[-1]
        return dataclasses.replace(stacked, shape=stacked.shape[:-1], n_bytes=share,
                                   data_offset=stacked.data_offset + e * share)

    def hf_names(self) -> list[str]:
        """transformers' names of the tensors the file holds (of those a Llama-family model has;
        a mixture-of-experts file's per expert)."""
        layers = range(self.hf_config.num_hidden_layers)
        moe = [*ROUTER_NAMES.get(getattr(self.hf_config, "model_type", None), ()),
               *(f"mlp.experts.{e}.{n}" for e in range(self.num_experts) for n in EXPERT_NAMES)]
        sandwich = SANDWICH_NAMES if sandwich_norms(self.hf_config) else ()
        gemma4 = getattr(self.hf_config, "model_type", None) == "gemma4_text"
        if gemma4:
            sandwich = SANDWICH_NAMES + GEMMA4_LAYER_NAMES
        hybrid = HYBRID_LAYER_NAMES if self.layout is not None else ()
        candidates = [*GLOBAL_NAMES, *(GEMMA4_GLOBAL_NAMES if gemma4 else ()),
                      *(f"model.layers.{i}.{n}" for i in layers for n in (*LAYER_NAMES, *sandwich, *moe, *hybrid))]
        return [n for n in candidates if self._tensor(n) is not None]

    def type_of(self, hf_name: str) -> str | None:
        """The stored type ("Q4_K", "Q6_K", "F32", ...), or None if the file lacks the tensor. A
        hybrid file's tensor that cannot be served as stored says "F32" (it is read dequantized):
        one made of two stored tensors of different types, or whose column reorder splits its
        type's groups."""
        t = self._tensor(hf_name)
        if t is None:
            return None
        source = self.source_of(hf_name)
        if source is not None and source.cols is not None and t.tensor_type.name not in FLOAT_READS \
                and not _whole_groups(source.cols, _widened_group(t.tensor_type.name)):
            return "F32"
        return t.tensor_type.name

    def moves_columns(self, hf_name: str) -> bool:
        """Whether transformers' columns are not the file's (a hybrid file's reorder): a K-quant's
        super-blocks are then served widened, a group at a time."""
        source = self.source_of(hf_name)
        return source is not None and source.cols is not None

    def shape(self, hf_name: str) -> tuple[int, ...]:
        """transformers' shape ([out, in]; GGUF lists the dimensions the other way round)."""
        source = self.source_of(hf_name)
        if source is not None and source.shape is not None:
            return source.shape
        return tuple(int(n) for n in reversed(self._tensor(hf_name).shape))

    def nbytes(self, hf_name: str) -> int:
        return int(self._tensor(hf_name).n_bytes)

    def int4_group(self, in_features: int) -> int:
        return BLOCK

    def int8_group(self, hf_name: str) -> int:
        return _widened_group(self.type_of(hf_name))

    def int4_groups(self, hf_name: str, rows: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q [out, in] uint8 0..15, scale, zero [out, in / 32] float32) with
        w = (q - 8) * scale + zero, rows in transformers' order (`rows`: only those)."""
        decode = self._decoder(hf_name, INT4)
        return self._decoded(hf_name, lambda stored: decode, rows=rows)

    def int8_groups(self, hf_name: str, rows: slice = slice(None)) -> tuple[torch.Tensor, ...]:
        """(q [out, in], scale [out, in / group] float32) with w = q * scale, q int8 (Q8_0:
        group 32; Q6_K: 16); or, for a type with a zero point (Q5_0, Q5_1, Q5_K: group 32),
        (q uint8 0..31, scale, zero) with w = q * scale + zero. Rows in transformers' order
        (`rows`: only those)."""
        decode = self._decoder(hf_name, INT8_GROUPS)
        return self._decoded(hf_name, lambda stored: decode, rows=rows)

    def int5_groups(self, hf_name: str, rows: slice = slice(None)) -> tuple[torch.Tensor, ...]:
        """(q [out, in] uint8 0..31, scale, zero [out, in / 32] float32) with w = q * scale + zero
        (Q5_0, Q5_1), rows in transformers' order (`rows`: only those)."""
        decode = self._decoder(hf_name, INT5_GROUPS)
        return self._decoded(hf_name, lambda stored: decode, rows=rows)

    def blocks(self, hf_name: str, rows: slice = slice(None)) -> tuple[torch.Tensor]:
        """(the file's blocks [out, in / values * bytes] uint8,) of a quantized tensor (a K-quant's
        super-blocks, a Q8_0's blocks of 32), rows in transformers' order (`rows`: only those),
        read as stored."""
        if self.type_of(hf_name) not in _DECODERS or self.moves_columns(hf_name):
            raise ValueError(f"{hf_name} is {self.type_of(hf_name)}, not quantized blocks in the file's column order")
        return self._decoded(hf_name, lambda stored: _as_stored, rows=rows)

    def _decoder(self, hf_name: str, form: str):
        """The decoder of the tensor's type into `form`, which the table must give that type
        (a K-quant's widened form too)."""
        kind = self.type_of(hf_name)
        fmt = format_of(kind)
        if form not in (fmt.cpu.form, (fmt.widened or (None,))[0]) or kind not in _DECODERS:
            raise ValueError(f"{hf_name} is {kind}, which is not served as {form} (engine.loading.stored_formats)")
        return _DECODERS[kind]

    def dequantized(self, hf_name: str, dtype: torch.dtype = torch.float32, rows: slice = slice(None)) -> torch.Tensor:
        """The tensor in `dtype`, as `gguf.quants.dequantize` gives it (then rounded to
        `dtype`), rows in transformers' order (`rows`: only those); decoded a slice of rows at
        a time, so no float32 copy of a large tensor is made on the way to a bf16 one."""
        (values,) = self._decoded(hf_name, self._float_decoder, dtype, rows=rows)
        return values.reshape(self.shape(hf_name)) if rows == slice(None) else values

    def _float_decoder(self, t: "StoredTensor"):
        """Stored blocks [rows, blocks, bytes] -> (float values [rows, n],), for t's type."""
        qtype = t.tensor_type
        if qtype.name in FLOAT_READS:
            return lambda raw: (raw.reshape(raw.shape[0], -1).view(FLOAT_READS[qtype.name]),)
        if qtype.name in _FLOAT_DECODERS:
            return lambda raw: (_FLOAT_DECODERS[qtype.name](raw),)
        return lambda raw: (self._gguf.quants.dequantize(raw.reshape(raw.shape[0], -1), qtype),)

    def _decoded(self, hf_name: str, decoder_of, dtype: torch.dtype | None = None,
                 rows: slice = slice(None)) -> tuple[torch.Tensor, ...]:
        """A decoder (stored blocks [rows, blocks, block bytes] -> arrays [rows, ...]; `decoder_of`
        gives it for a stored tensor: a hybrid file's tensor made of parts decodes each by its own) applied
        to slices of rows read from the file, written into whole tensors in transformers'
        row order (each output in `dtype` when given, else as decoded); `rows`: of
        transformers' rows, only these (the file's rows that hold them are read). A hybrid
        file's column reorder (gguf_qwen35) moves each output's columns (groups) after."""
        t = self._tensor(hf_name)
        total = int(t.shape[-1]) if len(t.shape) > 1 else 1
        wanted = (self._rows_of(hf_name, t, total) if len(t.shape) > 1 else np.zeros(1, dtype=np.int64))[rows]
        outputs = (self._read_parts(t, decoder_of, dtype, wanted) if t.parts
                   else self._read_rows(t, decoder_of(t), dtype, wanted))
        source = self.source_of(hf_name)
        if source is None or source.cols is None:
            return outputs
        return tuple(_columns_moved(out, source.cols) for out in outputs)

    def _rows_of(self, hf_name: str, t: "StoredTensor", total: int) -> np.ndarray:
        """Where each of transformers' rows is in the file (a hybrid file's reorder, or the Llama q/k one)."""
        source = self.source_of(hf_name)
        if source is not None and source.rows is not None:
            return source.rows
        return self._row_order(t.name, total)

    def _read_parts(self, t: "StoredTensor", decoder_of, dtype: torch.dtype | None,
                    wanted: np.ndarray) -> tuple[torch.Tensor, ...]:
        """_read_rows of a tensor made of parts (their rows concatenated): each wanted row read from
        its part, decoded by that part's decoder."""
        outputs, start = None, 0
        for part in t.parts:
            n = int(part.shape[-1])
            mine = np.nonzero((wanted >= start) & (wanted < start + n))[0]
            if len(mine):
                values = self._read_rows(part, decoder_of(part), dtype, wanted[mine] - start)
                if outputs is None:
                    outputs = [torch.empty((len(wanted), *v.shape[1:]), dtype=v.dtype) for v in values]
                for out, v in zip(outputs, values):
                    out[torch.from_numpy(mine)] = v.to(out.dtype)
            start += n
        return tuple(outputs)

    def _read_rows(self, t: "StoredTensor", decode, dtype: torch.dtype | None, wanted: np.ndarray) -> tuple[torch.Tensor, ...]:
        """`decode` applied to the file rows `wanted` of t (in that order), a slice of rows at a time."""
        total = int(t.shape[-1]) if len(t.shape) > 1 else 1
        block_values, block_bytes = self._gguf.GGML_QUANT_SIZES[t.tensor_type]
        row_bytes = t.n_bytes // total
        if decode is _as_stored and len(wanted) and np.array_equal(wanted, np.arange(wanted[0], wanted[0] + len(wanted))):
            return (self._read_run(t, int(wanted[0]), len(wanted), row_bytes),)
        where = np.full(total, -1, dtype=np.int64)      # file row -> its place in the output
        where[wanted] = np.arange(len(wanted))
        outputs = None
        span = int(wanted.max()) + 1 - int(wanted.min())
        sparse = len(wanted) * SPARSE < span            # the rows alone, one read each
        step = 1 if sparse else max(1, READ_BYTES // row_bytes)
        starts = np.unique(wanted) if sparse else range(int(wanted.min()), int(wanted.max()) + 1, step)
        with open(self.path, "rb", buffering=0) as f:
            for start in starts:
                n = min(step, int(wanted.max()) + 1 - start)
                index = where[start:start + n]
                keep = index >= 0
                if not keep.any():
                    continue
                f.seek(t.data_offset + start * row_bytes)
                raw = np.empty((n, row_bytes // block_bytes, block_bytes), dtype=np.uint8)
                if f.readinto(memoryview(raw).cast("B")) != raw.nbytes:
                    raise EOFError(f"{self.path} ends inside tensor {t.name}; the file is truncated")
                parts = [torch.from_numpy(np.ascontiguousarray(a)) for a in decode(raw if keep.all() else raw[keep])]
                if outputs is None:
                    outputs = [torch.empty((len(wanted), *p.shape[1:]), dtype=dtype or p.dtype) for p in parts]
                for out, part in zip(outputs, parts):
                    out.index_copy_(0, torch.from_numpy(index[keep]), part.to(out.dtype))
        return tuple(outputs)

    def _read_run(self, t: "StoredTensor", start: int, n: int, row_bytes: int) -> torch.Tensor:
        """File rows start .. start + n of t as stored [n, row_bytes] uint8: read straight into
        the tensor (a K-quant's rows in the file's order, most of a load's bytes)."""
        out = torch.empty((n, row_bytes), dtype=torch.uint8)
        with open(self.path, "rb", buffering=0) as f:
            f.seek(t.data_offset + start * row_bytes)
            view, done = memoryview(out.numpy()).cast("B"), 0
            while done < out.numel():
                got = f.readinto(view[done:])
                if not got:
                    raise EOFError(f"{self.path} ends inside tensor {t.name}; the file is truncated")
                done += got
        return out

    def _row_order(self, gguf_name: str, out: int) -> np.ndarray:
        """Where each of transformers' rows is in the file: transformers' processor applied
        to the row index."""
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor
        processor = TENSOR_PROCESSORS.get(self.arch, TensorProcessor)(config=self._processor_config)
        index = np.arange(out).reshape(out, 1)
        return np.asarray(processor.process(index, gguf_name).weights).reshape(out)

    @cached_property
    def _processor_config(self) -> dict:
        c = self.hf_config
        return {"num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads}


# ---- block decoders: stored blocks [rows, blocks, bytes] -> the kernels' forms, per row --------
def _widened_group(kind: str) -> int:
    """The group a stored type is served in a group at a time (a K-quant: its widened form's)."""
    fmt = format_of(kind)
    return fmt.widened[1] if fmt.widened else fmt.group or BLOCK


def _as_stored(raw: np.ndarray):
    """A row's blocks as the file stores them (a K-quant read in its super-blocks)."""
    return (_rows(raw),)


def _fp16(raw: np.ndarray, at: int) -> np.ndarray:
    """The fp16 at byte `at` of each block, as float32 [rows, blocks]."""
    return raw[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _rows(a: np.ndarray) -> np.ndarray:
    return a.reshape(a.shape[0], -1)


def _q4_0(raw: np.ndarray):
    d, nibbles = _fp16(raw, 0), raw[..., 2:]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)
    return _rows(q), d, np.zeros_like(d)


def _q4_1(raw: np.ndarray):
    d, m, nibbles = _fp16(raw, 0), _fp16(raw, 2), raw[..., 4:]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)
    return _rows(q), d, m + 8 * d


def _q4_k(raw: np.ndarray):
    rows, blocks = raw.shape[:2]
    d, dmin = _fp16(raw, 0)[..., None], _fp16(raw, 2)[..., None]
    sc, m = _k_scale_min(raw[..., 4:16])                        # [rows, blocks, 8] each
    nibbles = raw[..., 16:].reshape(rows, blocks, 4, 1, 32)     # 4 runs of 32 bytes
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=3)  # [rows, blocks, 4, 2, 32]: sub-blocks 2j, 2j+1
    scale = d * sc.astype(np.float32)
    return _rows(q), _rows(scale), _rows(8 * scale - dmin * m.astype(np.float32))


def _k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """12 bytes -> 8 six-bit scales and 8 six-bit mins (ggml's get_scale_min_k4): sub-blocks
    0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 in the nibbles
    of bytes 8-11, with their top 2 bits in the top bits of bytes 0-3 and 4-7."""
    lo, hi, mix = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    m = np.concatenate([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], axis=-1)
    return sc, m


def _q5_values(qh: np.ndarray, nibbles: np.ndarray) -> np.ndarray:
    """Q5_0's and Q5_1's 32 five-bit values per block: element j < 16 in the low nibble of
    byte j, element j + 16 in its high nibble, bit 4 of element j in bit j of qh (4 bytes, a
    little-endian uint32)."""
    high = np.unpackbits(qh, axis=-1, bitorder="little")                # [rows, blocks, 32]: bit j
    return np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1) | (high << 4)


def _q5_0(raw: np.ndarray):
    d = _fp16(raw, 0)
    return _rows(_q5_values(raw[..., 2:6], raw[..., 6:])), d, -16 * d


def _q5_1(raw: np.ndarray):
    return _rows(_q5_values(raw[..., 4:8], raw[..., 8:])), _fp16(raw, 0), _fp16(raw, 2)


def _q5_k(raw: np.ndarray):
    rows, blocks = raw.shape[:2]
    d, dmin = _fp16(raw, 0)[..., None], _fp16(raw, 2)[..., None]
    sc, m = _k_scale_min(raw[..., 4:16])                        # [rows, blocks, 8] each
    qh = raw[..., 16:48].reshape(rows, blocks, 1, 32)           # bit j of byte l: value l of sub-block j
    high = (qh >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1
    nibbles = raw[..., 48:].reshape(rows, blocks, 4, 1, 32)     # as Q4_K's
    low = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=3).reshape(rows, blocks, 8, 32)
    return _rows(low | (high << 4)), _rows(d * sc.astype(np.float32)), _rows(-(dmin * m.astype(np.float32)))


def _q8_0(raw: np.ndarray):
    return _rows(raw[..., 2:].copy().view(np.int8)), _fp16(raw, 0)


def _q6_k(raw: np.ndarray):
    rows, blocks = raw.shape[:2]
    ql = raw[..., :128].reshape(rows, blocks, 2, 1, 64)         # two halves of 128 values
    qh = raw[..., 128:192].reshape(rows, blocks, 2, 1, 32)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=3).reshape(rows, blocks, 2, 4, 32)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)) & 0x03
    q = (low | (high << 4)).astype(np.int8) - np.int8(32)
    scale = _fp16(raw, 208)[..., None] * raw[..., 192:208].copy().view(np.int8).astype(np.float32)
    return _rows(q), _rows(scale)


# E2M1's 16 values, doubled (ggml's kvalues_mxfp4): with ggml's scale 2^(e - 128), exact
_FP4_DOUBLED = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.float32)


def _mxfp4(raw: np.ndarray) -> np.ndarray:
    """MXFP4 blocks -> float32 values [rows, blocks * 32], as gguf.quants (ggml) decodes them."""
    codes = raw[..., 1:]
    values = _FP4_DOUBLED[np.concatenate([codes & 0x0F, codes >> 4], axis=-1)]      # [rows, blocks, 32]
    return _rows(np.ldexp(values, raw[..., :1].astype(np.int32) - 128))


# each GGUF type the table serves in a kernel's form, decoded into it
_DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q5_K": _q5_k,
             "Q6_K": _q6_k, "Q8_0": _q8_0}
_FLOAT_DECODERS = {"MXFP4": _mxfp4}     # decoded here, faster than gguf.quants (the same values)


# ---- the header ---------------------------------------------------------------------------
@dataclass(frozen=True)
class StoredTensor:
    name: str                   # GGUF's: "blk.0.attn_q.weight"
    tensor_type: "object"       # gguf.GGMLQuantizationType
    shape: tuple[int, ...]      # GGUF's order: the fastest-varying dimension first
    n_bytes: int
    data_offset: int            # from the start of the file
    parts: tuple["StoredTensor", ...] = ()      # a tensor made of these, their rows concatenated


def _concatenated(parts: list[StoredTensor]) -> StoredTensor:
    """One of transformers' tensors stored as several (Qwen3-Next's in_proj_qkvz: attn_qkv and
    attn_gate): of their type where they share one (served as stored, each row from its part),
    else said F32 (read dequantized, each part by its own type)."""
    import gguf
    kinds = {p.tensor_type for p in parts}
    return StoredTensor("+".join(p.name for p in parts),
                        parts[0].tensor_type if len(kinds) == 1 else gguf.GGMLQuantizationType.F32,
                        (parts[0].shape[0], sum(p.shape[-1] for p in parts)), sum(p.n_bytes for p in parts), -1,
                        tuple(parts))


def _whole_groups(cols: np.ndarray, group: int) -> bool:
    """Whether a column order moves whole groups of `group` columns (each kept in order)."""
    blocks = cols.reshape(-1, group) if cols.size % group == 0 else None
    return blocks is not None and bool((blocks[:, :1] % group == 0).all() and (np.diff(blocks, axis=1) == 1).all())


def _columns_moved(values: torch.Tensor, cols: np.ndarray) -> torch.Tensor:
    """values [rows, n / g] (a decoded form's columns or its groups' scales) with column c taken
    from the file's cols[c], a group at a time."""
    group = cols.size // values.shape[1]
    return values[:, torch.from_numpy(cols[::group] // group)]


_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def read_header(path: Path) -> tuple[dict, list[StoredTensor]]:
    """(scalar metadata, tensors) of a GGUF file (v2/v3, little-endian); array values
    (the tokenizer's tokens and merges) are skipped, but for short numeric ones (per layer)."""
    import gguf
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        _, n_tensors, n_kv = struct.unpack_from("<IQQ", data, 4)
        at, metadata = 24, {}
        for _ in range(n_kv):
            key, at = _string(data, at)
            (kind,), at = struct.unpack_from("<I", data, at), at + 4
            value, at = _value(data, at, kind)
            if value is not None:
                metadata[key] = value
        infos = []
        for _ in range(n_tensors):
            name, at = _string(data, at)
            (dims,), at = struct.unpack_from("<I", data, at), at + 4
            shape, at = struct.unpack_from(f"<{dims}Q", data, at), at + 8 * dims
            kind, offset = struct.unpack_from("<IQ", data, at)
            at += 12
            infos.append((name, gguf.GGMLQuantizationType(kind), tuple(int(n) for n in shape), offset))
    alignment = int(metadata.get("general.alignment", 32))
    start = -(-at // alignment) * alignment
    tensors = []
    for name, kind, shape, offset in infos:
        values, nbytes = gguf.GGML_QUANT_SIZES[kind]
        tensors.append(StoredTensor(name, kind, shape, math.prod(shape) // values * nbytes, start + offset))
    return metadata, tensors


def check_stored(path: Path, tensors: list[StoredTensor], num_experts: int, experts_key: str) -> None:
    """Every tensor's bytes are in the file, and every stacked expert tensor holds the number
    of experts the metadata says; else a CheckpointError naming the tensor."""
    size = path.stat().st_size
    for t in tensors:
        if t.data_offset + t.n_bytes > size:
            raise CheckpointError(f"{path} is truncated: tensor {t.name} ({t.tensor_type.name}) ends at byte "
                                  f"{t.data_offset + t.n_bytes} but the file has {size} bytes; download or copy "
                                  "it again")
        if "_exps." in t.name and (len(t.shape) < 2 or t.shape[-1] != num_experts):
            raise CheckpointError(f"{path}: tensor {t.name} has shape {list(t.shape)} (GGUF's order: experts last) "
                                  f"but {experts_key} is {num_experts}; the file is corrupt: download or convert "
                                  "it again")


def _string(data, at: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", data, at)
    return bytes(data[at + 8:at + 8 + n]).decode("utf-8", errors="replace"), at + 8 + n


def _value(data, at: int, kind: int):
    """(the value, or None for an array, which is skipped unless short and numeric; the offset after it)."""
    if kind == _STRING:
        return _string(data, at)
    if kind != _ARRAY:
        fmt = "<" + _SCALARS[kind]
        return struct.unpack_from(fmt, data, at)[0], at + struct.calcsize(fmt)
    item, count = struct.unpack_from("<IQ", data, at)
    at += 12
    if item == _STRING:
        for _ in range(count):
            at += 8 + struct.unpack_from("<Q", data, at)[0]
    elif item == _ARRAY:
        for _ in range(count):
            at = _value(data, at, _ARRAY)[1]
    elif count <= PER_LAYER_ARRAY_MAX:      # a per-layer key (Gemma 4's sliding_window_pattern, feed_forward_length)
        fmt = f"<{count}{_SCALARS[item]}"
        return list(struct.unpack_from(fmt, data, at)), at + struct.calcsize(fmt)
    else:
        at += count * struct.calcsize("<" + _SCALARS[item])
    return None, at


PER_LAYER_ARRAY_MAX = 1024      # numeric arrays up to this long are read (one value per layer); longer are the tokenizer's


class GGUFCheckpoint:
    """A GGUF file read as engine.loading.checkpoint.Checkpoint reads safetensors shards:
    transformers' names and shapes, one tensor at a time, each dequantized straight into
    `dtype` (the load's). The loader leaves the tensors served as stored on the meta device,
    so those are never read this way."""

    def __init__(self, folder: Path, tensors: GGUFTensors, dtype: torch.dtype):
        self.folder, self.source, self.dtype = Path(folder), tensors, dtype
        self.tensors = {name: tensors.shape(name) for name in tensors.hf_names()}
        # gpt-oss's experts: no kernel takes MXFP4, so they are dequantized as read (the loader says so)
        self.mxfp4 = any(tensors.type_of(name) == "MXFP4" for name in self.tensors)

    @property
    def files(self) -> list[Path]:
        return [self.source.path]

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name]

    def file_of(self, name: str) -> Path:
        return self.source.path

    def nbytes(self, name: str) -> int:
        return self.source.nbytes(name)

    def read(self, name: str) -> torch.Tensor:
        hybrid = self.source.source_of(name)
        if hybrid is not None and (hybrid.values or hybrid.elements is not None):    # Qwen3.5 / Qwen3-Next
            return self.source.layout.float_values(hybrid, self.source.dequantized(name, torch.float32)).to(self.dtype)
        shift = norm_shift(name, self.source.hf_config)      # Gemma's norms are stored as 1 + w
        if shift:
            return (self.source.dequantized(name, torch.float32) - shift).to(self.dtype)
        return self.source.dequantized(name, self.dtype)
