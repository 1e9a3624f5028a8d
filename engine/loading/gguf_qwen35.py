"""Qwen3.5 and Qwen3-Next from a llama.cpp file (`general.architecture` "qwen35", "qwen3next";
"qwen35moe" mapped alike): the config from the keys convert_hf_to_gguf.py writes, and every
tensor back in the names and layouts transformers' checkpoints have (engine.models.qwen3_5 reads).

Keys (conversion/qwen.py, Qwen3NextModel.set_gguf_parameters; src/models/qwen3next.cpp,
qwen35.cpp, load_arch_hparams): the dense model's (embedding_length, block_count,
feed_forward_length, attention.head_count(_kv), attention.key_length = head_dim,
layer_norm_rms_epsilon, rope.freq_base, context_length), and
  ssm.conv_kernel     linear_conv_kernel_dim
  ssm.state_size      linear_key_head_dim (llama.cpp takes the value heads' dim as the same)
  ssm.group_count     linear_num_key_heads
  ssm.time_step_rank  linear_num_value_heads
  ssm.inner_size      linear_value_head_dim * linear_num_value_heads
  full_attention_interval   layer i is full attention where (i + 1) % interval == 0 (4 by default)
  attention.recurrent_layers   (newer files) one bool per layer, true: linear; preferred to the interval
  rope.dimension_count      head_dim * partial_rotary_factor (the rotated dims)
  nextn_predict_layers      (qwen35) the MTP blocks appended to block_count: not ours, skipped
  expert_count, expert_used_count, expert_feed_forward_length, expert_shared_feed_forward_length
                      (qwen3next) the experts; every layer has them (llama.cpp refuses zero
                      experts and has no dense layer), top-k renormalised (build_moe_ffn, norm_w).
Qwen3.5's rope.dimension_sections (MRoPE) rotate a text token as plain RoPE does (every section
gets the same position), so they are not read.

Tensors, and what the converter did to each (Qwen3NextModel.modify_tensors, inherited by Qwen3.5's
_LinearAttentionVReorderBase); the reader undoes it:
- every `*norm.weight` but the linear layers' gated norm (`linear_attn.norm`) stored as 1 + w
  (llama.cpp multiplies by the stored weight): minus 1 on read, in fp32 (engine.loading.gguf_gemma);
- `A_log` stored as ssm_a = -exp(A_log): A_log = log(-ssm_a);
- `dt_bias` stored as `ssm_dt.bias`; `conv1d.weight` [C, 1, K] squeezed to ssm_conv1d [C, K];
- Qwen3-Next's `in_proj_qkvz` (per key head: q, k, the head's v and z) split into attn_qkv
  [all q; all k; all v] and attn_gate [all z] (older files: ssm_in, as transformers has it);
  its in_proj_ba is ssm_ba as is (per key head [b; a], which llama.cpp's graph splits so);
- Qwen3.5's in_proj_qkv / in_proj_z / in_proj_b / in_proj_a are attn_qkv / attn_gate /
  ssm_beta / ssm_alpha, and, where there are fewer key heads than value heads, the value heads
  are reordered from grouped by key head ([k0: v0 v1, k1: v0 v1]) to tiled ([v0 of k0, k1; v1 of
  k0, k1]: ggml_repeat broadcasts q and k so) in every tensor they index: the v rows of attn_qkv
  and ssm_conv1d, the rows of attn_gate, ssm_beta, ssm_alpha, the elements of ssm_a and
  ssm_dt, the columns of ssm_out (_LinearAttentionVReorderBase._reorder_v_heads);
- the full layers' q_proj ([q; gate] per head), k, v, o, the MLP and the experts (stacked as
  Qwen3-MoE's), the shared expert (ffn_*_shexp) and its gate (ffn_gate_inp_shexp) as they are.
A row reorder is applied to the row index, as the Llama q/k permutation is (so a quantized
tensor is still served as stored); ssm_out's column reorder moves whole value heads, so the
decoded groups move with them where a head is whole groups, and the tensor is dequantized
where it is not; Qwen3-Next's in_proj_qkvz, made of two stored tensors, is served as stored
where they share a type (each row read from its part), and dequantized where they do not (a
Q4_K_M file's attn_qkv is Q5_K and its attn_gate Q4_K, llama.cpp's recipe).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.errors import CheckpointError

GGUF_HYBRID_ARCHES = {"qwen35": "qwen3_5_text", "qwen3next": "qwen3_next", "qwen35moe": "qwen3_5_moe_text"}
ARCHITECTURES = {"qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_next": "Qwen3NextForCausalLM",
                 "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"}
TILED_V_HEADS = ("qwen35", "qwen35moe")      # the converter reorders their value heads
LLAMA_CPP_FULL_ATTENTION_INTERVAL = 4
NORM_SHIFT = 1.0
SPLIT = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight")   # Qwen3.5's
PER_KEY_HEAD = ("in_proj_qkvz.weight", "in_proj_ba.weight")                                 # Qwen3-Next's


def gguf_hybrid_config(metadata: dict, shapes: dict[str, tuple[int, ...]], **extra):
    """A Qwen3.5 / Qwen3-Next config from a llama.cpp file's keys (see the module's docstring),
    plus `extra` fields (the special token ids)."""
    from transformers import AutoConfig
    arch = metadata["general.architecture"]
    model_type = GGUF_HYBRID_ARCHES[arch]

    def key(name, default=None):
        return metadata.get(f"{arch}.{name}", default)
    layers = int(key("block_count")) - int(key("nextn_predict_layers", 0))
    heads, hidden = key("attention.head_count"), key("embedding_length")
    head_dim = key("attention.key_length", hidden // heads)
    value_heads = key("ssm.time_step_rank")
    interval = int(key("full_attention_interval", LLAMA_CPP_FULL_ATTENTION_INTERVAL))
    recurrent = key("attention.recurrent_layers") or [(i + 1) % interval != 0 for i in range(layers)]
    fields = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=key("attention.head_count_kv", heads), head_dim=head_dim,
                  intermediate_size=key("feed_forward_length"), max_position_embeddings=key("context_length"),
                  rms_norm_eps=key("attention.layer_norm_rms_epsilon"), vocab_size=shapes["token_embd.weight"][1],
                  tie_word_embeddings="output.weight" not in shapes, linear_conv_kernel_dim=key("ssm.conv_kernel"),
                  linear_key_head_dim=key("ssm.state_size"), linear_num_key_heads=key("ssm.group_count"),
                  linear_num_value_heads=value_heads, linear_value_head_dim=key("ssm.inner_size") // value_heads,
                  layer_types=["linear_attention" if recurrent[i] else "full_attention" for i in range(layers)],
                  rope_parameters={"rope_type": "default", "rope_theta": float(key("rope.freq_base", 10000.0)),
                                   "partial_rotary_factor": key("rope.dimension_count", head_dim) / head_dim})
    if key("expert_count"):
        fields.update(num_experts=key("expert_count"), num_experts_per_tok=key("expert_used_count"),
                      moe_intermediate_size=key("expert_feed_forward_length"),
                      shared_expert_intermediate_size=key("expert_shared_feed_forward_length"),
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    return AutoConfig.for_model(model_type, architectures=[ARCHITECTURES[model_type]], **fields, **extra)


# ---- the tensors -------------------------------------------------------------------------
@dataclass(frozen=True)
class Source:
    """Where one of transformers' tensors is in the file, and what undoes the converter."""
    parts: tuple[str, ...]                  # llama.cpp's tensors, their rows concatenated
    rows: np.ndarray | None = None          # transformers' row r is the parts' row rows[r]
    cols: np.ndarray | None = None          # transformers' column c is the file's column cols[c]
    shape: tuple[int, ...] | None = None    # transformers' shape, where the file's differs
    values: str | None = None               # a float transform: "shift" (1 + w), "a_log" (-exp)
    elements: np.ndarray | None = None      # a 1-D tensor's element order (as rows)


def v_head_order(key_heads: int, value_heads: int, dim: int) -> np.ndarray:
    """Where each of transformers' value-head rows (grouped by key head, `dim` rows a head) is
    in the converter's tiled order: value head j of key head k goes to j * key_heads + k."""
    per = value_heads // key_heads
    k, j, d = np.meshgrid(np.arange(key_heads), np.arange(per), np.arange(dim), indexing="ij")
    return ((j * key_heads + k) * dim + d).reshape(-1)


NOWHERE = Source(("(no llama.cpp tensor)",))      # a name transformers' other family has


class HybridLayout:
    """transformers' name -> its Source in a llama.cpp hybrid file (None: gguf's own name table
    and the file's layout, as for any other architecture)."""

    def __init__(self, arch: str, config, names: set[str]):
        self.arch, self.config, self.names = arch, config, names
        c = config
        self.hk, self.hv = c.linear_num_key_heads, c.linear_num_value_heads
        self.dk, self.dv = c.linear_key_head_dim, c.linear_value_head_dim
        self.key, self.value = self.hk * self.dk, self.hv * self.dv
        self.tiled = arch in TILED_V_HEADS and self.hk != self.hv

    def _v(self, dim: int, before: int = 0) -> np.ndarray | None:
        """The row order of a tensor whose rows past `before` are value heads of `dim` rows."""
        if not self.tiled:
            return None
        return np.concatenate([np.arange(before), before + v_head_order(self.hk, self.hv, dim)])

    def source(self, hf_name: str) -> Source | None:
        if hf_name.endswith("norm.weight") and ".linear_attn." not in hf_name:
            return Source((), values="shift")          # gguf's table names it; its value shifted
        if hf_name.endswith("mlp.shared_expert_gate.weight"):
            return Source((), shape=(1, self.config.hidden_size))      # llama.cpp: [hidden] or [1, hidden]
        if ".linear_attn." not in hf_name:
            return None
        layer, what = hf_name.split(".")[2], hf_name.split(".linear_attn.")[1]
        blk = f"blk.{layer}."
        conv = 2 * self.key + self.value
        table = {
            "A_log": Source((blk + "ssm_a",), values="a_log", elements=self._v(1)),
            "dt_bias": Source((blk + "ssm_dt.bias",), elements=self._v(1)),
            "conv1d.weight": Source((blk + "ssm_conv1d.weight",), rows=self._v(self.dv, 2 * self.key),
                                    shape=(conv, 1, self.config.linear_conv_kernel_dim)),
            "norm.weight": Source((blk + "ssm_norm.weight",)),
            "out_proj.weight": Source((blk + "ssm_out.weight",), cols=self._v(self.dv)),
            "in_proj_qkv.weight": Source((blk + "attn_qkv.weight",), rows=self._v(self.dv, 2 * self.key)),
            "in_proj_z.weight": Source((blk + "attn_gate.weight",), rows=self._v(self.dv)),
            "in_proj_b.weight": Source((blk + "ssm_beta.weight",), rows=self._v(1)),
            "in_proj_a.weight": Source((blk + "ssm_alpha.weight",), rows=self._v(1)),
            "in_proj_ba.weight": Source((blk + "ssm_ba.weight",)),
        }
        if what in (PER_KEY_HEAD if self.config.model_type != "qwen3_next" else SPLIT):
            return NOWHERE                          # the other family's projections
        if what == "in_proj_qkvz.weight":
            if blk + "ssm_in.weight" in self.names:     # a file from before the split: transformers' layout
                return Source((blk + "ssm_in.weight",))
            return Source((blk + "attn_qkv.weight", blk + "attn_gate.weight"), rows=self.qkvz_rows())
        return table.get(what, NOWHERE)

    def qkvz_rows(self) -> np.ndarray:
        """transformers' in_proj_qkvz rows (per key head: q, k, its value heads' v, then z) in
        the rows of attn_qkv [all q; all k; all v] followed by attn_gate [all z]."""
        per_v = self.hv // self.hk * self.dv
        z0 = 2 * self.key + self.value
        heads = [np.concatenate([np.arange(j * self.dk, (j + 1) * self.dk),
                                 self.key + np.arange(j * self.dk, (j + 1) * self.dk),
                                 2 * self.key + np.arange(j * per_v, (j + 1) * per_v),
                                 z0 + np.arange(j * per_v, (j + 1) * per_v)]) for j in range(self.hk)]
        return np.concatenate(heads)

    def float_values(self, source: Source, values: torch.Tensor) -> torch.Tensor:
        """A tensor read in float32 (transformers' rows) with the converter's value transform undone."""
        if source.elements is not None:
            values = values[torch.from_numpy(source.elements)]
        if source.values == "shift":
            return values - NORM_SHIFT
        if source.values == "a_log":
            return torch.log(-values)
        return values

    def expected(self) -> dict[str, tuple[int, ...]]:
        """The llama.cpp tensors of the linear layers and their shapes (torch's order), as
        llama.cpp's loader checks them (create_tensor)."""
        c, out = self.config, {}
        h, conv = c.hidden_size, 2 * self.key + self.value
        for i, kind in enumerate(c.layer_types):
            if kind != "linear_attention":
                continue
            blk = f"blk.{i}."
            out.update({blk + "ssm_a": (self.hv,), blk + "ssm_dt.bias": (self.hv,),
                        blk + "ssm_conv1d.weight": (conv, c.linear_conv_kernel_dim),
                        blk + "ssm_norm.weight": (self.dv,), blk + "ssm_out.weight": (h, self.value)})
            if c.model_type == "qwen3_next":
                out[blk + "ssm_ba.weight"] = (2 * self.hv, h)
                if blk + "ssm_in.weight" in self.names:
                    out[blk + "ssm_in.weight"] = (conv + self.value, h)
                    continue
            else:
                out.update({blk + "ssm_beta.weight": (self.hv, h), blk + "ssm_alpha.weight": (self.hv, h)})
            out.update({blk + "attn_qkv.weight": (conv, h), blk + "attn_gate.weight": (self.value, h)})
        return out


def check_hybrid_tensors(path: Path, layout: HybridLayout, shapes: dict[str, tuple[int, ...]]) -> None:
    """Every linear-layer tensor llama.cpp's loader requires is in the file with the shape the
    file's keys imply; else a CheckpointError naming it (`shapes`: GGUF's order, as stored)."""
    for name, expected in layout.expected().items():
        if name not in shapes:
            raise CheckpointError(f"{path}: tensor {name} is missing (a {layout.arch} file's linear-attention layers "
                                  "need it); the file is incomplete or was converted by another tool: convert it again")
        stored = tuple(int(n) for n in reversed(shapes[name]))
        if _squeezed(stored) != _squeezed(expected):
            raise CheckpointError(f"{path}: tensor {name} has shape {list(stored)} but the file's {layout.arch}.ssm.* "
                                  f"keys imply {list(expected)}; the file is corrupt: download or convert it again")


def _squeezed(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A shape without its leading 1s (GGUF's trailing ones: llama.cpp's loader ignores them)."""
    while len(shape) > 1 and shape[0] == 1:
        shape = shape[1:]
    return shape


def hybrid_layout(arch: str, config, names) -> HybridLayout | None:
    """The layout of a llama.cpp hybrid file (None for any other architecture)."""
    return HybridLayout(arch, config, set(names)) if arch in GGUF_HYBRID_ARCHES else None
