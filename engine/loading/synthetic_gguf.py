"""Random-weight GGUF files of real shapes, quantized as llama.cpp's recipes quantize them
(Q4_K_M, Q5_K_M, MXFP4_MOE), for tests and `bench load`.

`write_gguf(path, "qwen3-1.7b", "Q4_K_M")` writes a GGUF with the architecture's metadata,
the embedded default model's tokenizer (its vocabulary padded by the embedding's extra
rows, as real files often are), and every weight quantized to the type the recipe gives
it. gguf-py cannot quantize k-quants, so Q4_K, Q5_K and Q6_K blocks are packed here, in numpy:
round-to-nearest per (sub-)block, the layouts of ggml-common.h (decoded in
engine.loading.gguf_tensors); the other types come from `gguf.quants.quantize`.
Memory stays small at any size: each tensor is generated and quantized a slice of rows at
a time, and written as its stored bytes, after a header computed from the shapes (no float
model is ever held; the most held is one tensor's stored bytes).

Mixture-of-experts models are written in llama.cpp's layout (convert_hf_to_gguf.py): each
layer's experts stacked into one 3-D tensor per projection, `blk.N.ffn_{gate,up,down}_exps`
([E, out, in] in torch's order; gpt-oss's fused, interleaved gate_up split into gate and up),
the router as `ffn_gate_inp`, gpt-oss's expert biases as `ffn_*_exps.bias` [E, out] and its
sinks as `attn_sinks.weight`. Neither architecture has its q/k rows permuted (only
llama.cpp's LlamaModel permutes them).

Which tensors a recipe quantizes (llama.cpp, tensor_allows_quantization): weights of two or
three dimensions, never a norm, the router (`ffn_gate_inp`) or a bias: those stay F32, as
convert_hf_to_gguf.py writes them.
Q4_K_M (src/llama-quant.cpp, llama_tensor_get_type): Q4_K everywhere, except
  - `output` (or `token_embd` when the head is tied to it): Q6_K;
  - `attn_v` and `ffn_down` (`ffn_down_exps` too) of the layers `use_more_bits` picks: Q6_K;
  - in a model of exactly 8 experts, `attn_k` and `attn_v` Q8_0 and `attn_output` Q5_K;
  - a tensor whose rows are not whole 256-value super-blocks falls back (Q4_K -> Q5_0,
    Q5_K -> Q5_1, Q6_K -> Q8_0).
Q5_K_M: the same with Q5_K where Q4_K_M has Q4_K (the 8-expert attn_output stays Q5_K).
Any other recipe (Q4_0, Q5_0, Q8_0, ...) gives every quantized tensor that type.
MXFP4_MOE (what ggml-org's gpt-oss GGUFs are): the 3-D expert weights MXFP4 (ggml's block of
32: one E8M0 exponent byte, then 16 bytes whose low nibbles hold values 0-15 and high
nibbles 16-31, gguf.quants' quantizer), every other quantized weight Q8_0.
"""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import numpy as np
import torch

from engine.loading import synthetic_gguf_hybrid as hybrid_gguf
from engine.loading.synthetic import TensorSpec, make_config, tensor_groups
from engine.models.hybrid import is_hybrid
from engine.models.moe import MOE_MODEL_TYPES, expert_intermediate, num_experts

QK_K = 256
SLICE_VALUES = 2**22             # values generated and quantized at a time
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}   # llama.cpp's, for rows not whole super-blocks
# llama_ftype: general.file_type of a recipe
FILE_TYPES = {"Q4_K_M": 15, "Q5_K_M": 17, "Q4_0": 2, "Q4_1": 3, "Q5_0": 8, "Q5_1": 9, "Q8_0": 7, "MXFP4_MOE": 38}
K_MIXES = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K"}      # llama.cpp's _M recipes: the type of most tensors
# Qwen3-MoE at reduced size with rows of whole super-blocks (so the experts are Q4_K, as in
# Qwen3-30B-A3B's Q4_K_M) and tiny-qwen3-moe's 8 experts (so llama.cpp's 8-expert rules apply)
TINY_QWEN3_MOE_Q4_K = {"preset": "tiny-qwen3-moe", "hidden_size": 256, "moe_intermediate_size": 256,
                       "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
SYNTHETIC_GGUF_PRESETS = {"qwen3-1.7b-q4_k_m": ("qwen3-1.7b", "Q4_K_M"),
                          "qwen3-1.7b-q5_k_m": ("qwen3-1.7b", "Q5_K_M"),
                          "qwen3-8b-q4_k_m": ("qwen3-8b", "Q4_K_M"),          # about 5 GB, as the released file
                          "qwen3-14b-q4_k_m": ("qwen3-14b", "Q4_K_M"),        # about 9 GB, as the released file
                          "tiny-qwen3-moe-q4_k_m": (TINY_QWEN3_MOE_Q4_K, "Q4_K_M"),
                          "tiny-gpt-oss-mxfp4": ("tiny-gpt-oss", "MXFP4_MOE"),
                          "tiny-qwen3.5-q8_0": (hybrid_gguf.TINY_QWEN35_GGUF, "Q8_0"),
                          "tiny-qwen3-next-q8_0": (hybrid_gguf.TINY_QWEN3_NEXT_GGUF, "Q8_0"),
                          "qwen3.5-9b-q4_k_m": ("qwen3.5-9b", "Q4_K_M")}
ROUTERS = ("mlp.gate.weight", "mlp.router.weight")      # llama.cpp's ffn_gate_inp: never quantized


# ---- the recipe -------------------------------------------------------------------------
def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v / ffn_down get more bits."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def recipe_type(hf_name: str, shape: tuple[int, ...], config, recipe: str = "Q4_K_M") -> str:
    """The stored type `recipe` gives a tensor (transformers' name, or llama.cpp's stacked expert
    name `model.layers.N.mlp.experts.down_proj.weight`, and its shape)."""
    if len(shape) == 1 or not hf_name.endswith(".weight") or hf_name.endswith(ROUTERS):
        return "F32"
    if recipe == "MXFP4_MOE":
        return "MXFP4" if len(shape) == 3 else "Q8_0"
    if recipe not in K_MIXES:
        return recipe
    layers, kind = config.num_hidden_layers, K_MIXES[recipe]
    eight_experts = _num_experts(config) == 8
    if hf_name == "lm_head.weight" or (hf_name == "model.embed_tokens.weight" and config.tie_word_embeddings):
        kind = "Q6_K"
    elif hf_name.endswith(("self_attn.v_proj.weight", "mlp.down_proj.weight", "mlp.experts.down_proj.weight")):
        kind = "Q6_K" if use_more_bits(int(hf_name.split(".")[2]), layers) else kind
    if eight_experts and hf_name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
        kind = "Q8_0"
    elif eight_experts and hf_name.endswith("self_attn.o_proj.weight"):
        kind = "Q5_K"
    return FALLBACK[kind] if shape[-1] % QK_K and kind in FALLBACK else kind


def _num_experts(config) -> int:
    return num_experts(config) if config.model_type in MOE_MODEL_TYPES else getattr(config, "num_experts", 0) or 0


def gguf_tensor_specs(config) -> list[TensorSpec]:
    """The tensors a GGUF of this config holds, under transformers' names, in llama.cpp's
    layout: a layer's experts stacked per projection (`mlp.experts.gate_proj.weight`
    [E, out, in], biases [E, out]), gpt-oss's gate_up split into gate and up."""
    specs = []
    for spec in (s for group in tensor_groups(config) for s in group):
        prefix, _, rest = spec.name.partition(".mlp.experts.")
        if not rest:
            specs.append(spec)
        elif config.model_type == "gpt_oss":
            specs += _split_fused(spec, prefix + ".mlp.experts.", rest)
        elif rest.startswith("0."):          # Qwen3-MoE: per expert; stacked once, at expert 0
            proj = rest.split(".")[1]
            e = _num_experts(config)
            specs.append(TensorSpec(f"{prefix}.mlp.experts.{proj}.weight", (e, *spec.shape), spec.init))
    return specs


def _split_fused(spec: TensorSpec, p: str, fused: str) -> list[TensorSpec]:
    """gpt-oss's fused expert tensors ([E, in, out], gate and up interleaved) as llama.cpp
    stores them: [E, out, in] weights and [E, out] biases, gate and up apart."""
    e = spec.shape[0]
    if fused == "gate_up_proj":
        h, inter = spec.shape[1], spec.shape[2] // 2
        return [TensorSpec(p + f"{x}_proj.weight", (e, inter, h), spec.init) for x in ("gate", "up")]
    if fused == "gate_up_proj_bias":
        return [TensorSpec(p + f"{x}_proj.bias", (e, spec.shape[1] // 2), spec.init) for x in ("gate", "up")]
    if fused == "down_proj":
        return [TensorSpec(p + "down_proj.weight", (e, spec.shape[2], spec.shape[1]), spec.init)]
    return [TensorSpec(p + "down_proj.bias", spec.shape, spec.init)]


# ---- k-quant packing (round-to-nearest) ---------------------------------------------------
def _fp16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)[..., None].view(np.uint8)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """float [rows, n] -> Q4_K blocks as bytes [rows, n / 256 * 144]: per sub-block of 32 a
    scale and a min (6 bits each, times the super-block's fp16 d and dmin), w = d*sc*q - dmin*m."""
    rows = w.shape[0]
    d, dmin, sc, m, q = _k_sub_blocks(w, 15)
    q = q.reshape(rows, -1, 4, 2, 32)
    nibbles = q[..., 0, :] | (q[..., 1, :] << 4)        # bytes 32j..: sub-block 2j low, 2j + 1 high
    blocks = np.concatenate([_fp16_bytes(d), _fp16_bytes(dmin), _k_scale_bytes(sc, m),
                             nibbles.reshape(rows, -1, 128)], axis=-1)
    return blocks.reshape(rows, -1)


def _k_sub_blocks(w: np.ndarray, levels: int):
    """Q4_K's and Q5_K's rounding: per super-block of 256 an fp16 d and dmin, per sub-block of
    32 a 6-bit scale and min, values 0..levels: (d, dmin, sc, m, q [rows, blocks, 8, 32])."""
    rows = w.shape[0]
    x = w.astype(np.float32).reshape(rows, -1, 8, 32)
    low = np.minimum(x.min(-1), 0)                      # sub-block mins (<= 0), [rows, blocks, 8]
    step = (x.max(-1) - low) / levels
    d = (step.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = (-low.min(-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(step / np.where(d > 0, d, 1)[..., None]), 0, 63).astype(np.uint8)
    m = np.clip(np.round(-low / np.where(dmin > 0, dmin, 1)[..., None]), 0, 63).astype(np.uint8)
    scale = d[..., None] * sc
    q = np.round((x + (dmin[..., None] * m)[..., None]) / np.where(scale > 0, scale, 1)[..., None])
    return d, dmin, sc, m, np.clip(q, 0, levels).astype(np.uint8)


def _k_scale_bytes(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """The 12 bytes of 6-bit (scale, min) pairs of a K-quant super-block's 8 sub-blocks."""
    return np.concatenate([(sc[..., :4] & 0x3F) | ((sc[..., 4:] >> 4) << 6),
                           (m[..., :4] & 0x3F) | ((m[..., 4:] >> 4) << 6),
                           (sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4)], axis=-1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """float [rows, n] -> Q6_K blocks as bytes [rows, n / 256 * 210]: per sub-block of 16 an
    int8 scale (times the super-block's fp16 d), w = d*sc*(q - 32), q 0..63."""
    rows = w.shape[0]
    x = w.astype(np.float32).reshape(rows, -1, 16, 16)
    step = np.abs(x).max(-1) / 31                       # [rows, blocks, 16]
    d = (step.max(-1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(step / np.where(d > 0, d, 1)[..., None]), -128, 127).astype(np.int8)
    scale = d[..., None] * sc
    q = np.round(x / np.where(scale != 0, scale, 1)[..., None])
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(rows, -1, 2, 128)
    low = (q & 0x0F).reshape(rows, -1, 2, 2, 64)
    ql = low[..., 0, :] | (low[..., 1, :] << 4)                             # [rows, blocks, 2, 64]
    high = (q >> 4).reshape(rows, -1, 2, 4, 32)
    qh = high[..., 0, :] | (high[..., 1, :] << 2) | (high[..., 2, :] << 4) | (high[..., 3, :] << 6)
    blocks = np.concatenate([ql.reshape(rows, -1, 128), qh.reshape(rows, -1, 64), sc.view(np.uint8),
                             _fp16_bytes(d)], axis=-1)
    return blocks.reshape(rows, -1)


def quantize_q5_k(w: np.ndarray) -> np.ndarray:
    """float [rows, n] -> Q5_K blocks as bytes [rows, n / 256 * 176]: Q4_K's scales and mins
    with 5-bit values, w = d*sc*q - dmin*m, q 0..31: the low 4 bits as Q4_K's nibbles, bit 4
    of value l of sub-block j in bit j of qh[l]."""
    rows = w.shape[0]
    d, dmin, sc, m, q = _k_sub_blocks(w, 31)                           # q [rows, blocks, 8, 32]
    qh = ((q >> 4) << np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)).sum(axis=2, dtype=np.uint8)
    low4 = (q & 0x0F).reshape(rows, -1, 4, 2, 32)
    nibbles = low4[..., 0, :] | (low4[..., 1, :] << 4)
    blocks = np.concatenate([_fp16_bytes(d), _fp16_bytes(dmin), _k_scale_bytes(sc, m), qh,
                             nibbles.reshape(rows, -1, 128)], axis=-1)
    return blocks.reshape(rows, -1)


def quantize(w: np.ndarray, kind: str) -> np.ndarray:
    """float [rows, n] -> the stored bytes (or float values) of `kind`."""
    import gguf
    if kind == "Q4_K":
        return quantize_q4_k(w)
    if kind == "Q5_K":
        return quantize_q5_k(w)
    if kind == "Q6_K":
        return quantize_q6_k(w)
    return gguf.quants.quantize(w.astype(np.float32), gguf.GGMLQuantizationType[kind])


# ---- writing --------------------------------------------------------------------------
def write_gguf(path, preset: str | dict, recipe: str = "Q4_K_M", seed: int = 0) -> Path:
    """A random-weight GGUF of the preset's shapes (engine.loading.synthetic), each tensor of
    the type `recipe` gives it; returns the path."""
    import gguf
    path = Path(path)
    config = make_config(preset)
    source = _default_gguf()
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[_arch(config)])
    _add_metadata(writer, config, recipe, source)
    entries = _file_entries(config, recipe, seed)
    for name, shape, kind_name, _ in entries:
        kind = gguf.GGMLQuantizationType[kind_name]
        if kind.name == "F32":
            writer.add_tensor_info(name, list(shape), np.dtype(np.float32), 4 * int(np.prod(shape)))
            continue
        byte_shape = gguf.quant_shape_to_byte_shape(shape, kind)
        writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for *_, stored in entries:     # one tensor's stored bytes at a time (the largest: a Q6_K embedding)
        writer.write_tensor_data(np.concatenate(list(stored())))
    writer.close()
    return path


def planned_tensors(preset: str | dict, recipe: str = "Q4_K_M") -> list[tuple[str, tuple[int, ...], str]]:
    """(llama.cpp's name, shape in torch's order, stored type) of every tensor `write_gguf(path,
    preset, recipe)` writes, in its order: what the file would hold, with nothing generated or
    written (engine.bench.model_memory counts a preset's bytes from it)."""
    return [(name, tuple(shape), kind) for name, shape, kind, _ in _file_entries(make_config(preset), recipe, 0)]


def _arch(config):
    """gguf's MODEL_ARCH of a config."""
    import gguf
    return next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == GGUF_ARCHES.get(config.model_type, config.model_type))


def _file_entries(config, recipe: str, seed: int) -> list:
    """_entries of every tensor of the config's file, in the file's order."""
    import gguf
    names = gguf.get_tensor_name_map(_arch(config), config.num_hidden_layers)
    return [e for s in gguf_tensor_specs(config) for e in _entries(s, config, names, recipe, seed)]


def _entries(spec, config, names, recipe: str, seed: int) -> list:
    """(llama.cpp's name, shape, stored type, its stored bytes' slices) of one of transformers'
    tensors: one, or what a hybrid model's converter makes of it (engine.loading.synthetic_gguf_hybrid)."""
    std = config.initializer_range
    if not hybrid_gguf.converted_by_llama_cpp(config, spec.name):
        kind = recipe_type(spec.name, spec.shape, config, recipe)
        return [(gguf_name(names, spec.name), spec.shape, kind, lambda: _quantized_slices(spec, kind, std, seed))]
    out = []
    for i, (name, meta) in enumerate(hybrid_gguf.convert(config, spec.name, torch.empty(spec.shape, device="meta"))):
        kind = "F32" if spec.name.endswith(hybrid_gguf.KEPT_F32) else recipe_type(spec.name, tuple(meta.shape), config, recipe)

        def stored(i=i, kind=kind):
            w = hybrid_gguf.convert(config, spec.name, torch.from_numpy(_hf_values(spec, std, seed)))[i][1]
            return [quantize(w.reshape(-1, w.shape[-1]).numpy(), kind)]
        out.append((name, tuple(meta.shape), kind, stored))
    return out


def _hf_values(spec, std: float, seed: int) -> np.ndarray:
    """A hybrid model's tensor in transformers' layout, whole: its init plus noise (a norm's or
    dt_bias' values differ, so a reorder or a shift left undone shows)."""
    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(f"{seed}:{spec.name}".encode()).digest()[:8], "little"))
    base = {"ones": 1.0, "zeros": 0.0}.get(spec.init, 0.0)
    return (base + rng.standard_normal(spec.shape, dtype=np.float32) * std).astype(np.float32)


GGUF_ARCHES = {"qwen3_moe": "qwen3moe", "gpt_oss": "gpt-oss", **hybrid_gguf.GGUF_HYBRID_ARCH}     # model_type -> llama.cpp's arch


def gguf_name(names, hf_name: str) -> str:
    """llama.cpp's name of a tensor (transformers' name; a stacked expert tensor's
    `mlp.experts.gate_proj.weight`); gpt-oss's sinks gain the `.weight` llama.cpp gives them."""
    name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if name is None:
        raise ValueError(f"gguf's tensor-name table has no name for {hf_name}")
    return name if name.endswith((".weight", ".bias")) else name + ".weight"


def _quantized_slices(spec, kind: str, std: float, seed: int):
    """The tensor's stored bytes a slice of rows at a time (norms: ones); a tensor of more
    than two dimensions as its rows [prod(shape[:-1]), shape[-1]] (each expert's rows are
    contiguous)."""
    if spec.init == "ones":
        yield np.ones((1, *spec.shape), dtype=np.float32)
        return
    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(f"{seed}:{spec.name}".encode()).digest()[:8], "little"))
    n = spec.shape[-1]
    rows = int(np.prod(spec.shape[:-1]))
    step = max(1, SLICE_VALUES // n)
    for start in range(0, rows, step):
        w = rng.standard_normal((min(step, rows - start), n), dtype=np.float32) * std
        yield quantize(w, kind)


def _add_metadata(writer, config, recipe: str, source) -> None:
    """The architecture's hyperparameters, and the default model's tokenizer."""
    import gguf
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_name(f"synthetic {config.model_type} {recipe}")
    writer.add_file_type(FILE_TYPES.get(recipe, 0))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(hybrid_gguf.rope_dimension_count(config, head_dim))
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"] if hasattr(config, "rope_parameters")
                              and config.rope_parameters else config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if _num_experts(config):
        _add_moe_metadata(writer, config)
    if is_hybrid(config):
        hybrid_gguf.add_hybrid_metadata(writer, config)
    add_tokenizer(writer, source, config.vocab_size)


def add_tokenizer(writer, source, vocab_size: int) -> None:
    """The tokenizer keys of the GGUF `source` (a gguf.GGUFReader, or a file's path: read once
    per process), its vocabulary padded to `vocab_size` entries."""
    keys = _tokenizer_keys(Path(source)) if isinstance(source, (str, Path)) else _keys_of(source)
    for name, value, types in keys:
        if name in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type") and len(value) < vocab_size:
            pad = vocab_size - len(value)    # the embedding's rows past the vocabulary
            # plain entries: as added tokens, 100k pads would cost transformers' tokenizer 330 MB
            value = value + ([f"<|pad_{i}|>" for i in range(pad)] if name.endswith("tokens") else [1] * pad)
        writer.add_key_value(name, value, types[0], types[1] if len(types) > 1 else None)


@functools.cache
def _tokenizer_keys(path: Path) -> tuple:
    """A file's tokenizer keys as plain values (gguf's reader takes seconds on a vocabulary, and
    holds it as numpy arrays: the plain lists are kept instead)."""
    import gguf
    return _keys_of(gguf.GGUFReader(str(path)))


def _keys_of(reader) -> tuple:
    return tuple((name, field.contents(), tuple(field.types)) for name, field in reader.fields.items()
                 if name.startswith("tokenizer."))


def _add_moe_metadata(writer, config) -> None:
    """What convert_hf_to_gguf.py writes for Qwen3-MoE and gpt-oss beyond a dense model's keys."""
    import gguf
    writer.add_expert_count(_num_experts(config))
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(expert_intermediate(config))
    if config.model_type != "gpt_oss":
        return
    writer.add_sliding_window(config.sliding_window)
    rope = config.rope_parameters
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])


def _default_gguf() -> Path:
    from engine.loading.loader import default_gguf_path
    return default_gguf_path()
