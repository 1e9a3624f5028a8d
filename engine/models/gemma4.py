"""Gemma 4's dense text model (transformers' `gemma4_text`; a multimodal `gemma4` config's
`text_config`): what it changes beyond Gemma 3 (engine.models.gemma), as transformers 5.2x's
Gemma4TextModel computes it.

- Norms multiply by w itself (not 1 + w), in fp32, x * (mean(x^2) + eps) ** -0.5; values get
  a weightless RMSNorm (v_norm) beside the q/k norms, and attention is unscaled (scale 1.0).
- Heads per layer type (`config.per_layer_config`): full layers have `global_head_dim`
  (512 by default, the sliding layers' head_dim 256) and rotate by "proportional" RoPE (a
  quarter of the dims rotated, the rest passed through) with their own base.
- `attention_k_eq_v`: full layers have no v_proj; values are the key projection's output
  (before k_norm and RoPE), normed by v_norm.
- KV shared across layers (`num_kv_shared_layers`): the last layers have no k/v projections
  and attend over the keys and values of the last earlier layer of their type
  (`config.kv_sharing_modes`: "store" / "reuse"). Such a layer holds no cache of its own:
  the pool has a layer per layer that stores KV (`cache_shape`), and a sharing layer attends
  over its producer's. `use_double_wide_mlp`: the sharing layers' MLPs are twice as wide.
- Per-layer embeddings (PLE, the small sizes): a second table of num_layers x
  hidden_size_per_layer_input per token (scaled by sqrt of that), mixed with a projection of
  the embedded token ((proj * hidden^-0.5, normed) + rows) / sqrt(2); each layer adds
  post_norm(proj(gelu(gate(h)) * its slice)) to the residual after its MLP.
- Each layer's output is multiplied by its `layer_scalar` (a checkpoint tensor).

How it fits our step without touching it: the embedding (`PerLayerEmbedding`) returns each
token's main row and its per-layer rows side by side, so the compiled step's eager lookup
(`model.embed_tokens(ids)`) and the eager pass hand `decode_layers` everything it needs, and
every piece between attention calls stays row-wise.

Two things the paged pool does not do yet, done here the simple way (see `cache_shape`):
- a pool layer per layer shape: where the two layer types' head dims differ, every layer's
  K/V is stored zero-padded to the widest head (exact: zero dims add nothing to q.k, and
  the values' zero dims are dropped from the output), so a sliding layer's entries take the
  full layers' width (`padded_kv_values_per_token` says how much of the pool that is);
- attend-only attention: a sharing layer hands its producer's K/V of this pass to the
  attention op, which stores them again, the same bytes in the same slots, then attends.
Refused by name: the MoE block (26B-A4B), bidirectional attention, and full layers with
another KV head count than the sliding ones (num_global_key_value_heads).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.cache.kv_cache import CacheShape
from engine.errors import UnsupportedModelError
from engine.layers import attention_op
from engine.layers.attention import attention
from engine.models.llama import (FULL, MLP, Embedding, LlamaFamilyModel, Linear, Rotary, WeightSource,
                                 activation_of, apply_rope, layer_window, rope_tables)

GEMMA4_MODEL_TYPES = ("gemma4_text",)
STORE, REUSE = "store", "reuse"          # transformers' kv_sharing_modes


def is_gemma4(config) -> bool:
    return config.model_type in GEMMA4_MODEL_TYPES


def layer_config(config, index: int):
    """Layer `index`'s view of a heterogeneous config (its head_dim, KV heads)."""
    return config.per_layer_config[index]


def check_supported(config) -> None:
    """Refuse, by name, what a Gemma 4 text config may ask for that we do not serve."""
    if getattr(config, "enable_moe_block", False):
        raise UnsupportedModelError(f"{config.model_type}: enable_moe_block (Gemma 4's mixture-of-experts sizes, "
                                    "e.g. 26B-A4B) is not supported; the dense sizes are")
    if getattr(config, "use_bidirectional_attention", None):
        raise UnsupportedModelError(f"{config.model_type}: use_bidirectional_attention="
                                    f"{config.use_bidirectional_attention!r} is not supported; only causal text "
                                    "generation is")
    heads = {layer_config(config, i).num_key_value_heads for i in range(config.num_hidden_layers)}
    if len(heads) > 1:
        raise UnsupportedModelError(f"{config.model_type}: KV heads differ between layer types ({sorted(heads)}: "
                                    "num_global_key_value_heads); our attention metadata has one group size per model")


def sharing_producers(config) -> list[int | None]:
    """For each layer, the layer whose K/V it attends over (None: its own): a "reuse" layer's
    is the last layer of its type before the sharing ones (transformers' "store" layer)."""
    modes = config.kv_sharing_modes
    first_shared = config.num_hidden_layers - config.num_kv_shared_layers
    producers = []
    for i, mode in enumerate(modes):
        if mode != REUSE:
            producers.append(None)
            continue
        same = [j for j in range(first_shared) if config.layer_types[j] == config.layer_types[i]]
        producers.append(same[-1])
    return producers


class Gemma4RMSNorm(nn.Module):
    """transformers' Gemma4RMSNorm: x * (mean(x^2) + eps) ** -0.5 in fp32, times w (where it
    has one) in fp32, cast back."""

    def __init__(self, dim: int, eps: float, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        out = x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            out = out * self.weight.float()
        return out.type_as(x)


class Gemma4Attention(nn.Module):
    """q (and, unless it shares another layer's KV, k and v) in one fused projection; q/k/v
    norms, RoPE of the layer's type, scale 1.0, the layer type's window. `cache_index`: the
    pool layer it stores to and reads (its producer's where it shares); `cache_head_dim`: the
    pool's head width (its own, or wider: then K/V are zero-padded, see the module docstring)."""

    def __init__(self, config, index: int, cache_index: int, shares: bool, cache_head_dim: int):
        super().__init__()
        own = layer_config(config, index)
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, own.num_key_value_heads, own.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.shares = shares
        self.k_is_v = bool(config.attention_k_eq_v) and config.layer_types[index] == FULL
        self.parts = ("q_proj",) if shares else ("q_proj", "k_proj") if self.k_is_v else ("q_proj", "k_proj", "v_proj")
        self.sizes = (self.q_size,) + (self.kv_size,) * (len(self.parts) - 1)
        bias = bool(config.attention_bias)
        self.qkv_proj = Linear(config.hidden_size, sum(self.sizes), bias=bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=bias)
        self.q_norm = Gemma4RMSNorm(self.head_dim, config.rms_norm_eps)
        if not shares:
            self.k_norm = Gemma4RMSNorm(self.head_dim, config.rms_norm_eps)
            self.v_norm = Gemma4RMSNorm(self.head_dim, config.rms_norm_eps, with_scale=False)
        self.layer_type = config.layer_types[index]
        self.window = layer_window(config, index)
        self.cache_index, self.cache_head_dim = cache_index, cache_head_dim
        self.scale = 1.0

    def forward(self, x, cache, meta, rope, shared_kv: dict):
        """shared_kv: this pass's stored K/V by layer type ([N, H_kv, cache_head_dim] each),
        written by a producer layer, read by the layers sharing it."""
        n = x.shape[0]
        projected = self.qkv_proj(x).split(self.sizes, dim=-1)
        q = apply_rope(self.q_norm(projected[0].view(n, self.num_heads, self.head_dim)), rope)   # [N, H_q, D]
        if self.shares:
            k, v = shared_kv[self.layer_type]
        else:
            k = projected[1].view(n, self.num_kv_heads, self.head_dim)                      # [N, H_kv, D]
            v = k if self.k_is_v else projected[2].view(n, self.num_kv_heads, self.head_dim)
            k, v = self._padded(apply_rope(self.k_norm(k), rope)), self._padded(self.v_norm(v))
            shared_kv[self.layer_type] = (k, v)
        q = self._padded(q)
        if cache is None:
            out = attention_op.paged_attention(q, k, v, meta, self.cache_index, self.scale, self.window, None)
        else:
            out = attention(q, k, v, cache, meta, self.scale, self.window, None)            # [N, H_q, D_cache]
        return self.o_proj(out[..., :self.head_dim].reshape(n, self.q_size))

    def _padded(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, H, D] zero-padded to the pool's head width (a no-op where they agree)."""
        extra = self.cache_head_dim - self.head_dim
        return F.pad(x, (0, extra)) if extra else x


class Gemma4MLP(MLP):
    """GeGLU of `inter` (a KV-sharing layer's is twice as wide under use_double_wide_mlp)."""

    def __init__(self, config, inter: int):
        nn.Module.__init__(self)
        self.inter = inter
        self.gate_up_proj = Linear(config.hidden_size, 2 * inter, bias=False)
        self.down_proj = Linear(inter, config.hidden_size, bias=False)
        self.act = activation_of(config)


class Gemma4DecoderLayer(nn.Module):
    """Gemma's four norms, then the per-layer input's residual (PLE), then layer_scalar
    (`attention`: another class for the attention, e.g. the assistant's, engine.models.gemma4_assistant)."""

    def __init__(self, config, index: int, cache_index: int, shares: bool, cache_head_dim: int,
                 attention: type[nn.Module] | None = None):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = (attention or Gemma4Attention)(config, index, cache_index, shares, cache_head_dim)
        wide = 2 if config.use_double_wide_mlp and shares else 1
        self.mlp = Gemma4MLP(config, config.intermediate_size * wide)
        self.input_layernorm, self.post_attention_layernorm = Gemma4RMSNorm(hidden, eps), Gemma4RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = Gemma4RMSNorm(hidden, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1))
        self.per_layer = bool(config.hidden_size_per_layer_input)
        if self.per_layer:
            self.act = activation_of(config)
            self.per_layer_input_gate = Linear(hidden, config.hidden_size_per_layer_input)
            self.per_layer_projection = Linear(config.hidden_size_per_layer_input, hidden)
            self.post_per_layer_input_norm = Gemma4RMSNorm(hidden, eps)

    def forward(self, h, cache, meta, rope, per_layer_input, shared_kv):
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), cache, meta, rope, shared_kv))
        h = h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        if self.per_layer:
            gated = self.act(self.per_layer_input_gate(h)) * per_layer_input
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return h * self.layer_scalar


class PerLayerEmbedding(Embedding):
    """The token embedding (scaled by sqrt(hidden)) and, on a model with per-layer inputs,
    each token's per-layer rows (the model's `embed_tokens_per_layer`, scaled by sqrt of their
    width) after it: [N, hidden + num_layers * per_layer_width]."""
    per_layer: Embedding | None = None      # not a submodule: the model holds it, under its checkpoint name

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = super().forward(ids)
        if self.per_layer is None:
            return rows
        return torch.cat([rows, self.per_layer(ids).to(rows.dtype)], dim=-1)


class Gemma4Model(LlamaFamilyModel):
    """LlamaFamilyModel's interface (loading, packing, logits, the compiled step's decode_layers)
    over Gemma 4's layers."""

    def __init__(self, config, max_positions: int | None = None):
        nn.Module.__init__(self)
        check_supported(config)
        self.config = config
        self.max_positions = max_positions or config.max_position_embeddings
        producers = sharing_producers(config)
        storing = [i for i, p in enumerate(producers) if p is None]
        cache_index = {i: storing.index(i if p is None else p) for i, p in enumerate(producers)}
        dims = [layer_config(config, i).head_dim for i in range(config.num_hidden_layers)]
        self.head_dim = max(dims)                         # the pool's head width
        self.own_head_dims = [dims[i] for i in storing]   # what each pool layer's K/V need
        self.rotaries = nn.ModuleDict({t: Rotary(config, layer_config(config, config.layer_types.index(t)).head_dim,
                                                 self.max_positions, t) for t in sorted(set(config.layer_types))})
        self.rotary, self.sliding_rotary = None, None
        self.kv_index = [cache_index[i] for i in range(config.num_hidden_layers)]    # each layer's pool layer
        self.embed_tokens = PerLayerEmbedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.scale = config.hidden_size ** 0.5
        self.per_layer_width = config.hidden_size_per_layer_input or 0
        if self.per_layer_width:
            width = config.num_hidden_layers * self.per_layer_width
            self.embed_tokens_per_layer = Embedding(config.vocab_size_per_layer_input, width)
            self.embed_tokens_per_layer.scale = self.per_layer_width ** 0.5
            self.per_layer_model_projection = Linear(config.hidden_size, width)
            self.per_layer_projection_norm = Gemma4RMSNorm(self.per_layer_width, config.rms_norm_eps)
        self.layers = nn.ModuleList(Gemma4DecoderLayer(config, i, cache_index[i], producers[i] is not None, self.head_dim)
                                    for i in range(config.num_hidden_layers))
        self.norm = Gemma4RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.packed_weights: list[torch.Tensor] = []
        self.tie_weights()

    def tie_weights(self) -> None:
        super().tie_weights()
        if self.per_layer_width:      # looked up beside the main rows (a plain attribute: no second parameter name)
            self.embed_tokens.__dict__["per_layer"] = self.embed_tokens_per_layer

    @property
    def cache_shape(self) -> CacheShape:
        """A pool layer per layer that stores K/V (a KV-sharing layer has none), each as wide as
        the widest head (see the module docstring)."""
        return CacheShape(len(self.own_head_dims), self.layers[0].self_attn.num_kv_heads, self.head_dim)

    @property
    def padded_kv_values_per_token(self) -> int:
        """Of cache_shape's K and V values per token, those the zero padding of the narrower
        layers' heads takes (0 where every layer's head is the pool's width)."""
        heads = self.layers[0].self_attn.num_kv_heads
        return sum(2 * heads * (self.head_dim - d) for d in self.own_head_dims)

    def decode_layers(self, h: torch.Tensor, positions: torch.Tensor, kv, meta) -> torch.Tensor:
        """PerLayerEmbedding's rows [N, hidden (+ layers * per-layer width)] at `positions` ->
        final normed hidden states [N, hidden]."""
        hidden = self.config.hidden_size
        per_layer = self._per_layer_inputs(h[:, :hidden], h[:, hidden:]) if self.per_layer_width else None
        h = h[:, :hidden]
        ropes = {t: r.at(positions, h.dtype) for t, r in self.rotaries.items()}
        shared_kv: dict = {}
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            cache = None if kv is None else kv.layer(attn.cache_index)
            h = layer(h, cache, meta, ropes[attn.layer_type], None if per_layer is None else per_layer[:, i], shared_kv)
        return self.norm(h)

    def _per_layer_inputs(self, h: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """[N, layers, width]: (norm(proj(h) * hidden^-0.5) + rows) * 2^-0.5, as transformers'
        project_per_layer_inputs."""
        n, shape = h.shape[0], (h.shape[0], self.config.num_hidden_layers, self.per_layer_width)   # an early exit's too
        projected = self.per_layer_model_projection(h) * self.config.hidden_size ** -0.5
        projected = self.per_layer_projection_norm(projected.view(shape))
        return (projected + rows.reshape(n, *shape[1:])) * 2.0 ** -0.5

    def _weight_source(self, name: str, shape: tuple[int, ...]) -> WeightSource:
        """A layer's fused projection is made of the parts it has (q only where it shares KV,
        q and k under attention_k_eq_v)."""
        module, _, attr = name.rpartition(".")
        owner, _, proj = module.rpartition(".")
        if proj != "qkv_proj":
            return super()._weight_source(name, shape)
        attn = self.get_submodule(owner)
        return WeightSource(name, tuple((f"model.{owner}.{part}.{attr}", (size, *shape[1:]))
                                        for part, size in zip(attn.parts, attn.sizes)))

    def _rope_tables_on(self, device) -> None:
        for layer_type, rotary in self.rotaries.items():
            head_dim = layer_config(self.config, self.config.layer_types.index(layer_type)).head_dim
            cos, sin = rope_tables(self.config, head_dim, self.max_positions, layer_type)
            rotary.cos, rotary.sin = cos.to(device), sin.to(device)

    def hf_layer_tensors(self):
        raise NotImplementedError("Gemma 4 layers are not written back under transformers' names (an EAGLE head "
                                  "is not trained on a Gemma 4 target)")

    def load_hf_state_dict(self, tensors):
        raise NotImplementedError("a Gemma 4 model loads through load_weights (engine.loading.loader.load_model)")

