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
    log-prob, engine.bench.kl_divergence.compressed_log_probs): mean, median, 99th percentile
    and maximum;
  - how often both put the same token on top;
  - perplexity, the reference's, and the change, by the paired per-token log-prob differences.
Intervals are 95%: mean ± 1.96 standard errors over the scored tokens (llama-perplexity's
uncertainty; neighbouring tokens are not independent, so they are somewhat narrow).

Lossless settings change the speed, never the tokens: the configuration's greedy replies to a
few chat prompts (its compiled step, its speculation, its prefix cache, the prompts batched
together and again one at a time after them) are checked token for token against the plainest
path (the eager step, one prompt alone, no speculation, no prefix cache) on the same weights
and cache dtype. The one-at-a-time replies also give the configuration's decode tok/s.

A configuration whose weights or dtype differ from the loaded model's (weight_dtype int4 on a
float checkpoint) is served by a second engine loaded for the measurement and freed after it.
Qt-free; the app runs `QualityRun.steps()` on its worker thread, one bounded piece per call.
"""
from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from engine.config import BY_KEY, ENGINE, LOAD, LOADED, SETTINGS, EngineConfig, SamplingParams
from engine.errors import WorkbenchError
from resources import QUALITY_TEXT

QUALITY_TEXT_FILE = QUALITY_TEXT
# the shipped text's digest: a changed or damaged file is refused (its figures would not compare)
QUALITY_TEXT_SHA256 = "e2dde11bd3b1edecc32ffe66c513c520efb6dd430ae927090e0309ab7f08bfd4"
DEFAULT_TOKENS = 2048          # scored tokens of the shipped text (two windows)
WINDOW = 1024                  # tokens per window: bench kv's
PIECE = 256                    # tokens fed per forward (a prefill chunk)
Z95 = 1.959963984540054        # two-sided 95% normal quantile
CHECK_PROMPTS = 3              # chat prompts (engine.workload.CHAT_PROMPTS) the lossless check replies to
CHECK_TOKENS = 32              # greedy tokens of each reply


class QualityTextError(WorkbenchError):
    """The reference text is missing, unreadable or not the one shipped."""


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


# ---- the text ---------------------------------------------------------------------------------
def reference_text(path: Path | None = None, check_digest: bool | None = None) -> str:
    """The reference text: the shipped one (checked against its digest), or the file given."""
    check = path is None if check_digest is None else check_digest
    path = Path(path or QUALITY_TEXT_FILE)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise QualityTextError(f"the quality reference text {path} cannot be read ({exc.strerror or exc}); "
                               "reinstall the workbench to restore it") from exc
    if check and hashlib.sha256(data).hexdigest() != QUALITY_TEXT_SHA256:
        raise QualityTextError(f"the quality reference text {path} is not the one shipped (its SHA-256 differs), "
                               "so its figures would not compare with anyone's; reinstall the workbench to restore it")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise QualityTextError(f"the quality reference text {path} is not UTF-8 text ({exc.reason} at byte "
                               f"{exc.start}); reinstall the workbench to restore it") from exc


def text_ids(tokenizer, tokens: int, chat_ids: list[int] | None = None) -> tuple[list[list[int]], dict]:
    """The sequences scored: the shipped text's first tokens + 1 (each predicts the next), then
    the chat so far as its own sequence; and what they are."""
    ids = tokenizer.encode(reference_text(), add_special_tokens=False)[:tokens + 1]
    if len(ids) < 2:
        raise QualityTextError(f"the quality reference text {QUALITY_TEXT_FILE} holds no tokens to score")
    sequences = [ids] + ([chat_ids] if chat_ids and len(chat_ids) > 1 else [])
    digest = hashlib.sha256(np.asarray([t for s in sequences for t in s], dtype="<i4").tobytes()).hexdigest()
    return sequences, {"source": "shipped text" + (" + the chat so far" if len(sequences) > 1 else ""),
                       "file": QUALITY_TEXT_FILE.name, "tokens": sum(len(s) - 1 for s in sequences),
                       "sha256": digest}


# ---- teacher forcing ----------------------------------------------------------------------------
def forced_pieces(runner, sequences: list[list[int]], window: int = WINDOW) -> Iterator[tuple[torch.Tensor, list[int]]]:
    """Each sequence in non-overlapping windows, each window fed through the runner's cache in
    pieces of PIECE tokens: yields (the piece's fp32 logits [n, V], the n tokens they predict)."""
    for ids in sequences:
        for start in range(0, len(ids) - 1, window):
            chunk = ids[start:start + window + 1]
            seq = runner.start(chunk[:-1])
            try:
                for c in range(0, len(chunk) - 1, PIECE):
                    piece = chunk[c:c + PIECE + 1]
                    yield runner.forward(seq, piece[:-1], logits_for="all").float(), piece[1:]
            finally:
                runner.end(seq)


def pieces_in(sequences: list[list[int]], window: int = WINDOW) -> int:
    return sum(math.ceil(min(window, len(ids) - 1 - s) / PIECE) for ids in sequences for s in range(0, len(ids) - 1, window))


def perplexity(runner, ids: list[int], window: int = WINDOW) -> float:
    """Perplexity of ids under the runner (forced_pieces' windows and pieces)."""
    nll, count = 0.0, 0
    for logits, targets in forced_pieces(runner, [ids], window):
        nll += float(torch.nn.functional.cross_entropy(logits, torch.tensor(targets, device=logits.device), reduction="sum"))
        count += len(targets)
    return math.exp(nll / count)


def _nll(log_probs: torch.Tensor, targets: list[int]) -> np.ndarray:
    return -log_probs.gather(-1, torch.tensor(targets, device=log_probs.device)[:, None])[:, 0].double().cpu().numpy()


def scoring_runner(loaded, kv_cache_dtype: str, device: torch.device, window: int = WINDOW):
    """An eager runner of its own, with a pool for one window, in the given cache dtype."""
    from engine.runtime.model_runner import ModelRunner
    config = EngineConfig(kv_cache_dtype=kv_cache_dtype, compile="off", enable_prefix_caching=False)
    return ModelRunner(loaded, config, device, num_blocks=window // config.block_size + 2)


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


# ---- statistics ----------------------------------------------------------------------------------
def compare(ref_nll: np.ndarray, nll: np.ndarray, kld: np.ndarray, same: np.ndarray) -> dict:
    """The figures of one configuration against the reference, from per-token arrays."""
    n = len(nll)
    se = lambda x: float(np.std(x, ddof=1) / math.sqrt(n)) if n > 1 else float("nan")    # noqa: E731
    diff = nll - ref_nll
    d_mean, d_se = float(diff.mean()), se(diff)
    k_mean, k_se = float(kld.mean()), se(kld)
    p_same = float(same.mean())
    s_se = math.sqrt(max(p_same * (1 - p_same), 0.0) / max(n - 1, 1))
    ln_ppl, ln_se = float(nll.mean()), se(nll)
    pct = lambda x: 100.0 * (math.exp(x) - 1.0)    # noqa: E731
    return {"tokens_scored": n,
            "kld_mean": k_mean, "kld_mean_ci95": [max(0.0, k_mean - Z95 * k_se), k_mean + Z95 * k_se],
            "kld_median": float(np.median(kld)), "kld_p99": float(np.percentile(kld, 99)), "kld_max": float(kld.max()),
            "same_top_pct": 100 * p_same,
            "same_top_pct_ci95": [100 * max(0.0, p_same - Z95 * s_se), 100 * min(1.0, p_same + Z95 * s_se)],
            "ppl": math.exp(ln_ppl), "ppl_ci95": [math.exp(ln_ppl - Z95 * ln_se), math.exp(ln_ppl + Z95 * ln_se)],
            "ppl_reference": math.exp(float(ref_nll.mean())),
            "ppl_change_pct": pct(d_mean), "ppl_change_pct_ci95": [pct(d_mean - Z95 * d_se), pct(d_mean + Z95 * d_se)]}


def pareto_front(rows: list[dict]) -> list[int]:
    """Indices of the rows no other row beats on both lower kld_mean and higher decode_tok_s
    (equal on one, better on the other), ordered by kld_mean."""
    points = [(i, r["kld_mean"], r["decode_tok_s"]) for i, r in enumerate(rows)
              if r.get("kld_mean") is not None and r.get("decode_tok_s") is not None]
    front = [i for i, k, s in points
             if not any((k2 <= k and s2 >= s) and (k2 < k or s2 > s) for _, k2, s2 in points)]
    return sorted(front, key=lambda i: (rows[i]["kld_mean"], -rows[i]["decode_tok_s"]))


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
            reference = yield from self._reference(sequences, lambda f, m: Progress(m, f / total))
            for i, configuration in enumerate(self.configurations):
                share = lambda f, m, i=i: Progress(f"{configuration.label}: {m}", (i + 1 + f) / total)   # noqa: E731
                result = yield from self._measure(configuration, sequences, text, reference, share)
                self.results.append(result)
                yield Progress(f"{configuration.label}: {result['summary']}", (i + 2) / total, result)
        finally:
            eng.reconfigure(**{k: v for k, v in restore.items() if getattr(eng.config, k) != v})

    def _reference(self, sequences, progress) -> Iterator[Progress]:
        eng = self.engine
        dtype = eng.runner.model_dtype
        key = (eng.target_model.identity, str(dtype), str(eng.device), self.window,
               hashlib.sha256(repr(sequences).encode()).hexdigest())
        if key in _kept:
            yield progress(1.0, "the reference (kept from the last measurement)")
            return _kept[key]
        _kept.clear()                         # one reference at a time: its log-probs are large
        loaded = eng.target_model
        if _weights_name(loaded) != "float":
            yield progress(0.0, "loading the reference: the weights dequantized")
            from engine.loading import loader
            loaded = loader.load_model(loaded.folder, device=eng.device, dtype=dtype, weight_dtype="float")
        from engine.bench.kl_divergence import compressed_log_probs
        runner = scoring_runner(loaded, "auto", eng.device, self.window)
        n, stored, nll = pieces_in(sequences, self.window), [], []
        for i, (logits, targets) in enumerate(forced_pieces(runner, sequences, self.window)):
            stored.append(compressed_log_probs(logits))
            nll.append(_nll(torch.log_softmax(logits.double(), -1), targets))
            yield progress((i + 1) / n, f"the reference: {sum(map(len, nll))} tokens")
        settings = {"dtype": _dtype_name(dtype), "weight_dtype": "float", "kv_cache_dtype": runner.kv_dtype_name}
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
            in_effect = {"dtype": _dtype_name(served.runner.model_dtype), "weight_dtype": _weights_name(served.target_model),
                         "kv_cache_dtype": served.runner.kv_dtype_name}
            runner = scoring_runner(served.target_model, in_effect["kv_cache_dtype"], served.device, self.window)
            from engine.bench.kl_divergence import LOG_PROB_FLOOR, expand_log_probs
            n, nll, kld, same = pieces_in(sequences, self.window), [], [], []
            for i, (logits, targets) in enumerate(forced_pieces(runner, sequences, self.window)):
                q = torch.log_softmax(logits.double(), -1)
                p = torch.from_numpy(expand_log_probs(reference.stored[i], reference.n_vocab))
                kld.append(torch.where(p > -LOG_PROB_FLOOR, p.exp() * (p - q), torch.zeros_like(p)).sum(-1).numpy())
                same.append((p.argmax(-1) == q.argmax(-1)).numpy())
                nll.append(_nll(q, targets))
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


def summary(row: dict) -> str:
    lo, hi = row["ppl_change_pct_ci95"]
    quality = (f"KLD {row['kld_mean']:.5f} nats, same top {row['same_top_pct']:.1f}%, "
               f"perplexity {row['ppl_change_pct']:+.2f}% ({lo:+.2f} to {hi:+.2f})")
    tokens = row["lossless"]["said"]
    return f"{quality}; {tokens}; {row['decode_tok_s']:.1f} tok/s"


# ---- the lossless check -------------------------------------------------------------------------
def lossless_check(eng, prompts: int, tokens: int, progress) -> Iterator[Progress]:
    """Greedy replies to `prompts` chat prompts through the engine as configured, each alone
    (decode tok/s) and then all at once (batched, prefix-cache hits), against the plain path:
    the same engine with no speculation and no prefix cache, one prompt alone; in float32,
    where the compiled step promises the eager step's tokens, the eager step too. Token for
    token. The suffix proposer starts from an empty index (restored after): no configuration
    drafts from the replies another one just gave."""
    from engine.speculative.suffix_proposer import SuffixCache
    from engine.workload import CHAT_PROMPTS, chat
    asks = [eng.encode(chat(p)) for p in CHAT_PROMPTS[:prompts]]
    params = SamplingParams(max_tokens=tokens, stop_on_eos=False)
    eager = eng.runner.compiled is not None and eng.runner.model_dtype == torch.float32
    total = (3 + eager) * prompts * tokens
    done = [0]

    def tick(message):
        done[0] += 1
        return progress(min(1.0, done[0] / total), message)

    spec, kept_index = eng.speculator, eng.speculator.suffix_cache
    spec.suffix_cache = SuffixCache(eng.config.suffix_cache_tokens)
    asked = {"proposer": eng.config.proposer, "enable_prefix_caching": eng.config.enable_prefix_caching}
    s = eng.settings()
    try:
        alone, rates, hits = [], [], 0
        for ask in asks:
            out, stats = yield from _reply(eng, ask, params, tick, "as configured, one at a time")
            alone.append(out)
            hits += stats.prefix_hit_tokens
            if stats.decode_time_s > 0:
                rates.append(stats.decode_tokens / stats.decode_time_s)
        batched, batched_hits = yield from _together(eng, asks, params, tick)
        hits += batched_hits
        eng.reconfigure(proposer="off", enable_prefix_caching=False)
        plain = []
        for ask in asks:
            plain.append((yield from _reply(eng, ask, params, tick, "the plain path: alone, no speculation"))[0])
    finally:
        eng.reconfigure(**asked)
        spec.suffix_cache = kept_index
    replies = {"one at a time": alone, "batched": batched}
    checked = [f"speculation ({s['proposer']})" if s["proposer"] != "off" else None,
               f"prefix caching ({hits} tokens hit)" if asked["enable_prefix_caching"] else None, f"{len(asks)} requests batched"]
    if eager:
        replies["the compiled step"] = plain
        plain = yield from _eager(eng, asks, tokens, tick)
        checked.insert(0, "the compiled step (against the eager one)")
    checked = [c for c in checked if c]
    diverged = [{"prompt": i, "first_divergence": _first_difference(e, o), "path": path}
                for path, outs in replies.items() for i, (e, o) in enumerate(zip(plain, outs)) if e != o]
    identical = not diverged
    said = (f"token for token identical to the plain path ({len(asks)} prompts x {tokens} tokens; "
            f"{', '.join(checked)})" if identical else
            f"DIFFERS from the plain path in {len(diverged)} of {len(replies) * len(asks)} replies ({', '.join(checked)})")
    return {"checked": checked, "identical": identical, "prompts": len(asks), "tokens_each": tokens,
            "divergences": diverged, "said": said,
            "decode_tok_s": float(np.median(rates)) if rates else None}


def _reply(eng, ask: list[int], params, tick, message) -> Iterator[Progress]:
    stream, out = eng.start(ask, params), []
    try:
        while not stream.finished:
            out.extend(stream.step().token_ids)
            yield tick(message)
        return out, stream.stats
    finally:
        stream.close()


def _together(eng, asks: list[list[int]], params, tick) -> Iterator[Progress]:
    streams = [eng.start(ask, params) for ask in asks]
    outs = [[] for _ in asks]
    try:
        while not all(s.finished for s in streams):
            for i, s in enumerate(streams):
                if not s.finished:
                    outs[i].extend(s.step().token_ids)
                    yield tick(f"as configured, {len(asks)} at once")
        return outs, sum(s.stats.prefix_hit_tokens for s in streams)
    finally:
        for s in streams:
            s.close()


def _eager(eng, asks: list[list[int]], tokens: int, tick) -> Iterator[Progress]:
    """Greedy replies through an eager runner of the same weights and cache dtype."""
    runner = scoring_runner(eng.target_model, eng.runner.kv_dtype_name, eng.device, max(map(len, asks)) + tokens)
    outs = []
    for ask in asks:
        seq, out = runner.start(ask), []
        try:
            logits = runner.forward(seq, ask)
            while True:
                out.append(int(logits[-1].argmax()))
                yield tick("the eager step, alone")
                if len(out) == tokens:
                    break
                logits = runner.forward(seq, out[-1:])
        finally:
            runner.end(seq)
        outs.append(out)
    return outs


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


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
            and not (k == "dtype" and v == _dtype_name(eng.runner.model_dtype))}


def _engine_for(eng, settings: dict):
    from engine.engine import LLMEngine
    dtype = settings.get("dtype") or _dtype_name(eng.runner.model_dtype)    # never the dtype trial's second load
    config = eng.config.with_changes(**{**settings, "dtype": dtype})
    return LLMEngine.load(str(eng.target_model.folder), config)


def _weights_name(loaded) -> str:
    w = loaded.weights
    return "float" if w is None or not w.quantized else w.summary()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


assert all(s.exact in (LOADED,) or s.exact in s.choices for s in SETTINGS if s.lossy)
