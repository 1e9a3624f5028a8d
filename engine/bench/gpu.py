"""`python -m engine.bench gpu-check [--out FOLDER] [--dry-run] --json`: what the issues ask of
a GPU, in one command (at most about 8 minutes on an H200), for the day a device is lent;
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

A section that fails records {"error": ...} and the next runs. Results: one JSON object printed,
and with --out FOLDER, FOLDER/gpu_check.json, written again after every section (a run cut short
keeps what it measured), with each section's seconds under "seconds".

--dry-run: the whole script at sizes that take seconds (tests run it on the CPU so it does not
rot; on a GPU it is a first look before the full run): the tiny synthetic preset for both models
(unless --model / --synthetic names the first), few tokens, short contexts. Without CUDA and
without --dry-run it says so and exits 0.
"""
from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.bench.load import shape_checkpoint

PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.", "List three primes.")
# Llama-3.2-3B's config.json (its vocabulary too: the default model's tokenizer covers the ids it reads)
LLAMA_3_2_3B = {"preset": "llama-3.2-1b", "hidden_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 24,
                "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 8192}
TINY_SHAPE = {"preset": "tiny", "num_hidden_layers": 3}     # --dry-run's stand-in, written the same way


@dataclass(frozen=True)
class Sizes:
    tokens: int                 # generated per request
    users: tuple[int, ...]
    ks: tuple[int, ...]         # verify_cost's draft lengths
    long_context: int
    profiled_steps: int
    repeats: int                # timed passes per figure (medians)


FULL = Sizes(tokens=64, users=(1, 4, 16), ks=(1, 2, 4, 8), long_context=32768, profiled_steps=16, repeats=7)
DRY = Sizes(tokens=4, users=(1, 4, 16), ks=(1, 2, 4, 8), long_context=96, profiled_steps=2, repeats=2)


def bench_gpu_check(args) -> dict:
    dry = getattr(args, "dry_run", False)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() or not dry else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        return {"cuda": False, "message": "no CUDA on this machine: the GPU checks did not run (--dry-run --device "
                                          "cpu runs the script at tiny sizes on the CPU)"}
    if device.type != "cuda" and not dry:
        return {"cuda": False, "message": f"gpu-check measures a GPU; on {device} only --dry-run runs"}
    from engine.bench.model_flags import ModelSource, source_of
    sizes = DRY if dry else FULL
    named = source_of(args)
    if dry and not named.model and not named.synthetic:
        named = ModelSource(None, "tiny")
    report = Report(getattr(args, "out", None), {
        "cuda": device.type == "cuda", "dry_run": dry, "device": _device_name(device),
        "sizes": vars(sizes) | {"users": list(sizes.users), "ks": list(sizes.ks)}})
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
    from engine import EngineConfig, LLMEngine
    result.update(path=path or "default", random_weights=random_weights)
    config = EngineConfig(device=str(device), dtype=args.dtype or "bfloat16", compile=args.compile,
                          enable_prefix_caching=False)
    t0 = time.perf_counter()
    eng = LLMEngine.load(path, config)
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


# ---- helpers ------------------------------------------------------------------------------------
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
