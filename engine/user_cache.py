"""The workbench's user cache folder: platformdirs' user_cache_dir("inference-workbench"), or
$WORKBENCH_CACHE_DIR. It lies outside every clone, so what is built there once (llama.cpp,
the vLLM venv, converted weights) serves every clone on the machine.
Imports nothing heavy: the build scripts call it before torch is needed.

Measurements are kept there per key in JSON files (a CPU's dtype trial, its quantized
kernel's paths: `measured_once`): measured once, read back by every later process. A file
that is missing or not JSON reads as empty; a write keeps what another process wrote meanwhile.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

APP_NAME = "inference-workbench"
CACHE_ENV = "WORKBENCH_CACHE_DIR"


def root() -> Path:
    from platformdirs import user_cache_dir
    return Path(os.environ.get(CACHE_ENV) or user_cache_dir(APP_NAME))


def measured_once(cache_file: Path, key: str, measure_now: Callable[[], dict],
                  keep: Callable[[dict], bool] = lambda measured: True,
                  valid: Callable[[dict], bool] = lambda measured: True) -> dict:
    """known[key] from the cache file, measured now and written there if missing or not
    `valid` (unless `keep` says the result is not worth keeping: measured again next time)."""
    known = read_cache(cache_file)
    if not (isinstance(known.get(key), dict) and valid(known[key])):
        known[key] = measure_now()
        if not keep(known[key]):
            return known[key]
        known = read_cache(cache_file) | {key: known[key]}       # keep what another process wrote meanwhile
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1))
        tmp.replace(cache_file)
    return known[key]


def read_cache(cache_file: Path) -> dict:
    try:
        known = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}
