"""Speculative decoding: proposers and the rejection sampler.

Notation (as in the paper and gpt-fast): p is the TARGET distribution, q the DRAFT's.
For draft tokens x_1..x_k, the target scores all of them in one forward pass.
  - accepted token: x_i kept with probability min(1, p(x_i) / q(x_i)), given x_<i kept;
  - resampled ("recovered") token: at the first rejection, drawn from norm(max(0, p - q));
  - bonus token: when all k are kept, drawn from p at position k+1.
The emitted sequence then has exactly the target's distribution. Greedy mode keeps x_i
while it equals the target argmax, then emits the target argmax: identical to plain greedy.
A proposer without a distribution (n-gram lookup) is a point mass: q(x_i) = 1.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.config import SamplingParams
from engine.errors import DraftIncompatibleError
from engine.layers.sampler import probabilities
from engine.metrics import ACCEPTED, BONUS, RESAMPLED
from engine.runtime.model_runner import PassItem
from engine.spec.tree import DraftTree, TreeShape, frontier_rows, grow, select


# ---- the rejection sampler (pure) ---------------------------------------------
@dataclass
class Verdict:
    num_accepted: int            # draft tokens kept
    tokens: list[int]            # emitted: the kept draft tokens, then one resampled or bonus token
    kinds: list[str]


def rejection_sample(draft_tokens: list[int], draft_probs: torch.Tensor | None,
                     target_probs: torch.Tensor, generator: torch.Generator) -> Verdict:
    """draft_probs [k, V] (None: point masses), target_probs [k+1, V]."""
    k = len(draft_tokens)
    for i, x in enumerate(draft_tokens):
        p_x = float(target_probs[i, x])
        q_i = _point_mass(x, target_probs[i]) if draft_probs is None else draft_probs[i]
        q_x = float(q_i[x])
        u = float(torch.rand((), generator=generator))
        if q_x > 0 and u < min(1.0, p_x / q_x):
            continue
        residual = torch.clamp(target_probs[i] - q_i, min=0.0)
        if float(residual.sum()) <= 0.0:        # p == q on the support: any draw from p is exact
            residual = target_probs[i]
        token = int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
        return Verdict(i, list(draft_tokens[:i]) + [token], [ACCEPTED] * i + [RESAMPLED])
    bonus = int(torch.multinomial(target_probs[k], 1, generator=generator))
    return Verdict(k, list(draft_tokens) + [bonus], [ACCEPTED] * k + [BONUS])


def greedy_verify(draft_tokens: list[int], target_argmax: list[int]) -> Verdict:
    """target_argmax: the target's argmax at each of the k+1 verified positions."""
    k = len(draft_tokens)
    for i, x in enumerate(draft_tokens):
        if x != target_argmax[i]:
            return Verdict(i, list(draft_tokens[:i]) + [target_argmax[i]], [ACCEPTED] * i + [RESAMPLED])
    return Verdict(k, list(draft_tokens) + [target_argmax[k]], [ACCEPTED] * k + [BONUS])


def _point_mass(token: int, like: torch.Tensor) -> torch.Tensor:
    """q for a proposer without a distribution: all mass on the proposed token."""
    q = torch.zeros_like(like)
    q[token] = 1.0
    return q


# ---- proposers ------------------------------------------------------------------
@dataclass
class Proposal:
    tokens: list[int]
    probs: torch.Tensor | None    # [len(tokens), V] draft distribution, None for point masses
    time_s: float = 0.0
    tree: DraftTree | None = None  # a draft tree (tokens are its nodes'); None: a chain

    def trimmed(self, nodes: int) -> "Proposal":
        """A tree cut to its `nodes` best nodes (engine.spec.tree.select)."""
        tree = select(self.tree, nodes)
        return Proposal(list(tree.tokens), None, self.time_s, tree)


class Proposer:
    def begin(self, prompt_ids: list[int]) -> None:
        pass

    def propose(self, token_ids: list[int], k: int, params: SamplingParams, generator) -> Proposal:
        raise NotImplementedError

    supports_trees = False

    def propose_tree(self, token_ids: list[int], shape: TreeShape, params: SamplingParams, generator) -> Proposal:
        """A draft tree of at most shape.nodes nodes (engine.spec.tree.grow), for proposers
        with supports_trees."""
        raise NotImplementedError

    def target_pass(self, start: int, hidden: torch.Tensor) -> None:
        """The target's final hidden states [N, hidden] for positions start.. of its last pass."""

    def accepted(self, token_ids: list[int]) -> None:
        """The target settled on token_ids (the whole sequence so far)."""

    def end(self) -> None:
        pass


class NgramProposer(Proposer):
    """Prompt lookup: find the most recent earlier occurrence of the longest suffix n-gram
    (n from ngram_max down to ngram_min) and propose the tokens that followed it."""

    def __init__(self, ngram_min: int = 1, ngram_max: int = 4):
        self.ngram_min, self.ngram_max = ngram_min, ngram_max

    def propose(self, token_ids, k, params, generator) -> Proposal:
        t0 = time.perf_counter()
        tokens = ngram_lookup(token_ids, k, self.ngram_min, self.ngram_max)
        return Proposal(tokens, None, time.perf_counter() - t0)


def ngram_lookup(token_ids: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    length = len(token_ids)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = token_ids[length - n:]
        for start in range(length - n - 1, -1, -1):       # most recent match first
            if token_ids[start:start + n] == suffix:
                follow = token_ids[start + n:start + n + k]
                if follow:
                    return follow
    return []


class DraftModelProposer(Proposer):
    """A smaller model with its own paged KV cache, kept in step with the target."""

    def __init__(self, runner):
        self.runner = runner          # engine.runtime.model_runner.ModelRunner
        self.seq = None
        self.fed: list[int] = []      # the tokens whose KV the draft cache now holds

    def begin(self, prompt_ids: list[int]) -> None:
        self.seq = self.runner.start(prompt_ids)
        self.fed = list(prompt_ids[:self.seq.num_computed])

    def propose(self, token_ids, k, params, generator) -> Proposal:
        t0 = time.perf_counter()
        seq, runner = self.seq, self.runner
        logits = runner.forward(seq, token_ids[seq.num_computed:])      # catch up with the target
        tokens, probs = [], []
        for i in range(k):
            if params.greedy:
                token = int(torch.argmax(logits[-1]))
            else:
                q = probabilities(logits[-1], params)
                token = int(torch.multinomial(q, 1, generator=generator))
                probs.append(q)
            tokens.append(token)
            if i + 1 < k:
                logits = runner.forward(seq, [token])
        self.fed = list(token_ids) + tokens[:-1]
        return Proposal(tokens, torch.stack(probs) if probs else None, time.perf_counter() - t0)

    supports_trees = True

    def propose_tree(self, token_ids, shape, params, generator) -> Proposal:
        """Each depth's frontier is one tree pass of the draft model over its own cache (rows
        past the context, each attending its chain: engine.spec.tree); `accepted` rolls the
        nodes back, and the next catch-up feeds the accepted tokens as a chain."""
        t0 = time.perf_counter()
        seq, runner = self.seq, self.runner
        logits = runner.forward(seq, token_ids[seq.num_computed:])      # catch up; the root's row is last
        context = seq.num_computed
        index: dict[int, int] = {}                                      # node -> its cache index

        def expand(frontier, tree):
            rows = frontier_rows(tree, frontier, context, seq.num_computed, index)
            (out, _), = runner.forward_batch([PassItem(seq, [tree.tokens[f] for f in frontier], len(frontier), rows)])
            return torch.log_softmax(out, -1)

        tree = grow(torch.log_softmax(logits[-1], -1), expand, shape)
        self.fed = list(token_ids)
        tree = select(tree, shape.nodes)
        return Proposal(list(tree.tokens), None, time.perf_counter() - t0, tree)

    def accepted(self, token_ids: list[int]) -> None:
        # Draft KV stays valid only where what it was fed agrees with what the target settled on.
        keep = min(_common_prefix(token_ids, self.fed), len(token_ids) - 1)
        self.runner.rollback(self.seq, keep)
        del self.fed[keep:]
        self.runner.commit(self.seq, token_ids)

    def end(self) -> None:
        if self.seq is not None:
            self.runner.end(self.seq)
            self.seq = None


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def check_draft_compatible(target_tokenizer, draft_tokenizer) -> None:
    """Same token ids for the shared vocabulary range and the same special tokens."""
    tv, dv = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    t_by_id = {i: s for s, i in tv.items()}
    d_by_id = {i: s for s, i in dv.items()}
    shared = min(len(t_by_id), len(d_by_id))
    for i in range(shared):
        if t_by_id.get(i) != d_by_id.get(i):
            raise DraftIncompatibleError(
                f"the draft uses another tokenizer: token id {i} is {d_by_id.get(i)!r} in the draft "
                f"but {t_by_id.get(i)!r} in the target; choose a draft from the same model family")
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
        t, d = getattr(target_tokenizer, attr, None), getattr(draft_tokenizer, attr, None)
        if t is not None and d is not None and t != d:
            raise DraftIncompatibleError(f"the draft's {attr} is {d} but the target's is {t}")
