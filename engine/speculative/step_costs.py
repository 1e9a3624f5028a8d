"""What one decode step costs, measured: the machine's read bandwidth, the weight bytes a
step reads, the time of an N-token pass relative to a 1-token pass (the verify cost that
decides whether speculation pays), and the plain decode step the engine keeps measuring
(PlainStepClock: the baseline of "does speculation pay here?"). Used by `engine.bench.scenarios
decode` and by the engine."""
from __future__ import annotations

import statistics
import time
from collections import deque

import torch

from engine.cache.memory_plan import expert_bytes

BANDWIDTH_BYTES = 512 * 2**20


def read_bandwidths(reads: int = 7, buffer: torch.Tensor | None = None, warm: bool = True) -> list[float]:
    """Bytes per second of each of `reads` reductions over a large buffer (BANDWIDTH_BYTES unless
    given; the memory-bound limit a decode step that reads every weight once cannot beat), on
    this thread count, after one untimed (warm)."""
    x = torch.ones(BANDWIDTH_BYTES // 4, dtype=torch.float32) if buffer is None else buffer
    if warm:
        x.sum()
    out = []
    for _ in range(reads):
        t0 = time.perf_counter()
        x.sum()
        out.append(x.numel() * x.element_size() / (time.perf_counter() - t0))
    return out


def read_bandwidth(reads: int = 7) -> float:
    """The best of `reads` reads: what the machine gives when nothing else is reading (on a
    shared machine a median moves with the neighbours; the same read gave 30 to 62 GB/s from
    one hour to the next), so a roofline fraction divides by the limit, not by the noise."""
    return max(read_bandwidths(reads))


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: every parameter once (a tied embedding counts
    once, as the head reads it whole), except the embedding table, of which one row is read,
    and an MoE layer's experts, of which a token reads its top_k (memory_plan.expert_bytes)."""
    seen, total = set(), 0
    embedding = model.embed_tokens.weight
    head = getattr(model, "lm_head", None)
    head_reads_embedding = head is not None and head.weight is embedding and head.quant is None
    for m in model.modules():           # a quantized linear reads its kernel's bytes
        if getattr(m, "quant", None) is not None:
            total += m.quant.nbytes
            if m.weight.is_meta:        # not a tied embedding, which is still looked up
                seen.add(id(m.weight))
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if p is embedding and not head_reads_embedding:
            total += p.shape[1] * p.element_size()
        else:
            total += p.numel() * p.element_size()
    experts = expert_bytes(model)
    return total if experts is None else total - experts.resident_bytes + experts.per_token_bytes


def pass_seconds(runner, n: int, context: int = 64, repeats: int = 9, tree=None) -> float:
    """Median time of one n-token forward pass at `context` tokens, rolled back after each (on
    CUDA each timed to the end of its kernels).
    tree: an engine.speculative.tree.DraftTree of n - 1 nodes, verified as a tree pass instead."""
    return statistics.median(pass_times(runner, [(n, tree)], context, repeats)[0])


def pass_times(runner, shapes, context: int = 64, repeats: int = 9) -> list[list[float]]:
    """Seconds of `repeats` forward passes of each shape (n tokens, or (n, tree) with tree an
    engine.speculative.tree.DraftTree of n - 1 nodes, verified as a tree pass) at `context`
    tokens, one pass of each shape a round, rolled back after each: the shapes' rounds are
    interleaved, so a neighbour's load hits each alike and a ratio is taken within a round."""
    from engine.runtime.model_runner import PassItem
    shapes = [(s, None) if isinstance(s, int) else s for s in shapes]
    prompt = list(range(1000, 1000 + context))
    passes, seqs = [], []
    try:
        for n, tree in shapes:
            seq = runner.start(prompt, reserve_tokens=n)
            seqs.append(seq)
            runner.forward(seq, prompt)
            tokens = list(range(2000, 2000 + n))
            if tree is None:
                passes.append(lambda seq=seq, tokens=tokens, n=n: runner.forward(seq, tokens, logits_for=n))
            else:
                item = PassItem(seq, tokens, n, tree.rows(context))
                passes.append(lambda item=item: runner.forward_batch([item]))
        for seq, one_pass in zip(seqs, passes):       # warm-up (and compile, if on)
            one_pass()
            runner.rollback(seq, context)
        times = [[] for _ in shapes]
        for _ in range(repeats):
            for seq, one_pass, out in zip(seqs, passes, times):
                _synchronize(runner.device)
                t0 = time.perf_counter()
                one_pass()
                _synchronize(runner.device)
                out.append(time.perf_counter() - t0)
                runner.rollback(seq, context)
    finally:
        for seq in seqs:
            runner.end(seq)
    return times


def _relative(times: list[list[float]]) -> list[float]:
    """Each shape's median, within a round, of its time / the first shape's."""
    return [statistics.median(t / one for t, one in zip(shape, times[0])) for shape in times]


def verify_costs(runner, ks=(1, 2, 4, 8), repeats: int = 9, context: int = 64) -> dict[str, float]:
    """{k: time of a (k+1)-token pass / time of a 1-token pass}, both at `context` tokens, the
    median of the ratios within interleaved rounds."""
    relative = _relative(pass_times(runner, [1] + [k + 1 for k in ks], context, repeats))
    return {str(k): r for k, r in zip(ks, relative[1:])}


def _synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def tree_verify_costs(runner, nodes=(8, 16, 24, 32), context: int = 256) -> dict[str, dict[str, float]]:
    """{nodes: {"tree": time of a tree pass of that many nodes (the root's row too), "chain":
    a chain pass as wide} / time of a 1-token pass}, eager, at `context` tokens (interleaved
    rounds, as verify_costs)."""
    from engine.speculative.tree import TreeShape, grow, select
    logp = torch.log_softmax(torch.arange(64, 0, -1, dtype=torch.float32), -1)
    full = grow(logp, lambda frontier, tree: logp.repeat(len(frontier), 1), TreeShape(4, 8, max(nodes)))
    shapes = [1] + [s for n in nodes for s in ((n + 1, select(full, n)), n + 1)]
    relative = _relative(pass_times(runner, shapes, context, repeats=9))
    return {str(n): {"tree": relative[1 + 2 * i], "chain": relative[2 + 2 * i]} for i, n in enumerate(nodes)}


class PlainStepClock:
    """Wall times of plain (non-speculative) decode steps, per set-up that changes them (KV
    dtype, compiled or eager, threads): the plain decode speed speculation is compared with.
    Measured in the session; when a set-up has none yet, a short calibration (5 one-token
    target passes) stands in until plain steps are seen."""

    KEEP = 64

    def __init__(self):
        self.times: dict[tuple, deque] = {}
        self.calibrated: dict[tuple, float] = {}

    def record(self, key: tuple, seconds: float) -> None:
        self.times.setdefault(key, deque(maxlen=self.KEEP)).append(seconds)

    def estimate(self, key: tuple) -> tuple[float | None, str | None]:
        """(seconds, "session" | "calibration"), or (None, None)."""
        seen = self.times.get(key)
        if seen:
            return statistics.median(seen), "session"
        if key in self.calibrated:
            return self.calibrated[key], "calibration"
        return None, None

    def calibrate(self, key: tuple, runner, context: int = 64) -> None:
        if key not in self.times and key not in self.calibrated:
            self.calibrated[key] = pass_seconds(runner, 1, context=context, repeats=5)
