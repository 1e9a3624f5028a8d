"""LLMEngine: load a model, stream generations as step events, cancel, reconfigure.

The request path reads top to bottom:
  generate -> _prefill -> loop(_decode_step | _speculative_step) -> _emit -> finish.
One sequence at a time (a desktop chat); every setting can change between requests,
and k / proposer between steps. `reconfigure` and `cancel` are thread-safe: a GUI worker
may call them while another thread iterates `generate`.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Iterator

import torch

from engine import loader
from engine.config import EngineConfig, SamplingParams, SpecConfig
from engine.errors import ConfigError, PromptTooLongError, WorkbenchError
from engine.metrics import TARGET, RequestStats, StepEvent
from engine.model_runner import ModelRunner
from engine.sampler import make_generator, probabilities, sample
from engine.spec_decode import (DraftModelProposer, NgramProposer, Proposer, check_draft_compatible,
                                greedy_verify, rejection_sample)

# Settings that reallocate the pool: they wait for the next request if one is running.
POOL_SETTINGS = ("kv_cache_dtype", "block_size", "kv_cache_bytes", "num_blocks", "attention_backend")
LIVE_SETTINGS = ("enable_prefix_caching", "proposer", "num_speculative_tokens", "ngram_min", "ngram_max")
SELF_DRAFT = "self"   # draft with the target itself (acceptance 1.0 in greedy mode; a test fixture)


@dataclass
class ReconfigureResult:
    applied: dict
    deferred: dict      # applied when the running request ends


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


class LLMEngine:
    def __init__(self, target: loader.LoadedModel, config: EngineConfig, device: torch.device):
        self.config = config
        self.device = device
        self.target_model = target
        self.tokenizer = target.tokenizer
        self.max_model_len = min(config.max_model_len or target.model.max_positions, target.model.max_positions)
        self.runner = ModelRunner(target, config, device)
        self.draft_runner: ModelRunner | None = None
        self.draft_name: str | None = None
        self._lock = threading.Lock()
        self._pending: dict = {}
        self._cancel = threading.Event()
        self._running = False
        self.eos_ids = _eos_ids(target)
        if config.spec.draft_model:
            self.set_draft_model(config.spec.draft_model)

    # ---- construction ----------------------------------------------------------
    @classmethod
    def load(cls, model: str | None = None, config: EngineConfig | None = None, progress=None,
             allow_hub: bool = False, allow_pickle: bool = False) -> "LLMEngine":
        config = config or EngineConfig()
        device = pick_device(config.device)
        dtype = pick_dtype(config.dtype, device)
        target = loader.load_model(model, device=device, dtype=dtype, allow_hub=allow_hub,
                                   allow_pickle=allow_pickle, max_positions=config.max_model_len,
                                   progress=progress or loader._no_progress)
        return cls(target, config, device)

    def set_draft_model(self, reference: str | None, progress=None) -> None:
        """Load (or clear) the draft model. Checks tokenizer compatibility first."""
        if self._running:
            raise ConfigError("the draft model can change only between requests")
        if reference in (None, ""):
            self.draft_runner, self.draft_name = None, None
            return
        if reference == SELF_DRAFT:
            draft = self.target_model
        else:
            dtype = next(self.target_model.model.parameters()).dtype
            draft = loader.load_draft(reference, self.target_model, device=self.device, dtype=dtype,
                                      progress=progress or loader._no_progress)
            check_draft_compatible(self.tokenizer, draft.tokenizer)
        self.draft_runner = ModelRunner(draft, self.config, self.device, num_blocks=self.runner.kv.num_blocks)
        self.draft_name = reference
        self.config = self.config.with_changes(draft_model=reference)

    # ---- settings --------------------------------------------------------------
    def reconfigure(self, **changes) -> ReconfigureResult:
        """Change settings without reloading weights. Pool settings (KV dtype, block size,
        pool size) apply now if idle, else when the running request ends; the others apply
        at the next step. Invalid values raise ConfigError and change nothing."""
        unknown = set(changes) - set(POOL_SETTINGS) - set(LIVE_SETTINGS)
        if unknown:
            raise ConfigError(f"unknown or non-live settings: {sorted(unknown)} (the draft model uses set_draft_model)")
        self.config.with_changes(**changes)             # validate before touching anything
        with self._lock:
            if self._running:
                live = {k: v for k, v in changes.items() if k in LIVE_SETTINGS}
                deferred = {k: v for k, v in changes.items() if k in POOL_SETTINGS}
                self._pending.update(changes)
                return ReconfigureResult(live, deferred)
            self._pending.update(changes)
        self._apply_pending(pool_too=True)
        return ReconfigureResult(dict(changes), {})

    def _apply_pending(self, pool_too: bool) -> None:
        with self._lock:
            now = {k: v for k, v in self._pending.items() if pool_too or k in LIVE_SETTINGS}
            for k in now:
                del self._pending[k]
        if not now:
            return
        old = self.config
        self.config = old.with_changes(**now)
        if any(getattr(old, k) != getattr(self.config, k) for k in POOL_SETTINGS if k in now):
            self.runner.build_cache(self.config)
            if self.draft_runner is not None:
                self.draft_runner.build_cache(self.config, num_blocks=self.runner.kv.num_blocks)
        for runner in self._runners():
            runner.set_prefix_caching(self.config.enable_prefix_caching)

    def settings(self) -> dict:
        """The settings in effect (what the UI shows)."""
        c = self.config
        return {"kv_cache_dtype": self.runner.kv_dtype_name, "block_size": c.block_size,
                "enable_prefix_caching": c.enable_prefix_caching, "proposer": self._effective_proposer(),
                "num_speculative_tokens": c.spec.num_speculative_tokens, "draft_model": self.draft_name,
                "kv_pool_blocks": self.runner.kv.num_blocks, "kernels": self.runner.use_kernels}

    def _effective_proposer(self) -> str:
        p = self.config.spec.proposer
        return "off" if p == "draft" and self.draft_runner is None else p

    def _runners(self):
        return [r for r in (self.runner, self.draft_runner) if r is not None]

    def cancel(self) -> None:
        self._cancel.set()

    def reset_prefix_cache(self) -> None:
        for runner in self._runners():
            runner.blocks.reset_prefix_cache()

    # ---- prompts ---------------------------------------------------------------
    def encode(self, prompt: str | list[dict]) -> list[int]:
        """A string is tokenized as is; a list of chat messages goes through the chat template."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        text = self.tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    # ---- generation ------------------------------------------------------------
    def generate(self, prompt: str | list[dict] | list[int], params: SamplingParams | None = None) -> Iterator[StepEvent]:
        params = params or SamplingParams()
        self._apply_pending(pool_too=True)
        token_ids = list(prompt) if _is_token_list(prompt) else self.encode(prompt)
        if not token_ids:
            raise WorkbenchError("the prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(token_ids)} tokens but the context holds {self.max_model_len}; "
                "shorten it or start a new chat")
        max_new = min(params.max_tokens, self.max_model_len - len(token_ids))
        self._cancel.clear()
        self._running = True
        try:
            yield from _Request(self, token_ids, max_new, params).run()
        finally:
            self._running = False
            self._apply_pending(pool_too=True)

    def generate_text(self, prompt, params: SamplingParams | None = None) -> tuple[str, list[int], RequestStats]:
        text, ids, summary = [], [], None
        for ev in self.generate(prompt, params):
            text.append(ev.text_delta)
            ids.extend(ev.token_ids)
            summary = ev.summary or summary
        return "".join(text), ids, summary

    def _make_proposer(self) -> Proposer | None:
        spec = self.config.spec
        proposer = self._effective_proposer()
        if proposer == "ngram":
            return NgramProposer(spec.ngram_min, spec.ngram_max)
        if proposer == "draft":
            return DraftModelProposer(self.draft_runner)
        return None


class _Request:
    """One generation: owns its sequence's blocks and frees them however it ends."""

    def __init__(self, engine: LLMEngine, token_ids: list[int], max_new: int, params: SamplingParams):
        self.engine, self.params, self.max_new = engine, params, max_new
        self.prompt_len = len(token_ids)
        self.token_ids = token_ids
        self.generator = make_generator(params.seed)
        self.stats = RequestStats(prompt_tokens=len(token_ids))
        self.detok = _Detokenizer(engine.tokenizer)
        self.proposers: dict[str, Proposer] = {}
        self.step = 0
        self.t_submit = time.perf_counter()

    def run(self) -> Iterator[StepEvent]:
        eng = self.engine
        runner = eng.runner
        self.seq = runner.start(self.token_ids, reserve_tokens=self.max_new)
        self.stats.prefix_hit_tokens = self.seq.num_cached_tokens
        try:
            t0 = time.perf_counter()
            logits = runner.forward(self.seq, self.token_ids[self.seq.num_computed:])
            runner.commit(self.seq, self.token_ids)
            token = sample(logits[-1], self.params, self.generator)
            event = self._emit([token], [TARGET], t0, target_time=time.perf_counter() - t0)
            yield event
            while not event.finished:
                eng._apply_pending(pool_too=False)
                event = self._step()
                yield event
        finally:
            runner.end(self.seq)
            for p in self.proposers.values():
                p.end()

    def _proposer(self) -> Proposer | None:
        name = self.engine._effective_proposer()
        if name == "off":
            return None
        if name not in self.proposers:
            p = self.engine._make_proposer()
            p.begin(self.token_ids)
            self.proposers[name] = p
        return self.proposers[name]

    def _step(self) -> StepEvent:
        if self.engine._cancel.is_set():
            return self._emit([], [], time.perf_counter(), cancelled=True)
        proposer = self._proposer()
        remaining = self.max_new - self.stats.generated_tokens
        k = min(self.engine.config.spec.num_speculative_tokens, remaining - 1)
        if proposer is not None and k >= 1:
            return self._speculative_step(proposer, k)
        return self._decode_step()

    def _decode_step(self) -> StepEvent:
        t0 = time.perf_counter()
        runner = self.engine.runner
        logits = runner.forward(self.seq, self.token_ids[-1:])
        runner.commit(self.seq, self.token_ids)
        token = sample(logits[-1], self.params, self.generator)
        return self._emit([token], [TARGET], t0, target_time=time.perf_counter() - t0)

    def _speculative_step(self, proposer: Proposer, k: int) -> StepEvent:
        t0 = time.perf_counter()
        proposal = proposer.propose(self.token_ids, k, self.params, self.generator)
        if not proposal.tokens:
            event = self._decode_step()
            event.draft_time_s = proposal.time_s
            return event
        drafts = proposal.tokens
        runner = self.engine.runner
        t_target = time.perf_counter()
        logits = runner.forward(self.seq, self.token_ids[-1:] + drafts, logits_for=len(drafts) + 1)   # [k+1, V]
        if self.params.greedy:
            verdict = greedy_verify(drafts, logits.argmax(-1).tolist())
        else:
            verdict = rejection_sample(drafts, proposal.probs, probabilities(logits, self.params), self.generator)
        target_time = time.perf_counter() - t_target
        # KV is valid for the previous last token and the kept drafts; roll back the rest.
        runner.rollback(self.seq, len(self.token_ids) + verdict.num_accepted)
        positions = [i < verdict.num_accepted for i in range(min(verdict.num_accepted + 1, len(drafts)))]
        event = self._emit(verdict.tokens, verdict.kinds, t0, target_time=target_time,
                           draft_time=proposal.time_s, proposed=len(drafts),
                           accepted=verdict.num_accepted, positions=positions)
        runner.commit(self.seq, self.token_ids)
        proposer.accepted(self.token_ids)
        for other in self.proposers.values():
            if other is not proposer:
                other.accepted(self.token_ids)
        return event

    def _emit(self, tokens, kinds, t0, target_time=0.0, draft_time=0.0, proposed=0, accepted=0,
              positions=(), cancelled=False) -> StepEvent:
        eng, stats = self.engine, self.stats
        tokens, kinds, reason = self._clip(tokens, kinds)
        self.token_ids.extend(tokens)
        stats.generated_tokens += len(tokens)
        if cancelled:
            reason = "cancelled"
        now = time.perf_counter()
        first = self.step == 0
        held = sum(r.bytes_held() for r in eng._runners())
        capacity = sum(r.kv.bytes_allocated for r in eng._runners())
        event = StepEvent(
            step=self.step, token_ids=tokens, token_kinds=kinds, text_delta=self.detok.push(tokens, final=reason is not None),
            time_s=now - self.t_submit, step_time_s=now - t0, target_time_s=target_time, draft_time_s=draft_time,
            proposed=proposed, accepted=accepted, accepted_per_position=list(positions),
            kv_bytes_used=held, kv_bytes_capacity=capacity, kv_bytes_per_token=eng.runner.kv.bytes_per_token,
            kv_dtype=eng.runner.kv_dtype_name, prefix_hit_tokens=stats.prefix_hit_tokens,
            prompt_tokens=self.prompt_len, generated_tokens=stats.generated_tokens,
            ttft_s=(now - self.t_submit) if first else None, finished=reason is not None,
            finish_reason=reason, settings=eng.settings())
        if first:
            stats.ttft_s = event.ttft_s
        stats.record_step(event)
        if event.finished:
            event.summary = stats
        self.step += 1
        return event

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


class _Detokenizer:
    """Incremental text: decode a short window and emit only complete new characters."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def push(self, tokens: list[int], final: bool = False) -> str:
        self.ids.extend(tokens)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        full = self.tokenizer.decode(self.ids[self.prefix_offset:], skip_special_tokens=True)
        if full.endswith("\ufffd") and not final:
            return ""        # an incomplete UTF-8 sequence: wait for the next token
        delta = full[len(prefix):]
        self.prefix_offset = max(self.read_offset - 4, 0)
        self.read_offset = len(self.ids)
        return delta


def _is_token_list(prompt) -> bool:
    return isinstance(prompt, (list, tuple)) and (not prompt or isinstance(prompt[0], int))


def _eos_ids(target: loader.LoadedModel) -> set[int]:
    ids = set()
    for source in (target.hf_config.eos_token_id, target.tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    return ids
