"""`python -m engine.bench memory --config PRESET | FOLDER | FILE.gguf`: what a model needs on a
GPU card, from our own model built on the meta device (no memory, no weights, no hand-written
formula of its shapes): parameters (total, and active per token for a mixture of experts),
weight bytes per format (a GGUF's as stored, from its header), KV bytes per token, and the
tokens that fit on a 24 GiB and a 48 GiB card.

Weight formats (every linear of our model: attention, router, experts, dense MLPs, head; the
embedding table, norms, biases and sinks stay bf16, as `weight_dtype` int8/int4 keeps them):
  bf16      2 bytes a value;
  fp8       1 byte a weight + one fp32 scale per 128 x 128 block (Qwen's FP8 checkpoints);
  int8      our kernel's layout (engine.kernels.cpu_quant.pack): 1 byte a weight + the
            per-channel scale and minimum repeated per 32 inputs, in fp32 (an fp32 scale is
            rarely exact in fp16): 10 bits a weight;
  int4      our kernel's layout: 4 bits + an fp16 scale and minimum per group of 32: 5 bits;
  mxfp4     gpt-oss as OpenAI ships it: the experts' weights in MXFP4 (4-bit E2M1 values and
            one E8M0 exponent per 32: 4.25 bits), every other tensor bf16.
  gguf_as_stored  a GGUF's weights as a CUDA load holds them (engine.loading.stored_formats):
            a tensor whose type has a CUDA form (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)
            its file bytes, byte for byte; any other (F32 norms and routers, MXFP4, Q2_K, ...)
            bf16, 2 bytes a value. The embedding table is looked up in its stored blocks where
            the head is tied to it, or where every linear is served as stored (an F32 router
            means it is not); else it is a bf16 table. Only for a GGUF: --model FILE.gguf (its
            header's types and sizes) or a synthetic GGUF preset as --config (the types
            engine.loading.synthetic_gguf would write, nothing written).
What this engine serves on CUDA: bf16 for a float checkpoint; a GGUF as stored (the
gguf_as_stored row; a type without a CUDA form dequantized to bf16); an AWQ/GPTQ checkpoint's
int4 as stored (4 bits + an fp16 scale and integer zero per group, engine.kernels.gpu_quant).
The int8 / int4 rows (weight_dtype quantizing a float weight at load) run on the CPU only,
CUDA keeps them dequantized; FP8 weights are not read; MXFP4 is dequantized as it loads
(engine.loading.fused_experts): those rows say what the format needs, for comparison.

KV: K and V of every layer for every token (engine.cache.kv_cache.CacheShape), bf16 or FP8
E4M3 with its scales. A sliding-window layer counts as a full one, because this engine keeps
all of a sequence's blocks for it (the window is a mask); what a cache that freed blocks
behind the window would hold is shown apart (`window_freeing_cache`), as not what we do.

State: a hybrid model (Qwen3.5, Qwen3-Next: engine.models.qwen3_5) has KV in its full-attention
layers only, and per sequence a fixed-size state for its linear-attention layers (each one's
convolution inputs in bf16 and its delta-rule state in fp32, engine.cache.state_cache), whatever
the context: `state`, apart from `kv`. A sequence that fits on a card needs both.

Cards: of a card's memory, the engine's default gpu_memory_fraction (0.9), less the CUDA
context (a stated allowance: the memory plan measures it on the device), the activation
reserve the memory plan would hold (engine.cache.memory_plan.activation_bytes for a
RESERVE_PREFILL_TOKENS prompt with the attention kernels, plus CUDA_FIXED_RESERVE) and the
weights; the KV pool gets the rest, in whole blocks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.cache.kv_cache import FP8_DTYPE
from engine.cache.memory_plan import (CUDA_FIXED_RESERVE, RESERVE_PREFILL_TOKENS, GiB, MiB, activation_bytes,
                                      moe_blocks)
from engine.config import BY_KEY
from engine.loading.stored_formats import format_of

CARDS = {"24GiB": 24 * GiB, "48GiB": 48 * GiB}
CUDA_CONTEXT_BYTES = 512 * MiB          # the CUDA context and torch's own allocations: an allowance
GPU_MEMORY_FRACTION = BY_KEY["gpu_memory_fraction"].default
BLOCK_SIZE = BY_KEY["block_size"].default
QUANT_GROUP = 32                        # our int8 / int4 kernels' group; MXFP4's block
FP8_BLOCK = 128
KV_DTYPES = {"bf16": torch.bfloat16, "fp8_e4m3": FP8_DTYPE}
GGUF_AS_STORED = "gguf_as_stored"
SERVED_ON_CUDA = {
    "bf16": "yes",
    "fp8": "no: this engine does not read FP8 weights",
    "int8": "no: weight_dtype int8 runs on the CPU only (CUDA keeps the weights dequantized: the bf16 row)",
    "int4": "no: weight_dtype int4 runs on the CPU only (CUDA keeps the weights dequantized: the bf16 row); "
            "an AWQ/GPTQ checkpoint's int4 is served as stored",
    "mxfp4": "no: MXFP4 experts are dequantized as they load (engine.loading.fused_experts): the bf16 row",
    GGUF_AS_STORED: "yes: the GGUF's blocks byte for byte, read by the Triton kernel (where a type's kernel "
                    "fails its trial at load, that type is dequantized to bf16)",
}
EMBEDDING = "token_embd.weight"         # llama.cpp's names
HEAD = "output.weight"
NOT_LINEARS = ("ssm_conv1d.weight",)    # weights of two dimensions that no Linear of ours holds


def meta_model(config, max_positions: int = RESERVE_PREFILL_TOKENS):
    """Our model of this config on the meta device, in bf16: shapes and no memory."""
    from engine.loading.loader import no_random_init
    from engine.models import build_model
    positions = min(max_positions, config.max_position_embeddings)
    with torch.device("meta"), no_random_init():
        return build_model(config, max_positions=positions).to(torch.bfloat16)


def model_memory(config, context: int, gguf_tensors: list[FileTensor] | None = None,
                 file_bytes: int | None = None) -> dict:
    """Every figure of the module docstring for one config, at `context` tokens a sequence;
    with a GGUF's tensors (`gguf_file_tensors`, `gguf_preset_tensors`) the gguf_as_stored row
    too (`file_bytes`: the file's size, for a real file)."""
    model = meta_model(config)
    weights = weight_bytes(model)
    stored = None
    if gguf_tensors is not None:
        stored = as_stored_on_cuda(gguf_tensors, file_bytes)
        weights[GGUF_AS_STORED] = stored["bytes"]
    kv = kv_figures(model, context)
    state = state_figures(model)
    reserve = reserve_bytes(model)
    cards_of = cards(weights, kv["bytes_per_token"], reserve, context, state["bytes_per_sequence"] if state else 0)
    return {"model_type": config.model_type, "parameters": parameter_counts(model),
            "weights_bytes": weights, "weights_served_on_cuda": {k: SERVED_ON_CUDA[k] for k in weights},
            GGUF_AS_STORED: stored, "kv": kv, "state": state, "cards": cards_of,
            "human": {"weights": {k: _gib(v) for k, v in weights.items()},
                      "kv_per_sequence": {k: _gib(v) for k, v in kv["bytes_per_sequence"].items()},
                      "state_per_sequence": _mib(state["bytes_per_sequence"]) if state else None,
                      "tokens_that_fit": _fits_text(cards_of, context)}}


def state_figures(model) -> dict | None:
    """A hybrid model's linear-attention state per sequence (any context); None for others."""
    shape = getattr(model, "state_shape", None)      # a hybrid model's (engine.models.qwen3_5.HybridModel)
    if shape is None:
        return None
    return {"linear_layers": shape.num_layers, "bytes_per_sequence": shape.bytes_per_slot(torch.bfloat16),
            "per_layer": {"conv_inputs": [shape.conv_dim, shape.conv_width], "conv_dtype": "bf16",
                          "recurrent": [shape.num_heads, shape.head_k_dim, shape.head_v_dim], "recurrent_dtype": "fp32"},
            "note": "fixed per sequence, whatever its length: the linear layers hold no KV"}


# ---- parameters ------------------------------------------------------------------
def parameter_counts(model) -> dict:
    """Total parameters (each tensor once) and, for a mixture of experts, those one token
    uses: everything but the experts, plus top_k of each MoE layer's. Qwen's "A3B" (3.3B)
    counts the embedding table; OpenAI's 3.6B for gpt-oss-20b leaves it out (a token reads one
    row): both are given."""
    total = _numel(model.parameters())
    blocks = moe_blocks(model)
    experts = sum(_numel(b.experts.parameters()) for b in blocks)
    active_experts = sum(_numel(b.experts.parameters()) * b.top_k // b.num_experts for b in blocks)
    active = total - experts + active_experts
    embedding = model.embed_tokens.weight.numel()
    tied = model.lm_head.weight is model.embed_tokens.weight
    return {"total": total, "active_per_token": active,
            "active_per_token_without_embedding": active if tied else active - embedding,
            "expert_parameters": experts, "dense_parameters": total - experts, "embedding_parameters": embedding,
            "moe_layers": len(blocks), "experts_per_layer": blocks[0].num_experts if blocks else 0,
            "experts_per_token": blocks[0].top_k if blocks else 0,
            "human": {"total": f"{total / 1e9:.2f} B", "active_per_token": f"{active / 1e9:.2f} B",
                      "active_per_token_without_embedding": f"{(active if tied else active - embedding) / 1e9:.2f} B"}}


def _numel(params) -> int:
    seen, n = set(), 0
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            n += p.numel()
    return n


# ---- weights -------------------------------------------------------------------------
def quantized_bytes(out_features: int, in_features: int, fmt: str) -> int:
    """Bytes of one linear weight [out, in] in a format of the module docstring."""
    n, groups = out_features * in_features, out_features * math.ceil(in_features / QUANT_GROUP)
    if fmt == "bf16":
        return 2 * n
    if fmt == "fp8":
        return n + 4 * math.ceil(out_features / FP8_BLOCK) * math.ceil(in_features / FP8_BLOCK)
    if fmt == "int8":
        return n + 8 * groups                   # fp32 scale and minimum per group
    if fmt == "int4":
        return n // 2 + 4 * groups              # fp16 scale and minimum per group
    if fmt == "mxfp4":
        return n // 2 + groups                  # one E8M0 byte per block of 32
    raise ValueError(f"no weight format {fmt!r}")


def weight_bytes(model) -> dict[str, int]:
    """Bytes of the model's weights per format; mxfp4 only for gpt-oss (the experts as shipped).
    A head tied to the embedding is quantized beside it (the table stays bf16 for lookups)."""
    from engine.models.llama import Linear
    experts = {id(m) for b in moe_blocks(model) for e in b.experts for m in (e.gate_up_proj, e.down_proj)}
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    linear_weights = {id(m.weight) for m in linears}
    rest = {id(p): p.numel() for p in model.parameters() if id(p) not in linear_weights}
    tied = model.lm_head.weight is model.embed_tokens.weight
    formats = ["bf16", "fp8", "int8", "int4"] + (["mxfp4"] if model.config.model_type == "gpt_oss" else [])
    out = {}
    for fmt in formats:
        total = 2 * sum(rest.values())
        if tied and fmt != "bf16":
            total += 2 * model.embed_tokens.weight.numel()        # the table, beside the quantized head
        for m in linears:
            kind = fmt if fmt != "mxfp4" else ("mxfp4" if id(m) in experts else "bf16")
            total += quantized_bytes(*m.weight.shape, kind)
        out[fmt] = total
    return out


# ---- a GGUF's weights as stored on CUDA ----------------------------------------------------
@dataclass(frozen=True)
class FileTensor:
    """One tensor of a GGUF file, as its header gives it."""
    name: str                   # llama.cpp's: "blk.0.attn_q.weight"
    kind: str                   # its stored type: "Q4_K", "F32"
    shape: tuple[int, ...]
    file_bytes: int

    @property
    def values(self) -> int:
        return math.prod(self.shape)

    @property
    def is_linear(self) -> bool:
        """A weight a Linear of ours holds (the head and a tied embedding included)."""
        return (len(self.shape) >= 2 and self.name.endswith(".weight") and self.name != EMBEDDING
                and not self.name.endswith(NOT_LINEARS))


def gguf_file_tensors(path) -> list[FileTensor]:
    """The tensors of a GGUF file, from its header (engine.loading.gguf_tensors.read_header)."""
    from engine.loading.gguf_tensors import read_header
    _, tensors = read_header(Path(path))
    return [FileTensor(t.name, t.tensor_type.name, t.shape, t.n_bytes) for t in tensors]


def gguf_preset_tensors(preset: str) -> list[FileTensor]:
    """The tensors the synthetic GGUF preset's file would hold (engine.loading.synthetic_gguf:
    its recipe's types), their bytes from the types' block sizes; nothing is written."""
    import gguf
    from engine.loading.synthetic_gguf import SYNTHETIC_GGUF_PRESETS, planned_tensors
    out = []
    for name, shape, kind in planned_tensors(*SYNTHETIC_GGUF_PRESETS[preset]):
        values, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
        out.append(FileTensor(name, kind, shape, math.prod(shape) // values * block_bytes))
    return out


def as_stored_on_cuda(tensors: list[FileTensor], file_bytes: int | None = None) -> dict:
    """The bytes a CUDA load holds for these tensors (the gguf_as_stored row of the module
    docstring), per stored type and for the embedding; against the file's tensors' bytes, and
    against `file_bytes` (a real file's size) when given."""
    def on_cuda(kind: str) -> str | None:
        return format_of(kind).on(torch.device("cuda")).form

    names = {t.name for t in tensors}
    linears_stored = all(on_cuda(t.kind) for t in tensors if t.is_linear)
    tied = HEAD not in names
    by_type, total, embedding = {}, 0, None
    for t in tensors:
        form = on_cuda(t.kind)
        if t.name == EMBEDDING:
            form = form if tied or linears_stored else None
            embedding = {"type": t.kind, "looked_up_as_stored": form is not None, "tied_to_head": tied,
                         "bytes": t.file_bytes if form else 2 * t.values}
        held = t.file_bytes if form else 2 * t.values
        total += held
        row = by_type.setdefault(t.kind if form or t.name != EMBEDDING else f"{t.kind} (embedding)",
                                 {"on_cuda": form or "bf16", "tensors": 0, "file_bytes": 0, "bytes": 0})
        row["tensors"] += 1
        row["file_bytes"] += t.file_bytes
        row["bytes"] += held
    if embedding and not embedding["looked_up_as_stored"]:
        embedding["why_bf16"] = (f"{embedding['type']} has no CUDA form" if not on_cuda(embedding["type"]) else
                                 "a linear is not served as stored (so the table is not either)")
    in_file = sum(t.file_bytes for t in tensors)
    out = {"bytes": total, "file_tensor_bytes": in_file, "weights_to_file_tensors": round(total / in_file, 4),
           "by_type": by_type, "embedding": embedding,
           "human": {"bytes": _gib(total), "file_tensor_bytes": _gib(in_file)}}
    if file_bytes:
        out |= {"file_bytes": file_bytes, "weights_to_file": round(total / file_bytes, 4)}
        out["human"]["file_bytes"] = _gib(file_bytes)
    return out


# ---- KV cache ----------------------------------------------------------------------------
def kv_figures(model, context: int) -> dict:
    """KV bytes per token and per sequence, every layer cached in full; and, apart, what a
    cache that freed the blocks behind each window would hold for one sequence."""
    shape = model.cache_shape
    per_token = {name: shape.bytes_per_token(d) + shape.scale_bytes_per_token(d) for name, d in KV_DTYPES.items()}
    attentions = model.attention_layers                              # a hybrid model's full layers only
    windows = [attn.window for attn in attentions if not getattr(attn, "shares", False)]   # Gemma 4's sharing layers hold none
    window_layers = [w for w in windows if w]
    per_layer = {name: v // shape.num_layers for name, v in per_token.items()}
    kept = (len(windows) - len(window_layers)) * context + sum(min(context, w) for w in window_layers)
    return {"bytes_per_token": per_token, "bytes_per_sequence": {k: v * context for k, v in per_token.items()},
            "context": context, "num_layers": shape.num_layers, "num_kv_heads": shape.num_kv_heads,
            "head_dim": shape.head_dim, "full_layers": len(windows) - len(window_layers),
            "linear_layers": len(model.layers) - len(attentions), "kv_shared_layers": len(attentions) - len(windows),
            "window_layers": len(window_layers), "window_tokens": max(window_layers, default=0),
            "window_layers_counted": "as full layers: this engine keeps every block of a sequence for them "
                                     "(the window is a mask), so their KV bytes equal a full layer's",
            "window_freeing_cache": None if not window_layers else {
                "note": "NOT what this engine does: a cache that freed the blocks behind each window would "
                        "hold the full layers' tokens and at least min(context, window) of each window layer's",
                "bytes_per_sequence": {k: v * kept for k, v in per_layer.items()},
                "human": {k: _gib(v * kept) for k, v in per_layer.items()}}}


def reserve_bytes(model) -> int:
    """The memory plan's activation reserve on CUDA (the attention kernels: no score matrices)."""
    return activation_bytes(model, model.max_positions, kernels=True) + CUDA_FIXED_RESERVE


def cards(weights: dict[str, int], kv_per_token: dict[str, int], reserve: int, context: int,
          state_per_sequence: int = 0) -> dict:
    """Per card: the budget, and per weight format x KV dtype the KV tokens that fit (whole
    blocks) and how many sequences of `context` tokens that is (each with its state, if any)."""
    out = {"gpu_memory_fraction": GPU_MEMORY_FRACTION, "cuda_context_allowance_bytes": CUDA_CONTEXT_BYTES,
           "activation_reserve_bytes": reserve, "reserve_prompt_tokens": RESERVE_PREFILL_TOKENS,
           "block_size": BLOCK_SIZE}
    for card, size in CARDS.items():
        budget = int(size * GPU_MEMORY_FRACTION) - CUDA_CONTEXT_BYTES - reserve
        fits = {}
        for fmt, w in weights.items():
            for kv, per_token in kv_per_token.items():
                room = budget - w
                tokens = max(room, 0) // (per_token * BLOCK_SIZE) * BLOCK_SIZE
                blocks_per_sequence = math.ceil(context / BLOCK_SIZE) * per_token * BLOCK_SIZE
                sequences = max(room, 0) // (blocks_per_sequence + state_per_sequence)
                fits[f"{fmt}_weights_{kv}_kv"] = {"weights_fit": room > 0, "kv_bytes": max(room, 0),
                                                  "tokens": tokens, "sequences_at_context": sequences}
        out[card] = {"card_bytes": size, "budget_after_reserve_bytes": budget, "fits": fits}
    return out


def _fits_text(cards_of: dict, context: int) -> dict:
    return {card: {key: f"{f['tokens']:,} tokens = {f['sequences_at_context']} x {context:,}" if f["weights_fit"]
                   else "the weights and the reserve do not fit" for key, f in cards_of[card]["fits"].items()}
            for card in CARDS}


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def _mib(n: int) -> str:
    return f"{n / MiB:.2f} MiB"
