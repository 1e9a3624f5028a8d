"""`bench kernels` on the CPU: `linear_rows`, what the whole model's quantized linears cost at 1,
2, 4, 5, 8 and 16 rows. A decode step is 1 row; a verify of k drafts is k + 1 rows (5 at the
app's k = 4), and a batch of users is more: a kernel whose cost stays flat as rows grow makes
speculation and batching pay.

The model named (--model F or --synthetic PRESET; default: the embedded model), loaded as the
app loads it (engine.loading.loader.load_model: dtype auto, weight_dtype auto: a GGUF's tensors
as stored); every quantized linear called once per pass in model order on random activations,
timed over REPEATS passes (median). `model` names it as given, `model_path` the file loaded,
`model_name` what the loader calls it. The head (the tied Q8_0 embedding of the default) is
timed apart: a decode step runs it on one row whatever the verify width.
`linear_rows_gb_s` is the body's bytes over its one-row time, beside `read_bandwidth_gb_s`,
what a large reduction reads per second in the same run (the median of the reads), and
`fraction_of_bandwidth` their ratio.

The roofline: `all_linears_1_row_ms` is one row's pass over every quantized linear, head
included, timed as one pass (taking turns with the body's row counts); `all_linears_gb_s` the
bytes those weights hold over it; and `roofline_fraction` that over `read_bandwidth_best_gb_s`,
the best of the reads of a large buffer (READS before the timings, one after each round of
them, READS after; `read_bandwidth_reads_gb_s`: each): how close one row comes to what this
machine can read, on a machine that may be shared and noisy.

`per_type` (engine.bench.per_type_rates): each stored type the model serves quantized, its
kernel timed on its own with the weight in cache (one thread, 1 and 16 rows) and streaming
one large weight from memory (1 row, one thread and all threads), beside plain reads on one
and on all threads in the same rounds (`read_1_thread_gb_s`, `read_all_threads_gb_s`: best
and median), so a machine whose memory is slow still shows what a kernel costs to compute.
"""
from __future__ import annotations

import statistics
import time

import torch

from engine.bench import per_type_rates

ROWS = (1, 2, 4, 5, 8, 16)
REPEATS = 15
READS = 5                       # reads of the bandwidth buffer, before the timings and again after
ALL = "all"                     # the pass over every quantized linear, head included, at 1 row


def linear_rows_bench(source=None, repeats: int = REPEATS, type_rounds: int = per_type_rates.ROUNDS,
                      in_cache_shape: tuple[int, int] = per_type_rates.IN_CACHE_SHAPE,
                      stream_shape: tuple[int, int] = per_type_rates.STREAM_SHAPE) -> dict:
    """source: an engine.bench.model_flags.ModelSource (None: the embedded model); type_rounds,
    in_cache_shape, stream_shape: per_type's (engine.bench.per_type_rates)."""
    from engine.bench.model_flags import ModelSource
    from engine.engine import pick_dtype
    from engine.errors import ConfigError
    from engine.layers import quantized_linear
    from engine.loading.loader import DEFAULT_MODEL, default_gguf_path, load_model
    from engine.models.llama import Linear
    source = source or ModelSource(None, None)
    reference = source.path() or DEFAULT_MODEL
    cpu = torch.device("cpu")
    dtype, why = pick_dtype("auto", cpu)
    loaded = load_model(reference, dtype=dtype)
    model = loaded.model
    body = [m.quant for m in model.modules() if isinstance(m, Linear) and m.quant is not None and m is not model.lm_head]
    head = model.lm_head.quant
    if not body:
        raise ConfigError(f"kernels times a model's quantized linears, and {source.name} has none here "
                          f"({loaded.weights.summary() if loaded.weights else 'float weights'}); pass a quantized "
                          "GGUF: --model FILE.gguf, or --synthetic with a GGUF preset (qwen3-1.7b-q4_k_m, ...)")

    from engine.speculative.step_costs import BANDWIDTH_BYTES, read_bandwidths
    buffer = torch.ones(BANDWIDTH_BYTES // 4, dtype=torch.float32)      # far larger than any cache
    reads = read_bandwidths(READS, buffer)

    def timed(passes: dict[str, tuple[list, int]], read_each_round: bool = False) -> dict[str, float]:
        """Median ms of each pass (label: (weights, rows)): every weight called once on `rows`
        random rows. The passes take turns round by round, so a neighbour's load or a clock
        change weighs on every one alike and the ratios between them hold on a shared machine;
        read_each_round: a bandwidth read after each round too, so the reads see what the
        passes saw."""
        gen = torch.Generator().manual_seed(0)
        xs = {(n, k): torch.randn(n, k, generator=gen).to(dtype)
              for weights, n in passes.values() for k in {qw.shape[1] for qw in weights}}
        times = {label: [] for label in passes}
        for repeat in range(repeats + 1):       # the first round warms the caches: dropped
            for label, (weights, n) in passes.items():
                start = time.perf_counter()
                for qw in weights:
                    quantized_linear.linear(xs[n, qw.shape[1]], qw, None)
                if repeat:
                    times[label].append(time.perf_counter() - start)
            if repeat and read_each_round:
                reads.extend(read_bandwidths(1, buffer, warm=False))
        return {label: round(statistics.median(t) * 1e3, 3) for label, t in times.items()}

    everything = body + ([head] if head is not None else [])
    measured = timed({**{str(n): (body, n) for n in ROWS}, ALL: (everything, 1)}, read_each_round=True)
    all_ms = measured.pop(ALL)
    rows_ms = measured
    head_ms = timed({str(n): ([head], n) for n in ROWS}) if head is not None else None
    reads += read_bandwidths(READS, buffer)
    types = per_type_rates.per_type_rates(per_type_rates.served_quantized(loaded.weights, dtype), dtype, buffer,
                                          type_rounds, in_cache_shape, stream_shape)
    del buffer
    body_bytes = sum(qw.nbytes for qw in body)
    all_bytes = sum(qw.nbytes for qw in everything)
    best = max(reads)
    path = default_gguf_path() if reference == DEFAULT_MODEL else reference
    result = {"model": source.name, "model_path": str(path), "model_name": loaded.display_name,
              "dtype": f"{str(dtype).removeprefix('torch.')} ({why})",
              "weights": loaded.weights.summary(), "kernel": quantized_linear.path(),
              "threads": torch.get_num_threads(), "linears": len(body),
              "bytes": body_bytes, "repeats": repeats,
              "linear_rows": rows_ms,
              "ratio_to_1_row": {n: round(ms / rows_ms["1"], 3) for n, ms in rows_ms.items()},
              # one row reads every weight byte once: how close that comes to what this machine reads
              "linear_rows_gb_s": round(body_bytes / rows_ms["1"] / 1e6, 2),
              "read_bandwidth_gb_s": round(statistics.median(reads) / 1e9, 2)}
    result["fraction_of_bandwidth"] = round(result["linear_rows_gb_s"] / result["read_bandwidth_gb_s"], 3)
    result |= {"all_linears": len(everything), "all_linears_bytes": all_bytes, "all_linears_1_row_ms": all_ms,
               "all_linears_gb_s": round(all_bytes / all_ms / 1e6, 2),
               "read_bandwidth_best_gb_s": round(best / 1e9, 2),
               "read_bandwidth_reads_gb_s": [round(r / 1e9, 2) for r in reads],
               "roofline_fraction": round(all_bytes / (all_ms * 1e-3) / best, 3)}
    if head_ms is not None:
        result["head_rows"] = head_ms
        result["head_ratio_to_1_row"] = {n: round(ms / head_ms["1"], 3) for n, ms in head_ms.items()}
        result["head_gb_s"] = round(head.nbytes / head_ms["1"] / 1e6, 2)
    return result | types
