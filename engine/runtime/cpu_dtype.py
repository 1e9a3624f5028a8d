"""`dtype="auto"` on the CPU: the faster of fp32 and bf16 weights, measured on this CPU.

Decode reads every weight once per token, so a weight format's speed is how fast oneDNN's
linear reads it. The probe times one packed matrix-vector product per dtype on a matrix too
big for the caches (2048 x 8192: 64 MiB in fp32, 32 MiB in bf16), the way a decode step reads
it. On a CPU with AMX / AVX512-BF16, bf16 reads about twice as fast (half the bytes); where
bf16 has no native path, its conversions make it slower and fp32 wins. The result is kept per
CPU model, instruction set, torch version and thread count in the user cache folder (the
probe takes under a second).

A dtype is timed on each linear kernel that runs it here (engine.layers.packed_linear.BACKENDS:
ours, oneDNN; torch's matmul only where neither does), after a tiny forward pass's worth of
its ops has run (`compute_refusal`); each dtype then prefers its fastest kernel. A dtype
whose kernels are missing is skipped with its reason, never a crash: on an AVX2-only CPU
oneDNN refuses bf16, and bf16 is timed on our CPU linear instead.
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engine import cpu_features
from engine.errors import first_line
from engine.layers import packed_linear

PROBE_SHAPE = (8192, 2048)          # [out, in]
CANDIDATES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    why: str                    # what "In effect" says of it


def cpu_key() -> str:
    """What the probe's answer depends on: the CPU, its ISA as torch and oneDNN see it (a
    ONEDNN_MAX_CPU_ISA or ATEN_CPU_CAPABILITY cap changes it), torch and the threads."""
    onednn = ",".join(dtype_name(d) for d in CANDIDATES if packed_linear.refusal(d) is None) or "none"
    from engine.kernels import cpu_linear
    ours = "none" if cpu_linear.refusal() else f"{cpu_linear.isa()} {cpu_linear.build_tag()}"
    return (f"v2 | {cpu_features.model_name()} | {cpu_features.isa_name()} | {torch.backends.cpu.get_cpu_capability()} | "
            f"oneDNN {onednn} | ours {ours} | torch {torch.__version__} | {torch.get_num_threads()} threads")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def compute_refusal(dtype: torch.dtype) -> str | None:
    """Why a forward pass cannot run in `dtype` on this CPU (None: a tiny one ran): its linear
    as the engine calls it, a norm, rotary, softmax attention and SiLU."""
    gen = torch.Generator().manual_seed(0)
    try:
        x = torch.randn(3, 64, generator=gen).to(dtype)
        h = packed_linear.linear(x, torch.randn(64, 64, generator=gen).to(dtype), None)
        h = h * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(dtype)
        h = h * torch.cos(h) + torch.sin(h)
        attn = torch.softmax((h @ h.t()).float(), dim=-1).to(dtype) @ h
        out = F.silu(attn) * attn
    except RuntimeError as error:
        return f"{dtype_name(dtype)} kernels are missing on this CPU: {first_line(error)}"
    if not torch.isfinite(out.float()).all():
        return f"{dtype_name(dtype)} gave non-finite results on this CPU"
    return None


def probe_seconds(dtype: torch.dtype, backend: str, repeats: int = 9) -> float:
    """Median time of a 1-row plus a 5-row linear (a decode step, a k = 4 verify pass) over
    PROBE_SHAPE in `dtype` on linear `backend`, packed as the engine packs."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(PROBE_SHAPE, generator=gen).to(dtype)
    with packed_linear.preferring(dtype, backend):
        packed = packed_linear.pack(weight) if packed_linear.packable(weight) else weight
    del weight
    xs = [torch.randn(rows, PROBE_SHAPE[1], generator=gen).to(dtype) for rows in (1, 5)]
    times = []
    for i in range(repeats + 2):
        t0 = time.perf_counter()
        for x in xs:
            packed_linear.linear(x, packed, None)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure() -> dict[str, dict[str, float] | str]:
    """Per candidate dtype: seconds per linear backend that runs it here, or why the dtype
    was skipped (a string). Torch's matmul is timed only where no other backend runs."""
    out = {}
    for dtype in CANDIDATES:
        skipped = compute_refusal(dtype)
        if skipped:
            out[dtype_name(dtype)] = skipped
            continue
        runs = [b for b in packed_linear.BACKENDS if b not in packed_linear.refusals(dtype)]
        out[dtype_name(dtype)] = {b: probe_seconds(dtype, b) for b in (runs[:-1] if len(runs) > 1 else runs)}
    return out


def fastest(cache_file: Path) -> DtypeChoice:
    """The faster weight dtype on this CPU, of those whose kernels run here (fp32 if none
    other does), and why. Each dtype's fastest linear backend becomes its preferred one
    (engine.layers.packed_linear.prefer)."""
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
    return _choice(known[key])


def _choice(measured: dict) -> DtypeChoice:
    best = {}                       # dtype name -> (seconds, backend)
    for name, timed in measured.items():
        if isinstance(timed, dict) and timed and hasattr(torch, name):
            backend = min(timed, key=timed.get)
            best[name] = (timed[backend], backend)
            packed_linear.prefer(getattr(torch, name), backend)
    skipped = "; ".join(f"{name} skipped: {why}" for name, why in measured.items() if isinstance(why, str))
    if not best:
        return DtypeChoice(torch.float32, f"auto: float32, no candidate ran the probe ({skipped})")
    chosen = min(best, key=lambda name: best[name][0])
    timed = ", ".join(f"{name} on {b} {t * 1e3:.2f} ms" for name, (t, b) in sorted(best.items(), key=lambda kv: kv[1]))
    return DtypeChoice(getattr(torch, chosen), f"auto: the faster here (probe linear {timed})"
                       + (f"; {skipped}" if skipped else ""))
