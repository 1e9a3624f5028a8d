"""`dtype="auto"` on the CPU: the faster of fp32 and bf16, measured on this CPU.

Two measurements, each kept in the user cache folder:

- **The whole step, per model format** (`fastest_step`, what `auto` picks for a model
  LLMEngine.load loads). The dtype is the activations' as much as the weights': weights
  served as stored (a quantized GGUF's int4 / int8 groups) read the same bytes in either
  dtype, and the step around them (norms, rotary, attention, the sampler, the per-step
  Python) differs. So the engine loads the model in each candidate dtype, exactly as it will
  run it (weights as served, compiled or not), times a few decode steps, and keeps the
  faster: on both CPUs measured (AVX2, AVX-512 BF16) a Q4_1 GGUF decoded faster with fp32
  activations, while float weights read faster in bf16 where the CPU has it. The answer is
  kept per CPU key (below) and per model format: the architecture, how its weights are
  stored (engine.loading.loader.weights_format), and the weight_dtype and compile settings.
- **The float linear** (`fastest`, under a second): one packed matrix-vector product per
  dtype on a matrix too big for the caches (2048 x 8192: 64 MiB in fp32, 32 MiB in bf16),
  the way a decode step reads a float weight. It picks each dtype's fastest linear kernel
  (engine.layers.packed_linear.BACKENDS: ours, oneDNN; torch's matmul only where neither
  runs), and answers `auto` where no model is at hand (bench kernels).

Both are kept per CPU model, instruction set, torch version and thread count (`cpu_key`). A
dtype is timed only after a tiny forward pass's worth of its ops has run (`compute_refusal`);
a dtype whose kernels are missing (on an AVX2-only CPU oneDNN refuses bf16) or whose trial
failed is skipped with its reason and never picked.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

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


def cpu_key(threads: int | None = None) -> str:
    """What the probe's answer depends on: the CPU, its ISA as torch and oneDNN see it (a
    ONEDNN_MAX_CPU_ISA or ATEN_CPU_CAPABILITY cap changes it), torch and the threads (torch's
    count now, or `threads`: an engine's starting count, which its thread governor lowers
    while other programs keep cores busy)."""
    onednn = ",".join(dtype_name(d) for d in CANDIDATES if packed_linear.refusal(d) is None) or "none"
    from engine.kernels import cpu_linear
    ours = "none" if cpu_linear.refusal() else f"{cpu_linear.isa()} {cpu_linear.build_tag()}"
    return (f"v2 | {cpu_features.model_name()} | {cpu_features.isa_name()} | {torch.backends.cpu.get_cpu_capability()} | "
            f"oneDNN {onednn} | ours {ours} | torch {torch.__version__} | {threads or torch.get_num_threads()} threads")


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
    """The dtype whose float linear reads faster on this CPU, of those whose kernels run here
    (fp32 if none other does), and why. Each dtype's fastest linear backend becomes its
    preferred one (engine.layers.packed_linear.prefer)."""
    return _choice(_measured_once(cache_file, cpu_key(), measure))


def fastest_step(cache_file: Path, model_format: str, step_seconds: Callable[[torch.dtype], float]) -> DtypeChoice:
    """The dtype whose whole decode step runs faster for a model of `model_format` on this
    CPU, and why; measured once per CPU and model format by `step_seconds(dtype)` (seconds
    per decode step of the model loaded in that dtype, as the engine runs it)."""
    return step_choice(_measured_once(cache_file, step_key(model_format), lambda: measure_steps(step_seconds),
                                      keep=lambda measured: any(not isinstance(v, str) for v in measured.values())))


def step_key(model_format: str, threads: int | None = None) -> str:
    return f"{cpu_key(threads)} | {model_format}"


def measure_steps(step_seconds: Callable[[torch.dtype], float]) -> dict[str, float | str]:
    """Per candidate dtype: seconds per decode step, or why it was not timed (a string): its
    kernels are missing here, or a kernel failed in its trial. An error the engine names (a
    checkpoint that does not load: a WorkbenchError) is the model's, not the dtype's: it
    propagates, and nothing is kept."""
    out: dict[str, float | str] = {}
    for dtype in CANDIDATES:
        refused = compute_refusal(dtype)
        if refused is None:
            try:
                out[dtype_name(dtype)] = float(step_seconds(dtype))
                continue
            except RuntimeError as error:
                refused = f"{dtype_name(dtype)} did not run the model here: {first_line(error)}"
        out[dtype_name(dtype)] = refused
    return out


def step_choice(measured: dict) -> DtypeChoice:
    """The faster of the timed dtypes (fp32 when none ran); a dtype with a reason instead of
    a time is never picked."""
    timed = {name: s for name, s in measured.items()
             if isinstance(s, (int, float)) and not isinstance(s, bool) and s > 0 and hasattr(torch, name)}
    skipped = "; ".join(f"{name} skipped: {why}" for name, why in measured.items() if isinstance(why, str))
    if not timed:
        return DtypeChoice(torch.float32, f"auto: float32, no candidate ran the model's step ({skipped or 'none timed'})")
    chosen = min(timed, key=timed.get)
    figures = ", ".join(f"{name} {t * 1e3:.2f} ms" for name, t in sorted(timed.items(), key=lambda kv: kv[1]))
    return DtypeChoice(getattr(torch, chosen), f"auto: the faster decode step of this model here ({figures})"
                       + (f"; {skipped}" if skipped else ""))


def known_steps(cache_file: Path, model_format: str, threads: int | None = None) -> dict | None:
    """What the whole-step measurement found for this CPU, model format and thread count
    (an engine's starting count: its thread_governor.most), if it has run."""
    found = _read_cache(cache_file).get(step_key(model_format, threads))
    return found if isinstance(found, dict) else None


def _measured_once(cache_file: Path, key: str, measure_now: Callable[[], dict],
                   keep: Callable[[dict], bool] = lambda measured: True) -> dict:
    """known[key] from the cache file, measured now and written there if missing (unless
    `keep` says the result is not worth keeping: measured again next time)."""
    known = _read_cache(cache_file)
    if not isinstance(known.get(key), dict):
        known[key] = measure_now()
        if not keep(known[key]):
            return known[key]
        known = _read_cache(cache_file) | {key: known[key]}       # keep what another process wrote meanwhile
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1))
        tmp.replace(cache_file)
    return known[key]


def _read_cache(cache_file: Path) -> dict:
    try:
        known = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


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
