"""What differs between OpenAI-compatible servers: one row per kind.

For each kind: the flag that turns on /metrics, the launch flags that fix each of our
settings (shown read-only, with the flag, in settings()), the settings a request can carry
instead, the extra request fields that make the stream report per-chunk numbers, the
endpoint that resets the prefix cache, and where its launch settings can be read back.
A kind is detected from /metrics names or /props (engine.remote.backend), or chosen by the user.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.remote.server_metrics import parse_samples

VLLM, SGLANG, LLAMACPP, OPENAI = "vllm", "sglang", "llama.cpp", "openai"
LAUNCH_KEYS = ("kv_cache_dtype", "proposer", "num_speculative_tokens", "enable_prefix_caching")


@dataclass(frozen=True)
class ServerKind:
    name: str
    label: str
    metrics_flag: str                        # how /metrics is turned on
    launch_flags: dict[str, str]             # setting key -> the launch flag that sets it
    per_request: dict[str, str] = field(default_factory=dict)   # setting key -> request body field
    stream_fields: dict = field(default_factory=dict)           # extra body fields for streamed numbers
    reset_endpoint: str | None = None        # POST path that drops the prefix cache
    reset_note: str = ""                     # what the server needs for that endpoint
    info_path: str | None = None             # GET path with version / launch settings (JSON)
    drafts_per_request: bool = False         # the stream counts a request's drafts (llama.cpp timings.draft_n)


KINDS: dict[str, ServerKind] = {k.name: k for k in (
    ServerKind(
        VLLM, "vLLM", "always on at /metrics",
        {"kv_cache_dtype": "--kv-cache-dtype fp8",
         "proposer": "--speculative-config '{\"method\": \"eagle\"|\"ngram\"|\"draft_model\", ...}'",
         "num_speculative_tokens": "--speculative-config '{..., \"num_speculative_tokens\": k}'",
         "enable_prefix_caching": "--enable-prefix-caching / --no-enable-prefix-caching"},
        stream_fields={"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        reset_endpoint="/reset_prefix_cache", reset_note="start vLLM with VLLM_SERVER_DEV_MODE=1",
        info_path="/version"),
    ServerKind(
        SGLANG, "SGLang", "--enable-metrics",
        {"kv_cache_dtype": "--kv-cache-dtype fp8_e4m3",
         "proposer": "--speculative-algorithm EAGLE|EAGLE3|STANDALONE|NGRAM (+ --speculative-draft-model-path)",
         "num_speculative_tokens": "--speculative-num-draft-tokens k",
         "enable_prefix_caching": "on unless --disable-radix-cache"},
        stream_fields={"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        reset_endpoint="/flush_cache", info_path="/get_server_info"),
    ServerKind(
        LLAMACPP, "llama.cpp server", "--metrics",
        {"kv_cache_dtype": "--cache-type-k / --cache-type-v (f16, q8_0, ...)",
         "proposer": "-md <draft.gguf> --spec-type draft-simple",
         "num_speculative_tokens": "--spec-draft-n-max k (a request may lower it)",
         "enable_prefix_caching": "per request (cache_prompt); --cache-reuse for shifted prefixes"},
        per_request={"enable_prefix_caching": "cache_prompt", "num_speculative_tokens": "speculative.n_max"},
        stream_fields={"stream_options": {"include_usage": True}, "timings_per_token": True},
        reset_endpoint="/slots/{id}?action=erase", reset_note="start llama-server with --slot-save-path DIR; its RAM prompt cache "
        "(--cache-ram, on by default) keeps copies that erasing the slots does not drop: --cache-ram 0 for a full reset",
        info_path="/props", drafts_per_request=True),
    ServerKind(OPENAI, "OpenAI-compatible server", "none known", {},
               stream_fields={"stream_options": {"include_usage": True}}),
)}


def kind_of_props(props: dict) -> str | None:
    """llama.cpp's GET /props has these; other servers answer 404."""
    return LLAMACPP if isinstance(props, dict) and "default_generation_settings" in props else None


def launch_settings(kind: str, info: dict | None, metrics_text: str | None,
                    slots: list | None = None) -> tuple[dict, str | None]:
    """(settings fixed at launch, server version) from the kind's info endpoint, /metrics
    and (llama.cpp) /slots; a value the server does not reveal is None."""
    settings = dict.fromkeys(LAUNCH_KEYS)
    if kind == LLAMACPP:
        found, version = _llamacpp(info or {}, slots)
    elif kind in (VLLM, SGLANG):
        found, version = (_vllm if kind == VLLM else _sglang)(info or {}, metrics_text or "")
    else:
        return settings, None
    settings.update(found)
    return settings, version


def _llamacpp(props: dict, slots: list | None) -> tuple[dict, str | None]:
    """/props names the speculative types only when they are not the launch default, so
    whether a slot speculates comes from /slots (its `speculative` flag)."""
    spec = props.get("default_generation_settings", {}).get("params", {}).get("speculative.types")
    speculating = [bool(s.get("speculative")) for s in slots or [] if isinstance(s, dict)]
    if spec and spec != "none":
        proposer = spec
    elif speculating:
        proposer = "draft" if any(speculating) else "off"
    else:
        proposer = None
    return {"proposer": proposer}, props.get("build_info")


def _vllm(version_info: dict, metrics_text: str) -> tuple[dict, str | None]:
    found = {}
    for name, labels, _ in parse_samples(metrics_text) if metrics_text else ():
        if name == "vllm:cache_config_info":
            found["kv_cache_dtype"] = labels.get("cache_dtype")
            if "enable_prefix_caching" in labels:
                found["enable_prefix_caching"] = labels["enable_prefix_caching"] == "True"
        elif name == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
            k = int(labels.get("position", -1)) + 1
            found["num_speculative_tokens"] = max(k, found.get("num_speculative_tokens") or 0)
            found["proposer"] = "on"
    if metrics_text and "proposer" not in found:
        found["proposer"] = "off"     # vLLM exports spec_decode series only when it speculates (0.32, seen)
    return found, version_info.get("version")


def _sglang(info: dict, metrics_text: str) -> tuple[dict, str | None]:
    args = info.get("server_args", info)     # newer versions nest the launch arguments
    algorithm = args.get("speculative_algorithm")
    found = {"kv_cache_dtype": args.get("kv_cache_dtype"),
             "proposer": algorithm if algorithm else ("off" if "speculative_algorithm" in args else None),
             "num_speculative_tokens": args.get("speculative_num_draft_tokens")}
    if "disable_radix_cache" in args:
        found["enable_prefix_caching"] = not args["disable_radix_cache"]
    return found, info.get("version")
