"""LLMEngine: load a model, serve many requests at once, stream each one's step events,
cancel, reconfigure.

The request path reads top to bottom:
  submit (a Request, WAITING) -> step: Scheduler.schedule (decodes and drafts first, then
  prefill chunks, under a token budget; preempt the newest when blocks run out) -> proposers
  draft -> ModelRunner.forward_batch (ONE pass over every scheduled token) ->
  Request.finish_pass (sample or verify, commit blocks) -> StepEvents (one per request that
  advanced, each with its request_id).
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
from engine.cache.memory_plan import MemoryPlan, expert_bytes, moe_blocks, plan_memory
from engine.config import (BY_KEY, ENGINE, LIVE, NEXT_REQUEST, SCHEDULER_DEFAULTS, SETTINGS, EngineConfig,
                           SamplingParams, TreeShape, keys, parse_tree)
from engine.errors import CacheTooSmallError, ConfigError, PromptTooLongError, WorkbenchError
from engine.loading import loader
from engine.metrics import EngineStep, ProposerCounts, RequestStats, StepEvent
from engine.models.eagle_head import EagleHead
from engine.models.gemma4 import is_gemma4
from engine.models.gemma4_assistant import Gemma4Assistant, is_assistant_folder, load_assistant
from engine.request import Request
from engine.runtime import cpu_paths
from engine.runtime.eagle_step import EagleStep
from engine.runtime.model_runner import ModelRunner, PassItem, prepare_model
from engine.scheduler import Scheduler
from engine.speculative.assistant_proposer import AssistantProposer
from engine.speculative.eagle_proposer import EagleProposer
from engine.speculative.policy import SpeculationPolicy
from engine.speculative.proposer_choice import OFF, ProposerChoice
from engine.speculative.spec_decode import DraftModelProposer, NgramProposer, Proposer, check_draft_compatible
from engine.speculative.suffix_proposer import SuffixCache, SuffixProposer
from engine.speculative.step_costs import PlainStepClock, weight_bytes_per_token
from engine.stream import RequestStream
from engine.thread_policy import ThreadGovernor, starting_threads

SELF_DRAFT = "self"   # draft with the target itself (acceptance 1.0 in greedy mode; a test fixture)
# Changing these reallocates the KV pool (and drops the prefix cache).
POOL_SETTINGS = tuple(s.key for s in SETTINGS if s.rebuilds_pool)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device, trial: "DtypeTrial | None" = None) -> tuple[torch.dtype, str]:
    """(the compute dtype for the `dtype` setting, why): the one place it is decided. On the
    CPU the float-linear probe picks each dtype's linear kernel (engine.runtime.cpu_dtype.fastest);
    `auto` is the dtype whose whole decode step runs the model faster, measured once per CPU
    and model format through `trial` (LLMEngine.load's), or without a model at hand (bench
    kernels) the dtype whose float linear reads faster."""
    if device.type == "cpu":
        from engine.runtime.cpu_dtype import fastest, fastest_step
        choice = fastest(loader.cache_dir() / "cpu_dtype.json")
        if name == "auto":
            if trial is not None:
                choice = fastest_step(loader.cache_dir() / STEP_DTYPE_CACHE, trial.model_format, trial.step_seconds)
            return choice.dtype, choice.why
    elif name == "auto":
        return torch.bfloat16, "auto: bf16 on CUDA"
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name], "asked for"


STEP_DTYPE_CACHE = "cpu_dtype_step.json"
TRIAL_TEXT = "The quick brown fox jumps over the lazy dog, and then"
TRIAL_TOKENS, TRIAL_RUNS, TRIAL_BLOCKS = 16, 3, 32


class DtypeTrial:
    """`dtype auto` on the CPU, the first time this CPU meets a model format: the model
    LLMEngine.load is about to load, loaded in a candidate dtype and run as the engine will
    run it (weights as served, compiled as `config` says), timed over a few decode steps
    after a warm-up. The faster load is kept for the engine, so the winner is not loaded
    again; the slower one is freed before the next candidate loads, unless both fit with room."""

    def __init__(self, reference, config: EngineConfig, progress: loader.Progress, **load_options):
        self.model_format = model_format(reference, config, load_options.get("allow_hub", False))
        self.reference, self.config, self.progress, self.load_options = reference, config, progress, load_options
        self.kept: tuple[float, torch.dtype, loader.LoadedModel] | None = None
        self.tried, self.shown = 0, 0.0          # candidates loaded so far; the progress bar's fraction

    def step_seconds(self, dtype: torch.dtype) -> float:
        """Seconds per decode step of the model in `dtype` (the median of TRIAL_RUNS replies)."""
        from engine.runtime.cpu_dtype import CANDIDATES
        name, index, share = str(dtype).removeprefix("torch."), self.tried, loader.WEIGHTS_START / len(CANDIDATES)
        self.tried += 1

        def said(message: str, fraction: float) -> None:
            # each candidate's load and compile within its share of the bar before the weights', never going back
            self.shown = max(self.shown, share * (index + min(fraction, 1.0)))
            self.progress(f"dtype auto: timing {name} once on this CPU: {message}", self.shown)
        if self.kept is not None and not _room_for_another(self.kept[2].model):
            self.kept = None                 # the winner, if it was this one, is loaded again
        loaded = loader.load_model(self.reference, device="cpu", dtype=dtype, progress=said,
                                   max_positions=self.config.max_model_len, weight_dtype=self.config.weight_dtype,
                                   **self.load_options)
        trial = EngineConfig(device="cpu", dtype=name, weight_dtype=self.config.weight_dtype, compile=self.config.compile,
                             max_model_len=self.config.max_model_len, enable_prefix_caching=False,
                             num_blocks=TRIAL_BLOCKS)
        threads = torch.get_num_threads()        # the engine's thread governor may lower it while it runs
        try:
            engine = LLMEngine(loaded, trial, torch.device("cpu"), said, dtype_why="dtype auto's trial")
            engine.warm_compiled_step()
            seconds = decode_step_seconds(engine)
            del engine
        finally:
            torch.set_num_threads(threads)      # each candidate, and the engine after, start with as many
        if self.kept is None or seconds < self.kept[0]:
            self.kept = (seconds, dtype, loaded)
        return seconds

    def take(self, dtype: torch.dtype) -> loader.LoadedModel | None:
        """The model already loaded in `dtype`, if the trial kept it."""
        kept, self.kept = self.kept, None
        return kept[2] if kept is not None and kept[1] == dtype else None


def _serves_quantized(model) -> bool:
    """Whether any of the model's linears is served quantized (weight_dtype, or as stored)."""
    return any(getattr(m, "quant", None) is not None for m in model.modules())


def model_format(reference, config: EngineConfig, allow_hub: bool = False) -> str:
    """What `dtype auto`'s step measurement is kept under, beside the CPU: the model's
    architecture and stored weights (engine.loading.loader.weights_format) and the settings
    that change how they run."""
    folder = loader.resolve(reference, allow_hub=allow_hub)
    return f"{loader.weights_format(folder)} | weight_dtype {config.weight_dtype} | compile {config.compile}"


def decode_step_seconds(engine: "LLMEngine") -> float:
    """Median seconds per decode step over TRIAL_RUNS replies of TRIAL_TOKENS tokens (one
    reply first, unmeasured: its compiled shapes, caches). Decode time excludes the prefill
    and any compile (engine.metrics.RequestStats)."""
    import statistics
    ids = engine.tokenizer.encode(TRIAL_TEXT)
    params = SamplingParams(max_tokens=TRIAL_TOKENS, stop_on_eos=False)
    engine.generate_text(ids, params)
    per_step = []
    for _ in range(TRIAL_RUNS):
        stats = engine.generate_text(ids, params)[2]
        per_step.append(stats.decode_time_s / max(1, stats.decode_tokens))
    return statistics.median(per_step)


def _room_for_another(model) -> bool:
    """Whether a second copy of `model`'s weights fits in the memory free now, with as much again to spare."""
    from engine.cache.memory_plan import weights_bytes
    return _available_ram() > 3 * weights_bytes(model)


def _available_ram() -> int:
    """Bytes of memory free for a new allocation now (0 when it cannot be read: nothing is kept)."""
    try:
        import psutil
        return psutil.virtual_memory().available
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as meminfo:
            return next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return 0


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
        self.plan: MemoryPlan = plan_memory(config, device, target.model)
        self.runner = ModelRunner(target, config, device, num_blocks=self.plan.num_blocks, progress=progress,
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
        self.policy = SpeculationPolicy()
        self.suffix_cache = SuffixCache(config.suffix_cache_tokens)     # earlier replies, for proposer `suffix`
        self.proposer_choice = ProposerChoice()                          # proposer `auto`'s counters and choice
        self.eagle_refused: tuple[str | None, str] | None = None         # (head, why) auto could not load
        self.settings_version = 0      # bumped whenever settings() may answer differently
        self._pending: dict = {}
        self.eos_ids = _eos_ids(target)
        self.eagle: tuple[str | None, EagleHead] | None = None     # (reference, head) once loaded
        self.eagle_step: EagleStep | None = None      # the head's passes, compiled as the target's step is
        self.plain_steps = PlainStepClock()
        self.thread_governor = ThreadGovernor(starting_threads())    # fewer threads while cores are busy
        self._refuse_assistant_without_one(config)
        if config.draft_model:
            self.set_draft_model(config.draft_model)
        if config.proposer == "eagle":
            self.load_eagle_head(config.eagle_head)
        elif config.proposer == "auto":
            self.load_eagle_head_if_it_fits(config.eagle_head)

    # ---- construction ----------------------------------------------------------
    @classmethod
    def load(cls, model: str | None = None, config: EngineConfig | None = None, progress=None,
             allow_hub: bool = False, allow_pickle: bool = False) -> "LLMEngine":
        config = config or EngineConfig()
        progress = progress or loader.no_progress
        device = pick_device(config.device)
        trial = (DtypeTrial(model, config, progress, allow_hub=allow_hub, allow_pickle=allow_pickle)
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
        plan = plan_memory(self.config, self.device, self.target_model.model, draft.model if draft else None)
        self.runner.build_cache(self.config, plan.num_blocks, plan.prefix_snapshots)
        self.settings_version += 1
        if draft is None:
            self.draft_runner = None
        elif self.draft_runner is not None and self.draft_runner.loaded is draft:
            self.draft_runner.build_cache(self.config, plan.num_blocks)
        else:
            self.draft_runner = ModelRunner(draft, self.config, self.device, num_blocks=plan.num_blocks,
                                            progress=self.progress, on_settings_changed=self._settings_changed)
        self.plan = plan

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

    def _target_is_gemma4(self) -> bool:
        config = getattr(self.target_model.model, "config", None)
        return config is not None and is_gemma4(config)

    def _refuse_assistant_without_one(self, config: EngineConfig) -> None:
        """`proposer: assistant` needs a Gemma 4 target and its assistant in the draft model slot."""
        if config.proposer != "assistant":
            return
        if not self._target_is_gemma4():
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
            self.load_eagle_head(new.eagle_head)           # a missing or foreign head fails here
        elif new.proposer == "auto":
            self.load_eagle_head_if_it_fits(new.eagle_head)
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
        if not now:
            return
        self.settings_version += 1
        draft = now.pop("draft_model", self.draft_name)
        old, self.config = self.config, self.config.with_changes(**now)
        if any(getattr(old, k) != getattr(self.config, k) for k in POOL_SETTINGS):
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
        c, auto = self.config, self.config.proposer == "auto"
        return {"kv_cache_dtype": self.runner.kv_dtype_name, "block_size": c.block_size,
                "enable_prefix_caching": c.enable_prefix_caching, "prefix_caching": self.runner.prefix_state,
                "proposer": "auto" if auto else self.proposer_in_effect(),
                "proposer_choice": self.describe_proposer_choice() if auto else None,
                "num_speculative_tokens": c.num_speculative_tokens, "draft_model": self.draft_name,
                "draft_tree": str(parse_tree(c.draft_tree) or "off") if auto else str(self.tree_in_effect() or "off"),
                "eagle_head": None if self.eagle is None else (self.eagle[0] or "shipped"),
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
                                  self.runner.attention_state)

    def plain_step_key(self) -> tuple:
        """What changes a plain decode step's time (the proposer does not)."""
        return (self.runner.kv_dtype_name, self.runner.compile_state, torch.get_num_threads())

    def tree_in_effect(self) -> TreeShape | None:
        """The draft tree each decode step grows, or None: a chain (the n-gram proposer has
        no tree). The suffix proposer always drafts a tree, shaped by its counts: at most
        draft_tree's nodes, or k nodes k deep when draft_tree is off."""
        proposer = self.proposer_in_effect()
        if proposer == "suffix":
            k = self.config.num_speculative_tokens
            return parse_tree(self.config.draft_tree) or TreeShape(k, k, k)
        if proposer not in ("eagle", "draft"):           # the assistant drafts a chain
            return None
        return parse_tree(self.config.draft_tree)

    def proposer_in_effect(self) -> str:
        """The proposer that drafts this step: the setting's, "off" when it has nothing to draft
        with, and under `auto` the one ProposerChoice picked for the step."""
        p = self.config.proposer
        if p == "auto":
            return self.proposer_choice.chosen
        if p == "draft" and self.assistant is not None:      # the draft model slot holds the assistant
            return "assistant"
        if ((p == "draft" and self.draft_runner is None) or (p == "eagle" and self.eagle is None)
                or (p == "assistant" and self.assistant is None)):
            return "off"
        return p

    def auto_candidates(self) -> list[str]:
        """What `proposer: auto` chooses among: suffix and n-gram, EAGLE where a head for this
        model is loaded, the draft model or the Gemma 4 assistant where one is, and "off"
        (engine.speculative.proposer_choice)."""
        return (["suffix", "ngram"] + ["eagle"] * (self.eagle is not None)
                + ["draft"] * (self.draft_runner is not None) + ["assistant"] * (self.assistant is not None) + [OFF])

    def describe_proposer_choice(self) -> dict:
        """`auto`'s choice, why, and each candidate's measured figures; what it left out, and why."""
        left_out = {} if self.draft_runner is not None else {"draft": "no draft model loaded"}
        if self.assistant is None and self._target_is_gemma4():
            left_out["assistant"] = "no Gemma 4 assistant loaded (draft_model: its folder)"
        if self.eagle is None:
            left_out["eagle"] = self.eagle_refused[1] if self.eagle_refused else "no EAGLE head loaded"
        return self.proposer_choice.describe() | {"left_out": left_out}

    def load_eagle_head_if_it_fits(self, reference: str | None) -> None:
        """`auto`: the EAGLE head joins the candidates where one fits this model; a missing or
        foreign head leaves it out (describe_proposer_choice says why), once per reference."""
        if self.eagle_refused is not None and self.eagle_refused[0] == reference:
            return
        try:
            self.load_eagle_head(reference)
        except WorkbenchError as e:
            self.eagle_refused = (reference, str(e))

    def load_eagle_head(self, reference: str | None) -> None:
        """Load the EAGLE head (a few MB) unless this one is loaded; raises a clear error."""
        if self.eagle is not None and self.eagle[0] == reference:
            return
        head, _ = loader.load_eagle_head(reference, self.target_model, self.device, self.runner.model_dtype)
        if self.device.type == "cpu" and _serves_quantized(self.target_model.model):
            head.serve_int8()                   # a draft step's cost is its weights' bytes: see there
        prepare_model(head, self.device)
        self.eagle = (reference, head)
        self.eagle_step = EagleStep(head, self.device, self.progress)
        self.eagle_step.follow(self.runner)
        if self.runner.compiled is not None and self.runner.compiled.is_built:
            self.eagle_step.warm(self.config.block_size)     # loaded after the target's step was warmed

    def make_proposer(self, name: str, seq=None) -> Proposer:
        """A new proposer for one request; seq: its target sequence (engine.runtime.model_runner.RunnerSeq)."""
        if name == "ngram":
            return NgramProposer(self.config.ngram_min, self.config.ngram_max)
        if name == "suffix":
            c = self.config
            return SuffixProposer(self.suffix_cache, c.suffix_spec_factor, c.suffix_min_prob, c.suffix_cache_tokens)
        if name == "draft":
            return DraftModelProposer(self.draft_runner)
        if name == "eagle":
            self.eagle_step.follow(self.runner)      # each request drafts one way from its start
            return EagleProposer(self.eagle[1], self.config.block_size, self.device, self.eagle_step)
        if name == "assistant":
            proposer = AssistantProposer(self.assistant, self.runner)
            proposer.follow(seq)
            return proposer
        raise ConfigError(f"no proposer named {name!r}")

    def runners(self) -> list[ModelRunner]:
        return [r for r in (self.runner, self.draft_runner) if r is not None]

    def compiled_steps(self) -> list:
        """What runs a compiled step: the runners and the EAGLE head's step (each counts its compiles)."""
        return self.runners() + ([self.eagle_step] if self.eagle_step is not None else [])

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

    def reset_suffix_cache(self) -> None:
        """Forget earlier replies (the suffix proposer's global index) and its counters."""
        self.suffix_cache.clear()

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
        speculates = self.proposer_in_effect() != "off" or self.config.proposer == "auto"
        if speculates and not self.has_work:            # the baseline of "does speculation pay"
            self.plain_steps.calibrate(self.plain_step_key(), self.runner)
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

    def step(self) -> list[StepEvent]:
        """One engine step: schedule, draft, one forward pass over every scheduled token,
        settle each request's tokens. One event per request that advanced (or was cancelled)."""
        t0 = time.perf_counter()
        self.apply_pending(live_only=self.has_work)
        events = self._drop_cancelled()
        if not self.scheduler.has_work:
            return events
        if self.device.type == "cpu" and self.thread_governor.tick():
            self.settings_version += 1          # "In effect" shows the new thread count
        max_seqs, budget = self.scheduler_limits()
        plan = self.scheduler.schedule(self.runner, max_seqs, budget, self._k_for_step())
        rows = sum(s.num_tokens for s in plan.scheduled)           # before drafts
        work = [self._prepare(s, rows - s.num_tokens) for s in plan.scheduled]
        t_pass = time.perf_counter()
        results = self._forward(work)
        pass_s = time.perf_counter() - t_pass
        compile_s = sum(r.take_compile_s() for r in self.compiled_steps())     # drafting's compile included
        compiles = sum(r.take_compiles() for r in self.compiled_steps())
        stepped, drafted = [], ProposerCounts()
        for w, (logits, hidden) in zip(work, results):
            start = w.item.seq.num_computed - len(w.item.tokens)
            event = w.request.finish_pass(start, w.item.tokens, logits, hidden, w.proposal, pass_s, compile_s)
            if event is not None:
                stepped.append(event)
                if w.proposal is not None and w.proposal.grown:              # a tree trimmed to 0 nodes too:
                    self.policy.record_tree(event.tree_predicted_accepted or 0.0, event.accepted,   # its drafting
                                            len(event.token_ids), pass_s + w.proposal.time_s,     # was spent
                                            max(w.proposal.tree.depths, default=0))
                elif w.drafts:
                    self.policy.record_verdict(self.proposer_in_effect(), event.accepted_per_position)
                if w.proposal is not None and w.proposal.source:    # the suffix proposer's, by source
                    self.suffix_cache.record(w.proposal.source, len(w.proposal.tree), event.accepted)
                if w.proposal is not None or (w.decode and self.proposer_in_effect() == OFF):
                    drafted.add(_drafted(w, event))
            if w.request.finished:
                self._forget(w.request)
        if self.config.proposer == "auto":
            self.proposer_choice.record(self.proposer_in_effect(), self.step_count, drafted)
        step = self._step_stats(plan, work, stepped, pass_s, time.perf_counter() - t0, compiles)
        figures = step.as_dict()                  # one plain-data copy for every event of the step
        for event in stepped:
            event.engine_step = figures
        if len(work) == 1 and work[0].decode and work[0].max_drafts == 0:
            self.plain_steps.record(self.plain_step_key(), step.step_s)
        return events + stepped

    def warm_compiled_step(self) -> float:
        """Compile the model's step now (the target's, the draft's, and the EAGLE head's) instead
        of at the first reply that needs it, reporting through the engine's progress; from
        inductor's disk cache this takes seconds, cold about a minute on a small CPU. Returns the
        seconds spent compiling (0.0: the step is eager, or compiled already). Call it when idle."""
        if self.has_work:
            raise ConfigError("the compiled step can be warmed only between requests")
        seconds = sum(runner.warm_compiled() for runner in self.runners())
        if self.eagle_step is not None:
            self.eagle_step.follow(self.runner)
            seconds += self.eagle_step.warm(self.config.block_size)
        return seconds

    def _forward(self, work: list["_Work"]) -> list[tuple]:
        """One pass over every scheduled token (compiled where `compile` is on, else eager; a
        reply never mixes the two), batch-invariant either way."""
        return self.runner.forward_batch([w.item for w in work]) if work else []

    def _prepare(self, scheduled, other_rows: int = 0) -> "_Work":
        """A scheduled request's rows: a prompt chunk, or its last token (the root) and the
        drafts to verify. A chain's rows are causal; a branching tree's attend each its own
        path (engine.speculative.tree), the costlier attention. other_rows: the other requests' rows
        in the pass, before their drafts."""
        request, decode = scheduled.request, scheduled.request.decoding
        if self.config.proposer == "auto" and not request.proposers:
            # every candidate follows the request from its first pass: the EAGLE head sees the prompt's
            # features, and a reply joins the suffix index whichever proposer drafted it
            request.start_proposers([name for name in self.auto_candidates() if name != OFF])
        proposal = self._propose(request, scheduled.max_drafts, other_rows) if decode and scheduled.max_drafts else None
        start = request.num_computed
        if proposal is not None and proposal.tokens:
            tree = proposal.tree
            item = PassItem(request.seq, request.token_ids[start:] + tree.tokens, 1 + len(tree),
                            None if tree.is_chain() else tree.rows(start))
        else:
            n = 1 if decode else scheduled.num_tokens
            item = PassItem(request.seq, request.token_ids[start:start + n], 1 if start + n == len(request.token_ids) else 0)
        return _Work(request, item, proposal, decode, scheduled.max_drafts)

    def _propose(self, request: Request, max_drafts: int, other_rows: int):
        """Its drafts: a chain of up to max_drafts, or, while a tree is in effect, a tree
        (under `auto`: grown as deep as the policy says and trimmed to the nodes that pay)."""
        tree, auto = self.tree_in_effect(), self.config.speculation_policy == "auto"
        if tree is not None and auto and self.proposer_in_effect() != "suffix":    # a suffix tree's depth is free
            tree = TreeShape(tree.top_k, self.policy.tree_depth(tree.depth), tree.nodes)
        proposal = request.propose(max_drafts, tree)
        if proposal is None:
            return None
        if not proposal.grown:
            self.policy.record_draft(len(proposal.tokens), proposal.time_s)
        elif auto:
            proposal = proposal.trimmed(self.policy.choose_tree_nodes(proposal.tree.scores, max_drafts, other_rows))
        return proposal

    def _k_for_step(self) -> int:
        """Draft tokens per decoding sequence this step: k, or the policy's choice by batch size.
        Under `proposer: auto` the step's proposer is chosen first (its payoff already weighs
        whether drafting pays, so its trees are grown and trimmed, and a measuring step drafts k)."""
        c, auto = self.config, self.config.proposer == "auto"
        decoding = max(sum(1 for r in self.scheduler.running if r.decoding), 1)
        if auto:
            self._choose_proposer(decoding)
        proposer = self.proposer_in_effect()
        if proposer == "off":
            return 0
        tree = self.tree_in_effect()
        if tree is not None:
            others = sum(r.num_uncomputed for r in self.scheduler.running) - 1
            if c.speculation_policy == "fixed" or auto or self.policy.grow_tree(1 + max(others, 0)):
                return tree.nodes
            return 0
        if c.speculation_policy == "fixed" or (auto and self.proposer_choice.is_measuring):
            return c.num_speculative_tokens
        own_draft_s = self.proposer_choice.counts(proposer).draft_s_per_token if auto else None
        return self.policy.choose_k(proposer, decoding, c.num_speculative_tokens, draft_token_s=own_draft_s)

    def _choose_proposer(self, decoding: int) -> None:
        """`auto`: the proposer of this step (engine.speculative.proposer_choice). A new winner (not a
        measuring step) changes the settings the next event carries."""
        others = sum(r.num_uncomputed for r in self.scheduler.running if not r.decoding)
        before = self.proposer_choice.chosen, self.proposer_choice.is_measuring
        chosen = self.proposer_choice.choose(self.auto_candidates(), self.step_count, self.policy.predicted_pass_s,
                                             decoding, others)
        if not self.proposer_choice.is_measuring and (chosen, False) != before:
            self.settings_version += 1

    def _step_stats(self, plan, work: list["_Work"], events: list[StepEvent], pass_s: float, step_s: float,
                    compiles: int = 0) -> EngineStep:
        rows = sum(len(w.item.tokens) for w in work)
        decode_rows = sum(len(w.item.tokens) for w in work if w.decode)
        if work:
            self.policy.record_pass(rows, pass_s)
        blocks = self.runner.blocks
        step = EngineStep(step=self.step_count, running=len(self.scheduler.running),
                          waiting=len(self.scheduler.waiting), batch_size=len(work),
                          prefill_tokens=rows - decode_rows, decode_tokens=decode_rows,
                          kv_blocks_used=blocks.num_used_blocks, kv_blocks_free=blocks.num_free_blocks,
                          preemptions=len(plan.preempted), drafted=sum(len(w.drafts) for w in work),
                          accepted=sum(e.accepted for e in events),
                          k=max((s.max_drafts for s in plan.scheduled), default=0), pass_s=pass_s, step_s=step_s,
                          experts_active=self._experts_active() if work else None, compiles=compiles,
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
    proposal: object            # engine.speculative.spec_decode.Proposal, or None
    decode: bool                # a decode (or verify) step, not a prompt chunk
    max_drafts: int = 0         # drafts it was allowed (0: a plain decode step)

    @property
    def drafts(self) -> list[int]:
        return self.proposal.tokens if self.proposal is not None else []


def _drafted(work: _Work, event: StepEvent) -> ProposerCounts:
    """One sequence's part of a step, as proposer `auto` counts it."""
    proposal = work.proposal
    return ProposerCounts(asked=1, drafted=int(event.proposed > 0), proposed=event.proposed, accepted=event.accepted,
                          draft_s=proposal.time_s if proposal is not None else 0.0)


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
