"""Draft trees: many candidate continuations verified in one target pass (SpecInfer, EAGLE-2).

Every proposal is a tree: a chain of k drafts is the tree whose parents are i - 1.
A tree's nodes are draft tokens, numbered in the order they were grown (a parent before its
children); node i's parent is parents[i] (-1: a child of the root, the last sampled token).
The verify pass feeds the root and every node: row 0 is the root at position p, row i + 1 is
node i, at position p + depth(i) (RoPE and the causal mask see the depth) but stored at
index p + 1 + i of its sequence's cache (each node its own slot). A row attends to the
context before p and to its own chain of ancestors: the tree mask. The torch path lays that
chain out as a sequence of its own (engine.layers.attention), so a node's numbers are the
same as if its path had been fed as a chain: greedy decoding with a tree is token-identical
to plain decoding. A chain's tree mask is the causal mask, so its pass is plain causal rows
(the cheaper attention path) and keeping its accepted rows is a rollback.

Growing (EAGLE-2's rule, `grow`): from the root the draft's top-k tokens are the first
frontier; each next depth expands the frontier's nodes into their top-k children and keeps
the best k of those by cumulative log-probability (the product of the draft's confidences
along the path) as the next frontier; the others stay in the tree as leaves. Then the `nodes` best nodes overall by cumulative log-probability are
verified; a path's score only falls along it, so that set always holds every node's parent.
The sum of the kept nodes' confidences is what the draft itself predicts the pass accepts.

Verification: greedy walks from the root, following the child whose token is the target's
argmax, and emits the target's argmax where no child matches. Sampling stays lossless by
recursive rejection over siblings (SpecInfer; EAGLE's `evaluate_posterior`): a node's
children are point-mass proposals tried in order, child x kept with probability p(x) under
the target's distribution p, and on rejection p loses x (renormalised) before the next
sibling; when every child is rejected the token is drawn from what is left of p. (A chain
drafted from a distribution q is sampled against q instead: spec_decode.rejection_sample.)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from engine.config import TreeShape, parse_tree  # noqa: F401 (the setting's value, re-exported)
from engine.layers.attention_metadata import TreeRows
from engine.metrics import ACCEPTED, BONUS, RESAMPLED


@dataclass
class DraftTree:
    tokens: list[int]
    parents: list[int]                       # -1: a child of the root
    scores: list[float] = field(default_factory=list)    # cumulative draft log-probability per node

    @classmethod
    def chain(cls, tokens: list[int]) -> "DraftTree":
        """k drafts in a row: node i's parent is node i - 1 (no scores: the draft gave none)."""
        return cls(list(tokens), list(range(-1, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depths(self) -> list[int]:
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    def path(self, node: int) -> list[int]:
        """The nodes from the root's child down to `node`."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def children(self) -> list[list[int]]:
        """children()[i + 1]: node i's children; children()[0]: the root's, in node order."""
        out: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, p in enumerate(self.parents):
            out[p + 1].append(i)
        return out

    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def predicted_accepted(self) -> float:
        """The draft's own expectation of accepted nodes: the sum of path confidences."""
        return sum(math.exp(s) for s in self.scores)

    def rows(self, start: int) -> "TreeRows":
        """The verify pass's layout at a root stored at index `start` (see the module doc)."""
        paths = [[start]] + [[start] + [start + 1 + j for j in self.path(i)] for i in range(len(self))]
        return TreeRows(context=start, indices=[start + r for r in range(len(self) + 1)], paths=paths)


def frontier_rows(tree: DraftTree, frontier: list[int], context: int, first: int, index: dict[int, int]) -> TreeRows:
    """The rows of one growth pass of a draft over `frontier`, stored at its cache indices
    first.. after a context of `context` keys; index (node -> cache index) gains them."""
    index.update({node: first + j for j, node in enumerate(frontier)})
    return TreeRows(context, [index[f] for f in frontier], [[index[a] for a in tree.path(f)] for f in frontier])


def select(tree: DraftTree, nodes: int) -> DraftTree:
    """The `nodes` best nodes by cumulative score (ancestor-closed, see the module doc),
    renumbered in their original order."""
    if nodes >= len(tree):
        return tree
    best = sorted(range(len(tree)), key=lambda i: (-tree.scores[i], i))[:nodes]
    keep = set(best)
    for i in best:                     # ties at -inf or equal scores: keep the tree closed
        keep.update(tree.path(i))
    order = sorted(keep)
    new = {old: j for j, old in enumerate(order)}
    return DraftTree([tree.tokens[i] for i in order], [new.get(tree.parents[i], -1) for i in order],
                     [tree.scores[i] for i in order])


@dataclass
class Verdict:
    """What a verify pass settled, for a chain or a tree (the token kinds: engine.speculative.spec_decode)."""
    path: list[int]              # accepted nodes, root's child first (a chain's: 0, 1, ...)
    tokens: list[int]            # emitted: the accepted nodes' tokens, then one resampled or bonus token
    kinds: list[str]
    attempted_depths: int        # depths at which a node was tried (accepted path + the failed try)

    @property
    def num_accepted(self) -> int:
        return len(self.path)

    @property
    def rows(self) -> list[int]:
        """The pass rows (root first) whose KV stays: the root and the accepted nodes."""
        return [0] + [i + 1 for i in self.path]

    @property
    def accepted_per_position(self) -> list[bool]:
        """Per depth: accepted, then the failed try if one was made (engine.metrics' positions)."""
        return [d < self.num_accepted for d in range(self.attempted_depths)]


def greedy_verify(tree: DraftTree, target_argmax: list[int]) -> Verdict:
    """target_argmax: the target's argmax at every row (root first)."""
    children = tree.children()
    path, row = [], 0
    while True:
        want = target_argmax[row]
        match = next((c for c in children[row] if tree.tokens[c] == want), None)
        if match is None:
            return _verdict(tree, path, want, tried=bool(children[row]))
        path.append(match)
        row = match + 1


def sample_verify(tree: DraftTree, target_probs: torch.Tensor, generator: torch.Generator) -> Verdict:
    """Point-mass drafts (an n-gram chain, a tree). target_probs [rows, V]: the target's
    distribution at every row (root first)."""
    children = tree.children()
    path, row = [], 0
    while True:
        p = target_probs[row].clone()
        match = None
        for c in children[row]:
            x = tree.tokens[c]
            u = float(torch.rand((), generator=generator))
            if u < float(p[x]):                 # a point mass: min(1, p(x) / 1)
                match = c
                break
            p[x] = 0.0
            total = float(p.sum())
            if total <= 0.0:                    # nothing left of p: cannot happen unless p was a point mass
                p = target_probs[row].clone()
                break
            p /= total
        if match is None:
            token = int(torch.multinomial(p, 1, generator=generator))
            return _verdict(tree, path, token, tried=bool(children[row]))
        path.append(match)
        row = match + 1


def _verdict(tree: DraftTree, path: list[int], token: int, tried: bool) -> Verdict:
    """The accepted path, then `token`: resampled where a child was tried, else a bonus."""
    return Verdict(path, [tree.tokens[i] for i in path] + [token],
                   [ACCEPTED] * len(path) + [RESAMPLED if tried else BONUS], len(path) + int(tried))


def grow(root_logp: torch.Tensor, expand, shape: TreeShape, vocab: torch.Tensor | None = None) -> DraftTree:
    """EAGLE-2's expansion. root_logp [V]: the draft's log-probabilities after the root.
    expand(frontier nodes, tree) -> [len(frontier), V] log-probabilities after each of them
    (the draft run on the frontier in one pass). vocab: the token id of each of the V
    entries (a reduced head), None: the entry is the token id. Returns every grown node
    (select trims it)."""
    k = shape.top_k
    token = (lambda i: int(i)) if vocab is None else (lambda i: int(vocab[i]))
    top = torch.topk(root_logp, min(k, root_logp.shape[-1]))
    tree = DraftTree([], [], [])
    frontier = []
    for s, t in zip(top.values.tolist(), top.indices.tolist()):
        if s == float("-inf"):
            break
        frontier.append(len(tree))
        tree.tokens.append(token(t))
        tree.parents.append(-1)
        tree.scores.append(float(s))
    for _ in range(shape.depth - 1):
        if not frontier:
            break
        logp = expand(frontier, tree)                                           # [F, V]
        cum = logp + torch.tensor([tree.scores[i] for i in frontier], dtype=logp.dtype)[:, None]
        vals, idx = torch.topk(cum, min(k, cum.shape[-1]), dim=-1)              # each node's top-k children
        new = []
        for f, parent in enumerate(frontier):
            for s, t in zip(vals[f].tolist(), idx[f].tolist()):
                if s == float("-inf"):
                    break
                new.append(len(tree))
                tree.tokens.append(token(t))
                tree.parents.append(parent)
                tree.scores.append(float(s))
        new.sort(key=lambda i: (-tree.scores[i], i))                            # the best k grow on
        frontier = sorted(new[:k])
    return tree
