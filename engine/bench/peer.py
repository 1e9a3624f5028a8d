"""`python -m engine.bench peer`: our engine next to another engine's server on the same weights.

--engine llama-server (default): llama.cpp's server on the same GGUF; --engine vllm: vLLM's
CPU build on float safetensors weights of the GGUF, in our dtype or in --peer-dtype
(engine.bench.peer_servers says what each serves and how it is started).

Precision on each side: our engine loads in --dtype (default `auto`: engine.engine.pick_dtype)
in every mode (single stream, --sweep-concurrency, --busy-cores). vLLM computes in --peer-dtype
(default: the dtype our side ran in), so it can run in its own fastest dtype on this CPU
(float32 where the CPU has no native bf16), as a user would run it. llama-server has no float
dtype to choose for a quantized GGUF: it computes on the file's stored types, and --peer-dtype
is refused for it; what it runs is reported instead (the file's tensor types, its KV cache
type). `sides` reports each side's dtype, weights, KV cache and threads.

The same chat prompts (greedy, --tokens each) go through the local engine and through the
server started here on 127.0.0.1, each without and with speculative decoding, in one run.
llama-server: speculation uses the target as its own draft on both sides (local: draft
"self"; server: `-md <same gguf> --spec-type draft-simple --spec-draft-n-max k`), so
acceptance is high and the figures show what verification costs. vLLM: ngram prompt lookup
on both sides. Prefix caching is off on both sides
(every prompt starts with the same chat template, which would otherwise be served from
cache). Precision is reported (`local_precision`, `server_precision`, `sides`): the local
engine computes in --dtype (`auto`: the faster here, engine.runtime.cpu_dtype) and, by
weight_dtype `auto`, serves a 4-bit GGUF's tensors as stored (others dequantized); llama.cpp
computes on the stored quantized weights; with --engine vllm both sides serve the same float
weights, ours in --dtype, vLLM in --peer-dtype (default: ours).

TTFT: median over prompts, measured by the client from submission to the first token.
tok/s: decode tokens / decode time over all prompts (engine.metrics). Each measured pass
follows an unmeasured pass over the same prompts (warm-up: compiled shapes, caches).
Both sides get the same number of CPU threads (`threads`; vLLM's worker is bound to that
many cores, and `server.omp_threads_bound` reads back what it bound); load_avg_1min says how
busy the machine was. The local side runs first and the server is started after it: vLLM's
idle engine loop spins a core, which would slow whatever ran beside it.

llama-server only, single stream: after the server has stopped, `llama-bench -m GGUF -p 0 -n N
-t threads -r 3 -o json` once (N: --tokens, at least 32), llama.cpp's token generation on the
same file and threads without HTTP, chat template or sampling, so the kernels can be compared
on their own: `llama_bench_tg_tok_s` (the median of its repetitions), `ours_over_llama_bench`
(our plain decode tok/s, `local_tok_s.no_spec`, over it) and `llama_bench` (the command, its
samples, mean, deviation and build). Where it did not run (not built, failed, --engine vllm)
those are null and `llama_bench_error` says why; the rest of the report stands.

--sweep-concurrency 1,4 runs instead a serving workload at each level, on both sides in one
run: max(--prompts, level) chat requests arriving at once, at most `level` outstanding,
--tokens each (greedy, EOS ignored), prefix caching off. Ours is the local engine with
continuous batching (engine.bench.serve.run_workload); theirs is `llama-server --parallel
level` (each slot with room for the longest request) or one vLLM server with --max-num-seqs
the highest level, on the same weights and threads, driven by as many concurrent streams
(engine.bench.serve_remote.remote_workload). Every level runs on our side first, then on
the server's. Each side warms up on `level` short requests first. It prints `sweep`, one row
per level: concurrency, local_output_throughput and server_output_throughput (generated
tokens / the workload's wall time, engine.metrics.serving_summary), their ratio, median TTFT
and TPOT on each side, and the most requests each side ran at once. --compare KEY=A,B (as
in `bench serve`) runs both arms on our side, interleaved level by level, and each row then
holds each arm's local figures under `arms` (with its ratio to the server).

--busy-cores N (llama-server only) adds `busy`: plain decoding (no speculation) on both sides over --repeats
rounds, alternately quiet and with N spinning processes beside them (engine.bench.busy),
medians of each: local_quiet_tok_s, local_busy_tok_s, server_quiet_tok_s, server_busy_tok_s,
and each side's busy / quiet ratio. The thread policy in effect is named (`thread_policy`).
The rounds run within --busy-budget-s (default 240 s, warm-up included): a reply still running at
the end of its side's share is cancelled and counted for what it decoded, and `replies` says
how many finished, were cut or never started; `rounds` how many of `rounds_planned` ran.
"""
from __future__ import annotations

import os
import statistics
import time
from collections import Counter

from engine.bench.model_flags import model_path
from engine.bench.peer_servers import LLAMA, VLLM, LlamaPeer, peer_for
from engine.bench.serve import concurrency_levels, parse_compare
from engine.errors import ConfigError, WorkbenchError
from engine.metrics import combined, ratio

MODES = ("no_spec", "spec")
BUSY_BUDGET_S = 240.0      # --busy-cores: the seconds its rounds may take, warm-up included
LLAMA_BENCH_MIN_TOKENS = 32     # llama-bench's -n at least: a few steps' rate is mostly noise
LLAMA_BENCH_REPETITIONS = 3     # its -r: a median of three, in seconds on a small model


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
    """The `peer` scenario: --engine (llama-server or vllm), --model (a .gguf; default the
    embedded one; vllm: a Hugging Face folder too) or --synthetic (llama-server: a GGUF preset),
    --prompts, --tokens, --k; --sweep-concurrency 1,4: the concurrency sweep instead, with
    --compare KEY=A,B arms on our side."""
    count = max(1, min(args.prompts, len(PEER_PROMPTS)))
    engine = getattr(args, "engine", None) or LLAMA
    if args.busy_cores and engine != LLAMA:
        raise ConfigError("peer --busy-cores runs against llama-server only; leave --engine out or drop --busy-cores")
    dtype, peer_dtype = peer_dtypes(args, engine)
    if engine == VLLM:
        from engine.remote.vllm_venv import python
        python()                  # a missing vLLM is said before a synthetic checkpoint is written
    model = model_path(args)
    if args.sweep_concurrency:
        return run_peer_sweep(model, count, args.tokens, concurrency_levels(args), engine,
                              getattr(args, "compare", None), dtype=dtype, peer_dtype=peer_dtype)
    prompts = [[{"role": "user", "content": text}] for text in PEER_PROMPTS[:count]]
    return run_peer_bench(model, prompts, args.tokens, args.k, args.compile, args.busy_cores, args.repeats,
                          engine, dtype=dtype, peer_dtype=peer_dtype,
                          busy_budget_s=getattr(args, "busy_budget_s", BUSY_BUDGET_S))


def peer_dtypes(args, engine_name: str) -> tuple[str, str | None]:
    """(our `dtype` setting, the peer's dtype or None: the one our side runs in), from --dtype
    and --peer-dtype; --peer-dtype is refused where the peer has no float dtype to choose."""
    peer_dtype = getattr(args, "peer_dtype", None)
    if peer_dtype and engine_name == LLAMA:
        raise ConfigError(f"--peer-dtype {peer_dtype}: llama-server computes on the GGUF's stored types and has no "
                          "float dtype to choose; drop --peer-dtype (the report names what it runs) or use "
                          "--engine vllm")
    return getattr(args, "dtype", None) or "auto", peer_dtype


def run_peer_bench(model: str | None, prompts: list[list[dict]], tokens: int, k: int, compile_mode: str = "auto",
                   busy_cores: int = 0, repeats: int = 4, engine_name: str = LLAMA, *, dtype: str = "auto",
                   peer_dtype: str | None = None, busy_budget_s: float = BUSY_BUDGET_S) -> dict:
    peer = peer_for(engine_name, model)
    load_start = os.getloadavg()[0]       # the machine may be shared: say how busy it was
    local, local_info, engine = _local(peer, prompts, tokens, k, compile_mode, dtype)
    threads = local_info["threads"]
    server_dtype = peer_dtype or local_info["dtype"]
    server, server_info = {}, {}
    for mode in MODES:
        # as many threads as our engine started with, so both sides get the same cores
        with peer.server(threads=threads, dtype=server_dtype, k=k if mode == "spec" else None) as process:
            server[mode] = _through_server(process.url, prompts, tokens)
            server_info = peer.info(process, threads)
            server_side = peer.side(process, server_dtype, threads)
    kernels = _llama_bench(peer, threads, tokens, local["no_spec"]["tok_s"])     # no server running beside it
    busy = (_busy(engine, peer, prompts, tokens, busy_cores, repeats, threads, busy_budget_s)
            if busy_cores else None)
    return {"model": os.path.basename(peer.local_model), "engine": peer.name,
            "load_avg_1min": {"start": load_start, "end": os.getloadavg()[0]}, "prompts": len(prompts),
            "tokens": tokens, "k": k, "threads": threads, "draft": peer.draft, "server": server_info, "busy": busy,
            "thread_policy": {"local": engine.thread_governor.describe(), "server": server_info["thread_policy"]},
            "local_precision": local_info["precision"], "local_compile": local_info["compile"],
            "server_precision": peer.precision(server_dtype),
            **_sides(local_info["side"], server_side),
            **_fields("local", local), **_fields("server", server), **kernels}


def _llama_bench(peer, threads: int, tokens: int, local_tok_s: float) -> dict:
    """llama-bench's token generation on the peer's GGUF at our thread count, and our plain
    decode rate over it; where it gives no rate, nulls and `llama_bench_error` saying why."""
    from engine.remote.llama_tools import llama_bench_tg
    if peer.name != LLAMA:
        return _no_llama_bench(f"not run: the peer is {peer.name} on float weights, and llama-bench runs llama.cpp "
                               "on a GGUF (run bench peer with the default --engine llama-server)")
    n_gen = max(tokens, LLAMA_BENCH_MIN_TOKENS)
    try:
        tg = llama_bench_tg(peer.gguf, n_gen, threads, LLAMA_BENCH_REPETITIONS)
    except (WorkbenchError, OSError) as e:
        return _no_llama_bench(str(e))
    return {"llama_bench_tg_tok_s": tg.tok_s, "ours_over_llama_bench": ratio(local_tok_s, tg.tok_s),
            "llama_bench": {"command": tg.command, "n_gen": tg.n_gen, "repetitions": LLAMA_BENCH_REPETITIONS,
                            "threads": tg.threads, "samples_ts": tg.samples_ts, "avg_ts": tg.avg_ts,
                            "stddev_ts": tg.stddev_ts, "build": tg.build},
            "llama_bench_error": None}


def _no_llama_bench(reason: str) -> dict:
    return {"llama_bench_tg_tok_s": None, "ours_over_llama_bench": None, "llama_bench": None,
            "llama_bench_error": reason}


def _sides(local_side: dict, server_side: dict) -> dict:
    """Each side's dtype, weights, KV cache and threads (`local_dtype` / `server_dtype`: the
    dtype alone, for scripts; None where a side computes on stored quantized types)."""
    return {"local_dtype": local_side["dtype"], "server_dtype": server_side["dtype"],
            "sides": {"local": local_side, "server": server_side}}


def local_side(engine, dtype_setting: str) -> dict:
    """What our side runs: its dtype (and how `dtype_setting` chose it), weights, KV cache, threads."""
    settings = engine.settings()
    return {"dtype": settings["dtype"], "dtype_setting": dtype_setting, "dtype_why": engine.dtype_why,
            "weights": settings.get("weight_dtype") or "dequantized by our loader",
            "kv_cache_dtype": settings["kv_cache_dtype"], "threads": engine.thread_governor.most,
            "thread_policy": engine.thread_governor.describe()}


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


def _local(peer, prompts, tokens: int, k: int, compile_mode: str, dtype: str = "auto") -> tuple[dict, dict, object]:
    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.engine import SELF_DRAFT
    engine = LLMEngine.load(peer.local_model, EngineConfig(device="cpu", enable_prefix_caching=False,
                                                           compile=compile_mode, dtype=dtype))
    if peer.local_proposer == "draft":
        engine.set_draft_model(SELF_DRAFT)
    params = SamplingParams(max_tokens=tokens)
    results = {}
    for mode in MODES:
        engine.reconfigure(proposer=peer.local_proposer if mode == "spec" else "off", num_speculative_tokens=k)
        results[mode] = _measured(lambda prompt: engine.generate_text(prompt, params)[2], prompts)
    # the engine's starting count: its governor may have lowered torch's while other programs ran
    info = {"precision": _local_precision(engine), "threads": engine.thread_governor.most,
            "compile": engine.settings()["compile"], "dtype": engine.settings()["dtype"],
            "side": local_side(engine, dtype)}
    engine.reconfigure(proposer="off")
    return results, info, engine


def _busy(engine, peer: LlamaPeer, prompts, tokens: int, busy_cores: int, repeats: int, threads: int,
          budget_s: float = BUSY_BUDGET_S) -> dict:
    """Plain decode tok/s on both sides, quiet and beside `busy_cores` spinning processes,
    rounds interleaved (quiet, busy, quiet, ...) so that drift hits both alike; medians.

    Bounded in time: a side that crawls beside the spinners (llama-server's threads wait for
    each other a whole time slice at every barrier) would take many minutes. Each side of
    each round gets an equal share of `budget_s`; a reply still running when its share ends is
    cancelled and counted for what it decoded, the prompts after it are not started, and a
    round that would start after the budget is left out. What finished is reported: rounds
    run, and per side and state the replies finished, cut and never started."""
    from engine import SamplingParams
    from engine.bench.busy import BusyCores
    from engine.remote.backend import RemoteBackend
    params = SamplingParams(max_tokens=tokens)
    runs = {f"{side}_{state}_tok_s": [] for side in ("local", "server") for state in ("quiet", "busy")}
    replies = {f"{side}_{state}": Counter(finished=0, cut=0, not_started=0)
               for side in ("local", "server") for state in ("quiet", "busy")}
    compile_steps = {"quiet": 0, "busy": 0}     # steps of our timed replies whose pass compiled: none, we check
    deadline = time.monotonic() + budget_s
    planned = max(2, repeats + repeats % 2)          # as many quiet rounds as busy ones
    share_s = budget_s / (2 * planned + 2)           # a side's part of a round (and of the warm-up)
    rounds = 0
    with peer.server(threads=threads, dtype="") as process:
        backend = RemoteBackend(process.url)
        try:
            backend.reconfigure(enable_prefix_caching=False)
            sides = {"local": engine, "server": backend}
            for backend_ in sides.values():             # warm-up, unmeasured
                _replies_until(backend_, prompts[:1], params, time.monotonic() + share_s)
            for round_ in range(planned):
                if time.monotonic() >= deadline:
                    break
                state = "busy" if round_ % 2 else "quiet"
                with BusyCores(busy_cores if state == "busy" else 0):
                    for side, backend_ in sides.items():
                        until = min(deadline, time.monotonic() + share_s)
                        stats, counts = _replies_until(backend_, prompts, params, until)
                        replies[f"{side}_{state}"].update(counts)
                        if side == "local":
                            compile_steps[state] += sum(s.compile_steps for s in stats)
                        if stats:
                            runs[f"{side}_{state}_tok_s"].append(_summaries(stats)["tok_s"])
                rounds += 1
        finally:
            backend.close()
    out = {name: statistics.median(values) if values else None for name, values in runs.items()}
    return {**out, "busy_cores": busy_cores, "rounds": rounds, "rounds_planned": planned, "budget_s": budget_s,
            "replies": {name: dict(counts) for name, counts in replies.items()}, "threads": threads,
            "local_compile_steps": compile_steps,
            **{f"{side}_busy_over_quiet": _busy_over_quiet(out, side) for side in ("local", "server")}, "runs": runs}


def _busy_over_quiet(medians: dict, side: str) -> float | None:
    """busy / quiet tok/s; None where either state has no reply that decoded."""
    busy = medians[f"{side}_busy_tok_s"]
    return None if busy is None else ratio(busy, medians[f"{side}_quiet_tok_s"])


def _replies_until(backend, prompts, params, until: float) -> tuple[list, dict]:
    """Each prompt's reply in turn, until the monotonic time `until`: the one still running
    then is cancelled (its summary counts what it decoded), the rest are not started.
    Returns (the replies' summaries, {"finished", "cut", "not_started"})."""
    stats, counts = [], {"finished": 0, "cut": 0, "not_started": 0}
    for prompt in prompts:
        if time.monotonic() >= until:
            counts["not_started"] += 1
            continue
        request, summary, cut = backend.start(prompt, params), None, False
        try:
            while not request.finished:
                if not cut and time.monotonic() >= until:
                    request.cancel()             # the next step is its last
                    cut = True
                summary = request.step().summary or summary
        finally:
            request.close()
        counts["cut" if cut else "finished"] += 1
        if summary is not None and summary.decode_tokens:
            stats.append(summary)
    return stats, counts


def _through_server(url: str, prompts, tokens: int) -> dict:
    from engine import SamplingParams
    from engine.remote.backend import RemoteBackend
    backend = RemoteBackend(url)
    try:
        if backend.kind.per_request.get("enable_prefix_caching"):      # llama.cpp: per request; vLLM: at launch
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


# ---- the concurrency sweep --------------------------------------------------------------------
WARM_UP_TOKENS = 8
SLOT_CONTEXT_MIN = 2048


def run_peer_sweep(model: str | None, prompts: int, tokens: int, levels: list[int], engine_name: str = LLAMA,
                   compare: str | None = None, *, dtype: str = "auto", peer_dtype: str | None = None) -> dict:
    from engine import EngineConfig, LLMEngine
    peer = peer_for(engine_name, model)
    key, values = parse_compare(compare) if compare else (None, [None])
    load_start = os.getloadavg()[0]
    engine = LLMEngine.load(peer.local_model, EngineConfig(device="cpu", enable_prefix_caching=False, dtype=dtype))
    ours = local_side(engine, dtype)          # before --compare's arms change its settings
    threads, server_dtype = engine.thread_governor.most, peer_dtype or engine.settings()["dtype"]
    chats = {level: [[{"role": "user", "content": f"{PEER_PROMPTS[i % len(PEER_PROMPTS)]} (request {i})"}]
                     for i in range(max(prompts, level))] for level in levels}
    local = {}
    for level in levels:            # every level on our side first: no server is running beside it
        for value in values:
            if key is not None:
                engine.reconfigure(**{key: value})
            local[level, value] = _local_level(engine, chats[level], tokens, level)
    slot_context = max(SLOT_CONTEXT_MIN, max(len(engine.encode(chat)) for c in chats.values() for chat in c)
                       + tokens + 16)
    rows, server_info, server_side = [], {}, {}
    with peer.sweep_servers(levels, threads=threads, dtype=server_dtype, slot_context=slot_context) as server_for:
        for level in levels:
            process = server_for(level)
            server = _server_level(process.url, chats[level], tokens, level)
            server_info = peer.info(process, threads) | ({"slot_context": slot_context} if peer.name == LLAMA else {})
            server_side = peer.side(process, server_dtype, threads)
            rows.append(_sweep_row(level, len(chats[level]), {v: local[level, v] for v in values}, server, key))
    return {"model": os.path.basename(peer.local_model), "engine": peer.name,
            "load_avg_1min": {"start": load_start, "end": os.getloadavg()[0]},
            "tokens": tokens, "threads": threads, "server": server_info, "compare": compare,
            "local_precision": _local_precision(engine), "server_precision": peer.precision(server_dtype),
            **_sides(ours, server_side), "sweep": rows}


def _local_level(engine, chats, tokens: int, level: int) -> dict:
    from engine.bench.serve import run_workload
    from engine.workload import Job
    jobs = [Job(0.0, engine.encode(chat), tokens) for chat in chats]
    run_workload(engine, [Job(0.0, j.prompt, WARM_UP_TOKENS) for j in jobs[:level]], level)
    return run_workload(engine, jobs, level)


def _server_level(url: str, chats, tokens: int, level: int) -> dict:
    from engine.bench.serve_remote import remote_workload
    from engine.remote.backend import RemoteBackend
    from engine.workload import Job
    backend = RemoteBackend(url, poll_interval_s=float("inf"))
    try:
        if backend.kind.per_request.get("enable_prefix_caching"):
            backend.reconfigure(enable_prefix_caching=False)
        jobs = [Job(0.0, chat, tokens) for chat in chats]
        remote_workload(backend, [Job(0.0, j.prompt, WARM_UP_TOKENS) for j in jobs[:level]], level)
        return remote_workload(backend, jobs, level)
    finally:
        backend.close()


def _sweep_row(level: int, requests: int, local_arms: dict, server: dict, key: str | None) -> dict:
    from engine.bench.serve import _label
    arms = {_label(value): _local_fields(local, server) for value, local in local_arms.items()}
    row = {"concurrency": level, "requests": requests, **(next(iter(arms.values())) if key is None else {}),
           "server_output_throughput": server["output_throughput"],
           "server_median_ttft_ms": server["median_ttft_ms"], "server_median_tpot_ms": server["median_tpot_ms"],
           "server_completed": server["completed"], "server_failed": server["failed"],
           "server_max_concurrent": server["max_concurrent"]}
    return row if key is None else row | {"arms": arms}


def _local_fields(local: dict, server: dict) -> dict:
    from engine.metrics import ratio
    return {"local_output_throughput": local["output_throughput"],
            "local_over_server": ratio(local["output_throughput"], server["output_throughput"] or 0),
            "local_median_ttft_ms": local["median_ttft_ms"], "local_median_tpot_ms": local["median_tpot_ms"],
            "local_completed": local["completed"], "local_max_concurrent": local["max_concurrent"]}
