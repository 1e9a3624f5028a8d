"""Sliding windows and attention sinks (gpt-oss, Gemma) in every attention path: the torch
path, our CPU kernel (its AVX2 and baseline builds) and the Triton kernels (interpreter),
against a plain float64 dense reference, over one pass of a long prefill chunk, a short
chunk, a decode and a draft tree, in fp32, bf16 and FP8 caches.

A row at position p sees the keys at positions p - window < j <= p (transformers'
`kv_idx > q_idx - sliding_window`; 0: no window). A tree row's keys are the context (key i
at position i) then its path (at context + depth). Sinks: one logit per query head added to
each softmax and dropped after it. Then what batch invariance asks of them: a row's bits are
the same alone or in a batch, across chunk boundaries, and a tree row's are its chain's; a
window past the context and sinks of -1e30 change no bit.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")          # before triton is imported (see test_kernels)

import dataclasses
import types

import pytest
import torch

from engine.cache.kv_cache import FP8_DTYPE, CacheShape, KVCache, dequantize_fp8
from engine.layers import attention_op
from engine.layers.attention import CPU, KERNELS, TORCH, SeqSlice, attention, paged_attention_ref, prepare, store_kv
from engine.layers.attention_metadata import TreeRows
from tests.kernels_required import skip_unless_runs

H_Q, H_KV, D, BS = 4, 2, 32, 4          # GQA groups of 2; 4-token blocks: tables cut tiles and chunks
NUM_BLOCKS = 80
SCALE = D ** -0.5
WINDOWS = (0, 1, 3, 17)
SINKS = torch.randn(H_Q, generator=torch.Generator().manual_seed(7)) * 2
# (q dtype, cache dtype)
DTYPES = {"fp32": (torch.float32, torch.float32), "bf16": (torch.bfloat16, torch.bfloat16),
          "fp8": (torch.float32, FP8_DTYPE), "bf16-fp8": (torch.bfloat16, FP8_DTYPE)}
# fp32 arithmetic agrees to summation order; with bf16 queries our kernels round the inputs
# only, the torch path its products and weights too (its bf16 matmuls)
TOLERANCE = {(torch.float32, TORCH): 1e-5, (torch.float32, CPU): 1e-5, (torch.float32, KERNELS): 1e-5,
             (torch.bfloat16, TORCH): 6e-2, (torch.bfloat16, CPU): 2e-2, (torch.bfloat16, KERNELS): 2e-2}


def _kernels_available() -> bool:
    from engine.kernels import dispatch
    return dispatch.kernels_available("cpu")


def _cpu_refusal():
    from engine.kernels import cpu_attention
    return cpu_attention.refusal()


def _use(name: str):
    """Run in the mode `name` names (a generator for the fixtures): our CPU kernel's builds are
    forced with force_isa, and restored after."""
    if name.startswith("cpu"):
        from engine import cpu_features
        from engine.kernels import cpu_attention
        skip_unless_runs(_cpu_refusal(), "our CPU attention")
        isa = name.removeprefix("cpu-")
        if not all(f in cpu_features.flags() for f in cpu_attention.NEEDS[isa]):
            pytest.skip(f"no {isa} on this CPU")
        cpu_attention.force_isa(isa)
        try:
            yield CPU
        finally:
            cpu_attention.force_isa(None)
    elif name == "triton":
        if not _kernels_available():
            pytest.skip("needs triton and TRITON_INTERPRET=1")
        yield KERNELS
    else:
        yield TORCH


@pytest.fixture(scope="module", params=["torch", "cpu-avx2", "cpu-scalar", "triton"])
def path(request):
    yield from _use(request.param)


# the batch-invariant paths (the CPU's; the Triton kernels' launch shape follows the row count)
INVARIANT = pytest.mark.parametrize("path", ["torch", "cpu-avx2", "cpu-scalar"], indirect=True)


# ---- one pass over a shared pool ------------------------------------------------------------

@dataclasses.dataclass
class Seq:
    """A sequence of the pass: rows at positions first..context-1 (causal), or a draft tree."""
    table: torch.Tensor
    context: int
    first: int = 0
    tree: TreeRows | None = None

    @property
    def indices(self) -> list[int]:        # the cache index of each new row
        return self.tree.indices if self.tree else list(range(self.first, self.context))


def _sequences() -> list[Seq]:
    blocks = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(3))
    tables = [blocks[0:24], blocks[24:40], blocks[40:64], blocks[64:72]]
    tree = TreeRows(context=70, indices=list(range(70, 76)),
                    paths=[[70], [70, 71], [70, 72], [70, 71, 73], [70, 71, 73, 74], [70, 72, 75]])
    return [Seq(tables[0], 90, first=40),            # a long prefill chunk (50 rows, two key tiles)
            Seq(tables[1], 61, first=55),            # a short chunk (a verify pass)
            Seq(tables[2], 76, tree=tree),           # a draft tree over a 70-token context
            Seq(tables[3], 21, first=20)]            # a decode


SEQS = _sequences()


def _pool(dtype) -> object:
    """Every slot written (the cached prefixes): one layer's pool."""
    cache = KVCache(CacheShape(1, H_KV, D), NUM_BLOCKS, BS, dtype, torch.device("cpu")).layer(0)
    gen = torch.Generator().manual_seed(11)
    n = NUM_BLOCKS * BS
    value_dtype = torch.float32 if dtype == FP8_DTYPE else dtype
    store_kv(cache, (torch.randn(n, H_KV, D, generator=gen) * 2).to(value_dtype),
             torch.randn(n, H_KV, D, generator=gen).to(value_dtype), torch.arange(n))
    return cache


def _clone(cache):
    return dataclasses.replace(cache, **{f: getattr(cache, f).clone() for f in ("k", "v", "k_scale", "v_scale")
                                         if getattr(cache, f) is not None})


def _new_rows(seq_id: int, index: int, q_dtype):
    """A row's q, k, v: the same whichever pass it is in (seeded by its sequence and index)."""
    gen = torch.Generator().manual_seed(1000 * seq_id + index)
    value_dtype = torch.float32 if q_dtype == torch.float32 else q_dtype
    return (torch.randn(H_Q, D, generator=gen).to(q_dtype), torch.randn(H_KV, D, generator=gen).to(value_dtype),
            torch.randn(H_KV, D, generator=gen).to(value_dtype))


def _slot(seq: Seq, index: int) -> int:
    return int(seq.table[index // BS]) * BS + index % BS


def pass_inputs(mode, items, q_dtype):
    """items: (sequence id, Seq with its rows) -> the pass's q, k, v and metadata."""
    slices, positions, slots, rows = [], [], [], []
    for seq_id, seq in items:
        slices.append(SeqSlice(len(rows), len(seq.indices), seq.table, seq.context, seq.tree))
        for r, index in enumerate(seq.indices):
            positions.append(seq.tree.positions[r] if seq.tree else index)
            slots.append(_slot(seq, index))
            rows.append(_new_rows(seq_id, index, q_dtype))
    q, k, v = (torch.stack(x) for x in zip(*rows))
    return q, k, v, prepare(mode, torch.tensor(positions), torch.tensor(slots), slices, BS, H_Q // H_KV)


def run_pass(mode, cache, items, q_dtype, window=0, sinks=None):
    """The pass's output [N, H_q, D] (its new keys and values stored into cache)."""
    q, k, v, meta = pass_inputs(mode, items, q_dtype)
    return attention(q, k, v, cache, meta, SCALE, window, sinks)


def attend_cached(mode, q, cache, meta, window, sinks):
    """attention() without its store: the rows' keys and values are in the cache already."""
    if mode == CPU:
        from engine.kernels import cpu_attention
        return cpu_attention.attend(q, cache, meta.layout, SCALE, window, sinks)
    return paged_attention_ref(q, cache, meta, SCALE, window, sinks)


def dense_reference(cache, items, q_dtype, window, sinks) -> torch.Tensor:
    """float64, row by row, from the keys' (cache index, position) lists."""
    def read(pool, scales):
        flat = pool.flatten(0, 1)
        return (flat if scales is None else dequantize_fp8(flat, scales.flatten(0, 1), torch.float32)).double()
    k_all, v_all = read(cache.k, cache.k_scale), read(cache.v, cache.v_scale)
    out = []
    for seq_id, seq in items:
        for r, index in enumerate(seq.indices):
            if seq.tree is None:
                p, keys = index, [(i, i) for i in range(index + 1)]
            else:
                context, path = seq.tree.context, seq.tree.paths[r]
                p = context + len(path) - 1
                keys = [(i, i) for i in range(context)] + [(i, context + d) for d, i in enumerate(path)]
            if window:
                keys = [(i, j) for i, j in keys if j > p - window]
            slots = torch.tensor([_slot(seq, i) for i, _ in keys])
            k, v = k_all[slots], v_all[slots]                                      # [T, H_kv, D]
            q = _new_rows(seq_id, index, q_dtype)[0].double().view(H_KV, H_Q // H_KV, D)
            scores = torch.einsum("hgd,thd->hgt", q, k) * SCALE
            if sinks is not None:
                scores = torch.cat([scores, sinks.double().view(H_KV, -1, 1)], -1)
            weights = scores.softmax(-1)[..., :len(keys)]
            out.append(torch.einsum("hgt,thd->hgd", weights, v).reshape(H_Q, D))
    return torch.stack(out)


ALL = list(enumerate(SEQS))


@pytest.mark.parametrize("dtypes", list(DTYPES))
def test_each_path_is_the_dense_reference(path, dtypes):
    q_dtype, cache_dtype = DTYPES[dtypes]
    if path == KERNELS and dtypes == "bf16-fp8":
        pytest.skip("the interpreter is slow; FP8 and bf16 are each covered")
    base = _pool(cache_dtype)
    # the interpreter is slow: each window once there, with sinks on every other one
    cases = [(w, SINKS if i % 2 else None) for i, w in enumerate(WINDOWS)] if path == KERNELS else \
        [(w, s) for w in WINDOWS for s in (None, SINKS)]
    tolerance = TOLERANCE[q_dtype, path]
    for window, sinks in cases:
        cache = _clone(base)
        got = run_pass(path, cache, ALL, q_dtype, window, sinks)
        want = dense_reference(cache, ALL, q_dtype, window, sinks)
        torch.testing.assert_close(got.double(), want, atol=tolerance, rtol=tolerance,
                                   msg=lambda m: f"window {window}, sinks {sinks is not None}: {m}")


@pytest.mark.parametrize("dtypes", ["fp32", "bf16", "fp8"])
def test_a_window_past_the_context_and_sinks_at_minus_1e30_change_no_bit(path, dtypes):
    q_dtype, cache_dtype = DTYPES[dtypes]
    base = _pool(cache_dtype)
    plain = run_pass(path, _clone(base), ALL, q_dtype)
    past = run_pass(path, _clone(base), ALL, q_dtype, window=max(s.context for s in SEQS))
    silent = run_pass(path, _clone(base), ALL, q_dtype, sinks=torch.full((H_Q,), -1e30))
    assert torch.equal(past, plain) and torch.equal(silent, plain)


@INVARIANT
@pytest.mark.parametrize("dtypes", ["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("window", [3, 17])
def test_a_row_is_the_same_alone_and_in_a_batch(path, dtypes, window):
    q_dtype, cache_dtype = DTYPES[dtypes]
    base = _pool(cache_dtype)
    together = run_pass(path, _clone(base), ALL, q_dtype, window, SINKS)
    start = 0
    for item in ALL:
        alone = run_pass(path, _clone(base), [item], q_dtype, window, SINKS)
        assert torch.equal(alone, together[start:start + len(alone)]), f"sequence {item[0]}"
        start += len(alone)


@INVARIANT
@pytest.mark.parametrize("dtypes", ["fp32", "bf16", "fp8"])
def test_a_chunk_boundary_changes_no_bit(path, dtypes):
    """A 90-token prompt in one pass and in chunks of 23, 18, 49 (boundaries inside blocks and
    key tiles), beside a decode: each row's bits, under a window and sinks."""
    q_dtype, cache_dtype = DTYPES[dtypes]
    table = SEQS[0].table
    base = _pool(cache_dtype)
    whole = run_pass(path, _clone(base), [(0, Seq(table, 90))], q_dtype, 17, SINKS)
    cache, parts = _clone(base), []
    for first, end in ((0, 23), (23, 41), (41, 90)):
        parts.append(run_pass(path, cache, [(3, SEQS[3]), (0, Seq(table, end, first=first))], q_dtype, 17,
                              SINKS)[1:])
    assert torch.equal(torch.cat(parts), whole)


@INVARIANT
@pytest.mark.parametrize("dtypes", ["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("window", [2, 3, 17])
def test_a_tree_row_is_its_chain_under_a_window(path, dtypes, window):
    """Each tree row's bits are those of the causal row its path makes when stored as a chain
    (its keys at the positions the window counts): windows inside its path and reaching back
    into the context."""
    q_dtype, cache_dtype = DTYPES[dtypes]
    seq = SEQS[2]
    tree = seq.tree
    base = _pool(cache_dtype)
    cache = _clone(base)
    rows = run_pass(path, cache, [(2, seq)], q_dtype, window, SINKS)
    for r, tree_path in enumerate(tree.paths):
        chain = _clone(cache)                       # the path's keys and values moved to context, context + 1, ..
        for pool in (chain.k, chain.v, chain.k_scale, chain.v_scale):
            if pool is not None:
                flat = (pool.view(torch.uint8) if pool.dtype == FP8_DTYPE else pool).flatten(0, 1)
                chain_slots = [_slot(seq, tree.context + d) for d in range(len(tree_path))]
                flat[chain_slots] = flat[[_slot(seq, i) for i in tree_path]]
        end = tree.context + len(tree_path)
        q = _new_rows(2, tree.indices[r], q_dtype)[0]
        meta = prepare(path, torch.tensor([end - 1]), torch.tensor([_slot(seq, end - 1)]),
                       [SeqSlice(0, 1, seq.table, end)], BS, H_Q // H_KV)
        out = attend_cached(path, q[None], chain, meta, window, SINKS)     # its key is in place already
        assert torch.equal(out[0], rows[r]), f"row {r} (path {tree_path})"


def _whole(layer):
    """A one-layer pool as the graph's attention op takes it (attention_op.graph_pass reads these)."""
    def whole(t):
        return None if t is None else t[None]
    return types.SimpleNamespace(k=whole(layer.k), v=whole(layer.v), k_scale=whole(layer.k_scale),
                                 v_scale=whole(layer.v_scale), rotated=False, dtype=layer.k.dtype)


def test_the_compiled_steps_op_takes_the_window_and_sinks():
    """workbench::paged_attention, the graph's Python op: its schema declares the pool it writes,
    and its result (eager, and traced by torch.compile through its fake), with the pass rebuilt
    from its rows as tensors (causal and tree rows), is attention()'s, window and sinks too, and
    the new keys land in the same slots."""
    schema = str(attention_op.python_op._schema)
    assert "Tensor(a!) k_pool, Tensor(b!) v_pool" in schema and "int window, Tensor? sinks" in schema
    base = _pool(torch.float32)
    for window, sinks in ((3, SINKS), (0, None)):
        stored = _clone(base)
        want = run_pass(TORCH, stored, ALL, torch.float32, window, sinks)
        q, k, v, meta = pass_inputs(TORCH, ALL, torch.float32)
        step = torch.compile(lambda q, k, v, graph, sinks: attention_op.paged_attention(q, k, v, graph, 0, SCALE,
                                                                                        window, sinks) * 1,
                             backend="eager", fullgraph=True)
        for compiled in (False, True):
            pool = _clone(base)
            graph = attention_op.graph_pass(_whole(pool), meta)
            assert not graph.native and graph.mode == TORCH
            got = (step(q, k, v, graph, sinks) if compiled else
                   attention_op.paged_attention(q, k, v, graph, 0, SCALE, window, sinks))
            assert torch.equal(got, want)
            assert torch.equal(pool.k, stored.k) and torch.equal(pool.v, stored.v)
