"""The suffix proposer (proposer `suffix`): drafts what followed the context's longest earlier
match, in the request's own text or in earlier requests' outputs (SuffixDecoding, arXiv
2411.04975; vLLM's speculative method `suffix`). Model-free: a draft costs index lookups.

Two indices (engine.speculative.suffix_index): the request's own (its prompt and output so far,
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
The engine asks for it as a tree (Speculator.tree_in_effect: k nodes k deep, or draft_tree's
shape); under speculation_policy auto the policy verifies the nodes that the measured pass
costs say pay, by these probabilities (engine.speculative.policy.choose_tree_nodes).
Drafts are point masses (tree.sample_verify keeps sampling lossless; greedy verification
keeps the target's argmax), so what is drafted changes only the speed.
"""
from __future__ import annotations

import math
import time
from collections import deque

from engine.speculative.spec_decode import Proposal, Proposer
from engine.speculative.suffix_index import MAX_MATCH, Match, SuffixIndex
from engine.speculative.tree import DraftTree

MAX_LENGTHS_TRIED = 4      # distinct match lengths tried per index, longest first
KEEP_TIMES = 100_000       # drafting times kept for the median and p99
REQUEST, GLOBAL = "request", "global"


class SuffixCache:
    """The engine's global index over finished requests' outputs, and where the suffix
    proposer's draft tokens came from (drafted and accepted, per source)."""

    def __init__(self, max_tokens: int):
        self.index = SuffixIndex(max_tokens)
        self.clear()

    def clear(self) -> None:
        """An empty global index and zero counters (a bench arm starts here)."""
        self.index.clear()
        self.drafted = {REQUEST: 0, GLOBAL: 0}
        self.accepted = {REQUEST: 0, GLOBAL: 0}
        self.propose_s: deque[float] = deque(maxlen=KEEP_TIMES)     # the recent steps' drafting seconds

    def add_output(self, tokens: list[int], max_tokens: int) -> None:
        self.index.max_tokens = max_tokens
        if max_tokens > 0:
            self.index.add_document(tokens)
        else:
            self.index.evict()

    def record(self, source: str, drafted: int, accepted: int) -> None:
        """A verified draft from `source` (its nodes as verified, after any trim)."""
        self.drafted[source] += drafted
        self.accepted[source] += accepted

    def counters(self) -> dict:
        """Draft tokens by source, drafted and accepted; the global index's size; the median and
        99th percentile of a step's drafting time (ms; a busy machine's preemptions show in p99)."""
        times = sorted(self.propose_s)
        return {"draft_tokens_from_request": self.drafted[REQUEST], "draft_tokens_from_global": self.drafted[GLOBAL],
                "accepted_from_request": self.accepted[REQUEST], "accepted_from_global": self.accepted[GLOBAL],
                "global_tokens": self.index.num_tokens, "global_requests": len(self.index.documents),
                "proposal_ms_median": 1e3 * times[len(times) // 2] if times else None,
                "proposal_ms_p99": 1e3 * times[min(len(times) - 1, int(0.99 * len(times)))] if times else None}


class SuffixProposer(Proposer):
    def __init__(self, cache: SuffixCache, spec_factor: float = 1.0, min_prob: float = 0.1,
                 cache_tokens: int = 1 << 18):
        self.cache, self.spec_factor, self.min_prob, self.cache_tokens = cache, spec_factor, min_prob, cache_tokens
        self.own = SuffixIndex()

    def begin(self, prompt_ids: list[int]) -> None:
        self.own.extend(prompt_ids)

    def propose(self, token_ids, k, params, generator) -> Proposal:
        """A tree of at most k nodes (a chain when the counts never branch)."""
        return self._draft(token_ids, k, k, None, grown=False)

    supports_trees = True

    def propose_tree(self, token_ids, shape, params, generator) -> Proposal:
        """A tree of at most shape.nodes nodes, shape.depth deep, shape.top_k children a node;
        its scores are the nodes' log-probabilities, which the policy trims by (grown)."""
        return self._draft(token_ids, shape.nodes, shape.depth, shape.top_k, grown=True)

    def _draft(self, token_ids, nodes: int, depth: int, top_k: int | None, grown: bool) -> Proposal:
        t0 = time.perf_counter()
        own = self.own
        if own.end < len(token_ids):
            own.extend(token_ids[own.end:])
        context = token_ids[-MAX_MATCH:]
        rule = (nodes, self.spec_factor, self.min_prob, depth, top_k)
        best = best_draft(own, own.match(context, before=own.end - 1), *rule)
        source = REQUEST
        shared = self.cache.index
        if shared.num_tokens:
            theirs = best_draft(shared, shared.match(context), *rule)
            if theirs is not None and (best is None or theirs[1] > best[1]):
                best, source = theirs, GLOBAL
        tree = DraftTree([], [], []) if best is None else best[0]
        seconds = time.perf_counter() - t0
        self.cache.propose_s.append(seconds)
        return Proposal(tree, None, seconds, grown=grown, source=source if len(tree) else "")

    def finished(self, token_ids: list[int], prompt_len: int) -> None:
        self.cache.add_output(token_ids[prompt_len:], self.cache_tokens)


def best_draft(index: SuffixIndex, match: Match, max_nodes: int, spec_factor: float, min_prob: float,
               max_depth: int | None = None, top_k: int | None = None) -> tuple[DraftTree, float] | None:
    """The best-scoring draft tree over the match's distinct lengths, with its score; None
    when nothing is worth drafting."""
    best = None
    for m in sorted(set(match.lengths), reverse=True)[:MAX_LENGTHS_TRIED]:
        nodes = min(max_nodes, int(spec_factor * m + 1e-6))
        if nodes < 1 or (best is not None and best[1] >= nodes):
            break                         # shorter matches allow fewer nodes: none can score more
        positions = [p for p, n in zip(match.positions, match.lengths) if n >= m]
        windows = index.following(positions, min(nodes, max_depth or nodes))
        tree, score = continuation_tree(windows, nodes, min_prob, top_k)
        if len(tree) and (best is None or score > best[1]):
            best = (tree, score)
    return best


def continuation_tree(windows: list[list[int]], max_nodes: int, min_prob: float,
                      top_k: int | None = None) -> tuple[DraftTree, float]:
    """windows: the tokens after each of C occurrences. The tree of their common prefixes:
    at most max_nodes nodes (at most top_k children each) of probability (count / C) at least
    min_prob, the most probable first (then the shallower, then the more recent), its node
    scores their log-probabilities; and the sum of those probabilities."""
    occurrences = len(windows)
    need = max(1, math.ceil(min_prob * occurrences - 1e-9))
    trie: dict = {}                                   # token -> [count, children, latest occurrence]
    for i, window in enumerate(windows):
        level = trie
        for token in window:
            entry = level.get(token)
            if entry is None:
                entry = level[token] = [0, {}, i]
            entry[0] += 1
            entry[2] = i
            level = entry[1]
    found = []                                        # (-count, depth, -latest, token, children, parent key)
    stack = [(trie, 0, None)]
    while stack:
        level, depth, parent = stack.pop()
        for token, (count, children, latest) in level.items():
            if count >= need:
                key = (-count, depth, -latest, token)
                found.append(key + (parent,))
                stack.append((children, depth + 1, key))
    found.sort(key=lambda f: f[:4])                   # a parent sorts before its children
    node_of: dict = {}
    tree, total = DraftTree([], [], []), 0
    kids: dict = {}
    for neg_count, depth, neg_latest, token, parent in found:
        if len(tree) == max_nodes:
            break
        if parent is not None and parent not in node_of:
            continue                                  # its parent was left out (top_k)
        p = -1 if parent is None else node_of[parent]
        if top_k is not None and kids.get(p, 0) == top_k:
            continue
        kids[p] = kids.get(p, 0) + 1
        node_of[(neg_count, depth, neg_latest, token)] = len(tree)
        tree.tokens.append(token)
        tree.parents.append(p)
        tree.scores.append(math.log(-neg_count / occurrences))
        total -= neg_count
    return tree, total / occurrences
