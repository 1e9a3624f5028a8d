"""The suffix proposer (proposer `suffix`): drafts what followed the context's longest earlier
match, in the request's own text or in earlier requests' outputs (SuffixDecoding, arXiv
2411.04975; vLLM's speculative method `suffix`). Model-free: a draft costs index lookups.

Two indices (engine.spec.suffix_index): the request's own (its prompt and output so far,
appended to each step) and the engine's global one over finished requests' outputs
(`SuffixCache`, bounded by the suffix_cache_tokens setting, oldest requests evicted first).
Each step, for each index:
  - the recent occurrences of the context's suffix, each with its match length m;
  - for each distinct m (longest first), the occurrences matching at least m tokens, and
    what followed them: a path's estimated probability is the number of occurrences followed
    by it over the number of occurrences (its count in the suffix tree over its root's);
  - the draft is a tree of at most min(k, floor(suffix_spec_factor x m)) nodes, the most
    probable paths first, each node at least suffix_min_prob likely (a node is never likelier
    than its parent, so the best n nodes always hold their ancestors);
  - its score is the sum of its nodes' probabilities: the tokens it is expected to accept.
The draft with the best score over every m and both indices is proposed; no match, no draft.
Drafts are point masses (tree.sample_verify keeps sampling lossless; greedy verification
keeps the target's argmax), so what is drafted changes only the speed.
"""
from __future__ import annotations

import math
import time
from bisect import bisect_right

import numpy as np

from engine.spec.spec_decode import Proposal, Proposer
from engine.spec.suffix_index import MAX_MATCH, SEPARATOR, Match, SuffixIndex
from engine.spec.tree import DraftTree

MAX_LENGTHS_TRIED = 4      # distinct match lengths tried per index, longest first
REQUEST, GLOBAL = "request", "global"


class SuffixCache:
    """The engine's global index over finished requests' outputs, and where the suffix
    proposer's draft tokens came from (drafted and accepted, per source)."""

    def __init__(self, max_tokens: int):
        self.index = SuffixIndex(max_tokens)
        self.drafted = {REQUEST: 0, GLOBAL: 0}
        self.accepted = {REQUEST: 0, GLOBAL: 0}

    def clear(self) -> None:
        """An empty global index and zero counters (a bench arm starts here)."""
        self.index.clear()
        self.drafted = {REQUEST: 0, GLOBAL: 0}
        self.accepted = {REQUEST: 0, GLOBAL: 0}

    def add_output(self, tokens: list[int], max_tokens: int) -> None:
        self.index.max_tokens = max_tokens
        if max_tokens > 0:
            self.index.add_document(tokens)
        else:
            self.index.evict()

    def counters(self) -> dict:
        return {"draft_tokens_from_request": self.drafted[REQUEST], "draft_tokens_from_global": self.drafted[GLOBAL],
                "accepted_from_request": self.accepted[REQUEST], "accepted_from_global": self.accepted[GLOBAL],
                "global_tokens": self.index.num_tokens, "global_requests": len(self.index.documents)}


class SuffixProposer(Proposer):
    def __init__(self, cache: SuffixCache, spec_factor: float = 1.0, min_prob: float = 0.1,
                 cache_tokens: int = 1 << 18):
        self.cache, self.spec_factor, self.min_prob, self.cache_tokens = cache, spec_factor, min_prob, cache_tokens
        self.own = SuffixIndex()
        self.last: tuple[int, DraftTree, str] | None = None    # (context length, tree, source) of the last draft

    def begin(self, prompt_ids: list[int]) -> None:
        self.own.extend(prompt_ids)

    def propose(self, token_ids, k, params, generator) -> Proposal:
        t0 = time.perf_counter()
        own = self.own
        if own.end < len(token_ids):
            own.extend(token_ids[own.end:])
        context = token_ids[-MAX_MATCH:]
        best = best_draft(own, own.match(context, before=own.end - 1), k, self.spec_factor, self.min_prob)
        source = REQUEST
        shared = self.cache.index
        if shared.num_tokens:
            theirs = best_draft(shared, shared.match(context), k, self.spec_factor, self.min_prob)
            if theirs is not None and (best is None or theirs[1] > best[1]):
                best, source = theirs, GLOBAL
        if best is None:
            self.last = None
            return Proposal(DraftTree.chain([]), None, time.perf_counter() - t0)
        tree = best[0]
        self.cache.drafted[source] += len(tree)
        self.last = (len(token_ids), tree, source)
        return Proposal(tree, None, time.perf_counter() - t0)

    def accepted(self, token_ids: list[int]) -> None:
        """Count the last draft's accepted nodes: the path its emitted tokens follow (the
        token after the accepted path never matches a tried child)."""
        if self.last is None:
            return
        start, tree, source = self.last
        self.last = None
        children, row, kept = tree.children(), 0, 0
        for token in token_ids[start:]:
            row = next((c + 1 for c in children[row] if tree.tokens[c] == token), None)
            if row is None:
                break
            kept += 1
        self.cache.accepted[source] += kept

    def finished(self, token_ids: list[int], prompt_len: int) -> None:
        self.accepted(token_ids)
        self.cache.add_output(token_ids[prompt_len:], self.cache_tokens)


def best_draft(index: SuffixIndex, match: Match, k: int, spec_factor: float,
               min_prob: float) -> tuple[DraftTree, float] | None:
    """The best-scoring draft tree over the match's distinct lengths, with its score; None
    when nothing is worth drafting."""
    best = None
    for m in sorted(set(match.lengths.tolist()), reverse=True)[:MAX_LENGTHS_TRIED]:
        nodes = min(k, int(spec_factor * m + 1e-6))
        if nodes < 1:
            break                                   # shorter matches allow fewer nodes still
        windows = index.following(match.positions[match.lengths >= m], nodes)
        tree, score = continuation_tree(windows, nodes, min_prob)
        if len(tree) and (best is None or score > best[1]):
            best = (tree, score)
    return best


def continuation_tree(windows: np.ndarray, max_nodes: int, min_prob: float) -> tuple[DraftTree, float]:
    """windows [C, D]: the D tokens after each of C occurrences (SEPARATOR where the text
    ended). The tree of their common prefixes, at most max_nodes nodes of probability (count
    / C) at least min_prob, most probable first (then shallower, then by token order), node
    scores their log-probabilities; and the sum of those probabilities."""
    occurrences, depth = windows.shape
    need = max(1, math.ceil(min_prob * occurrences - 1e-9))
    if occurrences == 1:                                    # one occurrence: a chain, probability 1
        row = windows[0].tolist()
        tokens = row[:row.index(SEPARATOR)] if SEPARATOR in row else row
        tokens = tokens[:max_nodes]
        return DraftTree(tokens, list(range(-1, len(tokens) - 1)), [0.0] * len(tokens)), float(len(tokens))
    rows = windows[np.lexsort(windows.T[::-1])]            # sorted by the first token, then the second...
    new = np.ones((occurrences, depth), dtype=bool)        # [i, d]: row i starts a new prefix of length d + 1
    new[1:] = np.logical_or.accumulate(rows[1:] != rows[:-1], axis=1)
    starts_at: list[list[int]] = []
    found: list[tuple[int, int, int]] = []                 # (-count, depth, first row)
    for d in range(depth):
        starts = np.flatnonzero(new[:, d])
        counts = np.diff(starts, append=occurrences)
        ok = (counts >= need) & (rows[starts, d] != SEPARATOR)
        if not ok.any():
            break
        starts_at.append(starts.tolist())
        found.extend((-c, d, s) for c, s in zip(counts[ok].tolist(), starts[ok].tolist()))
    found.sort()
    node_of: dict[tuple[int, int], int] = {}
    tree, total = DraftTree([], [], []), 0
    for neg_count, d, s in found[:max_nodes]:
        if d == 0:
            parent = -1
        else:                                              # the prefix one shorter that holds row s
            above = starts_at[d - 1]
            parent = node_of[(d - 1, above[bisect_right(above, s) - 1])]
        node_of[(d, s)] = len(tree)
        tree.tokens.append(int(rows[s, d]))
        tree.parents.append(parent)
        tree.scores.append(math.log(-neg_count / occurrences))
        total -= neg_count
    return tree, total / occurrences
