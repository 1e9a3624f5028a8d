"""A Llama decoder's layers in one op call (cpu_decoder.cpp, `workbench_cpu::decoder_stack`), for
a compiled step whose linears are our quantized kernel's (engine.kernels.cpu_quant, weights
named by index) and whose attention is our C++ op (engine.kernels.cpu_attention). It calls
those ops per layer, as the per-layer graph does, with the norms, RoPE and residuals folded into
them: the same bits, without the host's work between 150 op calls a step."""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch


class Stack(NamedTuple):
    """The op's constants for one model (engine.models.llama.LlamaFamilyModel.stack_plan)."""
    weights: tuple[int, ...]            # per layer: qkv, o, gate_up, down (linear_at's indices)
    norms: tuple[torch.Tensor, ...]     # per layer: the input norm's weight, the post-attention norm's
    eps: float
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    windows: tuple[int, ...]            # per layer (0: none)
    scale: float


@functools.cache
def register_fake() -> None:
    """The op's output shape for the compiler: called before a graph is traced (by the compiled
    step, once our kernel holds the model's weights; dynamo cannot trace this call itself)."""
    torch.library.register_fake("workbench_cpu::decoder_stack")(lambda h, *rest: h.new_empty(h.shape))


def run(h: torch.Tensor, stack: Stack, graph, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The layers' output (before the final norm) for embedded rows h [N, hidden]; `graph` the
    pass as attention takes it (engine.layers.attention_op.GraphPass, our C++ op's), `rope` each
    row's cos and sin [N, 1, D]."""
    g = graph
    return torch.ops.workbench_cpu.decoder_stack(
        h, list(stack.weights), list(stack.norms), stack.eps, stack.heads, stack.kv_heads, stack.head_dim, stack.inter,
        list(stack.windows), stack.scale, g.k_pool, g.v_pool, g.k_scale, g.v_scale, g.slots, g.tables, g.row_seq,
        g.prefix, g.extra_start, g.extra_keys, g.isa, *rope)
