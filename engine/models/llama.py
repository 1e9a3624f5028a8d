"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, gpt-oss, Gemma 3) built from
a transformers config and loading transformers' weight names. RMSNorm, RoPE, GQA, SwiGLU;
Qwen2 q/k/v bias; Qwen3 per-head q/k RMSNorm; mixture-of-experts feed-forward blocks
(engine.models.moe); gpt-oss's attention biases, learned sink logits and sliding-window
layers; Gemma 3's (1 + w) norms, four per layer, scaled embedding, GeGLU and per-layer-type
RoPE (engine.models.gemma). Attention goes through the paged KV cache.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.cache.kv_cache import CacheShape, KVCache
from engine.errors import UnsupportedModelError
from engine.kernels import cpu_decoder, cpu_quant
from engine.layers import attention_op, packed_linear, quantized_linear
from engine.layers.attention import AttentionMetadata, attention
from engine.models.gemma import (GEMMA_MODEL_TYPES, check_supported, embedding_scale, is_gemma, sandwich_norms,
                                  scale_rows, softcap)
from engine.models.hybrid import HYBRID_MODEL_TYPES, is_hybrid, rotary_dim
from engine.models.moe import MOE_MODEL_TYPES, SparseMoE, is_sparse_layer

DENSE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_MODEL_TYPES = DENSE_MODEL_TYPES + GEMMA_MODEL_TYPES + MOE_MODEL_TYPES + HYBRID_MODEL_TYPES
FUSED_DTYPES = (torch.float32, torch.bfloat16)      # activations our kernel folds a norm, gate or residual for
FUSED_GATE = F.silu                                 # the gate's activation it folds (SwiGLU)


class Linear(nn.Module):
    """y = x @ W^T + b, W stored as transformers stores it, [out, in] (a checkpoint's tensor is
    copied as is: no transpose at load).

    On the CPU, inference runs on oneDNN's linear (the kernel inductor uses), which reads
    weights 1.1-2x faster than MKL's matmul at SmolLM2's shapes (MKL's small-M GEMM made a
    5-token pass cost 1.64 one-token passes). Once the model is packed (`pack`, see
    engine.layers.packed_linear) the weight lives only in oneDNN's layout: the plain parameter
    becomes a meta tensor of the same shape and dtype (so byte counts stay right), and
    `dense_weight()` gives the values back. Training, autocast and CUDA take F.linear.
    A quantized linear (`quantize`, engine.layers.quantized_linear) holds its weight in an
    int4/int8 kernel's format instead, with the same meta parameter."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.packed: torch.Tensor | None = None
        self.pack_index = -1                    # its place in the model's packed weights
        self.quant: quantized_linear.QuantizedWeight | None = None
        self.quant_indices: tuple[int, ...] = ()   # its parts' indices for compiled graphs (register_graph_weights)

    def forward(self, x: torch.Tensor, norm: "RMSNorm | None" = None, gate: Callable | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """`norm` applied to x first, or `gate` (an activation: x is [gate | up], the product's input
        gate(gate) * up); `residual` added to the product. Our quantized kernel folds them into
        its call where it can (cpu_fused.h: a decode step's layer is then its linears and its
        attention, no kernel between them); elsewhere they run as the modules they are."""
        fused = self._fused(x, norm, gate, residual)
        if fused is None:
            if norm is not None:
                x = norm(x)
            if gate is not None:
                g, up = x.chunk(2, dim=-1)
                x = gate(g) * up
            y = self._product(x, cpu_quant.NOTHING_FUSED)
            return y if residual is None else residual + y
        return self._product(x, fused)

    def _fused(self, x, norm, gate, residual) -> "cpu_quant.Fused | None":
        """What our kernel folds around this product (None: it cannot, the modules run)."""
        if norm is None and gate is None and residual is None:
            return cpu_quant.NOTHING_FUSED
        if (not quantized_linear.fuses(self.quant) or x.device.type != "cpu" or x.dtype not in FUSED_DTYPES
                or (norm is not None and not norm.foldable(x.dtype)) or (gate is not None and gate is not FUSED_GATE)
                or (residual is not None and residual.dtype != x.dtype)):
            return None
        return cpu_quant.Fused(None if norm is None else norm.weight, 0.0 if norm is None else norm.eps,
                               gate is not None, None if residual is None else residual.reshape(-1, self.weight.shape[0]))

    def _product(self, x: torch.Tensor, fused: "cpu_quant.Fused") -> torch.Tensor:
        if torch.compiler.is_compiling() and (self.quant_indices or (self.quant is None and self.pack_index >= 0)):
            # a graph names its weight by index, tested first: a graph that looked at the weight's
            # tensors would guard each at every call (121 tensor guards, 0.5-0.7 ms a step)
            x2 = x.reshape(-1, x.shape[-1])
            y = (quantized_linear.graph_linear(x2, self.quant, self.quant_indices, self.bias, fused)
                 if self.quant_indices else packed_linear.packed_linear(x2, self.pack_index, self.weight.shape[0], self.bias))
            return y.view(*x.shape[:-1], y.shape[-1])
        if self.quant is None and self.packed is None and not self._cpu_inference(x):
            return F.linear(x, self.weight, self.bias)
        x2 = x.reshape(-1, x.shape[-1])
        if self.quant is not None:
            y = quantized_linear.linear(x2, self.quant, self.bias, fused)
        elif self.packed is None:       # oneDNN re-lays the weight out (or torch's matmul, see there)
            y = packed_linear.linear(x2, self.weight, self.bias)
        else:
            y = packed_linear.linear(x2, self.packed, self.bias)
        return y.view(*x.shape[:-1], y.shape[-1])

    def _cpu_inference(self, x: torch.Tensor) -> bool:
        """Inference on the CPU with matching dtypes (training, autocast, torch.compile and
        CUDA take F.linear: the oneDNN op has no backward and no mixed dtypes)."""
        return (x.device.type == "cpu" and x.dtype == self.weight.dtype
                and not torch.compiler.is_compiling()
                and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)))

    def pack(self, index: int, keep_plain: bool) -> torch.Tensor:
        """Move the weight into oneDNN's layout; `keep_plain` when the parameter is shared
        (a head tied to the embedding, which still looks rows up)."""
        self.packed, self.pack_index = packed_linear.pack(self.weight), index
        self._drop_plain(keep_plain)
        return self.packed

    def quantize(self, qw: "quantized_linear.QuantizedWeight", keep_plain: bool) -> None:
        """Serve the weight from `qw`; the plain parameter goes (to meta) unless it is shared."""
        self.quant = qw
        self._drop_plain(keep_plain)

    def _drop_plain(self, keep_plain: bool) -> None:
        """The plain parameter becomes a meta tensor of its shape and dtype (byte counts stay
        right) once another form serves the weight."""
        if not keep_plain:
            self.weight = nn.Parameter(torch.empty_like(self.weight, device="meta"), requires_grad=False)

    def dense_weight(self) -> torch.Tensor:
        if self.quant is not None and self.weight.is_meta:
            return quantized_linear.dequantize(self.quant)
        return packed_linear.unpack(self.packed) if self.weight.is_meta else self.weight


class Embedding(nn.Embedding):
    """nn.Embedding that can look its rows up in the packed weight of a head tied to it and
    served as stored (`serve_from`): the float table is then never held (Qwen3-1.7B's: 593 MiB
    in bf16), and each row is the stored weight dequantized exactly, rounded to the dtype.
    `scale` (Gemma's sqrt(hidden)) multiplies every row looked up."""
    rows_from = None
    scale: float | None = None

    def serve_from(self, qw: "quantized_linear.QuantizedWeight") -> None:
        self.rows_from = qw
        if not self.weight.is_meta:
            self.weight = nn.Parameter(torch.empty_like(self.weight, device="meta"), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = super().forward(ids) if self.rows_from is None else self._stored_rows(ids)
        return rows if self.scale is None else scale_rows(rows, self.scale)

    def _stored_rows(self, ids: torch.Tensor) -> torch.Tensor:
        flat = quantized_linear.rows(self.rows_from, ids.reshape(-1))
        return flat.to(self.weight.dtype).to(ids.device).view(*ids.shape, flat.shape[-1])


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, weight_in_fp32: bool = False, unit_offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.weight_in_fp32 = weight_in_fp32      # gpt-oss, Gemma: the weight multiplies before the cast back
        self.unit_offset = unit_offset            # Gemma: by (1 + w), in fp32

    def foldable(self, dtype: torch.dtype) -> bool:
        """Whether our quantized kernel can apply this norm to its input rows (Llama's, in x's dtype)."""
        return not self.unit_offset and not self.weight_in_fp32 and self.weight.dtype == dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same order of operations as transformers (fp32 variance, cast back before the weight).
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (x32 * (1.0 + self.weight.float())).to(dtype)
        if self.weight_in_fp32:
            return (self.weight * x32).to(dtype)
        return self.weight * x32.to(dtype)


def norm_of(config, dim: int) -> RMSNorm:
    return RMSNorm(dim, config.rms_norm_eps, weight_in_fp32=config.model_type == "gpt_oss",
                   unit_offset=is_gemma(config) or is_hybrid(config))


class Rotary(nn.Module):
    """cos/sin tables for every position up to max_positions (`layer_type`: of that kind of
    layer, where the config has RoPE parameters per layer type)."""

    def __init__(self, config, head_dim: int, max_positions: int, layer_type: str | None = None):
        super().__init__()
        self.layer_type = layer_type
        cos, sin = rope_tables(config, head_dim, max_positions, layer_type)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Gathered once per forward pass and shared by every layer: 2 x [N, 1, D]."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rope(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x [N, H, D]; rotate-half convention, as transformers' Llama."""
    cos, sin = rope
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rope_tables(config, head_dim: int, max_positions: int,
                layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.device("cpu"):     # real tables even while the model is built on "meta"
        inv_freq, attention_scaling = _rope_inv_freq(config, head_dim, layer_type)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.float())
        emb = torch.cat((freqs, freqs), dim=-1)                     # [P, D]
        return emb.cos() * attention_scaling, emb.sin() * attention_scaling


SLIDING, FULL = "sliding_attention", "full_attention"     # transformers' layer_types


def rope_per_layer_type(config) -> bool:
    """Whether the config has RoPE parameters per layer type (Gemma 3: sliding layers have
    their own base), transformers' rope_parameters {"full_attention": {...}, "sliding_attention": {...}}."""
    params = getattr(config, "rope_parameters", None) or {}
    return isinstance(params.get(SLIDING), dict)


def _rope_params(config, layer_type: str | None = None) -> dict:
    """The RoPE parameters of `layer_type`'s layers (None: all of them, e.g. for rope_identity)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if layer_type is not None and rope_per_layer_type(config):
        params = params[layer_type]
    params = dict(params)
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def _rope_inv_freq(config, head_dim: int, layer_type: str | None = None):
    params = _rope_params(config, layer_type)
    if params["rope_type"] == "default":
        base = float(params["rope_theta"])
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        return inv, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    fn = ROPE_INIT_FUNCTIONS.get(params["rope_type"])
    if fn is None:
        raise UnsupportedModelError(f"RoPE type {params['rope_type']!r} is not supported")
    if layer_type is not None and rope_per_layer_type(config):
        return fn(config, torch.device("cpu"), layer_type=layer_type)
    return fn(config, torch.device("cpu"))


def rope_identity(config) -> str:
    """Everything about RoPE that changes cached keys (part of the prefix-cache key)."""
    return repr(sorted((k, str(v)) for k, v in _rope_params(config).items()))


def layer_window(config, index: int) -> int:
    """Keys a query of layer `index` sees (0: all): transformers' `sliding_window` where the
    config's `layer_types` names the layer "sliding_attention" (gpt-oss, Qwen2/3 with
    use_sliding_window), or on every layer of a Mistral config that sets one."""
    window = getattr(config, "sliding_window", None) or 0
    types = getattr(config, "layer_types", None)
    if types:
        return int(window) if types[index] == SLIDING else 0
    return int(window) if config.model_type == "mistral" else 0


class Attention(nn.Module):
    def __init__(self, config, head_dim: int, index: int = 0):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        attention_bias = bool(getattr(config, "attention_bias", False))
        # q, k and v projections fused into one matmul (one weight read per step).
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                               bias=attention_bias or config.model_type == "qwen2")
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=attention_bias)
        self.qk_norm = config.model_type in ("qwen3", "qwen3_moe", *GEMMA_MODEL_TYPES)
        if self.qk_norm:
            self.q_norm = norm_of(config, head_dim)
            self.k_norm = norm_of(config, head_dim)
        # Gemma: query_pre_attn_scalar ** -0.5 (head_dim's on all but Gemma 3 27B)
        self.scale = (getattr(config, "query_pre_attn_scalar", None) or head_dim) ** -0.5
        self.layer_index = index             # its place in the stack (the compiled graph's attention op)
        self.window = layer_window(config, index)
        # gpt-oss: one learned logit per query head in every softmax's denominator
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if config.model_type == "gpt_oss" else None

    def forward(self, x, cache, meta: AttentionMetadata | None, rope, norm: RMSNorm | None = None,
                residual: torch.Tensor | None = None):
        """cache None: inside the compiled step, attention is its op (engine.layers.attention_op)
        and meta the pass as the op takes it (attention_op.GraphPass). `norm` is applied to x
        first and `residual` added to the output (Linear.forward folds them where it can)."""
        n = x.shape[0]
        q, k, v = self.qkv_proj(x, norm=norm).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)              # [N, H_q, D]
        k = k.view(n, self.num_kv_heads, self.head_dim)           # [N, H_kv, D]
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        # our C++ op rotates q and k itself (no kernel of the graph's between the linears)
        folded = cache is None and attention_op.rotates(meta) and rope[0].shape[-1] == self.head_dim
        if not folded:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        if cache is None:
            out = attention_op.paged_attention(q, k, v, meta, self.layer_index, self.scale, self.window, self.sinks,
                                               rope if folded else None)
        else:
            out = attention(q, k, v, cache, meta, self.scale, self.window, self.sinks)      # [N, H_q, D]
        return self.o_proj(out.reshape(n, self.q_size), residual=residual)


# a dense MLP's activation (transformers' names: config.hidden_act, Gemma's hidden_activation)
ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def activation_of(config) -> Callable[[torch.Tensor], torch.Tensor]:
    name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None) or "silu"
    if name not in ACTIVATIONS:
        raise UnsupportedModelError(f"{config.model_type}: activation {name!r} is not supported; "
                                    f"supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU, or Gemma's GeGLU."""

    def __init__(self, config):
        super().__init__()
        self.inter = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.inter, bias=False)
        self.down_proj = Linear(self.inter, config.hidden_size, bias=False)
        self.act = activation_of(config)

    def forward(self, x, norm: RMSNorm | None = None, residual: torch.Tensor | None = None):
        """`norm` applied to x first, `residual` added to the output (folded where Linear can)."""
        return self.down_proj(self.gate_up_proj(x, norm=norm), gate=self.act, residual=residual)


class DecoderLayer(nn.Module):
    """Pre-norm residual blocks. Llama's post_attention_layernorm is the MLP's input norm;
    Gemma's (`sandwich`) norms the attention's output, and two more norm the MLP's input and
    output (transformers' names for all four)."""

    def __init__(self, config, head_dim: int, index: int = 0):
        super().__init__()
        self.self_attn = Attention(config, head_dim, index)
        self.mlp = SparseMoE(config, Linear) if is_sparse_layer(config, index) else MLP(config)
        self.input_layernorm = norm_of(config, config.hidden_size)
        self.post_attention_layernorm = norm_of(config, config.hidden_size)
        self.sandwich = sandwich_norms(config)
        if self.sandwich:
            self.pre_feedforward_layernorm = norm_of(config, config.hidden_size)
            self.post_feedforward_layernorm = norm_of(config, config.hidden_size)

    def forward(self, h, cache, meta, rope):
        if self.sandwich:
            h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), cache, meta, rope))
            return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        h = self.self_attn(h, cache, meta, rope, norm=self.input_layernorm, residual=h)
        if isinstance(self.mlp, MLP):
            return self.mlp(h, norm=self.post_attention_layernorm, residual=h)
        return h + self.mlp(self.post_attention_layernorm(h))


def attention_of(layer: nn.Module) -> "Attention | None":
    """A decoder layer's attention (None: a hybrid model's linear-attention layer)."""
    return getattr(layer, "self_attn", None)


class LlamaFamilyModel(nn.Module):
    def __init__(self, config, max_positions: int | None = None):
        super().__init__()
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model type {config.model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        check_supported(config)
        self.config = config
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.max_positions = max_positions or config.max_position_embeddings
        per_type = rope_per_layer_type(config)
        self.rotary = Rotary(config, rotary_dim(config, self.head_dim), self.max_positions, FULL if per_type else None)
        # Gemma 3: sliding-window layers rotate with their own base
        self.sliding_rotary = Rotary(config, self.head_dim, self.max_positions, SLIDING) if per_type else None
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.scale = embedding_scale(config)
        self.layers = nn.ModuleList(self.decoder_layer(config, i) for i in range(config.num_hidden_layers))
        # each layer's layer in the paged KV cache (None: a hybrid model's linear layer, which has none)
        self.kv_index = [a.layer_index if a is not None else None for a in map(attention_of, self.layers)]
        self.norm = norm_of(config, config.hidden_size)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.packed_weights: list[torch.Tensor] = []     # see pack_for_cpu
        self.tie_weights()

    def decoder_layer(self, config, index: int) -> nn.Module:
        """Layer `index` (a subclass builds its own: engine.models.qwen3_5.HybridModel)."""
        if is_hybrid(config):
            raise UnsupportedModelError(f"{config.model_type}: build it with engine.models.build_model (its "
                                        "linear-attention layers are engine.models.qwen3_5's)")
        return DecoderLayer(config, self.head_dim, index)

    def tie_weights(self) -> None:
        if getattr(self.config, "tie_word_embeddings", False):
            self.lm_head.weight = self.embed_tokens.weight

    def pack_for_cpu(self) -> None:
        """Put every linear weight in oneDNN's layout for CPU inference (engine.layers.packed_linear);
        once, and only for fp32 / bf16 weights on the CPU. The model is then for inference only."""
        linears = [m for m in self.modules() if isinstance(m, Linear) and m.quant is None]
        if self.packed_weights:
            return
        if not all(packed_linear.packable(m.weight) for m in linears):
            # Torch's matmul serves them (no packing kernel runs this dtype): its rows are checked too.
            plain = [m.weight for m in linears if m.weight.device.type == "cpu" and not m.weight.is_meta]
            if plain:
                packed_linear.check_rows(plain)
            return
        embeddings = {id(m.weight) for m in self.modules() if isinstance(m, nn.Embedding)}
        self.packed_weights = [m.pack(i, keep_plain=id(m.weight) in embeddings) for i, m in enumerate(linears)]
        packed_linear.check_rows(self.packed_weights)      # batch invariance on this CPU (see there)

    @property
    def attention_layers(self) -> list[Attention]:
        """The layers' attention modules (a hybrid model's full layers only)."""
        return [a for a in map(attention_of, self.layers) if a is not None]

    @property
    def cache_shape(self) -> CacheShape:
        attentions = self.attention_layers       # none: a hybrid model cut to its first linear layers
        heads = attentions[0].num_kv_heads if attentions else self.config.num_key_value_heads
        return CacheShape(len(attentions), heads, self.head_dim)

    def hidden_states(self, input_ids: torch.Tensor, kv: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids [N] -> final normed hidden states [N, hidden]."""
        return self.decode_layers(self.embed_tokens(input_ids), meta.positions, kv, meta)

    def decode_layers(self, h: torch.Tensor, positions: torch.Tensor, kv: KVCache | None, meta) -> torch.Tensor:
        """Embedded inputs [N, hidden] at `positions` -> final normed hidden states. kv None: the
        compiled step's graph, meta the pass as its attention op takes it (attention_op.GraphPass)."""
        rope = self.rotary.at(positions, h.dtype)
        if kv is None and attention_op.rotates(meta) and (stack := self.stack_plan(h.dtype)) is not None:
            return self.norm(cpu_decoder.run(h, stack, meta, rope))       # one op call for every layer
        sliding = rope if self.sliding_rotary is None else self.sliding_rotary.at(positions, h.dtype)
        for layer, kv_index in zip(self.layers, self.kv_index):
            window = getattr(attention_of(layer), "window", 0)
            layer_rope = sliding if window else rope      # a sliding layer's window > 0
            h = layer(h, None if kv is None or kv_index is None else kv.layer(kv_index), meta, layer_rope)
        return self.norm(h)

    def stack_plan(self, dtype: torch.dtype) -> "cpu_decoder.Stack | None":
        """The decoder_stack op's constants (engine.kernels.cpu_decoder) where a compiled pass whose
        attention is our C++ op (attention_op.rotates) can run every layer in one call: plain
        Llama layers (SwiGLU, no q/k norm, biases, sinks or per-layer RoPE) whose linears our
        quantized kernel serves whole (None: the graph calls each layer's ops)."""
        if self.sliding_rotary is not None or dtype not in FUSED_DTYPES:
            return None
        weights, norms, windows = [], [], []
        for i, layer in enumerate(self.layers):
            if type(layer) is not DecoderLayer or layer.sandwich or type(layer.mlp) is not MLP or layer.mlp.act is not FUSED_GATE:
                return None
            a, mlp = layer.self_attn, layer.mlp
            linears = (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if (a.qk_norm or a.sinks is not None or a.layer_index != i or self.rotary.cos.shape[-1] != a.head_dim
                    or any(len(m.quant_indices) != 1 or m.bias is not None or not quantized_linear.fuses(m.quant)
                           for m in linears)
                    or not all(n.foldable(dtype) and n.eps == self.layers[0].input_layernorm.eps
                               for n in (layer.input_layernorm, layer.post_attention_layernorm))):
                return None
            weights += [m.quant_indices[0] for m in linears]
            norms += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            windows.append(a.window)
        if not self.layers:
            return None
        a = self.layers[0].self_attn
        if any(layer.self_attn.scale != a.scale for layer in self.layers):
            return None
        return cpu_decoder.Stack(tuple(weights), tuple(norms), self.layers[0].input_layernorm.eps, a.num_heads,
                                 a.num_kv_heads, a.head_dim, self.layers[0].mlp.inter, tuple(windows), a.scale)

    def forward(self, input_ids, kv: KVCache, meta: AttentionMetadata, logits_for: str | int = "last"):
        """Logits for the last token ("last"), all tokens ("all"), or the last n tokens (int)."""
        return self.forward_with_hidden(input_ids, kv, meta, logits_for)[0]

    def forward_with_hidden(self, input_ids, kv: KVCache, meta: AttentionMetadata, logits_for: str | int = "last"):
        """(logits as forward gives them, final normed hidden states of every new token [N, hidden]):
        the hidden states feed an EAGLE draft head at no extra cost. logits_for may also be a
        tensor of row indices (a batched pass: each sequence's last rows)."""
        h = self.hidden_states(input_ids, kv, meta)
        return self.logits(logits_rows(h, logits_for)), h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final hidden states [N, hidden] -> float32 logits [N, vocab] (softcapped where the
        config says, in the activation dtype as transformers does)."""
        return softcap(self.lm_head(h), getattr(self.config, "final_logit_softcapping", None)).float()

    def hf_layer_tensors(self) -> dict[str, torch.Tensor]:
        """The decoder layers' weights under transformers' names: q/k/v and gate/up unfused,
        [out, in] (what save_pretrained would write for them)."""
        out = {}
        for i, layer in enumerate(self.layers):
            a, p = layer.self_attn, f"model.layers.{i}."
            q, k, v = a.qkv_proj.weight.split([a.q_size, a.kv_size, a.kv_size])
            gate, up = layer.mlp.gate_up_proj.weight.split(layer.mlp.inter)
            out.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                        p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": a.o_proj.weight,
                        p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                        p + "mlp.down_proj.weight": layer.mlp.down_proj.weight,
                        p + "input_layernorm.weight": layer.input_layernorm.weight,
                        p + "post_attention_layernorm.weight": layer.post_attention_layernorm.weight})
            if layer.sandwich:
                out.update({p + "pre_feedforward_layernorm.weight": layer.pre_feedforward_layernorm.weight,
                            p + "post_feedforward_layernorm.weight": layer.post_feedforward_layernorm.weight})
            if a.qkv_proj.bias is not None:
                qb, kb, vb = a.qkv_proj.bias.split([a.q_size, a.kv_size, a.kv_size])
                out.update({p + "self_attn.q_proj.bias": qb, p + "self_attn.k_proj.bias": kb,
                            p + "self_attn.v_proj.bias": vb})
            if a.qk_norm:
                out.update({p + "self_attn.q_norm.weight": a.q_norm.weight, p + "self_attn.k_norm.weight": a.k_norm.weight})
        return out

    # ---- loading: transformers' tensors -> our parameters ------------------------------
    def weight_sources(self) -> list["WeightSource"]:
        """Where each parameter (a tied head counts once) comes from in a transformers
        checkpoint: q/k/v and gate/up are fused along the output dim in that order."""
        return [self._weight_source(name, tuple(p.shape)) for name, p in self.named_parameters()]

    def _weight_source(self, name: str, shape: tuple[int, ...]) -> "WeightSource":
        module, _, attr = name.rpartition(".")
        prefix = "" if module == "lm_head" else "model."
        owner, _, proj = module.rpartition(".")
        if proj == "router" and self.config.model_type in ("qwen3_moe", "qwen3_next", "qwen3_5_moe_text"):
            module = f"{owner}.gate"                        # Qwen3-MoE and Qwen3-Next name their router `gate`
        if proj not in FUSED_PROJECTIONS:
            return WeightSource(name, ((f"{prefix}{module}.{attr}", shape),))
        parts = tuple((f"{prefix}{owner}.{part}.{attr}", (size, *shape[1:]))
                      for part, size in zip(FUSED_PROJECTIONS[proj], self._fused_sizes(proj, shape)))
        return WeightSource(name, parts)

    def _fused_sizes(self, proj: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        if proj == "gate_up_proj":                          # a dense MLP's or an expert's
            return (shape[0] // 2,) * 2
        attn = self.layers[0].self_attn
        return attn.q_size, attn.kv_size, attn.kv_size

    def fingerprint_down(self) -> tuple[Linear, str]:
        """The down projection the weights fingerprint samples (the last layer's; an MoE
        layer's first expert's) and its checkpoint name."""
        i = len(self.layers) - 1
        mlp = self.layers[i].mlp
        if isinstance(mlp, SparseMoE):
            return mlp.experts[0].down_proj, f"model.layers.{i}.mlp.experts.0.down_proj.weight"
        return mlp.down_proj, f"model.layers.{i}.mlp.down_proj.weight"

    def load_weights(self, read: Callable[[str], torch.Tensor], device, dtype: torch.dtype,
                     on_loaded: Callable[["WeightSource"], None] = lambda source: None,
                     skip: frozenset[str] | set[str] = frozenset()) -> None:
        """Fill every parameter of a model built on the meta device, one at a time, directly
        in `dtype` on `device`. `read(name)` gives one checkpoint tensor on the CPU (e.g. a
        view of a memory-mapped file); it is dropped once copied. RoPE tables stay fp32.
        The parameters in `skip` stay on the meta device: their values come in another form
        (an AWQ/GPTQ linear's int4 groups, engine.loading.weight_quant)."""
        for source in self.weight_sources():
            if source.param in skip:
                value = torch.empty(source.rows_shape, dtype=dtype, device="meta")
            else:
                value = fill_parameter(source, read, torch.device(device), dtype)
            module, _, attr = source.param.rpartition(".")
            setattr(self.get_submodule(module), attr, nn.Parameter(value))
            on_loaded(source)
        self.tie_weights()
        self._rope_tables_on(device)

    def materialize(self) -> None:
        """After building on the meta device: allocate on the CPU, re-tie, rebuild RoPE tables
        (for load_hf_state_dict; load_weights needs none of this)."""
        self.to_empty(device="cpu")
        self.tie_weights()
        self._rope_tables_on("cpu")

    def _rope_tables_on(self, device) -> None:
        for rotary in (self.rotary, self.sliding_rotary):
            if rotary is not None:
                cos, sin = rope_tables(self.config, rotary_dim(self.config, self.head_dim), self.max_positions,
                                       rotary.layer_type)
                rotary.cos, rotary.sin = cos.to(device), sin.to(device)

    def load_hf_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load transformers' weight names, fusing q/k/v and gate/up."""
        own = {}
        prefix = "model."
        for name, t in tensors.items():
            if name.startswith(prefix):
                name = name[len(prefix):]
            own[name] = t
        fused = {}
        for i in range(len(self.layers)):
            a, m = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
            fused[a + "qkv_proj.weight"] = torch.cat([own.pop(a + p + "_proj.weight") for p in "qkv"])
            if a + "q_proj.bias" in own:
                fused[a + "qkv_proj.bias"] = torch.cat([own.pop(a + p + "_proj.bias") for p in "qkv"])
            fused[m + "gate_up_proj.weight"] = torch.cat([own.pop(m + "gate_proj.weight"), own.pop(m + "up_proj.weight")])
        own.update(fused)
        if "lm_head.weight" not in own or getattr(self.config, "tie_word_embeddings", False):
            own.pop("lm_head.weight", None)
        own = {k: v for k, v in own.items() if "rotary_emb" not in k}
        missing, unexpected = self.load_state_dict(own, strict=False)
        missing = [k for k in missing if not (k == "lm_head.weight" and self.lm_head.weight is self.embed_tokens.weight)]
        if missing or unexpected:
            raise UnsupportedModelError(f"weights do not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}")


def logits_rows(h: torch.Tensor, logits_for) -> torch.Tensor:
    """The rows of h [N, hidden] that get logits: the last ("last"), the last n (int), all
    ("all"), or those a tensor of row indices names (a batched pass: each sequence's last rows)."""
    if isinstance(logits_for, torch.Tensor):
        return h.index_select(0, logits_for)
    if logits_for == "last":
        return h[-1:]
    if isinstance(logits_for, int):
        return h[-logits_for:]
    return h


FUSED_PROJECTIONS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@dataclass(frozen=True)
class WeightSource:
    """One of our parameters and the transformers tensors it is made of."""
    param: str                                          # ours: "layers.0.self_attn.qkv_proj.weight"
    parts: tuple[tuple[str, tuple[int, ...]], ...]      # (transformers' name, its shape), stacked on dim 0

    @property
    def rows_shape(self) -> tuple[int, ...]:
        """The parts stacked: the whole parameter's shape."""
        return (sum(shape[0] for _, shape in self.parts), *self.parts[0][1][1:])


def fill_parameter(source: WeightSource, read: Callable[[str], torch.Tensor], device: torch.device,
                   dtype: torch.dtype) -> torch.Tensor:
    """The parameter's value in `dtype` on `device`: each part copied into its rows, to the
    device and the dtype in one copy."""
    rows = torch.empty(source.rows_shape, dtype=dtype, device=device)
    start = 0
    for name, shape in source.parts:
        rows[start:start + shape[0]].copy_(read(name))
        start += shape[0]
    return rows
