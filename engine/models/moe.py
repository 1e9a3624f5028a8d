"""Mixture-of-experts feed-forward blocks: Qwen3-MoE's (softmax router, top-k, optionally
renormalised) and gpt-oss's (biased router, top-k logits softmaxed; clamped SwiGLU experts
with biases).

Experts run batched: the pass's (token, slot) pairs are sorted by expert and each expert that
any token chose runs once, over all of its tokens, as two linears (engine.models.llama.Linear:
packed for oneDNN, or served as stored int4/int8 by our kernels). The loop is over experts,
never over tokens.

Batch invariance: a token's result never depends on which other tokens share its experts.
Each expert's linears are row-invariant (the same kernels as a dense layer's, checked the
same way), the routing is row-wise, and each token's k weighted expert outputs are summed in
one fixed order (ascending expert id, as transformers' index_add does) by elementwise ops.

Inside the compiled step the experts are one opaque op, `workbench::moe_experts(x, experts,
weights, block)` (which experts run, and over how many tokens, depends on the data: the graph
cannot hold it), like attention; `block` names the module in a registry of this process's
MoE blocks. Everything else (the router's linear, top-k, the weights) stays in the graph.
"""
from __future__ import annotations

import itertools
import threading
import weakref

import torch
import torch.nn.functional as F
from torch import nn

MOE_MODEL_TYPES = ("qwen3_moe", "gpt_oss")


def is_sparse_layer(config, index: int) -> bool:
    """Whether decoder layer `index` has experts (Qwen3-MoE's mlp_only_layers and
    decoder_sparse_step; every gpt-oss layer)."""
    if config.model_type == "gpt_oss":
        return True
    if config.model_type != "qwen3_moe":
        return False
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (index not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0 and (index + 1) % step == 0)


def num_experts(config) -> int:
    return config.num_local_experts if config.model_type == "gpt_oss" else config.num_experts


def expert_intermediate(config) -> int:
    return config.intermediate_size if config.model_type == "gpt_oss" else config.moe_intermediate_size


class Expert(nn.Module):
    """One expert: gate and up fused into one linear ([gate; up] rows), then down."""

    def __init__(self, config, linear_cls):
        super().__init__()
        self.inter = expert_intermediate(config)
        bias = config.model_type == "gpt_oss"
        self.gate_up_proj = linear_cls(config.hidden_size, 2 * self.inter, bias=bias)
        self.down_proj = linear_cls(self.inter, config.hidden_size, bias=bias)
        self.clamped = config.model_type == "gpt_oss"
        if self.clamped:
            self.alpha, self.limit = float(config.swiglu_alpha), float(config.swiglu_limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        if not self.clamped:
            return self.down_proj(F.silu(gate) * up)
        gate = gate.clamp(max=self.limit)           # gpt-oss: as transformers' GptOssExperts._apply_gate
        up = up.clamp(min=-self.limit, max=self.limit)
        return self.down_proj((up + 1) * (gate * torch.sigmoid(gate * self.alpha)))


_BLOCKS: "weakref.WeakValueDictionary[int, SparseMoE]" = weakref.WeakValueDictionary()
_NEXT_BLOCK = itertools.count()
_LOCK = threading.Lock()


class SparseMoE(nn.Module):
    """The feed-forward block of an MoE layer: router, then the chosen experts, weighted."""

    def __init__(self, config, linear_cls):
        super().__init__()
        self.kind = config.model_type
        self.num_experts = num_experts(config)
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = bool(getattr(config, "norm_topk_prob", False))
        self.router = linear_cls(config.hidden_size, self.num_experts, bias=self.kind == "gpt_oss")
        self.experts = nn.ModuleList(Expert(config, linear_cls) for _ in range(self.num_experts))
        with _LOCK:
            self.block = next(_NEXT_BLOCK)          # its name for the compiled step's op
            _BLOCKS[self.block] = self
        self.last_active = 0                        # experts the last eager call woke (stats)

    @property
    def down_proj(self):
        """The first expert's down projection (what the weights fingerprint samples)."""
        return self.experts[0].down_proj

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [N, k] in x's dtype, experts [N, k] int64) for each token."""
        logits = self.router(x)
        if self.kind == "gpt_oss":
            top, chosen = torch.topk(logits, self.top_k, dim=-1)
            return F.softmax(top, dim=1, dtype=top.dtype), chosen
        probs = F.softmax(logits, dim=-1, dtype=torch.float)
        top, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(logits.dtype), chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.route(x)
        if torch.compiler.is_compiling():
            return moe_experts(x, chosen, weights, self.block)
        return self.run_experts(x, chosen, weights)

    def run_experts(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, H], each token's experts and weights [N, k] -> Σ_k weight·expert(x) [N, H]."""
        n, k = chosen.shape
        chosen, order = chosen.sort(dim=1)                  # each token's experts, ascending
        weights = weights.gather(1, order)
        flat = chosen.reshape(-1)
        by_expert = torch.argsort(flat, stable=True)        # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        inputs = x.index_select(0, by_expert // k)
        outputs = torch.empty(n * k, x.shape[1], dtype=x.dtype, device=x.device)
        start = 0
        for e, count in enumerate(counts):
            if count:
                outputs[start:start + count] = self.experts[e](inputs[start:start + count])
                start += count
        self.last_active = sum(1 for c in counts if c)
        per_slot = torch.empty_like(outputs)
        per_slot[by_expert] = outputs
        per_slot = per_slot.view(n, k, -1)
        out = torch.zeros_like(x)
        for j in range(k):                                  # ascending expert id, as index_add
            out = out + per_slot[:, j] * weights[:, j, None]
        return out


def _moe_experts(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, block: int) -> torch.Tensor:
    module = _BLOCKS.get(block)
    if module is None:
        raise RuntimeError(f"workbench::moe_experts: MoE block {block} is gone (its model was freed)")
    return module.run_experts(x, chosen, weights)


def _moe_experts_shape(x, chosen, weights, block):
    return torch.empty_like(x)


_LIBRARY = torch.library.Library("workbench", "FRAGMENT")
_LIBRARY.define("moe_experts(Tensor x, Tensor chosen, Tensor weights, int block) -> Tensor",
                tags=(torch.Tag.cudagraph_unsafe,))
for _key in ("CPU", "CUDA"):
    _LIBRARY.impl("moe_experts", _moe_experts, _key)
torch.library.register_fake("workbench::moe_experts", _moe_experts_shape, lib=_LIBRARY)
moe_experts = torch.ops.workbench.moe_experts.default
