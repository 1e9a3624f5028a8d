"""Write K and V for N new tokens into their paged slots in one launch.

Same contract as `engine.layers.attention.store_kv`; an FP8 cache gets the values quantized
exactly as `engine.cache.kv_cache.quantize_fp8` does (same scales, same bits).
"""
import torch
import triton
import triton.language as tl

from engine.cache.kv_cache import FP8_MAX, LayerCache
from engine.kernels.fp8 import e4m3_encode


@triton.jit
def _store_rows(x_ptr, cache_ptr, scale_ptr, tok, slot, stride_xn, stride_xh, stride_cs, stride_ss,
                num_heads, head_dim, IS_FP8: tl.constexpr, FP8_MAX: tl.constexpr,
                BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """One token's [num_heads, head_dim] values into cache slot `slot`."""
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < num_heads) & (dims[None, :] < head_dim)
    x = tl.load(x_ptr + tok * stride_xn + heads[:, None] * stride_xh + dims[None, :],
                mask=mask, other=0.0)                                            # [H, D]
    dst = cache_ptr + slot * stride_cs + heads[:, None] * head_dim + dims[None, :]
    if IS_FP8:
        x = x.to(tl.float32)
        # IEEE-rounded division, as torch does, so scales and bits match quantize_fp8.
        scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=1), FP8_MAX), 1e-12)   # [H]
        xq = tl.clamp(tl.math.div_rn(x, scale[:, None]), -FP8_MAX, FP8_MAX)
        tl.store(dst, e4m3_encode(xq), mask=mask)
        tl.store(scale_ptr + slot * stride_ss + heads, scale, mask=heads < num_heads)
    else:
        tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_ptr,
                     stride_kn, stride_kh, stride_vn, stride_vh, stride_cs, stride_ss,
                     num_heads, head_dim, IS_FP8: tl.constexpr, FP8_MAX: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    # One program per token: all of its KV heads, K and V.
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:   # a negative slot marks a padding token: nothing to write
        _store_rows(k_ptr, k_cache_ptr, k_scale_ptr, tok, slot, stride_kn, stride_kh, stride_cs,
                    stride_ss, num_heads, head_dim, IS_FP8, FP8_MAX, BLOCK_H, BLOCK_D)
        _store_rows(v_ptr, v_cache_ptr, v_scale_ptr, tok, slot, stride_vn, stride_vh, stride_cs,
                    stride_ss, num_heads, head_dim, IS_FP8, FP8_MAX, BLOCK_H, BLOCK_D)


def store_kv(cache: LayerCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v [N, num_kv_heads, head_dim] -> cache slots `slot_mapping` [N] (block_id * block_size + offset)."""
    n, num_heads, head_dim = k.shape
    if n == 0:
        return
    assert cache.k.is_contiguous() and cache.v.is_contiguous(), "cache tensors must be contiguous"
    k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (k, v))
    is_fp8 = cache.k_scale is not None
    # FP8 is written as raw bytes (see fp8.py); scales get their own pointer.
    k_cache, v_cache = (c.view(torch.uint8) if is_fp8 else c for c in (cache.k, cache.v))
    k_scale, v_scale = (cache.k_scale, cache.v_scale) if is_fp8 else (k_cache, v_cache)  # unused
    stride_ss = cache.k_scale.stride(1) if is_fp8 else 0
    _store_kv_kernel[(n,)](
        k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), cache.k.stride(1), stride_ss,
        num_heads, head_dim, IS_FP8=is_fp8, FP8_MAX=FP8_MAX,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim))
