"""The EAGLE proposer: drafts with engine.models.eagle_head from the target's own hidden states.

Position bookkeeping, for token_ids x_0..x_{n-1} (x_{n-1} sampled, not yet fed to the target):
  - the target has final hidden states f_j for j <= n-2: every forward pass hands its rows to
    `target_pass` (prefill, plain decode and verify passes alike: no extra target work);
  - the head's cache holds true-feature entries for positions base..kv_end-1; the entry at
    j is computed from (f_j, x_{j+1});
  - propose: catch up positions kv_end..n-2 in one pass (their features are the target's),
    the last row drafts d_1; then each next draft feeds (g, d_i) at the next position, where
    g is the head's own predicted feature. Those entries are speculative: kv_end stays n-1,
    so the next catch-up overwrites them. That is the head's rollback: after a verify the
    target's features for the accepted tokens replace the guesses.
A verify pass writes features for rejected drafts too; they lie past n'-2 for the next
token_ids (n' tokens), are never read, and the next pass overwrites them.
When the proposer starts mid-request (speculation switched on) or the prompt came from the
prefix cache, the head's cache starts at the first position it has a feature for (`base`);
its attention then sees a shorter context, which costs acceptance, never correctness.
"""
from __future__ import annotations

import time

import torch

from engine.config import SamplingParams
from engine.layers.attention_metadata import AttentionMetadata, SeqSlice, TreeRows
from engine.layers.sampler import greedy, probabilities
from engine.models.eagle_head import EagleHead
from engine.runtime.eagle_step import EagleStep
from engine.speculative.spec_decode import Proposal, Proposer
from engine.speculative.tree import DraftTree, TreeShape, frontier_rows, grow, select

GROW = 256          # feature and cache room is added in steps of this many positions


class EagleProposer(Proposer):
    reads_hidden = True

    def __init__(self, head: EagleHead, block_size: int, device, step: EagleStep | None = None):
        """step: how the head's passes run (the engine's, compiled where the target's step is);
        None: eagerly."""
        self.head, self.block_size, self.device = head, block_size, device
        self.step = step or EagleStep(head, torch.device(device))
        self.last_row = torch.zeros(1, dtype=torch.int64, device=device)     # a one-row pass's logits row
        self.dtype = head.fc.weight.dtype
        self.base: int | None = None      # first position with a target feature
        self.have = 0                     # features are known for positions base..have-1
        self.kv_end = 0                   # head cache holds true-feature entries base..kv_end-1
        self.features = torch.empty(0, head.config.hidden_size, dtype=self.dtype, device=device)
        self.kv = None

    @torch.inference_mode()
    def target_pass(self, start: int, hidden: torch.Tensor) -> None:
        """The target's final hidden states for positions start..start+N-1 (every pass). Kept in
        inference tensors, as the head's own guesses are: a compiled graph's inputs are of one
        kind (dynamo guards on it, and compiled the head's step twice)."""
        if self.base is None or start > self.have:   # the first pass seen, or one was missed
            self.base = self.kv_end = self.have = start
        if start < self.base:                        # rows before the head's first position
            hidden, start = hidden[self.base - start:], self.base
        lo = start - self.base
        self._ensure(lo + hidden.shape[0] + 1)
        self.features[lo:lo + hidden.shape[0]] = hidden.to(self.dtype)
        self.have = start + hidden.shape[0]
        self.kv_end = min(self.kv_end, start)        # entries from `start` on used older features

    @torch.inference_mode()
    def propose(self, token_ids, k, params: SamplingParams, generator) -> Proposal:
        t0 = time.perf_counter()
        first_pass = self._catch_up(token_ids)
        if first_pass is None:
            return Proposal(DraftTree.chain([]), None, time.perf_counter() - t0)
        logits, g = first_pass
        last = len(token_ids) - 2
        tokens, probs = [], []
        for i in range(k):
            token, q = self._pick(logits[-1:], params, generator)
            tokens.append(token)
            if q is not None:
                probs.append(q)
            if i + 1 == k:
                break
            pos = last + 1 + i                      # the position whose input is (g, token)
            self._ensure(pos - self.base + 2)
            out = self.step.chain(token, g[-1:], self.kv, pos - self.base, pos)
            if out is None:
                meta = self._meta(pos, 1)
                out = self.step([token], g[-1:], self.kv, meta, meta.positions + self.base, self.last_row)
            logits, g = out
        return Proposal(DraftTree.chain(tokens), torch.stack(probs) if probs else None, time.perf_counter() - t0)

    supports_trees = True

    @torch.inference_mode()
    def propose_tree(self, token_ids, shape: TreeShape, params: SamplingParams, generator) -> Proposal:
        """EAGLE-2: the catch-up pass as for a chain, then one head pass per depth over the
        frontier, each node attending the true-feature entries and its own chain of guessed
        entries (stored past them, overwritten by the next catch-up like a chain's)."""
        t0 = time.perf_counter()
        first_pass = self._catch_up(token_ids)
        if first_pass is None:
            return Proposal(DraftTree.chain([]), None, time.perf_counter() - t0)
        logits, g = first_pass
        head, context = self.head, self.kv_end - self.base          # true-feature entries in the head's cache
        index: dict[int, int] = {}                                  # node -> its slot in the head's cache
        out_feature: dict[int, torch.Tensor] = {-1: g[-1:]}         # node -> the head's guess after it

        def expand(frontier, tree):
            first = context + len(index)
            self._ensure(first + len(frontier) + 1)
            rows = frontier_rows(tree, frontier, context, first, index)
            meta = self._tree_meta(rows)
            ids = [tree.tokens[f] for f in frontier]
            feats = torch.cat([out_feature[tree.parents[f]] for f in frontier])
            rows = torch.arange(len(frontier), device=self.device)
            reduced, g_out = self.step(ids, feats, self.kv, meta, meta.positions + self.base, rows)
            for j, f in enumerate(frontier):
                out_feature[f] = g_out[j:j + 1]
            return torch.log_softmax(reduced, -1)

        tree = select(grow(torch.log_softmax(logits[-1], -1), expand, shape, vocab=head.head_token_ids), shape.nodes)
        return Proposal(tree, None, time.perf_counter() - t0, grown=True)

    def _catch_up(self, token_ids):
        """The head's pass over the positions it has target features for and no entry yet;
        (reduced logits of its last row, which drafts the first token, guessed features of its
        rows). None: no feature for the last position yet."""
        n = len(token_ids)
        last = n - 2
        if self.base is None or self.have <= last or last < self.base:
            return None
        first = min(self.kv_end, last)
        meta = self._meta(first, last - first + 1)
        rows = torch.tensor([last - first], dtype=torch.int64, device=self.device)
        out = self.step(list(token_ids[first + 1:last + 2]), self.features[first - self.base:last - self.base + 1], self.kv, meta,
                        meta.positions + self.base, rows)
        self.kv_end = last + 1
        return out

    def _tree_meta(self, rows: TreeRows) -> AttentionMetadata:
        positions = torch.tensor(rows.positions, device=self.device)
        slots = torch.tensor(rows.indices, device=self.device)
        context = max(rows.indices) + 1
        blocks = torch.arange(-(-context // self.block_size), device=self.device)
        return self._prepared(positions, slots, [SeqSlice(0, len(rows.indices), blocks, context, rows)])

    def _pick(self, reduced_logits: torch.Tensor, params: SamplingParams, generator):
        if params.greedy:
            return self.head.head_ids[greedy(reduced_logits.reshape(-1))], None
        q = probabilities(self.head.full_logits(reduced_logits)[0], params)
        return int(torch.multinomial(q, 1, generator=generator)), q

    def _meta(self, start: int, n: int) -> AttentionMetadata:
        """The head's cache is contiguous from `base`: slot = position - base (the metadata's
        positions are slots; RoPE takes slot + base, the target's positions)."""
        local = torch.arange(start - self.base, start - self.base + n, device=self.device)
        context = start - self.base + n
        blocks = torch.arange(-(-context // self.block_size), device=self.device)
        return self._prepared(local, local, [SeqSlice(0, n, blocks, context)])

    def _prepared(self, positions, slots, seqs) -> AttentionMetadata:
        """In the attention mode of the head's step (its cache is its own, one layer)."""
        return self.step.metadata(positions, slots, seqs, self.block_size)

    def _ensure(self, positions: int) -> None:
        """Room for `positions` head positions (features and cache), grown by copying."""
        if self.features.shape[0] >= positions and self.kv is not None:
            return
        size = -(-max(positions, 1) // GROW) * GROW
        features = torch.zeros(size, self.features.shape[1], dtype=self.dtype, device=self.device)
        features[:self.features.shape[0]] = self.features
        self.features = features
        kv = self.head.new_cache(size, self.block_size, self.device)
        if self.kv is not None:
            old = self.kv.layer(0)
            new = kv.layer(0)
            new.k[:old.k.shape[0]] = old.k
            new.v[:old.v.shape[0]] = old.v
        self.kv = kv

    def end(self) -> None:
        self.kv = None
        self.features = self.features[:0]
