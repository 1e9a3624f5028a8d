"""Exact block ids, ref counts and free-queue order through allocate / hit / free / evict."""
import pytest

from engine.cache.block_manager import BlockManager
from engine.cache.hashing import chain_keys, root_key
from engine.errors import CacheTooSmallError

BS = 4
ROOT = root_key("model-a", "float32", "none", BS)


def manager(num_blocks=8, prefix=True):
    return BlockManager(num_blocks, BS, ROOT, enable_prefix_caching=prefix)


def run_prompt(bm, tokens):
    """Allocate a prompt as the engine does: all of it is computed, full blocks committed."""
    seq = bm.allocate_prompt(tokens)
    bm.commit(seq, tokens, len(tokens))
    return seq


def refs(bm):
    return [b.ref_count for b in bm.blocks]


def test_fresh_allocation_takes_blocks_in_order():
    bm = manager()
    seq = run_prompt(bm, list(range(10)))          # 10 tokens -> 3 blocks, 2 full
    assert seq.block_table == [0, 1, 2]
    assert seq.num_cached_tokens == 0
    assert refs(bm)[:4] == [1, 1, 1, 0]
    assert list(bm.free_queue) == [3, 4, 5, 6, 7]
    assert len(bm.cached) == 2                      # only full blocks are cached
    assert bm.blocks[2].key is None


def test_hit_shares_blocks_and_recomputes_last_token():
    bm = manager()
    tokens = list(range(12))                        # exactly 3 full blocks
    a = run_prompt(bm, tokens)
    b = bm.allocate_prompt(tokens)
    # The last token must be recomputed, so block 2 (holding it) is not a hit.
    assert b.block_table[:2] == a.block_table[:2] == [0, 1]
    assert b.block_table[2] == 3
    assert b.num_cached_tokens == 8
    assert refs(bm)[:4] == [2, 2, 1, 1]


def test_free_order_and_lru_eviction():
    bm = manager(num_blocks=6)
    a = run_prompt(bm, list(range(10)))             # blocks 0,1 cached; 2 partial
    bm.free(a)
    # Uncached block 2 goes to the head (reused first); cached ones to the tail, tail-first.
    assert list(bm.free_queue) == [2, 3, 4, 5, 1, 0]
    assert refs(bm) == [0] * 6
    b = run_prompt(bm, [100 + i for i in range(16)])   # 4 blocks: takes 2,3,4,5; nothing evicted
    assert b.block_table == [2, 3, 4, 5]
    assert len(bm.cached) == 2 + 4
    c = bm.allocate_prompt([200, 201])              # takes block 1: evicts the LRU cached block
    assert c.block_table == [1]
    assert bm.blocks[1].key is None
    hit, _ = bm.lookup(list(range(10)))
    assert hit == [0]                               # block 0 still cached; the chain stops at evicted block 1


def test_hit_on_freed_block_removes_it_from_free_queue():
    bm = manager(num_blocks=4)
    a = run_prompt(bm, list(range(9)))              # 3 blocks, 0 and 1 cached
    bm.free(a)
    b = bm.allocate_prompt(list(range(9)))
    assert b.block_table == [0, 1, 2]
    assert b.num_cached_tokens == 8
    assert list(bm.free_queue) == [3]
    assert refs(bm) == [1, 1, 1, 0]


def test_hit_confirmed_against_token_ids():
    bm = manager()
    a = run_prompt(bm, list(range(9)))
    # Corrupt the stored tokens: the key still matches, the confirmation must reject it.
    bm.blocks[a.block_table[0]].token_ids = (9, 9, 9, 9)
    assert bm.lookup(list(range(9)))[0] == []


def test_prefix_caching_off_never_hits_or_caches():
    bm = manager(prefix=False)
    run_prompt(bm, list(range(9)))
    b = bm.allocate_prompt(list(range(9)))
    assert b.num_cached_tokens == 0 and bm.cached == {}


def test_truncate_releases_tail_blocks():
    bm = manager()
    seq = bm.allocate_prompt(list(range(5)))
    bm.ensure_capacity(seq, 13)
    assert seq.block_table == [0, 1, 2, 3]
    bm.truncate(seq, 6)
    assert seq.block_table == [0, 1]
    assert list(bm.free_queue)[:2] == [2, 3]   # unkeyed: to the head, last freed first
    assert bm.num_used_blocks == 2


def test_cache_too_small_changes_nothing():
    bm = manager(num_blocks=3)
    with pytest.raises(CacheTooSmallError, match="needs 4 KV blocks"):
        bm.allocate_prompt(list(range(13)))
    with pytest.raises(CacheTooSmallError, match="raise the KV cache size"):
        bm.allocate_prompt(list(range(5)), reserve_tokens=100)
    assert list(bm.free_queue) == [0, 1, 2] and refs(bm) == [0, 0, 0]


def test_chained_keys_depend_on_every_previous_block():
    a = chain_keys(ROOT, [1, 2, 3, 4, 5, 6, 7, 8], BS)
    b = chain_keys(ROOT, [0, 2, 3, 4, 5, 6, 7, 8], BS)
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]


def test_root_changes_with_anything_that_changes_cache_contents():
    base = root_key("m", "float32", "none", 16)
    assert root_key("m", "fp8_e4m3", "per_token_head_fp32", 16) != base
    assert root_key("m2", "float32", "none", 16) != base
    assert root_key("m", "float32", "none", 16, rope="theta=1e6") != base
    assert root_key("m", "float32", "none", 16) == base
