"""Entry points for `engine.layers.attention` in the kernels mode: `store` writes a pass's new
K/V with the store kernel (one launch for every row), then `decode_attention` attends a batch
of sequences that each feed the same few rows (a decode pass: one launch per layer, whatever
the number of sequences) and `sequence_attention` one sequence alone (a prefill chunk, a draft
tree) with the paged-attention kernel.

This module imports without triton; `kernels_available` says whether the kernels can run.
"""
from __future__ import annotations

import torch

from engine.cache.kv_cache import LayerCache
from engine.config import MAX_SPEC_TOKENS
from engine.kernels import interpreting
from engine.layers.attention_metadata import DecodeBatch, KernelLaunch

try:
    from engine.kernels.paged_attention import (DECODE_BLOCK_N, DECODE_PARTITION, paged_attention,
                                                paged_prefill_attention)
    from engine.kernels.store import store_kv
    _IMPORT_ERROR: ImportError | None = None
except ImportError as error:    # triton missing (macOS, Windows, a CPU-only install)
    _IMPORT_ERROR = error

# Up to this many new tokens (one decode token, or k + 1 verification tokens) take the
# decode configuration: all of a KV group's query rows in one program, split-K.
MAX_DECODE_TOKENS = MAX_SPEC_TOKENS + 1


def kernels_available(device: torch.device | str) -> bool:
    """True where the Triton kernels can run: CUDA with triton, or the Triton interpreter
    (TRITON_INTERPRET=1, CPU tensors)."""
    if _IMPORT_ERROR is not None:
        return False
    return interpreting() or torch.device(device).type == "cuda"


def kernels_in_effect(backend: str, device: torch.device | str) -> tuple[bool, str]:
    """(does attention run in the Triton kernels?, why) for the `attention_backend` setting on
    `device`: the one place this is decided (the runner and the memory plan ask here)."""
    if backend == "torch":
        return False, "off (attention backend: torch)"
    if _IMPORT_ERROR is not None:
        return False, f"off: triton does not import here ({_IMPORT_ERROR})"
    if torch.device(device).type == "cuda":
        return True, "on (CUDA)"
    if backend == "triton" and interpreting():
        return True, "on (the Triton interpreter, TRITON_INTERPRET=1)"
    return False, "off: the Triton kernels run on CUDA (on the CPU only in the interpreter, for tests)"


def _require() -> None:
    if _IMPORT_ERROR is not None:
        raise RuntimeError("Triton kernels were requested but triton failed to import "
                           f"({_IMPORT_ERROR}); install triton or turn kernels off.") from _IMPORT_ERROR


def store(cache: LayerCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v [N, H_kv, D] of every new row of a pass into their slots [N], in one launch (an FP8
    pool's values quantized as they are stored). Same bits as engine.layers.attention.store_kv."""
    _require()
    store_kv(cache, k, v, slot_mapping)


def decode_attention(q: torch.Tensor, cache: LayerCache, batch: DecodeBatch, scale: float, window: int = 0,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Q, H_q, D] of a batch's sequences, their new K/V already stored -> [B, Q, H_q, D], in
    one launch (and the merge's, where a context spans several partitions). The partitions are
    DECODE_PARTITION keys whatever the batch, so a sequence's bits are its own alone or beside
    any others (engine.kernels.paged_attention: batch invariance)."""
    _require()
    return paged_attention(q, cache, batch.block_tables, batch.positions, batch.max_context_len, scale,
                           DECODE_PARTITION, DECODE_BLOCK_N, window=window, sinks=sinks)


def sequence_attention(q: torch.Tensor, cache: LayerCache, meta: KernelLaunch, scale: float, tree: tuple | None = None,
                       window: int = 0, sinks: torch.Tensor | None = None,
                       window_start: torch.Tensor | None = None) -> torch.Tensor:
    """q [N, H_q, D] of one sequence, its new K/V already stored -> [N, H_q, D]. Same contract as
    `engine.layers.attention.attention` (window, sinks too). tree: (bits [N] int64, start [1]
    int32), see paged_attention; meta.positions are then the rows' cache indices (the causal
    part), and under a window window_start [N] int64 is each row's first cache index seen."""
    _require()
    num_tokens = q.shape[0]
    # The kernel masks by meta.positions itself, so it is correct for any positions; the
    # token count alone picks the launch shape and no device value is read back (no sync).
    if num_tokens <= MAX_DECODE_TOKENS:
        batched_tree = None if tree is None else (tree[0][None], tree[1])
        out = paged_attention(q[None], cache, meta.block_table[None], meta.positions[None],
                              meta.context_len, scale, DECODE_PARTITION, DECODE_BLOCK_N, batched_tree, window, sinks,
                              None if window_start is None else window_start[None])
        return out[0]                                                            # [N, H_q, D]
    return paged_prefill_attention(q, cache, meta.block_table, meta.positions, meta.context_len, scale, tree=tree,
                                   window=window, sinks=sinks, window_start=window_start)
