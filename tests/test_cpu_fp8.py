"""Our FP8 cache read (engine.kernels.cpu_fp8): the gather + dequantize the torch attention path
makes per layer, in one op, with the torch expression's bits (what keeps greedy output the same
with and without it), on each instruction set this CPU offers, and the torch path where it is
refused."""
import pytest
import torch

from engine import EngineConfig, SamplingParams
from engine import cpu_features
from engine.cache.kv_cache import FP8_DTYPE, LayerCache
from engine.engine import LLMEngine
from engine.kernels import cpu_fp8
from engine.layers import attention
from engine.loading.loader import load_model
from engine.loading.synthetic import write_checkpoint
from tests.conftest import forced_fallback
from tests.kernels_required import skip_unless_runs

# e4m3fn's extremes: ±0, the smallest and largest subnormals, the smallest normal, ±448 and the NaNs
EXTREMES = [0x00, 0x80, 0x01, 0x81, 0x07, 0x87, 0x08, 0x88, 0x7e, 0xfe, 0x7f, 0xff]
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(INT_VIEW[a.dtype]),
                                                                      b.view(INT_VIEW[b.dtype]))


def offered_isas() -> list[str]:
    return [isa for isa, needs in cpu_fp8.NEEDS.items() if all(f in cpu_features.flags() for f in needs)]


@pytest.fixture
def serving():
    skip_unless_runs(cpu_fp8.refusal(), "our FP8 cache read")


def fp8_pool(blocks: int, block_size: int, heads: int, head_dim: int, seed: int = 0):
    """values [blocks, block_size, heads, head_dim] (random bytes, every extreme included) and
    their scales, from 1e-12 (quantize_fp8's floor) to 1e30."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 256, (blocks, block_size, heads, head_dim), dtype=torch.uint8, generator=gen)
    flat = values.view(-1)
    flat[:len(EXTREMES)] = torch.tensor(EXTREMES, dtype=torch.uint8)
    flat[-len(EXTREMES):] = torch.tensor(EXTREMES, dtype=torch.uint8)
    exponents = torch.randint(-40, 100, (blocks, block_size, heads), generator=gen).float()
    scales = torch.rand(blocks, block_size, heads, generator=gen) * 10 ** (exponents / 10)
    scales.view(-1)[:2] = torch.tensor([1e-12, 1e30])
    return values.view(FP8_DTYPE), scales


SHAPES = [(1, 1, 8), (16, 3, 64), (4, 2, 20), (32, 1, 128), (16, 2, 72)]      # block_size, heads, head_dim


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=dtype_id)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "bs{}-h{}-d{}".format(*s))
@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
def test_whole_blocks_and_single_slots_read_torchs_bits(serving, isa, shape, dtype):
    if isa not in offered_isas():
        pytest.skip(f"this CPU has no {isa}")
    block_size, heads, head_dim = shape
    values, scales = fp8_pool(9, *shape)
    tables = torch.tensor([3, 0, 8, 3, 5, 0])                     # repeats, as a padded table reads block 0
    slots = torch.tensor([0, 9 * block_size - 1, 2 * block_size + 1, 2 * block_size + 1, 7])
    for pool, pool_scales, index in ((values, scales, tables), (values.flatten(0, 1), scales.flatten(0, 1), slots)):
        got = torch.ops.workbench_cpu.fp8_gather(pool, pool_scales, index, dtype, cpu_fp8.ISAS[isa])
        assert same_bits(got, cpu_fp8.reference(pool, pool_scales, index, dtype))
        assert same_bits(got, torch.ops.workbench_cpu.fp8_gather(pool.view(torch.uint8), pool_scales, index.int(),
                                                                 dtype, cpu_fp8.ISAS[isa]))


def test_every_byte_decodes_as_torch_decodes_it(serving):
    values = torch.arange(256, dtype=torch.uint8).view(4, 1, 1, 64).view(FP8_DTYPE)
    scales = torch.ones(4, 1, 1)
    index = torch.arange(4)
    for isa in offered_isas():
        got = torch.ops.workbench_cpu.fp8_gather(values, scales, index, torch.float32, cpu_fp8.ISAS[isa])
        assert same_bits(got, values.float()), isa


def test_an_index_past_the_pool_is_an_error_not_a_read(serving):
    values, scales = fp8_pool(4, 16, 3, 64)
    with pytest.raises(RuntimeError, match="index 4 is out of range for 4 rows"):
        cpu_fp8.gather(values, scales, torch.tensor([0, 4]), torch.bfloat16)


def layer_cache(block_size: int = 16, heads: int = 3, head_dim: int = 64) -> LayerCache:
    """An FP8 layer whose every slot holds a quantized random key and value."""
    gen = torch.Generator().manual_seed(1)
    blocks = 12
    k, v = (torch.randn(blocks * block_size, heads, head_dim, generator=gen) * 3 for _ in range(2))
    cache = LayerCache(torch.zeros(blocks, block_size, heads, head_dim, dtype=FP8_DTYPE),
                       torch.zeros(blocks, block_size, heads, head_dim, dtype=FP8_DTYPE),
                       torch.ones(blocks, block_size, heads), torch.ones(blocks, block_size, heads))
    attention.store_kv(cache, k, v, torch.arange(blocks * block_size))
    return cache


def attention_reads(cache: LayerCache, dtype: torch.dtype) -> list[torch.Tensor]:
    """What the torch attention path reads: one sequence (gather_kv), a batch of sequences by
    whole blocks and a tree's rows key by key (_gather)."""
    block_size = cache.k.shape[1]
    positions = torch.arange(200)
    tables = [torch.tensor([4, 1, 7, 2, 9, 0]), torch.tensor([3, 11, 5])]
    batch = attention._Group([attention._Keys([0], 90, tables[0]), attention._Keys([1, 2], 40, tables[1])],
                             positions, block_size, 3)
    tree = attention._Group([attention._Keys([0], 21, tables[1], list(range(17)) + [30, 33, 34, 35]),
                             attention._Keys([1], 19, tables[1], list(range(17)) + [30, 31])],
                            positions, block_size, 3)
    assert batch.slots is None and tree.slots is not None
    return [*attention.gather_kv(cache, tables[0], 90, dtype), *attention._gather(cache, batch, dtype),
            *attention._gather(cache, tree, dtype)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_the_attention_path_reads_the_same_bits_with_the_op_and_refused(serving, dtype):
    cache = layer_cache()
    assert cpu_fp8.serves(cache.k, cache.k_scale, dtype)
    ours = attention_reads(cache, dtype)
    with forced_fallback("fp8-refused"):
        assert not cpu_fp8.serves(cache.k, cache.k_scale, dtype)
        torchs = attention_reads(cache, dtype)
    assert all(same_bits(a, b) for a, b in zip(ours, torchs, strict=True))


def test_a_refused_op_leaves_the_torch_path_serving():
    cache = layer_cache()
    with forced_fallback("fp8-refused"):
        assert cpu_fp8.refusal() == "our FP8 cache read refused (forced by a test)"
        k, v = attention.gather_kv(cache, torch.tensor([2, 0]), 20, torch.bfloat16)
    want = cpu_fp8.reference(cache.k, cache.k_scale, torch.tensor([2, 0]), torch.bfloat16).flatten(0, 1)[:20]
    assert same_bits(k, want) and k.shape == (20, 3, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_greedy_replies_on_the_fp8_cache_are_the_same_with_the_op_and_refused(serving, tmp_path, dtype):
    loaded = load_model(str(write_checkpoint(tmp_path, "tiny", seed=0)), dtype=dtype)
    prompts = [loaded.tokenizer.encode(t) for t in ("The cat sat on", "Once upon a time there was a")]
    params = SamplingParams(max_tokens=12, stop_on_eos=False)

    def replies():
        eng = LLMEngine(loaded, EngineConfig(kv_cache_bytes=8 * 2**20, kv_cache_dtype="fp8_e4m3", compile="off"),
                        torch.device("cpu"))
        return [eng.generate_text(p, params)[1] for p in prompts]
    ours = replies()
    with forced_fallback("fp8-refused"):
        assert replies() == ours
