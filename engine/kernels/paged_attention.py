"""Attention of each sequence's newest Q tokens over its paged KV cache.

One kernel serves decode (Q = 1), speculative verification (Q = k + 1, causal among the
Q tokens) and prefill with prefix-cache hits (Q = uncached tokens, keys = cached + new);
only the launch configuration differs. Query row r of a program is (token r // G, head
r % G) of one KV-head group, so every K/V tile is read once, in its stored dtype, for all
G query heads and all Q tokens. FP8 is dequantized in registers: the per-token scales are
folded into the scores (K) and the probabilities (V), so the tiles go to `tl.dot` as
exact float16/bfloat16/float32 values.

Split-K: the keys are cut into partitions of `partition_size` tokens, each program
handles one (sequence, KV head, row chunk, partition) and writes a normalized partial
output with its log-sum-exp; a second kernel merges the partitions. A row whose keys all lie
in the first partition (position < partition_size) gets its final output from the first
kernel directly and is skipped by the merge.

Batch invariance: a row's arithmetic depends only on its sequence (its query, positions and
keys) and on the partition size, never on the other sequences of the launch. Whether a row
is written directly or merged is the row's own position's choice, not the batch's longest
context; the merge runs over a row's own partitions in chunks of a fixed MERGE_BLOCK_P, so
the order of its sums does not change with the grid; programs past a sequence's context
write nothing. So a sequence's output is bitwise the same alone or in any batch, given the
same partition size (the engine's decode launches: DECODE_PARTITION, fixed).

Softmax runs online in float32, in base 2 (exp2) with log2(e) folded into the scale.

A sliding window (per layer: `window`, 0 for none) masks the keys at positions <= a row's
position - window; the tiles wholly before every row's window are not read (a tile a row
does not see leaves its sums exactly as they were, so skipping it changes no bit). A tree's
rows, whose cache indices are not their positions, are given their first cache index in the
window (`window_start`). Attention sinks (gpt-oss, one logit per query head) add exp(sink)
to the denominator: in the first kernel for a row written directly, else in the merge.
"""
import math

import torch
import triton
import triton.language as tl

from engine.cache.kv_cache import LayerCache
from engine.kernels import interpreting, mend_interpreter
from engine.kernels.fp8 import e4m3_decode_div256

mend_interpreter()          # the loops below have runtime bounds

# Launch shapes. Register use was checked by compiling for sm_80/sm_90 (no spills at these
# sizes); the speeds are untuned: `python -m engine.bench kernels` measures them on a GPU.
MAX_BLOCK_M = 64           # query rows (tokens x group heads) per program; more rows -> more chunks
DECODE_BLOCK_N = 32        # keys per inner-loop tile
DECODE_PARTITION = 256     # keys per split-K partition (fixed: never derived from the batch)
MERGE_BLOCK_P = 16         # partitions the merge reads per step (fixed: see batch invariance above)
PREFILL_BLOCK_N = 32
_DOT_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _load_kv_tile(cache_ptr, slot, kvh, tok_ok, dims, d_ok, stride_cs, stride_ch,
                  IS_FP8: tl.constexpr, DTYPE: tl.constexpr):
    """[BLOCK_N, BLOCK_D] tile of one KV head, in DTYPE. FP8 comes back as value / 256
    (exact); callers multiply the per-token scales by 256."""
    rows = cache_ptr + slot * stride_cs + kvh * stride_ch                            # [N] pointers
    x = tl.load(rows[:, None] + dims[None, :], mask=tok_ok[:, None] & d_ok[None, :], other=0)
    if IS_FP8:
        x = e4m3_decode_div256(x)
    return x.to(DTYPE)


@triton.jit
def _load_scale(scale_ptr, slot, kvh, tok_ok, stride_ss):
    """Per-token FP8 scales [BLOCK_N] of one KV head, times 256 (see _load_kv_tile)."""
    return tl.load(scale_ptr + slot * stride_ss + kvh, mask=tok_ok, other=0.0) * 256.0


@triton.jit
def _paged_attn_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, positions_ptr,
        out_ptr, part_ptr, lse_ptr, tree_bits_ptr, tree_start_ptr, window_start_ptr, sinks_ptr,
        stride_qb, stride_qq, stride_qh, stride_bt, stride_pb, stride_cs, stride_ch, stride_ss, stride_tb, stride_wb,
        stride_ob, stride_oq, stride_oh, stride_xb, stride_xp, stride_xq, stride_xh, stride_lb, stride_lp, stride_lq,
        qk_scale_log2, num_queries, group, num_row_chunks, partition_size, window,
        IS_FP8: tl.constexpr, STORE_LSE: tl.constexpr, IS_TREE: tl.constexpr, HAS_WINDOW: tl.constexpr,
        SINKS: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, SLOT_DTYPE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    seq = tl.program_id(0)
    kvh = tl.program_id(1) // num_row_chunks
    part = tl.program_id(2)

    rows = (tl.program_id(1) % num_row_chunks) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < num_queries * group
    qtok = rows // group
    head = kvh * group + rows % group
    pos = tl.load(positions_ptr + seq * stride_pb + qtok, mask=row_ok, other=-1).to(tl.int32)  # [M]
    dims = tl.arange(0, BLOCK_D)
    d_ok = dims < HEAD_DIM
    if IS_TREE:   # a draft tree: keys from tree_start on are seen only along the row's path (bit i: key tree_start + i)
        tree_start = tl.load(tree_start_ptr + seq).to(tl.int32)
        tree_bits = tl.load(tree_bits_ptr + seq * stride_tb + qtok, mask=row_ok, other=0)            # [M] int64
    if HAS_WINDOW:   # the first cache index each row sees
        if IS_TREE:
            lo = tl.load(window_start_ptr + seq * stride_wb + qtok, mask=row_ok, other=0).to(tl.int32)
        else:
            lo = pos - window + 1

    # Keys this program reads: its partition, cut at the chunk's last query position (and
    # under a window, from the first tile any of its rows sees). The first partition's program
    # always runs: a row without keys (a padded row: position -1) gets zeros, not garbage.
    start = part * partition_size
    end = tl.minimum(start + partition_size, tl.max(pos, axis=0) + 1)
    first_tile = start
    if HAS_WINDOW:
        lo_min = tl.min(tl.where(row_ok, lo, end), axis=0)
        first_tile = start + tl.maximum(lo_min - start, 0) // BLOCK_N * BLOCK_N
    if (start < end) | (part == 0):
        q = tl.load(q_ptr + seq * stride_qb + qtok[:, None] * stride_qq + head[:, None] * stride_qh
                    + dims[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(DOT_DTYPE)  # [M, D]
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)   # running max of scores (log2 units)
        l_i = tl.zeros([BLOCK_M], tl.float32)                 # running sum of exp2(score - m_i)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for tile in range(first_tile, end, BLOCK_N):
            toks = tile + tl.arange(0, BLOCK_N)
            tok_ok = toks < end
            block = tl.load(block_tables_ptr + seq * stride_bt + toks // BLOCK_SIZE, mask=tok_ok, other=0)
            slot = block.to(SLOT_DTYPE) * BLOCK_SIZE + toks % BLOCK_SIZE                 # [N]
            k = _load_kv_tile(k_cache_ptr, slot, kvh, tok_ok, dims, d_ok, stride_cs, stride_ch,
                              IS_FP8, DOT_DTYPE)                                        # [N, D]
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)                   # [M, N]
            if IS_FP8:
                s = s * _load_scale(k_scale_ptr, slot, kvh, tok_ok, stride_ss)[None, :]
            s = s * qk_scale_log2
            seen = tok_ok[None, :] & (toks[None, :] <= pos[:, None])
            if IS_TREE:
                rel = toks - tree_start
                shift = tl.minimum(tl.maximum(rel, 0), 63).to(tl.int64)
                on_path = ((tree_bits[:, None] >> shift[None, :]) & 1) != 0
                seen = seen & ((rel[None, :] < 0) | on_path)
            if HAS_WINDOW:
                seen = seen & (toks[None, :] >= lo[:, None])
            s = tl.where(seen, s, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)   # rows with no key yet: no NaN
            p = tl.math.exp2(s - m_ref[:, None])
            alpha = tl.math.exp2(m_i - m_ref)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new

            v = _load_kv_tile(v_cache_ptr, slot, kvh, tok_ok, dims, d_ok, stride_cs, stride_ch,
                              IS_FP8, DOT_DTYPE)                                        # [N, D]
            if IS_FP8:
                p = p * _load_scale(v_scale_ptr, slot, kvh, tok_ok, stride_ss)[None, :]
            acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)

        if part == 0:   # a row whose keys all lie in the first partition is final here; the others are merged
            direct = row_ok & (pos < partition_size)
            l_d, acc_d = l_i, acc
            if SINKS:   # the sink's term joins its denominator here
                sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0) * 1.4426950408889634   # log2 units
                m_s = tl.maximum(m_i, sink)
                alpha = tl.math.exp2(m_i - m_s)
                l_d = l_i * alpha + tl.math.exp2(sink - m_s)
                acc_d = acc * alpha[:, None]
            l_d = tl.where(l_d == 0.0, 1.0, l_d)   # rows without keys (masked rows): m_i = -inf, acc = 0
            o_ptrs = out_ptr + seq * stride_ob + qtok[:, None] * stride_oq + head[:, None] * stride_oh + dims[None, :]
            tl.store(o_ptrs, (acc_d / l_d[:, None]).to(out_ptr.dtype.element_ty), mask=direct[:, None] & d_ok[None, :])
        if STORE_LSE:
            split = row_ok & (pos >= partition_size)
            l_i = tl.where(l_i == 0.0, 1.0, l_i)
            x_ptrs = (part_ptr + seq * stride_xb + part * stride_xp + qtok[:, None] * stride_xq
                      + head[:, None] * stride_xh + dims[None, :])
            tl.store(x_ptrs, acc / l_i[:, None], mask=split[:, None] & d_ok[None, :])
            tl.store(lse_ptr + seq * stride_lb + part * stride_lp + qtok * stride_lq + head,
                     m_i + tl.math.log2(l_i), mask=split)


@triton.jit
def _merge_partitions_kernel(part_ptr, lse_ptr, positions_ptr, out_ptr, sinks_ptr,
                             stride_pb, stride_xb, stride_xp, stride_xq, stride_xh,
                             stride_lb, stride_lp, stride_lq, stride_ob, stride_oq, stride_oh, head_dim,
                             partition_size, SINKS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    """out = sum_p w_p * out_p / sum_p w_p with w_p = 2^(lse_p - max lse), over the partitions
    up to this query token's (one before its window has lse -inf: w_p = 0), read BLOCK_P at a
    time. With sinks, the head's sink is one more term of the denominator (and of the max). A
    token in the first partition alone was written by the first kernel: nothing to do."""
    seq, qtok, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    num_parts = tl.load(positions_ptr + seq * stride_pb + qtok) // partition_size + 1
    if num_parts > 1:
        dims = tl.arange(0, BLOCK_D)
        lse_row = lse_ptr + seq * stride_lb + qtok * stride_lq + head
        part_row = part_ptr + seq * stride_xb + qtok * stride_xq + head * stride_xh
        m = tl.full([BLOCK_P], float("-inf"), tl.float32)
        for first in range(0, num_parts, BLOCK_P):
            parts = first + tl.arange(0, BLOCK_P)
            m = tl.maximum(m, tl.load(lse_row + parts * stride_lp, mask=parts < num_parts, other=float("-inf")))
        m_all = tl.max(m, axis=0)
        if SINKS:
            sink = tl.load(sinks_ptr + head) * 1.4426950408889634                       # log2 units
            m_all = tl.maximum(m_all, sink)
        total = tl.zeros([BLOCK_P], tl.float32)
        acc = tl.zeros([BLOCK_D], tl.float32)
        for first in range(0, num_parts, BLOCK_P):
            parts = first + tl.arange(0, BLOCK_P)
            part_ok = parts < num_parts
            lse = tl.load(lse_row + parts * stride_lp, mask=part_ok, other=float("-inf"))  # [P]
            w = tl.where(part_ok, tl.math.exp2(lse - m_all), 0.0)
            part_out = tl.load(part_row + parts[:, None] * stride_xp + dims[None, :],
                               mask=part_ok[:, None] & (dims[None, :] < head_dim), other=0.0)  # [P, D]
            total += w
            acc += tl.sum(w[:, None] * part_out, axis=0)
        denominator = tl.sum(total, axis=0)
        if SINKS:
            denominator += tl.math.exp2(sink - m_all)
        tl.store(out_ptr + seq * stride_ob + qtok * stride_oq + head * stride_oh + dims,
                 (acc / denominator).to(out_ptr.dtype.element_ty), mask=dims < head_dim)


def _empty(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every tensor the kernels write is allocated here (tests swap in NaN-filled ones)."""
    return torch.empty(*shape, dtype=dtype, device=device)


def paged_attention(q: torch.Tensor, cache: LayerCache, block_tables: torch.Tensor, positions: torch.Tensor,
                    max_context_len: int, scale: float, partition_size: int, block_n: int,
                    tree: tuple[torch.Tensor, torch.Tensor] | None = None, window: int = 0,
                    sinks: torch.Tensor | None = None, window_start: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Q, H_q, D], block_tables [B, max_blocks], positions [B, Q] (query token i of
    sequence b sees keys at positions <= positions[b, i]; its keys must be in the cache)
    -> [B, Q, H_q, D]. `partition_size` must be a multiple of `block_n`.
    tree: (bits [B, Q] int64, start [B] int32): a draft tree's mask on top of that: a key at
    start + i (0 <= i < 64) is seen only where bit i of the query's bits is set.
    window > 0: a query sees only the keys at positions > positions[b, i] - window; a tree's
    queries (positions: cache indices) those at cache indices >= window_start [B, Q] int64.
    sinks [H_q] (fp32 or the model dtype): one more logit per head in each softmax's denominator."""
    batch, num_queries, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = cache.k.shape
    group = num_q_heads // num_kv_heads
    assert group * num_kv_heads == num_q_heads and partition_size % block_n == 0
    assert cache.k.is_contiguous() and cache.v.is_contiguous(), "cache tensors must be contiguous"
    q = q if q.stride(-1) == 1 else q.contiguous()
    is_fp8 = cache.k_scale is not None
    k_cache, v_cache = (c.view(torch.uint8) if is_fp8 else c for c in (cache.k, cache.v))
    k_scale, v_scale = (cache.k_scale, cache.v_scale) if is_fp8 else (k_cache, v_cache)  # unused
    stride_ss = cache.k_scale.stride(1) if is_fp8 else 0

    # tl.dot operands in the model dtype; the interpreter's tl.dot multiplies bfloat16 bit
    # patterns as integers (triton 3.9), so there the bf16 path does its dots in float32.
    dot_dtype = _DOT_DTYPES[q.dtype]
    if dot_dtype == tl.bfloat16 and interpreting():
        dot_dtype = tl.float32
    block_m = min(max(16, triton.next_power_of_2(num_queries * group)), MAX_BLOCK_M)  # tl.dot: M >= 16
    row_chunks = triton.cdiv(num_queries * group, block_m)
    num_parts = triton.cdiv(max(max_context_len, 1), partition_size)
    out = _empty(*q.shape, dtype=q.dtype, device=q.device)
    if num_parts == 1:   # every row is written directly; no partials (placeholders)
        part_out, lse = out.unsqueeze(1), out                                 # [B, 1, Q, H_q, D]
    else:
        part_out = _empty(batch, num_parts, num_queries, num_q_heads, head_dim, dtype=torch.float32,
                          device=q.device)
        lse = _empty(batch, num_parts, num_queries, num_q_heads, dtype=torch.float32, device=q.device)
    tree_bits, tree_start = tree if tree is not None else (positions, positions)     # unused without a tree
    assert window >= 0 and (tree is None or window == 0 or window_start is not None), \
        "a tree's rows under a window need their window_start"
    window_start = window_start if tree is not None and window else positions       # unused unless both
    has_sinks = sinks is not None
    sinks = sinks.detach().to(torch.float32).contiguous() if has_sinks else positions   # unused without
    _paged_attn_kernel[(batch, num_kv_heads * row_chunks, num_parts)](
        q, k_cache, v_cache, k_scale, v_scale, block_tables, positions, out, part_out, lse, tree_bits, tree_start,
        window_start, sinks,
        q.stride(0), q.stride(1), q.stride(2), block_tables.stride(0), positions.stride(0),
        cache.k.stride(1), cache.k.stride(2), stride_ss, tree_bits.stride(0), window_start.stride(0),
        *out.stride()[:3], *part_out.stride()[:4], *lse.stride()[:3],
        scale * math.log2(math.e), num_queries, group, row_chunks, partition_size, window,
        IS_FP8=is_fp8, STORE_LSE=num_parts > 1, IS_TREE=tree is not None, HAS_WINDOW=window > 0,
        SINKS=has_sinks, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        # 32-bit slot offsets save registers; 64-bit only where the cache needs them
        SLOT_DTYPE=tl.int64 if cache.k.numel() >= 2**31 else tl.int32,
        DOT_DTYPE=dot_dtype, DOT_PRECISION="ieee" if dot_dtype == tl.float32 else "tf32",  # fp32: no TF32
        BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(head_dim), num_warps=4 if block_m <= 16 else 8)
    if num_parts > 1:
        _merge_partitions_kernel[(batch, num_queries, num_q_heads)](
            part_out, lse, positions, out, sinks, positions.stride(0), *part_out.stride()[:4],
            *lse.stride()[:3], *out.stride()[:3], head_dim, partition_size, SINKS=has_sinks,
            BLOCK_P=MERGE_BLOCK_P, BLOCK_D=triton.next_power_of_2(head_dim))
    return out


def paged_decode_attention(q: torch.Tensor, cache: LayerCache, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, max_context_len: int | None = None,
                           partition_size: int = DECODE_PARTITION, block_n: int = DECODE_BLOCK_N,
                           window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Decode / verification for a batch: q [B, Q, H_q, D] holds each sequence's last Q
    tokens (positions context_len-Q .. context_len-1, causal among them), block_tables
    [B, max_blocks] int32, context_lens [B] int32 -> [B, Q, H_q, D]. window, sinks: see
    paged_attention.

    `max_context_len` sizes the split-K grid; pass it to avoid a device sync."""
    if max_context_len is None:
        max_context_len = int(context_lens.max())
    offsets = torch.arange(q.shape[1], device=q.device, dtype=context_lens.dtype)
    positions = context_lens[:, None] - q.shape[1] + offsets                    # [B, Q]
    return paged_attention(q, cache, block_tables, positions, max_context_len, scale, partition_size, block_n,
                           window=window, sinks=sinks)


def paged_prefill_attention(q: torch.Tensor, cache: LayerCache, block_table: torch.Tensor,
                            positions: torch.Tensor, context_len: int, scale: float,
                            block_n: int = PREFILL_BLOCK_N, tree: tuple | None = None, window: int = 0,
                            sinks: torch.Tensor | None = None,
                            window_start: torch.Tensor | None = None) -> torch.Tensor:
    """One sequence's prefill over paged KV: q [N, H_q, D] for the uncached tokens at
    `positions` [N]; keys are everything in the cache up to each position (prefix-cache
    hits included) -> [N, H_q, D]. Query rows give the parallelism, so no split-K: one
    partition (its size is a runtime argument, so no recompile per prompt length).
    tree, window, sinks, window_start [N]: see paged_attention."""
    partition = triton.cdiv(context_len, block_n) * block_n
    if tree is not None:
        tree = (tree[0][None], tree[1])
    out = paged_attention(q[None], cache, block_table[None], positions[None], context_len, scale,
                          partition, block_n, tree, window, sinks, None if window_start is None else window_start[None])
    return out[0]
