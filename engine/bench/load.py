"""`python -m engine.bench load --synthetic PRESET | --model FOLDER [--device] [--dtype] --json`:
what a streaming load costs in memory and time, against the time to read the weight files.

The load runs in a fresh subprocess, so its peak RSS (resource.getrusage) is this load's
alone. There, every weight file is first read once untimed (so every timing sees a warm
page cache), then read twice more, timed:
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
as qwen3-1.7b-q4_k_m: PRESET.gguf, engine.loading.synthetic_gguf) and reused.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

READ_CHUNK = 64 * 2**20
RSS_FACTOR, RSS_SLACK = 1.3, 2**30
TIME_FACTOR = 2.0


def run_load_bench(model: str | None, synthetic: str | None, device: str | None, dtype: str | None) -> dict:
    folder = Path(_resolve(str(synthetic_checkpoint(synthetic)) if synthetic else model))
    cmd = [sys.executable, "-m", "engine.bench.load", str(folder), device or "auto", dtype or stored_dtype(folder)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the load subprocess failed:\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    basis = "file_bytes" if result["gguf"] else "weight_bytes"
    target_rss = RSS_FACTOR * result[basis] + RSS_SLACK
    return {"model": synthetic or str(model), "folder": str(folder), **result,
            "peak_rss_over_weights": result["peak_rss_bytes"] / result["weight_bytes"],
            "peak_rss_over_file": result["peak_rss_bytes"] / result["file_bytes"], "rss_target_basis": basis,
            "rss_target_bytes": int(target_rss), "rss_target_met": result["peak_rss_bytes"] <= target_rss,
            "load_over_read": result["load_s"] / result["read_s"],
            "load_over_read_new_memory": result["load_s"] / result["read_new_memory_s"],
            "time_target_met": result["load_s"] <= TIME_FACTOR * result["read_s"]}


def _resolve(model: str | None) -> Path:
    from engine.loading.loader import resolve
    return resolve(model)


def synthetic_checkpoint(preset: str) -> Path:
    """<cache>/synthetic/PRESET, written once (into a temporary folder, then renamed); a GGUF
    preset: <cache>/synthetic/PRESET.gguf."""
    from engine.loading.loader import cache_dir
    from engine.loading.synthetic import write_checkpoint
    from engine.loading.synthetic_gguf import SYNTHETIC_GGUF_PRESETS
    if preset in SYNTHETIC_GGUF_PRESETS:
        return synthetic_gguf(preset)
    folder = cache_dir() / "synthetic" / preset
    if (folder / "config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    print(f"writing the synthetic {preset} checkpoint to {folder} (once)", file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{preset}-"))
    write_checkpoint(tmp, preset)
    os.replace(tmp, folder)
    return folder


def synthetic_gguf(preset: str) -> Path:
    """<cache>/synthetic/PRESET.gguf, written once (to a temporary name, then renamed)."""
    from engine.loading.loader import cache_dir
    from engine.loading.synthetic_gguf import SYNTHETIC_GGUF_PRESETS, write_gguf
    path = cache_dir() / "synthetic" / f"{preset}.gguf"
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
    from engine.loading.weight_quant import FLOAT_TYPES
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
    """ru_maxrss is KiB on Linux (bytes on macOS); the resource module is POSIX only."""
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
