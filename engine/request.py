"""Request: one generation's state inside the engine, and what a step does with it.

A request is WAITING (queued, or preempted and queued again at the head), RUNNING (it holds
KV blocks: its tokens are being computed, a prefill chunk or a decode step at a time) or
FINISHED. As in vLLM v1 there is no prefill phase as such: each step computes some of the
tokens whose KV is missing (`token_ids[num_computed:]`), and a pass that reaches the last
token samples the next one. The scheduler (engine.scheduler) decides how many tokens each
request computes in a step; the engine (engine.engine) runs one forward pass over all of
them and hands each request its rows (`finish_pass`).

A request never looks at the others: its tokens are a function of its prompt, its sampling
parameters and its seed (its own generator), whatever shares its batch.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable, Protocol

import torch

from engine.config import EngineConfig, SamplingParams
from engine.errors import CacheTooSmallError
from engine.layers.sampler import greedy, make_generator, probabilities, sample
from engine.metrics import TARGET, ProposerCounts, RequestStats, StepEvent, speculation_report
from engine.runtime.detokenizer import Detokenizer
from engine.runtime.model_runner import ModelRunner, RunnerSeq
from engine.speculative.proposer_choice import shadow_counts, shadow_verdict
from engine.speculative.spec_decode import Proposal, Proposer, rejection_sample
from engine.speculative.speculator import Speculator
from engine.speculative.tree import TreeShape, Verdict, greedy_verify, sample_verify

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


HiddenSink = Callable[[int, int, torch.Tensor], None]
"""(request id, first position, final hidden states [N, hidden] of positions start..): what a
pass hands the proposers, handed to an observer as well (the draft head's training data)."""


class RequestHost(Protocol):
    """What a request uses of its engine (LLMEngine), and nothing more."""
    config: EngineConfig
    runner: ModelRunner
    tokenizer: object
    eos_ids: set[int]
    settings_version: int          # changes whenever settings() may answer differently
    speculator: Speculator         # the proposer in effect, new proposers, the plain step's time
    hidden_sink: HiddenSink | None  # sees every pass's final hidden states (LLMEngine.hidden_sink)

    def kv_bytes(self) -> tuple[int, int]: ...
    def settings(self) -> dict: ...


class Request:
    def __init__(self, engine: RequestHost, request_id: int, token_ids: list[int], max_new: int,
                 params: SamplingParams):
        self.engine, self.request_id, self.params, self.max_new = engine, request_id, params, max_new
        self.prompt_len = len(token_ids)
        self.token_ids = list(token_ids)       # the prompt, then every generated token
        self.state = WAITING
        self.generator = make_generator(params.seed)
        self.stats = RequestStats(prompt_tokens=len(token_ids))
        self.detok = Detokenizer(engine.tokenizer)
        self.proposers: dict[str, Proposer] = {}
        self.shadows: dict[str, tuple[list[int], float, int]] = {}     # proposer auto's shadow drafts (tokens, s, at)
        self.shadowed_at: dict[str, int] = {}                          # the step_index of each one's last
        self.last_pass: tuple | None = None    # (start position, its hidden states, rows kept or None: all)
        self.seq: RunnerSeq | None = None      # its KV blocks while RUNNING
        self.step_index = 0                    # events emitted
        self.cancelled = threading.Event()     # set from any thread; seen at the next step
        self.t_submit = time.perf_counter()
        self.t_last_event = self.t_submit
        self.step_compile_s = 0.0              # compiling since the last event (finish_pass)
        self.events: deque[StepEvent] | None = None    # kept for a RequestStream, if one reads it
        self._settings_version = -1            # the first event carries the settings

    # ---- state ---------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self.state == FINISHED

    @property
    def num_computed(self) -> int:
        return 0 if self.seq is None else self.seq.num_computed

    @property
    def num_uncomputed(self) -> int:
        """Tokens whose KV is missing: the whole prompt at first, then the last sampled token."""
        return len(self.token_ids) - self.num_computed

    @property
    def decoding(self) -> bool:
        """Only the last sampled token is left to compute: a decode (or verify) step."""
        return self.seq is not None and self.num_uncomputed == 1 and self.stats.generated_tokens > 0

    @property
    def room(self) -> int:
        """Tokens it may still generate."""
        return self.max_new - self.stats.generated_tokens

    def cancel(self) -> None:
        self.cancelled.set()

    def admit(self, seq: RunnerSeq) -> None:
        """Blocks for it (its prefix-cache hit included): it runs from the next pass."""
        self.seq, self.state = seq, RUNNING
        if self.stats.queue_time_s is None:        # the first admission: its queue time and prefix hit
            self.stats.queue_time_s = time.perf_counter() - self.t_submit
            self.stats.prefix_hit_tokens = seq.num_cached_tokens
            self.stats.prefix_recomputed_tokens = seq.num_unrestored_tokens

    def preempt(self) -> None:
        """Give its blocks back (its full blocks stay in the prefix cache) and wait again; it
        keeps its generated tokens and recomputes their KV when it runs again."""
        self.release()
        self.state = WAITING
        self.stats.preemptions += 1

    def release(self) -> None:
        """Free its blocks and proposers; safe to call more than once."""
        if self.seq is not None:
            self.engine.runner.end(self.seq)
            self.seq = None
        for p in self.proposers.values():
            p.end()
        self.proposers.clear()
        self.last_pass = None

    def finish(self) -> None:
        for p in self.proposers.values():
            p.finished(self.token_ids, self.prompt_len)
        self.release()
        self.state = FINISHED

    # ---- speculation ---------------------------------------------------------------
    def propose(self, k: int, tree: TreeShape | None = None) -> Proposal | None:
        """Draft up to k tokens for a decode step (None: no proposer, or nothing to draft); with
        a tree shape and a proposer that grows trees, a tree of at most k nodes (a tree's
        nodes are not all emitted: its depth, not its size, is what `room` limits)."""
        proposer = self._proposer()
        if proposer is None or k < 1 or self.room < 2:
            return None
        try:
            if tree is not None and proposer.supports_trees:
                shape = TreeShape(tree.top_k, min(tree.depth, self.room - 1), min(k, tree.nodes))
                proposal = proposer.propose_tree(self.token_ids, shape, self.params, self.generator)
            else:
                proposal = proposer.propose(self.token_ids, min(k, self.room - 1), self.params, self.generator)
        except CacheTooSmallError:              # the draft model's own pool is full: draft later
            return None
        proposal.proposer = self.engine.speculator.proposer_in_effect()
        return proposal

    def shadow_propose(self, names: list[str], k: int, every: int) -> None:
        """Ask each of these proposers what it would draft now, without verifying it (proposer
        auto measures a retrieval proposer so: engine.speculative.proposer_choice), one draft
        pending per proposer, at most one every `every` of this request's steps."""
        if k < 1 or self.room < 2:
            return
        for name in names:
            if name in self.shadows or self.step_index - self.shadowed_at.get(name, -every) < every:
                continue
            proposer = self._proposer(name)
            if proposer is None:
                continue
            proposal = proposer.propose(self.token_ids, min(k, self.room - 1), self.params, None)
            self.shadows[name] = (proposal.tokens, proposal.time_s, len(self.token_ids))
            self.shadowed_at[name] = self.step_index

    def settle_shadows(self) -> list[tuple[str, ProposerCounts]]:
        """The shadow drafts the tokens produced since have settled: per proposer, the step it
        would have made (its tokens up to the first the target did not produce were accepted;
        under greedy decoding, a verify pass's verdict). One still matching what has come so far
        waits for more; one cut short by the request's end is dropped."""
        settled = []
        for name, (tokens, seconds, at) in list(self.shadows.items()):
            accepted = shadow_verdict(tokens, self.token_ids[at:at + len(tokens)], self.finished)
            if accepted is None:
                continue
            del self.shadows[name]
            if accepted >= 0:
                settled.append((name, shadow_counts(tokens, accepted, seconds)))
        return settled

    def start_proposers(self, names: list[str]) -> None:
        """Start these proposers now (proposer auto: each follows every pass, whichever drafts)."""
        for name in names:
            self._proposer(name)

    def _proposer(self, name: str | None = None) -> Proposer | None:
        name = name or self.engine.speculator.proposer_in_effect()
        if name == "off":
            return None
        if name not in self.proposers:
            p = self.engine.speculator.make_proposer(name, self.seq)
            try:
                p.begin(self.token_ids)
            except CacheTooSmallError:
                return None
            if self.last_pass is not None and p.reads_hidden:
                p.target_pass(self.last_pass[0], self._kept_hidden())
            self.proposers[name] = p
        return self.proposers[name]

    # ---- after the pass ------------------------------------------------------------
    def finish_pass(self, start: int, fed: list[int], logits: torch.Tensor, hidden: torch.Tensor,
                    proposal: Proposal | None, pass_s: float, compile_s: float = 0.0) -> StepEvent | None:
        """Its rows of a pass that fed `fed` at positions start..: settle the tokens, commit
        the blocks, and return its event (None: a prefill chunk that does not end the prompt).
        A verify pass's rows are the root at `start`, then every draft (engine.speculative.tree):
        the root's and the accepted path's KV stay (compacted to start..), the rest is freed.
        compile_s: seconds of the step spent compiling (the event carries them; the step is
        then kept out of decode speed)."""
        self.step_compile_s += compile_s
        runner = self.engine.runner
        verdict = self._verify(proposal, logits) if proposal is not None and proposal.tokens else None
        if verdict is not None:
            runner.compact(self.seq, start, verdict.rows)
        # the kept rows' hidden states, as a chain would have them, taken only where one reads them
        # (a proposer that drafts from them, the hidden sink): an op on the host after a pass runs
        # with cold caches, tens of microseconds a step on a small model
        self.last_pass = (start, hidden, verdict.rows if verdict is not None else None)
        readers = [p for p in self.proposers.values() if p.reads_hidden]
        if readers or self.engine.hidden_sink is not None:
            hidden = self._kept_hidden()
            if self.engine.hidden_sink is not None:
                self.engine.hidden_sink(self.request_id, start, hidden)
            for p in readers:
                p.target_pass(start, hidden)
        if verdict is None:
            if self.num_uncomputed > 0:              # mid-prompt (or mid-recompute) chunk
                runner.commit(self.seq, self.token_ids)
                return None
            runner.rollback(self.seq, self.seq.num_computed)     # blocks reserved for drafts not made
            runner.commit(self.seq, self.token_ids)
            return self._emit([sample(logits[-1], self.params, self.generator)], [TARGET], pass_s,
                              draft_time=proposal.time_s if proposal is not None else 0.0,
                              proposer=proposal.proposer if proposal is not None else None)
        runner.commit(self.seq, self.token_ids + verdict.tokens)
        tree = proposal.tree
        event = self._emit(verdict.tokens, verdict.kinds, pass_s, draft_time=proposal.time_s, proposed=len(tree),
                           accepted=verdict.num_accepted, positions=verdict.accepted_per_position,
                           tree_nodes=len(tree) if proposal.grown else 0,
                           tree_predicted=tree.predicted_accepted() if proposal.grown else None,
                           proposer=proposal.proposer)
        for p in self.proposers.values():
            p.accepted(self.token_ids)
        return event

    def _kept_hidden(self) -> torch.Tensor:
        """The last pass's hidden states of the rows it kept (a verify pass's root and accepted
        drafts, in path order), taken once and kept."""
        start, hidden, rows = self.last_pass
        if rows is not None:
            hidden = hidden[:len(rows)] if rows == list(range(len(rows))) else hidden[rows]
            self.last_pass = (start, hidden, None)
        return hidden

    def _verify(self, proposal: Proposal, logits: torch.Tensor) -> Verdict:
        """logits [1 + drafts, V]: the target's at the root and at every draft."""
        if self.params.greedy:
            return greedy_verify(proposal.tree, greedy(logits))
        target_probs = probabilities(logits, self.params)
        if proposal.probs is not None:            # a chain drafted from q: keep with min(1, p/q)
            return rejection_sample(proposal.tokens, proposal.probs, target_probs, self.generator)
        return sample_verify(proposal.tree, target_probs, self.generator)

    def cancelled_event(self) -> StepEvent:
        return self._emit([], [], 0.0, target_passes=0, cancelled=True)

    # ---- events ------------------------------------------------------------------
    def _emit(self, tokens, kinds, pass_s: float, draft_time=0.0, proposed=0, accepted=0,
              positions=(), target_passes=1, cancelled=False, tree_nodes=0, tree_predicted=None,
              proposer=None) -> StepEvent:
        eng, stats = self.engine, self.stats
        tokens, kinds, reason = self._clip(tokens, kinds)
        reason = "cancelled" if cancelled else reason
        self.token_ids.extend(tokens)
        now = time.perf_counter()
        first = stats.generated_tokens == 0 and bool(tokens)       # the first token: TTFT
        used, capacity = eng.kv_bytes()
        event = StepEvent(
            step=self.step_index, token_ids=tokens, token_kinds=kinds,
            pieces=self.detok.push(tokens, kinds, final=reason is not None),
            time_s=now - self.t_submit, step_time_s=now - self.t_last_event, target_time_s=pass_s,
            draft_time_s=draft_time, target_passes=target_passes, proposed=proposed, accepted=accepted,
            accepted_per_position=list(positions), kv_bytes_used=used, kv_bytes_capacity=capacity,
            kv_bytes_per_token=eng.runner.kv.bytes_per_token, kv_dtype=eng.runner.kv_dtype_name,
            prefix_hit_tokens=stats.prefix_hit_tokens, prompt_tokens=self.prompt_len,
            generated_tokens=stats.generated_tokens + len(tokens),
            ttft_s=(now - self.t_submit) if first else None, finished=reason is not None,
            finish_reason=reason, settings=self._settings_if_changed(), request_id=self.request_id,
            compile_s=self.step_compile_s, tree_nodes=tree_nodes, tree_predicted_accepted=tree_predicted,
            proposer=proposer)
        self.t_last_event, self.step_compile_s = now, 0.0
        stats.record_step(event)
        event.running = stats.as_dict()
        if stats.proposed:
            plain_s, source = eng.speculator.plain_step_s()
            event.speculation = speculation_report(event.running, eng.config.num_speculative_tokens, plain_s, source)
        if event.finished:
            stats.e2e_s = event.time_s
            event.summary = stats
            self.finish()
        self.step_index += 1
        if self.events is not None:
            self.events.append(event)
        return event

    def _settings_if_changed(self) -> dict | None:
        """settings() on the first event and after a change; None otherwise (no per-token
        snapshot to build and compare)."""
        if self.engine.settings_version == self._settings_version:
            return None
        self._settings_version = self.engine.settings_version
        return self.engine.settings()

    def _clip(self, tokens, kinds):
        """Stop at EOS (kept, as the stop token) and at max_tokens."""
        reason = None
        if self.params.stop_on_eos:
            for i, t in enumerate(tokens):
                if t in self.engine.eos_ids:
                    tokens, kinds, reason = tokens[:i + 1], kinds[:i + 1], "stop"
                    break
        room = self.room
        if len(tokens) >= room:
            tokens, kinds = tokens[:room], kinds[:room]
            reason = reason or "length"
        return tokens, kinds, reason
