"""`python -m engine.bench serve`: a serving workload on our engine, many requests at once.

The workload follows vLLM's `bench serve`: --num-prompts requests, arriving all at once
(--request-rate inf) or as a gamma process of that rate (--burstiness 1: Poisson), at most
--max-concurrency outstanding; prompts from --prompt-set (chat, repeat, edit: multi-turn chats
that revise an earlier answer, or random token ids of --input-len), each after a shared system prompt of --shared-prefix-len tokens (SGLang's
generated-shared-prefix idea), --output-len tokens each (EOS ignored, as vLLM's random
dataset does), --seed for everything random.

Output fields are named as vLLM's bench serve saves them (engine.metrics.serving_summary),
plus max_concurrent (the most requests running at once), mean_running, preemptions,
prefix_hit_tokens, and single_stream_tok_s: one request of the workload alone, in the same
run (output tokens / its end-to-end time, the same formula as output_throughput), the
baseline of throughput_vs_single.

--sweep-concurrency 1,4,16 prints one row per level. --compare KEY=A,B runs both arms in
one process, interleaved level by level (a noisy machine cannot fake a difference between
arms run at different times), and prints each arm's fields under `arms` and `ratio`: B over
A for every numeric field.

--compare profile=A,B takes two session profiles (engine.profiles: a saved or built-in
profile's name, or a profile file's path) and runs each arm with that profile's engine
settings (SessionProfile.engine_settings, the ones a loaded engine can change), on this
command line's model and workload. A pool or sequence cap the command line fixes
(--kv-cache-bytes, --max-num-seqs, --compile on/off) holds for both arms, as a command line
wins over a file. Each arm's `profile` names the profile and its file, gives every engine
setting the arm ran with (`config`, read back from the engine) and, under `not_applied`,
what the profile asks for that this run does not do: another model, a load-time setting
(device, dtype, ...), a held setting, sampling other than the workload's greedy requests, or
a proposer with nothing to propose (a draft proposer without a draft model). The profile's
system prompt and workload are not used: the command line's workload runs for both arms.
Every arm's settings are applied once before anything is measured, so a profile the engine
refuses (a draft model that is not there) fails in seconds, naming the profile.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine import config as settings_table
from engine.config import BY_KEY, SamplingParams
from engine.errors import ConfigError, WorkbenchError
from engine.metrics import ratio
from engine.profiles import ProfileError, SessionProfile, find_profile
# The workload itself (fields, prompt sets, arrivals, the driver) is engine.workload's, shared with the app.
from engine.workload import Job, Workload, arrival_times, make_jobs, run_to_completion  # noqa: F401 (re-exported)

W = Workload()      # the CLI's defaults are the workload's


def add_arguments(ap) -> None:
    ap.add_argument("--num-prompts", type=int, default=W.num_prompts, help="serve: requests in the workload")
    ap.add_argument("--request-rate", type=float, default=W.arrival_rate,
                    help="serve: requests per second (inf: all at once)")
    ap.add_argument("--burstiness", type=float, default=W.burstiness, help="serve: gamma shape of arrivals (1: Poisson)")
    ap.add_argument("--max-concurrency", type=int, default=W.max_concurrency,
                    help="serve: most requests outstanding at once")
    ap.add_argument("--shared-prefix-len", type=int, default=W.shared_prefix_len,
                    help="serve: tokens of a system prompt all share")
    ap.add_argument("--input-len", type=int, default=W.input_len, help="serve: prompt tokens for --prompt-set random")
    ap.add_argument("--output-len", type=int, default=W.output_len, help="serve: tokens generated per request")
    ap.add_argument("--seed", type=int, default=W.seed, help="serve: workload seed")
    ap.add_argument("--sweep-concurrency", default=None, help="serve: comma-separated max concurrency levels")
    ap.add_argument("--compare", default=None,
                    help="serve: KEY=A,B (an engine setting) or profile=A,B (two profiles' engine settings: "
                    "names or files) run interleaved")
    ap.add_argument("--kv-cache-bytes", type=int, default=None, help="serve: a fixed KV pool (memory pressure)")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="serve: the engine's sequence cap")


def bench_serve(args) -> dict:
    from engine.bench.scenarios import _engine
    key, values = parse_compare(args.compare) if args.compare else (None, [None])   # before the load: fails fast
    held = held_settings(args)
    eng = _engine(args, **{"compile": args.compile} | held)
    changes = {_label(value): arm_changes(key, value, held) for value in values}
    check_arms(eng, changes)
    jobs_for = make_workload(eng, args)
    levels = concurrency_levels(args)
    rows = []
    for level in levels:
        arms = {}
        for value in values:
            if key is not None:
                eng.reconfigure(**changes[_label(value)])
            eng.warm_compiled_step()               # a compile is never inside a timed figure
            arms[_label(value)] = run_arm(eng, jobs_for, args, level)
            if isinstance(value, ProfileArm):
                arms[_label(value)]["profile"] = profile_report(eng, value, held, args)
        rows.append({"max_concurrency": level, **_arms_or_fields(arms, key)})
    out = {"model": eng.target_model.display_name, "dtype": str(eng.runner.model_dtype).removeprefix("torch."),
           "prompt_set": args.prompts_set or "chat", "num_prompts": args.num_prompts,
           "request_rate": args.request_rate, "output_len": args.output_len,
           "shared_prefix_len": args.shared_prefix_len, "compare": args.compare,
           "scheduler": dict(zip(("max_num_seqs", "max_num_batched_tokens"), eng.scheduler_limits()))}
    if args.sweep_concurrency:
        return out | {"rows": rows}
    return out | rows[0]


def held_settings(args) -> dict:
    """The engine settings this command line fixes for every arm (a profile does not change them)."""
    given = {"kv_cache_bytes": args.kv_cache_bytes, "max_num_seqs": args.max_num_seqs,
             "compile": None if args.compile == "auto" else args.compile}
    return {key: value for key, value in given.items() if value is not None}


def arm_changes(key: str | None, value, held: dict) -> dict:
    """What LLMEngine.reconfigure gets for one arm: the one setting, or every engine setting of
    the profile but those the command line holds."""
    if key is None:
        return {}
    if isinstance(value, ProfileArm):
        return {k: v for k, v in value.profile.engine_settings().items() if k not in held}
    return {key: value}


def check_arms(eng, changes: dict[str, dict]) -> None:
    """Apply every arm's settings once, before anything is measured: a setting the engine refuses
    (a draft model or EAGLE head that is not there) fails now, naming its arm."""
    for label, arm in changes.items():
        try:
            eng.reconfigure(**arm)
        except WorkbenchError as exc:
            raise ConfigError(f"--compare arm {label!r}: the engine refused its settings: {exc}") from exc
        eng.warm_compiled_step()                   # every arm's graphs (a draft's too) are built now


def run_arm(eng, jobs_for, args, level: int) -> dict:
    """One arm at one concurrency level: a cold prefix cache, one request alone, then the workload."""
    eng.reset_prefix_cache()
    jobs = jobs_for()
    single = run_workload(eng, [Job(0.0, jobs[-1].prompt, jobs[-1].max_tokens)], 1)
    eng.reset_prefix_cache()
    fields = run_workload(eng, jobs, level)
    fields["single_stream_tok_s"] = single["output_throughput"]
    fields["throughput_vs_single"] = ratio(fields["output_throughput"], single["output_throughput"])
    fields["settings"] = {k: v for k, v in eng.settings().items()
                          if k in ("kv_cache_dtype", "enable_prefix_caching", "proposer", "num_speculative_tokens",
                                   "kv_pool_blocks", "compile", "threads")}
    return fields


def run_workload(eng, jobs: list[Job], max_concurrency: int) -> dict:
    """Submit each job at its arrival time (at most max_concurrency outstanding), step the
    engine until all finish; the serving figures (engine.workload.WorkloadRun)."""
    return run_to_completion(eng, jobs, max_concurrency)


def make_workload(eng, args):
    """A function giving the same jobs every time it is called (each arm serves the same ones)."""
    jobs = make_jobs(eng, workload_of(args))
    return lambda: list(jobs)


def workload_of(args) -> Workload:
    """The command line's workload (a bad value is refused with the field's range)."""
    rate = None if args.request_rate == float("inf") else args.request_rate
    return Workload(num_prompts=args.num_prompts, request_rate=rate, burstiness=args.burstiness,
                    max_concurrency=args.max_concurrency, shared_prefix_len=args.shared_prefix_len,
                    prompt_set=args.prompts_set or "chat", input_len=args.input_len, output_len=args.output_len,
                    seed=args.seed)


def concurrency_levels(args) -> list[int]:
    """--sweep-concurrency 1,4,16 as [1, 4, 16]; without it, [--max-concurrency]."""
    return [int(c) for c in args.sweep_concurrency.split(",")] if args.sweep_concurrency else [args.max_concurrency]


PROFILE_KEY = "profile"       # --compare profile=A,B: two session profiles' engine settings


@dataclass(frozen=True)
class ProfileArm:
    """One arm of --compare profile=A,B: the profile as given (a name or a path), its file, and it."""
    label: str
    path: Path
    profile: SessionProfile

    def __str__(self) -> str:
        return self.label


def parse_compare(text: str) -> tuple[str, list]:
    key, _, values = text.partition("=")
    arms = values.split(",")
    setting = BY_KEY.get(key)
    if (setting is None and key != PROFILE_KEY) or len(arms) != 2 or not all(arms):
        raise ConfigError("--compare takes KEY=A,B with KEY a setting (e.g. kv_cache_dtype=auto,fp8_e4m3) or "
                          f"profile (profile=baseline,all_optimizations: profile names or files), got {text!r}")
    parsed = [profile_arm(v) for v in arms] if key == PROFILE_KEY else [_value(setting, v) for v in arms]
    if _label(parsed[0]) == _label(parsed[1]):
        raise ConfigError(f"--compare {key}: the two arms are the same ({arms[0]!r}); give two different ones")
    return key, parsed


def profile_arm(text: str) -> ProfileArm:
    """A --compare profile arm: a saved or built-in profile's name, or a profile file's path."""
    try:
        profile, path = find_profile(text)
    except ProfileError as exc:
        raise ConfigError(f"--compare profile: {exc}") from exc
    return ProfileArm(text, path, profile)


# Sampling the workload's requests set themselves (--output-len, EOS ignored); the others take
# SamplingParams' defaults there (greedy), whatever a profile says.
WORKLOAD_SAMPLING = ("max_tokens", "stop_on_eos")


def profile_report(eng, arm: ProfileArm, held: dict, args) -> dict:
    """A profile arm's profile, every engine setting it ran with (read back from the engine), and
    what the profile asks for that this run does not do, each with why."""
    ran = {key: getattr(eng.config, key) for key in arm.profile.engine_settings()}
    return {"name": arm.profile.name, "source": str(arm.path), "config": ran,
            "not_applied": not_applied(eng, arm.profile, held, args)}


def not_applied(eng, profile: SessionProfile, held: dict, args) -> dict[str, str]:
    asked, out = profile.engine_config(), {}
    from engine.bench.model_flags import model_path
    model = model_path(args) or "default"         # --model, or --synthetic's checkpoint
    if profile.model != model:
        out["model"] = f"{profile.model!r}: this run serves {model!r}"
    if profile.backend != "local":
        out["backend"] = f"{profile.backend!r}: this run serves the local engine (a server: --backend URL)"
    for key in settings_table.keys(settings_table.ENGINE, applies=(settings_table.LOAD,)):
        if getattr(asked, key) != getattr(eng.config, key):
            out[key] = f"{getattr(asked, key)!r}: set when a model loads; this run has {getattr(eng.config, key)!r}"
    for key, value in held.items():
        if getattr(asked, key) != value:
            out[key] = f"{getattr(asked, key)!r}: --{key.replace('_', '-')} {value} holds for both arms"
    workload, wanted = SamplingParams(), profile.sampling_params()
    for key in settings_table.keys(settings_table.SAMPLING):
        if key not in WORKLOAD_SAMPLING and getattr(wanted, key) != getattr(workload, key):
            out[key] = f"{getattr(wanted, key)!r}: the workload's requests have {getattr(workload, key)!r} (both arms)"
    in_effect = "auto" if eng.config.proposer == "auto" else eng.speculator.proposer_in_effect()   # auto picks per step
    if profile.proposer != in_effect:
        missing = "no draft model (draft_model)" if profile.proposer == "draft" else "no EAGLE head"
        out["proposer"] = f"{profile.proposer!r}: {missing} to propose with, so {in_effect!r} ran"
    return out


def _value(setting, text: str):
    if setting.type is bool:
        if text.lower() not in ("true", "false", "on", "off", "1", "0"):
            raise ConfigError(f"{setting.key} takes true or false, got {text!r}")
        return text.lower() in ("true", "on", "1")
    if text.lower() == "none" and setting.optional:
        return None
    return setting.validate(setting.type(text))


def _label(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _arms_or_fields(arms: dict, key) -> dict:
    if key is None:
        return next(iter(arms.values()))
    a, b = arms.values()
    return {"arms": arms, "ratio": {k: ratio(b[k], a[k]) for k in a
                                    if isinstance(a[k], (int, float)) and isinstance(b.get(k), (int, float))
                                    and not isinstance(a[k], bool)}}
