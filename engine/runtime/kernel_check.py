"""Whether each of our native CPU kernels runs where it should: `python -m engine.runtime.cpu_paths
--require`, the first check of scripts/test.sh.

On a user's machine a kernel that refuses falls back and says why (engine.runtime.cpu_paths).
A refusal is excused only where this machine cannot build the library: no C++ compiler (the
one torch.utils.cpp_extension calls: $CXX, else c++). Where one is found, every kernel must
build and pass its trial on the scalar path and on each instruction set the CPU's flags offer
it (its NEEDS), or, where WORKBENCH_CPU_ISA forces one, on that one: a kernel's refusal there
is a broken kernel, and so is an instruction set that fails its trial while the kernel serves
on a narrower one (choose_isa drops it without a word). CI builds llama.cpp, so it has a
compiler: there a broken kernel fails the run, named, instead of turning its tests into
skips (tests/kernels_required.py fails those tests too, under WORKBENCH_REQUIRE_KERNELS=1).
"""
from __future__ import annotations

import importlib
import os
import shutil
import sys

from engine import cpu_features

# report key -> module; each has refusal(); those with NEEDS and _trial are tried per instruction set
KERNELS = {"ours_linear": "engine.kernels.cpu_linear", "ours_quantized": "engine.kernels.cpu_quant",
           "ours_kquant": "engine.kernels.cpu_kquant", "ours_fp8": "engine.kernels.cpu_fp8",
           "ours_attention": "engine.kernels.cpu_attention"}
NAMES = {"ours_linear": "our CPU linear", "ours_quantized": "our quantized CPU linear",
         "ours_kquant": "our K-quant linear", "ours_fp8": "our FP8 cache read", "ours_attention": "our CPU attention"}


def compiler_missing() -> str | None:
    """Why this machine may refuse to build our kernels (None: the compiler the build calls is
    installed, so every kernel must build)."""
    from torch.utils.cpp_extension import get_cxx_compiler
    compiler = get_cxx_compiler()
    if shutil.which(compiler) is None:
        return f"no C++ compiler here ({compiler!r} is not installed; install g++)"
    return None


def required_isas(module) -> list[str]:
    """The instruction sets `module`'s op must pass here: scalar and each one the CPU's flags
    offer, or scalar and the one WORKBENCH_CPU_ISA forces (an imitated narrower CPU)."""
    from engine.kernels import cpu_linear
    flags = cpu_features.flags()
    offered = [isa for isa, needs in module.NEEDS.items() if all(f in flags for f in needs)]
    forced = os.environ.get(cpu_linear.ISA_ENV)
    if forced in module.NEEDS:
        offered = [isa for isa in offered if isa in ("scalar", forced)]
    return offered


def _isa_in_use(key: str, module) -> str:
    if key == "ours_kquant":            # it runs on our quantized linear's instruction set
        return importlib.import_module(KERNELS["ours_quantized"]).isa()
    return module.isa()


def states() -> dict[str, str]:
    """Each kernel's path here: 'runs (its instruction set)' or its refusal."""
    out = {}
    for key, name in KERNELS.items():
        module = importlib.import_module(name)
        why = module.refusal()
        out[key] = f"runs ({_isa_in_use(key, module)})" if why is None else f"refused: {why}"
    return out


def failures() -> dict[str, str]:
    """Each kernel this machine should run that refused, or an instruction set of it that failed
    its trial, and why (empty: all run, or no compiler excuses them)."""
    if compiler_missing():
        return {}
    out = {}
    for key, name in KERNELS.items():
        module = importlib.import_module(name)
        why = module.refusal()
        if why is None and hasattr(module, "_trial"):
            # the trials refusal() ran, again: it keeps only whether scalar and the one in use passed
            failed = [f"its {isa} path failed its trial ({result})"
                      for isa in required_isas(module) if (result := module._trial(isa)) is not None]
            why = "; ".join(failed) or None
        if why is not None:
            out[NAMES[key]] = why
    return out


def build_output(lines: int = 30) -> str:
    """The compiler's last `lines` lines where the library did not build (the refusals keep one
    line of it), else ''."""
    from engine.kernels import cpu_linear
    try:
        cpu_linear.load()
    except Exception as error:      # noqa: BLE001 - whatever the build raised is the answer
        return "\n".join(str(error).strip().splitlines()[-lines:])
    return ""


def require() -> int:
    """Print each kernel this machine should run that refused, naming it, to stderr: 1 if any,
    else 0 (a machine without a compiler says so and passes)."""
    excuse = compiler_missing()
    failed = failures()
    for name, why in failed.items():
        print(f"cpu: FAILED: {name} must run here and does not: {why}", file=sys.stderr)
    if any("did not build" in why for why in failed.values()):
        print(f"cpu: the build's output (last lines):\n{build_output()}", file=sys.stderr)
    if failed:
        print("cpu: a C++ compiler is installed here, so each of our kernels must build and pass its trials "
              "(engine.runtime.kernel_check); fix the kernel named above", file=sys.stderr)
        return 1
    if excuse:
        print(f"cpu: our kernels may refuse here: {excuse}", file=sys.stderr)
    return 0
