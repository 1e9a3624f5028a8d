"""Speculative decoding: proposers and the rejection sampler.

A proposal is a draft tree (engine.speculative.tree); a chain of k drafts is the tree whose parents
are i - 1. Greedy verification (tree.greedy_verify) keeps drafts while they equal the target
argmax, then emits the target argmax: identical to plain greedy, for chains and trees.

Notation (as in the paper and gpt-fast): p is the TARGET distribution, q the DRAFT's.
For a chain x_1..x_k drafted from q, the target scores all of them in one forward pass.
  - accepted token: x_i kept with probability min(1, p(x_i) / q(x_i)), given x_<i kept;
  - resampled ("recovered") token: at the first rejection, drawn from norm(max(0, p - q));
  - bonus token: when all k are kept, drawn from p at position k+1.
The emitted sequence then has exactly the target's distribution. A proposer without a
distribution (n-gram lookup, a tree's nodes) is a point mass, q(x_i) = 1: tree.sample_verify,
which for a chain is this rule with q a point mass.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.config import SamplingParams
from engine.errors import DraftIncompatibleError
from engine.layers.sampler import greedy, probabilities
from engine.metrics import ACCEPTED, BONUS, RESAMPLED
from engine.runtime.model_runner import PassItem
from engine.speculative.tree import DraftTree, TreeShape, Verdict, frontier_rows, grow, select


# ---- the rejection sampler (pure) ---------------------------------------------
def rejection_sample(draft_tokens: list[int], draft_probs: torch.Tensor,
                     target_probs: torch.Tensor, generator: torch.Generator) -> Verdict:
    """A chain drafted from q. draft_probs [k, V]: q at each draft, target_probs [k+1, V]."""
    k = len(draft_tokens)
    for i, x in enumerate(draft_tokens):
        p_x, q_x = float(target_probs[i, x]), float(draft_probs[i, x])
        u = float(torch.rand((), generator=generator))
        if q_x > 0 and u < min(1.0, p_x / q_x):
            continue
        residual = torch.clamp(target_probs[i] - draft_probs[i], min=0.0)
        if float(residual.sum()) <= 0.0:        # p == q on the support: any draw from p is exact
            residual = target_probs[i]
        token = int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
        return Verdict(list(range(i)), list(draft_tokens[:i]) + [token], [ACCEPTED] * i + [RESAMPLED], i + 1)
    bonus = int(torch.multinomial(target_probs[k], 1, generator=generator))
    return Verdict(list(range(k)), list(draft_tokens) + [bonus], [ACCEPTED] * k + [BONUS], k)


# ---- proposers ------------------------------------------------------------------
@dataclass
class Proposal:
    tree: DraftTree               # the drafts (DraftTree.chain for k in a row)
    probs: torch.Tensor | None    # [len(tree), V] a chain's draft distribution q; None: point masses
    time_s: float = 0.0
    grown: bool = False           # grown by propose_tree: a tree step, its scores the draft's confidences
    source: str = ""              # where a retrieval draft came from (the suffix proposer: request, global)
    proposer: str = ""            # which proposer drafted it (the engine's name for it: suffix, ngram, ...)
    grown_nodes: int | None = None    # a trimmed tree's nodes as grown (None: not trimmed)

    @property
    def tokens(self) -> list[int]:
        return self.tree.tokens

    def trimmed(self, nodes: int) -> "Proposal":
        """A grown tree cut to its `nodes` best nodes (engine.speculative.tree.select)."""
        return Proposal(select(self.tree, nodes), None, self.time_s, grown=True, source=self.source,
                        proposer=self.proposer, grown_nodes=len(self.tree))


class Proposer:
    reads_hidden = False      # target_pass is given the target's hidden states (else it is not called)

    def begin(self, prompt_ids: list[int]) -> None:
        pass

    def propose(self, token_ids: list[int], k: int, params: SamplingParams, generator) -> Proposal:
        raise NotImplementedError

    supports_trees = False

    def propose_tree(self, token_ids: list[int], shape: TreeShape, params: SamplingParams, generator) -> Proposal:
        """A draft tree of at most shape.nodes nodes (engine.speculative.tree.grow), for proposers
        with supports_trees."""
        raise NotImplementedError

    def target_pass(self, start: int, hidden: torch.Tensor) -> None:
        """The target's final hidden states [N, hidden] for positions start.. of its last pass
        (only for a proposer that reads_hidden)."""

    def accepted(self, token_ids: list[int]) -> None:
        """The target settled on token_ids (the whole sequence so far)."""

    def finished(self, token_ids: list[int], prompt_len: int) -> None:
        """The request ended (not preempted) with token_ids, its prompt the first prompt_len."""

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
        return Proposal(DraftTree.chain(tokens), None, time.perf_counter() - t0)


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
        self._sync(token_ids)
        logits = runner.forward(seq, token_ids[seq.num_computed:])      # catch up with the target
        tokens, probs = [], []
        for i in range(k):
            if params.greedy:
                token = greedy(logits[-1])
            else:
                q = probabilities(logits[-1], params)
                token = int(torch.multinomial(q, 1, generator=generator))
                probs.append(q)
            tokens.append(token)
            if i + 1 < k:
                logits = runner.forward(seq, [token])
        self.fed = list(token_ids) + tokens[:-1]
        return Proposal(DraftTree.chain(tokens), torch.stack(probs) if probs else None, time.perf_counter() - t0)

    supports_trees = True

    def propose_tree(self, token_ids, shape, params, generator) -> Proposal:
        """Each depth's frontier is one tree pass of the draft model over its own cache (rows
        past the context, each attending its chain: engine.speculative.tree); `accepted` (or, for a
        tree the target never verified, the next proposal) rolls the nodes back, and the next
        catch-up feeds the accepted tokens as a chain."""
        t0 = time.perf_counter()
        seq, runner = self.seq, self.runner
        self._sync(token_ids)
        logits = runner.forward(seq, token_ids[seq.num_computed:])      # catch up; the root's row is last
        self.fed = list(token_ids)
        context = seq.num_computed
        index: dict[int, int] = {}                                      # node -> its cache index

        def expand(frontier, tree):
            rows = frontier_rows(tree, frontier, context, seq.num_computed, index)
            (out, _), = runner.forward_batch([PassItem(seq, [tree.tokens[f] for f in frontier], len(frontier), rows)])
            return torch.log_softmax(out, -1)

        tree = grow(torch.log_softmax(logits[-1], -1), expand, shape)
        return Proposal(select(tree, shape.nodes), None, time.perf_counter() - t0, grown=True)

    def accepted(self, token_ids: list[int]) -> None:
        self._sync(token_ids)
        self.runner.commit(self.seq, token_ids)

    def _sync(self, token_ids: list[int]) -> None:
        """Draft KV stays valid only where what it was fed agrees with what the target settled on,
        and never past what `fed` records: a draft the target did not verify (a tree trimmed to no
        node, a draft cut short by the draft's own full pool) left rows past it. At least the
        last token is fed again, so a catch-up pass always has a row."""
        keep = min(_common_prefix(token_ids, self.fed), len(token_ids) - 1, self.seq.num_computed)
        self.runner.rollback(self.seq, keep)
        del self.fed[keep:]

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
