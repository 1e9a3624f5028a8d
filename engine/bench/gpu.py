"""`python -m engine.bench gpu-check [--out FOLDER] [--dry-run] --json`: what the issues ask of
a GPU, in one command (at most about 8 minutes on an H200 before the linears section, which adds
2 to 3 on a fresh machine: estimates, not yet timed), for the day a device is lent;
scripts/gpu_check.sh runs it there in one call (../shared/tools/gpu/README.md).

For each model, the one named (--model / --synthetic; default: the embedded model) and a
random-weight model of Llama-3.2-3B's shape (LLAMA_3_2_3B, written once to the user cache), on
the engine as it loads by default (bf16 unless --dtype; --compile, the attention path and the KV
dtype as `auto` picks them), no speculation, greedy:
- decode: decode tok/s (after every request's first token) at 1, 4 and 16 users, each level's
  ratio to one user, and how many requests got the tokens their prompt gets alone;
- step: host ms per decode step at one user (wall time of engine.step) and GPU ms (the time of
  the kernels it launched, from the torch profiler);
- roofline_fraction: the weight bytes a step reads x one user's tok/s / the bandwidth measured in
  the same run (CUDA: the kernel bench's device copy, reads + writes; CPU: a large read);
- verify_cost: the time of a (k+1)-row pass / a 1-row pass, k = 1, 2, 4, 8;
- long_context: one decode pass at 32k tokens of context (or the most the model takes), over a
  pool in the model's dtype and over an FP8 E4M3 pool: ms per pass and KV bytes per token;
- parity (the named model; random weights make it meaningless, and it says so): the greedy
  tokens against transformers' generate in the same dtype, and transformers' decode tok/s.
Before the models (CUDA): the decode-attention kernel bench (engine.bench.kernels, with the copy
bandwidth) and the batched decode kernel's check: 8 sequences of mixed lengths, each one's output
alone bitwise equal to its row in the batch, and the batch against the torch reference.
After them, linears: the GPU kernels on GGUF weights as stored (engine.kernels.gpu_quant), for the
qwen3-1.7b-q4_k_m and qwen3-8b-q4_k_m files, each part a section of its own under linears[FILE]:
- kernel: one pass of gpu_quant.linear over every linear of the file (each layer's seven, then
  the head) at 1, 4 and 16 rows of bf16 activations, replayed as a CUDA graph (median of 10):
  GB/s of stored bytes and its fraction of the copy bandwidth. The shapes and types are those
  engine.loading.synthetic_gguf's Q4_K_M recipe writes the file with (so no file is read), the
  blocks random: the time depends on the bytes and the shapes, not the values;
- decode: one user's decode tok/s through the engine loading the file (as decode measures it).
  The check writes the 1.7B to the user cache where it is not there (1.1 GB, about 45 s); the
  8B's 5 GB take about 3.5 minutes, so it is decoded only where already cached (`skipped` says so);
- llama_server: the same through llama-server's CUDA build (every layer on the GPU) where one is
  found ($WORKBENCH_LLAMA_SERVER or scripts/build_llama_server.sh's folder, and its
  --list-devices names a CUDA device); else `not_run` says why. gpu-check builds nothing.
Estimates for a fresh machine: the kernel parts about 15 s a file, the 1.7B's write 45 s and its
load and compile about a minute, llama-server (not built for CUDA) nothing; the 8B, when cached,
about 2 minutes more.

A section that fails records {"error": ...} and the next runs. Results: one JSON object printed,
and with --out FOLDER, FOLDER/gpu_check.json, written again after every section (a run cut short
keeps what it measured), with each section's seconds under "seconds".

--dry-run: the whole script at sizes that take seconds (tests run it on the CPU so it does not
rot; on a GPU it is a first look before the full run): the tiny synthetic preset for both models
(unless --model / --synthetic names the first), few tokens, short contexts; linears on a tiny
Q4_K_M recipe's two weights cut to 64 x 256 (Q4_K, Q6_K), one timed pass (on the CPU in the
Triton interpreter, TRITON_INTERPRET=1 before triton is imported; without it `kernel` says why
it skipped), decoding the named model. Without CUDA and without --dry-run it says so and exits 0.
"""
from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.bench.load import shape_checkpoint
from engine.errors import first_line
from engine.metrics import ratio

PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.", "List three primes.")
# Llama-3.2-3B's config.json (its vocabulary too: the default model's tokenizer covers the ids it reads)
LLAMA_3_2_3B = {"preset": "llama-3.2-1b", "hidden_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 24,
                "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 8192}
TINY_SHAPE = {"preset": "tiny", "num_hidden_layers": 3}     # --dry-run's stand-in, written the same way
LINEAR_ROWS = (1, 4, 16)
# --dry-run's linears: tiny's layers widened to whole super-blocks, so Q4_K_M gives Q4_K and Q6_K as it does the files
TINY_GGUF = {"preset": "tiny", "hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 64}
GGUF_RECIPES = {"tiny-q4_k_m": (TINY_GGUF, "Q4_K_M")}      # beside engine.loading.synthetic_gguf's presets
# files gpu-check writes when the cache lacks them: the 1.7B's 1.1 GB take about 45 s; the 8B's 5 GB about
# 3.5 minutes, more than the check has to spare, so its decode runs only where the file is already cached
WRITTEN_BY_THE_CHECK = ("qwen3-1.7b-q4_k_m",)


@dataclass(frozen=True)
class Sizes:
    tokens: int                 # generated per request
    users: tuple[int, ...]
    ks: tuple[int, ...]         # verify_cost's draft lengths
    long_context: int
    profiled_steps: int
    repeats: int                # timed passes per figure (medians)
    linear_files: tuple[str, ...]           # the linears section's GGUF presets
    linear_repeats: int                     # its timed passes at each row count
    linear_cap: tuple[int, int] | None      # its weights cut to at most [out, in], each distinct one once


FULL = Sizes(tokens=64, users=(1, 4, 16), ks=(1, 2, 4, 8), long_context=32768, profiled_steps=16, repeats=7,
             linear_files=("qwen3-1.7b-q4_k_m", "qwen3-8b-q4_k_m"), linear_repeats=10, linear_cap=None)
DRY = Sizes(tokens=4, users=(1, 4, 16), ks=(1, 2, 4, 8), long_context=96, profiled_steps=2, repeats=2,
            linear_files=("tiny-q4_k_m",), linear_repeats=1, linear_cap=(64, 256))


def bench_gpu_check(args) -> dict:
    dry = getattr(args, "dry_run", False)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() or not dry else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        return {"cuda": False, "message": "no CUDA on this machine: the GPU checks did not run (--dry-run --device "
                                          "cpu runs the script at tiny sizes on the CPU)"}
    if device.type != "cuda" and not dry:
        return {"cuda": False, "message": f"gpu-check measures a GPU; on {device} only --dry-run runs"}
    from engine.bench.model_flags import ModelSource, source_of
    from engine.loading.loader import DEFAULT_MODEL
    sizes = DRY if dry else FULL
    named = source_of(args)
    if dry and not named.model and not named.synthetic:
        named = ModelSource(None, "tiny")
    report = Report(getattr(args, "out", None), {
        "cuda": device.type == "cuda", "dry_run": dry, "device": _device_name(device),
        "sizes": vars(sizes) | {"users": list(sizes.users), "ks": list(sizes.ks),
                                "linear_files": list(sizes.linear_files)}})
    if device.type == "cuda":
        from engine.bench.kernels import run_kernel_bench
        report.section("kernels", lambda: run_kernel_bench(named))
        report.section("batched_decode", lambda: batched_decode_check(device))
        _release()
    bandwidth = _bandwidth(device, report.get("kernels"))
    report["models"] = {}
    run_model(named.path(), named.synthetic is not None, args, device, sizes, bandwidth, report,
              report["models"].setdefault(named.name, {"name": named.name}), parity=True)
    shape_name, shape = ("tiny-3-layers", TINY_SHAPE) if dry else ("llama-3.2-3b", LLAMA_3_2_3B)
    into = report["models"].setdefault(shape_name, {"name": shape_name})
    try:
        run_model(str(shape_checkpoint(shape_name, shape)), True, args, device, sizes, bandwidth, report, into,
                  parity=False)
    except Exception as error:          # noqa: BLE001: the named model's figures stand
        into["error"] = f"{type(error).__name__}: {error}"
        print(f"gpu-check: {shape_name} failed: {into['error']}", file=sys.stderr)
        report.write()
    run_linears(args, device, sizes, bandwidth, report, stand_in=(named.path() or DEFAULT_MODEL) if dry else None)
    return dict(report)


class Report(dict):
    """The results so far; with a folder, written to FOLDER/gpu_check.json after every section."""

    def __init__(self, folder: str | None, fields: dict):
        super().__init__(fields, seconds={})
        self.path = None
        if folder:
            Path(folder).mkdir(parents=True, exist_ok=True)
            self.path = Path(folder) / "gpu_check.json"
        self.write()

    def section(self, name: str, measure, into: dict | None = None) -> None:
        """into[name] = measure(), or {"error": ...} where it fails; timed, then written."""
        target = self if into is None else into
        t0 = time.perf_counter()
        try:
            target[name] = measure()
        except Exception as error:      # noqa: BLE001: one section's failure must not lose the others
            target[name] = {"error": f"{type(error).__name__}: {error}"}
            print(f"gpu-check: {name} failed: {target[name]['error']}", file=sys.stderr)
        key = name if into is None else f"{into['name']}/{name}"
        self["seconds"][key] = round(time.perf_counter() - t0, 2)
        self.write()

    def write(self) -> None:
        if self.path is not None:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self, indent=1, default=str))
            os.replace(tmp, self.path)


def run_model(path: str | None, random_weights: bool, args, device: torch.device, sizes: Sizes,
              bandwidth: float | None, report: Report, result: dict, parity: bool) -> None:
    """Every per-model figure (see the module docstring), into `result`, a dict `report` holds."""
    from engine import LLMEngine
    result.update(path=path or "default", random_weights=random_weights)
    t0 = time.perf_counter()
    eng = LLMEngine.load(path, _engine_config(args, device))
    report["seconds"][f"{result['name']}/load"] = round(time.perf_counter() - t0, 2)
    result["settings"] = {k: eng.settings()[k] for k in ("kernels", "compile", "dtype", "kv_cache_dtype", "paths")}
    result["memory_plan"] = eng.settings()["memory_plan"]
    solo: list[list[int]] = []
    report.section("decode", lambda: decode_levels(eng, sizes, solo), result)
    report.section("step", lambda: step_times(eng, sizes), result)
    one_user = (result["decode"].get("users") or {}).get(str(sizes.users[0]), {}).get("decode_tok_s")
    result["roofline_fraction"] = (eng.weight_bytes_per_token * one_user / bandwidth
                                   if one_user and bandwidth else None)
    result["weight_bytes_per_token"] = eng.weight_bytes_per_token
    report.section("verify_cost", lambda: _verify_costs(eng, sizes), result)
    report.section("long_context", lambda: long_context(eng, sizes), result)
    dtype = eng.runner.model_dtype
    del eng
    _release()
    if parity:
        report.section("parity", lambda: transformers_parity(path, device, dtype, sizes, solo, random_weights), result)


# ---- the sections -----------------------------------------------------------------------------
def decode_levels(eng, sizes: Sizes, solo: list[list[int]]) -> dict:
    """Each prompt alone (its tokens kept in `solo`), then len(PROMPTS)-cycling batches of each
    level of users; each level warmed first (a compiled step records a graph per batch size)."""
    _serve(eng, [PROMPTS[0]], 2)                                     # warm-up (and compile)
    solo.extend(_serve(eng, [p], sizes.tokens)["tokens"][0] for p in PROMPTS)
    levels = {}
    for n in sizes.users:
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
        _serve(eng, prompts, 2)
        run = _serve(eng, prompts, sizes.tokens)
        same = sum(tokens == solo[i % len(PROMPTS)] for i, tokens in enumerate(run["tokens"]))
        levels[str(n)] = {"decode_tok_s": run["decode_tok_s"], "output_tok_s": run["output_tok_s"],
                          "requests_with_solo_tokens": f"{same}/{n}"}
    one = levels[str(sizes.users[0])]["decode_tok_s"]
    for row in levels.values():
        row["vs_one_user"] = row["decode_tok_s"] / one if one and row["decode_tok_s"] else None
    return {"users": levels}


def _serve(eng, prompts: list[str], tokens: int) -> dict:
    """The prompts at once through the scheduler: each request's tokens, output tok/s over the
    run and decode tok/s from the step where every request has its first token."""
    from engine import SamplingParams
    from engine.workload import chat
    params = SamplingParams(max_tokens=tokens, stop_on_eos=False)
    ids = [eng.submit(chat(p), params) for p in prompts]
    got = {rid: [] for rid in ids}
    _synchronize(eng.device)
    t0, first, at_first = time.perf_counter(), None, 0
    while eng.has_work:
        for event in eng.step():
            got[event.request_id].extend(event.token_ids)
        if first is None and all(got.values()):
            first, at_first = time.perf_counter(), sum(map(len, got.values()))
    _synchronize(eng.device)
    end, total = time.perf_counter(), sum(map(len, got.values()))
    decode = (total - at_first) / (end - first) if first is not None and end > first and total > at_first else None
    return {"tokens": [got[rid] for rid in ids], "output_tok_s": total / (end - t0), "decode_tok_s": decode}


def step_times(eng, sizes: Sizes) -> dict:
    """One user's decode steps: wall time of each (median), then the same number under the torch
    profiler for the time of the kernels they launched (CUDA)."""
    from engine import SamplingParams
    from engine.workload import chat
    from torch.profiler import ProfilerActivity, profile
    eng.submit(chat(PROMPTS[0]), SamplingParams(max_tokens=2 * sizes.profiled_steps + 8, stop_on_eos=False))
    while not any(event.token_ids for event in eng.step()):         # the prefill
        pass
    walls = []
    for _ in range(sizes.profiled_steps):
        t0 = time.perf_counter()
        eng.step()
        walls.append(time.perf_counter() - t0)
    cuda = eng.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(sizes.profiled_steps):
            eng.step()
        _synchronize(eng.device)
    eng.cancel()
    while eng.has_work:
        eng.step()
    kernel_us = _kernel_us(prof) if cuda else None
    return {"host_ms_per_step": 1e3 * statistics.median(walls),
            "gpu_ms_per_step": kernel_us / 1e3 / sizes.profiled_steps if kernel_us else None,
            "steps": sizes.profiled_steps}


def _kernel_us(prof) -> float | None:
    from torch.autograd import DeviceType
    spans = [e.time_range.elapsed_us() for e in prof.events() if e.device_type == DeviceType.CUDA]
    return float(sum(spans)) if spans else None


def _verify_costs(eng, sizes: Sizes) -> dict:
    from engine.speculative.step_costs import verify_costs
    return verify_costs(eng.runner, sizes.ks, repeats=sizes.repeats)


def long_context(eng, sizes: Sizes) -> dict:
    """One decode pass at the longest context asked (or the model's most), over a pool in the
    model's dtype and over an FP8 E4M3 one (the engine reconfigured between them, then back)."""
    from engine.speculative.step_costs import pass_seconds
    context = min(sizes.long_context, eng.max_model_len - 16)
    out: dict = {"context": context}
    for kv in ("auto", "fp8_e4m3"):
        eng.reconfigure(kv_cache_dtype=kv)
        plan = eng.settings()["memory_plan"]
        seconds = pass_seconds(eng.runner, 1, context=context, repeats=sizes.repeats)
        out[kv] = {"kv_cache_dtype": eng.settings()["kv_cache_dtype"], "ms_per_pass": 1e3 * seconds,
                   "kv_bytes_per_token": plan["kv_pool_bytes"] / max(plan["tokens_that_fit"], 1)}
    eng.reconfigure(kv_cache_dtype="auto")
    out["fp8_speedup"] = out["auto"]["ms_per_pass"] / out["fp8_e4m3"]["ms_per_pass"]
    return out


def transformers_parity(path: str | None, device: torch.device, dtype: torch.dtype, sizes: Sizes,
                        solo: list[list[int]], random_weights: bool) -> dict:
    """transformers' greedy tokens for the prompts, in the engine's dtype, against the engine's
    (each alone), and transformers' decode tok/s (the time of 1 token taken off, as ours)."""
    from transformers import AutoTokenizer
    from engine.loading.loader import resolve, transformers_model
    folder = resolve(path)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    hf = transformers_model(folder, dtype=dtype).to(device).eval()
    same, tokens, seconds = [], 0, 0.0
    _timed_generate(hf, torch.tensor([[1, 2, 3]], device=device), 2)      # warm-up
    for prompt, ours in zip(PROMPTS, solo):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)], device=device)
        one, _ = _timed_generate(hf, ids, 1)
        full, out = _timed_generate(hf, ids, sizes.tokens)
        seconds += full - one
        tokens += sizes.tokens - 1
        same.append(out[0, ids.shape[1]:].tolist() == ours)
    del hf
    _release()
    return {"greedy_identical": same, "meaningful": not random_weights,
            "transformers_decode_tok_s": tokens / seconds if seconds > 0 else None}


def _timed_generate(hf, ids, tokens: int):
    with torch.inference_mode():
        _synchronize(ids.device)
        t0 = time.perf_counter()
        out = hf.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        _synchronize(ids.device)
    return time.perf_counter() - t0, out


def batched_decode_check(device: torch.device, lengths=(3, 700, 256, 257, 40, 1, 1500, 33)) -> dict:
    """The batched decode kernel on this device: 8 sequences of mixed lengths (one partition to
    several) over a bf16 and an FP8 pool, 8 KV heads of 128 and 32 query heads, bf16 queries. Each
    sequence alone must give its row of the batch bit for bit; the batch is compared with the
    torch reference (the largest difference)."""
    from engine.cache.kv_cache import FP8_DTYPE, LayerCache
    from engine.kernels.paged_attention import paged_decode_attention
    from engine.layers.attention import SeqSlice, paged_attention_ref, prepare, store_kv
    h_kv, group, head_dim, block_size = 8, 4, 128, 16
    g = torch.Generator(device="cpu").manual_seed(0)
    blocks = [-(-n // block_size) for n in lengths]
    order = torch.randperm(sum(blocks), generator=g)
    tables = torch.zeros(len(lengths), max(blocks), dtype=torch.int32)
    at = 0
    for b, count in enumerate(blocks):
        tables[b, :count] = order[at:at + count]
        at += count
    tables, context = tables.to(device), torch.tensor(lengths, dtype=torch.int32, device=device)
    q = torch.randn(len(lengths), 1, h_kv * group, head_dim, generator=g).to(device, torch.bfloat16)
    out = {}
    for name, pool in (("bf16", torch.bfloat16), ("fp8_e4m3", FP8_DTYPE)):
        shape = (sum(blocks), block_size, h_kv, head_dim)
        fp8 = pool == FP8_DTYPE
        cache = LayerCache(torch.zeros(shape, dtype=pool, device=device), torch.zeros(shape, dtype=pool, device=device),
                           *([torch.ones(shape[:-1], device=device) for _ in range(2)] if fp8 else [None, None]))
        for b, n in enumerate(lengths):
            slots = tables[b, torch.arange(n, device=device) // block_size].long() * block_size \
                + torch.arange(n, device=device) % block_size
            kv = torch.randn(2, n, h_kv, head_dim, generator=g).to(device, torch.bfloat16)
            store_kv(cache, kv[0], kv[1], slots)
        batch = paged_decode_attention(q, cache, tables, context, head_dim ** -0.5, max_context_len=max(lengths))
        alone_equal = [bool(torch.equal(paged_decode_attention(q[b:b + 1], cache, tables[b:b + 1, :blocks[b]],
                                                                context[b:b + 1], head_dim ** -0.5,
                                                                max_context_len=n)[0], batch[b]))
                       for b, n in enumerate(lengths)]
        worst = 0.0
        for b, n in enumerate(lengths):
            meta = prepare("torch", torch.tensor([n - 1], device=device), torch.empty(0, device=device),
                           [SeqSlice(0, 1, tables[b, :blocks[b]].long(), n)], block_size, group)
            ref = paged_attention_ref(q[b].float(), cache, meta, head_dim ** -0.5)
            worst = max(worst, (batch[b].float() - ref).abs().max().item())
        out[name] = {"alone_equals_batch": all(alone_equal), "max_abs_diff_vs_reference": worst}
    return {"lengths": list(lengths), **out}


# ---- linears: the GPU kernels on GGUF weights as stored ------------------------------------------
def run_linears(args, device: torch.device, sizes: Sizes, bandwidth: float | None, report: Report,
                stand_in: str | None) -> None:
    """The section `linears` (the module docstring), each file's three parts a section of its
    own under report["linears"][FILE]: `kernel`, `decode`, `llama_server`. stand_in: the model
    the dry run decodes instead of a file."""
    t0 = time.perf_counter()
    out = report.setdefault("linears", {})
    out.update(rows=list(LINEAR_ROWS), bandwidth_gb_s=bandwidth / 1e9 if bandwidth else None,
               bandwidth="the kernel bench's device copy (reads + writes)" if device.type == "cuda"
               else "a large read (CPU)")
    for name in sizes.linear_files:
        into = out.setdefault(name, {"name": name})
        report.section("kernel", lambda: kernel_gb_s(name, device, sizes, bandwidth), into)
        _release()
        path = stand_in or _gguf_file(name, report)
        into["file"] = path
        report.section("decode", lambda: file_decode(name, path, args, device, sizes, bandwidth), into)
        _release()
        ours = into["decode"].get("decode_tok_s")
        report.section("llama_server", lambda: llama_server_decode(path, sizes, ours), into)
    report["seconds"]["linears"] = round(time.perf_counter() - t0, 2)
    report.write()


def gguf_linears(name: str, cap: tuple[int, int] | None = None) -> list[tuple[str, tuple[int, int]]]:
    """(type, [out, in]) of every linear of the GGUF preset's file in model order, the head last
    (the tied embedding where the head is tied), as engine.loading.synthetic_gguf's recipe
    stores them: the writer's own shapes and types, so no file is read. cap: each shape cut to
    at most [out, in] and each distinct (type, shape) kept once (the dry run's few weights)."""
    from engine.kernels.gpu_quant import BLOCKS
    from engine.loading.synthetic import make_config
    from engine.loading.synthetic_gguf import SYNTHETIC_GGUF_PRESETS, gguf_tensor_specs, recipe_type
    preset, recipe = (GGUF_RECIPES | SYNTHETIC_GGUF_PRESETS)[name]
    config = make_config(preset)
    head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    specs = [s for s in gguf_tensor_specs(config) if s.name.startswith("model.layers.") and len(s.shape) == 2]
    specs += [s for s in gguf_tensor_specs(config) if s.name == head]
    linears = [(recipe_type(s.name, s.shape, config, recipe), tuple(s.shape)) for s in specs]
    linears = [(kind, shape) for kind, shape in linears if kind in BLOCKS]
    if cap is not None:
        linears = list(dict.fromkeys((kind, (min(out, cap[0]), min(inp, cap[1]))) for kind, (out, inp) in linears))
    return linears


def kernel_gb_s(name: str, device: torch.device, sizes: Sizes, bandwidth: float | None) -> dict:
    """One pass of gpu_quant.linear over every linear of the file (gguf_linears) at 1, 4 and 16
    rows of bf16 activations: stored bytes / the pass's time (median of sizes.linear_repeats),
    and that over the bandwidth. The blocks are random (gpu_quant_linear.random_weight): the
    time depends on the bytes and shapes, not the values. Each linear has its own copy on the
    device, so a pass reads every byte from memory as a decode step does, not from the L2.
    CUDA: the pass replayed as a CUDA graph (the kernels' time, not Python's launches); the CPU
    (Triton interpreter): its wall time; where neither runs, `skipped` says why."""
    from engine.kernels import gpu_quant
    why = gpu_quant.device_refusal(device)
    if why:
        return {"rows": None, "skipped": f"{why}: set TRITON_INTERPRET=1 for the run (before triton is imported) "
                                         "to take the kernel through on the CPU"}
    from engine.kernels import gpu_quant_linear
    linears = gguf_linears(name, sizes.linear_cap)
    gen = torch.Generator().manual_seed(0)
    made: dict[tuple, gpu_quant.StoredWeight] = {}
    weights = []
    for kind, (out, inp) in linears:
        first = made.get((kind, out, inp))
        if first is None:
            first = made[kind, out, inp] = gpu_quant_linear.random_weight(kind, out, inp, gen).to(device)
            weights.append(first)
        else:
            weights.append(gpu_quant.StoredWeight(kind, first.data.clone(), (out, inp)))
    stored = sum(gpu_quant.stored_bytes(kind, shape) for kind, shape in linears)
    result = {"linears": len(linears), "stored_bytes": stored, "weights": "random blocks of the file's shapes and "
              "types" + (f", cut to at most {sizes.linear_cap[0]} x {sizes.linear_cap[1]}" if sizes.linear_cap else ""),
              "types": dict(Counter(kind for kind, _ in linears)), "rows": {}}
    for rows in LINEAR_ROWS:
        xs = {inp: torch.randn(rows, inp, generator=gen).to(device, torch.bfloat16) for _, (_, inp) in linears}
        seconds, result["timing"] = _pass_seconds(lambda: [gpu_quant.linear(xs[w.shape[1]], w) for w in weights],
                                                  device, sizes.linear_repeats)
        rate = stored / seconds
        result["rows"][str(rows)] = {"ms_per_pass": 1e3 * seconds, "stored_gb_s": rate / 1e9,
                                     "of_bandwidth": rate / bandwidth if bandwidth else None}
    return result


def _pass_seconds(one_pass, device: torch.device, repeats: int) -> tuple[float, str]:
    """(the median seconds of `one_pass`, how it was timed); on CUDA after a pass that compiles
    the kernels (the interpreter compiles nothing)."""
    if device.type != "cuda":
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            one_pass()
            times.append(time.perf_counter() - t0)
        return statistics.median(times), "wall time of each pass (the Triton interpreter)"
    one_pass()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            one_pass()
        run, how = graph.replay, "a CUDA graph of the pass, CUDA events around each replay"
    except RuntimeError as error:       # the figure stands, launches included, and says so
        run, how = one_pass, f"eager launches, CUDA events around each (the CUDA graph failed: {first_line(error)})"
    run()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times), how


def _gguf_file(name: str, report: Report) -> str | None:
    """The preset's file from the user cache, written there first where the check writes it
    (WRITTEN_BY_THE_CHECK; its seconds under NAME/write); None where it is not there."""
    from engine.bench.load import synthetic_gguf, synthetic_gguf_path
    path = synthetic_gguf_path(name)
    if path.is_file() or name not in WRITTEN_BY_THE_CHECK:
        return str(path) if path.is_file() else None
    t0 = time.perf_counter()
    path = synthetic_gguf(name)
    report["seconds"][f"{name}/write"] = round(time.perf_counter() - t0, 2)
    return str(path)


def file_decode(name: str, path: str | None, args, device: torch.device, sizes: Sizes,
                bandwidth: float | None) -> dict:
    """One user's decode tok/s on the file through the engine as it loads by default (as the
    decode section measures it: _serve), and the roofline fraction it implies."""
    from engine import LLMEngine
    if path is None:
        return {"decode_tok_s": None, "skipped": f"{name}.gguf is not in the user cache and gpu-check does not write "
                f"it (minutes): write it first, `python -m engine.bench load --synthetic {name} --json`"}
    t0 = time.perf_counter()
    eng = LLMEngine.load(path, _engine_config(args, device))
    load_s = time.perf_counter() - t0
    _serve(eng, [PROMPTS[1]], 2)                                     # warm-up (and compile)
    tok_s = _serve(eng, [PROMPTS[0]], sizes.tokens)["decode_tok_s"]
    settings = eng.settings()
    return {"decode_tok_s": tok_s, "tokens": sizes.tokens, "load_s": load_s, "weights": settings["weight_dtype"],
            "compile": settings["compile"], "kernels": settings["kernels"],
            "weight_bytes_per_token": eng.weight_bytes_per_token,
            "roofline_fraction": eng.weight_bytes_per_token * tok_s / bandwidth if tok_s and bandwidth else None}


def llama_server_decode(path: str | None, sizes: Sizes, ours: float | None) -> dict:
    """One user's decode tok/s on the same file through llama-server's CUDA build (every layer
    on the GPU), beside ours; where there is none, `not_run` says why (gpu-check builds nothing:
    scripts/build_llama_server.sh builds for the CPU)."""
    from engine.errors import LlamaServerMissingError
    from engine.remote.llama_server import LlamaServer
    from engine.remote.llama_server_binary import binary
    try:
        server = binary()
    except LlamaServerMissingError as error:
        return _no_llama_server(f"not built here: {first_line(error)}")
    devices = _cuda_devices(server)
    if isinstance(devices, str):
        return _no_llama_server(devices)
    if path is None or not path.endswith(".gguf"):
        return _no_llama_server(f"no GGUF file to serve ({path or 'not in the cache'})")
    with LlamaServer(path, metrics=False, extra=("-ngl", "999")) as process:
        theirs = _server_decode_tok_s(process.url, sizes.tokens)
        version = process.version()
    return {"decode_tok_s": theirs, "ours_over_llama_server": ratio(ours, theirs) if ours else None,
            "binary": str(server), "version": version, "devices": devices, "not_run": None}


def _no_llama_server(why: str) -> dict:
    return {"decode_tok_s": None, "ours_over_llama_server": None, "not_run": why}


def _cuda_devices(server: Path) -> list[str] | str:
    """The CUDA devices `llama-server --list-devices` names, or why there are none."""
    import subprocess
    try:
        done = subprocess.run([str(server), "--list-devices"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"`{server} --list-devices` failed: {first_line(error)}"
    said = [line.strip() for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    devices = [line for line in said if line.startswith("CUDA")]
    return devices or (f"not built for CUDA here: `{server} --list-devices` names no CUDA device (it said: "
                       f"{' '.join(said)[:200]}); scripts/build_llama_server.sh builds for the CPU, gpu-check "
                       "builds nothing")


def _server_decode_tok_s(url: str, tokens: int) -> float | None:
    """A reply to PROMPTS[1] (warm-up), then one to PROMPTS[0], greedy, EOS ignored: the second's
    decode tok/s as the server's timings give it (engine.remote)."""
    from engine import SamplingParams
    from engine.remote.backend import RemoteBackend
    backend = RemoteBackend(url)
    try:
        for prompt in (PROMPTS[1], PROMPTS[0]):
            summary = None
            for event in backend.generate([{"role": "user", "content": prompt}],
                                          SamplingParams(max_tokens=tokens, stop_on_eos=False)):
                summary = event.summary or summary
        return summary.decode_tok_s if summary is not None else None
    finally:
        backend.close()


# ---- helpers ------------------------------------------------------------------------------------
def _engine_config(args, device: torch.device):
    """The engine as it loads by default here: bf16 unless --dtype, --compile, no prefix caching."""
    from engine import EngineConfig
    return EngineConfig(device=str(device), dtype=args.dtype or "bfloat16", compile=args.compile,
                        enable_prefix_caching=False)


def _bandwidth(device: torch.device, kernels: dict | None) -> float | None:
    """Bytes per second the roofline divides by: the kernel bench's device copy (CUDA), or a
    large read (CPU), measured in this run."""
    if device.type == "cuda":
        gbps = (kernels or {}).get("copy_gb_per_s")
        return gbps * 1e9 if gbps else None
    from engine.speculative.step_costs import read_bandwidth
    return read_bandwidth()


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform
    return platform.processor() or platform.machine()


def _synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _release() -> None:
    """Free what the last section held (an engine drops in reference cycles) before the next
    measures or plans memory."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
