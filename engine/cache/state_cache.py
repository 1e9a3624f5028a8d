"""The recurrent state of a hybrid model's linear-attention layers (Qwen3.5, Qwen3-Next), beside
the paged KV cache of its full-attention layers (vLLM v1's hybrid cache: a fixed state slot per
request next to the attention layers' blocks).

A slot per running sequence, whatever its length: for each linear-attention layer the causal
convolution's last K - 1 inputs ([conv_dim, K-1], model dtype) and the delta rule's state
([Hv, Dk, Dv], float32, as transformers keeps it). A slot is taken with the sequence and given
back with it (engine.runtime.model_runner); a new one starts at zeros, the state before any token.

A pass whose every row wants logits (a decode, a verify pass of a chain or a tree) keeps the state
after each of its rows (`kept`), so that speculation can go back to the last accepted token
(`restore`): a chain's row r follows row r - 1, a tree's row follows its parent. Only the last
such pass of a sequence is kept: a rollback reaches back into that pass, no further. For prefix
hits, the state at block boundaries is saved apart (engine.cache.state_snapshots) and copied
into a new sequence's slot on a hit.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

RECURRENT_DTYPE = torch.float32


@dataclass(frozen=True)
class StateShape:
    num_layers: int         # linear-attention layers
    conv_dim: int           # channels of the convolution (q, k and v of every head)
    conv_width: int         # K - 1 inputs kept
    num_heads: int          # value heads
    head_k_dim: int
    head_v_dim: int

    def bytes_per_slot(self, conv_dtype: torch.dtype) -> int:
        """One sequence's state in every linear layer (conv inputs + recurrent state)."""
        conv = self.conv_dim * self.conv_width * torch.empty((), dtype=conv_dtype).element_size()
        recurrent = self.num_heads * self.head_k_dim * self.head_v_dim * RECURRENT_DTYPE.itemsize
        return self.num_layers * (conv + recurrent)


@dataclass
class KeptStates:
    """A verify pass's states of one sequence in one layer: before the pass, then after each row."""
    start: int                                  # the sequence's num_computed before the pass
    conv: list[torch.Tensor] = field(default_factory=list)
    recurrent: list[torch.Tensor] = field(default_factory=list)


class StateCache:
    def __init__(self, shape: StateShape, num_slots: int, conv_dtype: torch.dtype, device: torch.device):
        self.shape, self.num_slots, self.device = shape, num_slots, device
        self.conv_dtype = conv_dtype
        self.conv = torch.zeros(shape.num_layers, num_slots, shape.conv_dim, shape.conv_width,
                                dtype=conv_dtype, device=device)
        self.recurrent = torch.zeros(shape.num_layers, num_slots, shape.num_heads, shape.head_k_dim,
                                     shape.head_v_dim, dtype=RECURRENT_DTYPE, device=device)
        self.free_slots = list(range(num_slots - 1, -1, -1))      # pop() hands out slot 0 first
        self.kept: dict[tuple[int, int], KeptStates] = {}        # (layer, slot) -> the last verify pass's

    @property
    def bytes_per_slot(self) -> int:
        return self.shape.bytes_per_slot(self.conv_dtype)

    @property
    def pool_bytes(self) -> int:
        return self.num_slots * self.bytes_per_slot

    @property
    def num_used_slots(self) -> int:
        return self.num_slots - len(self.free_slots)

    def bytes_held(self) -> int:
        return self.num_used_slots * self.bytes_per_slot

    def can_allocate(self) -> bool:
        return bool(self.free_slots)

    def allocate(self) -> int:
        """A zeroed slot (the state before a sequence's first token). The pool is sized for the
        sequences the scheduler runs at once; should more run (max_num_seqs raised live), it grows."""
        if not self.free_slots:
            self._grow(2 * self.num_slots)
        slot = self.free_slots.pop()
        self.reset(slot)
        return slot

    def _grow(self, num_slots: int) -> None:
        pad = num_slots - self.num_slots
        self.conv = torch.cat([self.conv, self.conv.new_zeros(self.conv.shape[0], pad, *self.conv.shape[2:])], dim=1)
        self.recurrent = torch.cat([self.recurrent, self.recurrent.new_zeros(self.recurrent.shape[0], pad,
                                                                               *self.recurrent.shape[2:])], dim=1)
        self.free_slots = list(range(num_slots - 1, self.num_slots - 1, -1)) + self.free_slots
        self.num_slots = num_slots

    def reset(self, slot: int) -> None:
        self.conv[:, slot].zero_()
        self.recurrent[:, slot].zero_()
        self.forget(slot)

    def free(self, slot: int) -> None:
        if slot in self.free_slots:
            raise RuntimeError(f"state slot {slot} freed twice")
        self.forget(slot)
        self.free_slots.append(slot)

    def forget(self, slot: int) -> None:
        for layer in range(self.shape.num_layers):
            self.kept.pop((layer, slot), None)

    def keep(self, layer: int, slot: int, start: int) -> KeptStates:
        """Start keeping the states of a verify pass from `start` (the state now is the first)."""
        kept = self.kept[(layer, slot)] = KeptStates(start)
        kept.conv.append(self.conv[layer, slot].clone())
        kept.recurrent.append(self.recurrent[layer, slot].clone())
        return kept

    def restore(self, slot: int, start: int, rows: int) -> None:
        """Back to the state after `rows` rows of the last verify pass that began at `start` (0: before
        it). For a tree, `rows` is one past the last kept row's index in the pass."""
        for layer in range(self.shape.num_layers):
            kept = self.kept.get((layer, slot))
            if kept is None or kept.start != start or not 0 <= rows < len(kept.conv):
                raise RuntimeError(f"state slot {slot}: no state kept after {rows} rows of a pass from {start} "
                                   "(only a verify pass keeps its states)")
            self.conv[layer, slot].copy_(kept.conv[rows])
            self.recurrent[layer, slot].copy_(kept.recurrent[rows])
        self.forget(slot)
