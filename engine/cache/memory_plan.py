"""The memory plan: how a device's memory goes to the weights, the KV pool and a reserve for
activations, and how many tokens of context the pool holds.

- CUDA: this process may hold `gpu_memory_fraction` of the device's total memory less what
  other processes hold (mem_get_info's used memory less what this process's allocator holds,
  memory_reserved; CUDA contexts count there too). From that, what this process's tensors
  use when the plan is made (our weights) and the activation reserve are subtracted; the pool
  gets the rest. Tensors no longer reachable (a dropped engine in a reference cycle, a bench's
  buffers) are collected and torch's cached blocks released before measuring, so they count
  for nobody; the plan says how much the others hold (`others_bytes`).
- CPU: the pool is a byte budget, by default RAM / 32 (at least 256 MiB, at most 8 GiB).
  The reserve is shown, not subtracted: host memory is not set aside in advance.
- `kv_cache_bytes`, when set, is the pool budget on any device; `num_blocks` overrides both.
- A draft model counts in the same plan: its weights (tensors it shares with the target
  count once) and its pool, which has as many blocks as the target's.
- Mixture-of-experts: every expert of every MoE layer is resident (a token reads only its
  top-k, but any token may pick any expert), so the weights are all of them; the plan says
  how much of that is experts (`moe`). Sliding-window layers (gpt-oss) keep every block of a
  sequence, the window being a mask over them, so a window layer's KV bytes are a full
  layer's; the plan says so (`kv_layers`) and counts no saving the cache does not make.
- Hybrid models (Qwen3.5: linear-attention layers between full ones): only the full layers
  have KV, and each running sequence holds a fixed-size state slot for the linear layers
  (engine.cache.state_cache), whatever its length. The plan counts the slots for the most
  sequences that run at once (`max_num_seqs` in effect) apart from the KV pool (`state`), and
  takes them from the pool's budget first. Then the prefix cache's snapshots of that state at
  block boundaries (engine.cache.state_snapshots), a state slot's bytes each:
  SNAPSHOTS_PER_SLOT per state slot, but no more than a SNAPSHOT_SHARE of what the budget
  has left; the KV pool gets the rest.

The reserve is an estimate: the largest activations of one forward pass over a prompt of
`min(context length, RESERVE_PREFILL_TOKENS)` tokens (with the torch attention path's score
matrices where the Triton kernels do not run), the logits of a verification pass, and on
CUDA a fixed allowance for cuBLAS workspaces and allocator slack. A longer prompt needs more.
"""
from __future__ import annotations

import gc
import os
from dataclasses import dataclass, replace

import torch

from engine.cache.kv_cache import resolve_kv_dtype
from engine.config import MAX_SPEC_TOKENS, EngineConfig
from engine.errors import CacheTooSmallError

GiB, MiB = 2**30, 2**20
CPU_RAM_DIVISOR = 32
CPU_BUDGET_MIN, CPU_BUDGET_MAX = 256 * MiB, 8 * GiB
RESERVE_PREFILL_TOKENS = 8192
CUDA_FIXED_RESERVE = 256 * MiB
SNAPSHOTS_PER_SLOT = 4      # a hybrid model's state snapshots for prefix hits, per state slot...
SNAPSHOT_SHARE = 4          # ...taking at most a quarter of the budget left after the state slots


@dataclass(frozen=True)
class MemoryPlan:
    device: str
    total_bytes: int            # the device's memory (CUDA) or RAM (CPU)
    weights_bytes: int          # target + draft, shared tensors once
    draft_weights_bytes: int
    reserve_bytes: int
    reserve_tokens: int         # the prompt length the reserve is sized for
    kv_bytes_per_block: int     # target + draft pools, FP8 scales included
    block_size: int
    num_blocks: int
    budget: str                 # which rule sized the pool
    others_bytes: int = 0       # CUDA: held outside this process's allocator when planned (other processes, contexts)
    moe: "ExpertBytes | None" = None        # the target's experts (all resident; in weights_bytes)
    kv_layers: "KVLayers | None" = None     # the target's full and window layers (all cached in full)
    state: "StateBytes | None" = None       # a hybrid target's linear-layer state slots (apart from KV)

    @property
    def kv_pool_bytes(self) -> int:
        return self.num_blocks * self.kv_bytes_per_block

    @property
    def prefix_snapshots(self) -> int:
        """A hybrid target's state snapshots for prefix hits (0: none)."""
        return self.state.snapshots if self.state else 0

    @property
    def tokens_that_fit(self) -> int:
        return self.num_blocks * self.block_size

    def as_dict(self) -> dict:
        """Plain data for the app's "In effect" and `python -m engine.bench memory`."""
        return {"device": self.device, "total_bytes": self.total_bytes, "weights_bytes": self.weights_bytes,
                "draft_weights_bytes": self.draft_weights_bytes, "kv_pool_bytes": self.kv_pool_bytes,
                "reserve_bytes": self.reserve_bytes, "reserve_tokens": self.reserve_tokens,
                "tokens_that_fit": self.tokens_that_fit, "budget": self.budget, "others_bytes": self.others_bytes,
                "moe": self.moe.as_dict() if self.moe else None,
                "kv_layers": self.kv_layers.as_dict() if self.kv_layers else None,
                "state": self.state.as_dict() if self.state else None}


@dataclass(frozen=True)
class StateBytes:
    """A hybrid model's recurrent state: one slot per running sequence, any length."""
    linear_layers: int
    bytes_per_slot: int
    slots: int
    snapshots: int = 0          # the prefix cache's state snapshots at block boundaries

    @property
    def pool_bytes(self) -> int:
        return self.slots * self.bytes_per_slot

    @property
    def snapshot_bytes(self) -> int:
        return self.snapshots * self.bytes_per_slot

    def as_dict(self) -> dict:
        return {"linear_layers": self.linear_layers, "state_bytes_per_sequence": self.bytes_per_slot,
                "state_slots": self.slots, "state_pool_bytes": self.pool_bytes,
                "prefix_snapshots": self.snapshots, "prefix_snapshot_bytes": self.snapshot_bytes,
                "prefix_snapshots_kept": "the state at block boundaries of cached blocks, for prefix hits "
                                         "(least recently used dropped first, and with their blocks)"}


def prefix_snapshots(slots: int, bytes_per_slot: int, budget: int) -> int:
    """State snapshots the prefix cache keeps (SNAPSHOTS_PER_SLOT, SNAPSHOT_SHARE)."""
    return max(0, min(SNAPSHOTS_PER_SLOT * slots, budget // SNAPSHOT_SHARE // bytes_per_slot))


def state_slots(config: EngineConfig, device: torch.device) -> int:
    """State slots a hybrid model's runner holds: one per sequence that may run at once (the
    max_num_seqs in effect), and one more for a scratch sequence (a warm-up, a cost probe)."""
    from engine.config import SCHEDULER_DEFAULTS
    return (config.max_num_seqs or SCHEDULER_DEFAULTS.get(torch.device(device).type, SCHEDULER_DEFAULTS["cpu"])[0]) + 1


def state_bytes(model: torch.nn.Module, config: EngineConfig, device: torch.device) -> "StateBytes | None":
    shape = getattr(model, "state_shape", None)      # a hybrid model's (engine.models.qwen3_5.HybridModel)
    if shape is None:
        return None
    return StateBytes(shape.num_layers, shape.bytes_per_slot(next(model.parameters()).dtype),
                      state_slots(config, device))


@dataclass(frozen=True)
class ExpertBytes:
    """A mixture-of-experts model's experts as served: all resident, top_k read per token."""
    moe_layers: int
    experts: int                # per MoE layer
    top_k: int                  # experts each token is routed to, per MoE layer
    resident_bytes: int         # every expert of every MoE layer (part of the weights)
    per_token_bytes: int        # the experts one token reads: top_k of each layer's

    def as_dict(self) -> dict:
        return {"moe_layers": self.moe_layers, "experts": self.experts, "top_k": self.top_k,
                "expert_weights_bytes": self.resident_bytes, "expert_bytes_per_token": self.per_token_bytes,
                "experts_resident": "all: every expert of every MoE layer is held (any token may pick any)"}


@dataclass(frozen=True)
class KVLayers:
    """Which layers attend over a sliding window, and how the cache counts them."""
    full: int
    window: int
    window_tokens: int          # the widest window (0: none)
    shared: int = 0             # layers attending over another layer's KV (Gemma 4): no cache of their own

    def as_dict(self) -> dict:
        return {"full": self.full, "window": self.window, "window_tokens": self.window_tokens,
                "kv_shared_layers": self.shared,
                "window_layers_cached": "in full: every block of a sequence is kept (the window is a mask), "
                                        "so a window layer's KV bytes equal a full layer's"}


@dataclass(frozen=True)
class DeviceMemory:
    """A device's memory when the plan is made, in bytes."""
    free: int                   # held by nobody (CUDA: mem_get_info's free)
    total: int
    ours_held: int = 0          # CUDA: what this process's allocator holds (memory_reserved)
    ours_used: int = 0          # CUDA: of that, what live tensors use (memory_allocated): our weights

    @property
    def others(self) -> int:
        """Held outside this process's allocator: other processes, and CUDA contexts."""
        return max(0, self.total - self.free - self.ours_held)


def plan_memory(config: EngineConfig, device: torch.device, target: torch.nn.Module,
                draft: torch.nn.Module | None = None,
                memory: "DeviceMemory | tuple[int, int] | None" = None) -> MemoryPlan:
    """The plan for a loaded target (and draft). `memory`: the device's as measured now, or
    (free, total) bytes (as if every used byte were another's); measured here when not given.
    Call it with no KV pool allocated."""
    device = torch.device(device)
    memory = device_memory(device) if memory is None else memory
    memory = DeviceMemory(*memory) if isinstance(memory, tuple) else memory
    total = memory.total
    models = [target] + ([draft] if draft is not None else [])
    target_bytes, draft_bytes = weights_bytes(target), weights_bytes(draft, shared_with=target) if draft else 0
    tokens = min(RESERVE_PREFILL_TOKENS, target.max_positions)
    reserve = activation_bytes(target, tokens, kernels=_kernels_likely(config, device))
    reserve += CUDA_FIXED_RESERVE if device.type == "cuda" else 0
    per_block = sum(_kv_bytes_per_token(m, config) for m in models) * config.block_size
    budget, rule = kv_budget(config, device, memory, reserve)
    state = state_bytes(target, config, device)
    if state:
        budget -= state.pool_bytes
        state = replace(state, snapshots=prefix_snapshots(state.slots, state.bytes_per_slot, budget))
        budget -= state.snapshot_bytes
    if per_block:
        num_blocks = config.num_blocks or budget // per_block
    else:                   # no KV layer (a hybrid model cut to linear layers): blocks only count tokens
        num_blocks = config.num_blocks or state_slots(config, device) * -(-target.max_positions // config.block_size)
    plan = MemoryPlan(str(device), total, target_bytes + draft_bytes, draft_bytes, reserve, tokens,
                      per_block, config.block_size, num_blocks, "num_blocks" if config.num_blocks else rule,
                      memory.others if device.type == "cuda" else 0, expert_bytes(target), kv_layers(target), state)
    if num_blocks < 1:
        raise CacheTooSmallError(_no_room(plan, budget))
    return plan


def kv_budget(config: EngineConfig, device: torch.device, memory: DeviceMemory, reserve: int) -> tuple[int, str]:
    """(bytes for the KV pools, which rule gave them). CUDA: what this process may hold (the
    fraction of the device less the others' memory), less what its tensors use and the reserve."""
    if config.kv_cache_bytes is not None:
        return config.kv_cache_bytes, "kv_cache_bytes"
    if device.type == "cuda":
        fraction = config.gpu_memory_fraction
        ours_at_most = int(memory.total * fraction) - memory.others
        return ours_at_most - memory.ours_used - reserve, f"gpu_memory_fraction {fraction:g}"
    return cpu_budget(memory.total), f"RAM/{CPU_RAM_DIVISOR}"


def cpu_budget(ram_bytes: int) -> int:
    return min(max(ram_bytes // CPU_RAM_DIVISOR, CPU_BUDGET_MIN), CPU_BUDGET_MAX)


def device_memory(device: torch.device) -> DeviceMemory:
    """The device's memory now. On CUDA, unreachable tensors are collected and the blocks torch
    caches but no tensor uses are released first, so they count as free."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        return DeviceMemory(free, total, torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device))
    total = ram_bytes()
    return DeviceMemory(total, total)


def ram_bytes() -> int:
    try:
        import psutil
        return psutil.virtual_memory().total
    except ImportError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):     # no sysconf (Windows without psutil)
        return 16 * GiB


def weights_bytes(model: torch.nn.Module, shared_with: torch.nn.Module | None = None) -> int:
    """Bytes of the model's parameters, each storage once, and of packed copies held beside a
    plain weight (engine.layers.packed_linear); those of `shared_with` excluded. A packed weight's
    parameter is a meta tensor of the same shape, which counts its bytes; a quantized one
    (engine.layers.quantized_linear) counts its kernel's bytes."""
    def storages(m):
        held = {(id(p) if p.is_meta else p.data_ptr()): p.numel() * p.element_size() for p in m.parameters()}
        held.update({id(x.packed): x.packed.numel() * x.packed.element_size() for x in m.modules()
                     if getattr(x, "packed", None) is not None and not x.weight.is_meta})
        for x in m.modules():       # a quantized weight: its kernel's bytes, not the meta parameter's
            if getattr(x, "quant", None) is not None:
                if x.weight.is_meta:
                    held.pop(id(x.weight), None)
                held[id(x.quant)] = x.quant.nbytes
            if getattr(x, "rows_from", None) is not None and x.weight.is_meta:     # looked up in stored bytes
                held.pop(id(x.weight), None)
                held[id(x.rows_from)] = x.rows_from.nbytes          # a tied head's: the same key, counted once
        return held
    skip = storages(shared_with) if shared_with is not None else {}
    return sum(n for key, n in storages(model).items() if key not in skip)


def moe_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's mixture-of-experts blocks (engine.models.moe.SparseMoE: `experts`, `top_k`)."""
    return [m for m in model.modules() if hasattr(m, "experts") and hasattr(m, "top_k")]


def expert_bytes(model: torch.nn.Module) -> ExpertBytes | None:
    """The experts' bytes as served (weights_bytes of each layer's experts), all of them
    resident, and the top_k / experts share of each layer's that one token reads; None for a
    dense model. A layer's experts are all the same size, so the share is exact."""
    blocks = moe_blocks(model)
    if not blocks:
        return None
    resident = [weights_bytes(b.experts) for b in blocks]
    per_token = sum(n * b.top_k // b.num_experts for n, b in zip(resident, blocks))
    return ExpertBytes(len(blocks), blocks[0].num_experts, blocks[0].top_k, sum(resident), per_token)


def kv_layers(model: torch.nn.Module) -> KVLayers:
    """Full and sliding-window layers (engine.models.llama.Attention.window; 0: full) that hold
    KV; those that attend over another layer's (`shares`, engine.models.gemma4) counted apart."""
    attentions = _attentions(model)
    windows = [getattr(attn, "window", 0) or 0 for attn in attentions if not getattr(attn, "shares", False)]
    return KVLayers(sum(1 for w in windows if not w), sum(1 for w in windows if w), max(windows, default=0),
                    len(attentions) - len(windows))


def activation_bytes(model: torch.nn.Module, tokens: int, kernels: bool) -> int:
    """Peak activations of one forward pass over `tokens` tokens (see the module docstring).
    A dense MLP holds its input, gate/up and the product; an MoE block (engine.models.moe)
    the router's logits, top_k copies of each token (gathered inputs, expert outputs, their
    scatter back) and one expert's intermediates over at most every token (each token picks
    an expert at most once)."""
    c, attentions = model.config, _attentions(model)
    if attentions:
        q_size, kv_size, num_heads = attentions[0].q_size, attentions[0].kv_size, attentions[0].num_heads
    else:                   # a hybrid model cut to its first (linear) layers: its config's attention
        num_heads = c.num_attention_heads
        q_size, kv_size = num_heads * model.head_dim, c.num_key_value_heads * model.head_dim
    itemsize = next(model.parameters()).element_size()
    hidden = c.hidden_size
    mlp = max(_mlp_activations(layer.mlp, hidden) for layer in model.layers)
    per_token = max(mlp, 3 * hidden + 4 * q_size + 4 * kv_size) * itemsize
    logits = (MAX_SPEC_TOKENS + 1) * c.vocab_size * (itemsize + 4)
    scores = 0 if kernels else 2 * 4 * num_heads * tokens * tokens     # fp32 scores + probabilities
    return tokens * per_token + logits + scores


def _attentions(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The attention modules of the layers that have one (a hybrid model's full layers)."""
    return [layer.self_attn for layer in model.layers if hasattr(layer, "self_attn")]


def _mlp_activations(mlp: torch.nn.Module, hidden: int) -> int:
    """Values per token a feed-forward block holds at its peak (in the model's dtype)."""
    if not hasattr(mlp, "experts"):
        return 2 * hidden + 4 * mlp.inter
    router_logits = 2 * mlp.num_experts            # fp32 probabilities, counted as two values
    return (3 * mlp.top_k + 2) * hidden + 4 * mlp.experts[0].inter + router_logits


def _kv_bytes_per_token(model: torch.nn.Module, config: EngineConfig) -> int:
    dtype = resolve_kv_dtype(config.kv_cache_dtype, next(model.parameters()).dtype)
    shape = model.cache_shape
    return shape.bytes_per_token(dtype) + shape.scale_bytes_per_token(dtype)


def _kernels_likely(config: EngineConfig, device: torch.device) -> bool:
    """Whether attention will run in the Triton kernels (no score matrices), as ModelRunner decides."""
    from engine.kernels.dispatch import kernels_in_effect      # imports without triton
    return kernels_in_effect(config.attention_backend, device)[0]


def _no_room(plan: MemoryPlan, budget: int) -> str:
    others = f", other processes and CUDA contexts {_gib(plan.others_bytes)}" if plan.device.startswith("cuda") else ""
    return (f"no room for a KV cache on {plan.device}: {_gib(plan.total_bytes)} in all{others}, weights "
            f"{_gib(plan.weights_bytes)}, activation reserve {_gib(plan.reserve_bytes)}, leaving "
            f"{_gib(max(budget, 0))} by {plan.budget} (one block needs {plan.kv_bytes_per_block} bytes); "
            "raise gpu_memory_fraction or kv_cache_bytes, shorten the context, use the FP8 KV cache, "
            "or load a smaller model or dtype")


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"
