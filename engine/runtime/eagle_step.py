"""The EAGLE head's draft step (engine.models.eagle_head), run the way the target's runner runs
its own: compiled where the target's step is (engine.runtime.compiled_step: the same graph
machinery, attention as its op, packed linears named by index, guards skipped once built,
compiles counted so they never count as drafting or decode time) and attending the way it
attends; eager (the torch path, the reference) where the target's is eager, or once the
head's compiled step failed.

A chain of k draft tokens is k head passes of one row each (plus the catch-up pass over the
positions the target's last pass fed), so on a small CPU the eager pass's per-op overhead was
most of its cost: the compiled pass is a few fused kernels around the attention op.
"""
from __future__ import annotations

import torch

from engine.errors import first_line
from engine.layers.attention import TORCH, AttentionMetadata, prepare
from engine.layers.attention_metadata import SeqSlice
from engine.models.eagle_head import EagleHead
from engine.runtime.compiled_step import CompiledStep


class EagleStep:
    def __init__(self, head: EagleHead, device: torch.device, progress=None):
        self.head, self.device, self.progress = head, device, progress
        self.compiled: CompiledStep | None = None
        self.compile_error: str | None = None    # why the compiled step was given up, if it was
        self.attention_mode = TORCH               # the mode of the metadata its passes take

    def follow(self, runner) -> None:
        """Compile as the target's runner (engine.runtime.model_runner.ModelRunner) does, and
        attend the way it does; eager where it is eager or the head's graph failed before."""
        if runner.compiled is None or self.compile_error is not None:
            self.compiled, self.attention_mode = None, TORCH
            return
        if self.compiled is None:
            self.compiled = CompiledStep(self.head, self.device, self.progress, run=self.head.draft_pass,
                                         what="the EAGLE head's draft step")
        self.attention_mode = runner.attention_mode

    def __call__(self, ids: list[int], features: torch.Tensor, kv, meta: AttentionMetadata,
                 rope_positions: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """EagleHead.draft_pass's (reduced logits of `rows`, predicted features of every row) for
        token ids [N]; meta is in this step's attention_mode."""
        embedded = self.head.embed(ids)
        if self.compiled is not None:
            try:
                return self.compiled.call((embedded, features, rope_positions), kv, meta, rows)
            except Exception as error:      # noqa: BLE001 - compiling failed: eager from now on
                self._failed(error)
                meta = self.metadata(meta.positions, meta.slot_mapping, meta.seqs, kv.block_size)
        return self.head.draft_pass(embedded, features, rope_positions, rows, kv, meta)

    @torch.inference_mode()
    def warm(self, block_size: int) -> float:
        """Run the compiled step once on a scratch one-token pass (in a scratch cache), so that it
        compiles now, reporting through `progress`, and not inside a timed reply. Returns the
        seconds that call spent compiling (0.0: eager, or compiled already)."""
        if self.compiled is None or self.compiled.is_built:
            return 0.0
        zero = torch.zeros(1, dtype=torch.int64, device=self.device)
        features = torch.zeros(1, self.head.config.hidden_size, dtype=self.head.fc.weight.dtype, device=self.device)
        meta = self.metadata(zero, zero, [SeqSlice(0, 1, zero, 1)], block_size)
        self([self.head.head_ids[0]], features, self.head.new_cache(1, block_size, self.device), meta, zero, zero)
        self.take_compiles()
        return self.take_compile_s()

    def metadata(self, positions, slots, seqs: list[SeqSlice], block_size: int) -> AttentionMetadata:
        """A head pass's attention metadata in this step's mode."""
        attn = self.head.layers[0].self_attn
        return prepare(self.attention_mode, positions, slots, seqs, block_size, attn.num_heads // attn.num_kv_heads)

    def _failed(self, error: Exception) -> None:
        """A failed call may have stored the layer's K/V: the eager pass stores them again, in the
        same slots."""
        self.compile_error = (f"off: the EAGLE head's compiled step failed ({type(error).__name__}: "
                              f"{first_line(error)}); drafting eagerly")
        self.compiled, self.attention_mode = None, TORCH

    @property
    def state(self) -> str:
        """Whether the head's passes run compiled, and why not ("In effect")."""
        if self.compile_error is not None:
            return self.compile_error
        return "on" if self.compiled is not None else "off (the target's step is eager)"

    def take_compile_s(self) -> float:
        """Seconds the head's passes spent compiling since last asked (engine.metrics keeps a
        step that compiled out of decode speed)."""
        return self.compiled.take_compile_s() if self.compiled is not None else 0.0

    def take_compiles(self) -> int:
        """Calls of the head's compiled step that compiled since last asked."""
        return self.compiled.take_compiles() if self.compiled is not None else 0
