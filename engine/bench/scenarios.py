"""The scenarios of `python -m engine.bench` that run our engine in this process: parity,
prefix, kv, memory, decode, speculative (the command line and the registry: engine.bench.cli).

Each returns one JSON-able dict (field names are a contract: scripts read them). Timings are
medians; comparisons are ratios measured in the same run, since the machine may be shared
and noisy. Every scenario with a model runs on --model (a HF folder or a .gguf; default: the
embedded model) or --synthetic (engine.bench.model_flags), with --draft, --device and --dtype
where given.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from engine.bench.model_flags import model_path
from engine.metrics import combined, speculation_report
from engine.quality.forced import perplexity
# The prompt sets are the serving workload's (engine.workload), shared with the app's load panel.
from engine.workload import CHAT_PROMPTS, PASSAGE, REPEAT_PROMPTS, chat, held_out_text  # noqa: F401
from engine.workload import edit_chat
from engine.workload import system_prompt_of as _system_prompt

# bench speculative's prompts per set (messages), each served once per arm
LONG_CHAT_CONTEXT = 1024       # bench decode's verify cost at a long chat's context too
SPECULATIVE_PROMPTS = {"chat": [chat(p) for p in CHAT_PROMPTS[:8]], "repeat": [chat(p) for p in REPEAT_PROMPTS],
                       "edit": [edit_chat(i) for i in range(8)]}

PREFIX_COMPARED_TOKENS = 16     # bench prefix: greedy tokens a hit must share with a cold run

# Where transformers' copy of the model shares the device (parity, decode), the engine's pool
# is this fixed budget rather than what the memory plan would give it (most of a GPU).
HF_BESIDE_POOL_BYTES = 512 * 2**20

BUILTIN_SHAPES = {   # (layers, attention heads, kv heads, head_dim)
    "llama-2-7b": (32, 32, 32, 128),
    "llama-2-7b-gqa8": (32, 32, 8, 128),
}


def _engine(args, **config):
    """The scenario's engine on --model (or --synthetic's checkpoint, written once to the user
    cache); --device, --dtype and --weight-dtype, when given, win over the scenario's own choice."""
    from engine import EngineConfig, LLMEngine
    given = (("device", args.device), ("dtype", args.dtype), ("weight_dtype", getattr(args, "weight_dtype", None)))
    config.update({key: value for key, value in given if value})
    return LLMEngine.load(model_path(args), EngineConfig(**config), progress=_progress)


def _progress(message: str, fraction: float) -> None:
    print(f"[{fraction:4.0%}] {message}", file=sys.stderr)


def _hf_model(eng, dtype: torch.dtype | None = None):
    """transformers' model on the engine's folder and device, in the engine's dtype unless
    told: the reference."""
    from engine.loading.loader import transformers_model
    hf = transformers_model(eng.target_model.folder, dtype=dtype or eng.runner.model_dtype).eval()
    hf = hf.to(eng.device)
    hf.generation_config.eos_token_id = None      # compare fixed-length continuations
    hf.generation_config.pad_token_id = 0
    return hf


# ---- parity --------------------------------------------------------------------
def bench_parity(args) -> dict:
    from engine import SamplingParams
    # transformers reads a GGUF dequantized: so do we, unless --weight-dtype says otherwise
    eng = _engine(args, dtype="float32", device="cpu", kv_cache_bytes=HF_BESIDE_POOL_BYTES, compile=args.compile,
                  weight_dtype="float")
    hf = _hf_model(eng)
    prompts, tokens = CHAT_PROMPTS[:args.prompts], args.tokens
    identical, max_diff = True, 0.0
    for text in prompts:
        ids = eng.encode(chat(text))
        _, ours, _ = eng.generate_text(ids, SamplingParams(max_tokens=tokens, stop_on_eos=False))
        with torch.inference_mode():
            out = hf.generate(torch.tensor([ids], device=eng.device), max_new_tokens=tokens, do_sample=False,
                              output_logits=True, return_dict_in_generate=True)
        theirs = out.sequences[0, len(ids):].tolist()
        identical &= ours == theirs
        max_diff = max(max_diff, _teacher_forced_diff(eng, ids, theirs, torch.cat(out.logits)))
    return {"model": eng.target_model.display_name, "device": str(eng.device), "dtype": _dtype(eng),
            "prompts": len(prompts), "tokens_per_prompt": tokens, "greedy_identical": identical,
            "max_abs_logit_diff": max_diff, "compile": eng.settings()["compile"]}


def _dtype(eng) -> str:
    return str(eng.runner.model_dtype).removeprefix("torch.")


def _teacher_forced_diff(eng, prompt_ids, continuation, hf_logits) -> float:
    """Our logits at every generated position, fed the reference tokens, vs transformers'."""
    runner = eng.runner
    seq = runner.start(prompt_ids)
    try:
        ours = [runner.forward(seq, prompt_ids[seq.num_computed:])]
        for t in continuation[:-1]:
            ours.append(runner.forward(seq, [t]))
    finally:
        runner.end(seq)
    return float((torch.cat(ours) - hf_logits.float().to(eng.device)).abs().max())


# ---- prefix caching --------------------------------------------------------------
def bench_prefix(args) -> dict:
    """TTFT with the system prompt's blocks cold (the prefix cache reset) and warm (a hit), and
    that a hit gives the cold run's tokens (PREFIX_COMPARED_TOKENS greedy); then the same system
    prompt with another question (`other_question`: a hit ending inside it). For a hybrid model a
    hit restores the linear layers' state saved at its last block boundary: what a hit saves is
    the prefill of the hit tokens (`prefill_tokens_cold` - `prefill_tokens_warm`), and
    `prefix_recomputed_tokens` counts cached tokens recomputed for want of a state snapshot."""
    from engine import SamplingParams
    eng = _engine(args, enable_prefix_caching=True)
    system = _system_prompt(eng.tokenizer, args.system_tokens)
    msgs = chat("Summarise the rules above in one sentence.", system=system)
    one = SamplingParams(max_tokens=1)
    prompt_tokens = len(eng.encode(msgs))
    system_tokens = len(eng.tokenizer.encode(system, add_special_tokens=False))

    def cold():
        eng.reset_prefix_cache()
        return eng.generate_text(msgs, one)[2].ttft_s

    def warm():
        stats = eng.generate_text(msgs, one)[2]
        warm.hit, warm.recomputed = stats.prefix_hit_tokens, stats.prefix_recomputed_tokens
        return stats.ttft_s

    eng.generate_text(msgs, one)      # warm up the allocator and kernels
    cold_ms = [cold() * 1e3 for _ in range(args.repeats)]
    eng.generate_text(msgs, one)
    warm_ms = [warm() * 1e3 for _ in range(args.repeats)]
    a, b = statistics.median(cold_ms), statistics.median(warm_ms)
    compare = SamplingParams(max_tokens=PREFIX_COMPARED_TOKENS, stop_on_eos=False)
    eng.reset_prefix_cache()
    cold_reply = eng.generate_text(msgs, compare)[1]
    warm_reply, warm_stats = eng.generate_text(msgs, compare)[1:]
    # the same system prompt, another question: the hit ends inside the system prompt's blocks
    other = eng.generate_text(chat("List three of the rules above.", system=system), one)[2]
    snapshots = eng.runner.snapshots
    return {"model": eng.target_model.display_name, "dtype": _dtype(eng), "compile": eng.settings()["compile"],
            "prompt_tokens": prompt_tokens, "system_prompt_tokens": system_tokens,
            "ttft_cold_ms": a, "ttft_warm_ms": b, "ttft_reduction": 1 - b / a, "hit_tokens": warm.hit,
            "hit_fraction_of_system_prompt": warm.hit / system_tokens, "repeats": args.repeats,
            "prefill_tokens_cold": prompt_tokens, "prefill_tokens_warm": prompt_tokens - warm.hit,
            "prefix_recomputed_tokens": warm.recomputed,
            "hit_tokens_identical": warm_reply == cold_reply and warm_stats.prefix_hit_tokens == warm.hit,
            "compared_tokens": len(cold_reply),
            "other_question": {"prompt_tokens": other.prompt_tokens, "hit_tokens": other.prefix_hit_tokens,
                               "prefix_recomputed_tokens": other.prefix_recomputed_tokens,
                               "ttft_ms": other.ttft_s * 1e3},
            "state_snapshots": None if snapshots is None else {
                "kept": snapshots.num_saved, "max": snapshots.num_snapshots, "bytes_held": snapshots.bytes_held(),
                "bytes_per_snapshot": snapshots.bytes_per_snapshot},
            "prefix_caching": eng.runner.prefix_state}


# ---- KV cache: bytes and perplexity ----------------------------------------------
def bench_kv(args) -> dict:
    from engine import EngineConfig
    from engine.cache.kv_cache import FP8_DTYPE
    from engine.runtime.model_runner import ModelRunner
    # the weights as stored, dequantized (the cache's loss alone); runners below hold the caches
    eng = _engine(args, dtype="float32", device="cpu", num_blocks=1, weight_dtype="float")
    ids = eng.tokenizer.encode(held_out_text(), add_special_tokens=False)[:args.eval_tokens + 1]
    shape = eng.runner.kv.shape
    result = {"model": eng.target_model.display_name, "model_dtype_name": _dtype(eng), "device": str(eng.device),
              "bytes_per_token": {"model_dtype": shape.bytes_per_token(eng.runner.model_dtype),
                                  "bfloat16": shape.bytes_per_token(torch.bfloat16),
                                  "fp8_e4m3": shape.bytes_per_token(FP8_DTYPE)},
              "scale_bytes_per_token": shape.scale_bytes_per_token(FP8_DTYPE),
              "scale_scheme": "one float32 scale per (token, KV head)"}
    ppl = {}
    for name in ("auto", "bfloat16", "fp8_e4m3", "fp8_e4m3_hadamard"):
        runner = ModelRunner(eng.target_model, EngineConfig(kv_cache_dtype=name, num_blocks=args.window // 16 + 2),
                             eng.device)
        ppl[name] = perplexity(runner, ids, args.window)
    result.update({"ppl_model_dtype": ppl["auto"], "ppl_bf16": ppl["bfloat16"], "ppl_fp8": ppl["fp8_e4m3"],
                   "ppl_increase_pct": 100 * (ppl["fp8_e4m3"] / ppl["auto"] - 1),
                   "ppl_increase_pct_vs_bf16": 100 * (ppl["fp8_e4m3"] / ppl["bfloat16"] - 1),
                   "ppl_by_kv_dtype": ppl,
                   "ppl_increase_pct_by_kv_dtype": {name: 100 * (value / ppl["auto"] - 1) for name, value in ppl.items()
                                                    if name != "auto"},
                   "eval_tokens": len(ids) - 1, "window": args.window,
                   "eval_text": "pydoc_data.topics (ships with Python)"})
    return result


# ---- analytic memory ---------------------------------------------------------------
def bench_memory(args) -> dict:
    """Bytes per sequence from a config's shapes (analytic; --config, else the model's); for a
    config we can build (a folder, a .gguf, 'default' or a synthetic preset such as
    qwen3-30b-a3b or qwen3-14b-q4_k_m), what the model needs on a GPU card
    (engine.bench.model_memory; a GGUF's weights as stored on CUDA among its rows); and the
    memory plan of --model or --synthetic (with --draft) on --device as the engine makes it.
    --device cuda where there is no CUDA device: the plan is not made, and says so
    (`plan_not_made`)."""
    from engine.bench.model_memory import model_memory
    named = model_path(args)          # --model, or --synthetic's checkpoint
    config = named if args.config == "default" and named else args.config
    result = cache_bytes(config, args.context)
    hf_config = _config_for(config)
    if hf_config is not None:
        result["model"] = model_memory(hf_config, args.context, *_gguf_tensors(config))
    if args.device and torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        return result | {"plan": plan_not_made(named, args.device)}
    eng = _engine(args)
    if args.draft:
        eng.set_draft_model(args.draft, progress=_progress)
    return result | {"plan": {"model": eng.target_model.display_name, "draft": eng.draft_name, **eng.plan.as_dict()}}


def plan_not_made(named: str | None, device: str) -> dict:
    """The `plan` of bench memory on a machine without the CUDA device asked for: said plainly,
    with the weights a CUDA load of a GGUF would hold (its gguf_as_stored row) in its place."""
    from engine.bench.model_memory import as_stored_on_cuda, gguf_file_tensors
    out = {"made": False, "model": named or "default",
           "why": f"not planned: no CUDA device here (torch.cuda.is_available() is False), and the engine's "
                  f"memory plan for --device {device} is made on the device; run it where CUDA is to get it"}
    path = _gguf_path(named or "default")
    if path is None:
        return out | {"weights_on_cuda": "not counted here: a float checkpoint's weights are the model section's "
                                         "bf16 row"}
    stored = as_stored_on_cuda(gguf_file_tensors(path), path.stat().st_size)
    return out | {"weights_on_cuda": "the GGUF's weights as stored (the model section's gguf_as_stored row)",
                  "weights_bytes": stored["bytes"], "file_bytes": stored["file_bytes"],
                  "weights_to_file": stored["weights_to_file"],
                  "human": {"weights": stored["human"]["bytes"], "file": stored["human"]["file_bytes"]}}


def _gguf_path(config: str):
    """The GGUF file a config names (a .gguf path, or 'default': the embedded model's); None
    for any other."""
    from pathlib import Path

    from engine.loading.loader import default_gguf_path
    if config == "default":
        return default_gguf_path()
    path = Path(config).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


def _gguf_tensors(config: str) -> tuple:
    """(the GGUF's tensors, the file's size) of a config that names one (a .gguf, 'default', a
    synthetic GGUF preset: its planned tensors, no size); (None, None) for any other."""
    from engine.bench.model_memory import gguf_file_tensors, gguf_preset_tensors
    from engine.bench.model_flags import is_gguf_preset
    if is_gguf_preset(config):
        return gguf_preset_tensors(config), None
    path = _gguf_path(config)
    return (gguf_file_tensors(path), path.stat().st_size) if path else (None, None)


def cache_bytes(config: str, context: int) -> dict:
    from engine.cache.kv_cache import FP8_DTYPE, CacheShape, KVCache
    layers, heads, kv_heads, head_dim, name = _shape_for(config)
    gqa_heads = kv_heads if kv_heads < heads else 8
    per_seq, allocation_matches = {}, True
    for label, h in (("mha", heads), (f"gqa{gqa_heads}", gqa_heads)):
        shape = CacheShape(layers, h, head_dim)
        for dtype_label, dtype in (("fp16", torch.float16), ("fp8_e4m3", FP8_DTYPE)):
            # Checked against a real allocation (on the meta device: no memory is used).
            blocks = -(-context // 16)
            allocated = KVCache(shape, blocks, 16, dtype, torch.device("meta")).bytes_allocated
            per_token = shape.bytes_per_token(dtype) + shape.scale_bytes_per_token(dtype)
            allocation_matches &= allocated == blocks * 16 * per_token
            per_seq[f"{label}_{dtype_label}"] = shape.bytes_per_token(dtype) * context
            per_seq[f"{label}_{dtype_label}_scales"] = shape.scale_bytes_per_token(dtype) * context
    gqa = f"gqa{gqa_heads}"
    return {"config": name, "context": context, "num_layers": layers, "num_attention_heads": heads,
            "num_kv_heads": kv_heads, "head_dim": head_dim, "bytes_per_sequence": per_seq,
            "human": {k: _human(v) for k, v in per_seq.items() if not k.endswith("_scales")},
            "gqa_reduction": per_seq["mha_fp16"] / per_seq[f"{gqa}_fp16"],
            "fp8_reduction": per_seq[f"{gqa}_fp16"] / per_seq[f"{gqa}_fp8_e4m3"],
            "fp8_reduction_with_scales": per_seq[f"{gqa}_fp16"] / (per_seq[f"{gqa}_fp8_e4m3"]
                                                                  + per_seq[f"{gqa}_fp8_e4m3_scales"]),
            "allocation_matches": allocation_matches}


def _shape_for(config: str):
    if config in BUILTIN_SHAPES:
        return (*BUILTIN_SHAPES[config], config)
    cfg = _config_for(config)
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    # a hybrid model's linear-attention layers hold a fixed state, not KV (the `model` section's
    # `state` counts it)
    layer_types = getattr(cfg, "layer_types", None) or []
    layers = cfg.num_hidden_layers - sum(kind == "linear_attention" for kind in layer_types)
    return layers, heads, getattr(cfg, "num_key_value_heads", heads) or heads, head_dim, config


def _config_for(config: str):
    """The transformers config of a config.json folder, a .gguf, 'default', or a synthetic
    preset (its released model's shapes; a GGUF preset's: its float preset's); None for a
    built-in shape, which has no config."""
    from engine.loading.synthetic import PRESETS, make_config
    from engine.loading.synthetic_gguf import SYNTHETIC_GGUF_PRESETS
    if config in BUILTIN_SHAPES:
        return None
    if config in PRESETS:
        return make_config(config)
    if config in SYNTHETIC_GGUF_PRESETS:
        return make_config(SYNTHETIC_GGUF_PRESETS[config][0])
    from engine.loading.loader import load_config, resolve
    return load_config(resolve(None if config == "default" else config))


def _human(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"


# ---- decode speed ------------------------------------------------------------------
def bench_decode(args) -> dict:
    """Ours (at --dtype, --compile; and at the other of fp32 / bf16) against transformers
    `generate` in fp32 (its CPU default), the same threads, interleaved; plus the roofline
    fraction, the verify costs (at 64 tokens of context, and by context: at the timed chat's
    prompt plus half its tokens, and at LONG_CHAT_CONTEXT) and the CPU dtype probe's timings."""
    from engine import SamplingParams
    from engine.runtime import cpu_dtype
    from engine.speculative.step_costs import read_bandwidths, tree_verify_costs, verify_costs, weight_bytes_per_token
    eng = _engine(args, enable_prefix_caching=False, kv_cache_bytes=HF_BESIDE_POOL_BYTES, compile=args.compile)
    baseline = _hf_model(eng, torch.float32)
    same_dtype = _hf_model(eng) if eng.runner.model_dtype != torch.float32 else None
    # Ours at the other weight dtype too (fp32 <-> bf16, its own `compile` choice), so the
    # dtype that `auto` picks is checked against what the engine really does.
    other_name = "float32" if eng.runner.model_dtype != torch.float32 else "bfloat16"
    other = _engine(argparse.Namespace(**{**vars(args), "dtype": other_name}), enable_prefix_caching=False,
                    kv_cache_bytes=HF_BESIDE_POOL_BYTES, compile=args.compile)
    # Quantized weights: the same model with its weights dequantized to bf16, beside
    quantized = eng.target_model.weights is not None and eng.target_model.weights.quantized > 0
    bf16 = (_engine(argparse.Namespace(**{**vars(args), "dtype": "bfloat16", "weight_dtype": "float"}),
                    enable_prefix_caching=False, kv_cache_bytes=HF_BESIDE_POOL_BYTES, compile=args.compile)
            if quantized else None)
    ids = eng.encode(chat(CHAT_PROMPTS[1]))
    n = args.tokens

    def ours(tokens, engine=eng):
        t0 = time.perf_counter()
        engine.generate_text(ids, SamplingParams(max_tokens=tokens, stop_on_eos=False))
        return time.perf_counter() - t0

    def theirs(hf, tokens):
        t0 = time.perf_counter()
        with torch.inference_mode():
            hf.generate(torch.tensor([ids], device=eng.device), max_new_tokens=tokens, min_new_tokens=tokens,
                        do_sample=False)
        return time.perf_counter() - t0

    def per_token(fn):            # decode time = time(n) - time(1): TTFT excluded, for both alike
        return (fn(n) - fn(1)) / (n - 1)

    # The roofline divides by the best of the reads before and after the timings (their spread is
    # reported: on a shared machine the same read moves with the neighbours)
    reads = read_bandwidths()
    ours(4), ours(4, other), theirs(baseline, 4)       # warm-up (and compile, if on)
    if bf16 is not None:
        ours(4, bf16)
    runs = {"ours": [], "ours_other_dtype": [], "hf": [], "hf_same_dtype": [], "bf16": []}
    for _ in range(args.repeats):                      # interleaved, so drift hits all alike
        runs["ours"].append(per_token(ours))
        runs["ours_other_dtype"].append(per_token(lambda t: ours(t, other)))
        if bf16 is not None:
            runs["bf16"].append(per_token(lambda t: ours(t, bf16)))
        runs["hf"].append(per_token(lambda t: theirs(baseline, t)))
        if same_dtype is not None:
            runs["hf_same_dtype"].append(per_token(lambda t: theirs(same_dtype, t)))
    tok_s = {name: 1 / statistics.median(times) for name, times in runs.items() if times}
    weight_bytes = weight_bytes_per_token(eng.target_model.model)
    reads += read_bandwidths()
    bandwidth = max(reads)
    compiled = eng.runner.compiled
    return {"ours_tok_s": tok_s["ours"], "hf_tok_s": tok_s["hf"], "ratio": tok_s["ours"] / tok_s["hf"],
            "ratio_same_dtype": tok_s["ours"] / tok_s.get("hf_same_dtype", tok_s["hf"]),
            "roofline_fraction": weight_bytes * tok_s["ours"] / bandwidth,
            "weight_bytes_per_token": weight_bytes, "read_bandwidth_best_gb_s": bandwidth / 1e9,
            "read_bandwidth_reads_gb_s": [round(r / 1e9, 2) for r in reads],
            "verify_cost": verify_costs(eng.runner), "tree_verify_cost": tree_verify_costs(eng.runner),
            # where a chat's drafts are verified: its prompt and half its reply; and a longer chat
            "verify_cost_by_context": {str(c): verify_costs(eng.runner, context=c)
                                       for c in (len(ids) + n // 2, LONG_CHAT_CONTEXT)},
            "compile": eng.settings()["compile"],
            "other_dtype": {"dtype": other_name, "ours_tok_s": tok_s["ours_other_dtype"],
                            "compile": other.settings()["compile"]},
            "dtype_probe_s": cpu_dtype.measure() if eng.device.type == "cpu" else None,
            "dtype_auto": _dtype_auto(args, eng),
            "compile_s": compiled.graph.compile_s if compiled else None,      # the model's graph, once
            "tokens": n, "repeats": args.repeats, "threads": torch.get_num_threads(),
            "device": str(eng.device), "dtype": _dtype(eng), "baseline": "transformers generate, float32",
            "weight_dtype": eng.settings()["weight_dtype"],
            "bf16_tok_s": tok_s.get("bf16"),
            "speedup_vs_bf16": tok_s["ours"] / tok_s["bf16"] if "bf16" in tok_s else None}


def _dtype_auto(args, eng) -> dict | None:
    """What `dtype auto` weighs on the CPU for this model (engine.engine.pick_dtype): each
    dtype's decode step as its trial timed it (seconds, or why it was skipped; null until a
    load with dtype auto has met this model format on this CPU) and the dtype it picks. The
    float linear's figures are `dtype_probe_s`."""
    if eng.device.type != "cpu":
        return None
    from engine.loading.loader import cache_dir
    from engine.runtime.cpu_dtype import STEP_DTYPE_CACHE, dtype_name, known_steps, model_format, step_choice
    fmt = model_format(model_path(args), eng.config)
    steps = known_steps(cache_dir() / STEP_DTYPE_CACHE, fmt, eng.thread_governor.most)
    return {"picks": dtype_name(step_choice(steps).dtype) if steps else None, "step_s": steps, "model_format": fmt}


# ---- speculative decoding ------------------------------------------------------------
def bench_speculative(args) -> dict:
    """Plain decoding and speculation on the same prompts in one run (each warmed up first), the
    timed arms in the order plain, speculative, speculative, plain, so that a machine speeding
    up or slowing down over the run weighs on both alike (one plain arm before one speculative
    arm read 0.93x to 1.06x where nothing was drafted); each side's figures are its two arms
    together. The chat prompts are held out from the EAGLE head's training
    (engine.training.distill_data). Honest arms: each arm serves every prompt once, and starts
    with the suffix proposer's global index empty (the warm-up's replies are forgotten)."""
    from engine import SamplingParams
    from engine.errors import WorkbenchError
    eng = _engine(args, enable_prefix_caching=False, compile=args.compile, speculation_policy=args.speculation_policy)
    prompt_set = args.prompts_set or ("repeat" if args.proposer == "ngram" else "chat")
    if prompt_set not in SPECULATIVE_PROMPTS:
        raise WorkbenchError(f"--prompt-set {prompt_set} is for serve; speculative takes "
                             f"{', '.join(SPECULATIVE_PROMPTS)}")
    prompts = SPECULATIVE_PROMPTS[prompt_set]
    params = SamplingParams(max_tokens=args.tokens)
    if args.proposer == "draft":
        draft = args.draft or "self:8"
        eng.set_draft_model(draft, progress=_progress)
    elif args.proposer == "eagle":
        draft = args.draft or "the shipped EAGLE head"
        eng.reconfigure(proposer="eagle", eagle_head=args.draft)
    elif args.proposer == "suffix":
        draft = "suffix decoding (the request's own text and earlier replies)"
    elif args.proposer == "auto":
        if args.draft:
            eng.set_draft_model(args.draft, progress=_progress)
        draft = "auto: each step the proposer with the best measured payoff (engine.speculative.proposer_choice)"
    else:
        draft = "n-gram prompt lookup"
    encoded = [eng.encode(p) for p in prompts]

    def run(proposer):
        eng.reconfigure(proposer=proposer, num_speculative_tokens=args.k, draft_tree=args.tree)
        eng.speculator.suffix_cache.clear()
        eng.speculator.proposer_choice.clear()                  # auto measures its candidates again in each arm
        outs, stats = [], []
        for ids in encoded:
            _, out, s = eng.generate_text(ids, params)
            outs.append(out)
            stats.append(s)
        return outs, stats

    run("off"), run(args.proposer)                   # warm-up (and compile, if on) both paths
    base_out, base_first = run("off")
    forecast = eng.speculator.forecast()             # what the plain arm's shadow drafts predicted
    spec_out, spec_first = run(args.proposer)
    spec_again, spec_second = run(args.proposer)
    # the proposers' own counters, of the second speculative arm (the plain arm after it clears them)
    counters = {**_suffix_figures(eng, args.proposer), **_auto_figures(eng, args.proposer)}
    base_again, base_second = run("off")
    base, spec = combined(base_first + base_second), combined(spec_first + spec_second)
    plain_step_s = base.decode_time_s / base.target_passes
    # None when the timed arm drafted nothing (an adaptive policy that found speculation losing
    # here): the figures that need drafted tokens are null, and `drafted` says so
    report = speculation_report(spec.as_dict(), args.k, plain_step_s, "this run") or {}
    return {"drafted": spec.proposed, "speculation_policy": eng.config.speculation_policy,
            "k": args.k, "proposer": args.proposer, "draft": draft,
            "prompt_set": prompt_set, "prompts": len(prompts), "acceptance_rate": spec.acceptance_rate,
            "mean_accepted_len": spec.mean_accepted_len, "alpha_per_attempted_token": report.get("alpha"),
            "per_position": spec.per_position,
            "baseline_tok_s": base.decode_tok_s, "spec_tok_s": spec.decode_tok_s,
            "speedup": spec.decode_tok_s / base.decode_tok_s,
            # The i.i.d. model with the measured costs, each relative to a plain decode step.
            "predicted_speedup": report.get("predicted_speedup"), "break_even_alpha": report.get("break_even_alpha"),
            "draft_target_cost_ratio": report.get("draft_cost"), "verify_vs_decode_step": report.get("verify_cost"),
            "step_vs_decode_step": report.get("step_cost"), "step_other_vs_decode_step": report.get("step_other_cost"),
            "proposal_ms_per_step": 1e3 * spec.draft_time_s / spec.target_passes if spec.target_passes else None,
            "dtype": _dtype(eng), "compile": eng.settings()["compile"], "threads": torch.get_num_threads(),
            "greedy_identical": spec_out == base_out == spec_again == base_again, "drafted_by": spec.drafted_by,
            "arms": "plain, speculative, speculative, plain: counts are of both arms of a side; the suffix and "
                    "auto counters of the second speculative arm",
            "forecast_by_plain_arm": forecast, **_tree_figures(spec, plain_step_s, eng), **counters,
            "ceiling": _ceiling_figures(encoded, base_out, args.k, spec, plain_step_s, report.get("verify_cost"),
                                        report.get("step_other_cost"))}


def _ceiling_figures(prompts, replies, k: int, spec, plain_step_s: float, verify_cost, other_cost) -> dict:
    """What any draft taken from earlier text (the request's own, or earlier replies) could
    reach on these replies at most k tokens a pass (engine.speculative.suffix_ceiling): tokens per
    pass, and the speedup that bounds at this arm's measured cost of a drafting pass (a tree
    step's, else the chain's verify; never under a plain step). `speedup_at_step_cost` adds the
    rest of a speculative step's measured work (scheduling, verifying, events: the report's
    step_other_cost), which the oracle's steps would pay too: what a run drafting as the oracle
    does would measure on this engine, so that measured / it is the drafts' share alone."""
    from engine.speculative.suffix_ceiling import ceiling
    c = ceiling(prompts, replies, k)
    pass_cost = spec.tree_time_s / spec.tree_steps / plain_step_s if spec.tree_steps else verify_cost or 1.0
    pass_cost = max(pass_cost, 1.0)
    step_cost = pass_cost + (other_cost or 0.0)
    return c | {"pass_cost": pass_cost, "speedup": c["tokens_per_pass"] / pass_cost if c["passes"] else None,
                "step_cost": step_cost, "speedup_at_step_cost": c["tokens_per_pass"] / step_cost if c["passes"] else None}


def _auto_figures(eng, proposer: str) -> dict:
    """proposer auto: each candidate's counters over the timed arm (sequence-steps it drafted
    for, verified and accepted draft tokens, drafting time), the last choice and why, and what
    it left out."""
    if proposer != "auto":
        return {}
    return {"auto": eng.speculator.describe_choice()}


def _suffix_figures(eng, proposer: str) -> dict:
    """The suffix proposer's draft tokens by source (the request's own text, or the global index
    of earlier replies in this arm), drafted and accepted, and its settings."""
    if proposer not in ("suffix", "auto"):
        return {}
    c = eng.config
    return {"suffix": eng.speculator.suffix_cache.counters() | {
        "spec_factor": c.suffix_spec_factor, "min_prob": c.suffix_min_prob, "cache_tokens": c.suffix_cache_tokens}}


def _tree_figures(spec, plain_step_s: float, eng) -> dict:
    """With a draft tree: what the trees were, and the speedup the draft's own confidences
    predict (1 + predicted accepted nodes per tree, over the measured cost of a tree step:
    drafting plus the verify pass, relative to a plain step) next to the measured one."""
    tree = eng.settings()["draft_tree"]
    if not spec.tree_steps:
        return {"tree": tree}
    step_cost = spec.tree_time_s / spec.tree_steps / plain_step_s
    predicted_tau = 1 + spec.tree_predicted / spec.tree_steps
    return {"tree": tree, "tree_steps": spec.tree_steps, "plain_steps": spec.target_passes - spec.tree_steps,
            "tree_nodes_mean": spec.tree_nodes / spec.tree_steps,
            "tree_predicted_tau": predicted_tau,
            "tree_accepted_per_tree": spec.accepted / spec.tree_steps,
            "tree_step_cost": step_cost, "tree_predicted_speedup": predicted_tau / step_cost}
