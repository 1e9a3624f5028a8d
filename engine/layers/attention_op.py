"""Attention as one opaque op of a compiled graph (vLLM's piecewise compilation).

The compiled step (engine.runtime.compiled_step) traces the whole pass with a dynamic token
dimension. Everything between two attention calls is row-wise (linears, norms, RoPE, the
MLP), so a row's result cannot depend on its neighbours. Attention is where rows meet the
cache and each other: it stays out of the graph as `workbench::paged_attention(q, k, v,
layer, scale, window, sinks)` (the layer's sliding window, 0 for none, and its attention
sinks or None), one call per layer, which stores the new K/V and attends over the paged cache
through engine.layers.attention in the pass's mode (our CPU kernel, the torch path, or the
Triton kernels on CUDA), reading the pass's pool and metadata from `serving` (per thread: the GUI
process runs the engine on a worker thread). On CUDA the op is tagged cudagraph-unsafe, so
inductor records CUDA graphs of the pieces between attention calls (graph partitioning).

The graph may be given more rows than the pass has (on CUDA a pass is padded to a token-count
bucket); the op attends the pass's rows and repeats the last for the rest.

On the CPU, where our attention kernel serves, the graph calls its C++ twin instead,
`workbench_cpu::attend_layer` (engine/kernels/cpu_attention.cpp): `serving` hands it the whole
pool and the pass's rows once per pass, and each layer's call stores and attends without
entering Python (the Python op cost about 60 us a layer before the kernel ran, 30 layers a
step). Where no such pass was begun (the torch path, a rotated cache) it calls the Python op.
"""
from __future__ import annotations

import contextlib
import threading

import torch

from engine.cache.kv_cache import FP8_DTYPE, KVCache
from engine.kernels import cpu_attention
from engine.layers.attention import attention
from engine.layers.attention_metadata import CPU, AttentionMetadata

_pass = threading.local()
NATIVE_POOLS = (torch.float32, torch.bfloat16, FP8_DTYPE)


@contextlib.contextmanager
def serving(kv, meta: AttentionMetadata):
    """The pool and metadata the op's calls inside the block read (one pass)."""
    before = getattr(_pass, "current", None)
    _pass.current = (kv, meta)
    native = _begin_native(kv, meta)
    try:
        yield
    finally:
        if native:
            torch.ops.workbench_cpu.end_pass()
        _pass.current = before


def _begin_native(kv, meta: AttentionMetadata) -> bool:
    """Hand the pass to workbench_cpu::attend_layer where our CPU kernel attends it (an unrotated
    paged pool of a float or FP8 dtype); False: its calls go to the Python op."""
    if not (meta.mode == CPU and type(kv) is KVCache and not kv.rotated and kv.dtype in NATIVE_POOLS
            and kv.k.device.type == "cpu"):
        return False
    rows = meta.layout
    torch.ops.workbench_cpu.begin_pass(kv.k, kv.v, kv.k_scale, kv.v_scale, meta.slot_mapping, rows.tables,
                                       rows.row_seq, rows.prefix, rows.extra_start, rows.extra_keys,
                                       cpu_attention.ISAS[cpu_attention.isa()])
    return True


def _paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float, window: int,
                     sinks: torch.Tensor | None) -> torch.Tensor:
    current = getattr(_pass, "current", None)
    if current is None:
        raise RuntimeError("workbench::paged_attention ran outside attention_op.serving (no pass to attend in)")
    kv, meta = current
    n = meta.positions.shape[0]
    if q.shape[0] == n:
        return attention(q, k, v, kv.layer(layer), meta, scale, window, sinks)
    out = attention(q[:n], k[:n], v[:n], kv.layer(layer), meta, scale, window, sinks)
    return torch.cat([out, out[-1:].expand(q.shape[0] - n, *out.shape[1:])])   # padding rows repeat the last


def _paged_attention_shape(q, k, v, layer, scale, window, sinks):
    return torch.empty_like(q)


_LIBRARY = torch.library.Library("workbench", "FRAGMENT")
_LIBRARY.define("paged_attention(Tensor q, Tensor k, Tensor v, int layer, float scale, int window, Tensor? sinks) "
                "-> Tensor",
                tags=(torch.Tag.cudagraph_unsafe,))
for _key in ("CPU", "CUDA"):
    _LIBRARY.impl("paged_attention", _paged_attention, _key)
torch.library.register_fake("workbench::paged_attention", _paged_attention_shape, lib=_LIBRARY)
python_op = torch.ops.workbench.paged_attention.default


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float, window: int,
                    sinks: torch.Tensor | None) -> torch.Tensor:
    """The graph's attention call for `layer` (read when the graph is traced): our C++ op on the
    CPU where our kernel serves, else the Python op."""
    if q.device.type == "cpu" and cpu_attention.ready():
        return torch.ops.workbench_cpu.attend_layer.default(q, k, v, layer, scale, window, sinks)
    return python_op(q, k, v, layer, scale, window, sinks)
