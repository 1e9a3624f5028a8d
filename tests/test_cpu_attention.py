"""Our CPU paged attention (engine.kernels.cpu_attention), the compiled step's attention op:
against a float64 reference in fp32, bf16 and FP8, causal and tree rows, GQA groups and
block sizes, with sliding windows and sinks (keys before a window are never read); the AVX2
build gives the baseline build's bits; a row's result is the same alone or among others, and
a tree row's is its chain's; the engine says which path attends. (tests/test_attention_window
checks every attention path against one dense reference.)"""
import random

import pytest
import torch

from engine.cache.kv_cache import FP8_DTYPE, CacheShape, KVCache
from engine.kernels import cpu_attention
from engine.kernels.cpu_attention import PassRows, reference
from engine.layers.attention import store_kv
from tests.conftest import forced_fallback
from tests.kernels_required import every_test_needs

_needs_kernel = every_test_needs(cpu_attention.refusal, "our CPU attention")


def _cache(dtype, num_kv_heads, head_dim, block_size, num_blocks=12, seed=0):
    cache = KVCache(CacheShape(1, num_kv_heads, head_dim), num_blocks, block_size, dtype, torch.device("cpu")).layer(0)
    gen = torch.Generator().manual_seed(seed)
    n = num_blocks * block_size
    k = torch.randn(n, num_kv_heads, head_dim, generator=gen) * 2
    v = torch.randn(n, num_kv_heads, head_dim, generator=gen)
    store_kv(cache, k.to(torch.float32 if dtype == FP8_DTYPE else dtype), v.to(torch.float32 if dtype == FP8_DTYPE
                                                                              else dtype), torch.arange(n))
    return cache


def _rows(num_blocks: int, block_size: int, seed=0) -> PassRows:
    """Three sequences over a shuffled pool: causal rows of each, and two tree rows of the last."""
    rng = random.Random(seed)
    blocks = list(range(num_blocks))
    rng.shuffle(blocks)
    width = num_blocks // 3
    tables = torch.tensor([blocks[i * width:(i + 1) * width] for i in range(3)])
    capacity = width * block_size
    row_seq = [0, 0, 1, 2, 2, 2, 2]
    prefix = [1, capacity // 2, capacity, 3, min(17, capacity - 1), capacity - 6, capacity - 6]
    extra = [capacity - 5, capacity - 3, capacity - 5, capacity - 4, capacity - 2]      # two paths of the tree
    starts = [0, 0, 0, 0, 0, 0, 2, 5]
    return PassRows(tables, torch.tensor(row_seq), torch.tensor(prefix), torch.tensor(starts), torch.tensor(extra))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, FP8_DTYPE], ids=["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("heads,head_dim,block_size", [((4, 4), 64, 16), ((9, 3), 64, 16), ((8, 2), 128, 4),
                                                       ((6, 1), 8, 2)])
def test_the_kernel_is_the_reference_arithmetic(dtype, heads, head_dim, block_size):
    num_q_heads, num_kv_heads = heads
    cache = _cache(dtype, num_kv_heads, head_dim, block_size)
    rows = _rows(12, block_size)
    q_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    q = torch.randn(7, num_q_heads, head_dim, generator=torch.Generator().manual_seed(1)).to(q_dtype)
    got = cpu_attention.attend(q, cache, rows, head_dim ** -0.5)
    want = reference(q, cache, rows, head_dim ** -0.5)
    tolerance = 1e-5 if q_dtype == torch.float32 else 8e-3
    torch.testing.assert_close(got.double(), want.double(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, FP8_DTYPE], ids=["fp32", "bf16", "fp8"])
def test_avx2_and_baseline_builds_give_the_same_bits(dtype):
    from engine import cpu_features
    if not all(f in cpu_features.flags() for f in cpu_attention.NEEDS["avx2"]):
        pytest.skip("no AVX2 on this CPU")
    cache = _cache(dtype, 3, 64, 16)
    rows = _rows(12, 16)
    q = torch.randn(7, 9, 64).to(torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
    a = cpu_attention._call(q, cache, rows, 0.125, cpu_attention.ISAS["avx2"])
    b = cpu_attention._call(q, cache, rows, 0.125, cpu_attention.ISAS["scalar"])
    assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, FP8_DTYPE], ids=["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("window", [1, 3, 17])
def test_a_window_and_sinks_are_the_reference_arithmetic_on_both_builds(dtype, window):
    """A row's last `window` keys (a tree row's: its path's last, then the context's) and one
    sink logit per query head, on each build, the same bits on both."""
    from engine import cpu_features
    cache = _cache(dtype, 3, 64, 16)
    rows = _rows(12, 16)
    q_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    q = torch.randn(7, 9, 64, generator=torch.Generator().manual_seed(2)).to(q_dtype)
    sinks = torch.randn(9, generator=torch.Generator().manual_seed(3)) * 2
    isas = [isa for isa in cpu_attention.ISAS if all(f in cpu_features.flags() for f in cpu_attention.NEEDS[isa])]
    tolerance = 1e-5 if q_dtype == torch.float32 else 8e-3
    for row_sinks in (None, sinks):
        want = reference(q, cache, rows, 0.125, window, row_sinks)
        got = [cpu_attention._call(q, cache, rows, 0.125, cpu_attention.ISAS[isa], window, row_sinks) for isa in isas]
        torch.testing.assert_close(got[0].double(), want.double(), atol=tolerance, rtol=tolerance)
        assert all(torch.equal(g, got[0]) for g in got[1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, FP8_DTYPE], ids=["fp32", "bf16", "fp8"])
def test_keys_before_the_window_are_never_read(dtype):
    """The kernel starts at the window's first key: NaN in the keys and values before it
    changes no bit, for a causal row and a tree row whose window reaches back into the context."""
    cache = _cache(dtype, 3, 64, 16)
    table = torch.tensor([4, 9, 2, 7])
    # row 0: position 39, sees 23..39; row 1: context 30 then its path 33, 35, 38: sees 16..29 and its path
    rows = PassRows(table[None], torch.zeros(2, dtype=torch.int64), torch.tensor([40, 30]), torch.tensor([0, 0, 3]),
                    torch.tensor([33, 35, 38]))
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 9, 64, generator=gen).to(torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
    sinks = torch.randn(9, generator=gen)
    clean = cpu_attention.attend(q, cache, rows, 0.125, 17, sinks)

    def poison(indices):
        for pool in (cache.k, cache.v):
            flat = (pool.view(torch.uint8) if pool.dtype == FP8_DTYPE else pool).flatten(0, 1)
            for index in indices:
                flat[table[index // 16] * 16 + index % 16] = 0x7F if pool.dtype == FP8_DTYPE else float("nan")
    poison(range(16))
    assert torch.equal(cpu_attention.attend(q, cache, rows, 0.125, 17, sinks), clean)
    poison(range(16, 23))
    poisoned = cpu_attention.attend(q, cache, rows, 0.125, 17, sinks)
    assert torch.equal(poisoned[0], clean[0]) and poisoned[1].isnan().all()     # row 1 reads 16..22


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, FP8_DTYPE], ids=["fp32", "bf16", "fp8"])
def test_a_row_is_the_same_alone_and_a_tree_row_is_its_chain(dtype):
    cache = _cache(dtype, 3, 64, 16)
    rows = _rows(12, 16)
    q = torch.randn(7, 9, 64).to(torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
    together = cpu_attention.attend(q, cache, rows, 0.125)
    for r in range(7):
        e0, e1 = rows.extra_start[r], rows.extra_start[r + 1]
        alone = PassRows(rows.tables[rows.row_seq[r]][None], torch.zeros(1, dtype=torch.int64), rows.prefix[r:r + 1],
                         torch.tensor([0, int(e1 - e0)]), rows.extra_keys[e0:e1] if e1 > e0 else torch.zeros(1).long())
        assert torch.equal(cpu_attention.attend(q[r:r + 1], cache, alone, 0.125)[0], together[r])
    # Row 5 sees the context then cache indices c-5, c-3; a chain stored there in that order
    # (the same keys, the same order) is the causal row at position c-3 over a copy whose
    # indices c-6.. hold them: the same bits.
    capacity = 4 * 16
    chain = KVCache(CacheShape(1, 3, 64), 12, 16, cache.k.dtype, torch.device("cpu")).layer(0)
    for pool, src in ((chain.k, cache.k), (chain.v, cache.v), (chain.k_scale, cache.k_scale), (chain.v_scale, cache.v_scale)):
        if pool is None:
            continue
        raw, raw_src = (pool.view(torch.uint8), src.view(torch.uint8)) if pool.dtype == FP8_DTYPE else (pool, src)
        raw.copy_(raw_src)
        table = rows.tables[2]
        flat, flat_src = raw.flatten(0, 1), raw_src.flatten(0, 1)
        for dst_index, src_index in ((capacity - 6, capacity - 5), (capacity - 5, capacity - 3)):
            flat[table[dst_index // 16] * 16 + dst_index % 16] = flat_src[table[src_index // 16] * 16 + src_index % 16]
    causal = PassRows(rows.tables[2][None], torch.zeros(1, dtype=torch.int64), torch.tensor([capacity - 4]),
                      torch.tensor([0, 0]), torch.zeros(1, dtype=torch.int64))
    assert torch.equal(cpu_attention.attend(q[5:6], chain, causal, 0.125)[0], together[5])


def test_the_engine_says_which_path_attends(make_tiny_engine):
    compiled, eager = make_tiny_engine(compile="on"), make_tiny_engine(compile="off")
    assert compiled.settings()["paths"]["attention"].startswith(f"ours ({cpu_attention.isa()})")
    assert (compiled.runner.attention_mode, eager.runner.attention_mode) == ("cpu", "torch")
    assert eager.settings()["paths"]["attention"].startswith("torch (")
    with forced_fallback("attention-refused"):
        refused = make_tiny_engine(compile="on")
        assert refused.settings()["paths"]["attention"] == "torch (our CPU attention refused (forced by a test))"
        assert refused.runner.attention_mode == "torch" and refused.runner.compiled is not None


@pytest.mark.parametrize("kv_dtype,q_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                              (torch.float32, torch.bfloat16), (FP8_DTYPE, torch.bfloat16),
                                              (FP8_DTYPE, torch.float32)],
                         ids=["fp32", "bf16", "bf16-into-fp32", "fp8-from-bf16", "fp8-from-fp32"])
@pytest.mark.parametrize("window,with_sinks", [(0, False), (5, True)])
def test_the_compiled_steps_layer_op_stores_and_attends_as_the_python_op(kv_dtype, q_dtype, window, with_sinks):
    """workbench_cpu::attend_layer (the graph's call: the whole pool, the layer and the pass's rows
    as arguments) against the Python op it stands in for: the same output bits, padding rows repeating the
    last, and the same pool bytes and FP8 scales, in every pool dtype, a later layer of a
    two-layer pool, causal and tree rows, under a window with sinks."""
    from engine.layers import attention_op
    from engine.layers.attention import CPU, SeqSlice, TreeRows, prepare
    gen = torch.Generator().manual_seed(3)
    shape, block_size = CacheShape(2, 3, 64), 4
    pools = [KVCache(shape, 10, block_size, kv_dtype, torch.device("cpu")) for _ in range(2)]
    history = torch.randn(2, 2, 40, 3, 64, generator=gen)         # [k/v, layer, slots, H_kv, D]
    for pool in pools:
        for layer in range(2):
            store_kv(pool.layer(layer), history[0, layer].to(q_dtype), history[1, layer].to(q_dtype), torch.arange(40))
    table_a, table_b = torch.tensor([3, 7, 1, 0]), torch.tensor([2, 5, 9, 8, 6])
    # sequence a: 2 new rows at 9, 10; sequence b: a tree of two paths over a context of 14
    seqs = [SeqSlice(start=0, count=2, context_len=11, block_table=table_a),
            SeqSlice(start=2, count=2, context_len=16, block_table=table_b,
                     tree=TreeRows(context=14, paths=[[14], [15]], indices=[14, 15]))]
    positions = torch.tensor([9, 10, 14, 14])
    slots = torch.tensor([int(table_a[p // block_size]) * block_size + p % block_size for p in (9, 10)] +
                         [int(table_b[i // block_size]) * block_size + i % block_size for i in (14, 15)])
    q = torch.randn(5, 9, 64, generator=gen).to(q_dtype)          # 4 rows and one padding row
    k, v = (torch.randn(5, 3, 64, generator=gen).to(q_dtype) for _ in range(2))
    sinks = torch.randn(9, generator=gen) if with_sinks else None
    outs = []
    for pool, native in zip(pools, (False, True)):
        graph = attention_op.graph_pass(pool, prepare(CPU, positions, slots, seqs, block_size, 3), native)
        assert graph.native == native
        outs.append(attention_op.paged_attention(q, k, v, graph, 1, 0.125, window, sinks))
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[1][4], outs[1][3])
    for got, want in ((pools[1].k, pools[0].k), (pools[1].v, pools[0].v), (pools[1].k_scale, pools[0].k_scale),
                      (pools[1].v_scale, pools[0].v_scale)):
        if want is not None:
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, FP8_DTYPE], ids=["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("window", [0, 5, 40])
def test_a_verify_passs_rows_read_their_shared_keys_once_with_each_rows_bits_alone(dtype, window):
    """A verify pass's k + 1 rows of one sequence (positions c .. c + k) are attended together,
    each shared key and value read once for all of them: every row's bits are the ones it gets
    alone, with a window (some rows' windows start inside the shared keys) and sinks, on
    every thread count."""
    cache = _cache(dtype, 3, 64, 16)
    table = torch.tensor([[4, 9, 2, 7, 11, 0]])
    context, k = 70, 8
    prefix = torch.arange(context + 1, context + k + 2)
    rows = PassRows(table, torch.zeros(k + 1, dtype=torch.int64), prefix, torch.zeros(k + 2, dtype=torch.int64),
                    torch.zeros(1, dtype=torch.int64))
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(k + 1, 9, 64, generator=gen).to(torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
    sinks = torch.randn(9, generator=gen)
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, threads):
            torch.set_num_threads(n_threads)
            together = cpu_attention.attend(q, cache, rows, 0.125, window, sinks)
            for r in range(k + 1):
                alone = PassRows(table, torch.zeros(1, dtype=torch.int64), prefix[r:r + 1], torch.zeros(2, dtype=torch.int64),
                                 torch.zeros(1, dtype=torch.int64))
                assert torch.equal(cpu_attention.attend(q[r:r + 1], cache, alone, 0.125, window, sinks)[0], together[r]), r
    finally:
        torch.set_num_threads(threads)
    want = reference(q, cache, rows, 0.125, window, sinks)
    tolerance = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(together.double(), want.double(), atol=tolerance, rtol=tolerance)
