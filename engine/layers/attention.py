"""Paged attention: the torch reference path (runs anywhere) and dispatch to the Triton
kernels on CUDA. Metadata is passed explicitly, never through module globals: a GUI
process runs the engine on a worker thread while other threads exist.
"""
from __future__ import annotations

import torch

from engine.layers.attention_metadata import AttentionMetadata, causal_mask  # noqa: F401 (re-exported)
from engine.cache.kv_cache import LayerCache, dequantize_fp8, quantize_fp8


def encode_kv(cache: LayerCache, k: torch.Tensor, v: torch.Tensor) -> tuple:
    """k, v [N, H_kv, D] as the cache stores them: (k, v, k_scale, v_scale), scales None
    unless the cache is FP8 (then the values are quantized)."""
    if cache.k_scale is None:
        return k.to(cache.k.dtype), v.to(cache.v.dtype), None, None
    kq, ks = quantize_fp8(k)
    vq, vs = quantize_fp8(v)
    return kq, vq, ks, vs


def write_kv(cache: LayerCache, encoded: tuple, slot_mapping: torch.Tensor) -> None:
    """Write encode_kv's output into the given slots. The cache may also be every layer's
    pool at once ([L, num_blocks, block_size, ...] with encoded [L, N, ...]): one copy per
    tensor for all layers."""
    k, v, ks, vs = encoded
    dim = cache.k.dim() - 4                         # 0 for one layer, 1 for all of them

    def flat(pool, tail: int):                      # [..., num_blocks * block_size, *tail dims]
        return pool.view(*pool.shape[:dim], -1, *pool.shape[pool.dim() - tail:])
    if ks is None:
        flat(cache.k, 2).index_copy_(dim, slot_mapping, k)
        flat(cache.v, 2).index_copy_(dim, slot_mapping, v)
        return
    # index_copy_ has no FP8 kernel on CPU; copy the raw bytes instead.
    flat(cache.k, 2).view(torch.uint8).index_copy_(dim, slot_mapping, k.view(torch.uint8))
    flat(cache.v, 2).view(torch.uint8).index_copy_(dim, slot_mapping, v.view(torch.uint8))
    flat(cache.k_scale, 1).index_copy_(dim, slot_mapping, ks)
    flat(cache.v_scale, 1).index_copy_(dim, slot_mapping, vs)


def store_kv(cache: LayerCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write k, v [N, num_kv_heads, head_dim] into their slots, quantizing if the cache is FP8."""
    write_kv(cache, encode_kv(cache, k, v), slot_mapping)


def _decode(cache: LayerCache, encoded: tuple, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """encode_kv's output read back as the cache would give it."""
    k, v, ks, vs = encoded
    if ks is None:
        return k.to(dtype), v.to(dtype)
    return dequantize_fp8(k, ks, dtype), dequantize_fp8(v, vs, dtype)


def gather_kv(cache: LayerCache, block_table: torch.Tensor, context_len: int, dtype: torch.dtype):
    """Read one sequence's keys and values, dequantized: 2 x [context_len, H_kv, D]."""
    def read(values, scales):
        x = values.index_select(0, block_table).flatten(0, 1)[:context_len]
        if scales is None:
            return x.to(dtype)
        s = scales.index_select(0, block_table).flatten(0, 1)[:context_len]
        return dequantize_fp8(x, s, dtype)
    return read(cache.k, cache.k_scale), read(cache.v, cache.v_scale)


def paged_attention_ref(q: torch.Tensor, cache: LayerCache, meta: AttentionMetadata, scale: float,
                        k: torch.Tensor | None = None, v: torch.Tensor | None = None) -> torch.Tensor:
    """q [N, H_q, D] -> [N, H_q, D]. Query i sees keys at positions <= positions[i].
    k, v [T, H_kv, D]: the sequence's keys and values if already read, else from the cache.

    GQA without copying KV heads: the G query heads of a group are folded into the
    query-length axis, so each KV head is read once for all of them."""
    n, num_q_heads, head_dim = q.shape
    if k is None:
        k, v = gather_kv(cache, meta.block_table, meta.context_len, q.dtype)    # [T, H_kv, D]
    num_kv_heads = k.shape[1]
    group = num_q_heads // num_kv_heads
    qg = q.view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(num_kv_heads, group * n, head_dim)
    k, v = k.transpose(0, 1), v.transpose(0, 1)                            # [H_kv, T, D]
    mask = None if meta.causal_mask is None else meta.causal_mask.repeat(group, 1)   # [G*N, T]
    # Plain matmul-softmax: for one sequence on the CPU it is several times faster than SDPA's
    # kernel at decode shapes (measured: ~7 ms vs <1 ms per call at T=40 on SmolLM2 shapes).
    scores = torch.matmul(qg, k.transpose(1, 2)) * scale                  # [H_kv, G*N, T]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    out = torch.matmul(scores.softmax(-1, dtype=torch.float32).to(v.dtype), v)   # [H_kv, G*N, D]
    return out.view(num_kv_heads, group, n, head_dim).permute(2, 0, 1, 3).reshape(n, num_q_heads, head_dim)


def attention(q, k, v, cache: LayerCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Store the new k, v then attend over the sequence's cached keys, reading them back
    from the cache (so an FP8 cache affects every token's attention, prefill included)."""
    if meta.use_kernels:
        from engine.kernels import dispatch
        return dispatch.attention(q, k, v, cache, meta, scale)
    if meta.pending_kv is not None:
        return _attention_without_store(q, k, v, cache, meta, scale)
    store_kv(cache, k, v, meta.slot_mapping)
    return paged_attention_ref(q, cache, meta, scale)


def _attention_without_store(q, k, v, cache: LayerCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The compiled step's attention: the cache is only read (a pure function of it). The
    new k, v are encoded as the cache stores them, placed at their positions in what was
    read, and handed back in meta.pending_kv for the caller to write after the pass: the
    same numbers as storing first and reading back."""
    encoded = encode_kv(cache, k, v)
    meta.pending_kv.append(encoded)
    k_new, v_new = _decode(cache, encoded, q.dtype)
    k_all, v_all = gather_kv(cache, meta.block_table, meta.context_len, q.dtype)     # [T, H_kv, D]
    k_all = k_all.index_copy(0, meta.positions, k_new)
    v_all = v_all.index_copy(0, meta.positions, v_new)
    return _attention_fusable(q, k_all, v_all, meta.causal_mask, scale)


def _attention_fusable(q, k, v, mask, scale: float) -> torch.Tensor:
    """paged_attention_ref's arithmetic as broadcast products and sums, which inductor fuses
    with the gather above into a few loops: no matmul calls and no contiguous copies of the
    transposed keys (those were 3 ms of a 20 ms compiled bf16 decode step on the 2-core CPU).
    q [N, H_q, D], k, v [T, H_kv, D], mask [N, T]."""
    n, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    qg = q.view(n, num_kv_heads, num_q_heads // num_kv_heads, 1, head_dim)           # [N, H_kv, G, 1, D]
    scores = (qg * k.transpose(0, 1)[None, :, None]).sum(-1) * scale              # [N, H_kv, G, T]
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    p = scores.softmax(-1, dtype=torch.float32).to(v.dtype)
    out = (p[..., None] * v.transpose(0, 1)[None, :, None]).sum(-2)                # [N, H_kv, G, D]
    return out.reshape(n, num_q_heads, head_dim)
