"""Which configs are hybrid (linear-attention layers between full-attention ones: Qwen3.5's
text model, Qwen3-Next) and what that changes in the Llama-family decoder. engine.models.llama
asks here, as it asks engine.models.gemma; the layers themselves are in engine.models.qwen3_5.

- `layer_types` names each layer "linear_attention" (Gated DeltaNet) or "full_attention"
  (gated attention through the paged KV cache); only the full layers have KV;
- every RMSNorm multiplies by (1 + w), in fp32 (as Gemma's), but for the gated norm inside a
  linear layer (w, then the SiLU gate);
- RoPE rotates the first `partial_rotary_factor` of each head's dims (a quarter).
"""
from __future__ import annotations

HYBRID_MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
MULTIMODAL_WRAPPERS = ("qwen3_5", "qwen3_5_moe")      # configs whose text_config we serve
LINEAR, FULL = "linear_attention", "full_attention"


def text_config(config):
    """The config we serve: a multimodal `qwen3_5` config's text_config (its vision tower is left
    unread; the released Qwen3.5 checkpoints are such), any other config as it is."""
    return config.text_config if config.model_type in MULTIMODAL_WRAPPERS else config


# Checkpoint tensors a hybrid model's text model never reads: a multimodal checkpoint's vision tower,
# and the multi-token-prediction head (transformers leaves `mtp.*` unread too).
UNREAD_PREFIXES = ("model.visual.", "mtp.")


def unread_tensor(name: str, config) -> bool:
    return is_hybrid(config) and name.startswith(UNREAD_PREFIXES)


def is_hybrid(config) -> bool:
    return config.model_type in HYBRID_MODEL_TYPES


def is_linear_layer(config, index: int) -> bool:
    return is_hybrid(config) and config.layer_types[index] == LINEAR


def rotary_dim(config, head_dim: int) -> int:
    """The head dims RoPE rotates (all but where the config rotates a part)."""
    params = getattr(config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) if is_hybrid(config) else 1.0
    return int(head_dim * factor)
