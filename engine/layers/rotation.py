"""The Hadamard rotation of head_dim, for the rotated FP8 KV cache (kv_cache_dtype
"fp8_e4m3_hadamard").

A key's few large channels set its FP8 scale and flatten the small ones to zero. Rotated by
an orthonormal Hadamard matrix H (Sylvester's, scaled by 1/sqrt(D)), every channel of H·k
is a mix of all of them, so the range is spread and the rounding error shrinks (QuaRot,
SpinQuant). Attention is unchanged in exact arithmetic: (Hq)·(Hk) = q·k, and with values
stored as Hv the output is H·Σ p v, so one more rotation (H is its own inverse) gives it
back. The rotation is applied where attention is entered (engine.layers.attention), so the
torch path, the compiled step and the Triton kernels all see rotated q, k, v and never
need to know.

Measured by the issue's probe (fake quantization in transformers, SmolLM2-135M): FP8
keys-and-values +0.87% perplexity, +0.41% with the rotation.

The transform is the fast Walsh-Hadamard butterfly in float32: log2(D) stages of
elementwise sums and differences. Each row's result depends on that row alone (no matmul,
whose rounding can change with the row count), so batch invariance holds.
"""
from __future__ import annotations

import math

import torch

from engine.cache.kv_cache import rotatable


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] times the orthonormal Sylvester-Hadamard matrix H_D (symmetric, H·H = I),
    in float32 (the caller casts)."""
    d = x.shape[-1]
    if not rotatable(d):
        raise ValueError(f"the Hadamard rotation needs a power-of-two head_dim, got {d}")
    y = x.float().reshape(-1, d)
    h = 1
    while h < d:
        y = y.view(-1, d // (2 * h), 2, h)
        a, b = y[:, :, 0], y[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2).view(-1, d)
        h *= 2
    return (y * (1.0 / math.sqrt(d))).view(x.shape)
