"""`bench kernels` on the CPU: `linear_rows`, what the whole model's quantized linears cost at 1,
2, 4, 8 and 16 rows. A decode step is 1 row; a k-token verify pass or a batch of users is more:
a kernel whose cost stays flat as rows grow makes speculation and batching pay.

The default model, loaded as the app loads it (dtype auto, weight_dtype auto: the GGUF's
tensors as stored); every quantized linear called once per pass in model order on random
activations, timed over REPEATS passes (median). The head (the tied Q8_0 embedding) is
timed apart: a decode step runs it on one row whatever the verify width.
`linear_rows_gb_s` is the body's bytes over its one-row time, beside `read_bandwidth_gb_s`,
what a large reduction reads per second in the same run (engine.speculative.step_costs).
"""
from __future__ import annotations

import statistics
import time

import torch

ROWS = (1, 2, 4, 8, 16)
REPEATS = 15


def linear_rows_bench(reference: str = "default", repeats: int = REPEATS) -> dict:
    from engine.engine import pick_dtype
    from engine.layers import quantized_linear
    from engine.loading.loader import load_model
    from engine.models.llama import Linear
    cpu = torch.device("cpu")
    dtype, why = pick_dtype("auto", cpu)
    loaded = load_model(reference, dtype=dtype)
    model = loaded.model
    body = [m.quant for m in model.modules() if isinstance(m, Linear) and m.quant is not None and m is not model.lm_head]
    head = model.lm_head.quant
    if not body:
        return {"message": f"no quantized linears: {loaded.weights.summary()}"}

    def timed(weights) -> dict[str, float]:
        """Median ms of one pass over `weights` at each row count. The row counts take turns
        pass by pass, so a neighbour's load or a clock change weighs on every count alike and
        the ratios between them hold on a shared machine."""
        gen = torch.Generator().manual_seed(0)
        xs = {n: {k: torch.randn(n, k, generator=gen).to(dtype) for k in {qw.shape[1] for qw in weights}} for n in ROWS}
        times = {n: [] for n in ROWS}
        for repeat in range(repeats + 1):       # the first round warms the caches: dropped
            for n in ROWS:
                start = time.perf_counter()
                for qw in weights:
                    quantized_linear.linear(xs[n][qw.shape[1]], qw, None)
                if repeat:
                    times[n].append(time.perf_counter() - start)
        return {str(n): round(statistics.median(t) * 1e3, 3) for n, t in times.items()}

    from engine.speculative.step_costs import read_bandwidth
    bandwidth = read_bandwidth()
    rows_ms = timed(body)
    body_bytes = sum(qw.nbytes for qw in body)
    result = {"model": reference, "dtype": f"{str(dtype).removeprefix('torch.')} ({why})",
              "weights": loaded.weights.summary(), "kernel": quantized_linear.path(),
              "threads": torch.get_num_threads(), "linears": len(body),
              "bytes": body_bytes, "repeats": repeats,
              "linear_rows": rows_ms,
              "ratio_to_1_row": {n: round(ms / rows_ms["1"], 3) for n, ms in rows_ms.items()},
              # one row reads every weight byte once: how close that comes to what this machine reads
              "linear_rows_gb_s": round(body_bytes / rows_ms["1"] / 1e6, 2),
              "read_bandwidth_gb_s": round(bandwidth / 1e9, 2)}
    result["fraction_of_bandwidth"] = round(result["linear_rows_gb_s"] / result["read_bandwidth_gb_s"], 3)
    if head is not None:
        head_ms = timed([head])
        result["head_rows"] = head_ms
        result["head_ratio_to_1_row"] = {n: round(ms / head_ms["1"], 3) for n, ms in head_ms.items()}
        result["head_gb_s"] = round(head.nbytes / head_ms["1"] / 1e6, 2)
    return result
