"""Exact byte counts and FP8 round-trip error bounds."""
import torch

from engine.cache.kv_cache import FP8_DTYPE, CacheShape, KVCache, dequantize_fp8, quantize_fp8
from engine.layers.attention import gather_kv, store_kv

SMOL = CacheShape(num_layers=30, num_kv_heads=3, head_dim=64)   # SmolLM2-135M


def test_bytes_per_token_for_the_default_model():
    assert SMOL.bytes_per_token(torch.float32) == 2 * 30 * 3 * 64 * 4 == 46080
    assert SMOL.bytes_per_token(torch.bfloat16) == 23040
    assert SMOL.bytes_per_token(FP8_DTYPE) == 11520 == SMOL.bytes_per_token(torch.float16) // 2
    assert SMOL.scale_bytes_per_token(FP8_DTYPE) == 2 * 30 * 3 * 4 == 720
    assert SMOL.scale_bytes_per_token(torch.bfloat16) == 0


def test_allocated_bytes_are_measured_from_the_tensors():
    cache = KVCache(SMOL, num_blocks=10, block_size=16, dtype=FP8_DTYPE, device=torch.device("cpu"))
    assert cache.bytes_allocated == 10 * 16 * (11520 + 720)
    assert cache.bytes_held(3) == 3 * 16 * (11520 + 720)
    assert cache.k.shape == (30, 10, 16, 3, 64)        # KV heads only, never query heads
    bf16 = KVCache(SMOL, num_blocks=10, block_size=16, dtype=torch.bfloat16, device=torch.device("cpu"))
    assert bf16.bytes_allocated == 10 * 16 * 23040


def test_llama2_7b_shapes():
    mha = CacheShape(32, 32, 128)
    gqa = CacheShape(32, 8, 128)
    assert mha.bytes_per_token(torch.float16) * 4096 == 2 * 2**30          # 2 GiB per sequence
    assert gqa.bytes_per_token(FP8_DTYPE) * 4096 == 256 * 2**20            # 256 MiB


def test_fp8_round_trip_error_bound():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, 128, generator=g) * torch.logspace(-3, 2, 8)[None, :, None]
    x[0, 0, 0] = 40.0                                   # an outlier in one head only
    q, scale = quantize_fp8(x)
    assert q.dtype == FP8_DTYPE and scale.shape == (512, 8)
    y = dequantize_fp8(q, scale, torch.float32)
    # E4M3 keeps 3 mantissa bits: relative error <= 2^-4 in the normal range; values below
    # the smallest normal (2^-6 * scale) have absolute error <= 2^-10 * scale.
    bound = x.abs() * 2**-4 + scale[..., None] * 2**-10
    assert ((y - x).abs() <= bound + 1e-12).all()
    # The outlier only coarsens its own (token, head), not its neighbours.
    assert scale[0, 1] < scale[0, 0] / 10


def test_store_then_gather_returns_what_was_written():
    cache = KVCache(CacheShape(1, 2, 16), num_blocks=6, block_size=4, dtype=FP8_DTYPE, device=torch.device("cpu"))
    layer = cache.layer(0)
    k = torch.randn(7, 2, 16)
    v = torch.randn(7, 2, 16)
    table = torch.tensor([5, 2])                        # out of order: positions 0-3 in block 5
    positions = torch.arange(7)
    slots = table[positions // 4] * 4 + positions % 4
    store_kv(layer, k, v, slots)
    k2, v2 = gather_kv(layer, table, 7, torch.float32)
    assert torch.allclose(k2, k, rtol=2**-4, atol=1e-3) and torch.allclose(v2, v, rtol=2**-4, atol=1e-3)
