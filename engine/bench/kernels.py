"""`python -m engine.bench kernels [--model F | --synthetic PRESET] --json`: decode-attention
kernel speed against the device's measured copy bandwidth; on the CPU, the quantized linears'
cost by row count (engine.bench.linear_rows), of the model named (default: the embedded one).
On CUDA the attention runs at the named model's shape (query heads, KV heads, head_dim; a
preset's from its config, nothing written), else at SHAPE's; `model` names which.

Decode attention is memory bound: each step reads every cached K/V byte once. So the
figure of merit is achieved bandwidth = bytes the kernel must move / kernel time, and
how close that comes to a plain device copy. L2 is flushed before every timed launch,
so short contexts are not served from cache.
"""
from __future__ import annotations

import statistics

import torch

from engine.cache.kv_cache import FP8_DTYPE, LayerCache, dtype_name

CONTEXT_LENS = (512, 4096, 32768)
KV_DTYPES = (torch.bfloat16, FP8_DTYPE)
# A Llama-3-8B-like layer: 32 query heads over 8 KV heads, head_dim 128; 16-token blocks.
SHAPE = dict(batch=1, num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16)
REPEATS = 50
L2_FLUSH_BYTES = 256 << 20
DEVICE = "cuda"


def run_kernel_bench(source=None) -> dict:
    """source: an engine.bench.model_flags.ModelSource (None: the embedded model)."""
    from engine.bench.model_flags import ModelSource
    source = source or ModelSource(None, None)
    if not torch.cuda.is_available():
        from engine.bench.linear_rows import linear_rows_bench
        return {"cuda": False, "message": "CUDA is absent; attention kernel bench skipped", **linear_rows_bench(source)}
    from engine.kernels.dispatch import kernels_available
    if not kernels_available("cuda"):
        return {"cuda": True, "model": source.name, "message": "triton is not importable; kernel bench skipped"}
    shape = attention_shape(source)
    copy_gbps = copy_bandwidth_gbps()
    results = [decode_case(ctx, dtype, copy_gbps, shape) for ctx in CONTEXT_LENS for dtype in KV_DTYPES]
    return {"cuda": True, "device": torch.cuda.get_device_name(), "model": source.name, "shape": shape,
            "copy_gb_per_s": round(copy_gbps, 1), "results": results}


def attention_shape(source) -> dict:
    """SHAPE, or with the named model's query heads, KV heads and head_dim."""
    if not source.model and not source.synthetic:
        return SHAPE
    if source.synthetic:
        from engine.loading.synthetic import make_config
        from engine.loading.synthetic_gguf import SYNTHETIC_GGUF_PRESETS
        config = make_config(SYNTHETIC_GGUF_PRESETS.get(source.synthetic, (source.synthetic,))[0])
    else:
        from engine.loading.loader import load_config, resolve
        config = load_config(resolve(source.model))
    heads = config.num_attention_heads
    return {**SHAPE, "num_q_heads": heads, "num_kv_heads": getattr(config, "num_key_value_heads", None) or heads,
            "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads}


def median_ms(fn, flush: torch.Tensor | None = None) -> float:
    """Median device time of `fn` over REPEATS runs, from CUDA events around each call."""
    fn()   # warm-up: compiles the kernels
    times = []
    for _ in range(REPEATS):
        if flush is not None:
            flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth_gbps(num_bytes: int = 1 << 30) -> float:
    """Device-to-device copy of a 1 GiB tensor: reads + writes per second."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * num_bytes / (ms * 1e-3) / 1e9


def decode_case(context_len: int, kv_dtype: torch.dtype, copy_gbps: float, layer: dict = SHAPE) -> dict:
    from engine.kernels.paged_attention import paged_decode_attention
    from engine.kernels.store import store_kv

    s = layer
    num_blocks = context_len // s["block_size"]
    shape = (num_blocks, s["block_size"], s["num_kv_heads"], s["head_dim"])
    fp8 = kv_dtype == FP8_DTYPE
    scales = [torch.ones(shape[:-1], device=DEVICE) for _ in range(2)] if fp8 else [None, None]
    cache = LayerCache(torch.empty(shape, dtype=kv_dtype, device=DEVICE),
                       torch.empty(shape, dtype=kv_dtype, device=DEVICE), *scales)
    # Pages in shuffled order, as a long-running pool hands them out.
    table = torch.randperm(num_blocks, device=DEVICE, dtype=torch.int32)
    slots = (table.long()[:, None] * s["block_size"] + torch.arange(s["block_size"], device=DEVICE)).flatten()
    kv = torch.randn(2, context_len, s["num_kv_heads"], s["head_dim"], device=DEVICE, dtype=torch.bfloat16)
    store_kv(cache, kv[0], kv[1], slots)
    tables = table[None].expand(s["batch"], -1)                                  # [B, num_blocks]
    q = torch.randn(s["batch"], 1, s["num_q_heads"], s["head_dim"], device=DEVICE, dtype=torch.bfloat16)
    context_lens = torch.full((s["batch"],), context_len, device=DEVICE, dtype=torch.int32)
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=DEVICE)

    ms = median_ms(lambda: paged_decode_attention(q, cache, tables, context_lens, s["head_dim"] ** -0.5,
                                                  max_context_len=context_len), flush)
    # The bytes any decode kernel must move: K/V values, FP8 scales, block table, q in, out.
    tensors = [cache.k, cache.v, tables, q, q] + ([cache.k_scale, cache.v_scale] if fp8 else [])
    num_bytes = sum(t.numel() * t.element_size() for t in tensors)
    gbps = num_bytes / (ms * 1e-3) / 1e9
    return {"context_len": context_len, "kv_dtype": dtype_name(kv_dtype), "time_us": round(ms * 1e3, 2),
            "bytes_moved": num_bytes, "gb_per_s": round(gbps, 1),
            "fraction_of_copy_bw": round(gbps / copy_gbps, 3)}
