"""What a configuration costs in output quality, measured on the loaded model against its most
exact configuration: the app's Quality tab and `python -m engine.bench quality --compare` run
this one implementation.

The reference: the loaded model's weights dequantized (weight_dtype float), its cache in the
compute dtype (kv_cache_dtype auto), in the dtype it was loaded with: each lossy setting at its
`exact` value in the settings table (engine.config). On the same tokens (a text the project
ships, resources/quality/reference_text.txt, and optionally the chat so far), fed through the
cache in non-overlapping windows of WINDOW tokens, pieces of PIECE tokens at a time (later
tokens attend to keys read back from the cache, as in serving), each configuration is compared
with the reference token by token, as llama-perplexity --kl-divergence compares a quantized file
with its base:
  - KL divergence KLD(reference || configuration) per token, over the reference's log-probs
    above its floor (the reference is kept as llama.cpp's base file keeps it: 16 bits a
    log-prob, engine.quality.log_probs): mean, median, 99th percentile
    and maximum;
  - how often both put the same token on top;
  - perplexity, the reference's, and the change, by the paired per-token log-prob differences.
Intervals are 95%: mean ± 1.96 standard errors over the scored tokens (llama-perplexity's
uncertainty; neighbouring tokens are not independent, so they are somewhat narrow).

Lossless settings change the speed, never the tokens: the configuration's greedy replies to a
few chat prompts (its compiled step, its speculation, its prefix cache, the prompts batched
together and again one at a time) are checked token for token against the plain path
(engine.quality.lossless). The one-at-a-time replies also give the configuration's decode tok/s.

A configuration whose weights or dtype differ from the loaded model's (weight_dtype int4 on a
float checkpoint) is served by a second engine loaded for the measurement and freed after it.
Qt-free; the app runs `QualityRun.steps()` on its worker thread, one bounded piece per call.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Iterator

import numpy as np
import torch

from engine.cache.kv_cache import dtype_name
from engine.config import BY_KEY, ENGINE, LOAD, SETTINGS
from engine.errors import WorkbenchError
from engine.quality.figures import compare, summary
from engine.quality.forced import WINDOW, nll_of, forced_pieces, pieces_in, scoring_runner
from engine.quality.lossless import lossless_check
from engine.quality.log_probs import LOG_PROB_FLOOR, compressed_log_probs, expand_log_probs
from engine.quality.text import text_ids

DEFAULT_TOKENS = 2048          # scored tokens of the shipped text (two windows)
CHECK_PROMPTS = 3              # chat prompts (engine.workload.CHAT_PROMPTS) the lossless check replies to
CHECK_TOKENS = 32              # greedy tokens of each reply


@dataclass(frozen=True)
class Configuration:
    """A set of settings to measure: engine settings by key (engine.config.SETTINGS); a key not
    given is as the engine has it when the run starts."""
    label: str
    settings: dict = field(default_factory=dict)


@dataclass
class Progress:
    message: str
    fraction: float
    result: dict | None = None


@dataclass
class Reference:
    """The reference's log-probs (compressed as llama.cpp's base file keeps them) and per-token
    negative log-likelihoods, and what it is."""
    key: tuple
    stored: list[np.ndarray]
    nll: np.ndarray
    n_vocab: int
    settings: dict


_kept: dict[tuple, Reference] = {}     # the last reference, reused by the next run on the same model and text


# ---- the run ------------------------------------------------------------------------------------
class QualityRun:
    """Measure each configuration against the reference on `engine` (an LLMEngine with nothing
    running). `steps()` does the work a bounded piece per next(); `close()` stops early. Either
    way the engine ends with the settings it had."""

    def __init__(self, engine, configurations: list[Configuration], chat: list[dict] | None = None,
                 tokens: int | None = None, window: int = WINDOW, check_prompts: int = CHECK_PROMPTS,
                 check_tokens: int = CHECK_TOKENS):
        if not configurations:
            raise WorkbenchError("nothing to measure: give at least one configuration")
        self.engine, self.configurations = engine, list(configurations)
        self.tokens, self.window = tokens or DEFAULT_TOKENS, window
        self.check_prompts, self.check_tokens = check_prompts, check_tokens
        self.chat_ids = engine.encode(chat) if chat else None
        for c in self.configurations:
            _check_settings(c)
        self._gen: Iterator[Progress] | None = None
        self.results: list[dict] = []
        self.reference_s: float | None = None      # seconds this run spent on the reference (0: kept)

    def steps(self) -> Iterator[Progress]:
        if self._gen is None:
            self._gen = self._run()
        return self._gen

    def close(self) -> None:
        if self._gen is not None:
            self._gen.close()

    # each configuration's share of the bar: the reference counts as one more
    def _run(self) -> Iterator[Progress]:
        eng = self.engine
        restore = {key: getattr(eng.config, key) for key in _reconfigurable()}
        sequences, text = text_ids(eng.tokenizer, self.tokens, self.chat_ids)
        total = len(self.configurations) + 1
        try:
            t0 = time.perf_counter()
            reference = yield from self._reference(sequences, text["sha256"], lambda f, m: Progress(m, f / total))
            self.reference_s = time.perf_counter() - t0
            for i, configuration in enumerate(self.configurations):
                share = lambda f, m, i=i: Progress(f"{configuration.label}: {m}", (i + 1 + f) / total)   # noqa: E731
                result = yield from self._measure(configuration, sequences, text, reference, share)
                self.results.append(result)
                yield Progress(f"{configuration.label}: {result['summary']}", (i + 2) / total, result)
        finally:
            eng.reconfigure(**{k: v for k, v in restore.items() if getattr(eng.config, k) != v})

    def _reference(self, sequences, digest: str, progress) -> Iterator[Progress]:
        eng = self.engine
        dtype = eng.runner.model_dtype
        key = (eng.target_model.identity, str(dtype), str(eng.device), self.window, digest)
        if key in _kept:
            yield progress(1.0, "the reference (kept from the last measurement)")
            return _kept[key]
        _kept.clear()                         # one reference at a time: its log-probs are large
        loaded = eng.target_model
        if _weights_name(loaded) != "float":
            yield progress(0.0, "loading the reference: the weights dequantized")
            from engine.loading import loader
            loaded = loader.load_model(loaded.folder, device=eng.device, dtype=dtype, weight_dtype="float")
        runner = scoring_runner(loaded, "auto", eng.device, self.window)
        n, stored, nll = pieces_in(sequences, self.window), [], []
        for i, (logits, targets) in enumerate(forced_pieces(runner, sequences, self.window)):
            stored.append(compressed_log_probs(logits))
            nll.append(nll_of(torch.log_softmax(logits.double(), -1), targets))
            yield progress((i + 1) / n, f"the reference: {sum(map(len, nll))} tokens")
        settings = {"dtype": dtype_name(dtype), "weight_dtype": "float", "kv_cache_dtype": runner.kv_dtype_name}
        _kept[key] = Reference(key, stored, np.concatenate(nll), logits.shape[-1], settings)
        return _kept[key]

    def _measure(self, configuration: Configuration, sequences, text: dict, reference: Reference,
                 progress) -> Iterator[Progress]:
        t0 = time.perf_counter()
        eng = self.engine
        own = _loads_own(eng, configuration.settings)
        if own:
            yield progress(0.0, f"loading a second engine with {', '.join(f'{k} {v}' for k, v in own.items())}")
            served = _engine_for(eng, configuration.settings)
        else:
            live = {k: v for k, v in configuration.settings.items() if BY_KEY[k].applies != LOAD}
            eng.reconfigure(**live)
            served = eng
        try:
            in_effect = {"dtype": dtype_name(served.runner.model_dtype), "weight_dtype": _weights_name(served.target_model),
                         "kv_cache_dtype": served.runner.kv_dtype_name}
            runner = scoring_runner(served.target_model, in_effect["kv_cache_dtype"], served.device, self.window)
            n, nll, kld, same = pieces_in(sequences, self.window), [], [], []
            for i, (logits, targets) in enumerate(forced_pieces(runner, sequences, self.window)):
                q = torch.log_softmax(logits.double(), -1)
                p = torch.from_numpy(expand_log_probs(reference.stored[i], reference.n_vocab))
                kld.append(torch.where(p > -LOG_PROB_FLOOR, p.exp() * (p - q), torch.zeros_like(p)).sum(-1).numpy())
                same.append((p.argmax(-1) == q.argmax(-1)).numpy())
                nll.append(nll_of(q, targets))
                yield progress(0.6 * (i + 1) / n, f"scoring {sum(map(len, nll))} tokens")
            del runner
            figures = compare(reference.nll, np.concatenate(nll), np.concatenate(kld), np.concatenate(same))
            check = yield from lossless_check(served, self.check_prompts, self.check_tokens,
                                              lambda f, m: progress(0.6 + 0.4 * f, m))
        finally:
            if served is not eng:
                del served
                from engine.loading.weight_quant import release_freed_memory
                release_freed_memory()
        lossy = any(in_effect[k] != reference.settings[k] for k in in_effect)
        row = {"label": configuration.label, "settings": dict(configuration.settings), "in_effect": in_effect,
               "reference": dict(reference.settings), "model": eng.target_model.display_name, "text": text,
               "window": self.window, "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "lossy": lossy, **figures, "lossless": check, "decode_tok_s": check.pop("decode_tok_s"),
               "elapsed_s": time.perf_counter() - t0}
        row["summary"] = summary(row)
        return row


# ---- settings -----------------------------------------------------------------------------------
def _reconfigurable() -> tuple[str, ...]:
    from engine.engine import reconfigurable
    return reconfigurable()


def _check_settings(configuration: Configuration) -> None:
    for key, value in configuration.settings.items():
        setting = BY_KEY.get(key)
        if setting is None or setting.section != ENGINE:
            raise WorkbenchError(f"{configuration.label}: {key!r} is not an engine setting "
                                 f"(engine settings: {', '.join(s.key for s in SETTINGS if s.section == ENGINE)})")
        setting.validate(value)
        if setting.applies == LOAD and not setting.lossy:
            raise WorkbenchError(f"{configuration.label}: {key} is set when a model loads; load the model with it "
                                 "to measure it")


def _loads_own(eng, settings: dict) -> dict:
    """The load-time settings a configuration asks for that the loaded engine does not have."""
    return {k: v for k, v in settings.items() if BY_KEY[k].applies == LOAD and getattr(eng.config, k) != v
            and not (k == "dtype" and v == dtype_name(eng.runner.model_dtype))}


def _engine_for(eng, settings: dict):
    from engine.engine import LLMEngine
    dtype = settings.get("dtype") or dtype_name(eng.runner.model_dtype)    # never the dtype trial's second load
    config = eng.config.with_changes(**{**settings, "dtype": dtype})
    return LLMEngine.load(str(eng.target_model.folder), config)


def _weights_name(loaded) -> str:
    w = loaded.weights
    return "float" if w is None or not w.quantized else w.summary()


