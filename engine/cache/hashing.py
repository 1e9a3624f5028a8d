"""Chained SHA256 block keys for the prefix cache.

key(block 0) = SHA256(root || tokens of block 0), key(block i) = SHA256(key(block i-1) || tokens of block i).
The root is seeded by the model identity and everything that changes what the cache
holds for the same tokens (KV dtype, scale scheme, block size, RoPE settings), so toggling
FP8 can never serve a block written in the other dtype.
"""
from __future__ import annotations

import hashlib
import json
from typing import Sequence

import numpy as np


def root_key(model_identity: str, kv_dtype: str, scale_mode: str, block_size: int, rope: str = "") -> bytes:
    seed = json.dumps({"model": model_identity, "kv_dtype": kv_dtype, "scale_mode": scale_mode,
                       "block_size": block_size, "rope": rope}, sort_keys=True)
    return hashlib.sha256(seed.encode()).digest()


def block_key(parent: bytes, token_ids: Sequence[int]) -> bytes:
    return hashlib.sha256(parent + np.asarray(token_ids, dtype=np.int64).tobytes()).digest()


def chain_keys(root: bytes, token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Keys of every full block of token_ids."""
    keys, parent = [], root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_key(parent, token_ids[start:start + block_size])
        keys.append(parent)
    return keys
