"""Qwen3.5's text models (transformers' `qwen3_5_text`, `qwen3_5_moe_text`) and Qwen3-Next (`qwen3_next`): Llama-family
decoders whose layers are, three in four (`layer_types`), linear attention (Gated DeltaNet)
instead of attention.

- A linear layer (`GatedDeltaNet`): q, k and v projected together, mixed by a short causal
  convolution (SiLU), then the gated delta rule over the sequence's state (engine.layers.gated_delta,
  through engine.layers.linear_attention_op: one op of the compiled graph, reading the state
  cache); its output normed per value head and gated by SiLU(z), then projected out. beta =
  sigmoid(b) is how much a token writes; g = -exp(A_log) * softplus(a + dt_bias) its decay.
- A full layer (`GatedAttention`): q/k RMSNorm ((1 + w)), RoPE on a quarter of each head's dims,
  attention through the paged KV cache, and the output gated by sigmoid of a second half of
  q_proj's output (per head: [q; gate]).
- Norms multiply by (1 + w) in fp32 (engine.models.hybrid); the MLP is SwiGLU.
- Qwen3-Next differs in two places: its linear layer projects q, k, v and z in one matrix (and b
  and a in another) laid out per key head ([q; k; v of its value heads; z of them] for each),
  which `GatedDeltaNet` splits as transformers does (row-wise, in the graph); and its MLP is a
  mixture of experts (engine.models.moe's, routed as Qwen3-MoE's) plus a shared expert gated by
  sigmoid(shared_expert_gate(x)) (`SharedExpertMoE`), but on `mlp_only_layers`.
- Qwen3.5-MoE (`qwen3_5_moe_text`): Qwen3.5's layers, every MLP Qwen3-Next's experts, the top-k
  weights always renormalised.
Only the full layers have KV in the paged cache (their own layer numbering there, `kv_index`);
the linear layers' state is in engine.cache.state_cache, one slot per sequence.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from engine.cache.state_cache import StateShape
from engine.layers import attention_op, linear_attention_op
from engine.layers.attention import attention
from engine.models.hybrid import is_linear_layer
from engine.models.llama import MLP, Linear, LlamaFamilyModel, norm_of
from engine.models.moe import SparseMoE


class ConvWeight(nn.Module):
    """The depthwise convolution's weight, [conv_dim, 1, K] as transformers' nn.Conv1d stores it."""

    def __init__(self, channels: int, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, width))


class GatedRMSNorm(nn.Module):
    """w * norm(x) (the cast back before the weight), times SiLU(gate) in fp32, as transformers'
    Qwen3_5RMSNormGated."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        normed = self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return (normed * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, config, state_index: int):
        super().__init__()
        self.num_k_heads, self.num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_dim, self.value_dim = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.state_index = state_index           # its layer in the state cache
        h = config.hidden_size
        self.per_key_head = config.model_type == "qwen3_next"      # its fused, per-key-head projections
        if self.per_key_head:
            self.in_proj_qkvz = Linear(h, self.conv_dim + self.value_dim)
            self.in_proj_ba = Linear(h, 2 * self.num_v_heads)
        else:
            self.in_proj_qkv = Linear(h, self.conv_dim)
            self.in_proj_z = Linear(h, self.value_dim)
            self.in_proj_b = Linear(h, self.num_v_heads)
            self.in_proj_a = Linear(h, self.num_v_heads)
        self.conv1d = ConvWeight(self.conv_dim, config.linear_conv_kernel_dim)
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, h)

    def projections(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [N, hidden] -> q, k, v before the convolution [N, conv_dim], z [N, Hv * Dv], b, a [N, Hv]."""
        if not self.per_key_head:
            return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)
        n, hk, per = x.shape[0], self.num_k_heads, self.num_v_heads // self.num_k_heads
        q, k, v, z = self.in_proj_qkvz(x).view(n, hk, -1).split(
            [self.head_k_dim, self.head_k_dim, per * self.head_v_dim, per * self.head_v_dim], dim=-1)
        b, a = self.in_proj_ba(x).view(n, hk, 2 * per).split(per, dim=-1)
        mixed = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1)
        return mixed, z.reshape(n, -1), b.reshape(n, -1), a.reshape(n, -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        mixed, z, b, a = self.projections(x)                                  # mixed [N, conv_dim]
        z = z.view(n, self.num_v_heads, self.head_v_dim)
        beta = b.sigmoid()                                                    # [N, Hv]
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        args = (mixed, g, beta, self.conv1d.weight, self.state_index, self.num_k_heads, self.head_k_dim,
                self.head_v_dim)
        if torch.compiler.is_compiling():
            core = linear_attention_op.gated_delta_op(*args)
        else:
            core = linear_attention_op.mix(*args)                             # [N, Hv * Dv]
        core = self.norm(core.view(n, self.num_v_heads, self.head_v_dim), z)
        return self.out_proj(core.reshape(n, self.value_dim))

    @property
    def state_shape(self) -> tuple[int, int, int, int, int]:
        return (self.conv_dim, self.conv1d.weight.shape[-1] - 1, self.num_v_heads, self.head_k_dim,
                self.head_v_dim)


def apply_partial_rope(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x [N, H, D]: rotate-half RoPE on its first rotary dims (the cos/sin tables' width), the rest as is."""
    cos, sin = rope
    d = cos.shape[-1]
    rot, rest = x[..., :d], x[..., d:]
    x1, x2 = rot.chunk(2, dim=-1)
    return torch.cat([rot * cos + torch.cat((-x2, x1), dim=-1) * sin, rest], dim=-1)


class GatedAttention(nn.Module):
    def __init__(self, config, head_dim: int, kv_index: int):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = Linear(config.hidden_size, 2 * self.q_size, bias=bias)       # per head: [q; gate]
        self.k_proj = Linear(config.hidden_size, self.kv_size, bias=bias)
        self.v_proj = Linear(config.hidden_size, self.kv_size, bias=bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=bias)
        self.q_norm, self.k_norm = norm_of(config, head_dim), norm_of(config, head_dim)
        self.scale = head_dim ** -0.5
        self.layer_index = kv_index                 # its layer in the paged KV cache
        self.window, self.sinks = 0, None

    def forward(self, x, cache, meta, rope):
        n = x.shape[0]
        q, gate = self.q_proj(x).view(n, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        q, k = apply_partial_rope(self.q_norm(q), rope), apply_partial_rope(self.k_norm(k), rope)
        if cache is None:
            out = attention_op.paged_attention(q, k, v, meta, self.layer_index, self.scale, 0, None)
        else:
            out = attention(q, k, v, cache, meta, self.scale, 0, None)            # [N, H_q, D]
        out = out.reshape(n, self.q_size) * torch.sigmoid(gate.reshape(n, self.q_size))
        return self.o_proj(out)


class HybridDecoderLayer(nn.Module):
    """Pre-norm residual blocks around a linear or a full token mixer, then the MLP."""

    def __init__(self, config, head_dim: int, index: int):
        super().__init__()
        self.is_linear = is_linear_layer(config, index)
        before = config.layer_types[:index]
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(config, before.count("linear_attention"))
        else:
            self.self_attn = GatedAttention(config, head_dim, before.count("full_attention"))
        self.mlp = SharedExpertMoE(config) if has_experts(config, index) else MLP(config)
        self.input_layernorm = norm_of(config, config.hidden_size)
        self.post_attention_layernorm = norm_of(config, config.hidden_size)

    def forward(self, h, cache, meta, rope):
        x = self.input_layernorm(h)
        h = h + (self.linear_attn(x) if self.is_linear else self.self_attn(x, cache, meta, rope))
        return h + self.mlp(self.post_attention_layernorm(h))


def has_experts(config, index: int) -> bool:
    """Whether layer `index` is a mixture of experts: every layer of a Qwen3.5-MoE; Qwen3-Next's
    per decoder_sparse_step, but mlp_only_layers."""
    if config.model_type == "qwen3_5_moe_text":
        return True
    if config.model_type != "qwen3_next" or not getattr(config, "num_experts", 0):
        return False
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return index not in (getattr(config, "mlp_only_layers", None) or []) and (index + 1) % step == 0


class SharedExpertMoE(SparseMoE):
    """Qwen3-Next's feed-forward block: the routed experts (SparseMoE, routed as Qwen3-MoE's), plus
    a shared expert every token goes through, weighted by sigmoid(shared_expert_gate(x))."""

    def __init__(self, config):
        super().__init__(config, Linear)
        self.norm_topk_prob = self.norm_topk_prob or config.model_type == "qwen3_5_moe_text"   # always, there
        shared = SimpleNamespace(hidden_size=config.hidden_size, intermediate_size=config.shared_expert_intermediate_size,
                                 hidden_act=config.hidden_act)
        self.shared_expert = MLP(shared)
        self.shared_expert_gate = Linear(config.hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class HybridModel(LlamaFamilyModel):
    """LlamaFamilyModel's interface (loading, packing, logits, the compiled step's decode_layers)
    over Qwen3.5's / Qwen3-Next's layers; `state_shape` sizes the state cache."""

    def decoder_layer(self, config, index: int) -> nn.Module:
        return HybridDecoderLayer(config, self.head_dim, index)

    @property
    def state_shape(self) -> StateShape:
        linear = [layer.linear_attn for layer in self.layers if layer.is_linear]
        return StateShape(len(linear), *linear[0].state_shape)

    def hf_layer_tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for i, layer in enumerate(self.layers):
            out.update(hf_layer_tensors(layer, f"model.layers.{i}."))
        return out


def state_shape(model) -> StateShape | None:
    """The state cache's shape for `model` (None: a model without linear-attention layers)."""
    return getattr(model, "state_shape", None)


def hf_layer_tensors(layer: HybridDecoderLayer, p: str) -> dict[str, torch.Tensor]:
    """One layer's weights under transformers' names (gate/up unfused; a dense MLP's)."""
    if isinstance(layer.mlp, SharedExpertMoE):
        raise NotImplementedError("hf_layer_tensors: a Qwen3-Next expert layer's weights are not written back")
    gate, up = layer.mlp.gate_up_proj.weight.split(layer.mlp.inter)
    out = {p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
           p + "mlp.down_proj.weight": layer.mlp.down_proj.weight}
    mixer = "linear_attn" if layer.is_linear else "self_attn"
    for name, value in getattr(layer, mixer).named_parameters():
        out[f"{p}{mixer}.{name}"] = value
    for name in ("input_layernorm", "post_attention_layernorm"):
        out[f"{p}{name}.weight"] = getattr(layer, name).weight
    return out
