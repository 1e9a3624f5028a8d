"""Request: one generation, advanced one step at a time.

    request = engine.start(prompt, params)
    while not request.finished:
        event = request.step()        # prefill first, then one decode or speculative step
    request.close()                   # frees its blocks however it ended

`LLMEngine.generate` is that loop as an iterator; the app's worker runs one step per turn
of its event loop. The request owns its sequence's blocks and its proposers; settings come
from the engine's public interface (config, runners, proposer in effect) at every step.
"""
from __future__ import annotations

import threading
import time
from typing import Protocol

from engine.config import EngineConfig, SamplingParams
from engine.layers.sampler import make_generator, probabilities, sample
from engine.metrics import TARGET, RequestStats, StepEvent, attempted_positions, speculation_report
from engine.runtime.detokenizer import Detokenizer
from engine.runtime.model_runner import ModelRunner
from engine.spec.spec_decode import Proposer, greedy_verify, rejection_sample
from engine.spec.step_costs import PlainStepClock


class RequestHost(Protocol):
    """What a request uses of its engine (LLMEngine), and nothing more."""
    config: EngineConfig
    runner: ModelRunner
    tokenizer: object
    eos_ids: set[int]
    settings_version: int          # changes whenever settings() may answer differently
    plain_steps: PlainStepClock    # plain decode step times: the baseline of "does speculation pay"

    def apply_pending(self, live_only: bool) -> None: ...
    def plain_step_key(self) -> tuple: ...
    def proposer_in_effect(self) -> str: ...
    def make_proposer(self, name: str) -> Proposer: ...
    def kv_bytes(self) -> tuple[int, int]: ...
    def settings(self) -> dict: ...
    def request_closed(self, request: "Request") -> None: ...


class Request:
    def __init__(self, engine: RequestHost, token_ids: list[int], max_new: int, params: SamplingParams):
        self.engine, self.params, self.max_new = engine, params, max_new
        self.prompt_len = len(token_ids)
        self.token_ids = list(token_ids)
        self.generator = make_generator(params.seed)
        self.stats = RequestStats(prompt_tokens=len(token_ids))
        self.detok = Detokenizer(engine.tokenizer)
        self.proposers: dict[str, Proposer] = {}
        self.last_pass: tuple | None = None    # (start position, hidden states) of the last target pass
        self.step_index = 0
        self.finished = False
        self.cancelled = threading.Event()     # set from any thread; seen at the next step
        self.t_submit = time.perf_counter()
        self._settings_version = -1    # the first event carries the settings
        self.seq = engine.runner.start(self.token_ids, reserve_tokens=max_new)
        self.stats.prefix_hit_tokens = self.seq.num_cached_tokens

    def cancel(self) -> None:
        self.cancelled.set()

    def step(self) -> StepEvent:
        if self.finished:
            raise RuntimeError("this request has finished")
        if self.cancelled.is_set():
            return self._emit([], [], time.perf_counter(), target_passes=0, cancelled=True)
        if self.step_index == 0:
            return self._prefill()
        self.engine.apply_pending(live_only=True)
        proposer = self._proposer()
        k = min(self.engine.config.num_speculative_tokens, self.max_new - self.stats.generated_tokens - 1)
        if proposer is not None and k >= 1:
            return self._speculative_step(proposer, k)
        event = self._decode_step(time.perf_counter())
        self.engine.plain_steps.record(self.engine.plain_step_key(), event.step_time_s)
        return event

    def close(self) -> None:
        """Free the blocks and proposers; safe to call more than once."""
        if self.seq is not None:
            self.engine.runner.end(self.seq)
            self.seq = None
        for p in self.proposers.values():
            p.end()
        self.proposers.clear()
        self.finished = True
        self.engine.request_closed(self)

    # ---- steps -------------------------------------------------------------------
    def _prefill(self) -> StepEvent:
        t0 = time.perf_counter()
        runner = self.engine.runner
        logits = self._target_pass(self.token_ids[self.seq.num_computed:])
        runner.commit(self.seq, self.token_ids)
        token = sample(logits[-1], self.params, self.generator)
        return self._emit([token], [TARGET], t0, target_time=time.perf_counter() - t0)

    def _decode_step(self, t0: float, draft_time: float = 0.0) -> StepEvent:
        runner = self.engine.runner
        t_target = time.perf_counter()
        logits = self._target_pass(self.token_ids[-1:])
        runner.commit(self.seq, self.token_ids)
        token = sample(logits[-1], self.params, self.generator)
        return self._emit([token], [TARGET], t0, target_time=time.perf_counter() - t_target, draft_time=draft_time)

    def _speculative_step(self, proposer: Proposer, k: int) -> StepEvent:
        t0 = time.perf_counter()
        proposal = proposer.propose(self.token_ids, k, self.params, self.generator)
        if not proposal.tokens:
            return self._decode_step(t0, draft_time=proposal.time_s)
        drafts = proposal.tokens
        runner = self.engine.runner
        t_target = time.perf_counter()
        logits = self._target_pass(self.token_ids[-1:] + drafts, logits_for=len(drafts) + 1)   # [k+1, V]
        if self.params.greedy:
            verdict = greedy_verify(drafts, logits.argmax(-1).tolist())
        else:
            verdict = rejection_sample(drafts, proposal.probs, probabilities(logits, self.params), self.generator)
        target_time = time.perf_counter() - t_target
        # KV is valid for the previous last token and the kept drafts; roll back the rest.
        runner.rollback(self.seq, len(self.token_ids) + verdict.num_accepted)
        positions = attempted_positions(verdict.num_accepted, len(drafts))
        event = self._emit(verdict.tokens, verdict.kinds, t0, target_time=target_time,
                           draft_time=proposal.time_s, proposed=len(drafts),
                           accepted=verdict.num_accepted, positions=positions)
        runner.commit(self.seq, self.token_ids)
        for p in self.proposers.values():
            p.accepted(self.token_ids)
        return event

    def _target_pass(self, tokens: list[int], logits_for: str | int = "last"):
        """One target forward pass; its final hidden states go to the proposers (an EAGLE
        head drafts from them) and are kept for a proposer that starts later."""
        start = self.seq.num_computed
        logits = self.engine.runner.forward(self.seq, tokens, logits_for)
        self.last_pass = (start, self.engine.runner.last_hidden)
        for p in self.proposers.values():
            p.target_pass(*self.last_pass)
        return logits

    def _proposer(self) -> Proposer | None:
        name = self.engine.proposer_in_effect()
        if name == "off":
            return None
        if name not in self.proposers:
            p = self.engine.make_proposer(name)
            p.begin(self.token_ids)
            if self.last_pass is not None:
                p.target_pass(*self.last_pass)
            self.proposers[name] = p
        return self.proposers[name]

    # ---- events ------------------------------------------------------------------
    def _emit(self, tokens, kinds, t0, target_time=0.0, draft_time=0.0, proposed=0, accepted=0,
              positions=(), target_passes=1, cancelled=False) -> StepEvent:
        eng, stats = self.engine, self.stats
        tokens, kinds, reason = self._clip(tokens, kinds)
        reason = "cancelled" if cancelled else reason
        self.token_ids.extend(tokens)
        now = time.perf_counter()
        first = self.step_index == 0 and bool(tokens)      # the first token: TTFT
        used, capacity = eng.kv_bytes()
        event = StepEvent(
            step=self.step_index, token_ids=tokens, token_kinds=kinds,
            pieces=self.detok.push(tokens, kinds, final=reason is not None),
            time_s=now - self.t_submit, step_time_s=now - t0, target_time_s=target_time, draft_time_s=draft_time,
            target_passes=target_passes, proposed=proposed, accepted=accepted,
            accepted_per_position=list(positions), kv_bytes_used=used, kv_bytes_capacity=capacity,
            kv_bytes_per_token=eng.runner.kv.bytes_per_token, kv_dtype=eng.runner.kv_dtype_name,
            prefix_hit_tokens=stats.prefix_hit_tokens, prompt_tokens=self.prompt_len,
            generated_tokens=stats.generated_tokens + len(tokens),
            ttft_s=(now - self.t_submit) if first else None, finished=reason is not None,
            finish_reason=reason, settings=self._settings_if_changed())
        stats.record_step(event)
        event.running = stats.as_dict()
        if stats.proposed:
            plain_s, source = eng.plain_steps.estimate(eng.plain_step_key())
            event.speculation = speculation_report(event.running, eng.config.num_speculative_tokens, plain_s, source)
        if event.finished:
            event.summary = stats
            self.finished = True
        self.step_index += 1
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
        room = self.max_new - self.stats.generated_tokens
        if len(tokens) >= room:
            tokens, kinds = tokens[:room], kinds[:room]
            reason = reason or "length"
        return tokens, kinds, reason
