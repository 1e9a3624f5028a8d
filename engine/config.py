"""Every setting a user can change, defined once.

`SETTINGS` is the one table: key, type, default, range or choices, and when a change
takes effect. `EngineConfig` and `SamplingParams` are built from it, `LLMEngine.reconfigure`
routes changes by it, session profiles store and migrate it, and the app's settings panel
builds its controls from it. A new setting is one new row here, nowhere else.
"""
from __future__ import annotations

from dataclasses import dataclass, field, make_dataclass, replace
from functools import lru_cache
from typing import Any

from engine.errors import ConfigError

# When a change takes effect.
LIVE = "live"                   # at the next step, even in the middle of a reply
NEXT_REQUEST = "next request"   # when the running reply ends (reallocates the cache, loads a draft)
LOAD = "load"                   # when a model is loaded
LOADED = "as loaded"            # Setting.exact: the value the loaded model has

# The settings panel's groups, in order.
SPECULATION_GROUP, CACHE_GROUP, SAMPLING_GROUP = "Speculative decoding", "KV cache", "Sampling (next message)"
RUNTIME_GROUP = "Runtime"

# Which object holds a setting.
ENGINE = "engine"               # EngineConfig: the engine's own settings
SAMPLING = "sampling"           # SamplingParams: per request
SESSION = "session"             # only the profile holds it (the model reference, the system prompt)


@dataclass(frozen=True)
class Setting:
    key: str
    type: type                   # bool, int, float or str
    default: Any
    section: str
    applies: str
    label: str
    choices: dict | None = None  # allowed value -> what the UI calls it
    low: float | None = None     # inclusive range for numbers
    high: float | None = None
    optional: bool = False       # None is allowed (and means "not set")
    step: float | None = None    # the UI's increment for floats
    off_text: str | None = None  # what the UI shows for None (optional) or the lowest value ("off")
    group: str | None = None     # the settings panel's group for it (None: not in the panel)
    rebuilds_pool: bool = False  # a change reallocates the KV pool (and drops the prefix cache)
    help: str = ""
    # A setting that changes what the model computes (engine.quality measures what it costs):
    # its most exact value, the quality reference's (LOADED: the value the model was loaded with).
    exact: Any = None

    @property
    def lossy(self) -> bool:
        return self.exact is not None

    def validate(self, value):
        """The value as stored (ints accepted for floats), or ConfigError naming the setting."""
        if value is None:
            if self.optional:
                return None
            raise ConfigError(f"{self.key} must be set")
        if not self.accepts_type(value):
            raise ConfigError(f"{self.key} must be {self.type.__name__}, got {value!r}")
        value = self.type(value)
        if self.choices is not None and value not in self.choices:
            raise ConfigError(f"{self.key} must be one of {tuple(self.choices)}, got {value!r}")
        if self.low is not None and value < self.low or self.high is not None and value > self.high:
            raise ConfigError(f"{self.key} ({self.label}) must be in {_num(self.low)}..{_num(self.high)}, got {value!r}")
        return value

    def accepts_type(self, value) -> bool:
        # bool is an int in Python, but `true` is not a token count; a float takes an int.
        if isinstance(value, bool):
            return self.type is bool
        return isinstance(value, int if self.type is int else (int, float) if self.type is float else self.type)


def _num(x) -> str:
    return "" if x is None else f"{x:g}"


MAX_SPEC_TOKENS = 16


@dataclass(frozen=True)
class TreeShape:
    """What the `draft_tree` setting asks for: top-k per expansion, depth, nodes verified."""
    top_k: int
    depth: int
    nodes: int

    def __str__(self) -> str:
        return f"{self.top_k}:{self.depth}:{self.nodes}"


# `auto`: the tree EAGLE-2 would grow on a small budget; the engine then verifies the best
# nodes of it that the measured pass costs say pay (engine.speculative.policy).
AUTO_SHAPE = TreeShape(top_k=4, depth=6, nodes=24)
MAX_TREE_NODES = 64


@lru_cache(maxsize=64)        # asked every engine step; a shape is immutable
def parse_tree(value: str) -> TreeShape | None:
    """The `draft_tree` setting: "off" (None), "auto", or "TOPK:DEPTH:NODES" (e.g. "4:6:24")."""
    text = str(value).strip().lower()
    if text == "off":
        return None
    if text == "auto":
        return AUTO_SHAPE
    try:
        top_k, depth, nodes = (int(x) for x in text.split(":"))
    except ValueError:
        raise ConfigError(f"draft tree {value!r}: give off, auto or TOPK:DEPTH:NODES, e.g. 4:6:24") from None
    if not (1 <= top_k <= 16 and 1 <= depth <= 16 and 1 <= nodes <= MAX_TREE_NODES):
        raise ConfigError(f"draft tree {value!r}: top-k 1..16, depth 1..16 and nodes 1..{MAX_TREE_NODES}")
    if nodes < depth and top_k == 1:
        raise ConfigError(f"draft tree {value!r}: a top-1 tree is a chain of `depth` nodes")
    return TreeShape(top_k, depth, nodes)

# Device-dependent defaults of max_num_seqs / max_num_batched_tokens (None in the table).
# On a small CPU a step of 256 prefill tokens already takes a few hundred ms: more would
# stall the other requests' decoding for longer than a chat user waits between words.
SCHEDULER_DEFAULTS = {"cpu": (32, 256), "cuda": (256, 8192)}


def _scheduler_default(i: int) -> str:
    """SCHEDULER_DEFAULTS' i-th figure per device, for a setting's help text."""
    return ", ".join(f"{values[i]} on {'the CPU' if device == 'cpu' else 'CUDA'}"
                     for device, values in SCHEDULER_DEFAULTS.items())


BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)

SETTINGS: tuple[Setting, ...] = (
    # ---- session (profile only) ----
    Setting("name", str, "untitled", SESSION, NEXT_REQUEST, "Profile name"),
    Setting("model", str, "default", SESSION, LOAD, "Model",
            help="'default' (the embedded SmolLM2-135M-Instruct), a Hugging Face folder or a .gguf file"),
    Setting("system_prompt", str, "You are a helpful assistant.", SESSION, NEXT_REQUEST, "System prompt"),
    Setting("backend", str, "local", SESSION, LOAD, "Backend",
            choices={"local": "the local engine", "remote": "an OpenAI-compatible server"}),
    Setting("server_url", str, None, SESSION, LOAD, "Server URL", optional=True),
    Setting("server_model", str, None, SESSION, LOAD, "Served model", optional=True,
            help="None: the server's only model"),
    Setting("api_key_env", str, None, SESSION, LOAD, "API key variable", optional=True,
            help="the NAME of the environment variable holding the server's API key; the key is never saved"),
    # ---- speculative decoding ----
    Setting("proposer", str, "off", ENGINE, LIVE, "Proposer",
            choices={"off": "Off", "draft": "Draft model", "eagle": "EAGLE head", "ngram": "N-gram (prompt lookup)",
                     "suffix": "Suffix (earlier text and replies)", "assistant": "Gemma 4 assistant",
                     "auto": "Auto (the one that pays, measured)"},
            help="assistant: a Gemma 4 target drafts with its shipped assistant, loaded through the draft model "
            "slot (draft_model: a folder whose config.json says gemma4_assistant; it reads the target's hidden "
            "states and KV, so it has no cache of its own); auto: each step drafts with the proposer whose "
            "measured tokens per second is highest (suffix, n-gram, the EAGLE head where one fits the model, the "
            "draft model or the assistant where one is loaded), or none; each is measured again every so often "
            "(engine.speculative.proposer_choice)",
            group=SPECULATION_GROUP),
    Setting("num_speculative_tokens", int, 4, ENGINE, LIVE, "k (draft tokens)", low=1, high=MAX_SPEC_TOKENS,
            help="draft tokens proposed per step, verified in one target pass", group=SPECULATION_GROUP),
    Setting("draft_model", str, None, ENGINE, NEXT_REQUEST, "Draft model", optional=True,
            help="'self', 'self:N' (the target's first N layers), a folder or a .gguf (for the default model, the "
            "EAGLE head is the shipped draft: proposer 'eagle'); a Gemma 4 assistant's folder loads the assistant "
            "(proposer 'assistant', or 'draft')",
            group=SPECULATION_GROUP),
    Setting("eagle_head", str, None, ENGINE, LIVE, "EAGLE head", optional=True, off_text="shipped",
            help="a folder made by python -m engine.training.distill; None: the head shipped for the default model",
            group=SPECULATION_GROUP),
    Setting("speculation_policy", str, "auto", ENGINE, LIVE, "Draft tokens per step",
            choices={"auto": "by batch size (measured)", "fixed": "always k"},
            help="auto: each step verifies the k (up to the k above, 0 included) that the measured pass and draft "
            "costs at the current batch size say is fastest; fixed: always k"),
    Setting("draft_tree", str, "off", ENGINE, LIVE, "Draft tree",
            help="off: a chain of k tokens; auto: an EAGLE-2 tree (top-4, depth 6, up to 24 nodes), trimmed each step "
            "to the nodes the measured pass costs say pay; or TOPK:DEPTH:NODES, e.g. 4:6:24. The EAGLE head and the "
            "draft model grow trees; n-gram stays a chain; suffix always drafts a tree, of at most k nodes when off",
            group=SPECULATION_GROUP),
    Setting("ngram_min", int, 1, ENGINE, LIVE, "N-gram min", low=1, high=16, group=SPECULATION_GROUP),
    Setting("ngram_max", int, 4, ENGINE, LIVE, "N-gram max", low=1, high=16, group=SPECULATION_GROUP),
    Setting("suffix_spec_factor", float, 1.0, ENGINE, LIVE, "Suffix drafts per matched token", low=0.1, high=16.0,
            step=0.1, help="suffix proposer: a match of m tokens drafts at most this x m tokens (and at most k)",
            group=SPECULATION_GROUP),
    Setting("suffix_min_prob", float, 0.1, ENGINE, LIVE, "Suffix probability floor", low=0.0, high=1.0, step=0.05,
            help="suffix proposer: a token is drafted only if at least this share of the match's occurrences "
            "continued with it", group=SPECULATION_GROUP),
    Setting("suffix_cache_tokens", int, 1 << 18, ENGINE, LIVE, "Suffix cache (tokens)", low=0, high=1 << 26,
            off_text="off", help="suffix proposer: earlier replies' tokens kept for matching, oldest replies "
            "dropped first (0: only the request's own text)"),
    # ---- KV cache ----
    Setting("kv_cache_dtype", str, "auto", ENGINE, NEXT_REQUEST, "Cache dtype",
            choices={"auto": "Model dtype (auto)", "fp8_when_short": "FP8 E4M3 when the pool runs short",
                     "fp8_e4m3": "FP8 E4M3",
                     "fp8_e4m3_hadamard": "FP8 E4M3, Hadamard-rotated", "bfloat16": "bfloat16",
                     "float16": "float16", "float32": "float32"}, group=CACHE_GROUP, rebuilds_pool=True, exact="auto",
            help="FP8 when short: the model's dtype until the pool in it holds less than one full context, "
            "or a request is preempted for want of blocks; then FP8 (half the bytes or less), rebuilt when idle"),
    Setting("block_size", int, 16, ENGINE, NEXT_REQUEST, "Block size", choices={b: str(b) for b in BLOCK_SIZES},
            help="tokens per KV block; prefix caching reuses whole blocks", group=CACHE_GROUP, rebuilds_pool=True),
    Setting("enable_prefix_caching", bool, True, ENGINE, LIVE, "Prefix caching", group=CACHE_GROUP),
    Setting("kv_cache_bytes", int, None, ENGINE, NEXT_REQUEST, "KV pool bytes", low=1, optional=True,
            off_text="auto", help="auto: the memory plan sizes the pool (CUDA: what gpu_memory_fraction leaves "
            "after the weights and an activation reserve; CPU: RAM/32)", rebuilds_pool=True),
    Setting("num_blocks", int, None, ENGINE, NEXT_REQUEST, "KV pool blocks", low=1, optional=True,
            off_text="from bytes", help="overrides kv_cache_bytes when set", rebuilds_pool=True),
    Setting("attention_backend", str, "auto", ENGINE, NEXT_REQUEST, "Attention",
            choices={"auto": "auto", "torch": "torch (reference)", "triton": "Triton kernels"}, rebuilds_pool=True),
    Setting("compile", str, "auto", ENGINE, NEXT_REQUEST, "Compiled step",
            choices={"off": "off (eager)", "on": "on (torch.compile)", "auto": "auto"},
            help="run every pass through one torch.compile'd step (about a minute the first time on a 2-core CPU, "
            "seconds later from the disk cache); every pass of every request takes it, so a reply does not depend "
            "on its company. auto and on: compiled wherever the compiler runs (engine.runtime.compiled_step)",
            group=RUNTIME_GROUP),
    # ---- many requests at once (engine.scheduler) ----
    Setting("max_num_seqs", int, None, ENGINE, LIVE, "Max sequences", low=1, high=4096, optional=True,
            off_text="auto", help="requests running at once; auto: " + _scheduler_default(0)),
    Setting("max_num_batched_tokens", int, None, ENGINE, LIVE, "Tokens per step", low=1, high=1_000_000,
            optional=True, off_text="auto",
            help="the token budget of one step (decodes and drafts first, then prefill chunks); "
            "auto: " + _scheduler_default(1)),
    # ---- load time ----
    Setting("device", str, "auto", ENGINE, LOAD, "Device", help="auto = CUDA when present, else the CPU"),
    Setting("gpu_memory_fraction", float, 0.9, ENGINE, LOAD, "GPU memory fraction", low=0.05, high=1.0, step=0.05,
            help="the share of the GPU's memory the engine may use (weights, KV pool, activations), "
            "as vLLM's gpu_memory_utilization"),
    Setting("dtype", str, "auto", ENGINE, LOAD, "Weights dtype",
            choices={"auto": "auto", "float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}, exact=LOADED,
            help="auto = bf16 on CUDA; on the CPU the dtype whose decode step runs the model faster, measured "
                 "once per CPU and model format (engine.runtime.cpu_dtype)"),
    Setting("weight_dtype", str, "auto", ENGINE, LOAD, "Weights as served",
            choices={"auto": "as stored (a 4-bit GGUF stays 4-bit)", "float": "dequantized (the dtype above)",
                     "int8": "int8 (per channel)", "int4": "int4 (groups of 32)"}, exact="float",
            help="auto: a GGUF's or AWQ/GPTQ checkpoint's quantized weights run as stored where a kernel takes "
            "them (Q4_K, Q5_K, Q6_K in their super-blocks; Q4_0, Q4_1, AWQ, GPTQ as int4; Q5_0, Q5_1, Q8_0 as 8-bit "
            "groups); every other weight in the dtype above. "
            "int8 / int4: every linear quantized at load (round-to-nearest), a 4-bit GGUF's tensors kept as stored. "
            "CPU kernels only in this release (engine.loading.weight_quant)"),
    Setting("max_model_len", int, None, ENGINE, LOAD, "Context length", low=1, optional=True,
            off_text="the model's", help="None: the model's max_position_embeddings"),
    # ---- sampling (the next message) ----
    Setting("temperature", float, 0.0, SAMPLING, NEXT_REQUEST, "Temperature", low=0.0, high=5.0, step=0.05,
            help="0 = greedy", group=SAMPLING_GROUP),
    Setting("top_p", float, 1.0, SAMPLING, NEXT_REQUEST, "Top-p", low=0.01, high=1.0, step=0.05, group=SAMPLING_GROUP),
    Setting("top_k", int, 0, SAMPLING, NEXT_REQUEST, "Top-k", low=0, high=100_000, off_text="off", group=SAMPLING_GROUP),
    Setting("max_tokens", int, 256, SAMPLING, NEXT_REQUEST, "Max tokens", low=1, high=131_072, group=SAMPLING_GROUP),
    Setting("seed", int, None, SAMPLING, NEXT_REQUEST, "Seed", low=0, high=2**31 - 1, optional=True,
            off_text="random", help="not set: a new random seed for every reply", group=SAMPLING_GROUP),
    Setting("stop_on_eos", bool, True, SAMPLING, NEXT_REQUEST, "Stop at end of sequence"),
)
BY_KEY: dict[str, Setting] = {s.key: s for s in SETTINGS}


def keys(section: str | None = None, applies: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """Setting keys, in table order, filtered by section and/or when they apply."""
    return tuple(s.key for s in SETTINGS
                 if (section is None or s.section == section) and (applies is None or s.applies in applies))


def groups() -> dict[str, tuple[str, ...]]:
    """The settings panel's groups: title -> keys, in table order."""
    out: dict[str, tuple[str, ...]] = {}
    for s in SETTINGS:
        if s.group is not None:
            out[s.group] = out.get(s.group, ()) + (s.key,)
    return out


def validate(key: str, value):
    setting = BY_KEY.get(key)
    if setting is None:
        raise ConfigError(f"unknown setting {key!r}; known settings: {', '.join(BY_KEY)}")
    return setting.validate(value)


def _fields(section: str) -> list:
    return [(s.key, s.type if not s.optional else s.type | None, field(default=s.default))
            for s in SETTINGS if s.section == section]


class _Validated:
    """__post_init__ checks every field against its row of SETTINGS."""
    def __post_init__(self):
        for key in self.__dataclass_fields__:
            object.__setattr__(self, key, validate(key, getattr(self, key)))
        self._check()

    def _check(self) -> None:
        pass

    def with_changes(self, **changes):
        return replace(self, **changes)


class _EngineChecks(_Validated):
    def _check(self) -> None:
        if self.ngram_min > self.ngram_max:
            raise ConfigError(f"n-gram sizes must satisfy min <= max, got {self.ngram_min}..{self.ngram_max}")
        parse_tree(self.draft_tree)


class _SamplingChecks(_Validated):
    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


EngineConfig = make_dataclass("EngineConfig", _fields(ENGINE), bases=(_EngineChecks,), frozen=True,
                              namespace={"__doc__": "The engine's settings (the ENGINE rows of SETTINGS)."})
SamplingParams = make_dataclass("SamplingParams", _fields(SAMPLING), bases=(_SamplingChecks,), frozen=True,
                                namespace={"__doc__": "One request's sampling (the SAMPLING rows of SETTINGS). "
                                           "temperature 0 is greedy; top_k 0 and top_p 1 disable those filters."})
for _cls in (EngineConfig, SamplingParams):
    _cls.__module__ = __name__
