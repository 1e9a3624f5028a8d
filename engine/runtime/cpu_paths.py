"""Which path serves each part of a step on this machine, and why: the "paths" entry of
LLMEngine.settings() ("In effect"), CI's first lines and `bench decode`.

Every CPU-specific path is tried before it is relied on, each where it is decided: oneDNN's
linear per dtype (engine.layers.packed_linear.refusal), the quantized weight kernels
(ours: engine.kernels.cpu_quant.refusal; torch's: engine.layers.quantized_linear.refusal), the compute dtype (engine.runtime.cpu_dtype), the
compiled step's C++ compiler (engine.runtime.compiled_step.compiler_refusal) and Triton
(engine.kernels.dispatch.kernels_in_effect). This module only gathers their answers.

`python -m engine.runtime.cpu_paths` prints them (CI's first lines); with `--require` it exits 1,
naming each, when one of our native kernels that this machine should run refused
(engine.runtime.kernel_check: a compiler is found, so the kernel must build and pass its trials),
before the dtype probe runs.
"""
from __future__ import annotations

import argparse
import sys

import torch

from engine import cpu_features
from engine.kernels import cpu_quant
from engine.layers import packed_linear, quantized_linear
from engine.runtime import compiled_step, kernel_check
from engine.runtime.cpu_dtype import dtype_name


def describe(device: torch.device, dtype: torch.dtype, dtype_why: str, compile_state: str,
             attention_state: str, decode_state: str) -> dict[str, str]:
    """One line per part: what runs, and why where it is a fallback."""
    paths = {"isa": cpu_features.isa_name() if device.type == "cpu" else device.type,
             "dtype": f"{dtype_name(dtype)} ({dtype_why})"}
    if device.type == "cpu":
        paths["linear"] = packed_linear.path(dtype)
        paths["quantized"] = quantized_linear.path()
    paths["compile"] = compile_state
    paths["attention"] = attention_state
    paths["decode_graphs"] = decode_state
    return paths


def kernel_report() -> dict[str, str]:
    """This CPU, the compilers, and which path each of our native kernels took here."""
    return {"isa": cpu_features.isa_name(), "flags": " ".join(cpu_features.simd_flags()),
            "torch_capability": torch.backends.cpu.get_cpu_capability(),
            "compiler": compiled_step.compiler_refusal("cpu") or "found",
            "kernel_compiler": kernel_check.compiler_missing() or "found", **kernel_check.states()}


def probe_report() -> dict[str, str | None]:
    """What each probe says on this CPU, independent of a model (CI prints it first, after
    kernel_report): the dtype probe runs (or is read from the cache) first, so the kernels
    shown are the ones an engine loaded now would take."""
    from engine.loading.loader import cache_dir
    from engine.runtime.cpu_dtype import compute_refusal, fastest
    report = {"dtype_auto": fastest(cache_dir() / "cpu_dtype.json").why, "quantized": quantized_linear.path()}
    if cpu_quant.refusal() is None:
        report["quantized_paths"] = cpu_quant.plan().why
    for dtype in packed_linear.DTYPES:
        report[f"compute_{dtype_name(dtype)}"] = compute_refusal(dtype) or "runs"
        report[f"linear_{dtype_name(dtype)}"] = packed_linear.path(dtype)
        for kind in (quantized_linear.INT4, quantized_linear.INT8):
            report[f"torch_{kind}_{dtype_name(dtype)}"] = quantized_linear.refusal(kind, dtype) or "runs"
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.runtime.cpu_paths",
                                     description="Which path each CPU-specific kernel takes here, and why.")
    parser.add_argument("--require", action="store_true",
                        help="exit 1, naming each, when one of our kernels this machine should run refused "
                             "(a C++ compiler is found: it must build and pass its trials); scripts/test.sh")
    args = parser.parse_args(argv)
    for key, value in kernel_report().items():
        print(f"cpu: {key}: {value}", flush=True)
    if args.require and kernel_check.require():
        return 1
    for key, value in probe_report().items():
        print(f"cpu: {key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
