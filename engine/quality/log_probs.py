"""llama.cpp's 16-bit form of a token distribution (llama-perplexity --kl-divergence-base keeps a
reference's log-probs so): the quality measurement keeps its reference this way, and the
agreement bench writes and reads llama.cpp's base files with it."""
from __future__ import annotations

import numpy as np
import torch

LOG_PROB_FLOOR = 16.0        # llama.cpp keeps log-probs within 16 nats of the top one


def row_width(n_vocab: int) -> int:
    """uint16s per scored position: scale and min log-prob (two floats), then n_vocab, padded even."""
    return 2 * ((n_vocab + 1) // 2) + 4


def compressed_log_probs(logits: torch.Tensor) -> np.ndarray:
    """llama-perplexity's log_softmax with uint16 output, row by row ([rows, V] logits ->
    [rows, row_width(V)] uint16): the top logit m, the floor f = max(min logit, m - 16), the
    scale (m - f) / 65535 and the floor's log-prob f - m - log sum exp(x - m) stored as two
    floats, then each logit above the floor as round((x - f) / scale), the rest 0. Float32
    arithmetic as its, the exp sum in double."""
    x = logits.float()
    rows, n_vocab = x.shape
    top = x.max(-1, keepdim=True).values
    floor = torch.maximum(x.min(-1, keepdim=True).values, top - LOG_PROB_FLOOR)
    log_sum_exp = torch.exp(x - top).double().sum(-1, keepdim=True).log().float()
    min_log_prob = floor - top - log_sum_exp
    scale = (top - floor) / 65535.0
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.where(x > floor, torch.round(inv * (x - floor)), torch.zeros_like(x)).clamp(0, 65535)
    out = np.zeros((rows, row_width(n_vocab)), dtype="<u2")
    head = torch.cat([scale, min_log_prob], -1).numpy().astype("<f4")
    out[:, :4] = head.view("<u2")
    out[:, 4:4 + n_vocab] = q.to(torch.int32).numpy().astype("<u2")
    return out


def expand_log_probs(stored: np.ndarray, n_vocab: int) -> np.ndarray:
    """compressed_log_probs' rows read back as llama.cpp's kl_divergence reads them
    (scale * q + min_log_prob): [rows, n_vocab] float64."""
    head = np.ascontiguousarray(stored[:, :4]).view("<f4").astype(np.float64)      # [rows, 2]
    return head[:, :1] * stored[:, 4:4 + n_vocab] + head[:, 1:2]
