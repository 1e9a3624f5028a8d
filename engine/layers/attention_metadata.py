"""What one forward pass tells attention about its sequences: positions, cache slots, block
tables and mask. Its own module so the torch path (engine.layers.attention) and the Triton
dispatch (engine.kernels.dispatch) share it without importing each other.

Every pass, one sequence or many, lists each sequence's rows, table and context in `seqs`,
with the flattened positions and slots of every row, and says which path attends (`mode`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TreeRows:
    """Rows of a pass that attend as a draft tree (engine.speculative.tree): row r is stored at cache
    index indices[r] and sees the keys at indices 0..context-1, then those in paths[r] (its
    chain of ancestors, ending with itself), as if that chain had been fed alone. Its
    position (RoPE and mask) is context + len(paths[r]) - 1, and the key paths[r][d] sits at
    position context + d (a sliding window counts positions). A path runs root first, in
    increasing cache index (an ancestor is stored before its descendants)."""
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


# What attends: the torch path (the reference), our CPU kernel (the compiled step on the
# CPU, engine.kernels.cpu_attention) or the Triton kernels (CUDA, or the interpreter in tests).
TORCH, CPU, KERNELS = "torch", "cpu", "kernels"
MODES = (TORCH, CPU, KERNELS)


@dataclass(kw_only=True)
class AttentionMetadata:
    """The pool as one forward pass over N new tokens sees it: always a list of sequences,
    built once per pass by engine.layers.attention.prepare (with the mode's layout)."""
    mode: str                      # one of MODES
    positions: torch.Tensor        # [N] int64, RoPE positions of the rows (a tree row: context + depth)
    slot_mapping: torch.Tensor     # [N] int64, block_id * block_size + offset where each row's K/V go
    seqs: list[SeqSlice]           # each sequence's rows, block table and context
    layout: object = None          # the mode's per-pass layout, read by every layer


@dataclass(frozen=True, kw_only=True)
class KernelLaunch:
    """One sequence as a Triton kernel launch takes it: its rows' positions (a tree's rows:
    their cache indices, the causal part of the mask), slots, block table and context."""
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    context_len: int


@dataclass(frozen=True, kw_only=True)
class DecodeBatch:
    """Sequences of a kernels pass that each feed the same Q new rows (decodes, verify passes
    of one k), attending in one decode launch per layer: `rows` [B*Q] the pass's rows,
    sequence by sequence (None: every row of the pass, in order), positions [B, Q], block
    tables [B, max_blocks] (padded with block 0, never read) and the longest context (a host
    int: it sizes the split-K grid without a device sync)."""
    rows: torch.Tensor | None
    positions: torch.Tensor
    block_tables: torch.Tensor
    max_context_len: int


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
