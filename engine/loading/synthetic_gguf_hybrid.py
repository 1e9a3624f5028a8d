"""What llama.cpp's converter writes for a Qwen3.5 (`qwen35`) or Qwen3-Next (`qwen3next`) model,
for engine.loading.synthetic_gguf: the keys, and each of transformers' tensors as
convert_hf_to_gguf.py turns it into llama.cpp's (conversion/qwen.py: Qwen3NextModel.modify_tensors,
and Qwen3.5's _LinearAttentionVReorderBase before it). Written here the way the converter does it
(reshapes and permutes of the tensors), apart from the reader's inverse (engine.loading.gguf_qwen35,
which works on row indices), so a test of one against the other checks two readings of the
converter, not one against itself.
"""
from __future__ import annotations

import torch

from engine.models.hybrid import is_hybrid, rotary_dim

GGUF_HYBRID_ARCH = {"qwen3_5_text": "qwen35", "qwen3_next": "qwen3next"}
QWEN35_MROPE_SECTIONS = [11, 11, 10, 0]         # the converter's default (_Qwen35MRopeMixin)
KEPT_F32 = ("linear_attn.conv1d.weight", "mlp.shared_expert_gate.weight")   # llama.cpp leaves them unquantized
# Qwen3-Next's in_proj_qkvz split into attn_qkv and attn_gate, as today's converter does; False: one
# ssm_in in transformers' layout, as files from before the split have it (llama.cpp's legacy path)
SPLIT_QKVZ = True
# The tiny presets as llama.cpp files: Qwen3.5's heads 32 wide (a value head is whole Q8_0 blocks, so
# ssm_out's column reorder is served as stored); Qwen3-Next with every layer experts (llama.cpp's
# qwen3next has no dense layer) and a shared expert of whole blocks
TINY_QWEN35_GGUF = {"preset": "tiny-qwen3.5", "linear_key_head_dim": 32, "linear_value_head_dim": 32}
TINY_QWEN3_NEXT_GGUF = {"preset": "tiny-qwen3-next", "mlp_only_layers": [], "shared_expert_intermediate_size": 64}


def converted_by_llama_cpp(config, hf_name: str) -> bool:
    """Whether the converter changes this tensor beyond its name (then `convert` writes it)."""
    return is_hybrid(config) and (".linear_attn." in hf_name or hf_name.endswith("norm.weight")
                                  or hf_name.endswith("mlp.shared_expert_gate.weight"))


def convert(config, hf_name: str, w: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """(llama.cpp's name, tensor in torch's order) for one of transformers' tensors; works on
    the meta device too (the shapes, for the header)."""
    layer = hf_name.split(".")[2] if hf_name.startswith("model.layers.") else None
    blk = f"blk.{layer}."
    if not hf_name.startswith("model.layers.") or ".linear_attn." not in hf_name:
        return [(_plain_name(config, hf_name), w + 1 if hf_name.endswith("norm.weight") else w)]
    what = hf_name.split(".linear_attn.")[1]
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    if config.model_type == "qwen3_5_text" and hk != hv:
        w = _v_heads_tiled(what, w, hk, hv, dk, dv)
    if what == "A_log":
        return [(blk + "ssm_a", -torch.exp(w))]
    if what == "dt_bias":
        return [(blk + "ssm_dt.bias", w)]
    if what == "conv1d.weight":
        return [(blk + "ssm_conv1d.weight", w.squeeze(1))]
    if what == "in_proj_qkvz.weight" and not SPLIT_QKVZ:
        return [(blk + "ssm_in.weight", w)]
    if what == "in_proj_qkvz.weight":        # per key head [q, k, v, z] -> [all q; all k; all v], [all z]
        per = hv // hk * dv
        q, k, v, z = w.view(hk, 2 * dk + 2 * per, -1).split([dk, dk, per, per], dim=1)
        h = w.shape[-1]
        return [(blk + "attn_qkv.weight", torch.cat([q.reshape(-1, h), k.reshape(-1, h), v.reshape(-1, h)])),
                (blk + "attn_gate.weight", z.reshape(-1, h))]
    names = {"norm.weight": "ssm_norm.weight", "out_proj.weight": "ssm_out.weight", "in_proj_qkv.weight": "attn_qkv.weight",
             "in_proj_z.weight": "attn_gate.weight", "in_proj_b.weight": "ssm_beta.weight",
             "in_proj_a.weight": "ssm_alpha.weight", "in_proj_ba.weight": "ssm_ba.weight"}
    return [(blk + names[what], w)]


def _plain_name(config, hf_name: str) -> str:
    import gguf
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == GGUF_HYBRID_ARCH[config.model_type])
    name = gguf.get_tensor_name_map(arch, config.num_hidden_layers).get_name(hf_name, try_suffixes=(".weight",))
    return name


def _v_heads_tiled(what: str, w: torch.Tensor, hk: int, hv: int, dk: int, dv: int) -> torch.Tensor:
    """_LinearAttentionVReorderBase: the value heads from grouped by key head to tiled order,
    in the rows (columns for out_proj) that hold them."""
    per = hv // hk

    def tiled(x: torch.Tensor, dim: int, head: int) -> torch.Tensor:
        shape = list(x.shape)
        x = x.reshape(*shape[:dim], hk, per, head, *shape[dim + 1:])
        return x.transpose(dim, dim + 1).reshape(shape)
    if what in ("in_proj_qkv.weight", "conv1d.weight"):
        qk = 2 * hk * dk
        return torch.cat([w[:qk], tiled(w[qk:], 0, dv)])
    if what == "in_proj_z.weight":
        return tiled(w, 0, dv)
    if what in ("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias"):
        return tiled(w, 0, 1)
    if what == "out_proj.weight":
        return tiled(w, 1, dv)
    return w


def add_hybrid_metadata(writer, config) -> None:
    """Qwen3NextModel.set_gguf_parameters' keys beyond a dense model's (and the MoE ones)."""
    writer.add_ssm_conv_kernel(config.linear_conv_kernel_dim)
    writer.add_ssm_state_size(config.linear_key_head_dim)
    writer.add_ssm_group_count(config.linear_num_key_heads)
    writer.add_ssm_time_step_rank(config.linear_num_value_heads)
    writer.add_ssm_inner_size(config.linear_value_head_dim * config.linear_num_value_heads)
    interval = [i for i, t in enumerate(config.layer_types) if t == "full_attention"][0] + 1
    writer.add_full_attention_interval(interval)
    if config.model_type == "qwen3_5_text":
        writer.add_rope_dimension_sections(QWEN35_MROPE_SECTIONS)
    if getattr(config, "shared_expert_intermediate_size", None):
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)


def rope_dimension_count(config, head_dim: int) -> int:
    return rotary_dim(config, head_dim)
