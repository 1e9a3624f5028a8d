"""Gemma 3 from a llama.cpp file (`general.architecture` "gemma3"): its config from the keys
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

GGUF_GEMMA_ARCHES = {"gemma3": "gemma3_text"}        # llama.cpp's arch -> model_type
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
    if getattr(config, "model_type", None) in GGUF_GEMMA_ARCHES.values() and hf_name.endswith("norm.weight"):
        return NORM_SHIFT
    return 0.0
