"""A checkpoint on disk: which file holds each tensor, its shape and dtype, and reading one
tensor at a time.

Shards come from model.safetensors.index.json when the folder has one, else from every
*.safetensors file in it. All headers are read up front (safe_open parses only the header),
so a truncated or corrupt shard, or an index naming a missing file, is reported before any
weight is read. `read(name)` memory-maps the tensor's file with safe_open and returns the
tensor as a view of the mapping, which goes away with the tensor: one safe_open handle
keeps every page it has touched resident until it closes, so a handle per tensor is what
keeps resident memory at one tensor however large the checkpoint (about 1 ms per open).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.errors import CheckpointError, ModelNotFoundError, UnsupportedModelError

INDEX_NAME = "model.safetensors.index.json"
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
             "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
_REDOWNLOAD = "download or copy it again"


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    shape: tuple[int, ...]
    dtype: str                  # as the file names it: "BF16", "F32", ...

    @property
    def nbytes(self) -> int:
        numel = 1
        for n in self.shape:
            numel *= n
        return numel * _ITEMSIZE.get(self.dtype, 4)


class Checkpoint:
    def __init__(self, folder: Path, tensors: dict[str, TensorInfo], pickled: list[Path] | None = None):
        self.folder, self.tensors = folder, tensors
        self._pickled_files = pickled or []
        self._pickled: dict[str, torch.Tensor] | None = None

    @classmethod
    def open(cls, folder: Path, allow_pickle: bool = False) -> "Checkpoint":
        folder = Path(folder)
        if (folder / INDEX_NAME).is_file():
            return cls(folder, _headers(shards_from_index(folder)))
        files = sorted(folder.glob("*.safetensors"))
        if files:
            return cls(folder, _headers(files))
        return cls._pickle(folder, allow_pickle)

    @classmethod
    def _pickle(cls, folder: Path, allow_pickle: bool) -> "Checkpoint":
        files = sorted(folder.glob("pytorch_model*.bin")) if allow_pickle else []
        if files:
            return cls(folder, {}, files)
        if list(folder.glob("*.bin")):
            raise UnsupportedModelError(
                f"{folder} has only pickle (.bin) weights, which can run code when loaded; "
                "convert them to safetensors or tick 'allow pickle weights'")
        raise ModelNotFoundError(f"no weights (*.safetensors) found in {folder}")

    @property
    def files(self) -> list[Path]:
        return sorted({t.file for t in self.tensors.values()} | set(self._pickled_files))

    def __contains__(self, name: str) -> bool:
        return name in self.tensors or name in self._pickled_state()

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.tensors:
            return self.tensors[name].shape
        return tuple(self._pickled_state()[name].shape)

    def file_of(self, name: str) -> Path:
        return self.tensors[name].file if name in self.tensors else self._pickled_files[0]

    def nbytes(self, name: str) -> int:
        if name in self.tensors:
            return self.tensors[name].nbytes
        t = self._pickled_state()[name]
        return t.numel() * t.element_size()

    def read(self, name: str) -> torch.Tensor:
        """One tensor, on the CPU, as stored (a view of the memory-mapped file)."""
        if name not in self.tensors:
            return self._pickled_state()[name]
        from safetensors import safe_open
        info = self.tensors[name]
        try:
            with safe_open(str(info.file), framework="pt") as f:
                return f.get_tensor(name)
        except Exception as exc:      # noqa: BLE001 - the file changed or broke since its header was read
            raise _unreadable(info.file, exc) from exc

    def read_all(self) -> dict[str, torch.Tensor]:
        """Every tensor (for small checkpoints, such as a reduced-head draft)."""
        return {name: self.read(name) for name in [*self.tensors, *self._pickled_state()]}

    def _pickled_state(self) -> dict[str, torch.Tensor]:
        if self._pickled is None:
            self._pickled = {}
            for f in self._pickled_files:       # only when the user allowed pickle weights
                self._pickled.update(_torch_load(f))
        return self._pickled


def _torch_load(path: Path) -> dict[str, torch.Tensor]:
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:        # a file from before torch's zip format cannot be memory-mapped
        return torch.load(path, map_location="cpu", weights_only=True)


def shards_from_index(folder: Path) -> list[Path]:
    """The shard files model.safetensors.index.json names; each must exist."""
    index = folder / INDEX_NAME
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{index} is not a valid index (it needs a \"weight_map\" of tensor name -> "
                              f"shard file): {exc}; {_REDOWNLOAD}") from exc
    missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        raise CheckpointError(f"{index} names {missing[0]}, which is not in {folder}"
                              f"{f' ({len(missing)} shards are missing)' if len(missing) > 1 else ''}; "
                              f"{_REDOWNLOAD}")
    return [folder / n for n in names]


def _headers(files: list[Path]) -> dict[str, TensorInfo]:
    tensors: dict[str, TensorInfo] = {}
    for file in files:
        tensors.update(_header(file))
    return tensors


def _header(file: Path) -> dict[str, TensorInfo]:
    from safetensors import safe_open
    try:
        with safe_open(str(file), framework="pt") as f:
            return {name: TensorInfo(file, tuple(f.get_slice(name).get_shape()), f.get_slice(name).get_dtype())
                    for name in f.keys()}
    except Exception as exc:          # noqa: BLE001 - SafetensorError, OSError: both mean "unreadable"
        raise _unreadable(file, exc) from exc


def _unreadable(file: Path, exc: Exception) -> CheckpointError:
    return CheckpointError(f"{file} is truncated or corrupt (safetensors says: {exc}); {_REDOWNLOAD}")
