"""Triton kernels against the torch reference in engine/layers/attention.py, run by the Triton
interpreter on CPU (TRITON_INTERPRET=1, set before triton is imported).

Error bounds: an fp32 cache agrees with the reference to ~1e-6 (differences are float32
summation order only); the tests allow 1e-4. With an FP8 cache both sides read the SAME
fp8 bytes and scales, so the only difference is where the scale is applied (the kernel
folds it into the scores/probabilities): bound 1e-3. Stores are compared bit for bit.

Every run starts from NaN: cache slots the test never writes (holes, padding blocks) hold
NaN (FP8: byte 0x7F, a NaN) and NaN scales, outputs and split-K work buffers are NaN-filled,
so a kernel that reads what it must not, or leaves an output element unwritten, fails.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses

import pytest
import torch

triton = pytest.importorskip("triton")

import triton.language as tl  # noqa: E402

from engine.cache.kv_cache import FP8_DTYPE, LayerCache  # noqa: E402
from engine.kernels import dispatch, paged_attention as pa  # noqa: E402
from engine.kernels.fp8 import e4m3_decode_div256, e4m3_encode  # noqa: E402
from engine.kernels.store import store_kv as store_kv_kernel  # noqa: E402
from engine.layers.attention import SeqSlice, attention, paged_attention_ref, prepare, store_kv  # noqa: E402

pytestmark = pytest.mark.skipif(not dispatch.kernels_available("cpu"),
                                reason="needs TRITON_INTERPRET=1 for Triton kernels on CPU")

NAN_FP8_BYTE = 0x7F
FP32_TOL = 1e-4
FP8_TOL = 1e-3


def poisoned_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                   dtype: torch.dtype) -> LayerCache:
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if dtype != FP8_DTYPE:
        return LayerCache(torch.full(shape, float("nan"), dtype=dtype),
                          torch.full(shape, float("nan"), dtype=dtype), None, None)
    values = [torch.full(shape, NAN_FP8_BYTE, dtype=torch.uint8).view(FP8_DTYPE) for _ in range(2)]
    scales = [torch.full(shape[:-1], float("nan")) for _ in range(2)]
    return LayerCache(*values, *scales)


def clone_cache(c: LayerCache) -> LayerCache:
    return LayerCache(*(None if t is None else t.clone() for t in (c.k, c.v, c.k_scale, c.v_scale)), c.rotated)


def assert_caches_identical(a: LayerCache, b: LayerCache) -> None:
    """Bit for bit (FP8 compared as bytes), NaN poison included."""
    for x, y in zip((a.k, a.v, a.k_scale, a.v_scale), (b.k, b.v, b.k_scale, b.v_scale)):
        assert (x is None) == (y is None)
        if x is not None:
            if x.dtype == FP8_DTYPE:
                x, y = x.view(torch.uint8), y.view(torch.uint8)
            torch.testing.assert_close(x, y, atol=0, rtol=0, equal_nan=True)


@pytest.fixture(autouse=True)
def nan_outputs(monkeypatch):
    """Outputs, split-K partials and log-sum-exps start as NaN."""
    monkeypatch.setattr(pa, "_empty", lambda *shape, dtype, device: torch.full(shape, float("nan"),
                                                                              dtype=dtype, device=device))


# --------------------------------------------------------------------------- FP8 bits

@triton.jit
def _roundtrip_kernel(x_ptr, bits_ptr, decoded_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    bits = e4m3_encode(tl.load(x_ptr + offs))
    tl.store(bits_ptr + offs, bits)
    tl.store(decoded_ptr + offs, e4m3_decode_div256(bits).to(tl.float32) * 256.0)


def test_fp8_encode_decode_match_torch_bit_for_bit():
    """Every finite E4M3 value, the midpoints between neighbours (ties round to even), the
    floats just either side of them, and the subnormal range."""
    codes = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    grid = codes[codes.isfinite()].unique()                                     # sorted
    mids = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([grid, mids, torch.nextafter(mids, grid[1:]), torch.nextafter(mids, grid[:-1]),
                   torch.linspace(-2.0 ** -6, 2.0 ** -6, 257), torch.tensor([0.0, -0.0, 1e-30])])
    n = triton.next_power_of_2(x.numel())
    x = torch.cat([x, torch.zeros(n - x.numel())])
    bits, decoded = torch.empty(n, dtype=torch.uint8), torch.full((n,), float("nan"))
    _roundtrip_kernel[(1,)](x, bits, decoded, N=n)
    expected = x.to(FP8_DTYPE)
    assert torch.equal(bits, expected.view(torch.uint8))
    assert torch.equal(decoded, expected.float())


@triton.jit
def _count_kernel(out_ptr, n):
    total = 0
    for _ in range(0, n):          # a runtime bound: a scalar tensor in the interpreter
        total += 1
    tl.store(out_ptr, total)


def test_a_loop_with_a_runtime_bound_runs_where_the_interpreter_converts_scalars_with_int(monkeypatch):
    """triton 3.6's interpreter took int() of a one-element array for a loop bound, which numpy
    2.4 refuses, so every kernel with such a loop failed there; engine.kernels.mend_interpreter
    makes it take the element. Here 3.6's conversion is put back on this triton, then mended."""
    import numpy
    from triton.runtime import interpreter
    from engine.kernels import mend_interpreter
    if numpy.lib.NumpyVersion(numpy.__version__) < "2.4.0":
        pytest.skip("numpy < 2.4 converts a one-element array itself")
    patch_tensor = interpreter._patch_lang_tensor

    def as_in_triton_3_6(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))
    monkeypatch.setattr(interpreter, "_patch_lang_tensor", as_in_triton_3_6)
    out = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(Exception, match="0-dimensional"):
        _count_kernel[(1,)](out, 5)
    mend_interpreter()
    _count_kernel[(1,)](out, 5)
    assert out.item() == 5


# --------------------------------------------------------------------------- store

@pytest.mark.parametrize("cache_dtype,input_dtype", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32),
    (FP8_DTYPE, torch.float32), (FP8_DTYPE, torch.bfloat16)])
def test_store_writes_the_same_slots_and_bits_as_the_reference(cache_dtype, input_dtype):
    torch.manual_seed(0)
    num_kv_heads, head_dim = 3, 64
    k = torch.randn(7, num_kv_heads, head_dim) * torch.tensor([0.01, 1.0, 300.0])[:, None]
    v = torch.randn(7, num_kv_heads, head_dim)
    k[2] = 0.0   # all-zero head rows: FP8 scale clamps to 1e-12
    v = torch.randn(num_kv_heads, 7, head_dim).transpose(0, 1)   # strided, as a slice of a fused qkv
    k, v = k.to(input_dtype), v.to(input_dtype)
    slots = torch.tensor([13, 2, 3, 30, 31, 0, 17])      # out of order, across blocks
    ours = poisoned_cache(8, 4, num_kv_heads, head_dim, cache_dtype)
    ref = clone_cache(ours)
    store_kv_kernel(ours, k, v, slots)
    store_kv(ref, k, v, slots)
    assert_caches_identical(ours, ref)

    before = clone_cache(ours)   # a negative slot is padding: nothing is written
    store_kv_kernel(ours, k[:1] + 1, v[:1] + 1, torch.tensor([-1]))
    assert_caches_identical(ours, before)


# --------------------------------------------------------------------------- attention

def build_batch(context_lens, num_queries, num_kv_heads, group, head_dim, cache_dtype,
                q_dtype=torch.float32, block_size=4, num_blocks=40):
    """Sequences over a shared NaN-poisoned pool. Block tables are out of order with holes,
    sequence 1 reuses sequence 0's first block (a prefix-cache hit), and the padding past
    each table's end names a block that is never written."""
    torch.manual_seed(1)
    cache = poisoned_cache(num_blocks, block_size, num_kv_heads, head_dim, cache_dtype)
    free = torch.randperm(num_blocks - 1)[: num_blocks - 8].tolist()   # 7 holes; the last block is padding
    padding = num_blocks - 1
    max_blocks = max(-(-n // block_size) for n in context_lens)
    tables = torch.full((len(context_lens), max_blocks), padding, dtype=torch.int32)
    for b, n in enumerate(context_lens):
        for j in range(-(-n // block_size)):
            tables[b, j] = tables[0, 0] if (b == 1 and j == 0) else free.pop()
        slots = tables[b, torch.arange(n) // block_size].long() * block_size + torch.arange(n) % block_size
        kv = torch.randn(2, n, num_kv_heads, head_dim).to(q_dtype)
        store_kv(cache, kv[0], kv[1], slots)   # writes the shared block again: both read the same bytes
    q = torch.randn(len(context_lens), num_queries, num_kv_heads * group, head_dim).to(q_dtype)
    return cache, tables, torch.tensor(context_lens, dtype=torch.int32), q


def reference_batch(q, cache, tables, context_lens, window=0, sinks=None):
    num_queries = q.shape[1]
    outs = []
    for b, n in enumerate(context_lens.tolist()):
        positions = torch.arange(n - num_queries, n)
        meta = prepare("torch", positions, torch.empty(0), [SeqSlice(0, num_queries, tables[b].long(), n)],
                       cache.k.shape[1], q.shape[2] // cache.k.shape[2])
        outs.append(paged_attention_ref(q[b], cache, meta, q.shape[-1] ** -0.5, window, sinks))
    return torch.stack(outs)


@pytest.mark.parametrize("group,head_dim,fp8,num_queries,partition", [
    (1, 64, False, 1, 16),        # decode, MHA, 5 partitions on the longest sequence
    (3, 64, True, 4, 32),         # verification k=3, FP8, split-K
    (4, 128, False, 6, 16),       # verification k=5, split-K with partitions cut inside the Q window
    (8, 128, True, 1, 1024),      # decode, one partition (no merge kernel), FP8
    (8, 64, False, 9, 32),        # 72 query rows: two row chunks per KV head
])
def test_decode_attention_matches_reference(group, head_dim, fp8, num_queries, partition):
    cache_dtype = FP8_DTYPE if fp8 else torch.float32
    cache, tables, context_lens, q = build_batch([37, 9, 67], num_queries, num_kv_heads=2, group=group,
                                                 head_dim=head_dim, cache_dtype=cache_dtype)
    out = pa.paged_decode_attention(q, cache, tables, context_lens, head_dim ** -0.5, max_context_len=67,
                                    partition_size=partition, block_n=16)
    tol = FP8_TOL if fp8 else FP32_TOL
    torch.testing.assert_close(out, reference_batch(q, cache, tables, context_lens), atol=tol, rtol=tol)


@pytest.mark.parametrize("window,sinks,fp8,partition", [
    (3, True, False, 16),         # split-K: partitions wholly before every row's window are skipped
    (17, True, True, 16),         # FP8, a window across partitions, sinks in the merge
    (20, False, False, 32),       # a window alone
    (5, True, True, 1024),        # one partition: the sinks join in the first kernel
])
def test_decode_attention_with_a_window_and_sinks_matches_reference(window, sinks, fp8, partition):
    """Sliding windows and attention sinks (tests/test_attention_window.py checks the
    torch path against a dense reference): a skipped partition must still leave its merge
    weight zero (outputs start as NaN)."""
    cache, tables, context_lens, q = build_batch([37, 9, 67], 4, num_kv_heads=2, group=2, head_dim=64,
                                                 cache_dtype=FP8_DTYPE if fp8 else torch.float32)
    sink = torch.randn(4, generator=torch.Generator().manual_seed(4)) * 2 if sinks else None
    out = pa.paged_decode_attention(q, cache, tables, context_lens, 64 ** -0.5, max_context_len=67,
                                    partition_size=partition, block_n=16, window=window, sinks=sink)
    tol = FP8_TOL if fp8 else FP32_TOL
    torch.testing.assert_close(out, reference_batch(q, cache, tables, context_lens, window, sink), atol=tol, rtol=tol)


@pytest.mark.parametrize("fp8", [False, True])
def test_decode_attention_bf16_queries(fp8):
    """bf16 model: tiles go to tl.dot in bf16; the reference rounds dequantized FP8 to bf16
    where the kernel keeps the exact fp8 value, so compare at bf16 resolution."""
    cache, tables, context_lens, q = build_batch([21, 30], 2, num_kv_heads=2, group=4, head_dim=64,
                                                 cache_dtype=FP8_DTYPE if fp8 else torch.bfloat16,
                                                 q_dtype=torch.bfloat16)
    out = pa.paged_decode_attention(q, cache, tables, context_lens, 64 ** -0.5, max_context_len=30,
                                    partition_size=16, block_n=16)
    ref = reference_batch(q.float(), cache, tables, context_lens)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


# --------------------------------------------------------------------------- dispatch

def run_both(cache_dtype, cached, new, group=4, num_kv_heads=2, head_dim=64, block_size=4, rotated=False):
    """One forward step of `new` tokens after `cached` ones, through the kernels and through
    the reference, on identical NaN-poisoned caches: (out, ref_out, cache, ref_cache)."""
    torch.manual_seed(2)
    ctx = cached + new
    table = torch.tensor([9, 2, 14, 5, 11, 0, 7, 3, 12, 6, 1])[: -(-ctx // block_size)]
    slots = table[torch.arange(ctx) // block_size] * block_size + torch.arange(ctx) % block_size
    cache = dataclasses.replace(poisoned_cache(16, block_size, num_kv_heads, head_dim, cache_dtype), rotated=rotated)
    if cached:   # the prefix-cache hit: these tokens' K/V are already in the pool
        prefix_k, prefix_v = torch.randn(2, cached, num_kv_heads, head_dim)
        store_kv(cache, prefix_k, prefix_v, slots[:cached])
    ref_cache = clone_cache(cache)
    q = torch.randn(new, num_kv_heads * group, head_dim)
    k, v = torch.randn(2, new, num_kv_heads, head_dim)
    outs = []
    for use_kernels, c in ((True, cache), (False, ref_cache)):
        positions = torch.arange(cached, ctx)
        meta = prepare("kernels" if use_kernels else "torch", positions, slots[cached:], [SeqSlice(0, new, table, ctx)],
                       block_size, group)
        outs.append(attention(q, k, v, c, meta, head_dim ** -0.5))
    return outs[0], outs[1], cache, ref_cache


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("cached,new", [
    (40, 1),     # decode step
    (37, 6),     # speculative verification, k = 5
    (8, 22),     # prefill after a 2-block prefix-cache hit (prefill path: more than 17 new tokens)
    (0, 26),     # cold prefill
])
def test_dispatch_matches_reference_attention(fp8, cached, new):
    out, ref, cache, ref_cache = run_both(FP8_DTYPE if fp8 else torch.float32, cached, new)
    assert_caches_identical(cache, ref_cache)
    tol = FP8_TOL if fp8 else FP32_TOL
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


def test_prefill_with_prefix_hit_and_arbitrary_head_dim():
    """head_dim 80 (masked lanes) and GQA group 3 on the prefill path."""
    out, ref, cache, ref_cache = run_both(torch.float32, cached=12, new=19, group=3, head_dim=80)
    assert_caches_identical(cache, ref_cache)
    torch.testing.assert_close(out, ref, atol=FP32_TOL, rtol=FP32_TOL)


# --------------------------------------------------------------------------- GPU compile

_COMPILE_FOR_GPU = r"""
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from engine.kernels.paged_attention import _merge_partitions_kernel, _paged_attn_kernel
from engine.kernels.store import _store_kv_kernel

def build(fn, pointers, consts, arch, num_warps):
    sig = {a: "constexpr" if a in consts else pointers.get(a, "i32") for a in fn.arg_names}
    sig.update({a: "fp32" for a in fn.arg_names if a == "qk_scale_log2"})
    triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", arch, 32),
                   options={"num_warps": num_warps})

for arch in (80, 90):
    for cache, q in (("bf16", "bf16"), ("u8", "bf16")):   # a bf16 cache, an FP8 cache
        fp8 = cache == "u8"
        build(_store_kv_kernel, {"k_ptr": "*" + q, "v_ptr": "*" + q, "k_cache_ptr": "*" + cache,
              "v_cache_ptr": "*" + cache, "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "slot_ptr": "*i64"},
              dict(IS_FP8=fp8, FP8_MAX=448.0, BLOCK_H=8, BLOCK_D=128), arch, 4)
        for block_m, split in ((16, True), (64, False)):          # decode split-K, prefill
          # a draft tree's mask, a window (its causal and tree forms), both; the prefill shape:
          # none or both (the other two differ from those in their launch shape only)
          for tree, window in ((False, False), (True, True)) + (((True, False), (False, True)) if split else ()):
            part = "*fp32" if split else "*" + q       # without a split, the partials are placeholders
            build(_paged_attn_kernel, {"q_ptr": "*" + q, "k_cache_ptr": "*" + cache, "v_cache_ptr": "*" + cache,
                  "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "block_tables_ptr": "*i64",
                  "positions_ptr": "*i64", "out_ptr": "*" + q, "part_ptr": part, "lse_ptr": part, "tree_bits_ptr": "*i64",
                  "tree_start_ptr": "*i32", "window_start_ptr": "*i64", "sinks_ptr": "*fp32"},
                  dict(IS_FP8=fp8, STORE_LSE=split, IS_TREE=tree, HAS_WINDOW=window, SINKS=window and not split,
                       DOT_DTYPE=tl.bfloat16, DOT_PRECISION="tf32", HEAD_DIM=128, BLOCK_SIZE=16,
                       SLOT_DTYPE=tl.int32, BLOCK_M=block_m, BLOCK_N=32, BLOCK_D=128),
                  arch, 4 if block_m <= 16 else 8)
        for sinks in (False, True):
            build(_merge_partitions_kernel, {"part_ptr": "*fp32", "lse_ptr": "*fp32", "positions_ptr": "*i64",
                  "out_ptr": "*" + q, "sinks_ptr": "*fp32"}, dict(SINKS=sinks, BLOCK_P=16, BLOCK_D=128), arch, 4)
print("compiled")
"""


def test_kernels_compile_for_gpu_targets():
    """The interpreter runs kernels as Python and misses what only the GPU compiler rejects
    (it accepted a helper returning a tensor on one branch and None on the other). Compile
    the bf16 and FP8 configurations for sm_80 and sm_90 to cubin; no GPU needed, only the
    nvidia backend and ptxas that ship in the triton wheel."""
    import pathlib
    import subprocess
    import sys
    ptxas = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("this triton build ships no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run([sys.executable, "-c", _COMPILE_FOR_GPU], env=env, capture_output=True, text=True,
                          cwd=pathlib.Path(__file__).parent.parent, timeout=300)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


def test_engine_forward_with_kernels_matches_the_torch_path(tmp_path):
    """The whole model through the kernels (interpreter) vs the torch reference, FP8 cache,
    prefill + decode + a verification chunk."""
    from engine.config import EngineConfig
    from engine.loading.loader import load_model
    from engine.runtime.model_runner import ModelRunner
    from tests.test_models import ARCHS, _save_tiny
    _save_tiny(tmp_path, ARCHS["qwen3"])
    loaded = load_model(str(tmp_path))
    ids = torch.randint(0, 128, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    outs = []
    for backend in ("torch", "triton"):
        runner = ModelRunner(loaded, EngineConfig(block_size=4, num_blocks=16, kv_cache_dtype="fp8_e4m3",
                                                  attention_backend=backend), torch.device("cpu"))
        assert runner.use_kernels == (backend == "triton")
        seq = runner.start(ids[:12])
        logits = [runner.forward(seq, ids[:12], logits_for="all"), runner.forward(seq, ids[12:13])]
        logits.append(runner.forward(seq, ids[13:], logits_for="all"))
        outs.append(torch.cat(logits))
    assert (outs[0] - outs[1]).abs().max() < 1e-3


@pytest.mark.parametrize("cached,new", [(40, 1), (37, 6), (8, 22)])
def test_the_rotated_fp8_cache_gives_the_same_through_the_kernels(cached, new):
    """kv_cache_dtype fp8_e4m3_hadamard: attention rotates q, k, v on the way in and the output
    on the way out, so the kernels and the torch path store the same bytes and agree."""
    out, ref, cache, ref_cache = run_both(FP8_DTYPE, cached, new, rotated=True)
    torch.testing.assert_close(out, ref, atol=FP8_TOL, rtol=FP8_TOL)
    assert_caches_identical(cache, ref_cache)


@pytest.mark.parametrize("kv,nodes", [("auto", 7), ("fp8_e4m3", 7), ("auto", 24)])
def test_a_draft_tree_through_the_kernels_matches_the_torch_path(tmp_path, kv, nodes):
    """A tree verify pass (engine.speculative.tree) with the kernels' tree mask (interpreter) against
    the torch path, which computes each row as its own chain: same logits to the kernels'
    tolerance. With block size 4 the tree's keys span several blocks and partitions."""
    from engine.config import EngineConfig
    from engine.loading.loader import load_model
    from engine.runtime.model_runner import ModelRunner, PassItem
    from engine.speculative.tree import DraftTree
    from tests.test_models import ARCHS, _save_tiny
    _save_tiny(tmp_path, ARCHS["qwen3"])
    loaded = load_model(str(tmp_path))
    ids = torch.randint(0, 128, (21,), generator=torch.Generator().manual_seed(5)).tolist()
    tree = DraftTree([5, 6, 7, 8, 9, 10, 11], [-1, -1, 0, 0, 1, 2, 5], [0.0] * 7)
    if nodes > 7:          # more rows than the decode launch takes: the prefill launch, same mask
        from engine.speculative.tree import TreeShape, grow
        logp = torch.log_softmax(torch.randn(128, generator=torch.Generator().manual_seed(1)), -1)
        tree = grow(logp, lambda frontier, t: logp.roll(len(t)).repeat(len(frontier), 1), TreeShape(4, 6, nodes))
        assert len(tree) == 4 + 5 * 16 and max(tree.depths) == 6
        from engine.speculative.tree import select
        tree = select(tree, nodes)
    outs = []
    for backend in ("torch", "triton"):
        runner = ModelRunner(loaded, EngineConfig(block_size=4, num_blocks=16, kv_cache_dtype=kv,
                                                  attention_backend=backend), torch.device("cpu"))
        seq = runner.start(ids[:20])
        runner.forward(seq, ids[:20])
        (logits, _), = runner.forward_batch([PassItem(seq, [ids[20]] + tree.tokens, len(tree) + 1, tree.rows(20))])
        outs.append(logits)
    assert (outs[0] - outs[1]).abs().max() < (1e-3 if kv == "fp8_e4m3" else 1e-4)
