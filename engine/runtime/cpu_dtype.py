"""`dtype="auto"` on the CPU: the faster of fp32 and bf16 weights, measured on this CPU.

Decode reads every weight once per token, so a weight format's speed is how fast oneDNN's
linear reads it. The probe times one packed matrix-vector product per dtype on a matrix too
big for the caches (2048 x 8192: 64 MiB in fp32, 32 MiB in bf16), the way a decode step reads
it. On a CPU with AMX / AVX512-BF16, bf16 reads about twice as fast (half the bytes); where
bf16 has no native path, its conversions make it slower and fp32 wins. The result is kept per
CPU model, instruction set, torch version and thread count in the user cache folder (the
probe takes under a second).
"""
from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path

import torch

from engine.layers import packed_linear

PROBE_SHAPE = (8192, 2048)          # [out, in]
CANDIDATES = (torch.float32, torch.bfloat16)


def cpu_key() -> str:
    name = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{name} | {torch.backends.cpu.get_cpu_capability()} | torch {torch.__version__} | "
            f"{torch.get_num_threads()} threads")


def probe_seconds(dtype: torch.dtype, repeats: int = 15) -> float:
    """Median time of one 1-row linear over PROBE_SHAPE in `dtype`, packed as the engine packs."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(PROBE_SHAPE, generator=gen).to(dtype)
    packed, x = packed_linear.pack(weight), torch.randn(1, PROBE_SHAPE[1], generator=gen).to(dtype)
    del weight
    times = []
    for i in range(repeats + 3):
        t0 = time.perf_counter()
        packed_linear.linear(x, packed, None)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure() -> dict[str, float]:
    return {str(d).removeprefix("torch."): probe_seconds(d) for d in CANDIDATES}


def fastest(cache_file: Path) -> torch.dtype:
    """The faster weight dtype on this CPU (fp32 where oneDNN's packed linear is missing)."""
    if not packed_linear.AVAILABLE:
        return torch.float32
    key = cpu_key()
    try:
        known = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        known = {}
    if not isinstance(known, dict):
        known = {}
    if not isinstance(known.get(key), dict):
        known[key] = measure()
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(known, indent=1))
        tmp.replace(cache_file)
    seconds = known[key]
    return getattr(torch, min(seconds, key=seconds.get))
