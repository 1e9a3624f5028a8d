"""Engine settings as validated dataclasses. Everything the user can change lives here."""
from __future__ import annotations

from dataclasses import dataclass, field, replace, asdict

from engine.errors import ConfigError

KV_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8_e4m3")
PROPOSERS = ("off", "draft", "ngram")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
MAX_SPEC_TOKENS = 16


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding. `draft_model` is a model reference for the loader
    ("default-draft", a folder, a GGUF file, or the target itself via "self")."""
    proposer: str = "off"
    num_speculative_tokens: int = 4
    draft_model: str | None = None
    ngram_max: int = 4
    ngram_min: int = 1

    def __post_init__(self):
        if self.proposer not in PROPOSERS:
            raise ConfigError(f"speculative proposer must be one of {PROPOSERS}, got {self.proposer!r}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPEC_TOKENS:
            raise ConfigError(f"k (speculative tokens) must be in 1..{MAX_SPEC_TOKENS}, got {self.num_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ConfigError(f"n-gram sizes must satisfy 1 <= min <= max, got {self.ngram_min}..{self.ngram_max}")


@dataclass(frozen=True)
class EngineConfig:
    """Cache and runtime settings. `kv_cache_dtype="auto"` means the model dtype.

    `kv_cache_bytes` bounds the pool; `num_blocks` (if set) overrides it."""
    device: str = "auto"
    dtype: str = "auto"                      # model dtype: auto = bf16 on CUDA, fp32 on CPU
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    kv_cache_bytes: int = 512 * 2**20
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    max_model_len: int | None = None         # None: the model's max_position_embeddings
    attention_backend: str = "auto"
    spec: SpecConfig = field(default_factory=SpecConfig)

    def __post_init__(self):
        if self.kv_cache_dtype not in KV_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {KV_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            raise ConfigError(f"block_size must be a power of two in 1..256, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.kv_cache_bytes < 1:
            raise ConfigError("kv_cache_bytes must be positive")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if isinstance(self.spec, dict):
            object.__setattr__(self, "spec", SpecConfig(**self.spec))

    def with_changes(self, **changes) -> "EngineConfig":
        spec_changes = {k: changes.pop(k) for k in list(changes) if k in SpecConfig.__dataclass_fields__}
        spec = replace(self.spec, **spec_changes) if spec_changes else self.spec
        return replace(self, spec=changes.pop("spec", spec), **changes)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy. top_k 0 and top_p 1.0 disable those filters."""
    max_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_on_eos: bool = True

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
