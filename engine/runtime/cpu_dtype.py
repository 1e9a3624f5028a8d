"""`dtype="auto"` on the CPU: the faster of fp32 and bf16, measured on this CPU.

Two measurements, each kept in the user cache folder:

- **The whole step, per model format** (`fastest_step`, what `auto` picks for a model
  LLMEngine.load loads; `step_choice`). The dtype is the activations' as much as the weights': weights
  served as stored (a quantized GGUF's int4 / int8 groups) read the same bytes in either
  dtype, and the step around them (norms, rotary, attention, the sampler, the per-step
  Python) differs. So the engine loads the model in each candidate dtype, exactly as it will
  run it (weights as served, compiled or not), times a few decode steps of one user and of
  TRIAL_USERS at once, and keeps the cheaper over both (`step_choice`: one user's win does
  not buy a loss under load; issue 62 saw fp32 chosen on one row lose 4.3x at 16 users), bf16
  on a tie within TIE: on both CPUs measured (AVX2, AVX-512 BF16) a Q4_1 GGUF decoded one
  user faster with fp32 activations, while float weights read faster in bf16 where the CPU
  has it. The answer is
  kept per CPU key (below) and per model format: the architecture, how its weights are
  stored (engine.loading.loader.weights_format), and the weight_dtype and compile settings.
- **The float linear** (`fastest`, under a second): one packed matrix-vector product per
  dtype on a matrix too big for the caches (2048 x 8192: 64 MiB in fp32, 32 MiB in bf16),
  the way a decode step reads a float weight. It picks each dtype's fastest linear kernel
  (engine.layers.packed_linear.BACKENDS: ours, oneDNN; torch's matmul only where neither
  runs), and answers `auto` where no model is at hand (bench kernels).

Both are kept per CPU model, instruction set, torch version and thread count (`cpu_key`),
the whole step's also per version of the engine (`step_key`). A
dtype is timed only after a tiny forward pass's worth of its ops has run (`compute_refusal`);
a dtype whose kernels are missing (on an AVX2-only CPU oneDNN refuses bf16) or whose trial
failed is skipped with its reason and never picked.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from engine import cpu_features
from engine.config import EngineConfig, SamplingParams
from engine.errors import first_line
from engine.layers import packed_linear
from engine.loading import loader
from engine.user_cache import measured_once, read_cache

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
    return _choice(measured_once(cache_file, cpu_key(), measure))


def fastest_step(cache_file: Path, model_format: str, step_seconds: Callable[[torch.dtype], float]) -> DtypeChoice:
    """The dtype whose whole decode step runs faster for a model of `model_format` on this
    CPU, and why; measured once per CPU and model format by `step_seconds(dtype)` (seconds
    per decode step of the model loaded in that dtype, as the engine runs it)."""
    return step_choice(measured_once(cache_file, step_key(model_format), lambda: measure_steps(step_seconds),
                                      keep=lambda measured: any(not isinstance(v, str) for v in measured.values())))


def step_key(model_format: str, threads: int | None = None) -> str:
    """cpu_key, the engine's version (a step's speed is the engine's code as much as the CPU's:
    a trial kept from an earlier version chose bf16 by 9.17 against 9.39 ms, and once the graph's
    own kernels stopped opening OpenMP regions a fresh one chose fp32 by 8.08 against 8.27 ms)
    and the model's format."""
    from engine.runtime.compiled_step import engine_source_tag
    return f"{cpu_key(threads)} | engine {engine_source_tag()} | {model_format}"


def measure_steps(step_seconds: Callable[[torch.dtype], float | dict]) -> dict[str, float | dict | str]:
    """Per candidate dtype: seconds per decode step (one user's, or {users: seconds} as the
    trial times them), or why it was not timed (a string): its
    kernels are missing here, or a kernel failed in its trial. An error the engine names (a
    checkpoint that does not load: a WorkbenchError) is the model's, not the dtype's: it
    propagates, and nothing is kept."""
    out: dict[str, float | str] = {}
    for dtype in CANDIDATES:
        refused = compute_refusal(dtype)
        if refused is None:
            try:
                seconds = step_seconds(dtype)
                out[dtype_name(dtype)] = ({str(r): float(t) for r, t in seconds.items()} if isinstance(seconds, dict)
                                          else float(seconds))
                continue
            except RuntimeError as error:
                refused = f"{dtype_name(dtype)} did not run the model here: {first_line(error)}"
        out[dtype_name(dtype)] = refused
    return out


def step_choice(measured: dict) -> DtypeChoice:
    """The dtype whose steps cost least (fp32 when none ran); a dtype with a reason instead of a
    time is never picked. A dtype's time is its seconds per decode step of one user, or, as the
    trial measures them, per step at each number of users ({"1": s, "8": s}): each row count's
    time over the best dtype's at that count, averaged over the counts both have, so a dtype
    that wins one user by 10% and loses eight by 4x is not picked. Within TIE of each other
    the one named first in TIE_ORDER is (the same answer from one process to the next when
    the timings differ by noise)."""
    timed = {name: _per_rows(s) for name, s in measured.items() if _per_rows(s) and hasattr(torch, name)}
    skipped = "; ".join(f"{name} skipped: {why}" for name, why in measured.items() if isinstance(why, str))
    if not timed:
        return DtypeChoice(torch.float32, f"auto: float32, no candidate ran the model's step ({skipped or 'none timed'})")
    rows = sorted(set.intersection(*(set(t) for t in timed.values())), key=int)
    best = {r: min(t[r] for t in timed.values()) for r in rows}
    cost = {name: statistics.fmean(t[r] / best[r] for r in rows) for name, t in timed.items()}
    fastest = min(cost, key=cost.get)
    tied = [name for name in TIE_ORDER if cost.get(name, float("inf")) <= cost[fastest] * (1 + TIE)]
    chosen = tied[0] if tied else fastest
    figures = "; ".join(f"{name} " + ", ".join(f"{t[r] * 1e3:.2f} ms" + (f" at {r} user{'' if r == '1' else 's'}" if len(rows) > 1 else "")
                                                for r in rows)
                        for name, t in sorted(timed.items(), key=lambda kv: cost[kv[0]]))
    how = ("the cheaper decode steps of this model here, one user and many" if len(rows) > 1
           else "the faster decode step of this model here")
    tie = f", within {TIE:.0%}: {chosen} on a tie" if chosen != fastest or len(tied) > 1 else ""
    return DtypeChoice(getattr(torch, chosen), f"auto: {how} ({figures}{tie})" + (f"; {skipped}" if skipped else ""))


TIE = 0.03                              # costs this close are noise on a quiet machine
TIE_ORDER = ("bfloat16", "float32")     # on a tie: half the bytes of every float tensor


def _per_rows(seconds) -> dict[str, float] | None:
    """{users: seconds per step} of a measurement (a number: one user's), None if not a time."""
    if isinstance(seconds, dict):
        found = {str(r): float(s) for r, s in seconds.items() if isinstance(s, (int, float)) and s > 0}
        return found if "1" in found else None
    if isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and seconds > 0:
        return {"1": float(seconds)}
    return None


def known_steps(cache_file: Path, model_format: str, threads: int | None = None) -> dict | None:
    """What the whole-step measurement found for this CPU, model format and thread count
    (an engine's starting count: its thread_governor.most), if it has run."""
    found = read_cache(cache_file).get(step_key(model_format, threads))
    return found if isinstance(found, dict) else None


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


# ---- the whole step's trial (LLMEngine.load's, through fastest_step) ----------------------
STEP_DTYPE_CACHE = "cpu_dtype_step.json"
TRIAL_TEXT = "The quick brown fox jumps over the lazy dog, and then"
TRIAL_TOKENS, TRIAL_RUNS, TRIAL_BLOCKS = 16, 3, 32
TRIAL_USERS = 8                 # the many-users step the trial also times (a serving load, a verify of 7 drafts)


class DtypeTrial:
    """`dtype auto` on the CPU, the first time this CPU meets a model format: the model
    LLMEngine.load is about to load, loaded in a candidate dtype and run as the engine will
    run it (weights as served, compiled as `config` says), timed over a few decode steps
    after a warm-up. The faster load is kept for the engine, so the winner is not loaded
    again; the slower one is freed before the next candidate loads, unless both fit with room.
    engine_class: the engine that runs each candidate (engine.engine.LLMEngine; the runtime
    does not import the request path)."""

    def __init__(self, engine_class, reference, config: EngineConfig, progress: loader.Progress, **load_options):
        self.model_format = model_format(reference, config, load_options.get("allow_hub", False))
        self.engine_class = engine_class
        self.reference, self.config, self.progress, self.load_options = reference, config, progress, load_options
        self.kept: tuple[torch.dtype, loader.LoadedModel] | None = None
        self.measured: dict[str, dict[str, float]] = {}     # what step_choice weighs, so far
        self.tried, self.shown = 0, 0.0          # candidates loaded so far; the progress bar's fraction

    def step_seconds(self, dtype: torch.dtype) -> dict[str, float]:
        """Seconds per decode step of the model in `dtype`, of one user and of TRIAL_USERS at
        once ({"1": s, "8": s}: medians over TRIAL_RUNS)."""
        name, index, share = dtype_name(dtype), self.tried, loader.WEIGHTS_START / len(CANDIDATES)
        self.tried += 1

        def said(message: str, fraction: float) -> None:
            # each candidate's load and compile within its share of the bar before the weights', never going back
            self.shown = max(self.shown, share * (index + min(fraction, 1.0)))
            self.progress(f"dtype auto: timing {name} once on this CPU: {message}", self.shown)
        if self.kept is not None and not _room_for_another(self.kept[1].model):
            self.kept = None                 # the winner, if it was this one, is loaded again
        loaded = loader.load_model(self.reference, device="cpu", dtype=dtype, progress=said,
                                   max_positions=self.config.max_model_len, weight_dtype=self.config.weight_dtype,
                                   **self.load_options)
        trial = EngineConfig(device="cpu", dtype=name, weight_dtype=self.config.weight_dtype, compile=self.config.compile,
                             max_model_len=self.config.max_model_len, enable_prefix_caching=False,
                             num_blocks=TRIAL_BLOCKS)
        threads = torch.get_num_threads()        # the engine's thread governor may lower it while it runs
        try:
            engine = self.engine_class(loaded, trial, torch.device("cpu"), said, dtype_why="dtype auto's trial")
            engine.warm_compiled_step()
            seconds = {"1": decode_step_seconds(engine), str(TRIAL_USERS): batch_step_seconds(engine, TRIAL_USERS)}
            del engine
        finally:
            torch.set_num_threads(threads)      # each candidate, and the engine after, start with as many
        self.measured[name] = seconds
        chosen = step_choice(self.measured).dtype       # of those timed so far: the one to keep
        if chosen is dtype:
            self.kept = (dtype, loaded)
        return seconds

    def take(self, dtype: torch.dtype) -> loader.LoadedModel | None:
        """The model already loaded in `dtype`, if the trial kept it."""
        kept, self.kept = self.kept, None
        return kept[1] if kept is not None and kept[0] == dtype else None


def model_format(reference, config: EngineConfig, allow_hub: bool = False) -> str:
    """What `dtype auto`'s step measurement is kept under, beside the CPU: the model's
    architecture and stored weights (engine.loading.loader.weights_format) and the settings
    that change how they run."""
    folder = loader.resolve(reference, allow_hub=allow_hub)
    return f"{loader.weights_format(folder)} | weight_dtype {config.weight_dtype} | compile {config.compile}"


def decode_step_seconds(engine) -> float:
    """Median seconds per decode step of `engine` (an LLMEngine) over TRIAL_RUNS replies of
    TRIAL_TOKENS tokens (one reply first, unmeasured: its compiled shapes, caches). Decode time
    excludes the prefill and any compile (engine.metrics.RequestStats)."""
    ids = engine.tokenizer.encode(TRIAL_TEXT)
    params = SamplingParams(max_tokens=TRIAL_TOKENS, stop_on_eos=False)
    engine.generate_text(ids, params)
    per_step = []
    for _ in range(TRIAL_RUNS):
        stats = engine.generate_text(ids, params)[2]
        per_step.append(stats.decode_time_s / max(1, stats.decode_tokens))
    return statistics.median(per_step)


def batch_step_seconds(engine, users: int) -> float:
    """Median seconds per step of `engine` decoding `users` replies of TRIAL_TOKENS at once (the
    step that prefills them not counted), over TRIAL_RUNS rounds after one unmeasured."""
    ids = engine.tokenizer.encode(TRIAL_TEXT)
    params = SamplingParams(max_tokens=TRIAL_TOKENS, stop_on_eos=False)

    def one_round() -> float:
        for _ in range(users):
            engine.submit(ids, params)
        engine.step()                   # the prefills
        steps = []
        while engine.has_work:
            start = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - start)
        return statistics.median(steps)
    one_round()
    return statistics.median(one_round() for _ in range(TRIAL_RUNS))


def _room_for_another(model) -> bool:
    """Whether `model` may stay loaded while the next candidate loads: a second copy of its
    weights fits in the memory free now with as much again to spare, and it is small (an 8B's
    5 GB kept beside the next doubled the load's peak memory; it loads again in seconds)."""
    from engine.cache.memory_plan import weights_bytes
    held = weights_bytes(model)
    return held <= KEEP_WHILE_LOADING_BYTES and _available_ram() > 3 * held


KEEP_WHILE_LOADING_BYTES = 2**30    # a trial's candidate larger than this is freed before the next loads


def _available_ram() -> int:
    """Bytes of memory free for a new allocation now (0 when it cannot be read: nothing is kept)."""
    try:
        import psutil
        return psutil.virtual_memory().available
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as meminfo:
            return next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return 0
