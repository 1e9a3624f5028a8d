"""What one forward pass tells attention about its sequences: positions, cache slots, block
tables and mask. Its own module so the torch path (engine.layers.attention) and the Triton
dispatch (engine.kernels.dispatch) share it without importing each other.

A pass over one sequence fills the single-sequence fields; a batched pass (the scheduler's
step over many requests) lists each sequence's rows, table and context in `seqs`, with the
flattened positions and slots of every row."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TreeRows:
    """Rows of a pass that attend as a draft tree (engine.spec.tree): row r is stored at cache
    index indices[r] and sees the keys at indices 0..context-1, then those in paths[r] (its
    chain of ancestors, ending with itself), as if that chain had been fed alone. Its
    position (RoPE and mask) is context + len(paths[r]) - 1."""
    context: int
    indices: list[int]
    paths: list[list[int]]

    @property
    def positions(self) -> list[int]:
        return [self.context + len(p) - 1 for p in self.paths]


@dataclass
class SeqSlice:
    """One sequence's part of a batched pass: rows start..start+count-1 of the pass."""
    start: int
    count: int
    block_table: torch.Tensor      # [num_seq_blocks] int64
    context_len: int               # its tokens in the cache once its new ones are written
    tree: TreeRows | None = None   # its rows attend as a draft tree (None: causally, in order)


@dataclass
class AttentionMetadata:
    """The pool as one forward pass over N new tokens sees it."""
    positions: torch.Tensor        # [N] int64, absolute positions of the new tokens
    slot_mapping: torch.Tensor     # [N] int64, block_id * block_size + offset for each new token
    block_table: torch.Tensor      # [num_seq_blocks] int64 (int32 for kernels)
    context_len: int               # tokens in the cache once the new ones are written
    use_kernels: bool = False      # Triton on CUDA; False forces the torch reference
    causal_mask: torch.Tensor | None = None   # [N, T] bool, key j visible to query i; None: all visible
    seqs: list[SeqSlice] | None = None       # a batched pass; None: one sequence (the fields above)
    cpu_rows: object | None = None            # our CPU kernel attends (engine.kernels.cpu_attention.PassRows)
    plan: list | None = None                  # the torch path's per-pass layout, built by its first layer
    tree_masks: dict | None = None            # the kernels' tree launches by first row, built by the first layer

    def sequences(self) -> list[SeqSlice]:
        if self.seqs is not None:
            return self.seqs
        return [SeqSlice(0, self.positions.shape[0], self.block_table, self.context_len)]


def pass_positions(start: int, n: int, block_table: list[int], block_size: int, device) -> tuple:
    """A pass over n new tokens from position `start`: positions [N], the block table as a
    tensor, and the cache slot of each new token [N] (built on the host side of the pass)."""
    positions = torch.arange(start, start + n, device=device)
    table = torch.tensor(block_table, dtype=torch.int64, device=device)
    slots = table[positions // block_size] * block_size + positions % block_size
    return positions, table, slots


def tree_pass_positions(tree: TreeRows, block_table: list[int], block_size: int, device) -> tuple:
    """pass_positions for a tree's rows: their positions (depths past the context), the block
    table, and the slot of each row's own index."""
    positions = torch.tensor(tree.positions, dtype=torch.int64, device=device)
    table = torch.tensor(block_table, dtype=torch.int64, device=device)
    index = torch.tensor(tree.indices, dtype=torch.int64, device=device)
    slots = table[index // block_size] * block_size + index % block_size
    return positions, table, slots


def causal_mask(positions: torch.Tensor, context_len: int) -> torch.Tensor | None:
    """[N, T] bool, key j visible to query i iff j <= positions[i]. The new tokens are the
    last N of the context, so a single one sees every key: None (no mask)."""
    if positions.numel() == 1:
        return None
    return torch.arange(context_len, device=positions.device)[None, :] <= positions[:, None]
