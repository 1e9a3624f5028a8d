"""Block allocation, reference counts and the prefix cache.

Free blocks wait in an LRU queue (head = evicted first). A freed block that holds a
cached full block goes to the tail, so it can still be hit until it is reused; a freed
block with no key goes to the head, so uncached blocks are reused before cached ones.
Only full blocks get a key; a hit is confirmed against the stored token ids; the last
prompt token is always recomputed (hits never cover it).

A hybrid model's runner also asks that a hit end on a block whose linear-layer state was saved
(`usable_hits`, engine.cache.state_snapshots) and hears of every key dropped (`on_drop`), so
that a snapshot goes with its block.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.cache.hashing import block_key
from engine.errors import CacheTooSmallError


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    key: bytes | None = None
    token_ids: tuple[int, ...] | None = None


@dataclass
class SeqBlocks:
    """One sequence's blocks: its table and the chain keys of its full, computed blocks."""
    block_table: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)
    num_cached_tokens: int = 0          # prompt tokens served from the prefix cache
    num_unrestored_tokens: int = 0      # cached prompt tokens recomputed: no state snapshot reached them


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, root: bytes, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.root = root
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}
        self.usable_hits: Callable[[list[bytes]], int] | None = None     # blocks of a hit that may be used
        self.on_drop: Callable[[bytes], None] | None = None             # a key left the prefix cache

    # ---- queries -------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def lookup(self, token_ids: list[int]) -> tuple[list[int], list[bytes]]:
        """Block ids (and keys) of the longest usable cached prefix, never covering the last token."""
        hit_ids, keys = self.lookup_kv(token_ids)
        usable = len(keys) if self.usable_hits is None else self.usable_hits(keys)
        return hit_ids[:usable], keys[:usable]

    def lookup_kv(self, token_ids: list[int]) -> tuple[list[int], list[bytes]]:
        """Block ids (and keys) of the longest cached prefix, never covering the last token."""
        if not self.enable_prefix_caching:
            return [], []
        hit_ids, keys, parent = [], [], self.root
        for i in range((len(token_ids) - 1) // self.block_size):
            tokens = tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])
            parent = block_key(parent, tokens)
            block_id = self.cached.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hit_ids.append(block_id)
            keys.append(parent)
        return hit_ids, keys

    # ---- allocation ----------------------------------------------------------
    def allocate_prompt(self, token_ids: list[int], reserve_tokens: int = 0) -> SeqBlocks:
        """Take cached prefix blocks and fresh blocks for the rest of the prompt.

        Raises CacheTooSmallError (changing nothing) when the pool cannot hold the prompt
        plus `reserve_tokens` more."""
        hit_ids, keys = self.lookup(token_ids)
        needed_total = self.blocks_for(len(token_ids) + reserve_tokens)
        if needed_total > self.num_blocks:
            raise CacheTooSmallError(
                f"the request needs {needed_total} KV blocks ({len(token_ids)} prompt + {reserve_tokens} new tokens) "
                f"but the cache has {self.num_blocks}; raise the KV cache size, use FP8, or lower max tokens")
        hits_in_free = sum(1 for b in hit_ids if self.blocks[b].ref_count == 0)
        fresh = self.blocks_for(len(token_ids)) - len(hit_ids)
        if fresh > self.num_free_blocks - hits_in_free:
            raise CacheTooSmallError(
                f"the prompt needs {fresh} free KV blocks but only {self.num_free_blocks - hits_in_free} are free")
        seq = self._take_hits(hit_ids, keys)
        self.ensure_capacity(seq, len(token_ids))
        return seq

    def admit(self, token_ids: list[int]) -> SeqBlocks:
        """Take the cached prefix blocks only; the scheduler adds blocks a chunk at a time."""
        seq = self._take_hits(*self.lookup(token_ids))
        if self.usable_hits is not None:
            seq.num_unrestored_tokens = len(self.lookup_kv(token_ids)[0]) * self.block_size - seq.num_cached_tokens
        return seq

    def _take_hits(self, hit_ids: list[int], keys: list[bytes]) -> SeqBlocks:
        for b in hit_ids:
            self._ref(b)
        return SeqBlocks(block_table=list(hit_ids), keys=keys, num_cached_tokens=len(hit_ids) * self.block_size)

    def ensure_capacity(self, seq: SeqBlocks, num_tokens: int) -> None:
        """Grow the table to hold num_tokens tokens."""
        missing = self.blocks_for(num_tokens) - len(seq.block_table)
        if missing > self.num_free_blocks:
            raise CacheTooSmallError(
                f"the KV cache is full: {missing} more blocks needed, {self.num_free_blocks} free; "
                "raise the KV cache size or use FP8")
        for _ in range(missing):
            seq.block_table.append(self._take_free())

    def truncate(self, seq: SeqBlocks, num_tokens: int) -> None:
        """Roll back to num_tokens: release blocks past them (speculative rejection)."""
        keep = self.blocks_for(num_tokens)
        while len(seq.block_table) > keep:
            self._unref(seq.block_table.pop())
        del seq.keys[keep:]

    def commit(self, seq: SeqBlocks, token_ids: list[int], num_computed: int) -> None:
        """Register keys of blocks that became full with computed KV."""
        if not self.enable_prefix_caching:
            return
        parent = seq.keys[-1] if seq.keys else self.root
        for i in range(len(seq.keys), num_computed // self.block_size):
            tokens = tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])
            parent = block_key(parent, tokens)
            seq.keys.append(parent)
            block = self.blocks[seq.block_table[i]]
            if parent not in self.cached and block.key is None:
                block.key, block.token_ids = parent, tokens
                self.cached[parent] = block.block_id

    def free(self, seq: SeqBlocks) -> None:
        """Release in reverse order, so a sequence's tail blocks are evicted before its head."""
        for b in reversed(seq.block_table):
            self._unref(b)
        seq.block_table.clear()
        seq.keys.clear()

    def reset_prefix_cache(self) -> None:
        """Forget every cached block that no live sequence holds."""
        for block in self.blocks:
            if block.ref_count == 0 and block.key is not None:
                self._drop_key(block)

    # ---- internals -----------------------------------------------------------
    def _take_free(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.key is not None:           # evict the least recently used cached block
            self._drop_key(block)
        block.ref_count = 1
        return block_id

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def _unref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} freed twice"
        if block.ref_count == 0:
            self.free_queue[block_id] = None
            if block.key is None:
                self.free_queue.move_to_end(block_id, last=False)

    def _drop_key(self, block: Block) -> None:
        if self.cached.get(block.key) == block.block_id:
            del self.cached[block.key]
            if self.on_drop is not None:
                self.on_drop(block.key)
        block.key = block.token_ids = None
