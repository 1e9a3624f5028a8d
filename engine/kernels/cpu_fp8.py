"""Our FP8 KV cache read (cpu_fp8.cpp, the torch op `workbench_cpu::fp8_gather`): rows of an
E4M3 cache (whole blocks, or single slots) gathered and dequantized in one pass, with the bits
of the torch expression it replaces,
    dequantize_fp8(values.index_select(0, index), scales.index_select(0, index), dtype)
whose eager float8 -> float32 conversion costs about 60x a bf16 copy on the CPU (the FP8 cache
served 0.50x the bf16 cache's output throughput under load).

Built with our CPU linear, into the same library (engine.kernels.cpu_linear.load). Tried before
it is used (`refusal`): on every byte value and random scales, in fp32, bf16 and fp16, each
instruction set this CPU offers must give the scalar path's bits and the scalar path torch's.
The widest set that passes runs; `force_isa` (or WORKBENCH_CPU_ISA=avx2|scalar) picks another.
Where it does not serve (no compiler, a failed trial, not the CPU, a dtype it lacks), `gather`
computes the torch expression; so does a traced call (torch.compile fuses that expression
into its own loops).
"""
from __future__ import annotations

import functools

import torch

from engine.cache.kv_cache import dequantize_fp8
from engine.errors import first_line
from engine.kernels import cpu_linear

ISAS = cpu_linear.ISAS
NEEDS = {"scalar": (), "avx2": ("avx2", "fma", "f16c"), "avx512": ("avx512f",)}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_chosen: dict[str, str] = {}


@functools.cache
def refusal() -> str | None:
    """Why our FP8 cache read cannot serve here (None: it built and passed its trials)."""
    return cpu_linear.tried("our FP8 cache read", _chosen, NEEDS, _trial, _register_fake)


@functools.cache
def _register_fake() -> None:
    """The op's output for the compiler (torch.compile traces with fake tensors)."""
    torch.library.register_fake("workbench_cpu::fp8_gather")(
        lambda values, scales, index, dtype, isa: values.new_empty((index.shape[0], *values.shape[1:]), dtype=dtype))


def reference(values: torch.Tensor, scales: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The torch expression the op replaces (and the fallback)."""
    return dequantize_fp8(values.index_select(0, index), scales.index_select(0, index), dtype)


def _trial(isa: str) -> str | None:
    """None when `isa` gives the scalar path's bits and the scalar path torch's, on every byte
    (NaN bytes compared as NaN: torch's NaN bits may differ by build), for a head_dim with a tail."""
    gen = torch.Generator().manual_seed(0)
    values = torch.arange(256, dtype=torch.uint8).repeat(3)[torch.randperm(768, generator=gen)].view(4, 4, 48)
    scales = torch.exp2(torch.randint(-40, 40, (4, 4), generator=gen).float()) * torch.rand(4, 4, generator=gen)
    index = torch.tensor([3, 0, 3, 1])
    for dtype in DTYPES:
        try:
            got = torch.ops.workbench_cpu.fp8_gather(values, scales, index, dtype, ISAS[isa])
            scalar = torch.ops.workbench_cpu.fp8_gather(values, scales, index, dtype, ISAS["scalar"])
        except RuntimeError as error:
            return f"{isa} failed ({first_line(error)})"
        if not torch.equal(got.view(torch.uint8), scalar.view(torch.uint8)):
            return f"{isa} gives other {dtype} bits than the scalar path"
        want = reference(values.view(torch.float8_e4m3fn), scales, index, dtype)
        nan = want.isnan()
        if not torch.equal(nan, scalar.isnan()) or not torch.equal(scalar[~nan].view(torch.uint8),
                                                                    want[~nan].view(torch.uint8)):
            return f"{isa} gives other {dtype} bits than torch"
    return None


def isa() -> str:
    return _chosen.get("isa", "scalar")


def force_isa(name: str | None) -> None:
    """Run with `name` ('avx512', 'avx2', 'scalar'), or None: the widest that passed."""
    cpu_linear.force(_chosen, name, refusal)


def serves(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether `gather` runs the op for these tensors (else the torch expression)."""
    return (values.device.type == "cpu" and dtype in DTYPES and values.is_contiguous()
            and scales.is_contiguous() and refusal() is None)


def gather(values: torch.Tensor, scales: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `index` of an FP8 cache, dequantized: values [N, ..., D] (float8_e4m3fn), scales
    [N, ...] fp32, index [M] -> [M, ..., D] in `dtype`. N may count blocks ([NB, BS, H, D]) or
    slots ([NB * BS, H, D])."""
    if torch.compiler.is_compiling() or not serves(values, scales, dtype):
        return reference(values, scales, index, dtype)
    return torch.ops.workbench_cpu.fp8_gather(values, scales, index, dtype, ISAS[isa()])
