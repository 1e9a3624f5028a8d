"""`python -m engine.bench load --synthetic PRESET | --model FOLDER [--device] [--dtype] --json`:
what a streaming load costs in memory and time, against the time to read the weight files.

The load runs in a fresh subprocess, so its peak RSS (Linux's VmHWM; elsewhere
resource.getrusage) is this load's alone. There, every weight file is first read once
untimed (so every timing sees a warm page cache), then read twice more, timed:
  - `read_s`: into one reused 64 MiB buffer: the kernel's copy alone, the lower bound;
  - `read_new_memory_s`: 64 MiB `read()` calls, each into a new buffer, as reading a file
    into memory normally goes: this adds the page faults of fresh memory, which a load
    pays too (its weights need new memory) and which are slow on some virtual machines.
Then the model is loaded (`load_s`: loader.load_model with its checks, tokenizer and
RoPE tables; Python modules are imported before the clock starts).
Targets (issue 11): peak RSS <= 1.3 x weight bytes + 1 GiB; load_s <= 2 x read_s. For a
GGUF (issue 29) the RSS target is on the file's size instead, and the report says how each
stored type is served (`served`) and whether every quantized tensor is served as stored
(`all_quantized_as_stored`): the model is loaded in bfloat16 with weight_dtype auto.

A synthetic checkpoint is written once to <user cache>/synthetic/PRESET (a GGUF preset such
as qwen3-1.7b-q4_k_m: PRESET.gguf, engine.loading.synthetic_gguf) and reused. A preset whose
every layer would not fit this machine (qwen3-30b-a3b: 57 GiB in bf16, gpt-oss-20b: 39 GiB)
is written with fewer layers, <cache>/synthetic/PRESET-NL: `--layers N`, or by default as
many as fit (`layers_that_fit`): the load's RSS target (1.3 x weights + 1 GiB) and the
checkpoint's page cache (the timed reads are warm) together within LOAD_RAM_SHARE of the
memory available now. Each layer has the released model's shapes (all its experts), so the
figures per layer are the real model's; the report says how many layers ran and why.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from engine.errors import ConfigError

READ_CHUNK = 64 * 2**20
RSS_FACTOR, RSS_SLACK = 1.3, 2**30
TIME_FACTOR = 2.0
LOAD_RAM_SHARE = 0.8            # of the memory available: the load's RSS target and the page cache


def run_load_bench(model: str | None, synthetic: str | None, device: str | None, dtype: str | None,
                   layers: int | None = None) -> dict:
    reduced = synthetic_layers(synthetic, layers) if synthetic else None
    folder = Path(_resolve(str(synthetic_checkpoint(synthetic, reduced and reduced["layers"])) if synthetic else model))
    cmd = [sys.executable, "-m", "engine.bench.load", str(folder), device or "auto", dtype or stored_dtype(folder)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the load subprocess failed:\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    basis = "file_bytes" if result["gguf"] else "weight_bytes"
    target_rss = RSS_FACTOR * result[basis] + RSS_SLACK
    return {"model": synthetic or str(model), "folder": str(folder), "synthetic_layers": reduced, **result,
            "peak_rss_over_weights": result["peak_rss_bytes"] / result["weight_bytes"],
            "peak_rss_over_file": result["peak_rss_bytes"] / result["file_bytes"], "rss_target_basis": basis,
            "rss_target_bytes": int(target_rss), "rss_target_met": result["peak_rss_bytes"] <= target_rss,
            "load_over_read": result["load_s"] / result["read_s"],
            "load_over_read_new_memory": result["load_s"] / result["read_new_memory_s"],
            "time_target_met": result["load_s"] <= TIME_FACTOR * result["read_s"]}


def _resolve(model: str | None) -> Path:
    from engine.loading.loader import resolve
    return resolve(model)


def synthetic_checkpoint(preset: str, layers: int | None = None) -> Path:
    """<cache>/synthetic/PRESET (with `layers` fewer than the preset's: PRESET-<layers>L),
    written once (into a temporary folder, then renamed); a GGUF preset:
    <cache>/synthetic/PRESET.gguf."""
    from engine.loading.synthetic_gguf import SYNTHETIC_GGUF_PRESETS
    if preset in SYNTHETIC_GGUF_PRESETS:
        return synthetic_gguf(preset)
    fields = reduced_preset(preset, layers)
    return shape_checkpoint(preset if fields == preset else f"{preset}-{layers}L", fields)


def shape_checkpoint(name: str, fields) -> Path:
    """<cache>/synthetic/NAME: a random-weight checkpoint of a preset (or a preset's fields
    changed; engine.loading.synthetic), written once (into a temporary folder, renamed)."""
    from engine.loading.loader import cache_dir
    from engine.loading.synthetic import write_checkpoint
    folder = cache_dir() / "synthetic" / name
    if (folder / "config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    print(f"writing the synthetic {name} checkpoint to {folder} (once)", file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{name}-"))
    write_checkpoint(tmp, fields)
    os.replace(tmp, folder)
    return folder


def reduced_preset(preset: str, layers: int | None) -> str | dict:
    """The preset with its first `layers` layers (their layer types too: gpt-oss alternates
    window and full layers), or the preset itself when that is all of them."""
    from engine.loading.synthetic import PRESETS
    fields = PRESETS[preset]
    if layers is None or layers == fields["num_hidden_layers"]:
        return preset
    if not 1 <= layers <= fields["num_hidden_layers"]:
        raise ConfigError(f"--layers must be 1..{fields['num_hidden_layers']} for {preset}, got {layers}")
    reduced = {"preset": preset, "num_hidden_layers": layers}
    if "layer_types" in fields:
        reduced["layer_types"] = fields["layer_types"][:layers]
    return reduced


def synthetic_layers(preset: str, layers: int | None) -> dict | None:
    """How many layers of a (non-GGUF) preset the load runs, and why: asked (--layers), or as
    many as fit (layers_that_fit). None for a GGUF preset (always whole)."""
    from engine.loading.synthetic import PRESETS
    if preset not in PRESETS:
        return None
    total = PRESETS[preset]["num_hidden_layers"]
    per_layer, fixed = layer_bytes(preset)
    available = available_ram_bytes()
    fit = layers_that_fit(per_layer, fixed, available, total)
    cached = max((n for n in cached_layer_counts(preset) if n <= fit), default=None)
    chosen = layers if layers is not None else cached or fit
    why = ("asked for (--layers)" if layers is not None else "all of them fit" if chosen == total else
           f"{fit} fit: {1 + RSS_FACTOR:g} x weights + {RSS_SLACK / 2**30:g} GiB within {LOAD_RAM_SHARE:g} x the "
           f"{available / 2**30:.1f} GiB available (the RSS target and the page cache)"
           + (f"; the cached {chosen}-layer checkpoint is reused" if chosen != fit else "") + "; --layers N to choose")
    return {"layers": chosen, "of": total, "why": why, "bytes_per_layer": per_layer,
            "bytes_outside_layers": fixed, "weight_bytes_all_layers": fixed + total * per_layer,
            "available_ram_bytes": available}


def cached_layer_counts(preset: str) -> list[int]:
    """The layer counts of this preset's cut checkpoints already written (<cache>/synthetic/
    PRESET-NL): the default reuses the largest that fits rather than write another one
    whenever the memory available moves by a layer's worth."""
    from engine.loading.loader import cache_dir
    counts = []
    for folder in (cache_dir() / "synthetic").glob(f"{preset}-*L"):
        count = folder.name[len(preset) + 1:-1]
        if count.isdigit() and (folder / "config.json").is_file():
            counts.append(int(count))
    return sorted(counts)


def layers_that_fit(per_layer: int, fixed: int, available: int, total: int) -> int:
    """The most layers (at least 1) whose weights W keep the load's RSS target and the files'
    page cache, (1 + RSS_FACTOR) x W + RSS_SLACK, within LOAD_RAM_SHARE x available."""
    room = (LOAD_RAM_SHARE * available - RSS_SLACK) / (1 + RSS_FACTOR) - fixed
    return max(1, min(total, int(room // per_layer)))


def layer_bytes(preset: str) -> tuple[int, int]:
    """(bytes of the largest decoder layer, bytes of the rest: embedding, head, norm) in the
    checkpoint's dtype (bf16), from our model built on the meta device."""
    from engine.bench.model_memory import meta_model
    from engine.cache.memory_plan import weights_bytes
    from engine.loading.synthetic import make_config
    model = meta_model(make_config(preset))
    layers = [weights_bytes(layer) for layer in model.layers]
    return max(layers), weights_bytes(model) - sum(layers)


def available_ram_bytes() -> int:
    """Memory available now (Linux's MemAvailable; psutil elsewhere; else total RAM)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil
        return psutil.virtual_memory().available
    except ImportError:
        from engine.cache.memory_plan import ram_bytes
        return ram_bytes()


def synthetic_gguf_path(preset: str) -> Path:
    """Where synthetic_gguf keeps a GGUF preset's file (it may not be written yet)."""
    from engine.loading.loader import cache_dir
    return cache_dir() / "synthetic" / f"{preset}.gguf"


def synthetic_gguf(preset: str) -> Path:
    """<cache>/synthetic/PRESET.gguf, written once (to a temporary name, then renamed)."""
    from engine.loading.synthetic_gguf import SYNTHETIC_GGUF_PRESETS, write_gguf
    path = synthetic_gguf_path(preset)
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    print(f"writing the synthetic {preset} GGUF to {path} (once)", file=sys.stderr)
    tmp = path.with_name(f".{path.name}.tmp")
    write_gguf(tmp, *SYNTHETIC_GGUF_PRESETS[preset])
    os.replace(tmp, path)
    return path


def stored_dtype(folder: Path) -> str:
    """The dtype the checkpoint stores (of its first floating-point tensor); a GGUF's
    quantized tensors are served as stored in bfloat16."""
    from engine.loading.checkpoint import Checkpoint
    from engine.loading.loader import gguf_of
    if gguf_of(folder) is not None:
        return "bfloat16"
    names = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
    dtypes = [t.dtype for t in Checkpoint.open(folder).tensors.values() if t.dtype in names]
    return names[dtypes[0]] if dtypes else "float32"


# ---- the subprocess ----------------------------------------------------------------
def measure(folder: Path, device: str, dtype_name: str) -> dict:
    import torch
    from engine.cache.memory_plan import weights_bytes
    from engine.engine import pick_device
    from engine.loading.loader import load_config, load_model, open_checkpoint
    from engine.loading.stored_formats import FLOAT_TYPES
    from transformers import AutoConfig, AutoTokenizer  # noqa: F401 - imports are not part of a load
    device = str(pick_device(device))
    checkpoint = open_checkpoint(folder, load_config(folder))
    files = checkpoint.files
    rss_before = _peak_rss()
    read_files(files)                                   # warm the page cache, untimed
    t0 = time.perf_counter()
    file_bytes = read_files(files)
    read_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    read_files(files, reuse_buffer=False)
    read_new_memory_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    loaded = load_model(str(folder), device=device, dtype=getattr(torch, dtype_name))
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    gguf = getattr(checkpoint, "source", None)
    served = loaded.weights.as_dict() if loaded.weights else None
    stored_types = {gguf.type_of(n) for n in checkpoint.tensors} - set(FLOAT_TYPES) if gguf else set()
    return {"device": device, "dtype": dtype_name, "weight_bytes": weights_bytes(loaded.model),
            "gguf": gguf is not None, "weights": served, "stored_types": sorted(stored_types),
            "all_quantized_as_stored": None if gguf is None else bool(served) and all(
                "as stored" in served["served"].get(t, "") for t in stored_types),
            "file_bytes": file_bytes, "shards": len(files), "read_s": read_s,
            "read_new_memory_s": read_new_memory_s, "load_s": load_s,
            "peak_rss_bytes": _peak_rss(), "rss_before_load_bytes": rss_before, "vm_hwm_bytes": _vm_hwm(),
            "page_cache": "warm (files read once before timing)", "threads": torch.get_num_threads()}


def read_files(files: list[Path], reuse_buffer: bool = True) -> int:
    view, total = memoryview(bytearray(READ_CHUNK)), 0
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while n := (f.readinto(view) if reuse_buffer else len(f.read(READ_CHUNK))):
                total += n
    return total


def _peak_rss() -> int:
    """This process's peak RSS: Linux's VmHWM where there is one (an exec'd process's
    ru_maxrss starts from its parent's peak, so a load run from a large process, as in `bench
    all` or a test session, would report the parent's); else ru_maxrss, which is KiB on Linux
    (bytes on macOS); the resource module is POSIX only."""
    hwm = _vm_hwm()
    if hwm is not None:
        return hwm
    import resource
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _vm_hwm() -> int | None:
    """Linux's own count of this process's peak RSS: a cross-check of ru_maxrss, which an
    exec'd process inherits from its parent's peak when that was higher."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    line = next((l for l in text.splitlines() if l.startswith("VmHWM:")), None)
    return int(line.split()[1]) * 1024 if line else None


if __name__ == "__main__":
    print(json.dumps(measure(Path(sys.argv[1]), sys.argv[2], sys.argv[3])))
