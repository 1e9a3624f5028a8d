"""What Gemma 3's text model (transformers' `gemma3_text`; a multimodal `gemma3` config's
`text_config`) changes in the Llama-family decoder (engine.models.llama asks here, as it asks
engine.models.moe about experts):
- RMSNorm multiplies by (1 + w), in fp32 before the cast back (its weights are stored
  centred on 0; llama.cpp's files store 1 + w, engine.loading.gguf_gemma);
- the embedding is scaled by sqrt(hidden_size), the scale rounded to the activation dtype
  first (bf16: sqrt(640) = 25.30 becomes 25.25), as transformers does;
- GeGLU MLP (`hidden_activation`, tanh GELU), q/k RMSNorms, attention scale
  query_pre_attn_scalar ** -0.5;
- four norms per layer: each block's output is normed before it joins the residual stream
  (post_attention_layernorm, post_feedforward_layernorm), and the MLP's input by
  pre_feedforward_layernorm (`sandwich_norms`);
- `layer_types` names sliding-window layers (`sliding_window` keys), which rotate with their
  own RoPE base (rope_parameters per layer type: rope_local_base_freq, 10000 by default);
  full layers with rope_theta and any rope scaling (engine.models.llama.rope_tables);
- final_logit_softcapping, where set (Gemma 3 leaves it null).
Gemma 2's attention-logit softcapping and the bidirectional (embedding) variant are refused.
"""
from __future__ import annotations

import torch

from engine.errors import UnsupportedModelError

GEMMA_MODEL_TYPES = ("gemma3_text",)
MULTIMODAL_WRAPPERS = ("gemma3", "gemma4")     # configs whose text_config we serve (a gemma3_text, a gemma4_text)


def is_gemma(config) -> bool:
    return config.model_type in GEMMA_MODEL_TYPES


def text_config(config):
    """The config whose text model we serve: a multimodal `gemma3` config's text_config (its
    image tower is left unread), any other config as it is."""
    if config.model_type in MULTIMODAL_WRAPPERS:
        return config.text_config
    return config


IMAGE_TOWER_PREFIXES = ("vision_tower.", "multi_modal_projector.",      # a multimodal Gemma 3 checkpoint's
                        "model.vision_tower.", "model.embed_vision.",      # Gemma 4's image and audio sides
                        "model.audio_tower.", "model.embed_audio.")


def image_tower_tensor(name: str, config) -> bool:
    """Whether a checkpoint tensor belongs to a multimodal Gemma's image (or audio) side (left
    unread; its text model's tensors are under "language_model.", Gemma 4's "model.language_model.")."""
    return config.model_type in ("gemma3_text", "gemma4_text") and name.startswith(IMAGE_TOWER_PREFIXES)


def check_supported(config) -> None:
    """Refuse, by name, what a Gemma config may ask for that our forward pass does not do."""
    if getattr(config, "attn_logit_softcapping", None):
        raise UnsupportedModelError(
            f"{config.model_type}: attn_logit_softcapping={config.attn_logit_softcapping} (Gemma 2's attention "
            "softcapping) is not supported by our attention; Gemma 3 configs leave it null")
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModelError(
            f"{config.model_type}: use_bidirectional_attention (an embedding model) is not supported; "
            "only causal text generation is")


def sandwich_norms(config) -> bool:
    """Whether a decoder layer norms each block's output too (Gemma's four norms per layer)."""
    return is_gemma(config)


def embedding_scale(config) -> float | None:
    """What the embedding's rows are multiplied by (None: nothing)."""
    return config.hidden_size ** 0.5 if is_gemma(config) else None


def scale_rows(rows: torch.Tensor, scale: float) -> torch.Tensor:
    """rows * scale with the scale rounded to rows' dtype first (fp32, then the dtype), as
    transformers' Gemma3TextScaledWordEmbedding does."""
    return rows * torch.tensor(scale, dtype=torch.float32).to(rows.dtype)


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(logits / cap), in the logits' dtype (transformers' order of operations)."""
    if not cap:
        return logits
    return torch.tanh(logits / cap) * cap
