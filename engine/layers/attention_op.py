"""Attention as one op of the compiled graph, every input an argument.

The compiled step (engine.runtime.compiled_step) traces the whole pass with a dynamic token
dimension. Everything between two attention calls is row-wise (linears, norms, RoPE, the
MLP), so a row's result cannot depend on its neighbours. Attention is where rows meet the
cache and each other: one call per layer stores the layer's new K/V and attends over the
paged cache. Its inputs are the graph's: the pass (GraphPass, built once per pass by
`graph_pass`) names the whole pool, which the op writes and its schema says so (`Tensor(a!)`,
so inductor orders the layers' calls and writes the pool in place, no copy), and the pass's
rows as tensors (cpu_attention.PassRows: each row's sequence, its keys, the block tables,
the slots its new K/V go to). Nothing is read from a side channel and nothing is kept between
calls, so inductor sees what the step does, and a recorded step replays over the same buffers.

Which implementation attends is picked when the graph is traced, from the pass (GraphPass's
`native`, `uniform`, `mode`, `rotated` and `isa`, which dynamo guards: a pass of another kind
builds or finds its own graph):
- our C++ kernel, `workbench_cpu::attend_layer` (engine/kernels/cpu_attention.cpp), where it
  serves: the CPU, an unrotated fp32, bf16 or FP8 pool, the kernel passed its trials. The pool
  travels as bytes, so one graph serves every KV dtype;
- the Triton kernels' `workbench::uniform_attention` for a uniform pass (every sequence feeds the
  same rows, no tree: engine.runtime.decode_graphs' buffers): one store and one batched decode
  launch a layer, nothing read on the host, so a CUDA graph can record it;
- else `workbench::paged_attention`, the Python op: it rebuilds the pass's metadata in its mode
  from the row tensors (once per pass: `_metadata` keeps it by the rows tensor) and attends as
  the eager pass does (engine.layers.attention: the torch path, our kernel on a rotated pool,
  the Triton kernels for prefill chunks and trees). It reads the rows on the host, so on CUDA it
  stays cudagraph-unsafe (inductor records CUDA graphs of the pieces around it).

The graph may be given more rows than the pass has (on CUDA a pass is padded to a token-count
bucket); the op attends the pass's rows and repeats the last for the rest.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

from engine.cache.kv_cache import FP8_DTYPE, KVCache, LayerCache
from engine.kernels import cpu_attention
from engine.kernels.cpu_attention import PassRows
from engine.layers.attention import attention, prepare
from engine.layers.attention_metadata import CPU, AttentionMetadata, DecodeBatch, SeqSlice, TreeRows

NATIVE_POOLS = (torch.float32, torch.bfloat16, FP8_DTYPE)


class GraphPass(NamedTuple):
    """One pass as the graph's attention calls take it: the whole pool ([L, blocks, BS, H_kv, D],
    FP8 scales [L, blocks, BS, H_kv] or None; where our C++ op attends, its bytes [.., D * the
    element's width] and empty scales for a float pool), the rows' cache positions [N] and slots
    [N], the rows (PassRows' five tensors), and how it attends (constants: the graph is built per
    kind)."""
    k_pool: torch.Tensor
    v_pool: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    positions: torch.Tensor
    slots: torch.Tensor
    tables: torch.Tensor
    row_seq: torch.Tensor
    prefix: torch.Tensor
    extra_start: torch.Tensor
    extra_keys: torch.Tensor
    mode: str                # the pass's attention_metadata mode
    rotated: bool            # the pool holds Hadamard-rotated K/V
    native: bool             # our C++ kernel attends (isa: its build's code)
    isa: int
    uniform: int = 0         # Triton kernels: every sequence feeds this many rows, no tree (0: any pass)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The pass's row tensors (every dimension varies from pass to pass)."""
        return self.positions, self.slots, self.tables, self.row_seq, self.prefix, self.extra_start, self.extra_keys


def pool_args(kv: KVCache, mode: str, native: bool = True) -> dict:
    """GraphPass's pool and constants for passes in `mode` over the pool `kv`; native False: the
    Python op attends even where our C++ op could (tests compare them)."""
    native = native and (mode == CPU and kv.k.device.type == "cpu" and not kv.rotated and kv.dtype in NATIVE_POOLS
                         and cpu_attention.ready())
    pools = (kv.k, kv.v, kv.k_scale, kv.v_scale)
    if native:          # as bytes, so that one graph serves every KV dtype (attend_layer reads the width)
        if kv.k_scale is None:          # two unread scales, each like an FP8 pool's: dynamo guards their
            with torch.inference_mode(kv.k.is_inference()):         # kind, strides and aliasing
                scales = tuple(kv.k.new_empty((kv.k.shape[0], 1, *kv.k.shape[2:4]), dtype=torch.float32)
                               for _ in range(2))
        else:
            scales = (kv.k_scale, kv.v_scale)
        pools = (kv.k.view(torch.uint8), kv.v.view(torch.uint8), *scales)
    return dict(zip(("k_pool", "v_pool", "k_scale", "v_scale"), pools), mode=mode, rotated=kv.rotated,
                native=native, isa=cpu_attention.ISAS[cpu_attention.isa()] if native else 0)


def graph_pass(kv: KVCache, meta: AttentionMetadata, native: bool = True) -> GraphPass:
    """The pass `meta` over the pool `kv` as the graph takes it (its rows as tensors on the pool's
    device, built on the host once per pass); native: as pool_args."""
    rows = meta.layout if meta.mode == CPU else cpu_attention.rows_of(meta.seqs, meta.positions)
    device = kv.k.device
    tables, row_seq, prefix, extra_start, extra_keys = (
        t.to(device) for t in (rows.tables, rows.row_seq, rows.prefix, rows.extra_start, rows.extra_keys))
    return GraphPass(positions=meta.positions, slots=meta.slot_mapping, tables=tables, row_seq=row_seq, prefix=prefix,
                     extra_start=extra_start, extra_keys=extra_keys, **pool_args(kv, meta.mode, native))


def rotates(graph: GraphPass) -> bool:
    """Whether the graph's attention applies RoPE itself (`paged_attention`'s rope): our C++ op
    rotates q and k as it stores and reads them (no kernel of the graph's between the linears)."""
    return graph.native and not graph.uniform


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, graph: GraphPass, layer: int, scale: float,
                    window: int, sinks: torch.Tensor | None,
                    rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The graph's attention call for `layer` (0-based in the pool; window 0: none; sinks [H_q]
    or None): q, k, v [N, H, D] -> [N, H_q, D], the new K/V stored. The Triton kernels' op for a
    uniform pass, our C++ op where it serves, else the Python op (picked when the graph is traced).
    `rope` (each row's cos and sin [N, 1, D], only where `rotates`): q and k are rotated first."""
    g = graph
    if rope is not None and not rotates(g):
        raise ValueError("paged_attention: only our C++ op rotates q and k (attention_op.rotates)")
    if g.uniform:
        return kernels_op(q, k, v, g.k_pool, g.v_pool, g.k_scale, g.v_scale, g.slots, g.tables, g.prefix, layer, scale,
                          window, sinks, g.uniform)
    if g.native:
        return torch.ops.workbench_cpu.attend_layer.default(
            q, k, v, g.k_pool, g.v_pool, g.k_scale, g.v_scale, g.slots, g.tables, g.row_seq, g.prefix, g.extra_start,
            g.extra_keys, layer, scale, window, sinks, g.isa, *(rope or (None, None)))
    return python_op(q, k, v, g.k_pool, g.v_pool, g.k_scale, g.v_scale, *g.tensors(), layer, scale, window, sinks,
                     g.mode, g.rotated)


def seqs_of(rows: PassRows) -> list[SeqSlice]:
    """The pass's sequences (SeqSlice, with their draft trees) back from its rows: each
    sequence's rows are consecutive; a row with extra keys is a tree row, its path."""
    row_seq, prefix = rows.row_seq.tolist(), rows.prefix.tolist()
    starts, extra = rows.extra_start.tolist(), rows.extra_keys.tolist()
    seqs, r, n = [], 0, len(row_seq)
    while r < n:
        end = r
        while end < n and row_seq[end] == row_seq[r]:
            end += 1
        table = rows.tables[row_seq[r]]
        if starts[end] > starts[r]:
            paths = [extra[starts[j]:starts[j + 1]] for j in range(r, end)]
            tree = TreeRows(prefix[r], [p[-1] for p in paths], paths)
            context = max(tree.context, *tree.indices) + 1 if tree.indices else tree.context
        else:
            tree, context = None, prefix[end - 1]
        seqs.append(SeqSlice(r, end - r, table, context, tree))
        r = end
    return seqs


# A pass's metadata, rebuilt from its rows by the first layer's call and read by the others:
# kept by the pass's row_seq tensor (dropped with it), with copies of the rows it was built
# from (a buffer refilled in place for the next pass is a new pass).
_built = WeakIdKeyDictionary()


def _metadata(mode: str, tensors: tuple[torch.Tensor, ...], block_size: int, group_size: int) -> AttentionMetadata:
    positions, slots, *rows = tensors
    entry = _built.get(rows[1])
    if entry is not None and entry[0] == mode and all(
            a.shape == b.shape and torch.equal(a, b) for a, b in zip(entry[1], tensors)):
        return entry[2]
    meta = prepare(mode, positions, slots, seqs_of(PassRows(*rows)), block_size, group_size)
    _built[rows[1]] = (mode, tuple(t.clone() for t in tensors), meta)
    return meta


def _paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, positions: torch.Tensor,
                     slots: torch.Tensor, tables: torch.Tensor, row_seq: torch.Tensor, prefix: torch.Tensor,
                     extra_start: torch.Tensor, extra_keys: torch.Tensor, layer: int, scale: float, window: int,
                     sinks: torch.Tensor | None, path: str, rotated: bool) -> torch.Tensor:
    # path: the pass's attention_metadata mode ("mode" is taken: torch's redirect_to_mode passes its own)
    tensors = (positions, slots, tables, row_seq, prefix, extra_start, extra_keys)
    meta = _metadata(path, tensors, k_pool.shape[2], q.shape[1] // k_pool.shape[3])
    cache = _layer_cache(k_pool, v_pool, k_scale, v_scale, layer, rotated)
    n = positions.shape[0]
    return _padded(attention(q[:n], k[:n], v[:n], cache, meta, scale, window, sinks), q.shape[0])


def _layer_cache(k_pool, v_pool, k_scale, v_scale, layer: int, rotated: bool = False) -> LayerCache:
    """One layer of the whole pool the op was given."""
    def at(t):
        return None if t is None else t[layer]
    return LayerCache(k_pool[layer], v_pool[layer], at(k_scale), at(v_scale), rotated)


def _padded(out: torch.Tensor, total: int) -> torch.Tensor:
    """The pass's rows of an op's output, and the graph's padding rows after them: the last repeated."""
    if out.shape[0] == total:
        return out
    return torch.cat([out, out[-1:].expand(total - out.shape[0], *out.shape[1:])])


def _paged_attention_shape(q, k, v, k_pool, v_pool, k_scale, v_scale, positions, slots, tables, row_seq, prefix,
                           extra_start, extra_keys, layer, scale, window, sinks, path, rotated):
    return torch.empty_like(q)


_LIBRARY = torch.library.Library("workbench", "FRAGMENT")
_LIBRARY.define("paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_pool, Tensor(b!) v_pool, "
                "Tensor(c!)? k_scale, Tensor(d!)? v_scale, Tensor positions, Tensor slots, Tensor tables, "
                "Tensor row_seq, Tensor prefix, Tensor extra_start, Tensor extra_keys, int layer, float scale, "
                "int window, Tensor? sinks, str path, bool rotated) -> Tensor",
                tags=(torch.Tag.cudagraph_unsafe,))      # it reads the rows on the host
for _key in ("CPU", "CUDA"):
    _LIBRARY.impl("paged_attention", _paged_attention, _key)
torch.library.register_fake("workbench::paged_attention", _paged_attention_shape, lib=_LIBRARY)
python_op = torch.ops.workbench.paged_attention.default


def _uniform_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                       k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, slots: torch.Tensor,
                       tables: torch.Tensor, prefix: torch.Tensor, layer: int, scale: float, window: int,
                       sinks: torch.Tensor | None, q_rows: int) -> torch.Tensor:
    """A uniform pass in the Triton kernels, nothing read on the host: S = len(slots) / q_rows
    sequences, row r of sequence s at position prefix[r] - 1, their tables [S, W]. The split-K
    grid is sized by the tables' width (W blocks), not the longest context: the partitions past
    a sequence's keys add exact zeros (the kernels' batch invariance), so the bits are the
    general path's."""
    from engine.kernels import dispatch
    cache = _layer_cache(k_pool, v_pool, k_scale, v_scale, layer)
    n = slots.shape[0]
    dispatch.store(cache, k[:n], v[:n], slots)
    b = n // q_rows
    batch = DecodeBatch(rows=None, positions=(prefix - 1).view(b, q_rows), block_tables=tables,
                        max_context_len=tables.shape[1] * cache.k.shape[1])
    out = dispatch.decode_attention(q[:n].view(b, q_rows, *q.shape[1:]), cache, batch, scale, window, sinks)
    return _padded(out.flatten(0, 1), q.shape[0])


def _uniform_attention_shape(q, k, v, k_pool, v_pool, k_scale, v_scale, slots, tables, prefix, layer, scale, window,
                             sinks, q_rows):
    return torch.empty_like(q)


_LIBRARY.define("uniform_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_pool, Tensor(b!) v_pool, "
                "Tensor(c!)? k_scale, Tensor(d!)? v_scale, Tensor slots, Tensor tables, Tensor prefix, int layer, "
                "float scale, int window, Tensor? sinks, int q_rows) -> Tensor")
for _key in ("CPU", "CUDA"):
    _LIBRARY.impl("uniform_attention", _uniform_attention, _key)
torch.library.register_fake("workbench::uniform_attention", _uniform_attention_shape, lib=_LIBRARY)
kernels_op = torch.ops.workbench.uniform_attention.default
