"""A GGUF file's tensors as stored, under transformers' names: which quantization each one
has, and llama.cpp's 4-bit blocks as (q, scale, zero) groups for the int4 kernel.

The file is memory-mapped by the `gguf` package's reader; names map through its tensor-name
table, and the row order through transformers' own tensor processor (llama.cpp permutes the
rows of Llama's q and k projections; transformers undoes it on load, and so do we, on the
row index, so both agree by construction).

Block layouts (ggml-common.h): Q4_0 is fp16 d then 16 bytes of nibbles, w = d * (q - 8);
Q4_1 is fp16 d, fp16 m, then the nibbles, w = d * q + m. Byte j holds element j in its low
nibble and element j + 16 in its high nibble.
"""
from __future__ import annotations

from functools import cached_property
from pathlib import Path

import numpy as np
import torch

INT4_TYPES = ("Q4_0", "Q4_1")       # served as int4 as stored
BLOCK = 32


class GGUFTensors:
    def __init__(self, path: Path, hf_config):
        import gguf
        self.path = path
        self._gguf = gguf
        self.reader = gguf.GGUFReader(str(path))
        field = self.reader.fields["general.architecture"]
        self.arch = bytes(field.parts[field.data[0]]).decode()
        arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == self.arch)
        self.names = gguf.get_tensor_name_map(arch, hf_config.num_hidden_layers)
        self.by_name = {t.name: t for t in self.reader.tensors}
        self.hf_config = hf_config

    def _tensor(self, hf_name: str):
        name = self.names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        return None if name is None else self.by_name.get(name)

    def type_of(self, hf_name: str) -> str | None:
        """The stored type ("Q4_1", "Q8_0", "F32", ...), or None if the file lacks the tensor."""
        t = self._tensor(hf_name)
        return None if t is None else t.tensor_type.name

    def int4_group(self, in_features: int) -> int:
        return BLOCK

    def int4_groups(self, hf_name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q [out, in] uint8 0..15, scale, zero [out, in / 32] float32) with
        w = (q - 8) * scale + zero, rows in transformers' order."""
        t = self._tensor(hf_name)
        kind = t.tensor_type.name
        block_bytes = self._gguf.GGML_QUANT_SIZES[t.tensor_type][1]
        out = int(t.shape[1])
        raw = np.asarray(t.data).reshape(out, -1, block_bytes)
        d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        if kind == "Q4_1":
            m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
            nibbles = raw[..., 4:]
            zero = m + 8 * d
        elif kind == "Q4_0":
            nibbles = raw[..., 2:]
            zero = np.zeros_like(d)
        else:
            raise ValueError(f"{hf_name} is {kind}, not one of {INT4_TYPES}")
        q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(out, -1)
        rows = self._row_order(t.name, out)
        return (torch.from_numpy(q[rows]), torch.from_numpy(d[rows]), torch.from_numpy(zero[rows]))

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
