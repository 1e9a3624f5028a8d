"""`python -m engine.bench serve --backend URL`: the serve workload against a remote server.

The same requests as the local `bench serve` (engine.workload.make_jobs, the same options and
seed) go to an OpenAI-compatible server (vLLM, SGLang, llama.cpp's llama-server) as N
concurrent streams (engine.remote.concurrent_streams), and the output has the local run's
field names, computed by the same formulas (engine.metrics.serving_summary) from the
client-side timings: TTFT, ITL, TPOT and E2EL from the arrival times of the streamed chunks.
The chat prompts are sent as chat messages, so the server applies its own chat template;
random token ids (--prompt-set random) and the shared system prompt are made with --model's
tokenizer (default: the embedded model's) and sent as text, as vLLM's random dataset does.

From the server's own counters, sampled during the run (`server_load`): max_concurrent and
mean_running (its running-requests gauge: vLLM, SGLang, llama.cpp --metrics or /slots),
preemptions (vLLM's counter), and its KV-cache use and waiting requests. A field the server
cannot give is null, and `null_reasons` says why, by field name (`settings.threads`, ...).
`failed` and `errors` count the requests the server refused or lost.

--api-key-env NAME names the environment variable that holds the API key; the key itself is
never printed. An unreachable server is reported within 5 s, with what to check.
"""
from __future__ import annotations

import re

from engine.bench import serve
from engine.errors import ConfigError, ServerRequestError
from engine.metrics import ratio, serving_summary
from engine.workload import Job, make_jobs

# the local run's `settings` keys (engine.bench.serve.run_arm)
SETTINGS_SHOWN = ("kv_cache_dtype", "enable_prefix_caching", "proposer", "num_speculative_tokens",
                  "kv_pool_blocks", "compile", "threads")
LOCAL_ONLY_OPTIONS = {"kv_cache_bytes": "--kv-cache-bytes", "max_num_seqs": "--max-num-seqs"}
NOT_REPORTED = "the server does not report it"
REASONS = {
    "dtype": "a server does not report the dtype it computes in",
    "steps": "a server does not report its engine steps",
    "scheduler.max_num_seqs": "the server does not say how many requests it runs at once",
    "scheduler.max_num_batched_tokens": "the server does not report its token budget per step",
    "settings.kv_pool_blocks": "a server does not report its KV pool in blocks",
    "settings.compile": "a server does not report how its step is compiled",
    "settings.threads": "a server does not report its thread count",
    "total_input_tokens": "the server did not count the prompt tokens of every request",
    "total_token_throughput": "the server did not count the prompt or output tokens of every request",
    "total_output_tokens": "the server did not count the output tokens of every request",
    "output_throughput": "the server did not count the output tokens of every request",
    "prefix_hit_tokens": "the server did not report prefix-cache hits for every request "
                         "(vLLM: --enable-prompt-tokens-details)",
}


def add_arguments(ap) -> None:
    ap.add_argument("--backend", default=None, metavar="URL",
                    help="serve, drive this OpenAI-compatible server (vLLM, SGLang, llama-server) instead of the "
                    "local engine (engine.bench.serve_remote)")
    ap.add_argument("--api-key-env", default=None, metavar="NAME",
                    help="serve --backend: the environment variable holding the server's API key (never printed)")
    ap.add_argument("--served-model", default=None,
                    help="serve --backend: the model to ask the server for (default: the one it serves)")


def bench_serve_remote(args) -> dict:
    from engine.remote.backend import RemoteBackend
    for key, flag in LOCAL_ONLY_OPTIONS.items():
        if getattr(args, key, None) is not None:
            raise ConfigError(f"{flag} sets the local engine; a server fixes it when it is launched "
                              "(llama-server --parallel / --ctx-size, vLLM --max-num-seqs / --gpu-memory-utilization)")
    backend = RemoteBackend(args.backend, args.served_model, api_key_env=args.api_key_env,
                            poll_interval_s=float("inf"))      # the streams do not poll; the sampler does
    try:
        return _bench(backend, args)
    finally:
        backend.close()


def _bench(backend, args) -> dict:
    jobs, tokenizer_name = remote_jobs(args)
    levels = serve.concurrency_levels(args)
    key, values = serve.parse_compare(args.compare) if args.compare else (None, [None])
    notes: dict = {}
    rows = []
    for level in levels:
        arms = {}
        for value in values:
            if key is not None:
                backend.reconfigure(**{key: value})      # a launch-fixed setting is refused, naming its flag
            arms[serve._label(value)] = run_remote_arm(backend, jobs, level, notes)
        rows.append({"max_concurrency": level, **serve._arms_or_fields(arms, key)})
    settings = backend.settings()
    out = {"model": backend.model, "dtype": None, "prompt_set": args.prompts_set or "chat",
           "num_prompts": args.num_prompts, "request_rate": args.request_rate, "output_len": args.output_len,
           "shared_prefix_len": args.shared_prefix_len, "compare": args.compare,
           "scheduler": {"max_num_seqs": backend.slot_count(), "max_num_batched_tokens": None},
           "backend": {"url": redacted(backend.url), "server_kind": settings["server_kind"],
                       "server": settings["server"], "server_version": settings["server_version"],
                       "api_key_env": args.api_key_env, "metrics": settings["metrics"],
                       "workload_tokenizer": tokenizer_name, **notes}}
    out |= {"rows": rows} if args.sweep_concurrency else rows[0]
    return out | {"null_reasons": null_reasons(out, backend)}


def remote_jobs(args) -> tuple[list[Job], str | None]:
    """The local run's jobs (make_jobs on the same workload), as chat messages: random token
    ids become text, decoded by --model's tokenizer; (jobs, that tokenizer's model or None)."""
    source = _MessagesSource(args.model)
    jobs = make_jobs(source, serve.workload_of(args))
    return [Job(j.arrival_s, j.prompt if _is_chat(j.prompt) else
                [{"role": "user", "content": source.tokenizer.decode(j.prompt)}], j.max_tokens)
            for j in jobs], source.loaded_from


class _MessagesSource:
    """What make_jobs asks of an engine (tokenizer, encode), giving chat messages as they
    are instead of encoding them; the tokenizer is loaded only when the workload needs one."""

    def __init__(self, model: str | None):
        self.model, self._tokenizer, self.loaded_from = model, None, None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from engine.loading.loader import DEFAULT_MODEL, load_tokenizer, resolve
            self._tokenizer = load_tokenizer(resolve(self.model))
            self.loaded_from = self.model or DEFAULT_MODEL
        return self._tokenizer

    def encode(self, prompt):
        return prompt if _is_chat(prompt) else self.tokenizer.encode(prompt, add_special_tokens=True)


def _is_chat(prompt) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)


def run_remote_arm(backend, jobs: list[Job], level: int, notes: dict) -> dict:
    """One arm at one concurrency level, as the local run_arm: a cold prefix cache (where the
    server can drop it; notes["prefix_cache_reset"] says), one request alone, then the workload."""
    _reset_prefix_cache(backend, notes)
    single = remote_workload(backend, [Job(0.0, jobs[-1].prompt, jobs[-1].max_tokens)], 1)
    _reset_prefix_cache(backend, notes)
    fields = remote_workload(backend, jobs, level)
    fields["single_stream_tok_s"] = single["output_throughput"]
    both = fields["output_throughput"], single["output_throughput"]
    fields["throughput_vs_single"] = ratio(*both) if None not in both else None
    settings = backend.settings()
    fields["settings"] = {key: settings.get(key) for key in SETTINGS_SHOWN}
    return fields


def remote_workload(backend, jobs: list[Job], max_concurrency: int) -> dict:
    """The serving figures of `jobs` on the server (the local run_workload's fields), plus
    failed, errors and server_load (the sampled counters)."""
    from engine.remote.concurrent_streams import run_streams
    run = run_streams(backend, jobs, max_concurrency)
    if run.failures and not run.summaries:
        raise ServerRequestError(f"no request of the workload completed on {redacted(backend.url)}; "
                                 f"the first failure: {run.failures[0]}")
    load = run.load()
    return summary_of(run.summaries, run.duration_s) | {
        "max_concurrent": load["max_running"], "preemptions": load["preemptions"],
        "mean_running": load["mean_running"], "steps": None,
        "failed": len(run.failures), "errors": sorted(set(run.failures))[:3], "server_load": load}


# RequestStats counts a server may not report -> the serving_summary fields they make
COUNTED = {"prompt_tokens": ("total_input_tokens", "total_token_throughput"),
           "generated_tokens": ("total_output_tokens", "output_throughput", "total_token_throughput"),
           "prefix_hit_tokens": ("prefix_hit_tokens",)}


def summary_of(summaries, duration_s: float) -> dict:
    """serving_summary of the requests; a total that a count missing from some request would
    make up is None instead (never a missing count taken as 0)."""
    from dataclasses import replace
    missing = {name for name in COUNTED if any(getattr(s, name) is None for s in summaries)}
    counted = [replace(s, **{name: getattr(s, name) or 0 for name in missing}) for s in summaries]
    return serving_summary(counted, duration_s) | {field: None for name in missing for field in COUNTED[name]}


def _reset_prefix_cache(backend, notes: dict) -> None:
    from engine.errors import ServerError
    try:
        backend.reset_prefix_cache()
        notes.setdefault("prefix_cache_reset", "before each arm and its single request")
    except ServerError as e:
        notes["prefix_cache_reset"] = f"not reset: {e}"


def null_reasons(out: dict, backend) -> dict:
    """Why each null field is null, by field name ("settings.threads"; a sweep's or a
    comparison's rows share their names)."""
    reasons = dict(REASONS)
    label = backend.kind.label
    gauge = (f"the {label} reports no running-request gauge ({backend.metrics_note() or 'metrics: available'}), "
             "or the run was shorter than one sampling interval")
    reasons |= {"max_concurrent": gauge, "mean_running": gauge,
                "preemptions": f"the {label} exports no preemption counter (vLLM's vllm:num_preemptions)"}
    for key in ("kv_cache_dtype", "enable_prefix_caching", "proposer", "num_speculative_tokens"):
        reasons[f"settings.{key}"] = (f"the {label} does not report it (it is set by: "
                                      f"{backend.kind.launch_flags.get(key, 'its launch options')})")
    return {path: reasons.get(path, NOT_REPORTED) for path in sorted(set(_null_paths(out)))}


def _null_paths(data: dict, prefix: str = ""):
    for key, value in data.items():
        if key in ("backend", "server_load", "errors", "ratio", "compare"):   # not measured figures
            continue
        if value is None:
            yield prefix + key
        elif key in ("rows", "arms"):
            for fields in (value.values() if key == "arms" else value):
                yield from _null_paths(fields, prefix)
        elif isinstance(value, dict):
            yield from _null_paths(value, f"{prefix}{key}.")


def redacted(url: str) -> str:
    """The URL without a user name or password in it."""
    return re.sub(r"://[^/@]*@", "://", url)
