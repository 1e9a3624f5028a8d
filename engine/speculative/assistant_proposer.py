"""The Gemma 4 assistant as a proposer (engine.models.gemma4_assistant): drafts from the target's
hidden states and the target's own KV cache, as transformers' SinglePositionMultiTokenCandidateGenerator.

Position bookkeeping, for token_ids x_0..x_{n-1} (x_{n-1} sampled, not yet fed to the target):
the target's pool holds K/V for positions 0..n-2 (the sequence's `num_computed`), and its last
pass left the final hidden state of position n-2 (the one that predicted x_{n-1}; every pass
hands its rows to `target_pass`). Each draft is one assistant row at position n-1 attending
those n-1 keys: the first feeds (embed(x_{n-1}), the target's hidden), each next one the token
just drafted and the assistant's own projected hidden. Nothing is written to any cache, so
there is nothing to roll back: a verify pass's rejected rows lie past the next context.
Lossless as every proposer: greedy keeps a draft only where it equals the target's argmax, and
sampled drafts carry their distribution q to the rejection sampler (engine.speculative.spec_decode).
"""
from __future__ import annotations

import time

import torch

from engine.config import SamplingParams
from engine.layers import attention
from engine.layers.attention import TORCH, SeqSlice
from engine.layers.sampler import greedy, probabilities
from engine.speculative.spec_decode import Proposal, Proposer
from engine.speculative.tree import DraftTree


class AssistantProposer(Proposer):
    reads_hidden = True

    def __init__(self, assistant, runner):
        """assistant: engine.models.gemma4_assistant.Gemma4Assistant; runner: the target's
        ModelRunner (its pool and its model's embedding)."""
        self.assistant, self.runner = assistant, runner
        self.seq = None
        self.hidden: tuple[int, torch.Tensor] | None = None     # (first position, the last pass's rows)

    def follow(self, seq) -> None:
        """The target's sequence (engine.runtime.model_runner.RunnerSeq) whose context it drafts from."""
        self.seq = seq

    def target_pass(self, start: int, hidden: torch.Tensor) -> None:
        self.hidden = (start, hidden)

    @torch.inference_mode()
    def propose(self, token_ids, k, params: SamplingParams, generator) -> Proposal:
        t0 = time.perf_counter()
        n = len(token_ids)
        feature = self._target_hidden(n - 2)
        if feature is None or self.seq is None or self.seq.num_computed < n - 1 or k < 1:
            return Proposal(DraftTree.chain([]), None, time.perf_counter() - t0)
        meta, positions = self._meta(n - 1), torch.tensor([n - 1], device=self.runner.device)
        target = self.runner.model
        token, tokens, probs = token_ids[-1], [], []
        for _ in range(k):
            rows = target.embed_tokens(torch.tensor([token], device=self.runner.device))[:, :target.config.hidden_size]
            logits, feature = self.assistant.draft(rows, feature, positions, self.runner.kv, meta)
            if params.greedy:
                token = greedy(logits[0])
            else:
                q = probabilities(logits[0], params)
                token = int(torch.multinomial(q, 1, generator=generator))
                probs.append(q)
            tokens.append(token)
        return Proposal(DraftTree.chain(tokens), torch.stack(probs) if probs else None, time.perf_counter() - t0)

    def _target_hidden(self, position: int) -> torch.Tensor | None:
        """[1, hidden]: the target's final hidden state at `position` from its last pass."""
        if self.hidden is None or position < 0:
            return None
        start, rows = self.hidden
        if not start <= position < start + rows.shape[0]:
            return None
        return rows[position - start:position - start + 1]

    def _meta(self, context: int):
        """Torch-path metadata of one row over the sequence's first `context` cached keys, the row
        placed at the last of them (a row sees the keys up to its position, and the draft's own
        position holds none; its slot is never written: the assistant's attention only reads)."""
        table = torch.tensor(self.seq.block_table, dtype=torch.int64, device=self.runner.device)
        attn = self.assistant.layers[0].self_attn           # its query heads per KV head
        position = torch.tensor([context - 1], device=self.runner.device)
        return attention.prepare(TORCH, position, torch.zeros(1, dtype=torch.int64, device=self.runner.device),
                                 [SeqSlice(0, 1, table, context)], self.runner.kv.block_size,
                                 attn.num_heads // attn.num_kv_heads)
