"""A model with its own paged KV cache and block manager: the target has one, a draft
model has another. Runs forward passes over one sequence (`forward`) or many at once
(`forward_batch`: the scheduler's step, one pass over every scheduled token)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.cache.block_manager import BlockManager, SeqBlocks
from engine.cache.hashing import root_key
from engine.cache.kv_cache import FP8_DTYPE, KVCache, is_rotated, resolve_kv_dtype
from engine.cache.memory_plan import plan_memory, state_slots
from engine.cache.state_cache import StateCache
from engine.cache.state_snapshots import StateSnapshots
from engine.config import MAX_SPEC_TOKENS, EngineConfig
from engine.errors import first_line
from engine.layers import attention, gated_delta, linear_attention_op
from engine.layers.attention import CPU, KERNELS, TORCH, AttentionMetadata
from engine.layers.attention_metadata import SeqSlice, TreeRows, pass_positions, tree_pass_positions
from engine.layers.linear_attention_op import LinearPass, LinearSeq
from engine.loading.loader import LoadedModel
from engine.models.llama import rope_identity
from engine.models.qwen3_5 import state_shape
from engine.runtime import compiled_step
from engine.runtime.decode_graphs import DecodeGraphs

SCALE_MODE = "per_token_head_fp32"
# What prefix caching does for a hybrid model (what "In effect" says).
HYBRID_PREFIX_ON = ("on: a hit restores the linear-attention layers' state saved at its last block boundary "
                    "({snapshots} snapshots kept at most, {bytes} bytes; least recently used dropped first, and "
                    "with their blocks); a hit past the last snapshot is recomputed from there")
HYBRID_PREFIX_NO_ROOM = ("on, but the memory plan left no room for state snapshots: a hybrid model's prompts are "
                         "computed in full (no prefill is skipped)")


@dataclass
class RunnerSeq(SeqBlocks):
    """Blocks plus how many tokens have KV in the cache (and, for a hybrid model, the slot of its
    linear layers' state, which has moved past those tokens)."""
    num_computed: int = 0
    state_slot: int | None = None


@dataclass
class PassItem:
    """One sequence's part of a batched pass: its new tokens (fed at positions num_computed..)
    and how many of its last rows need logits (0: a prefill chunk that does not end the prompt)."""
    seq: RunnerSeq
    tokens: list[int]
    logits_rows: int = 1
    tree: TreeRows | None = None    # its rows attend as a draft tree (stored at num_computed..)


def prepare_model(model, device: torch.device) -> None:
    """Set a loaded model up for inference on `device`, before its memory is planned: on the
    CPU its linear weights move to oneDNN's layout (engine.layers.packed_linear). Idempotent."""
    if device.type == "cpu":
        model.pack_for_cpu()


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: EngineConfig, device: torch.device,
                 num_blocks: int | None = None, progress=None, on_settings_changed=None,
                 num_snapshots: int | None = None):
        self.loaded, self.model, self.device = loaded, loaded.model, device
        self.progress = progress            # where a compile reports ("compiling the decode step…")
        self.on_settings_changed = on_settings_changed or (lambda: None)   # e.g. the compiled step was given up
        prepare_model(self.model, device)
        self.model_dtype = next(self.model.parameters()).dtype
        self.compiled: compiled_step.CompiledStep | None = None    # kept across pool rebuilds
        self.compile_error: str | None = None      # why the compiled step was given up, if it was
        self.last_hidden: torch.Tensor | None = None               # the last pass's, see forward
        self._decode_graphs: DecodeGraphs | None = None            # the compiled step's, for this pool
        self.build_cache(config, num_blocks, num_snapshots)

    # ---- cache ---------------------------------------------------------------
    def build_cache(self, config: EngineConfig, num_blocks: int | None = None,
                    num_snapshots: int | None = None) -> None:
        """(Re)allocate the pool for the config's KV dtype and block size. Drops the prefix cache.
        num_blocks (and a hybrid model's num_snapshots): as the engine's memory plan says; None
        plans for this model alone."""
        self.release_cache()    # free the old pool before planning and allocating the new one
        shape = self.model.cache_shape
        dtype = resolve_kv_dtype(config.kv_cache_dtype, self.model_dtype)
        if num_blocks is None or (num_snapshots is None and state_shape(self.model) is not None):
            plan = plan_memory(config, self.device, self.model)
            num_blocks = plan.num_blocks if num_blocks is None else num_blocks
            num_snapshots = plan.prefix_snapshots if num_snapshots is None else num_snapshots
        self.kv = KVCache(shape, num_blocks, config.block_size, dtype, self.device,
                          rotated=is_rotated(config.kv_cache_dtype))
        states = state_shape(self.model)
        self.states = None if states is None else StateCache(states, state_slots(config, self.device),
                                                             self.model_dtype, self.device)
        scale_mode = SCALE_MODE if dtype == FP8_DTYPE else "none"
        root = root_key(self.loaded.identity, self.kv.name, scale_mode, config.block_size,
                        rope_identity(self.loaded.hf_config))
        self.blocks = BlockManager(self.kv.num_blocks, config.block_size, root, False)
        self.snapshots = None if self.states is None else StateSnapshots(self.states, num_snapshots)
        if self.snapshots is not None:
            self.blocks.usable_hits, self.blocks.on_drop = self.snapshots.usable_hits, self.snapshots.drop
        self.set_prefix_caching(config.enable_prefix_caching)
        from engine.kernels.dispatch import kernels_in_effect      # imports without triton
        self.use_kernels, self.kernels_state = kernels_in_effect(config.attention_backend, self.device)
        self.set_compile(config.compile)

    def set_compile(self, mode: str) -> None:
        """Run every pass through the compiled step (engine.runtime.compiled_step) or the eager
        reference. Once compiling or running it has failed, this runner stays eager and says why."""
        on, self.compile_state = compiled_step.wanted(mode, self.device)
        if on and self.compile_error is not None:
            on, self.compile_state = False, self.compile_error
        if not on:
            self.compiled = None
        elif self.compiled is None:
            self.compiled = compiled_step.CompiledStep(self.model, self.device, self.progress)
        self.attention_mode, self.attention_state = self._attention_path()

    def _attention_path(self) -> tuple[str, str]:
        """(what attends: an attention_metadata mode, and why), the one place it is decided: the
        Triton kernels where they run; in the compiled step on the CPU our kernel
        (engine.kernels.cpu_attention); else the torch path (the eager reference)."""
        if self.use_kernels:
            return KERNELS, "Triton kernels"
        if self.compiled is None or self.device.type != "cpu":
            return TORCH, f"torch ({self.kernels_state})"
        from engine.kernels import cpu_attention
        refused = cpu_attention.refusal()
        if refused:
            return TORCH, f"torch ({refused})"
        stacked = getattr(self.model, "stack_plan", lambda dtype: None)(self.model_dtype) is not None
        return CPU, (f"ours ({cpu_attention.isa()}), reads the paged cache as stored; "
                     + ("every layer in one op call (decoder_stack)" if stacked else "one op call a layer"))

    def warm_compiled(self) -> float:
        """Run the compiled step once on a scratch one-token sequence, so that it compiles now
        (reporting through `progress`) and not inside a timed reply. Returns the seconds that
        call spent compiling (0.0: eager, or compiled already). Nothing is left behind: the
        scratch blocks are freed without entering the prefix cache."""
        if self.compiled is None or self.compiled.is_built:
            return 0.0
        seq = self.start([0])
        try:
            self.forward(seq, [0], logits_for=1)
        finally:
            self.end(seq)
        self.take_compiles()
        return self.take_compile_s()

    def take_compile_s(self) -> float:
        """Seconds this runner's passes spent compiling since last asked (engine.metrics keeps
        a step that compiled out of decode speed)."""
        return self.compiled.take_compile_s() if self.compiled is not None else 0.0

    def take_compiles(self) -> int:
        """Calls of the compiled step that compiled since last asked (the engine's step stats)."""
        return self.compiled.take_compiles() if self.compiled is not None else 0

    def _compile_failed(self, error: Exception) -> None:
        """A failed call may have stored some layers' K/V: the eager pass stores them again, in
        the same slots, so the pass is simply run eagerly."""
        self.compile_error = (f"off: the compiled step failed ({type(error).__name__}: {first_line(error)}); "
                              "running eagerly")
        self.compile_state, self.compiled = self.compile_error, None
        self.attention_mode, self.attention_state = self._attention_path()
        self.on_settings_changed()

    def release_cache(self) -> None:
        self.kv = self.states = self.snapshots = None

    def set_prefix_caching(self, enabled: bool) -> None:
        """On where asked; for a hybrid model, with its state snapshots (`prefix_state` says how many)."""
        self.blocks.enable_prefix_caching = enabled
        self.prefix_state = "on" if enabled else "off"
        if enabled and self.snapshots is not None:
            n = self.snapshots.num_snapshots
            self.prefix_state = (HYBRID_PREFIX_ON.format(snapshots=n, bytes=self.snapshots.pool_bytes) if n
                                 else HYBRID_PREFIX_NO_ROOM)

    @property
    def kv_dtype_name(self) -> str:
        return self.kv.name

    def bytes_held(self) -> int:
        """KV bytes of the blocks held (state_bytes_held apart)."""
        return self.kv.bytes_held(self.blocks.num_used_blocks)

    def state_bytes_held(self) -> int:
        """A hybrid model's linear-layer state of the sequences running (0: none)."""
        return 0 if self.states is None else self.states.bytes_held()

    def snapshot_bytes_held(self) -> int:
        """A hybrid model's state snapshots the prefix cache holds (0: none)."""
        return 0 if self.snapshots is None else self.snapshots.bytes_held()

    # ---- sequences -----------------------------------------------------------
    def start(self, token_ids: list[int], reserve_tokens: int = 0) -> RunnerSeq:
        """A sequence with blocks for its whole prompt (a single sequence driven by forward)."""
        return self._with_state(_computed_from_cache(self.blocks.allocate_prompt(token_ids, reserve_tokens)))

    def admit(self, token_ids: list[int]) -> RunnerSeq:
        """A sequence holding only its prefix-cache hit (the scheduler's admission)."""
        return self._with_state(_computed_from_cache(self.blocks.admit(token_ids)))

    def _with_state(self, seq: RunnerSeq) -> RunnerSeq:
        """A hybrid model's sequence takes a state slot: zeroed, or on a prefix hit the state
        saved at the hit's last block boundary (the block manager asked for a hit that has one)."""
        if self.states is not None:
            seq.state_slot = self.states.allocate()
            if seq.num_computed:
                self.snapshots.restore(seq.keys[-1], seq.state_slot)
        return seq

    def end(self, seq: RunnerSeq) -> None:
        self.blocks.free(seq)
        if seq.state_slot is not None:
            self.snapshots.unstage(seq.state_slot)
            self.states.free(seq.state_slot)
            seq.state_slot = None

    def rollback(self, seq: RunnerSeq, num_computed: int) -> None:
        """Keep KV for the first num_computed tokens; free blocks past them. A hybrid model's state
        goes back to the one its last verify pass kept after that token."""
        if seq.state_slot is not None and num_computed < seq.num_computed:
            kept = self.states.kept.get((0, seq.state_slot))
            start = kept.start if kept is not None else seq.num_computed
            self.states.restore(seq.state_slot, start, num_computed - start)
        seq.num_computed = min(seq.num_computed, num_computed)
        self.blocks.truncate(seq, seq.num_computed)

    def forward(self, seq: RunnerSeq, new_tokens: list[int], logits_for: str | int = "last") -> torch.Tensor:
        """Feed new_tokens at positions num_computed.. (a pass of one sequence, forward_batch's
        path). Returns float32 logits of the last token ("last"), the last n (int) or all
        ("all"); the final hidden states of the new tokens are left in self.last_hidden
        [N, hidden] (an EAGLE head reads them). Blocks are not registered in the prefix cache
        here: the caller commits once it knows which tokens are final (speculative tokens may
        be rolled back)."""
        n = len(new_tokens)
        rows = 1 if logits_for == "last" else n if logits_for == "all" else logits_for
        (logits, self.last_hidden), = self.forward_batch([PassItem(seq, list(new_tokens), rows)])
        return logits

    @property
    def decode_graphs(self) -> DecodeGraphs | None:
        """The compiled step's recorded uniform passes over this pool (engine.runtime.decode_graphs);
        None where the step is eager. Made anew for a new pool or a new compiled step."""
        if self.compiled is None:
            return None
        graphs = self._decode_graphs
        if graphs is None or graphs.kv is not self.kv or graphs.compiled is not self.compiled:
            graphs = self._decode_graphs = DecodeGraphs(self.compiled, self.kv)
        return graphs

    @property
    def decode_graphs_state(self) -> str:
        """How a uniform pass runs here, and why ("In effect")."""
        if self.compiled is None:
            return "off (the step is eager)"
        if self.states is not None:
            return "off (a hybrid model's linear-attention state is not in the buffers)"
        return self.decode_graphs.state

    def uniform_rows(self, items: list[PassItem]) -> int | None:
        """Q where the pass is one the decode graphs take: every item feeds Q rows (a decode or a
        verify: at most MAX_SPEC_TOKENS + 1, so a whole prompt scored at once does not make buffers
        of its length) and wants all of their logits, none is a draft tree, the model keeps no
        linear-attention state, the step is compiled. None: forward_batch's general path."""
        if self.compiled is None or self.states is not None or not items:
            return None
        q = len(items[0].tokens)
        if q > MAX_SPEC_TOKENS + 1:
            return None
        if all(i.tree is None and len(i.tokens) == q and i.logits_rows == q for i in items):
            return q
        return None

    @torch.inference_mode()
    def forward_batch(self, items: list[PassItem]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One forward pass over every item's new tokens: flattened ids and positions, each
        sequence's own block table and context, through the compiled step where it is on (else
        the eager reference); a uniform pass (uniform_rows) through the decode graphs. Returns per
        item (float32 logits of its last logits_rows rows [logits_rows, V], final hidden states of
        its new tokens [n, hidden]). A row's numbers do not depend on the other items
        (layers.attention, layers.packed_linear)."""
        q = self.uniform_rows(items)
        if q is not None:
            out = self._forward_uniform(items, q)
            if out is not None:
                return out
        slices, positions, slots, ids, wanted, linear = [], [], [], [], [], []
        row = 0
        for item in items:
            start, n = item.seq.num_computed, len(item.tokens)
            self.blocks.ensure_capacity(item.seq, start + n)
            if item.tree is None:
                pos, table, slot = pass_positions(start, n, item.seq.block_table, self.kv.block_size, self.device)
            else:
                if item.tree.indices != list(range(start, start + n)):
                    raise ValueError("a tree's rows are stored at the sequence's next indices, in order")
                pos, table, slot = tree_pass_positions(item.tree, item.seq.block_table, self.kv.block_size,
                                                       self.device)
            slices.append(SeqSlice(row, n, table, start + n, item.tree))
            if item.seq.state_slot is not None:
                parents = _parents(item, start)
                staged = self._stage_snapshots(item.seq, start, n) if parents is None else []
                linear.append(LinearSeq(row, n, item.seq.state_slot, start, parents, staged))
            positions.append(pos)
            slots.append(slot)
            ids.extend(item.tokens)
            wanted.extend(range(row + n - item.logits_rows, row + n))
            row += n
        meta = self._prepare(self.attention_mode, torch.cat(positions), torch.cat(slots), slices)
        ids_t = torch.tensor(ids, dtype=torch.int64, device=self.device)
        rows_t = torch.tensor(wanted, dtype=torch.int64, device=self.device)
        linear_pass = None if self.states is None else LinearPass(self.states, linear, row, self.snapshots)
        with linear_attention_op.serving(linear_pass):
            logits, hidden = self._pass(ids_t, meta, rows_t)
        out, used = [], 0
        for item, s in zip(items, slices):
            item.seq.num_computed += s.count
            out.append((logits[used:used + item.logits_rows], hidden[s.start:s.start + s.count]))
            used += item.logits_rows
        return out

    def _forward_uniform(self, items: list[PassItem], q: int) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """forward_batch's answer for a uniform pass, through the decode graphs; None where the
        compiled step failed (it is given up, with its reason: the caller runs the pass eagerly)."""
        for item in items:
            self.blocks.ensure_capacity(item.seq, item.seq.num_computed + q)
        ids = torch.tensor([t for item in items for t in item.tokens], dtype=torch.int64, device=self.device)
        try:
            logits, hidden = self.decode_graphs.run(self.attention_mode, self.model.embed_tokens(ids),
                                                    [item.seq.num_computed for item in items],
                                                    [item.seq.block_table for item in items], q)
        except Exception as error:      # compiling, or CUDA graph capture, failed: eager from now on
            self._compile_failed(error)
            return None
        out = []
        for i, item in enumerate(items):
            item.seq.num_computed += q
            out.append((logits[i * q:(i + 1) * q], hidden[i * q:(i + 1) * q]))
        return out

    def _stage_snapshots(self, seq: RunnerSeq, start: int, n: int) -> list[tuple[int, int]]:
        """Where a prefill chunk's linear layers save their state for prefix hits: the block
        boundaries strictly inside it that the chunked form passes anyway (multiples of its
        CHUNK), and the last one (the chunk is cut there: a repeated prompt's hit ends on it).
        One the chunk ends on is saved from the slot, at commit."""
        if not self.blocks.enable_prefix_caching:
            return []
        bs = self.kv.block_size
        inside = list(range((start // bs + 1) * bs, start + n, bs))
        boundaries = [b for b in inside[:-1] if b % gated_delta.CHUNK == 0] + inside[-1:]
        return self.snapshots.stage(seq.state_slot, boundaries)

    def _prepare(self, mode: str, positions, slots, slices) -> AttentionMetadata:
        """The pass's attention metadata and its mode's layout, once for every layer."""
        config = self.model.config           # (a hybrid model cut to linear layers has no attention)
        return attention.prepare(mode, positions, slots, slices, self.kv.block_size,
                                 config.num_attention_heads // self.kv.shape.num_kv_heads)

    def _pass(self, ids: torch.Tensor, meta: AttentionMetadata, rows: torch.Tensor) -> tuple:
        if self.compiled is not None:
            try:
                return self.compiled(ids, self.kv, meta, rows)
            except Exception as error:      # compiling, or CUDA graph capture, failed: eager from now on
                self._compile_failed(error)
                meta = self._prepare(self.attention_mode, meta.positions, meta.slot_mapping, meta.seqs)
        return self.model.forward_with_hidden(ids, self.kv, meta, rows)

    @torch.inference_mode()
    def compact(self, seq: RunnerSeq, start: int, rows: list[int]) -> None:
        """After a tree's verify pass (rows stored at start..): move the KV of the kept rows
        (root first, in path order) to start, start + 1, ..., in every layer, then keep only
        them. A kept row never lies before its new place, so the copy reads before it writes."""
        moved = [(start + j, start + r) for j, r in enumerate(rows) if r != j]
        if moved:
            table = torch.tensor(seq.block_table, dtype=torch.int64, device=self.device)
            bs = self.kv.block_size
            dst, src = (torch.tensor(x, dtype=torch.int64, device=self.device) for x in zip(*moved))
            dst, src = (table[i // bs] * bs + i % bs for i in (dst, src))
            for pool in (self.kv.k, self.kv.v, self.kv.k_scale, self.kv.v_scale):
                if pool is None:
                    continue
                flat = pool.flatten(1, 2)                            # [L, num_blocks * block_size, ...]
                raw = flat.view(torch.uint8) if pool.dtype == FP8_DTYPE else flat
                raw[:, dst] = raw[:, src]
        if seq.state_slot is not None:           # the state after the last kept row
            self.states.restore(seq.state_slot, start, rows[-1] + 1)
            seq.num_computed = start + len(rows)
        self.rollback(seq, start + len(rows))

    def commit(self, seq: RunnerSeq, token_ids: list[int]) -> None:
        """token_ids: the sequence's final tokens; their first num_computed have KV. A hybrid
        model's state snapshots of the blocks that became full are filed under their keys."""
        self.blocks.commit(seq, token_ids, seq.num_computed)
        if seq.state_slot is not None and self.blocks.enable_prefix_caching:
            self.snapshots.settle(seq.state_slot, seq.keys, seq.num_computed, self.kv.block_size,
                                  self.blocks.cached.__contains__)


def _parents(item: PassItem, start: int) -> list[int] | None:
    """For the linear layers, which then keep the state after each row, the parents of the rows
    (-1: the state before the pass) of a pass whose every row wants logits (a decode, a verify
    pass, which may be rolled back): a chain's row follows the one before it, a tree's its parent.
    None for a prefill chunk (never rolled back: it takes the chunked form)."""
    n = len(item.tokens)
    if item.tree is not None:
        return [path[-2] - start if len(path) > 1 else -1 for path in item.tree.paths]
    if item.logits_rows == n:
        return list(range(-1, n - 1))
    return None


def _computed_from_cache(blocks: SeqBlocks) -> RunnerSeq:
    """Its cached prefix has KV already."""
    return RunnerSeq(blocks.block_table, blocks.keys, blocks.num_cached_tokens, blocks.num_unrestored_tokens,
                     blocks.num_cached_tokens)
