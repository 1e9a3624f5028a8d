"""The KV cache: what is stored, where, and who holds it. Imports no forward-pass code.

kv_cache.py       the paged pool per layer, [num_blocks, block_size, num_kv_heads, head_dim],
                  in the model dtype or FP8 E4M3 with scales; exact byte counts
block_manager.py  block allocation, reference counts, the prefix cache and its LRU free queue
hashing.py        chained SHA256 block keys seeded with everything that changes cache contents
memory_plan.py    how a device's memory splits into weights, KV pool and reserve
"""
