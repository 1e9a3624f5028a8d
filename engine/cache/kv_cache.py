"""Paged KV cache: per layer `[num_blocks, block_size, num_kv_heads, head_dim]`.

Only the model's KV heads are stored (GQA is never expanded to query heads).
Storage dtype is the model dtype, a 16-bit float, or FP8 E4M3. FP8 uses one float32
scale per (token, KV head): scale = amax(|x|) / 448 over that head's head_dim values.
Why per token-and-head: the scale is fixed the moment a token is written (no
re-quantization of older tokens when a later token has a larger range, which a
per-block or per-tensor scale would need), outliers in one head don't flatten the
resolution of the others, and it costs 4 bytes per 64-128 values (3-6%), reported apart.
The "fp8_e4m3_hadamard" scheme stores the same bytes for Hadamard-rotated keys and values
(engine.layers.rotation), which spreads a head's outlier channels before the scale is taken.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.errors import ConfigError

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_DTYPE = torch.float32
# FP8 with keys and values rotated by a Hadamard matrix before encoding (engine.layers.rotation).
FP8_HADAMARD = "fp8_e4m3_hadamard"
_NAMED_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                 "fp8_e4m3": FP8_DTYPE, FP8_HADAMARD: FP8_DTYPE}


# The model's dtype until the pool runs short, then FP8 E4M3: the engine resolves it to one of
# the two when it builds the pool (LLMEngine.pool_plan); on its own it reads as the model's.
FP8_WHEN_SHORT = "fp8_when_short"


def resolve_kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    return model_dtype if name in ("auto", FP8_WHEN_SHORT) else _NAMED_DTYPES[name]


def is_rotated(name: str) -> bool:
    """Whether the kv_cache_dtype setting's scheme stores Hadamard-rotated keys and values."""
    return name == FP8_HADAMARD


def rotatable(head_dim: int) -> bool:
    """Sylvester's Hadamard matrices exist for powers of two (engine.layers.rotation)."""
    return head_dim > 0 and head_dim & (head_dim - 1) == 0


def dtype_name(dtype: torch.dtype) -> str:
    return "fp8_e4m3" if dtype == FP8_DTYPE else str(dtype).removeprefix("torch.")


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., head_dim] -> (fp8 values [..., head_dim], float32 scales [...])."""
    amax = x.abs().amax(dim=-1).to(SCALE_DTYPE)
    scale = torch.clamp(amax / FP8_MAX, min=1e-12)
    q = (x.to(SCALE_DTYPE) / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.to(SCALE_DTYPE) * scale.unsqueeze(-1)).to(dtype)


@dataclass(frozen=True)
class CacheShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """K and V values for one token over all layers (scales excluded)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype.itemsize

    def scale_bytes_per_token(self, dtype: torch.dtype) -> int:
        if dtype != FP8_DTYPE:
            return 0
        return 2 * self.num_layers * self.num_kv_heads * SCALE_DTYPE.itemsize


class KVCache:
    """The pool. Block ids index dim 0 of every layer's tensors."""

    def __init__(self, shape: CacheShape, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, rotated: bool = False):
        self.shape, self.num_blocks, self.block_size = shape, num_blocks, block_size
        self.dtype, self.device = dtype, device
        self.is_fp8 = dtype == FP8_DTYPE
        if rotated and not (self.is_fp8 and rotatable(shape.head_dim)):
            raise ConfigError(f"the Hadamard-rotated cache ({FP8_HADAMARD}) is an FP8 scheme for a power-of-two "
                              f"head_dim; this model's head_dim is {shape.head_dim}: choose fp8_e4m3")
        self.rotated = rotated
        dims = (shape.num_layers, num_blocks, block_size, shape.num_kv_heads, shape.head_dim)
        self.k = torch.zeros(dims, dtype=dtype, device=device)
        self.v = torch.zeros(dims, dtype=dtype, device=device)
        if self.is_fp8:
            self.k_scale = torch.ones(dims[:-1], dtype=SCALE_DTYPE, device=device)
            self.v_scale = torch.ones(dims[:-1], dtype=SCALE_DTYPE, device=device)
        else:
            self.k_scale = self.v_scale = None
        self._layers = [self._make_layer(i) for i in range(shape.num_layers)]

    def layer(self, i: int) -> "LayerCache":
        return self._layers[i]

    def _make_layer(self, i: int) -> "LayerCache":
        scales = (self.k_scale[i], self.v_scale[i]) if self.is_fp8 else (None, None)
        return LayerCache(self.k[i], self.v[i], *scales, self.rotated)

    @property
    def name(self) -> str:
        """The scheme, as the kv_cache_dtype setting names it."""
        return FP8_HADAMARD if self.rotated else dtype_name(self.dtype)

    @property
    def bytes_per_token(self) -> int:
        return self.shape.bytes_per_token(self.dtype)

    @property
    def scale_bytes_per_token(self) -> int:
        return self.shape.scale_bytes_per_token(self.dtype)

    @property
    def bytes_per_block(self) -> int:
        return (self.bytes_per_token + self.scale_bytes_per_token) * self.block_size

    @property
    def bytes_allocated(self) -> int:
        """Measured from the tensors themselves, not derived from the config."""
        tensors = [self.k, self.v] + ([self.k_scale, self.v_scale] if self.is_fp8 else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def bytes_held(self, num_blocks_held: int) -> int:
        return num_blocks_held * self.bytes_per_block


@dataclass
class LayerCache:
    k: torch.Tensor                 # [num_blocks, block_size, num_kv_heads, head_dim]
    v: torch.Tensor
    k_scale: torch.Tensor | None    # [num_blocks, block_size, num_kv_heads] (FP8 only)
    v_scale: torch.Tensor | None
    rotated: bool = False           # holds H·k and H·v (engine.layers.rotation)
