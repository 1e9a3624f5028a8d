"""Prefix caching for a hybrid model: its linear layers' state saved at block boundaries.

A prefix hit skips the hit blocks' tokens, but a linear layer has no per-token cache to read
them back from: it needs its state (the convolution's inputs and the delta rule's state) as it
was after the hit's last token. As vLLM v1 does for its hybrid models, the state is saved at
block boundaries: a snapshot belongs to the full block whose end it was taken at, by the
block's chained key (engine.cache.block_manager), and a hit is only as long as its longest run
of blocks whose last block has a snapshot (`usable_hits`); on a hit that snapshot is copied
into the sequence's state slot (`restore`) and the sequence resumes after it.

What is saved (the runner stages it, engine.layers.linear_attention_op writes it): a prefill
chunk's state at the block boundaries inside it that its chunked form passes anyway (the
sequence's multiples of gated_delta.CHUNK) and at its last block boundary inside it (the chunk
is cut there); and a sequence's state whenever a pass leaves it on a boundary (a chunk ending
on one, a decode, a verify pass whose accepted tokens end on one). Other boundaries are not
saved: a hit ending on one falls back to the last saved boundary before it.

Bounded: a fixed pool of `num_snapshots` (the memory plan's `prefix_snapshots`, bytes of one
state slot each). A chunk's boundaries are first `stage`d (the last ones of a chunk when it
has more than the pool holds); once its blocks are committed a staged snapshot is filed
under its block's key (`settle`) or given back. When the pool is full the least recently used
snapshot goes (saving and hitting both count as use). When the block manager drops a block's
key (eviction, reset) the snapshot goes with it (`drop`); a block whose snapshot went keeps
its KV, and a hit on it falls back to the longest hit that still has one, or recomputes.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from engine.cache.state_cache import RECURRENT_DTYPE, StateCache


class StateSnapshots:
    def __init__(self, states: StateCache, num_snapshots: int):
        shape = states.shape
        self.states, self.num_snapshots = states, num_snapshots
        self.conv = torch.zeros(num_snapshots, shape.num_layers, shape.conv_dim, shape.conv_width,
                                dtype=states.conv_dtype, device=states.device)
        self.recurrent = torch.zeros(num_snapshots, shape.num_layers, shape.num_heads, shape.head_k_dim,
                                     shape.head_v_dim, dtype=RECURRENT_DTYPE, device=states.device)
        self.free = list(range(num_snapshots - 1, -1, -1))       # pop() hands out snapshot 0 first
        self.by_key: OrderedDict[bytes, int] = OrderedDict()     # LRU order: the head goes first
        self.staged: dict[int, list[tuple[int, int]]] = {}      # state slot -> [(boundary, snapshot)]

    # ---- queries -------------------------------------------------------------
    @property
    def bytes_per_snapshot(self) -> int:
        return self.states.bytes_per_slot

    @property
    def pool_bytes(self) -> int:
        return self.num_snapshots * self.bytes_per_snapshot

    @property
    def num_saved(self) -> int:
        return len(self.by_key)

    def bytes_held(self) -> int:
        return self.num_saved * self.bytes_per_snapshot

    def usable_hits(self, keys: list[bytes]) -> int:
        """How many of a hit's blocks can be used: up to the last one that has a snapshot."""
        for n in range(len(keys), 0, -1):
            if keys[n - 1] in self.by_key:
                return n
        return 0

    # ---- a hit ---------------------------------------------------------------
    def restore(self, key: bytes, slot: int) -> None:
        """The state saved at the end of block `key` into state slot `slot`, in every layer."""
        snapshot = self.by_key[key]
        self.by_key.move_to_end(key)
        self.states.conv[:, slot].copy_(self.conv[snapshot])
        self.states.recurrent[:, slot].copy_(self.recurrent[snapshot])

    # ---- saving --------------------------------------------------------------
    def stage(self, slot: int, boundaries: list[int]) -> list[tuple[int, int]]:
        """Snapshots for the state of slot `slot` at these boundaries (tokens of its sequence), to be
        written by the pass and filed by `settle`: [(boundary, snapshot)], the last boundaries
        first served when the pool cannot hold them all. Staged ones of an earlier pass go back."""
        self.unstage(slot)
        staged = []
        for boundary in reversed(boundaries):
            snapshot = self._take()
            if snapshot is None:
                break
            staged.append((boundary, snapshot))
        self.staged[slot] = staged[::-1]
        return self.staged[slot]

    def save_layer(self, snapshot: int, layer: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        self.conv[snapshot, layer].copy_(conv)
        self.recurrent[snapshot, layer].copy_(recurrent)

    def settle(self, slot: int, keys: list[bytes], num_computed: int, block_size: int, is_cached) -> None:
        """After the blocks of a sequence (state slot `slot`, its chain `keys`) were committed: file
        each staged snapshot under its block's key, and save the state in the slot when it stands
        on a boundary. is_cached(key): whether the block manager still has that block."""
        for boundary, snapshot in self.staged.pop(slot, []):
            key = self._key_at(keys, boundary, block_size, is_cached)
            if key is None:
                self.free.append(snapshot)
            else:
                self.by_key[key] = snapshot
        if num_computed % block_size == 0:
            key = self._key_at(keys, num_computed, block_size, is_cached)
            snapshot = None if key is None else self._take()
            if snapshot is not None:
                self.by_key[key] = snapshot
                self.conv[snapshot].copy_(self.states.conv[:, slot])
                self.recurrent[snapshot].copy_(self.states.recurrent[:, slot])

    def _key_at(self, keys: list[bytes], boundary: int, block_size: int, is_cached) -> bytes | None:
        """The key of the block ending at `boundary`, where it is cached and has no snapshot yet."""
        index = boundary // block_size - 1
        if not 0 <= index < len(keys) or keys[index] in self.by_key or not is_cached(keys[index]):
            return None
        return keys[index]

    def _take(self) -> int | None:
        """A free snapshot, or the least recently used saved one; None: every one is staged."""
        if self.free:
            return self.free.pop()
        if self.by_key:
            return self.by_key.popitem(last=False)[1]
        return None

    # ---- freeing -------------------------------------------------------------
    def unstage(self, slot: int) -> None:
        """Give back what a pass staged for this slot and nobody filed (its sequence ended)."""
        self.free.extend(snapshot for _, snapshot in self.staged.pop(slot, []))

    def drop(self, key: bytes) -> None:
        """Its block left the prefix cache: its snapshot goes too."""
        snapshot = self.by_key.pop(key, None)
        if snapshot is not None:
            self.free.append(snapshot)
