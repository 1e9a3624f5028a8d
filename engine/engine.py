"""LLMEngine: load a model, stream generations as step events, cancel, reconfigure.

The request path reads top to bottom:
  generate -> start (a Request) -> Request.step (prefill, then decode or speculative
  steps) -> StepEvent -> Request.close.
One sequence at a time (a desktop chat). Every setting can change without reloading the
weights; `engine.config.SETTINGS` says when each change takes effect (live: at the next
step; next request: when the running reply ends). Drive the engine from one thread;
only `cancel` may be called from any thread.
"""
from __future__ import annotations

from typing import Iterator

import torch

from engine.backend import ReconfigureResult, run_to_end
from engine.cache.memory_plan import MemoryPlan, plan_memory
from engine.config import BY_KEY, ENGINE, LIVE, NEXT_REQUEST, SETTINGS, EngineConfig, SamplingParams, keys
from engine.errors import ConfigError, PromptTooLongError, WorkbenchError
from engine.loading import loader
from engine.metrics import RequestStats, StepEvent
from engine.models.eagle_head import EagleHead
from engine.request import Request
from engine.runtime.model_runner import ModelRunner, prepare_model
from engine.spec.eagle_proposer import EagleProposer
from engine.spec.spec_decode import DraftModelProposer, NgramProposer, Proposer, check_draft_compatible
from engine.spec.step_costs import PlainStepClock

SELF_DRAFT = "self"   # draft with the target itself (acceptance 1.0 in greedy mode; a test fixture)
# Changing these reallocates the KV pool (and drops the prefix cache).
POOL_SETTINGS = tuple(s.key for s in SETTINGS if s.rebuilds_pool)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        from engine.runtime.cpu_dtype import fastest
        return fastest(loader.cache_dir() / "cpu_dtype.json")
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


class LLMEngine:
    def __init__(self, target: loader.LoadedModel, config: EngineConfig, device: torch.device,
                 progress: loader.Progress = loader.no_progress):
        self.config = config
        self.device = device
        self.progress = progress
        self.target_model = target
        self.tokenizer = target.tokenizer
        self.max_model_len = min(config.max_model_len or target.model.max_positions, target.model.max_positions)
        prepare_model(target.model, device)
        self.plan: MemoryPlan = plan_memory(config, device, target.model)
        self.runner = ModelRunner(target, config, device, num_blocks=self.plan.num_blocks, progress=progress,
                                  on_settings_changed=self._settings_changed)
        self.draft_runner: ModelRunner | None = None
        self.draft_name: str | None = None
        self.active: Request | None = None
        self.settings_version = 0      # bumped whenever settings() may answer differently
        self._pending: dict = {}
        self.eos_ids = _eos_ids(target)
        self.eagle: tuple[str | None, EagleHead] | None = None     # (reference, head) once loaded
        self.plain_steps = PlainStepClock()
        if config.draft_model:
            self.set_draft_model(config.draft_model)
        if config.proposer == "eagle":
            self.load_eagle_head(config.eagle_head)

    # ---- construction ----------------------------------------------------------
    @classmethod
    def load(cls, model: str | None = None, config: EngineConfig | None = None, progress=None,
             allow_hub: bool = False, allow_pickle: bool = False) -> "LLMEngine":
        config = config or EngineConfig()
        progress = progress or loader.no_progress
        device = pick_device(config.device)
        dtype = pick_dtype(config.dtype, device)
        target = loader.load_model(model, device=device, dtype=dtype, allow_hub=allow_hub,
                                   allow_pickle=allow_pickle, max_positions=config.max_model_len, progress=progress)
        return cls(target, config, device, progress)

    def set_draft_model(self, reference: str | None, progress=None) -> None:
        """Load (or clear) the draft model now. Checks tokenizer compatibility first; a
        draft that fails to load leaves the previous one in place. Both pools are planned
        again (the draft's weights and cache share the memory plan); the prefix cache goes."""
        if self.active is not None:
            raise ConfigError("the draft model can change only between requests")
        for runner in self.runners():
            runner.release_cache()          # room for the draft's weights
        try:
            draft = None if reference in (None, "") else self._load_draft(reference, progress or self.progress)
            self.build_pools(draft)
        except BaseException:
            self.build_pools(self._draft())
            raise
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
        self.runner.build_cache(self.config, plan.num_blocks)
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

    # ---- settings --------------------------------------------------------------
    def reconfigure(self, **changes) -> ReconfigureResult:
        """Change settings without reloading weights. Live settings apply at the next step;
        the others (KV dtype, block size, pool size, draft model) now if idle, else when the
        running request ends. Invalid values raise ConfigError and change nothing."""
        for key, value in changes.items():
            setting = BY_KEY.get(key)
            if setting is None or setting.section != ENGINE or setting.applies not in (LIVE, NEXT_REQUEST):
                raise ConfigError(f"{key!r} cannot change on a loaded engine (settings that can: "
                                  f"{', '.join(reconfigurable())}); load the model again to change it")
        new = self.config.with_changes(**changes)       # validate before touching anything
        if new.proposer == "eagle":
            self.load_eagle_head(new.eagle_head)           # a missing or foreign head fails here
        self._pending.update(changes)
        if self.active is None:
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
        c = self.config
        return {"kv_cache_dtype": self.runner.kv_dtype_name, "block_size": c.block_size,
                "enable_prefix_caching": c.enable_prefix_caching, "proposer": self.proposer_in_effect(),
                "num_speculative_tokens": c.num_speculative_tokens, "draft_model": self.draft_name,
                "eagle_head": None if self.eagle is None else (self.eagle[0] or "shipped"),
                "kv_pool_blocks": self.runner.kv.num_blocks, "kernels": self.runner.use_kernels,
                "threads": torch.get_num_threads(), "device": str(self.device),
                "dtype": str(self.runner.model_dtype).removeprefix("torch."),
                "memory_plan": self.plan.as_dict(), "chat_template": self.has_chat_template,
                "compile": self.runner.compile_state}

    def plain_step_key(self) -> tuple:
        """What changes a plain decode step's time (the proposer does not)."""
        return (self.runner.kv_dtype_name, self.runner.compile_state, torch.get_num_threads())

    def proposer_in_effect(self) -> str:
        p = self.config.proposer
        if (p == "draft" and self.draft_runner is None) or (p == "eagle" and self.eagle is None):
            return "off"
        return p

    def load_eagle_head(self, reference: str | None) -> None:
        """Load the EAGLE head (a few MB) unless this one is loaded; raises a clear error."""
        if self.eagle is not None and self.eagle[0] == reference:
            return
        head, _ = loader.load_eagle_head(reference, self.target_model, self.device, self.runner.model_dtype)
        prepare_model(head, self.device)
        self.eagle = (reference, head)

    def make_proposer(self, name: str) -> Proposer:
        if name == "ngram":
            return NgramProposer(self.config.ngram_min, self.config.ngram_max)
        if name == "draft":
            return DraftModelProposer(self.draft_runner)
        if name == "eagle":
            return EagleProposer(self.eagle[1], self.config.block_size, self.device)
        raise ConfigError(f"no proposer named {name!r}")

    def runners(self) -> list[ModelRunner]:
        return [r for r in (self.runner, self.draft_runner) if r is not None]

    def kv_bytes(self) -> tuple[int, int]:
        """(bytes held by live sequences, bytes allocated) over the target's and draft's pools."""
        return (sum(r.bytes_held() for r in self.runners()), sum(r.kv.bytes_allocated for r in self.runners()))

    def cancel(self) -> None:
        """Stop the running request at its next step. Safe from any thread."""
        request = self.active
        if request is not None:
            request.cancel()

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

    # ---- generation ------------------------------------------------------------
    def start(self, prompt: str | list[dict] | list[int], params: SamplingParams | None = None) -> Request:
        """Open a request (no forward pass yet); advance it with Request.step()."""
        if self.active is not None:
            raise WorkbenchError("a request is already running: wait for it to finish or cancel it")
        params = params or SamplingParams()
        self.apply_pending(live_only=False)
        token_ids = list(prompt) if _is_token_list(prompt) else self.encode(prompt)
        if not token_ids:
            raise WorkbenchError("the prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(token_ids)} tokens but the context holds {self.max_model_len}; "
                "shorten it or start a new chat")
        max_new = min(params.max_tokens, self.max_model_len - len(token_ids))
        if self.proposer_in_effect() != "off":       # the baseline "does speculation pay" needs
            self.plain_steps.calibrate(self.plain_step_key(), self.runner)
        self.active = Request(self, token_ids, max_new, params)
        return self.active

    def request_closed(self, request: Request) -> None:
        """Called by Request.close: waiting settings apply now."""
        if request is self.active:
            self.active = None
            self.apply_pending(live_only=False)

    def generate(self, prompt: str | list[dict] | list[int], params: SamplingParams | None = None) -> Iterator[StepEvent]:
        return run_to_end(self, prompt, params)

    def generate_text(self, prompt, params: SamplingParams | None = None) -> tuple[str, list[int], RequestStats]:
        text, ids, summary = [], [], None
        for ev in self.generate(prompt, params):
            text.append(ev.text_delta)
            ids.extend(ev.token_ids)
            summary = ev.summary or summary
        return "".join(text), ids, summary


def reconfigurable() -> tuple[str, ...]:
    """Keys LLMEngine.reconfigure takes."""
    return keys(ENGINE, applies=(LIVE, NEXT_REQUEST))


def plain_chat_text(messages: list[dict]) -> str:
    """Chat messages as plain text, for a model without a chat template."""
    turns = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n\n".join(turns + ["Assistant:"])


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
