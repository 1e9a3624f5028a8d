"""What this CPU's instruction set offers, read from the kernel's flags (x86 Linux), and one
short name for it.

Everything CPU-specific keys on this: the llama.cpp build folder (a binary built on an
AVX-512 CPU dies with SIGILL on an AVX2-only one that shares the home folder), the dtype
probe's cache, the native kernels' build cache, and CI's first line. A flag read here is a
hint only: a path is relied on after it has been tried (engine.runtime.cpu_paths).
Imports nothing heavy: the build scripts call it before torch is needed.
"""
from __future__ import annotations

import functools
import platform
from pathlib import Path

# The flags that decide which SIMD code can run, in the order a name lists them.
SIMD_FLAGS = ("sse4_2", "avx", "f16c", "fma", "bmi2", "avx2", "avx_vnni", "avx512f", "avx512cd", "avx512vl",
              "avx512dq", "avx512bw", "avx512vbmi", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8",
              "amx_bf16")
AVX512_BASE = ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")   # what -mavx512* of ggml needs
AVX2_BASE = ("avx", "avx2", "fma", "f16c")


def parse_flags(cpuinfo: str) -> frozenset[str]:
    """The `flags` of the first processor in a /proc/cpuinfo text."""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


@functools.cache
def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


@functools.cache
def flags() -> frozenset[str]:
    return parse_flags(_cpuinfo())


def simd_flags(cpu_flags: frozenset[str] | None = None) -> list[str]:
    cpu_flags = flags() if cpu_flags is None else cpu_flags
    return [f for f in SIMD_FLAGS if f in cpu_flags]


def isa_name(cpu_flags: frozenset[str] | None = None) -> str:
    """A short name of the vector ISA: 'avx512-vbmi-vnni-bf16', 'avx512', 'avx2', 'avx', 'sse4' or
    the machine name (aarch64...). Two CPUs with one name run the same llama.cpp build."""
    cpu_flags = flags() if cpu_flags is None else cpu_flags
    if platform.machine() not in ("x86_64", "AMD64") and not cpu_flags & set(SIMD_FLAGS):
        return platform.machine() or "unknown"
    if all(f in cpu_flags for f in AVX512_BASE):
        extras = [name for flag, name in (("avx512vbmi", "vbmi"), ("avx512_vnni", "vnni"),
                                         ("avx512_bf16", "bf16")) if flag in cpu_flags]
        return "-".join(["avx512", *extras])
    if all(f in cpu_flags for f in AVX2_BASE):
        return "avx2-vnni" if "avx_vnni" in cpu_flags else "avx2"
    if "avx" in cpu_flags:
        return "avx"
    return "sse4" if "sse4_2" in cpu_flags else "x86-64"


def model_name() -> str:
    for line in _cpuinfo().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()
