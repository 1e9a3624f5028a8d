"""The batched decode kernel (engine.kernels.paged_attention.paged_decode_attention: [B] lengths,
a [B, max_blocks] table) in the Triton interpreter, and the engine's kernels path that launches
it once per layer for a pass of decode (or verify) rows.

- it equals the torch reference (engine.layers.attention.paged_attention_ref) on mixed lengths,
  over fp32, bf16 and FP8 (E4M3 with per-token scales) pools, with split-K partitions merged in
  more than one of the merge's steps;
- padded rows, as a captured batch size pads a batch (length 1 on a scratch block, or 0), change
  no bit of the real rows, read nothing of the pool but their scratch key, and come out finite;
- a sequence's output is bitwise the same alone and in a batch of 8, whatever else the batch
  holds (longer contexts: more partitions in the grid; sinks; one partition or several);
- the engine's kernels pass of S decode sequences is one attention launch per layer (and one
  store), equals the torch path, and gives each sequence the bits it gets alone.

Small shapes (2 KV heads, head_dim 32, contexts of at most 300 keys, partitions of 16 keys in
the kernel's own tests) keep the interpreter's runs to seconds. Outputs and split-K work
buffers start as NaN (see test_kernels).
"""
import os
import types

os.environ.setdefault("TRITON_INTERPRET", "1")          # before triton is imported (see test_kernels)

import pytest
import torch

pytest.importorskip("triton")

from engine.cache.kv_cache import FP8_DTYPE  # noqa: E402
from engine.kernels import dispatch, paged_attention as pa  # noqa: E402
from engine.layers.attention import KERNELS, TORCH, SeqSlice, attention, prepare, store_kv  # noqa: E402
from tests.test_kernels import FP8_TOL, FP32_TOL, build_batch, poisoned_cache, reference_batch  # noqa: E402

pytestmark = pytest.mark.skipif(not dispatch.kernels_available("cpu"),
                                reason="needs TRITON_INTERPRET=1 for Triton kernels on CPU")

H_KV, GROUP, D = 2, 2, 32
PARTITION, BLOCK_N = 16, 16
# (q dtype, pool dtype): tolerance against the reference
POOLS = {"fp32": (torch.float32, torch.float32, FP32_TOL), "bf16": (torch.bfloat16, torch.bfloat16, 2e-2),
         "fp8": (torch.float32, FP8_DTYPE, FP8_TOL), "bf16-fp8": (torch.bfloat16, FP8_DTYPE, 2e-2)}
LENGTHS = [3, 67, 16, 17, 40, 1, 90, 33]      # one partition, several, a partition's edge, one key
SINKS = torch.randn(H_KV * GROUP, generator=torch.Generator().manual_seed(4)) * 2


@pytest.fixture(autouse=True)
def nan_outputs(monkeypatch):
    monkeypatch.setattr(pa, "_empty", lambda *shape, dtype, device: torch.full(shape, float("nan"),
                                                                              dtype=dtype, device=device))


def decode(q, cache, tables, lengths, sinks=None, partition=PARTITION):
    return pa.paged_decode_attention(q, cache, tables, lengths, D ** -0.5, max_context_len=max(int(lengths.max()), 1),
                                     partition_size=partition, block_n=BLOCK_N, sinks=sinks)


def batch_of(lengths, pool, num_queries=1):
    q_dtype, cache_dtype, _ = POOLS[pool]
    return build_batch(lengths, num_queries, num_kv_heads=H_KV, group=GROUP, head_dim=D, cache_dtype=cache_dtype,
                       q_dtype=q_dtype, num_blocks=sum(-(-n // 4) for n in lengths) + 16)


@pytest.mark.parametrize("pool,num_queries", [(pool, 1) for pool in POOLS] + [("fp32", 3), ("bf16-fp8", 3)])
def test_the_batched_kernel_equals_the_reference_on_mixed_lengths(pool, num_queries):
    cache, tables, lengths, q = batch_of([max(n, num_queries) for n in LENGTHS], pool, num_queries)
    out = decode(q, cache, tables, lengths)
    tol = POOLS[pool][2]
    torch.testing.assert_close(out.float(), reference_batch(q.float(), cache, tables, lengths), atol=tol, rtol=tol)


@pytest.mark.parametrize("sinks", [None, SINKS])
def test_a_row_merged_over_more_partitions_than_one_merge_step_reads(sinks):
    """290 keys in partitions of 16: 19 partitions, two of the merge's MERGE_BLOCK_P steps."""
    assert -(-290 // PARTITION) > pa.MERGE_BLOCK_P
    cache, tables, lengths, q = batch_of([290, 5], "fp32")
    out = decode(q, cache, tables, lengths, sinks)
    ref = reference_batch(q, cache, tables, lengths, sinks=sinks)
    torch.testing.assert_close(out, ref, atol=FP32_TOL, rtol=FP32_TOL)


@pytest.mark.parametrize("pool", ["fp32", "fp8"])
def test_padded_rows_change_no_real_row_and_read_only_their_scratch_key(pool):
    """A batch padded up to a captured size: the padded rows have length 1 (on a scratch block)
    or 0. The real rows' bits are those of the unpadded batch; a length-1 row's output is its
    scratch key's value, a length-0 row's zeros; the rest of the pool (NaN) is never read."""
    cache, tables, lengths, q = batch_of([37, 9, 67], pool)
    real = decode(q, cache, tables, lengths)
    scratch = cache.k.shape[0] - 1                          # never written by build_batch: NaN but one slot
    store_kv(cache, torch.ones(1, H_KV, D), torch.full((1, H_KV, D), 0.5), torch.tensor([scratch * 4]))
    pad_tables = torch.full((2, tables.shape[1]), scratch, dtype=tables.dtype)
    pad_q = torch.randn(2, 1, H_KV * GROUP, D).to(q.dtype)
    padded = decode(torch.cat([q, pad_q]), cache, torch.cat([tables, pad_tables]),
                    torch.cat([lengths, torch.tensor([1, 0], dtype=lengths.dtype)]))
    assert torch.equal(padded[:3], real)
    torch.testing.assert_close(padded[3].float(), torch.full_like(padded[3].float(), 0.5))   # one key: its value
    assert torch.equal(padded[4].float(), torch.zeros_like(padded[4].float()))       # no key: zeros


@pytest.mark.parametrize("pool,sinks,num_queries", [("fp32", SINKS, 1), ("fp8", None, 1), ("bf16", SINKS, 4),
                                                    ("bf16-fp8", SINKS, 4)])
def test_a_sequence_gets_the_same_bits_alone_and_in_a_batch_of_8(pool, sinks, num_queries):
    """The partition size is fixed; the batch's longest context only widens the grid. A short
    sequence alone is written by the first kernel in one partition (no merge launched at all),
    in the batch beside 90-key ones the merge kernel runs: its bits do not change."""
    cache, tables, lengths, q = batch_of([max(n, num_queries) for n in LENGTHS], pool, num_queries)
    together = decode(q, cache, tables, lengths, sinks)
    for b, n in enumerate(lengths.tolist()):
        alone = decode(q[b:b + 1], cache, tables[b:b + 1, :-(-n // 4)], lengths[b:b + 1], sinks)
        assert torch.equal(alone[0], together[b]), f"sequence {b} ({n} keys) differs alone and in the batch"


# --------------------------------------------------------------------------- the engine's kernels path

def decode_pass(lengths, mode, num_queries=1, cache_dtype=torch.float32, sequences=None, graph_op=False):
    """A pass of `num_queries` new rows per sequence after lengths[b] - num_queries cached ones,
    through engine.layers.attention in `mode` (graph_op: through the compiled graph's op for a
    uniform pass, its tables as wide as a step's buffers): (out [N, H_q, D], the pool after it)."""
    torch.manual_seed(3)
    sequences = range(len(lengths)) if sequences is None else sequences
    cache = poisoned_cache(8 * 80, 4, H_KV, D, cache_dtype)
    tables = [torch.arange(80) * 8 + b for b in range(8)]          # interleaved blocks, 8 sequences at most
    qkv = [torch.randn(3, n, H_KV * GROUP, D) for n in lengths]    # every token's q, k, v (k, v: first H_KV heads)
    seqs, positions, slots, q, k, v = [], [], [], [], [], []
    for b in sequences:
        n, table = lengths[b], tables[b]
        pos = torch.arange(n)
        slot = table[pos // 4] * 4 + pos % 4
        store_kv(cache, qkv[b][1, :n - num_queries, :H_KV], qkv[b][2, :n - num_queries, :H_KV], slot[:n - num_queries])
        seqs.append(SeqSlice(num_queries * len(seqs), num_queries, table[:-(-n // 4)], n))
        positions.append(pos[n - num_queries:])
        slots.append(slot[n - num_queries:])
        q.append(qkv[b][0, n - num_queries:])
        k.append(qkv[b][1, n - num_queries:, :H_KV])
        v.append(qkv[b][2, n - num_queries:, :H_KV])
    meta = prepare(mode, torch.cat(positions), torch.cat(slots), seqs, 4, GROUP)
    if graph_op:
        from engine.layers import attention_op
        whole = types.SimpleNamespace(rotated=False, dtype=cache.k.dtype, **{
            name: None if getattr(cache, name) is None else getattr(cache, name)[None]
            for name in ("k", "v", "k_scale", "v_scale")})
        graph = attention_op.graph_pass(whole, meta)
        wide = torch.zeros(len(seqs), 80, dtype=torch.int64)
        wide[:, :graph.tables.shape[1]] = graph.tables
        graph = graph._replace(tables=wide, uniform=num_queries)
        return attention_op.paged_attention(torch.cat(q), torch.cat(k), torch.cat(v), graph, 0, D ** -0.5, 0,
                                            None), cache
    out = attention(torch.cat(q), torch.cat(k), torch.cat(v), cache, meta, D ** -0.5)
    return out, cache


@pytest.fixture
def launches(monkeypatch):
    """How many attention kernel launches (with their split-K merge, where a context spans
    several partitions) and stores the kernels path makes."""
    counts = {"attention": 0, "store": 0}

    def counted(name, fn):
        def call(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return call
    monkeypatch.setattr(dispatch, "paged_attention", counted("attention", dispatch.paged_attention))
    monkeypatch.setattr(dispatch, "paged_prefill_attention", counted("attention", dispatch.paged_prefill_attention))
    monkeypatch.setattr(dispatch, "store_kv", counted("store", dispatch.store_kv))
    return counts


@pytest.mark.parametrize("num_queries,cache_dtype", [(1, torch.float32), (1, FP8_DTYPE), (4, torch.float32)])
def test_a_decode_pass_of_8_sequences_is_one_launch_and_equals_the_torch_path(launches, num_queries, cache_dtype):
    lengths = [5, 40, 1 + num_queries, 300, 17, 64, 9, 33]
    out, cache = decode_pass(lengths, KERNELS, num_queries, cache_dtype)
    assert launches == {"attention": 1, "store": 1}
    ref, ref_cache = decode_pass(lengths, TORCH, num_queries, cache_dtype)
    tol = FP8_TOL if cache_dtype == FP8_DTYPE else FP32_TOL
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    for ours, theirs in zip((cache.k, cache.v), (ref_cache.k, ref_cache.v)):
        assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))      # the same bytes stored


@pytest.mark.parametrize("num_queries,cache_dtype", [(1, FP8_DTYPE), (4, torch.float32)])
def test_the_graphs_uniform_op_gives_the_kernels_paths_bits(launches, num_queries, cache_dtype):
    """workbench::uniform_attention, a uniform pass in the compiled graph (its rows as tensors,
    the split-K grid sized by the tables' width, nothing read on the host): the kernels path's
    bits out and bytes stored, in one store and one launch."""
    lengths = [5, 40, 1 + num_queries, 300, 17, 64, 9, 33]
    want, want_cache = decode_pass(lengths, KERNELS, num_queries, cache_dtype)
    launches.update(attention=0, store=0)
    got, cache = decode_pass(lengths, KERNELS, num_queries, cache_dtype, graph_op=True)
    assert launches == {"attention": 1, "store": 1}
    assert torch.equal(got, want)
    for ours, theirs in zip((cache.k, cache.v), (want_cache.k, want_cache.v)):
        assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))


def test_each_sequence_of_the_pass_gets_its_bits_alone(launches):
    lengths = [5, 40, 2, 300, 17, 64, 9, 33]
    together, _ = decode_pass(lengths, KERNELS)
    for b in range(len(lengths)):
        alone, _ = decode_pass(lengths, KERNELS, sequences=[b])
        assert torch.equal(alone[0], together[b]), f"sequence {b} differs alone and in the pass"


def test_a_mixed_pass_batches_its_decodes_and_launches_the_rest_alone(launches):
    """Decodes beside a prefill chunk: one launch for the decodes, one for the chunk."""
    torch.manual_seed(5)
    cache = poisoned_cache(64, 4, H_KV, D, torch.float32)
    chunk, decodes = 20, [9, 30, 14]
    tables = [torch.arange(16) + 16 * b for b in range(4)]
    seqs, positions, slots, start = [], [], [], 0
    for b, (n, new) in enumerate([(n, 1) for n in decodes] + [(chunk, chunk)]):
        pos = torch.arange(n)
        slot = tables[b][pos // 4] * 4 + pos % 4
        old = torch.randn(2, n - new, H_KV, D)
        store_kv(cache, old[0], old[1], slot[:n - new])
        seqs.append(SeqSlice(start, new, tables[b][:-(-n // 4)], n))
        positions.append(pos[n - new:])
        slots.append(slot[n - new:])
        start += new
    q, k, v = torch.randn(start, H_KV * GROUP, D), torch.randn(start, H_KV, D), torch.randn(start, H_KV, D)
    outs = []
    for mode in (KERNELS, TORCH):
        pool = poisoned_cache(64, 4, H_KV, D, torch.float32)
        pool.k.copy_(cache.k), pool.v.copy_(cache.v)
        meta = prepare(mode, torch.cat(positions), torch.cat(slots), seqs, 4, GROUP)
        outs.append(attention(q, k, v, pool, meta, D ** -0.5))
    assert launches == {"attention": 2, "store": 1}
    torch.testing.assert_close(outs[0], outs[1], atol=FP32_TOL, rtol=FP32_TOL)


def test_the_model_decodes_a_batch_with_one_launch_per_layer_and_each_sequence_its_alone_logits(tmp_path, launches):
    """The runner's batched decode pass (4 sequences, an FP8 pool) through the kernels: one
    attention launch per layer, and each sequence's logits are the ones it gets in a pass alone."""
    from engine.config import EngineConfig
    from engine.loading.loader import load_model
    from engine.runtime.model_runner import ModelRunner, PassItem
    from tests.test_models import ARCHS, _save_tiny
    _save_tiny(tmp_path, ARCHS["qwen3"])
    loaded = load_model(str(tmp_path))
    runner = ModelRunner(loaded, EngineConfig(block_size=4, num_blocks=32, kv_cache_dtype="fp8_e4m3",
                                              attention_backend="triton", compile="off"), torch.device("cpu"))
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    prompts = [ids[:5], ids[5:14], ids[14:17], ids[17:40]]
    seqs = [runner.start(p, reserve_tokens=1) for p in prompts]
    for seq, prompt in zip(seqs, prompts):
        runner.forward(seq, prompt)
    launches.update(attention=0, store=0)
    together = runner.forward_batch([PassItem(seq, [7]) for seq in seqs])
    layers = len(loaded.model.layers)
    assert launches == {"attention": layers, "store": layers}
    for b in (0, 3):                        # the shortest context and the longest
        runner.rollback(seqs[b], len(prompts[b]))
        (alone, _), = runner.forward_batch([PassItem(seqs[b], [7])])
        assert torch.equal(alone, together[b][0])
