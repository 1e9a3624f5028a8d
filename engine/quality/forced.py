"""Teacher forcing for the quality measurement: a sequence in non-overlapping windows, each fed
through a runner's cache a prefill chunk at a time, as a prompt is served."""
from __future__ import annotations

import math
from typing import Iterator

import numpy as np
import torch

from engine.config import EngineConfig

WINDOW = 1024                  # tokens per window: bench kv's
PIECE = 256                    # tokens fed per forward (a prefill chunk)


def forced_pieces(runner, sequences: list[list[int]], window: int = WINDOW) -> Iterator[tuple[torch.Tensor, list[int]]]:
    """Each sequence in non-overlapping windows, each window fed through the runner's cache in
    pieces of PIECE tokens: yields (the piece's fp32 logits [n, V], the n tokens they predict)."""
    for ids in sequences:
        for start in range(0, len(ids) - 1, window):
            chunk = ids[start:start + window + 1]
            seq = runner.start(chunk[:-1])
            try:
                for c in range(0, len(chunk) - 1, PIECE):
                    piece = chunk[c:c + PIECE + 1]
                    yield runner.forward(seq, piece[:-1], logits_for="all").float(), piece[1:]
            finally:
                runner.end(seq)


def pieces_in(sequences: list[list[int]], window: int = WINDOW) -> int:
    return sum(math.ceil(min(window, len(ids) - 1 - s) / PIECE) for ids in sequences for s in range(0, len(ids) - 1, window))


def perplexity(runner, ids: list[int], window: int = WINDOW) -> float:
    """Perplexity of ids under the runner (forced_pieces' windows and pieces)."""
    nll, count = 0.0, 0
    for logits, targets in forced_pieces(runner, [ids], window):
        nll += float(torch.nn.functional.cross_entropy(logits, torch.tensor(targets, device=logits.device), reduction="sum"))
        count += len(targets)
    return math.exp(nll / count)


def nll_of(log_probs: torch.Tensor, targets: list[int]) -> np.ndarray:
    return -log_probs.gather(-1, torch.tensor(targets, device=log_probs.device)[:, None])[:, 0].double().cpu().numpy()


def scoring_runner(loaded, kv_cache_dtype: str, device: torch.device, window: int = WINDOW):
    """An eager runner of its own, with a pool for one window, in the given cache dtype."""
    from engine.runtime.model_runner import ModelRunner
    config = EngineConfig(kv_cache_dtype=kv_cache_dtype, compile="off", enable_prefix_caching=False)
    return ModelRunner(loaded, config, device, num_blocks=window // config.block_size + 2)
