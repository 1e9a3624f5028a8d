"""Random-weight checkpoints of real architectures, written from a config alone (no hub).

`write_checkpoint(folder, "qwen3-1.7b")` writes what a Hugging Face model folder holds:
config.json (transformers' own config class), safetensors shards with transformers' tensor
names (plus model.safetensors.index.json when there is more than one shard), and the
tokenizer files and chat template of the embedded default model. The weights are random:
normal(0, initializer_range) as transformers initialises them, norms 1. They serve to
measure speed and memory at real shapes, and as small fast test models ("tiny").

Memory stays small at any size: tensors are generated and written a slice at a time into
a safetensors file whose header is computed up front from the shapes. Each tensor has its
own generator, seeded from (seed, name), so the values do not depend on the sharding.

Command line: python -m engine.loading.synthetic PRESET OUT [--dtype bfloat16] [--seed 0]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.models.hybrid import is_hybrid
from engine.models.moe import expert_intermediate, is_sparse_layer, num_experts

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

PRESETS: dict[str, dict] = {
    "llama-3.2-1b": dict(model_type="llama", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, intermediate_size=8192, vocab_size=128256,
                         max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                         rope_scaling=_LLAMA3_ROPE, tie_word_embeddings=True),
    "qwen3-1.7b": dict(model_type="qwen3", hidden_size=2048, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, intermediate_size=6144, vocab_size=151936,
                       max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                       tie_word_embeddings=True),
    # Qwen3-8B's config.json: untied head
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, intermediate_size=12288, vocab_size=151936,
                     max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                     tie_word_embeddings=False),
    # Qwen3-14B's config.json: untied head
    "qwen3-14b": dict(model_type="qwen3", hidden_size=5120, num_hidden_layers=40, num_attention_heads=40,
                      num_key_value_heads=8, head_dim=128, intermediate_size=17408, vocab_size=151936,
                      max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                      tie_word_embeddings=False),
    # The default model's vocabulary, so its tokenizer fits. Untied: with a tied head a
    # random model mostly predicts the token it just read, and greedy output goes constant.
    "tiny": dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=49152,
                 max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
                 tie_word_embeddings=False),
}
PRESETS["tiny-qwen3"] = {**PRESETS["tiny"], "model_type": "qwen3"}
# Mixture-of-experts models as workstations run them (config.json of the released checkpoints)
_GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096, "rope_theta": 150000.0}
PRESETS["qwen3-30b-a3b"] = dict(
    model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
    head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936,
    max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False)
PRESETS["gpt-oss-20b"] = dict(
    model_type="gpt_oss", hidden_size=2880, num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8,
    head_dim=64, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4, vocab_size=201088,
    sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 12, attention_bias=True,
    max_position_embeddings=131072, rms_norm_eps=1e-5, rope_parameters=_GPT_OSS_ROPE, swiglu_limit=7.0,
    tie_word_embeddings=False)
PRESETS["tiny-qwen3-moe"] = {**PRESETS["tiny"], "model_type": "qwen3_moe", "moe_intermediate_size": 32,
                             "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True}
PRESETS["tiny-gpt-oss"] = {**PRESETS["tiny"], "model_type": "gpt_oss", "intermediate_size": 32,
                           "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": 8,
                           "layer_types": ["sliding_attention", "full_attention"], "attention_bias": True,
                           "rope_parameters": {**_GPT_OSS_ROPE, "original_max_position_embeddings": 64}}

# Hybrid linear-attention models (engine.models.qwen3_5). Their sizes are transformers' default
# configs, which its docstrings call "Qwen3.5-9B style" and "Qwen3-Next-80B-A3B style".
_HYBRID = dict(linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
               linear_num_value_heads=32, head_dim=256, max_position_embeddings=32768, rms_norm_eps=1e-6,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
               tie_word_embeddings=False)
PRESETS["qwen3.5-9b"] = dict(_HYBRID, model_type="qwen3_5_text", hidden_size=4096, num_hidden_layers=32,
                             num_attention_heads=16, num_key_value_heads=4, intermediate_size=12288, vocab_size=248320)
PRESETS["qwen3-next-80b-a3b"] = dict(
    _HYBRID, model_type="qwen3_next", hidden_size=2048, num_hidden_layers=48, num_attention_heads=16,
    num_key_value_heads=2, intermediate_size=5632, vocab_size=151936, num_experts=512, num_experts_per_tok=10,
    moe_intermediate_size=512, shared_expert_intermediate_size=512, decoder_sparse_step=1, norm_topk_prob=True,
    mlp_only_layers=[])
# three linear-attention layers and a full one; 2 key heads for 4 value heads
PRESETS["tiny-qwen3.5"] = {**PRESETS["tiny"], "model_type": "qwen3_5_text", "num_hidden_layers": 4,
                           "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                           "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                           "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                               "partial_rotary_factor": 0.25}}
PRESETS["tiny-qwen3-next"] = {**PRESETS["tiny-qwen3.5"], "model_type": "qwen3_next", "num_experts": 8,
                              "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                              "shared_expert_intermediate_size": 48, "mlp_only_layers": [1]}

# Gemma 4 (engine.models.gemma4): sliding and full layers with a wider head, the last two reusing
# earlier layers' KV (with double-wide MLPs), per-layer embeddings
PRESETS["tiny-gemma4"] = {**PRESETS["tiny"], "model_type": "gemma4_text", "num_hidden_layers": 5, "global_head_dim": 32,
                          "intermediate_size": 96, "sliding_window": 4, "num_kv_shared_layers": 2,
                          "layer_types": ["sliding_attention", "full_attention", "sliding_attention",
                                          "sliding_attention", "full_attention"],
                          "use_double_wide_mlp": True, "hidden_size_per_layer_input": 8,
                          "vocab_size_per_layer_input": 49152, "rms_norm_eps": 1e-6}

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",       # model_type -> class
                 "qwen3_moe": "Qwen3MoeForCausalLM", "gpt_oss": "GptOssForCausalLM",
                 "qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_next": "Qwen3NextForCausalLM",
                 "gemma4_text": "Gemma4ForCausalLM"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "tokenizer.model", "chat_template.jinja")
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
DEFAULT_MAX_SHARD_BYTES = 2 * 2**30
SLICE_ELEMENTS = 2**24          # generate and write at most this many values at a time
INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    init: str                   # "normal" (std = initializer_range), "ones" or "zeros" (a (1 + w) norm's)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


# ---- the plan: config -> tensor groups -> shards -----------------------------------
def make_config(preset: str | dict):
    """A transformers config from a preset name, or a dict of config fields; a dict with
    "preset" starts from that preset: {"preset": "tiny", "model_type": "qwen3"}."""
    from transformers import AutoConfig
    fields = dict(_preset_fields(preset))
    model_type = fields.pop("model_type", None)
    if model_type not in ARCHITECTURES:
        raise ValueError(f"model_type must be one of {', '.join(ARCHITECTURES)}, got {model_type!r}")
    fields.setdefault("initializer_range", 0.02)
    return AutoConfig.for_model(model_type, architectures=[ARCHITECTURES[model_type]], **fields)


def _preset_fields(preset: str | dict) -> dict:
    if isinstance(preset, str):
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
        return PRESETS[preset]
    fields = dict(preset)
    base = fields.pop("preset", None)
    return {**_preset_fields(base), **fields} if base else fields


def tensor_groups(config) -> list[list[TensorSpec]]:
    """transformers' tensor names and shapes, grouped: embedding, one group per layer, head."""
    if config.model_type == "gemma4_text":
        return _groups_of_our_model(config)
    h, v = config.hidden_size, config.vocab_size
    groups = [[TensorSpec("model.embed_tokens.weight", (v, h), "normal")]]
    groups += [_layer_tensors(config, i) for i in range(config.num_hidden_layers)]
    last = [TensorSpec("model.norm.weight", (h,), _norm_init(config))]
    if not config.tie_word_embeddings:
        last.append(TensorSpec("lm_head.weight", (v, h), "normal"))
    return groups + [last]


def _groups_of_our_model(config) -> list[list[TensorSpec]]:
    """The checkpoint tensors our model of the config reads (its weight sources, built on the
    meta device), grouped by layer: what differs from layer to layer (Gemma 4's KV-sharing
    layers have no k/v projections) comes from the model itself. Norms and layer scalars 1."""
    from engine.loading.loader import no_random_init
    from engine.models import build_model
    with torch.device("meta"), no_random_init():
        model = build_model(config, max_positions=2)
    groups: dict[str, list[TensorSpec]] = {}
    for source in model.weight_sources():
        for name, shape in source.parts:
            one = name.endswith("norm.weight") or name.endswith("layer_scalar")
            key = ".".join(name.split(".")[:3]) if name.startswith("model.layers.") else name
            groups.setdefault(key, []).append(TensorSpec(name, shape, "ones" if one else "normal"))
    return list(groups.values())


def _norm_init(config) -> str:
    """A norm's weight that multiplies by 1: w, or (1 + w) in a hybrid model (engine.models.hybrid)."""
    return "zeros" if is_hybrid(config) else "ones"


def _hybrid_layer_tensors(config, i: int) -> list[TensorSpec]:
    """A Qwen3.5 / Qwen3-Next layer: a linear-attention or a gated full-attention mixer, then the
    MLP (Qwen3-Next: experts and a shared expert, but on mlp_only_layers)."""
    h, p, norm = config.hidden_size, f"model.layers.{i}.", "zeros"
    specs = [TensorSpec(p + "input_layernorm.weight", (h,), norm),
             TensorSpec(p + "post_attention_layernorm.weight", (h,), norm)]
    if config.layer_types[i] == "linear_attention":
        hv, key = config.linear_num_value_heads, config.linear_num_key_heads * config.linear_key_head_dim
        value = hv * config.linear_value_head_dim
        a = p + "linear_attn."
        specs += [TensorSpec(a + "conv1d.weight", (2 * key + value, 1, config.linear_conv_kernel_dim), "normal"),
                  TensorSpec(a + "A_log", (hv,), "normal"), TensorSpec(a + "dt_bias", (hv,), "ones"),
                  TensorSpec(a + "norm.weight", (config.linear_value_head_dim,), "ones"),
                  TensorSpec(a + "out_proj.weight", (h, value), "normal")]
        if config.model_type == "qwen3_next":
            specs += [TensorSpec(a + "in_proj_qkvz.weight", (2 * key + 2 * value, h), "normal"),
                      TensorSpec(a + "in_proj_ba.weight", (2 * hv, h), "normal")]
        else:
            specs += [TensorSpec(a + "in_proj_qkv.weight", (2 * key + value, h), "normal"),
                      TensorSpec(a + "in_proj_z.weight", (value, h), "normal"),
                      TensorSpec(a + "in_proj_b.weight", (hv, h), "normal"),
                      TensorSpec(a + "in_proj_a.weight", (hv, h), "normal")]
    else:
        d = config.head_dim
        q_size, kv_size = config.num_attention_heads * d, config.num_key_value_heads * d
        specs += [TensorSpec(p + "self_attn.q_proj.weight", (2 * q_size, h), "normal"),
                  TensorSpec(p + "self_attn.k_proj.weight", (kv_size, h), "normal"),
                  TensorSpec(p + "self_attn.v_proj.weight", (kv_size, h), "normal"),
                  TensorSpec(p + "self_attn.o_proj.weight", (h, q_size), "normal"),
                  TensorSpec(p + "self_attn.q_norm.weight", (d,), norm),
                  TensorSpec(p + "self_attn.k_norm.weight", (d,), norm)]
    from engine.models.qwen3_5 import has_experts
    if not has_experts(config, i):
        return specs + _mlp_tensors(p + "mlp.", h, config.intermediate_size)
    shared = config.shared_expert_intermediate_size
    return (specs + _expert_tensors(config, p + "mlp.") + _mlp_tensors(p + "mlp.shared_expert.", h, shared)
            + [TensorSpec(p + "mlp.shared_expert_gate.weight", (1, h), "normal")])


def _mlp_tensors(p: str, h: int, inter: int) -> list[TensorSpec]:
    return [TensorSpec(p + "gate_proj.weight", (inter, h), "normal"), TensorSpec(p + "up_proj.weight", (inter, h), "normal"),
            TensorSpec(p + "down_proj.weight", (h, inter), "normal")]


def _layer_tensors(config, i: int) -> list[TensorSpec]:
    if is_hybrid(config):
        return _hybrid_layer_tensors(config, i)
    h, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q_size = config.num_attention_heads * head_dim
    kv_size = config.num_key_value_heads * head_dim
    p = f"model.layers.{i}."
    specs = [TensorSpec(p + "input_layernorm.weight", (h,), "ones"),
             TensorSpec(p + "self_attn.q_proj.weight", (q_size, h), "normal"),
             TensorSpec(p + "self_attn.k_proj.weight", (kv_size, h), "normal"),
             TensorSpec(p + "self_attn.v_proj.weight", (kv_size, h), "normal"),
             TensorSpec(p + "self_attn.o_proj.weight", (h, q_size), "normal")]
    if config.model_type in ("qwen3", "qwen3_moe"):
        specs += [TensorSpec(p + "self_attn.q_norm.weight", (head_dim,), "ones"),
                  TensorSpec(p + "self_attn.k_norm.weight", (head_dim,), "ones")]
    if getattr(config, "attention_bias", False):
        specs += [TensorSpec(p + f"self_attn.{x}_proj.bias", (size,), "normal")
                  for x, size in (("q", q_size), ("k", kv_size), ("v", kv_size), ("o", h))]
    if config.model_type == "gpt_oss":
        specs.append(TensorSpec(p + "self_attn.sinks", (config.num_attention_heads,), "normal"))
    specs.append(TensorSpec(p + "post_attention_layernorm.weight", (h,), "ones"))
    if is_sparse_layer(config, i):
        return specs + _expert_tensors(config, p + "mlp.")
    return specs + [TensorSpec(p + "mlp.gate_proj.weight", (inter, h), "normal"),
                    TensorSpec(p + "mlp.up_proj.weight", (inter, h), "normal"),
                    TensorSpec(p + "mlp.down_proj.weight", (h, inter), "normal")]


def _expert_tensors(config, p: str) -> list[TensorSpec]:
    """An MoE layer's router and experts as the released checkpoints store them: Qwen3-MoE one
    tensor per expert and projection, gpt-oss fused ([E, in, out], gate and up interleaved)."""
    h, e, inter = config.hidden_size, num_experts(config), expert_intermediate(config)
    if config.model_type == "gpt_oss":
        return [TensorSpec(p + "router.weight", (e, h), "normal"), TensorSpec(p + "router.bias", (e,), "normal"),
                TensorSpec(p + "experts.gate_up_proj", (e, h, 2 * inter), "normal"),
                TensorSpec(p + "experts.gate_up_proj_bias", (e, 2 * inter), "normal"),
                TensorSpec(p + "experts.down_proj", (e, inter, h), "normal"),
                TensorSpec(p + "experts.down_proj_bias", (e, h), "normal")]
    specs = [TensorSpec(p + "gate.weight", (e, h), "normal")]
    for x in range(e):
        specs += [TensorSpec(p + f"experts.{x}.gate_proj.weight", (inter, h), "normal"),
                  TensorSpec(p + f"experts.{x}.up_proj.weight", (inter, h), "normal"),
                  TensorSpec(p + f"experts.{x}.down_proj.weight", (h, inter), "normal")]
    return specs


def plan_shards(groups: list[list[TensorSpec]], bytes_per_value: int, max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Whole groups per shard; a new shard starts when the next group would pass the limit
    (a group larger than the limit gets a shard of its own)."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for group in groups:
        group_bytes = sum(t.numel for t in group) * bytes_per_value
        if shards[-1] and size + group_bytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].extend(group)
        size += group_bytes
    return shards


def shard_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


# ---- writing ----------------------------------------------------------------------
def write_checkpoint(folder, preset: str | dict, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                     max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """Write a random-weight HF checkpoint into folder (created if needed); returns it."""
    if dtype not in SAFETENSORS_DTYPES:
        raise ValueError(f"dtype must be one of {list(SAFETENSORS_DTYPES)}, got {dtype}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    existing = sorted(p.name for p in folder.glob("*.safetensors"))
    if existing:
        raise FileExistsError(f"{folder} already holds weights ({existing[0]}, ...); choose an empty folder")
    source = _tokenizer_source()
    config = make_config(preset)
    _use_special_tokens_of(config, source)
    config.save_pretrained(folder)
    bytes_per_value = torch.empty((), dtype=dtype).element_size()
    shards = plan_shards(tensor_groups(config), bytes_per_value, max_shard_bytes)
    names = shard_names(len(shards))
    for name, specs in zip(names, shards):
        write_safetensors(folder / name, specs, dtype, config.initializer_range, seed)
    if len(shards) > 1:
        _write_index(folder / INDEX_NAME, shards, names, bytes_per_value)
    _copy_tokenizer(source, folder)
    return folder


def write_safetensors(path: Path, specs: list[TensorSpec], dtype: torch.dtype, std: float, seed: int) -> None:
    """The safetensors layout (u64 header length, JSON header, raw little-endian data), with
    the header computed from shapes first so each tensor streams to disk slice by slice."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset, size = 0, torch.empty((), dtype=dtype).element_size()
    for spec in specs:
        nbytes = spec.numel * size
        header[spec.name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(spec.shape),
                             "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)            # data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for spec in specs:
            for values in tensor_slices(spec, dtype, std, seed):
                f.write(values.contiguous().view(torch.uint8).numpy().tobytes())


def tensor_slices(spec: TensorSpec, dtype: torch.dtype, std: float, seed: int):
    """The tensor's values, row-major, in slices of at most ~SLICE_ELEMENTS values."""
    if spec.init in ("ones", "zeros"):
        yield (torch.ones if spec.init == "ones" else torch.zeros)(spec.shape, dtype=dtype)
        return
    generator = torch.Generator().manual_seed(_tensor_seed(seed, spec.name))
    rows, row_shape = spec.shape[0], spec.shape[1:]
    rows_per_slice = max(1, SLICE_ELEMENTS // max(1, math.prod(row_shape)))
    for start in range(0, rows, rows_per_slice):
        n = min(rows_per_slice, rows - start)
        yield (torch.randn((n, *row_shape), generator=generator) * std).to(dtype)


def _tensor_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1


def _write_index(path: Path, shards: list[list[TensorSpec]], names: list[str], bytes_per_value: int) -> None:
    weight_map = {spec.name: name for name, specs in zip(names, shards) for spec in specs}
    total = sum(spec.numel for specs in shards for spec in specs) * bytes_per_value
    path.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


# ---- tokenizer -------------------------------------------------------------------
def _tokenizer_source() -> Path:
    from engine.loading.loader import resolve
    return resolve("default")


def _use_special_tokens_of(config, source: Path) -> None:
    """bos/eos/pad ids of the tokenizer we ship, so generation stops where the tokenizer says."""
    source_config = json.loads((source / "config.json").read_text())
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key in source_config:
            setattr(config, key, source_config[key])


def _copy_tokenizer(source: Path, folder: Path) -> None:
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, folder / name)


# ---- command line ------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    parser = argparse.ArgumentParser(prog="python -m engine.loading.synthetic", description=__doc__.split("\n")[0])
    parser.add_argument("preset", choices=sorted(PRESETS))
    parser.add_argument("out", type=Path, help="output folder (created; must hold no weights yet)")
    parser.add_argument("--dtype", choices=sorted(dtypes), default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-shard-bytes", type=int, default=DEFAULT_MAX_SHARD_BYTES)
    args = parser.parse_args(argv)
    folder = write_checkpoint(args.out, args.preset, dtypes[args.dtype], args.seed, args.max_shard_bytes)
    print(f"wrote {args.preset} ({args.dtype}, seed {args.seed}) to {folder}")


if __name__ == "__main__":
    main()
