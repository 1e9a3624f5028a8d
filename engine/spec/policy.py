"""How many draft tokens the next step verifies, from the batch size and measured costs.

Speculation trades a wider verify pass for more tokens per pass. Alone on a CPU, a 5-row
pass costs about one decode step, so k = 4 is nearly free; with 16 sequences decoding, each
row of drafts is a sixteenth of a wider pass that now costs several decode steps, and
speculation loses (vLLM #4565, #17984; hence vLLM's speculative_disable_by_batch_size and
SGLang's batch-aware adaptive speculation). The policy picks the k (0 included) that
maximises expected tokens per second for the batch:

    throughput(k) = B * tau(alpha, k) / (pass_s(B * (k + 1) rows) + B * k * draft_s)

with tau from engine.metrics.expected_accepted_len, alpha the proposer's measured per-token
acceptance, pass_s the measured time of a pass that wide and draft_s the measured time to
draft one token. Until a pass that wide has been seen, its time is extrapolated from the
nearest measured width, in proportion to its row tiles (linears run ROW_TILE rows a call).
"""
from __future__ import annotations

import statistics
from collections import deque

from engine.layers.packed_linear import ROW_TILE
from engine.metrics import PositionCounts, expected_accepted_len

KEEP = 32               # recent measurements per width
PRIOR_ALPHA = 0.6       # until a proposer has been tried: optimistic, or it would never be tried
MIN_ATTEMPTS = 16       # attempted draft positions before the measured alpha is trusted


def tiles(rows: int) -> int:
    return max(1, -(-rows // ROW_TILE))


class SpeculationPolicy:
    def __init__(self):
        self.pass_s: dict[int, deque] = {}          # row tiles -> recent pass seconds
        self.draft_s: deque = deque(maxlen=KEEP)    # seconds per drafted token
        self.positions: dict[str, PositionCounts] = {}

    # ---- measurements --------------------------------------------------------------
    def record_pass(self, rows: int, seconds: float) -> None:
        self.pass_s.setdefault(tiles(rows), deque(maxlen=KEEP)).append(seconds)

    def record_draft(self, tokens: int, seconds: float) -> None:
        if tokens:
            self.draft_s.append(seconds / tokens)

    def record_verdict(self, proposer: str, accepted_per_position: list[bool]) -> None:
        self.positions.setdefault(proposer, PositionCounts()).add(accepted_per_position)

    def alpha(self, proposer: str) -> float:
        counts = self.positions.get(proposer)
        if counts is None or sum(counts.attempts) < MIN_ATTEMPTS:
            return PRIOR_ALPHA
        return counts.alpha() or 0.0

    def predicted_pass_s(self, rows: int) -> float | None:
        want = tiles(rows)
        if not self.pass_s:
            return None
        if want in self.pass_s:
            return statistics.median(self.pass_s[want])
        nearest = min(self.pass_s, key=lambda t: abs(t - want))
        return statistics.median(self.pass_s[nearest]) * want / nearest

    # ---- the choice ----------------------------------------------------------------
    def choose_k(self, proposer: str, batch: int, k_max: int, other_rows: int = 0) -> int:
        """The k for a step with `batch` decoding sequences (and other_rows prefill rows in
        the same pass). k_max until the pass width has any measurement."""
        if batch < 1 or k_max < 1:
            return 0
        if self.predicted_pass_s(batch + other_rows) is None:
            return k_max
        alpha = min(self.alpha(proposer), 0.999)
        draft = statistics.median(self.draft_s) if self.draft_s else 0.0

        def throughput(k: int) -> float:
            seconds = self.predicted_pass_s(batch * (k + 1) + other_rows) + batch * k * draft
            return batch * expected_accepted_len(alpha, k) / seconds
        return max(range(k_max + 1), key=throughput)
