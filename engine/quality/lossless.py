"""Lossless settings change the speed, never the tokens: the quality measurement checks them
token for token (engine.quality.run) and times the configuration's decode here."""
from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from engine.cache.kv_cache import dtype_name
from engine.config import SamplingParams
from engine.quality.forced import scoring_runner

def lossless_check(eng, prompts: int, tokens: int, progress) -> Iterator:
    """Greedy replies to `prompts` chat prompts through the engine as configured, each alone
    (decode tok/s) and then all at once (batched, prefix-cache hits), against the plain path:
    the same engine with no speculation and no prefix cache, one prompt alone; where nothing is
    rounded below float32 (where the compiled step promises the eager step's tokens), the eager
    step too. Token for
    token. The suffix proposer starts from an empty index (restored after): no configuration
    drafts from the replies another one just gave."""
    from engine.speculative.suffix_proposer import SuffixCache
    from engine.workload import CHAT_PROMPTS, chat
    asks = [eng.encode(chat(p)) for p in CHAT_PROMPTS[:prompts]]
    params = SamplingParams(max_tokens=tokens, stop_on_eos=False)
    # The compiled step promises the eager step's tokens where nothing is rounded below float32:
    # float32 activations, a float32 cache and float weights. A quantized weight's kernel rounds
    # its input activations to 8 bits, and an FP8 or 16-bit cache what it stores, so the two
    # paths' summation orders can part at a near tie (tests/test_compiled_step.py).
    weights = eng.target_model.weights
    exact = (eng.runner.model_dtype == torch.float32 and eng.runner.kv_dtype_name == "float32"
             and (weights is None or not weights.quantized))
    eager = eng.runner.compiled is not None and exact
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
    not_checked = [] if eager or eng.runner.compiled is None else [
        f"the compiled step against the eager one ({dtype_name(eng.runner.model_dtype)}, a "
        f"{eng.runner.kv_dtype_name} cache, {'quantized' if weights and weights.quantized else 'float'} weights: "
        "rounded below float32, each path rounds in its own summation order)"]
    checked = [c for c in checked if c]
    diverged = [{"prompt": i, "first_divergence": _first_difference(e, o), "path": path}
                for path, outs in replies.items() for i, (e, o) in enumerate(zip(plain, outs)) if e != o]
    identical = not diverged
    said = (f"token for token identical to the plain path ({len(asks)} prompts x {tokens} tokens; "
            f"{', '.join(checked)})" if identical else
            f"DIFFERS from the plain path in {len(diverged)} of {len(replies) * len(asks)} replies ({', '.join(checked)})")
    said += f"; not checked: {not_checked[0]}" if not_checked else ""
    return {"checked": checked, "not_checked": not_checked, "identical": identical, "prompts": len(asks), "tokens_each": tokens,
            "divergences": diverged, "said": said,
            "decode_tok_s": float(np.median(rates)) if rates else None}


def _reply(eng, ask: list[int], params, tick, message) -> Iterator:
    stream, out = eng.start(ask, params), []
    try:
        while not stream.finished:
            out.extend(stream.step().token_ids)
            yield tick(message)
        return out, stream.stats
    finally:
        stream.close()


def _together(eng, asks: list[list[int]], params, tick) -> Iterator:
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


def _eager(eng, asks: list[list[int]], tokens: int, tick) -> Iterator:
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

