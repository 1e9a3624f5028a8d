"""LLMEngine: load a model, serve many requests at once, stream each one's step events,
cancel, reconfigure.

The request path reads top to bottom:
  submit (a Request, WAITING) -> step: Scheduler.schedule (decodes and drafts first, then
  prefill chunks, under a token budget; preempt the newest when blocks run out) -> the Speculator's
  proposers draft -> ModelRunner.forward_batch (ONE pass over every scheduled token) ->
  Request.finish_pass (sample or verify, commit blocks) -> StepEvents (one per request that
  advanced, each with its request_id) -> the Speculator records the verdicts.
`start` / `generate` follow one request through those steps (engine.stream.RequestStream):
the app's chat is one request among others. A request's tokens never depend on what else
is running (tests/test_batching.py). Every setting can change without reloading the
weights; `engine.config.SETTINGS` says when each change takes effect (live: at the next
step; next request: when the engine is idle). Drive the engine from one thread; only
`cancel` may be called from any thread.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from engine.backend import ReconfigureResult, run_to_end
from engine.cache.kv_cache import FP8_WHEN_SHORT
from engine.cache.memory_plan import MemoryPlan, expert_bytes, moe_blocks, plan_memory
from engine.config import (BY_KEY, ENGINE, LIVE, NEXT_REQUEST, SCHEDULER_DEFAULTS, SETTINGS, EngineConfig,
                           SamplingParams, keys, parse_tree)
from engine.errors import CacheTooSmallError, ConfigError, PromptTooLongError, WorkbenchError
from engine.loading import loader
from engine.metrics import EngineStep, RequestStats, StepEvent, pass_figures
from engine.models.gemma4 import is_gemma4
from engine.models.gemma4_assistant import Gemma4Assistant, is_assistant_folder, load_assistant
from engine.request import HiddenSink, Request
from engine.runtime import cpu_paths
from engine.runtime.cpu_dtype import STEP_DTYPE_CACHE, DtypeTrial, fastest, fastest_step
from engine.runtime.model_runner import ModelRunner, PassItem, prepare_model
from engine.scheduler import Scheduler, StepPlan
from engine.speculative.spec_decode import Proposal, check_draft_compatible
from engine.speculative.speculator import Speculator
from engine.speculative.step_costs import weight_bytes_per_token
from engine.stream import RequestStream
from engine.thread_policy import ThreadGovernor, starting_threads

SELF_DRAFT = "self"   # draft with the target itself (acceptance 1.0 in greedy mode; a test fixture)
# Changing these reallocates the KV pool (and drops the prefix cache).
POOL_SETTINGS = tuple(s.key for s in SETTINGS if s.rebuilds_pool)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device, trial: DtypeTrial | None = None) -> tuple[torch.dtype, str]:
    """(the compute dtype for the `dtype` setting, why): the one place it is decided. On the
    CPU the float-linear probe picks each dtype's linear kernel (engine.runtime.cpu_dtype.fastest);
    `auto` is the dtype whose whole decode step runs the model faster, measured once per CPU
    and model format through `trial` (LLMEngine.load's), or without a model at hand (bench
    kernels) the dtype whose float linear reads faster."""
    if device.type == "cpu":
        choice = fastest(loader.cache_dir() / "cpu_dtype.json")
        if name == "auto":
            if trial is not None:
                choice = fastest_step(loader.cache_dir() / STEP_DTYPE_CACHE, trial.model_format, trial.step_seconds)
            return choice.dtype, choice.why
    elif name == "auto":
        return torch.bfloat16, "auto: bf16 on CUDA"
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name], "asked for"


class LLMEngine:
    def __init__(self, target: loader.LoadedModel, config: EngineConfig, device: torch.device,
                 progress: loader.Progress = loader.no_progress, dtype_why: str = "as loaded"):
        self.config = config
        self.dtype_why = dtype_why          # how the compute dtype was chosen ("In effect")
        self.device = device
        self.progress = progress
        self.target_model = target
        self.tokenizer = target.tokenizer
        self.max_model_len = min(config.max_model_len or target.model.max_positions, target.model.max_positions)
        prepare_model(target.model, device)
        self.moe = moe_figures(target.model)          # None: a dense model
        # what one decode step reads (an MoE model: its dense part and each layer's top_k experts)
        self.weight_bytes_per_token = weight_bytes_per_token(target.model)
        self._moe_blocks = moe_blocks(target.model)
        self.pool_short: str | None = None      # why the pool counts as short (kv_cache_dtype fp8_when_short)
        self._short_rebuild = False             # it ran short mid-run: rebuild it in FP8 when idle
        pool_config, self.plan = self.pool_plan(None)
        self.runner = ModelRunner(target, pool_config, device, num_blocks=self.plan.num_blocks, progress=progress,
                                  on_settings_changed=self._settings_changed,
                                  num_snapshots=self.plan.prefix_snapshots)
        self.draft_runner: ModelRunner | None = None
        self.draft_name: str | None = None
        self.assistant: Gemma4Assistant | None = None      # a Gemma 4 assistant in the draft model slot
        self.scheduler = Scheduler()
        self.requests: dict[int, Request] = {}      # submitted and not yet finished
        self._ids = itertools.count()
        self.step_count = 0
        self.last_step: EngineStep | None = None
        # Every pass's final hidden states, as the proposers get them (engine.request.HiddenSink):
        # the EAGLE head's training data is the engine's own features (engine.training.served_data).
        self.hidden_sink: HiddenSink | None = None
        self.settings_version = 0      # bumped whenever settings() may answer differently
        self._pending: dict = {}
        self.eos_ids = _eos_ids(target)
        # the proposers, the policy, auto's choice, the suffix index, the EAGLE head: what each step asks
        self.speculator = Speculator(self, on_settings_changed=self._settings_changed)
        self.thread_governor = ThreadGovernor(starting_threads())    # fewer threads while cores are busy
        self._refuse_assistant_without_one(config)
        if config.draft_model:
            self.set_draft_model(config.draft_model)
        if config.proposer == "eagle":
            self.speculator.load_eagle_head(config.eagle_head)
        elif config.proposer == "auto":
            self.speculator.load_eagle_head_if_it_fits(config.eagle_head)

    # ---- construction ----------------------------------------------------------
    @classmethod
    def load(cls, model: str | None = None, config: EngineConfig | None = None, progress=None,
             allow_hub: bool = False, allow_pickle: bool = False) -> "LLMEngine":
        config = config or EngineConfig()
        progress = progress or loader.no_progress
        device = pick_device(config.device)
        trial = (DtypeTrial(cls, model, config, progress, allow_hub=allow_hub, allow_pickle=allow_pickle)
                 if config.dtype == "auto" and device.type == "cpu" else None)
        dtype, dtype_why = pick_dtype(config.dtype, device, trial)
        target = trial and trial.take(dtype)
        if target is not None:                  # the trial's load was shown within its share of the bar
            progress(f"model ready (kept from dtype auto's {str(dtype).removeprefix('torch.')} trial)", 1.0)
        else:
            target = loader.load_model(
                model, device=device, dtype=dtype, allow_hub=allow_hub, allow_pickle=allow_pickle,
                max_positions=config.max_model_len, progress=progress, weight_dtype=config.weight_dtype)
        engine = cls(target, config, device, progress, dtype_why)
        engine.warm_compiled_step()             # the compiled step is built at load, with progress
        return engine

    def set_draft_model(self, reference: str | None, progress=None) -> None:
        """Load (or clear) the draft model now. Checks tokenizer compatibility first; a
        draft that fails to load leaves the previous one in place. Both pools are planned
        again (the draft's weights and cache share the memory plan); the prefix cache goes."""
        if self.has_work:
            raise ConfigError("the draft model can change only between requests")
        for runner in self.runners():
            runner.release_cache()          # room for the draft's weights
        try:
            draft = assistant = None
            if is_assistant_reference(reference):       # no cache of its own: it reads the target's
                assistant = self._load_assistant(reference)
            elif reference not in (None, ""):
                draft = self._load_draft(reference, progress or self.progress)
            self.build_pools(draft)
        except BaseException:
            self.build_pools(self._draft())
            raise
        self.assistant = assistant
        self.draft_name = reference or None
        self.config = self.config.with_changes(draft_model=self.draft_name)

    def build_pools(self, draft: loader.LoadedModel | None) -> None:
        """Plan memory for the target and the draft, then (re)allocate both KV pools with the
        plan's number of blocks. The old pools are freed first: on CUDA the plan measures
        what is free without them."""
        for runner in self.runners():
            runner.release_cache()
        if draft is not None:
            prepare_model(draft.model, self.device)
        config, plan = self.pool_plan(draft)
        self.runner.build_cache(config, plan.num_blocks, plan.prefix_snapshots)
        self.settings_version += 1
        if draft is None:
            self.draft_runner = None
        elif self.draft_runner is not None and self.draft_runner.loaded is draft:
            self.draft_runner.build_cache(config, plan.num_blocks)
        else:
            self.draft_runner = ModelRunner(draft, config, self.device, num_blocks=plan.num_blocks,
                                            progress=self.progress, on_settings_changed=self._settings_changed)
        self.plan = plan

    def pool_plan(self, draft: loader.LoadedModel | None) -> tuple[EngineConfig, MemoryPlan]:
        """(the config the pools are built with, their memory plan): kv_cache_dtype fp8_when_short
        is the model's dtype until the pool runs short (pool_short says why: the pool in that
        dtype holds less than one full context, or a request was preempted for want of blocks),
        then fp8_e4m3. Planned once unless the model dtype's plan turns out short."""
        c, model = self.config, self.target_model.model
        draft_model = draft.model if draft else None
        if c.kv_cache_dtype != FP8_WHEN_SHORT:
            return c, plan_memory(c, self.device, model, draft_model)
        if self.pool_short is None:
            plan = plan_memory(c, self.device, model, draft_model)
            tokens = plan.num_blocks * c.block_size
            if tokens >= self.max_model_len:
                return c, plan
            self.pool_short = (f"the pool in the model's dtype holds {tokens} tokens, less than one full "
                               f"context ({self.max_model_len})")
        fp8 = c.with_changes(kv_cache_dtype="fp8_e4m3")
        return fp8, plan_memory(fp8, self.device, model, draft_model)

    def _note_preemptions(self, plan: StepPlan) -> None:
        """Under fp8_when_short, a step that preempted a request for want of blocks makes the pool
        short: it is rebuilt in FP8 once nothing runs."""
        if plan.preempted and self.config.kv_cache_dtype == FP8_WHEN_SHORT and self.pool_short is None:
            self.pool_short = (f"{len(plan.preempted)} request{'s' if len(plan.preempted) > 1 else ''} preempted "
                               f"for want of blocks at step {self.step_count}")
            self._short_rebuild = True

    def kv_cache_why(self) -> str | None:
        """Why the cache is in the dtype it is, where that was the engine's choice (fp8_when_short)."""
        if self.config.kv_cache_dtype != FP8_WHEN_SHORT:
            return None
        if self.pool_short is None:
            return "the model's dtype: the pool has not run short"
        return f"FP8 since {self.pool_short}" + (" (rebuilt when nothing runs)" if self._short_rebuild else "")

    def _draft(self) -> loader.LoadedModel | None:
        return self.draft_runner.loaded if self.draft_runner is not None else None

    def _load_draft(self, reference: str, progress) -> loader.LoadedModel:
        if reference == SELF_DRAFT:
            return self.target_model
        dtype = next(self.target_model.model.parameters()).dtype
        draft = loader.load_draft(reference, self.target_model, device=self.device, dtype=dtype, progress=progress)
        check_draft_compatible(self.tokenizer, draft.tokenizer)
        return draft

    def _load_assistant(self, reference: str) -> Gemma4Assistant:
        dtype = next(self.target_model.model.parameters()).dtype
        # served eagerly, unpacked: a few layers that read the ordered head's rows by index
        return load_assistant(Path(reference).expanduser(), self.target_model.model, dtype, self.device)

    def target_is_gemma4(self) -> bool:
        config = getattr(self.target_model.model, "config", None)
        return config is not None and is_gemma4(config)

    def _refuse_assistant_without_one(self, config: EngineConfig) -> None:
        """`proposer: assistant` needs a Gemma 4 target and its assistant in the draft model slot."""
        if config.proposer != "assistant":
            return
        if not self.target_is_gemma4():
            kind = getattr(self.target_model.hf_config, "model_type", type(self.target_model.model).__name__)
            raise ConfigError(f"proposer 'assistant' drafts with a Gemma 4 assistant for a Gemma 4 target; this "
                              f"model is {kind!r}: choose another proposer (draft, eagle, ngram, suffix or auto)")
        if not is_assistant_reference(config.draft_model):
            raise ConfigError("proposer 'assistant' needs the Gemma 4 assistant loaded: set draft_model to its "
                              "folder (a config.json whose model_type is gemma4_assistant)")

    # ---- settings --------------------------------------------------------------
    def reconfigure(self, **changes) -> ReconfigureResult:
        """Change settings without reloading weights. Live settings apply at the next step;
        the others (KV dtype, block size, pool size, draft model) now if idle, else when the
        last running request ends. Invalid values raise ConfigError and change nothing."""
        for key, value in changes.items():
            setting = BY_KEY.get(key)
            if setting is None or setting.section != ENGINE or setting.applies not in (LIVE, NEXT_REQUEST):
                raise ConfigError(f"{key!r} cannot change on a loaded engine (settings that can: "
                                  f"{', '.join(reconfigurable())}); load the model again to change it")
        new = self.config.with_changes(**changes)       # validate before touching anything
        self._refuse_assistant_without_one(new)
        if new.proposer == "eagle":
            self.speculator.load_eagle_head(new.eagle_head)           # a missing or foreign head fails here
        elif new.proposer == "auto":
            self.speculator.load_eagle_head_if_it_fits(new.eagle_head)
        self._pending.update(changes)
        if not self.has_work:
            self.apply_pending(live_only=False)
            return ReconfigureResult(dict(changes), {})
        live = {k: v for k, v in changes.items() if BY_KEY[k].applies == LIVE}
        self.apply_pending(live_only=True)
        return ReconfigureResult(live, {k: v for k, v in changes.items() if k not in live})

    def apply_pending(self, live_only: bool) -> None:
        """Apply waiting changes: only the live ones while a request runs."""
        now = {k: v for k, v in self._pending.items() if not live_only or BY_KEY[k].applies == LIVE}
        for k in now:
            del self._pending[k]
        short = self._short_rebuild and not live_only
        if not now and not short:
            return
        self.settings_version += 1
        draft = now.pop("draft_model", self.draft_name)
        old, self.config = self.config, self.config.with_changes(**now)
        if old.kv_cache_dtype != self.config.kv_cache_dtype:
            self.pool_short = None                  # fp8_when_short chosen again starts in the model's dtype
        self._short_rebuild = False
        if short or any(getattr(old, k) != getattr(self.config, k) for k in POOL_SETTINGS):
            self._rebuild_pools_or_revert(old)
        for runner in self.runners():
            runner.set_prefix_caching(self.config.enable_prefix_caching)
            runner.set_compile(self.config.compile)
        if draft != self.draft_name:
            self.set_draft_model(draft)

    def _rebuild_pools_or_revert(self, old: EngineConfig) -> None:
        try:
            self.build_pools(self._draft())
        except WorkbenchError:                  # e.g. no room for one block: keep the old pools
            self.config = old
            self.build_pools(self._draft())
            raise

    def _settings_changed(self) -> None:
        """A runner gave up its compiled step: the next event carries the new settings()."""
        self.settings_version += 1

    def settings(self) -> dict:
        """The settings in effect (what the UI shows)."""
        c, auto, spec = self.config, self.config.proposer == "auto", self.speculator
        return {"kv_cache_dtype": self.runner.kv_dtype_name, "kv_cache_why": self.kv_cache_why(), "block_size": c.block_size,
                "enable_prefix_caching": c.enable_prefix_caching, "prefix_caching": self.runner.prefix_state,
                "proposer": "auto" if auto else spec.proposer_in_effect(),
                "proposer_choice": spec.describe_choice() if auto else None,
                "speculation_paused": spec.paused, "proposer_forecast": spec.forecast(),
                "num_speculative_tokens": c.num_speculative_tokens, "draft_model": self.draft_name,
                "draft_tree": str(parse_tree(c.draft_tree) or "off") if auto else str(spec.tree_in_effect() or "off"),
                "eagle_head": None if spec.eagle is None else (spec.eagle[0] or "shipped"),
                "kv_pool_blocks": self.runner.kv.num_blocks, "kernels": self.runner.use_kernels,
                "threads": torch.get_num_threads(), "thread_policy": self.thread_governor.describe(),
                "device": str(self.device),
                "dtype": str(self.runner.model_dtype).removeprefix("torch."),
                "weight_dtype": self.target_model.weights.summary() if self.target_model.weights else None,
                "weight_bytes_per_token": self.weight_bytes_per_token, "moe": self.moe,
                "memory_plan": self.plan.as_dict(), "chat_template": self.has_chat_template,
                "compile": self.runner.compile_state, "paths": self.paths()}

    def paths(self) -> dict[str, str]:
        """Which kernel path serves each part of a step here, and why (engine.runtime.cpu_paths)."""
        return cpu_paths.describe(self.device, self.runner.model_dtype, self.dtype_why, self.runner.compile_state,
                                  self.runner.attention_state, self.runner.decode_graphs_state)

    def runners(self) -> list[ModelRunner]:
        return [r for r in (self.runner, self.draft_runner) if r is not None]

    def compiled_steps(self) -> list:
        """What runs a compiled step: the runners and the EAGLE head's step (each counts its compiles)."""
        return self.runners() + self.speculator.compiled_steps()

    def kv_bytes(self) -> tuple[int, int]:
        """(bytes held by live sequences, bytes allocated) over the target's and draft's pools."""
        return (sum(r.bytes_held() for r in self.runners()), sum(r.kv.bytes_allocated for r in self.runners()))

    def cancel(self, request_id: int | None = None) -> None:
        """Stop a request (None: every request) at the next step. Safe from any thread."""
        for rid, request in list(self.requests.items()):
            if request_id is None or rid == request_id:
                request.cancel()

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def scheduler_limits(self) -> tuple[int, int]:
        """(max_num_seqs, max_num_batched_tokens) in effect: the settings, or the device's defaults."""
        seqs, tokens = SCHEDULER_DEFAULTS.get(self.device.type, SCHEDULER_DEFAULTS["cpu"])
        return self.config.max_num_seqs or seqs, self.config.max_num_batched_tokens or tokens

    def reset_prefix_cache(self) -> None:
        for runner in self.runners():
            runner.blocks.reset_prefix_cache()

    # ---- prompts ---------------------------------------------------------------
    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, prompt: str | list[dict]) -> list[int]:
        """A string is tokenized as is; a list of chat messages goes through the chat template,
        or, for a model folder without one, becomes plain "Role: text" lines (settings() says so)."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        if not self.has_chat_template:
            return self.tokenizer.encode(plain_chat_text(prompt), add_special_tokens=True)
        text = self.tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    # ---- requests ----------------------------------------------------------------
    def submit(self, prompt: str | list[dict] | list[int], params: SamplingParams | None = None) -> int:
        """Queue a request; returns its id. Its events come from `step()`. A prompt that can
        never be served (empty, longer than the context, more blocks than the pool) raises
        here and queues nothing."""
        params = params or SamplingParams()
        if not self.has_work:
            self.apply_pending(live_only=False)
        token_ids = list(prompt) if _is_token_list(prompt) else self.encode(prompt)
        if not token_ids:
            raise WorkbenchError("the prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(token_ids)} tokens but the context holds {self.max_model_len}; "
                "shorten it or start a new chat")
        max_new = min(params.max_tokens, self.max_model_len - len(token_ids))
        self._check_fits(len(token_ids), max_new)
        if not self.has_work:
            self.speculator.calibrate_plain_step()
        request = Request(self, next(self._ids), token_ids, max_new, params)
        self.requests[request.request_id] = request
        self.scheduler.add(request)
        return request.request_id

    def _check_fits(self, prompt_tokens: int, max_new: int) -> None:
        blocks = self.runner.blocks
        needed = blocks.blocks_for(prompt_tokens + max_new)
        if needed > blocks.num_blocks:
            raise CacheTooSmallError(
                f"the request needs {needed} KV blocks ({prompt_tokens} prompt + {max_new} new tokens) "
                f"but the cache has {blocks.num_blocks}; raise the KV cache size, use FP8, or lower max tokens")

    def start(self, prompt: str | list[dict] | list[int], params: SamplingParams | None = None) -> RequestStream:
        """Submit a request and follow it: stream.step() advances the engine until its next event."""
        return RequestStream(self, self.requests[self.submit(prompt, params)])

    def request_closed(self, request: Request) -> None:
        """A stream was closed: when nothing runs any more, waiting settings apply."""
        if not self.has_work:
            self.apply_pending(live_only=False)

    def warm_compiled_step(self) -> float:
        """Compile the model's step now (the target's, the draft's, and the EAGLE head's) instead
        of at the first reply that needs it, reporting through the engine's progress; from
        inductor's disk cache this takes seconds, cold about a minute on a small CPU. Returns the
        seconds spent compiling (0.0: the step is eager, or compiled already). Call it when idle."""
        if self.has_work:
            raise ConfigError("the compiled step can be warmed only between requests")
        return sum(runner.warm_compiled() for runner in self.runners()) + self.speculator.warm()

    def step(self) -> list[StepEvent]:
        """One engine step: settings -> schedule -> prepare (each decode's drafts) -> one forward
        pass over every scheduled token -> settle each request's tokens -> record what the
        verdicts teach speculation -> the step's stats. One event per request that advanced
        (or was cancelled)."""
        t0 = time.perf_counter()
        events = self._apply_settings()
        if not self.scheduler.has_work:
            return events
        plan = self._schedule()
        self._note_preemptions(plan)
        work = self._prepare_pass(plan)
        done = self._forward(work)
        settled = self._settle(work, done)
        self.speculator.record(settled, done.rows, done.seconds, self.step_count)
        return events + self._step_stats(plan, work, settled, done, t0)

    def _apply_settings(self) -> list[StepEvent]:
        """Before the step: waiting settings apply (the live ones while requests run), cancelled
        requests leave (their events), the thread governor sets the threads."""
        self.apply_pending(live_only=self.has_work)
        events = self._drop_cancelled()
        if self.scheduler.has_work and self.device.type == "cpu" and self.thread_governor.tick():
            self.settings_version += 1          # "In effect" shows the new thread count
        return events

    def _schedule(self) -> StepPlan:
        """The step's work under the scheduler's limits, each decode allowed the speculator's k."""
        max_seqs, budget = self.scheduler_limits()
        return self.scheduler.schedule(self.runner, max_seqs, budget,
                                       self.speculator.k_for_step(self.scheduler.running, self.step_count))

    def _prepare_pass(self, plan: StepPlan) -> list["_Work"]:
        rows = sum(s.num_tokens for s in plan.scheduled)           # before drafts
        return [self._prepare(s, rows - s.num_tokens) for s in plan.scheduled]

    def _prepare(self, scheduled, other_rows: int = 0) -> "_Work":
        """A scheduled request's rows: a prompt chunk, or its last token (the root) and the
        drafts to verify. A chain's rows are causal; a branching tree's attend each its own
        path (engine.speculative.tree), the costlier attention. other_rows: the other requests' rows
        in the pass, before their drafts."""
        request, decode = scheduled.request, scheduled.request.decoding
        proposal = self.speculator.propose(request, scheduled.max_drafts if decode else 0, other_rows)
        start = request.num_computed
        if proposal is not None and proposal.tokens:
            tree = proposal.tree
            item = PassItem(request.seq, request.token_ids[start:] + tree.tokens, 1 + len(tree),
                            None if tree.is_chain() else tree.rows(start))
        else:
            n = 1 if decode else scheduled.num_tokens
            item = PassItem(request.seq, request.token_ids[start:start + n], 1 if start + n == len(request.token_ids) else 0)
        return _Work(request, item, proposal, decode, scheduled.max_drafts)

    def _forward(self, work: list["_Work"]) -> "_Pass":
        """One pass over every scheduled token (compiled where `compile` is on, else eager; a
        reply never mixes the two), batch-invariant either way."""
        t_pass = time.perf_counter()
        outputs = self.runner.forward_batch([w.item for w in work]) if work else []
        seconds = time.perf_counter() - t_pass
        steps = self.compiled_steps()
        compile_s = sum(r.take_compile_s() for r in steps)     # drafting's compile included
        compiles = sum(r.take_compiles() for r in steps)
        return _Pass(outputs, sum(w.rows for w in work), seconds, compile_s, compiles)

    def _settle(self, work: list["_Work"], done: "_Pass") -> list[tuple["_Work", StepEvent]]:
        """Each request's rows of the pass: its tokens settled (sampled, or drafts verified) and
        its blocks committed; (its part, its event) for each that advanced. A finished one leaves."""
        settled = []
        for w, (logits, hidden) in zip(work, done.outputs):
            start = w.item.seq.num_computed - len(w.item.tokens)
            event = w.request.finish_pass(start, w.item.tokens, logits, hidden, w.proposal, done.seconds,
                                          done.compile_s)
            if event is not None:
                settled.append((w, event))
            if w.request.finished:
                self._forget(w.request)
        return settled

    def _step_stats(self, plan: StepPlan, work: list["_Work"], settled: list[tuple["_Work", StepEvent]],
                    done: "_Pass", t0: float) -> list[StepEvent]:
        """The step's figures (EngineStep), on each event it emitted; a step that was one plain
        decode alone gives the speculator its baseline."""
        events = [event for _, event in settled]
        step = self._engine_step(plan, work, events, done, time.perf_counter() - t0)
        figures = step.as_dict()                  # one plain-data copy for every event of the step
        for event in events:
            event.engine_step = figures
        if len(work) == 1 and work[0].decode and work[0].max_drafts == 0:
            self.speculator.record_plain_step(step.step_s)
        return events

    def _engine_step(self, plan: StepPlan, work: list["_Work"], events: list[StepEvent], done: "_Pass",
                     step_s: float) -> EngineStep:
        blocks = self.runner.blocks
        step = EngineStep(step=self.step_count, running=len(self.scheduler.running),
                          waiting=len(self.scheduler.waiting), **pass_figures(work, events),
                          kv_blocks_used=blocks.num_used_blocks, kv_blocks_free=blocks.num_free_blocks,
                          preemptions=len(plan.preempted), pass_s=done.seconds, step_s=step_s,
                          experts_active=self._experts_active() if work else None, compiles=done.compiles,
                          threads=torch.get_num_threads())
        self.step_count += 1
        self.last_step = step
        return step

    def _experts_active(self) -> float | None:
        """Distinct experts the step's pass woke, averaged over the MoE layers (None: dense)."""
        if not self._moe_blocks:
            return None
        return sum(b.last_active for b in self._moe_blocks) / len(self._moe_blocks)

    def _drop_cancelled(self) -> list[StepEvent]:
        events = []
        for request in [r for r in self.requests.values() if r.cancelled.is_set()]:
            events.append(request.cancelled_event())
            self._forget(request)
        return events

    def _forget(self, request: Request) -> None:
        self.scheduler.remove(request)
        self.requests.pop(request.request_id, None)

    def generate(self, prompt: str | list[dict] | list[int], params: SamplingParams | None = None) -> Iterator[StepEvent]:
        return run_to_end(self, prompt, params)

    def generate_text(self, prompt, params: SamplingParams | None = None) -> tuple[str, list[int], RequestStats]:
        text, ids, summary = [], [], None
        for ev in self.generate(prompt, params):
            text.append(ev.text_delta)
            ids.extend(ev.token_ids)
            summary = ev.summary or summary
        return "".join(text), ids, summary


@dataclass
class _Work:
    """One request's part of a step."""
    request: Request
    item: PassItem
    proposal: Proposal | None
    decode: bool                # a decode (or verify) step, not a prompt chunk
    max_drafts: int = 0         # drafts it was allowed (0: a plain decode step)

    @property
    def drafts(self) -> list[int]:
        return self.proposal.tokens if self.proposal is not None else []

    @property
    def rows(self) -> int:
        """Its rows in the pass: a prompt chunk, or the root and the drafts to verify."""
        return len(self.item.tokens)


@dataclass
class _Pass:
    """A step's forward pass."""
    outputs: list[tuple]        # each request's (logits, hidden), in the work's order
    rows: int                   # every scheduled token, drafts included
    seconds: float
    compile_s: float            # of the step's seconds, spent compiling (drafting's included)
    compiles: int               # calls of a compiled step that compiled


def reconfigurable() -> tuple[str, ...]:
    """Keys LLMEngine.reconfigure takes."""
    return keys(ENGINE, applies=(LIVE, NEXT_REQUEST))


def plain_chat_text(messages: list[dict]) -> str:
    """Chat messages as plain text, for a model without a chat template."""
    turns = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n\n".join(turns + ["Assistant:"])


def moe_figures(model) -> dict | None:
    """An MoE model's experts as served (None: dense): how many per layer, how many each
    token uses, and the weight bytes one token reads: the dense part (every weight but the
    experts, one embedding row) plus top_k experts of each MoE layer."""
    experts = expert_bytes(model)
    if experts is None:
        return None
    read = weight_bytes_per_token(model)          # already counts top_k experts per MoE layer
    return experts.as_dict() | {"dense_bytes_per_token": read - experts.per_token_bytes,
                                "bytes_read_per_token": read}


def is_assistant_reference(reference) -> bool:
    """A draft model reference that names a Gemma 4 assistant's folder (engine.models.gemma4_assistant)."""
    if not isinstance(reference, str) or reference in ("", SELF_DRAFT) or reference.startswith("self:"):
        return False
    path = Path(reference).expanduser()
    return path.is_dir() and is_assistant_folder(path)


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
