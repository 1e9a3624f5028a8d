"""The workbench's user cache folder: platformdirs' user_cache_dir("inference-workbench"), or
$WORKBENCH_CACHE_DIR. It lies outside every clone, so what is built there once (llama.cpp,
the vLLM venv, converted weights) serves every clone on the machine.
Imports nothing heavy: the build scripts call it before torch is needed.
"""
from __future__ import annotations

import os
from pathlib import Path

APP_NAME = "inference-workbench"
CACHE_ENV = "WORKBENCH_CACHE_DIR"


def root() -> Path:
    from platformdirs import user_cache_dir
    return Path(os.environ.get(CACHE_ENV) or user_cache_dir(APP_NAME))
