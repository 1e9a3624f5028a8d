"""Our paged attention for the CPU (cpu_attention.cpp): the compiled step's attention op.

One call per layer reads the paged cache as stored (fp32, bf16, or FP8 through its scales)
for every row of the pass, whatever mix of prefill chunks, decodes and draft-tree rows it
holds. Each (row, KV head) is computed by one thread over its keys in order, so a row's
result depends on its query and its keys alone: batch-invariant by construction, and the
same bits on the AVX2 build and the baseline one (tested). It replaces the torch path's
per-layer gathers and dequantizing copies (the FP8 cache's float8 conversion cost about 60x
a bf16 copy there) and its ~25 small ops a layer.

The pass's rows are described once per pass (`rows_of`, on the host): for each row its
sequence, how many of the sequence's first cache indices it sees, and the extra indices a
tree row sees after them (its path). Those keys hold positions 0, 1, .. in that order (a
tree row's path at its chain's positions), so a sliding window of W (per layer, a kernel
argument) is the row's last W keys: the kernel starts there and never reads the others.
Attention sinks (gpt-oss) are one logit per query head in every row's softmax denominator.
It is built into the same library as our CPU linear (engine.kernels.cpu_linear) and tried
before it serves (`refusal`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from engine.errors import first_line
from engine.kernels import cpu_linear

KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2}
ISAS = {"scalar": 0, "avx2": 1}
NEEDS = {"scalar": (), "avx2": ("avx2", "fma")}
_chosen: dict[str, str] = {}


@dataclass
class PassRows:
    """What the kernel needs of a pass, as tensors: built once, read by every layer."""
    tables: torch.Tensor        # [S, max blocks] int64, each sequence's block table (padded with 0)
    row_seq: torch.Tensor       # [N] int64, the row's sequence
    prefix: torch.Tensor        # [N] int64, it sees cache indices 0 .. prefix - 1 of its sequence
    extra_start: torch.Tensor   # [N + 1] int64, then extra_keys[extra_start[r]:extra_start[r + 1]]
    extra_keys: torch.Tensor    # [E] int64 (at least one entry)


def rows_of(seqs, positions: torch.Tensor) -> PassRows:
    """PassRows for a pass's sequences (engine.layers.attention_metadata.SeqSlice; positions [N])."""
    width = max(s.block_table.shape[0] for s in seqs)
    tables = torch.zeros(len(seqs), width, dtype=torch.int64)
    row_seq, prefix, extra, starts = [], [], [], [0]
    pos = positions.tolist()
    for i, s in enumerate(seqs):
        tables[i, :s.block_table.shape[0]] = s.block_table.cpu()
        row_seq += [i] * s.count
        if s.tree is None:
            prefix += [p + 1 for p in pos[s.start:s.start + s.count]]
            starts += [starts[-1]] * s.count
        else:
            for path in s.tree.paths:
                prefix.append(s.tree.context)
                extra += path
                starts.append(starts[-1] + len(path))
    as_long = functools.partial(torch.tensor, dtype=torch.int64)
    return PassRows(tables, as_long(row_seq), as_long(prefix), as_long(starts), as_long(extra or [0]))


@functools.cache
def refusal() -> str | None:
    """Why the kernel cannot serve here (None: it built and passed its trials; the AVX2 build
    where the CPU has it and it gave the baseline build's bits). Tests replace this."""
    return cpu_linear.tried("our CPU attention", _chosen, NEEDS, _trial, _register_fake)


def ready() -> bool:
    """Whether the kernel passed its trials in this process (read where a graph is traced:
    refusal() has run by then wherever the CPU attention mode was chosen)."""
    return "isa" in _chosen


def isa() -> str:
    """The build the kernel runs ('avx2' or 'scalar')."""
    if refusal() is not None:
        raise RuntimeError(f"our CPU attention cannot serve here: {refusal()}")
    return _chosen["isa"]


def force_isa(name: str | None) -> None:
    """Run the `name` build ('avx2', 'scalar'), or None: the widest that passed."""
    cpu_linear.force(_chosen, name, refusal)


def attend(q: torch.Tensor, cache, rows: PassRows, scale: float, window: int = 0,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [N, H_q, D] (fp32 or bf16) -> [N, H_q, D]: each row over its keys in `cache` (one layer),
    the last `window` of them (0: all), with `sinks` [H_q] in the softmax's denominators."""
    return _call(q, cache, rows, scale, ISAS[isa()], window, sinks)


def store(cache, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """k, v [N, H_kv, D] into their slots of a float (fp32 or bf16) layer cache, in one call."""
    torch.ops.workbench_cpu.store_kv(cache.k, cache.v, k, v, slots)


def _call(q, cache, rows: PassRows, scale: float, isa_code: int, window: int = 0,
          sinks: torch.Tensor | None = None) -> torch.Tensor:
    kind = KINDS[cache.k.dtype]
    k, v = (cache.k.view(torch.uint8), cache.v.view(torch.uint8)) if kind == 2 else (cache.k, cache.v)
    if sinks is not None:
        sinks = sinks.detach().to(torch.float32).contiguous()
    return torch.ops.workbench_cpu.paged_attention(
        q.contiguous(), k, v, cache.k_scale, cache.v_scale, rows.tables, rows.row_seq, rows.prefix,
        rows.extra_start, rows.extra_keys, float(scale), int(window), sinks, kind, isa_code)


def reference(q: torch.Tensor, cache, rows: PassRows, scale: float, window: int = 0,
              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's arithmetic in float64 torch, row by row (its trial, and the tests'): a
    row's last `window` keys (0: all), and `sinks` [H_q] as one more logit per head whose
    column is dropped after the softmax."""
    from engine.cache.kv_cache import dequantize_fp8
    bs = cache.k.shape[1]
    num_kv_heads = cache.k.shape[2]
    group = q.shape[1] // num_kv_heads

    def read(pool, scales):
        flat = pool.flatten(0, 1)
        if scales is None:
            return flat.double()
        return dequantize_fp8(flat, scales.flatten(0, 1), torch.float32).double()
    k_all, v_all = read(cache.k, cache.k_scale), read(cache.v, cache.v_scale)
    out = torch.empty(q.shape, dtype=torch.float64)
    for r in range(q.shape[0]):
        e0, e1 = rows.extra_start[r].item(), rows.extra_start[r + 1].item()
        index = list(range(rows.prefix[r].item())) + rows.extra_keys[e0:e1].tolist()
        index = index[-window:] if window > 0 else index
        table = rows.tables[rows.row_seq[r]]
        slots = torch.tensor([table[i // bs].item() * bs + i % bs for i in index], dtype=torch.int64)
        k, v = k_all[slots], v_all[slots]                                    # [T, H_kv, D]
        qr = q[r].double().view(num_kv_heads, group, -1)
        scores = torch.einsum("hgd,thd->hgt", qr, k) * scale
        if sinks is not None:
            scores = torch.cat([scores, sinks.double().view(num_kv_heads, group, 1)], -1)
        weights = scores.softmax(-1)[..., :len(index)]
        out[r] = torch.einsum("hgt,thd->hgd", weights, v).reshape(q.shape[1], -1)
    return out.to(q.dtype)


def _trial(isa_name: str) -> str | None:
    """None when the `isa_name` build agrees with the float64 reference on a small pass of
    causal and tree rows, in fp32, bf16 and FP8, with and without a window and sinks, and
    (AVX2) gives the baseline build's bits."""
    from engine.cache.kv_cache import CacheShape, KVCache, quantize_fp8
    gen = torch.Generator().manual_seed(0)
    for dtype in KINDS:
        q_dtype = torch.float32 if dtype == torch.float8_e4m3fn else dtype
        cache = KVCache(CacheShape(1, 2, 16), 6, 4, dtype, torch.device("cpu")).layer(0)
        k, v = torch.randn(20, 2, 16, generator=gen), torch.randn(20, 2, 16, generator=gen)
        for pool, scales, x in ((cache.k, cache.k_scale, k), (cache.v, cache.v_scale, v)):
            if scales is None:
                pool.view(-1, 2, 16)[:20] = x.to(dtype)
            else:
                values, scale = quantize_fp8(x)
                pool.view(torch.uint8).view(-1, 2, 16)[:20] = values.view(torch.uint8)
                scales.view(-1, 2)[:20] = scale
        q = torch.randn(5, 4, 16, generator=gen).to(q_dtype)
        rows = PassRows(torch.tensor([[0, 1, 2, 3, 4], [5, 4, 3, 2, 1]]), torch.tensor([0, 0, 0, 1, 1]),
                        torch.tensor([3, 9, 17, 6, 6]), torch.tensor([0, 0, 0, 0, 2, 3]), torch.tensor([7, 9, 8]))
        for window, sinks in ((0, None), (4, torch.randn(4, generator=gen))):
            try:
                got = _call(q, cache, rows, 0.25, ISAS[isa_name], window, sinks)
                base = _call(q, cache, rows, 0.25, ISAS["scalar"], window, sinks)
            except RuntimeError as error:
                return first_line(error)
            want = reference(q, cache, rows, 0.25, window, sinks)
            tolerance = 1e-5 if q_dtype == torch.float32 else 1e-2
            if not torch.allclose(got.double(), want.double(), atol=tolerance, rtol=tolerance):
                where = " with a window and sinks" if window else ""
                return f"wrong results in {str(dtype).removeprefix('torch.')}{where}"
            if not torch.equal(got, base):
                return f"the {isa_name} build's bits differ from the baseline build's"
    return None


@functools.cache
def _register_fake() -> None:
    def fake(q, k, v, k_scale, v_scale, tables, row_seq, prefix, extra_start, extra_keys, scale, window, sinks,
             kind, isa):
        return torch.empty_like(q)
    torch.library.register_fake("workbench_cpu::paged_attention", fake)

    def fake_layer(q, k, v, k_pool, v_pool, k_scale, v_scale, slots, tables, row_seq, prefix, extra_start, extra_keys,
                   layer, scale, window, sinks, isa, cos=None, sin=None):
        return q.new_empty(q.shape)
    torch.library.register_fake("workbench_cpu::attend_layer", fake_layer)
