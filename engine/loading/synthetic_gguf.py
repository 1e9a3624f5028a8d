"""Random-weight GGUF files of real shapes, quantized as llama.cpp's recipes quantize them
(Q4_K_M), for tests and `bench load`.

`write_gguf(path, "qwen3-1.7b", "Q4_K_M")` writes a GGUF with the architecture's metadata,
the embedded default model's tokenizer (its vocabulary padded by the embedding's extra
rows, as real files often are), and every weight quantized to the type the recipe gives
it. gguf-py cannot quantize k-quants, so Q4_K and Q6_K blocks are packed here, in numpy:
round-to-nearest per (sub-)block, the layouts of ggml-common.h (decoded in
engine.loading.gguf_tensors); the other types come from `gguf.quants.quantize`.
Memory stays small at any size: each tensor is generated and quantized a slice of rows at
a time, and written as its stored bytes, after a header computed from the shapes (no float
model is ever held; the most held is one tensor's stored bytes).

Q4_K_M (llama.cpp, src/llama-quant.cpp, llama_tensor_get_type): Q4_K everywhere, except
  - `output` (or `token_embd` when the head is tied to it): Q6_K;
  - `attn_v` and `ffn_down` of the layers `use_more_bits` picks: Q6_K;
  - a tensor whose rows are not whole 256-value super-blocks falls back (Q4_K -> Q5_0,
    Q6_K -> Q8_0); norms stay F32.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from engine.loading.synthetic import make_config, tensor_groups

QK_K = 256
SLICE_VALUES = 2**22             # values generated and quantized at a time
FALLBACK = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}     # llama.cpp's, for rows not whole super-blocks
# llama_ftype: general.file_type of a recipe
FILE_TYPES = {"Q4_K_M": 15, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7}
SYNTHETIC_GGUF_PRESETS = {"qwen3-1.7b-q4_k_m": ("qwen3-1.7b", "Q4_K_M")}


# ---- the recipe -------------------------------------------------------------------------
def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v / ffn_down get more bits."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def recipe_type(hf_name: str, shape: tuple[int, ...], config, recipe: str = "Q4_K_M") -> str:
    """The stored type `recipe` gives a tensor (transformers' name and shape)."""
    if len(shape) == 1:
        return "F32"
    if recipe != "Q4_K_M":
        return recipe
    layers, kind = config.num_hidden_layers, "Q4_K"
    if hf_name == "lm_head.weight" or (hf_name == "model.embed_tokens.weight" and config.tie_word_embeddings):
        kind = "Q6_K"
    elif hf_name.endswith(("self_attn.v_proj.weight", "mlp.down_proj.weight")):
        kind = "Q6_K" if use_more_bits(int(hf_name.split(".")[2]), layers) else "Q4_K"
    return FALLBACK[kind] if shape[-1] % QK_K else kind


# ---- k-quant packing (round-to-nearest) ---------------------------------------------------
def _fp16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)[..., None].view(np.uint8)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """float [rows, n] -> Q4_K blocks as bytes [rows, n / 256 * 144]: per sub-block of 32 a
    scale and a min (6 bits each, times the super-block's fp16 d and dmin), w = d*sc*q - dmin*m."""
    rows = w.shape[0]
    x = w.astype(np.float32).reshape(rows, -1, 8, 32)
    low = np.minimum(x.min(-1), 0)                      # sub-block mins (<= 0), [rows, blocks, 8]
    step = (x.max(-1) - low) / 15
    d = (step.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = (-low.min(-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(step / np.where(d > 0, d, 1)[..., None]), 0, 63).astype(np.uint8)
    m = np.clip(np.round(-low / np.where(dmin > 0, dmin, 1)[..., None]), 0, 63).astype(np.uint8)
    scale = d[..., None] * sc
    q = np.round((x + (dmin[..., None] * m)[..., None]) / np.where(scale > 0, scale, 1)[..., None])
    q = np.clip(q, 0, 15).astype(np.uint8).reshape(rows, -1, 4, 2, 32)
    nibbles = q[..., 0, :] | (q[..., 1, :] << 4)        # bytes 32j..: sub-block 2j low, 2j + 1 high
    packed = np.concatenate([(sc[..., :4] & 0x3F) | ((sc[..., 4:] >> 4) << 6),
                             (m[..., :4] & 0x3F) | ((m[..., 4:] >> 4) << 6),
                             (sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4)], axis=-1)
    blocks = np.concatenate([_fp16_bytes(d), _fp16_bytes(dmin), packed, nibbles.reshape(rows, -1, 128)], axis=-1)
    return blocks.reshape(rows, -1)


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


def quantize(w: np.ndarray, kind: str) -> np.ndarray:
    """float [rows, n] -> the stored bytes (or float values) of `kind`."""
    import gguf
    if kind == "Q4_K":
        return quantize_q4_k(w)
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
    source = gguf.GGUFReader(str(_default_gguf()))
    arch = gguf.MODEL_ARCH_NAMES[next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == config.model_type)]
    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch),
                                     config.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), arch)
    _add_metadata(writer, config, recipe, source)
    specs = [s for group in tensor_groups(config) for s in group]
    kinds = {s.name: recipe_type(s.name, s.shape, config, recipe) for s in specs}
    for s in specs:
        kind = gguf.GGMLQuantizationType[kinds[s.name]]
        name = names.get_name(s.name, try_suffixes=(".weight",))
        if kind.name == "F32":
            writer.add_tensor_info(name, list(s.shape), np.dtype(np.float32), 4 * int(np.prod(s.shape)))
            continue
        byte_shape = gguf.quant_shape_to_byte_shape(s.shape, kind)
        writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for s in specs:     # one tensor's stored bytes at a time (the largest: a Q6_K embedding)
        writer.write_tensor_data(np.concatenate(list(_quantized_slices(s, kinds[s.name], config.initializer_range, seed))))
    writer.close()
    return path


def _quantized_slices(spec, kind: str, std: float, seed: int):
    """The tensor's stored bytes a slice of rows at a time (norms: ones)."""
    if spec.init == "ones":
        yield np.ones((1, *spec.shape), dtype=np.float32)
        return
    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(f"{seed}:{spec.name}".encode()).digest()[:8], "little"))
    rows, n = spec.shape
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
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"] if hasattr(config, "rope_parameters")
                              and config.rope_parameters else config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    for name, field in source.fields.items():
        if not name.startswith("tokenizer."):
            continue
        value = field.contents()
        if name in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type") and len(value) < config.vocab_size:
            pad = config.vocab_size - len(value)    # the embedding's rows past the vocabulary
            # plain entries: as added tokens, 100k pads would cost transformers' tokenizer 330 MB
            value = value + ([f"<|pad_{i}|>" for i in range(pad)] if name.endswith("tokens") else [1] * pad)
        writer.add_key_value(name, value, field.types[0], field.types[1] if len(field.types) > 1 else None)


def _default_gguf() -> Path:
    from engine.loading.loader import default_gguf_path
    return default_gguf_path()
