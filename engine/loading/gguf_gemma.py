"""Gemma 3 and 4 from a llama.cpp file (`general.architecture` "gemma3", "gemma4"; Gemma 4: see
gguf_gemma4_config): the config from the keys
convert_hf_to_gguf.py writes, and its norm weights back to transformers' values.

What the file says and what llama.cpp fixes (src/llama-model.cpp, LLM_ARCH_GEMMA3):
- keys: context_length, embedding_length, block_count, feed_forward_length, head_count(_kv),
  key_length (head_dim), layer_norm_rms_epsilon, rope.freq_base (the full layers'),
  attention.sliding_window, rope.scaling.type/factor (linear, full layers only; 4B and up),
  final_logit_softcapping where written;
- fixed by llama.cpp, no key: every 6th layer full, the rest sliding (set_swa_pattern(6):
  transformers' default layer_types too); the sliding layers' RoPE base 10000 (read from
  rope.freq_base_swa where a file has it); the attention scale 1/sqrt(head_dim), except on
  the 27B (62 layers) where it is 1/sqrt(hidden / heads) (transformers' query_pre_attn_scalar);
- the vocabulary is the embedding's rows (convert drops the out-of-vocabulary ones).
- norms: convert_hf_to_gguf.py's Gemma3Model stores every `*norm.weight` as w + 1 (norm_shift
  1.0: llama.cpp's RMSNorm multiplies by the stored weight, transformers' by 1 + w), so we
  subtract 1, in fp32, as transformers' GGUF reader does (Gemma2TensorProcessor). The
  subtraction is exact in fp32 while the stored 1 + w lies within [0.5, 2] (Sterbenz), so the
  (1 + w) our norm multiplies by is the stored value, bit for bit (w itself has lost the bits
  that adding 1 rounded away).
"""
from __future__ import annotations

GGUF_GEMMA_ARCHES = {"gemma3": "gemma3_text", "gemma4": "gemma4_text"}        # llama.cpp's arch -> model_type
NORMS_STORED_SHIFTED = ("gemma3_text",)              # Gemma 4's convert stores w itself (norm_shift 0)
LLAMA_CPP_SWA_PATTERN = 6                            # every 6th layer full (set_swa_pattern(6))
LLAMA_CPP_SWA_ROPE_BASE = 10000.0
LLAMA_CPP_27B_LAYERS = 62                            # where the attention scale is 1/sqrt(hidden / heads)
NORM_SHIFT = 1.0


def gguf_gemma3_config(metadata: dict, shapes: dict[str, tuple[int, ...]], **extra):
    """A Gemma3TextConfig from a llama.cpp file's keys (see the module's docstring), plus
    `extra` fields (the special token ids)."""
    from transformers import AutoConfig
    arch = "gemma3"

    def key(name, default=None):
        return metadata.get(f"{arch}.{name}", default)
    heads, hidden, layers = key("attention.head_count"), key("embedding_length"), key("block_count")
    head_dim = key("attention.key_length", hidden // heads)
    full = {"rope_type": "default", "rope_theta": float(key("rope.freq_base", 1_000_000.0))}
    if key("rope.scaling.type") == "linear":
        full.update(rope_type="linear", factor=float(key("rope.scaling.factor")))
    window = key("attention.sliding_window")
    fields = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=key("attention.head_count_kv", heads), head_dim=head_dim,
                  intermediate_size=key("feed_forward_length"), max_position_embeddings=key("context_length"),
                  rms_norm_eps=key("attention.layer_norm_rms_epsilon"), vocab_size=shapes["token_embd.weight"][1],
                  tie_word_embeddings="output.weight" not in shapes, sliding_window=window,
                  query_pre_attn_scalar=hidden // heads if layers == LLAMA_CPP_27B_LAYERS else head_dim,
                  final_logit_softcapping=key("final_logit_softcapping") or None,
                  layer_types=["sliding_attention" if window and (i + 1) % LLAMA_CPP_SWA_PATTERN else "full_attention"
                               for i in range(layers)],
                  rope_parameters={"full_attention": full, "sliding_attention": {
                      "rope_type": "default", "rope_theta": float(key("rope.freq_base_swa", LLAMA_CPP_SWA_ROPE_BASE))}})
    return AutoConfig.for_model("gemma3_text", architectures=["Gemma3ForCausalLM"], **fields, **extra)


def norm_shift(hf_name: str, config) -> float:
    """What llama.cpp added to a stored tensor of a file of this config (subtract it on read)."""
    if getattr(config, "model_type", None) in NORMS_STORED_SHIFTED and hf_name.endswith("norm.weight"):
        return NORM_SHIFT
    return 0.0


def gguf_gemma_config(metadata: dict, shapes: dict[str, tuple[int, ...]], rope_freqs: list[float] | None = None,
                      **extra):
    """The config of a llama.cpp Gemma file of either generation (rope_freqs: a Gemma 4 file's
    rope_freqs tensor, rope_freqs_of)."""
    if metadata.get("general.architecture") == "gemma4":
        return gguf_gemma4_config(metadata, shapes, rope_freqs, **extra)
    return gguf_gemma3_config(metadata, shapes, **extra)


TRANSFORMERS_GEMMA4_FULL_ROPE = 0.25      # the full layers' partial_rotary_factor where a file has no rope_freqs
UNROTATED = 1e29                          # llama.cpp's rope_freqs: 1e30 for a pair left alone


def rope_freqs_of(path, tensors) -> list[float] | None:
    """The values of a file's `rope_freqs.weight` (F32; `tensors`: engine.loading.gguf_tensors
    read_header's), or None where it has none."""
    import numpy as np
    stored = next((t for t in tensors if t.name == "rope_freqs.weight" and t.tensor_type.name == "F32"), None)
    if stored is None:
        return None
    return np.fromfile(path, dtype=np.float32, count=stored.shape[0], offset=stored.data_offset).tolist()


def gguf_gemma4_config(metadata: dict, shapes: dict[str, tuple[int, ...]], rope_freqs: list[float] | None = None,
                       **extra):
    """A Gemma4TextConfig from the keys llama.cpp's convert (conversion/gemma.py, Gemma4Model)
    writes and its gemma4 graph reads (src/models/gemma4.cpp):
    - attention.sliding_window_pattern: one bool per layer (true: sliding) -> layer_types;
    - key_length / key_length_swa: the full and sliding layers' head dims (global_head_dim, head_dim);
    - head_count_kv: a number, or one per layer (the full layers' -> num_global_key_value_heads);
    - feed_forward_length: a number, or one per layer, doubled on the KV-sharing layers
      (use_double_wide_mlp); attention.shared_kv_layers; embedding_length_per_layer_input
      (0: no per-layer embeddings); rope.freq_base (full layers) and rope.freq_base_swa
      (llama.cpp's default 10000 where absent); final_logit_softcapping where written;
    - from the tensors: the vocabularies (token_embd, per_layer_token_embd), a tied head (no
      output.weight), attention_k_eq_v (a full layer that stores KV has no attn_v).
    The full layers' proportional RoPE has no key: llama.cpp writes it as the rope_freqs tensor
    (1 for a rotated pair, 1e30 for a pair left alone), whose rotated share is the
    partial_rotary_factor (transformers' default quarter where a file has none).
    Norms are stored as w (Gemma 4's convert adds nothing), and the attention scale is 1."""
    from transformers import AutoConfig
    arch = "gemma4"

    def key(name, default=None):
        return metadata.get(f"{arch}.{name}", default)
    layers, hidden = key("block_count"), key("embedding_length")
    sliding = [bool(x) for x in key("attention.sliding_window_pattern")]
    layer_types = ["sliding_attention" if s else "full_attention" for s in sliding]
    shared = int(key("attention.shared_kv_layers", 0))
    ff = _per_layer(key("feed_forward_length"), layers)
    kv_heads = _per_layer(key("attention.head_count_kv"), layers)
    sliding_heads = next(h for h, s in zip(kv_heads, sliding) if s)
    full_heads = next((h for h, s in zip(kv_heads, sliding) if not s), sliding_heads)
    stores = [i for i in range(layers - shared) if not sliding[i]]
    per_layer = int(key("embedding_length_per_layer_input", 0))
    fields = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=key("attention.head_count"),
                  num_key_value_heads=sliding_heads, head_dim=key("attention.key_length_swa"),
                  global_head_dim=key("attention.key_length"), intermediate_size=min(ff),
                  use_double_wide_mlp=max(ff) > min(ff), max_position_embeddings=key("context_length"),
                  rms_norm_eps=key("attention.layer_norm_rms_epsilon"), vocab_size=shapes["token_embd.weight"][1],
                  tie_word_embeddings="output.weight" not in shapes, sliding_window=key("attention.sliding_window"),
                  layer_types=layer_types, num_kv_shared_layers=shared,
                  attention_k_eq_v=bool(stores) and f"blk.{stores[0]}.attn_v.weight" not in shapes,
                  hidden_size_per_layer_input=per_layer,
                  vocab_size_per_layer_input=shapes["per_layer_token_embd.weight"][1] if per_layer else 0,
                  final_logit_softcapping=key("final_logit_softcapping") or None,
                  rope_parameters={"full_attention": {"rope_type": "proportional", "rope_theta": float(key("rope.freq_base")),
                                                      "partial_rotary_factor": _rotated_share(rope_freqs)},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": float(
                                       key("rope.freq_base_swa", LLAMA_CPP_SWA_ROPE_BASE))}})
    if full_heads != sliding_heads:
        fields["num_global_key_value_heads"] = full_heads
    return AutoConfig.for_model("gemma4_text", architectures=["Gemma4ForCausalLM"], **fields, **extra)


def _per_layer(value, layers: int) -> list[int]:
    """A key llama.cpp writes as one number or one per layer, as a list per layer."""
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)] * layers


def _rotated_share(rope_freqs: list[float] | None) -> float:
    if not rope_freqs:
        return TRANSFORMERS_GEMMA4_FULL_ROPE
    return sum(1 for f in rope_freqs if f < UNROTATED) / len(rope_freqs)
