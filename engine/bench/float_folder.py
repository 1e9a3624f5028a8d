"""A Hugging Face folder of float safetensors weights for a model reference, for a peer
engine that reads only such folders (vLLM: `bench peer --engine vllm`, its tests and the
screenshot): the same weights our float path serves (weight_dtype float).

A folder with *.safetensors is used as it is. A GGUF (default: the embedded model's) is
dequantized once by transformers' GGUF reader into
  <user cache dir>/safetensors/<gguf stem>-<key>/
(keyed by the file's path, size and mtime), with its config and tokenizer, written into a
temporary folder and renamed when complete, so a half-written one is never picked up. Our
own loader reads a GGUF's tensors directly and keeps no such copy.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from engine import user_cache
from engine.errors import ModelNotFoundError

WEIGHTS = "model.safetensors"


def float_folder(model: str | os.PathLike | None = None) -> Path:
    from engine.loading.loader import DEFAULT_MODEL, default_gguf_path
    if model in (None, "", DEFAULT_MODEL):
        return _from_gguf(default_gguf_path())
    path = Path(model).expanduser()
    if path.is_dir() and any(path.glob("*.safetensors")) and (path / "config.json").is_file():
        return path
    if path.is_file() and path.suffix == ".gguf":
        return _from_gguf(path)
    raise ModelNotFoundError(f"{model} is neither a Hugging Face folder with safetensors weights nor a .gguf file; "
                             "a peer engine reads one of those")


def _from_gguf(gguf: Path) -> Path:
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    target = user_cache.root() / "safetensors" / f"{gguf.stem}-{key}"
    if (target / WEIGHTS).is_file() and (target / "config.json").is_file():
        return target
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        config = model.config
        if hasattr(config, "quantization_config"):      # transformers will not save a "gguf-quantized" model
            del config.quantization_config
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if getattr(config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt"})
        config.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
