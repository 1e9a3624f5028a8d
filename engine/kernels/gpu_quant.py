"""Quantized linears on the GPU, reading the weights as stored: the entry points (whether the
kernels run here, their trial, the linear, the lookups). The layouts are
engine.kernels.gpu_quant_layouts'; the Triton kernels engine.kernels.gpu_quant_linear, imported
only when one runs, so this module imports without triton.

The kernel: y = x W^T + b for 1 to any rows, activations in bf16, fp16 or fp32, fp32 sums.
Each program computes ROWS_PER_PROGRAM rows by a tile of outputs and walks the whole input in
order, a (sub-)block at a time: the block's integer values (exact in the dot's dtype) dotted
with the activations, times the block's fp32 scale, plus its minimum times the activations'
sum where the format has one (llama.cpp's and Marlin's factoring: the weight is never rounded
to the activations' dtype). The tile of rows is fixed, never derived from the row count, and
no split-K: a row's bits are the same alone and in any batch.
"""
from __future__ import annotations

import functools

import torch

from engine.errors import first_line
from engine.kernels import interpreting
from engine.kernels.gpu_quant_layouts import (BLOCKS, DOT_DTYPES, FORMATS, INT4_ZP, StoredWeight,  # noqa: F401
                                              int4_zp_weight, shape_refusal, stored_bytes)


def device_refusal(device: torch.device) -> str | None:
    """Why the kernels cannot run on `device` (None: they can): CUDA with triton, or the Triton
    interpreter on the CPU (TRITON_INTERPRET=1, for tests)."""
    kind = torch.device(device).type
    if kind != "cuda" and not interpreting():
        return f"the GPU quantized kernels run on CUDA (on {kind} only in the Triton interpreter)"
    if kind == "cuda" and not torch.cuda.is_available():
        return "no CUDA device here"
    return _import_error()


@functools.cache
def _import_error() -> str | None:
    try:
        import engine.kernels.gpu_quant_linear  # noqa: F401
    except ImportError as error:
        return f"triton does not import here ({first_line(error)})"
    return None


def refusal(fmt: str, shape: tuple[int, int], device: torch.device, dtype: torch.dtype, group: int = 0) -> str | None:
    """Why a weight [out, in] in `fmt` cannot be served by the kernel on `device` with `dtype`
    activations (None: it can, and a small weight of the format passed its trial there)."""
    why = device_refusal(device) or shape_refusal(fmt, shape, group)
    if why:
        return why
    if dtype not in DOT_DTYPES:
        return f"the GPU quantized kernels take bf16, fp16 or fp32 activations, not {dtype}"
    return trial(fmt, str(torch.device(device)), dtype)


def trial(fmt: str, device: str, dtype: torch.dtype) -> str | None:
    """Run `fmt`'s kernel once on `device` on random blocks against their dequantized product
    (None: it matched). Tests replace this to force the fallback."""
    return _tried(fmt, device, dtype)


@functools.cache
def _tried(fmt: str, device: str, dtype: torch.dtype) -> str | None:
    from engine.kernels import gpu_quant_linear as k
    try:
        weight = k.random_weight(fmt, 32, 512, torch.Generator().manual_seed(0), group=128)
        weight = weight.to(device)
        x = torch.randn(3, 512, generator=torch.Generator().manual_seed(1)).to(device=device, dtype=dtype)
        got = k.linear(x, weight, None).float()
        want = x.float() @ k.dequantize(weight).float().t()
    except (RuntimeError, ValueError) as error:
        return f"the GPU {fmt} kernel failed here: {first_line(error)}"
    if not torch.allclose(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item()):
        return f"the GPU {fmt} kernel gave wrong results here"
    return None


def linear(x: torch.Tensor, weight: StoredWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, in] (bf16, fp16 or fp32) -> [M, out] in x's dtype."""
    from engine.kernels import gpu_quant_linear
    return gpu_quant_linear.linear(x, weight, bias)


def rows(weight: StoredWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the weight, dequantized exactly, fp32 [len(ids), in] (an embedding's lookups)."""
    from engine.kernels import gpu_quant_linear
    return gpu_quant_linear.rows(weight, ids)


