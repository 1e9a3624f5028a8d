"""Gemma 4's shipped draft model (transformers' `gemma4_assistant`), as our forward pass over the
target's own paged KV cache.

What transformers' Gemma4AssistantForCausalLM computes for one draft, and its
SinglePositionMultiTokenCandidateGenerator feeds it (transformers 5.2x):
- input: [the target's embedding of the last token (scaled by sqrt(hidden)) ; the target's
  final normed hidden state that predicted it] -> pre_projection -> hidden;
- Gemma 4 decoder layers that all share KV: none has k/v projections; each attends over the K/V
  of the target's last "store" layer of its type (kv_sharing_modes), i.e. over the target's
  context before the last token. The query sits at the last token's position, and stays there
  for every draft of a round (each next draft feeds the token just drafted and the assistant's
  own post_projection(hidden) in place of the target's);
- masks: full layers see every context key; sliding layers the last sliding_window + 1 of them
  (a bidirectional window of distance <= sliding_window, flipped to look back). The attention
  metadata puts the row at the last context key's position (the row's own position holds no
  key, and a row sees the keys up to its metadata position), so here a sliding layer's window
  is sliding_window + 1 keys; RoPE takes the real position;
- logits from lm_head (tied to its embedding), or, with use_ordered_embeddings, only for the
  tokens of the top centroid_intermediate_top_k centroids (the rest at the minimum - 1).

The assistant never writes the target's cache: its attention reads the pool through the torch
reference path (engine.layers.attention.paged_attention_ref), which stores nothing. Where the
target's pool is wider than a head (engine.models.gemma4: zero-padded K/V), queries are padded
the same way.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from engine.errors import UnsupportedModelError
from engine.layers.attention import paged_attention_ref
from engine.models.gemma4 import Gemma4Attention, Gemma4DecoderLayer, Gemma4RMSNorm, layer_config
from engine.models.llama import Linear, Rotary, apply_rope

ASSISTANT_MODEL_TYPE = "gemma4_assistant"


class ReadOnlyAttention(Gemma4Attention):
    """A KV-sharing layer's attention that reads the target's pool and stores nothing."""

    def forward(self, x, cache, meta, rope, shared_kv):
        n = x.shape[0]
        q = apply_rope(self.q_norm(self.qkv_proj(x).view(n, self.num_heads, self.head_dim)), rope)   # [N, H_q, D]
        out = paged_attention_ref(self._padded(q), cache, meta, self.scale, self.window)
        return self.o_proj(out[..., :self.head_dim].reshape(n, self.q_size))


class Gemma4Assistant(nn.Module):
    """The assistant beside a loaded Gemma 4 target (engine.models.gemma4.Gemma4Model)."""

    def __init__(self, config, target):
        super().__init__()
        text = config.text_config
        check_pairs(config, target)
        self.config, self.text = config, text
        store = {t: i for i, (t, mode) in enumerate(zip(target.config.layer_types, target.config.kv_sharing_modes))
                 if mode == "store"}
        self.layers = nn.ModuleList(
            Gemma4DecoderLayer(text, i, target.layers[store[text.layer_types[i]]].self_attn.cache_index, True,
                               target.head_dim, attention=ReadOnlyAttention)
            for i in range(text.num_hidden_layers))
        for layer in self.layers:      # see the module docstring: the window as transformers' mask has it
            if layer.self_attn.window:
                layer.self_attn.window += 1
        self.rotaries = nn.ModuleDict({t: Rotary(text, layer_config(text, text.layer_types.index(t)).head_dim,
                                                 target.max_positions, t) for t in sorted(set(text.layer_types))})
        self.pre_projection = Linear(2 * config.backbone_hidden_size, text.hidden_size)
        self.post_projection = Linear(text.hidden_size, config.backbone_hidden_size)
        self.norm = Gemma4RMSNorm(text.hidden_size, text.rms_norm_eps)
        self.embed_tokens = nn.Embedding(text.vocab_size, text.hidden_size)     # its head's rows (tied)
        self.lm_head = Linear(text.hidden_size, text.vocab_size)
        self.ordered = bool(config.use_ordered_embeddings)
        if self.ordered:
            self.centroids = Linear(text.hidden_size, config.num_centroids)
            self.register_buffer("token_ordering", torch.zeros(text.vocab_size, dtype=torch.int64))
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.inference_mode()
    def draft(self, token_rows: torch.Tensor, target_hidden: torch.Tensor, positions: torch.Tensor, kv, meta):
        """One draft per row: the target's embedding of the last token [N, backbone] and the
        hidden state beside it [N, backbone] (the target's, or the assistant's previous
        post_projection), rotated for `positions` [N], attending the target's pool `kv` as `meta`
        says (torch-path metadata, each row at its context's last key) -> (float32 logits [N, V],
        the hidden state for the next draft [N, backbone])."""
        h = self.pre_projection(torch.cat([token_rows, target_hidden.to(token_rows.dtype)], dim=-1))
        ropes = {t: r.at(positions, h.dtype) for t, r in self.rotaries.items()}
        for layer in self.layers:
            attn = layer.self_attn
            h = layer(h, kv.layer(attn.cache_index), meta, ropes[attn.layer_type], None, {})
        h = self.norm(h)
        return self.logits(h).float(), self.post_projection(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        if not self.ordered:
            return self.lm_head(h)
        top = self.centroids(h).topk(self.config.centroid_intermediate_top_k, dim=-1).indices        # [N, top_k]
        per_centroid = self.text.vocab_size // self.config.num_centroids
        ids = self.token_ordering.view(self.config.num_centroids, per_centroid)[top].flatten(1)    # [N, top_k * K]
        picked = (h.unsqueeze(1) @ self.lm_head.weight[ids].transpose(1, 2)).squeeze(1)            # [N, top_k * K]
        out = torch.full((h.shape[0], self.text.vocab_size), float(picked.min()) - 1.0, dtype=h.dtype, device=h.device)
        return out.scatter_(1, ids, picked)

    def load_state(self, tensors: dict[str, torch.Tensor]) -> None:
        """transformers' names: model.layers.*, model.norm, model.embed_tokens, pre/post_projection,
        lm_head, masked_embedding.*."""
        own = {}
        for name, t in tensors.items():
            name = name.removeprefix("model.").replace("masked_embedding.", "")
            parts = name.split(".")
            if len(parts) > 3 and parts[2] == "self_attn" and parts[3] == "q_proj":
                name = ".".join(parts[:3] + ["qkv_proj"] + parts[4:])
            elif len(parts) > 3 and parts[2] == "mlp" and parts[3] in ("gate_proj", "up_proj"):
                continue                                    # fused below
            own[name] = t
        for i in range(len(self.layers)):
            own[f"layers.{i}.mlp.gate_up_proj.weight"] = torch.cat(
                [tensors[f"model.layers.{i}.mlp.gate_proj.weight"], tensors[f"model.layers.{i}.mlp.up_proj.weight"]])
        if self.config.tie_word_embeddings:
            own.pop("lm_head.weight", None)
        missing, unexpected = self.load_state_dict(own, strict=False)
        missing = [k for k in missing if k != "lm_head.weight" or not self.config.tie_word_embeddings]
        if missing or unexpected:
            raise UnsupportedModelError(f"the assistant's weights do not match its config: missing {missing[:5]}, "
                                        f"unexpected {unexpected[:5]}")


def check_pairs(config, target) -> None:
    """The assistant attends the target's K/V: a Gemma 4 target whose stored layers' heads are
    the assistant's, and whose hidden size is the one it was trained beside."""
    text, tc = config.text_config, getattr(target, "config", None)
    if getattr(tc, "model_type", None) != "gemma4_text":
        kind = getattr(tc, "model_type", type(target).__name__)
        raise UnsupportedModelError(f"a Gemma 4 assistant drafts for a Gemma 4 target, not {kind!r}; choose the "
                                    "target it was shipped with, or another draft")
    if config.backbone_hidden_size != tc.hidden_size:
        raise UnsupportedModelError(f"the assistant was trained beside a target of hidden size "
                                    f"{config.backbone_hidden_size}; this target's is {tc.hidden_size}")
    for t in set(text.layer_types):
        mine, theirs = (layer_config(c, c.layer_types.index(t)) for c in (text, tc))
        if (mine.head_dim, mine.num_key_value_heads) != (theirs.head_dim, theirs.num_key_value_heads):
            raise UnsupportedModelError(f"the assistant's {t} layers have heads of {mine.head_dim} x "
                                        f"{mine.num_key_value_heads}; the target's K/V have {theirs.head_dim} x "
                                        f"{theirs.num_key_value_heads}: not this target's assistant")


def is_assistant_folder(folder) -> bool:
    """Whether a folder's config.json names a Gemma 4 assistant. A config that cannot be read is
    not one: the draft loader then names what is wrong with the folder."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("model_type") == ASSISTANT_MODEL_TYPE


def load_assistant(folder, target, dtype: torch.dtype = torch.float32, device="cpu") -> Gemma4Assistant:
    """The assistant in a transformers folder (config.json, safetensors), beside `target`
    (a loaded Gemma4Model)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig
    folder = Path(folder)
    config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
    if config.model_type != ASSISTANT_MODEL_TYPE:
        raise UnsupportedModelError(f"{folder} holds a {config.model_type!r} model, not a Gemma 4 assistant")
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    assistant = Gemma4Assistant(config, target)
    assistant.load_state(tensors)
    assistant = assistant.to(device=device, dtype=dtype).eval()
    for rotary in assistant.rotaries.values():       # fp32 tables, as the target's
        rotary.cos, rotary.sin = rotary.cos.float(), rotary.sin.float()
    return assistant
