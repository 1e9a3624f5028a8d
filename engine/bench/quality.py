"""`python -m engine.bench quality --weight-dtype X`: what serving the weights quantized costs
in quality, against the same checkpoint with its weights dequantized (weight_dtype float),
in the same compute dtype, in one run:
  - perplexity on the kv scenario's text (pydoc's topics, which ship with Python), the same
    windows for both;
  - greedy agreement over the chat prompt set: how many tokens each reply shares with the
    float reply before the first difference (the median, and every prompt's count).

`--compare KEY=A,B` (a setting, e.g. kv_cache_dtype=auto,fp8_e4m3 or weight_dtype=float,int4) or
`--compare profile=A,B` (two profiles' engine settings): each arm against the loaded model's most
exact configuration (its weights dequantized, its cache in the compute dtype) on the shipped
reference text (--eval-tokens of it, windows of --window): KL divergence, same top token,
perplexity and its change with 95% intervals, the lossless settings checked token for token, and
decode tok/s; the app's Quality tab runs the same code (engine.quality).

`--against llama.cpp --model FILE.gguf` (or --synthetic with a GGUF preset): our engine (fp32 compute unless --dtype, weights as
stored) beside llama.cpp on the same file (bench_against_llama_cpp):
  - perplexity by llama-perplexity's protocol (engine.remote.llama_tools) on the same token ids
    (llama-server's tokenization of the same text), n_ctx = --window, --eval-tokens / n_ctx
    chunks; llama.cpp run as users run it (K/V in f16, flash attention auto), with flash
    attention off, and with K/V in f32 and flash attention off; ours with K/V in fp32 (the
    compute dtype) and in float16. On the F32 file the arms agree to 0.001%; on a quantized
    file each moves perplexity by a few tenths of a percent, the noise that both engines' 8-bit
    activations (before their integer dot products) re-draw at any small change (docs/benchmarks.md,
    "Quantized weights and agreement with llama.cpp");
  - greedy replies to the 10 chat prompts on the same prompt ids, --tokens each (32 is the
    issue's), through llama-server as users run it and again with its K/V in f32: per prompt
    the first divergence (null: all tokens agree) and, where they part, each side's log-prob
    margin between the two tokens there (a margin of a few hundredths of a nat is a near tie
    that any rounding difference flips; a large one would be a bug). engine.bench.agreement
    asks, at each such divergence, which token the fp32 reference on the dequantized weights
    prefers, and what emulating llama.cpp's activation rounding changes.
"""
from __future__ import annotations

import argparse
import statistics

from engine.bench.scenarios import CHAT_PROMPTS, _engine, _progress, chat, held_out_text
from engine.quality.forced import perplexity as _perplexity

AGAINST = ("llama.cpp",)
PPL_TOLERANCE_PCT = 0.5        # issue 40's target: ours within 0.5% of llama-perplexity
# llama.cpp's arms beside its default (K/V f16, flash attention auto: on for the CPU), to say
# what its attention precision costs: the CPU flash-attention kernel rounds Q to f16 and sums
# V·softmax in an f16 accumulator (ggml-cpu ops.cpp, VKQ16); without it, K/V and Q still meet
# in f16 (the f16 cache's vec_dot type); with K/V in f32 and flash attention off, attention is f32.
LLAMA_FA_OFF = ("-fa", "off")
LLAMA_KV_F32 = ("-ctk", "f32", "-ctv", "f32", "-fa", "off")


def add_arguments(ap) -> None:
    ap.add_argument("--against", default=None, choices=AGAINST,
                    help="quality: our engine beside llama.cpp on the same --model GGUF (perplexity by "
                    "llama-perplexity's protocol with n_ctx --window over --eval-tokens, greedy tokens on the same "
                    "prompt ids); scripts/build_llama_server.sh builds its tools")


def bench_quality(args) -> dict:
    from engine import SamplingParams
    if getattr(args, "against", None):
        return bench_against_llama_cpp(args)
    if getattr(args, "compare", None):
        return bench_quality_compare(args)
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


def bench_quality_compare(args) -> dict:
    """--compare: the arms through engine.quality.QualityRun, as the app's Quality tab runs them."""
    from engine.bench.serve import PROFILE_KEY, parse_compare
    from engine.quality import Configuration, QualityRun, pareto_front
    key, values = parse_compare(args.compare)          # before the load: fails fast
    eng = _engine(args, compile=args.compile)
    arms = [Configuration(f"{key}={v}", _profile_settings(v.profile) if key == PROFILE_KEY else {key: v})
            for v in values]
    run = QualityRun(eng, arms, tokens=args.eval_tokens, window=args.window)
    for step in run.steps():
        if step.result is not None:
            _progress(step.message, step.fraction)
    rows = run.results
    return {"model": eng.target_model.display_name, "reference": rows[0]["reference"], "text": rows[0]["text"],
            "window": args.window, "reference_s": run.reference_s, "rows": rows, "pareto_front": [rows[i]["label"] for i in pareto_front(rows)]}


def _profile_settings(profile) -> dict:
    """A profile's engine settings, and the lossy load-time ones it sets away from their defaults."""
    from engine.config import BY_KEY, ENGINE, LOAD
    loads = {k: getattr(profile, k) for k, s in BY_KEY.items()
             if s.section == ENGINE and s.applies == LOAD and s.lossy and getattr(profile, k) != s.default}
    return profile.engine_settings() | loads


# ---- against llama.cpp on the same file -----------------------------------------------------
def bench_against_llama_cpp(args) -> dict:
    import tempfile
    from pathlib import Path
    import torch
    from engine.errors import WorkbenchError
    from engine.remote import llama_tools
    from engine.remote.llama_server import LlamaServer
    from engine.bench.model_flags import model_path
    path = model_path(args)           # --model, or --synthetic's GGUF
    if not path or not str(path).endswith(".gguf"):
        raise WorkbenchError("--against llama.cpp needs --model FILE.gguf or a GGUF --synthetic preset (the file both "
                             "engines load; python -m engine.bench.real_files lists the real ones)")
    model = Path(path).expanduser()
    eng = _engine(argparse.Namespace(**{**vars(args), "model": str(model), "synthetic": None,
                                        "dtype": args.dtype or "float32", "device": args.device or "cpu"}),
                  enable_prefix_caching=False, compile="off")
    threads = torch.get_num_threads()
    n_ctx = args.window
    chunks = max(1, args.eval_tokens // n_ctx)
    text = _eval_text(eng.tokenizer, (chunks + 1) * n_ctx)
    servers = {"llama_cpp": (), "llama_cpp_kv_f32": LLAMA_KV_F32}
    prompts = [eng.encode(chat(p)) for p in CHAT_PROMPTS]
    replies = {}
    with tempfile.TemporaryDirectory() as tmp:
        text_file = Path(tmp) / "eval.txt"
        text_file.write_text(text)
        for name, extra in servers.items():
            with LlamaServer(model, ctx_size=max(n_ctx, 1024), threads=threads, metrics=False, extra=extra) as server:
                if name == "llama_cpp":
                    ids = llama_tools.tokenize(server.url, text)
                    version = server.version()
                    kv_types = server.kv_cache_types()
                replies[name] = [llama_tools.greedy(server.url, p, args.tokens) for p in prompts]
        theirs_ppl = {name: llama_tools.perplexity(model, text_file, n_ctx, chunks, threads=threads, extra=extra)
                      for name, extra in {**servers, "llama_cpp_fa_off": LLAMA_FA_OFF}.items()}
    ours_ppl, ours_chunks = _llama_cpp_protocol_perplexity(eng, ids, n_ctx, chunks)
    eng.reconfigure(kv_cache_dtype="float16")           # llama.cpp's cache dtype, on our side
    ours_kv_f16 = _llama_cpp_protocol_perplexity(eng, ids, n_ctx, chunks)[0]
    eng.reconfigure(kv_cache_dtype="auto")
    ours_ids = eng.tokenizer.encode(text, add_special_tokens=True)
    greedy = _greedy_beside(eng, prompts, replies, args.tokens)
    ref = theirs_ppl["llama_cpp"]
    settings = eng.settings()
    return {
        "model": str(model), "against": "llama.cpp", "llama_cpp": version,
        "ours": {"dtype": settings["dtype"], "weight_dtype": settings["weight_dtype"],
                 "kv_cache_dtype": settings.get("kv_cache_dtype"), "served": _served(eng), "threads": threads},
        "llama_cpp_kv": kv_types,
        "perplexity": {"ours": ours_ppl, "llama_cpp": ref.ppl, "llama_cpp_stderr": ref.stderr,
                       "diff_pct": 100 * (ours_ppl / ref.ppl - 1),
                       "within_tolerance": abs(100 * (ours_ppl / ref.ppl - 1)) <= PPL_TOLERANCE_PCT,
                       "tolerance_pct": PPL_TOLERANCE_PCT,
                       "llama_cpp_fa_off": theirs_ppl["llama_cpp_fa_off"].ppl,
                       "llama_cpp_kv_f32": theirs_ppl["llama_cpp_kv_f32"].ppl,
                       "diff_pct_vs_llama_cpp_kv_f32": 100 * (ours_ppl / theirs_ppl["llama_cpp_kv_f32"].ppl - 1),
                       "ours_kv_float16": ours_kv_f16,
                       "ours_per_chunk": ours_chunks, "llama_cpp_per_chunk": ref.per_chunk,
                       "n_ctx": n_ctx, "chunks": ref.chunks, "scored_tokens": ref.chunks * (n_ctx - n_ctx // 2 - 1),
                       "same_chunks": ref.chunks == chunks and ref.n_ctx == n_ctx,
                       "tokenization_identical": ours_ids[:len(ids)] == ids,
                       "eval_text": "pydoc_data.topics (ships with Python)", "llama_perplexity": " ".join(ref.args)},
        "greedy": greedy,
    }


def _eval_text(tokenizer, tokens: int) -> str:
    """The shortest run of whole paragraphs of held_out_text with at least `tokens` tokens
    (llama-perplexity tokenizes the whole file it is given)."""
    text, out = held_out_text().split("\n\n"), []
    count = 0
    for paragraph in text:
        out.append(paragraph)
        count += len(tokenizer.encode(paragraph, add_special_tokens=False)) + 1
        if count >= tokens * 1.1:
            break
    return "\n\n".join(out)


def _served(eng) -> dict:
    weights = eng.target_model.weights
    return dict(weights.served) if weights is not None and getattr(weights, "served", None) else {}


def protocol_logits(eng, ids: list[int], n_ctx: int, chunks: int):
    """llama-perplexity's protocol on our runner, chunk by chunk: chunk i is ids[i n_ctx : (i+1)
    n_ctx] with its first token made BOS (where the tokenizer adds one), fed whole in pieces of
    256 through the cache. Yields (chunk, the fp32 logits of positions n_ctx/2 .. n_ctx-2
    [n_ctx - 1 - n_ctx/2, V]): the rows llama.cpp scores, each predicting the token after it."""
    import torch
    runner, first = eng.runner, n_ctx // 2
    bos = ids[0] if eng.tokenizer.bos_token_id is not None and ids and ids[0] == eng.tokenizer.bos_token_id else None
    for i in range(chunks):
        chunk = ids[i * n_ctx:(i + 1) * n_ctx]
        fed = ([bos] + chunk[1:]) if bos is not None else chunk
        rows = []
        seq = runner.start(fed)
        try:
            for c in range(0, n_ctx, 256):
                logits = runner.forward(seq, fed[c:c + 256], logits_for="all")      # [piece, V]
                scored = range(max(c, first), min(c + 256, n_ctx - 1))            # positions scored here
                if len(scored):
                    rows.append(logits[scored.start - c:scored.stop - c].float())
        finally:
            runner.end(seq)
        yield chunk, torch.cat(rows)


def _llama_cpp_protocol_perplexity(eng, ids: list[int], n_ctx: int, chunks: int) -> tuple[float, list[float]]:
    """Perplexity by llama-perplexity's protocol (protocol_logits): positions n_ctx/2 .. n_ctx-2
    scored. Returns (ppl, the running estimate after each chunk, as llama-perplexity prints it)."""
    import math
    import torch
    first = n_ctx // 2
    nll, count, running = 0.0, 0, []
    for chunk, rows in protocol_logits(eng, ids, n_ctx, chunks):
        targets = torch.tensor(chunk[first + 1:n_ctx], device=rows.device)
        nll += float(torch.nn.functional.cross_entropy(rows.double(), targets, reduction="sum"))
        count += n_ctx - first - 1
        running.append(math.exp(nll / count))
    return running[-1], running


def _greedy_beside(eng, prompts: list[list[int]], replies: dict, tokens: int) -> dict:
    from engine import SamplingParams
    params = SamplingParams(max_tokens=tokens)         # stops at EOS, as llama-server does
    eos = eng.eos_ids
    ours = [[t for t in eng.generate_text(p, params)[1] if t not in eos] for p in prompts]
    out = {"prompts": len(prompts), "tokens": tokens}
    for name, theirs in replies.items():
        rows = []
        for prompt, mine, reply in zip(prompts, ours, theirs):
            other = [t for t in reply.tokens if t not in eos]
            at = next((i for i, (a, b) in enumerate(zip(mine, other)) if a != b), None)
            if at is None and len(mine) != len(other):
                at = min(len(mine), len(other))          # one stopped (EOS) where the other went on
            row = {"first_divergence": at}
            if at is not None and at < min(len(mine), len(other)):
                row |= _margins(eng, prompt + mine[:at], mine[at], other[at], reply.top_logprobs[at]
                                if at < len(reply.top_logprobs) else [])
            rows.append(row)
        out[name] = {"agree": sum(r["first_divergence"] is None for r in rows),
                     "first_divergence": [r["first_divergence"] for r in rows], "divergences": rows}
    out["ours_text"] = [eng.tokenizer.decode(t) for t in ours]
    return out


def _margins(eng, context: list[int], ours: int, theirs: int, their_top: list[tuple[int, float]]) -> dict:
    """At a divergence: ours and theirs (ids), our log-prob of our token minus that of theirs,
    and theirs the other way round (from llama-server's top 2; None when ours is not in it)."""
    import torch
    runner = eng.runner
    seq = runner.start(context)
    try:
        logp = torch.log_softmax(runner.forward(seq, context, logits_for="last")[-1].double(), -1)
    finally:
        runner.end(seq)
    their = dict(their_top)
    return {"ours": ours, "theirs": theirs, "ours_margin_nats": float(logp[ours] - logp[theirs]),
            "theirs_margin_nats": (their[theirs] - their[ours]) if ours in their and theirs in their else None}
