"""`python -m engine.bench quality --weight-dtype X`: what serving the weights quantized costs
in quality, against the same checkpoint with its weights dequantized (weight_dtype float),
in the same compute dtype, in one run:
  - perplexity on the kv scenario's text (pydoc's topics, which ship with Python), the same
    windows for both;
  - greedy agreement over the chat prompt set: how many tokens each reply shares with the
    float reply before the first difference (the median, and every prompt's count).
"""
from __future__ import annotations

import argparse
import statistics

from engine.bench.scenarios import CHAT_PROMPTS, _engine, _perplexity, chat, held_out_text


def bench_quality(args) -> dict:
    from engine import SamplingParams
    weight_dtype = args.weight_dtype or "auto"
    engines = {name: _engine(argparse.Namespace(**{**vars(args), "weight_dtype": name}), enable_prefix_caching=False)
               for name in ("float", weight_dtype)}
    reference, served = engines["float"], engines[weight_dtype]
    ids = reference.tokenizer.encode(held_out_text(), add_special_tokens=False)[:args.eval_tokens + 1]
    ppl = {name: _perplexity(eng.runner, ids, args.window) for name, eng in engines.items()}
    greedy = SamplingParams(max_tokens=args.tokens, stop_on_eos=False)
    agree = []
    for prompt in CHAT_PROMPTS:
        prompt_ids = reference.encode(chat(prompt))
        a = reference.generate_text(prompt_ids, greedy)[1]
        b = served.generate_text(prompt_ids, greedy)[1]
        agree.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
    s = served.settings()
    return {"weight_dtype": weight_dtype, "served": s["weight_dtype"], "reference": reference.settings()["weight_dtype"],
            "dtype": s["dtype"], "weight_bytes_per_token": s["weight_bytes_per_token"],
            "reference_weight_bytes_per_token": reference.settings()["weight_bytes_per_token"],
            "ppl": ppl[weight_dtype], "ppl_reference": ppl["float"],
            "ppl_increase_pct": 100 * (ppl[weight_dtype] / ppl["float"] - 1),
            "greedy_agreement_tokens_median": statistics.median(agree), "greedy_agreement_tokens": agree,
            "greedy_tokens": args.tokens, "prompts": len(CHAT_PROMPTS), "eval_tokens": len(ids) - 1,
            "window": args.window, "eval_text": "pydoc_data.topics (ships with Python)"}
