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

import weakref

import torch

from engine.errors import first_line
from engine.layers import attention_op
from engine.layers.attention import CPU, TORCH, AttentionMetadata, prepare
from engine.layers.attention_metadata import SeqSlice
from engine.models.eagle_head import EagleHead
from engine.runtime.compiled_step import CompiledStep


class ChainPass:
    """The head's one-row passes of a chain over one head cache, as the target's decode steps run
    (engine.runtime.decode_graphs): its inputs and rows are tensors made once and refilled in
    place, prepared for the graph once, so a draft token's pass is the graph's call alone (the
    metadata and the graph's arguments were built anew for each: a fifth of the head's pass).
    The head's cache is contiguous: its block table is every block, and the row sees slots 0 ..
    its own. (It keeps the cache's tensors, not the cache: EagleStep keys its passes by the cache.)"""

    def __init__(self, compiled: CompiledStep, kv, hidden: int, dtype: torch.dtype, device: torch.device):
        self.compiled = compiled
        long = dict(dtype=torch.int64, device=device)
        self.embedded = torch.zeros(1, hidden, dtype=dtype, device=device)
        self.feature = torch.zeros(1, hidden, dtype=dtype, device=device)
        self.rope = torch.zeros(1, **long)
        self.slot, self.prefix = torch.zeros(1, **long), torch.ones(1, **long)
        graph = attention_op.GraphPass(
            positions=self.slot, slots=self.slot, tables=torch.arange(kv.k.shape[1], **long)[None],
            row_seq=torch.zeros(1, **long), prefix=self.prefix, extra_start=torch.zeros(2, **long),
            extra_keys=torch.zeros(1, **long), **attention_op.pool_args(kv, CPU))
        self.args = ((self.embedded, self.feature, self.rope), torch.zeros(1, **long), graph)
        self.prepared = None

    def __call__(self, embedded: torch.Tensor, feature: torch.Tensor, slot: int,
                 rope_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.embedded.copy_(embedded)
        self.feature.copy_(feature)
        self.slot.fill_(slot)
        self.prefix.fill_(slot + 1)
        self.rope.fill_(rope_position)
        if self.prepared is None:             # the first call may build the graph; then prepared once
            out = self.compiled.run(*self.args)
            prepared = self.compiled.prepare(*self.args)
            self.prepared = prepared if prepared.holds(*self.args) else False
            return out
        return self.compiled.run_prepared(self.prepared or self.compiled.prepare(*self.args))


class EagleStep:
    def __init__(self, head: EagleHead, device: torch.device, progress=None):
        self.head, self.device, self.progress = head, device, progress
        self.compiled: CompiledStep | None = None
        self.compile_error: str | None = None    # why the compiled step was given up, if it was
        self.attention_mode = TORCH               # the mode of the metadata its passes take
        # each head cache's one-row chain passes (a request's proposer has its own cache; gone with it)
        self._chains: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.chain_replays = 0                    # one-row chain passes run over prepared tensors (tests read it)

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

    def chain(self, token: int, feature: torch.Tensor, kv, slot: int,
              rope_position: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A chain's next one-row pass (token at the head cache's `slot`, RoPE at rope_position,
        after `feature`): __call__'s outputs, over tensors prepared once per head cache (ChainPass);
        None where the step is not compiled over our CPU attention (the caller runs __call__)."""
        if self.compiled is None or self.attention_mode != CPU or not self.compiled.is_built:
            return None
        chain = self._chains.get(kv)
        if chain is None:
            chain = self._chains[kv] = ChainPass(self.compiled, kv, self.head.config.hidden_size, feature.dtype,
                                                 feature.device)
        try:
            replay = bool(chain.prepared)
            out = chain(self.head.embed([token]), feature, slot, rope_position)
            self.chain_replays += replay
            return out
        except Exception as error:      # noqa: BLE001 - as __call__: eager from now on
            self._failed(error)
            return None

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
        self._chains.clear()

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
