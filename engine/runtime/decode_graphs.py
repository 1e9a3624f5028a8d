"""Uniform passes over persistent buffers, recorded once per batch size and replayed.

A pass where every sequence feeds the same number Q of new rows (a plain decode, Q = 1; a
verify of k drafts, Q = k + 1; no draft tree) takes the compiled step's graph over buffers made
once per pool (StepBuffers: sized by the pool's most sequences and blocks per sequence) and
filled in place each step, nano-vllm's `graph_vars` and vLLM's persistent batch. Its batch is
padded up to a recorded size; the padded sequences repeat the last real one, ids, positions,
slots and table (a padded row writes the bytes the real row wrote, to the slot it wrote them
to), and their rows are dropped. Every sequence's numbers are its own (the step is
batch-invariant), so padding changes no token.

A recording (one per batch size and Q) is made when the size is first used, or at load for the
sizes asked (`record`), and again for a new pool (the runner makes new DecodeGraphs when
`reconfigure` rebuilds it). On CUDA it is a CUDA graph (torch.cuda.CUDAGraph) of the compiled
step over the buffers; a capture that fails is reported (`refusal`) and the pass replays by
calling the graph, as on the CPU, where the recording is a stand-in that replays by calling
the graph over the same buffers (the graph's row dimension is dynamic there, so the CPU pads
nothing: every batch size is its own recording).
"""
from __future__ import annotations

import numpy as np
import torch

from engine.errors import first_line
from engine.layers import attention_op
from engine.layers.attention_metadata import KERNELS

# Batch sizes recorded on CUDA (vLLM's capture sizes): a uniform pass is padded to the next one.
CUDA_BATCH_SIZES = (1, 2, 4, 8) + tuple(range(16, 257, 16))


class StepBuffers:
    """The step's inputs for up to `max_seqs` sequences of `q_rows` rows each, allocated once:
    the embedded rows, positions, slots, block tables ([max_seqs, max_blocks]) and the rows as
    our attention op reads them (each row's sequence, how many keys it sees; no tree keys).

    The integers a step changes (positions, slots, keys seen, tables) are written through numpy
    views of host tensors (a few microseconds a step where torch's small ops took about 60). On
    the CPU the graph reads those tensors themselves; on CUDA they are pinned, and each goes over
    in one asynchronous copy. Each is a tensor of its own, not a view at an offset: the compiled
    step would copy a view (CompiledStep.prepare), and a replay reads the buffers as they are."""

    def __init__(self, max_seqs: int, max_blocks: int, q_rows: int, hidden: int, dtype: torch.dtype,
                 device: torch.device):
        rows = max_seqs * q_rows
        self.max_seqs, self.q_rows = max_seqs, q_rows
        long = dict(dtype=torch.int64, device=device)
        self.h = torch.zeros(rows, hidden, dtype=dtype, device=device)
        self.cuda = torch.device(device).type == "cuda"              # the host tensors go over by copy
        shapes = {"positions": (rows,), "slots": (rows,), "prefix": (rows,), "tables": (max_seqs, max_blocks)}
        self.host = {name: torch.zeros(shape, dtype=torch.int64, pin_memory=self.cuda) for name, shape in shapes.items()}
        self._np = {name: t.numpy() for name, t in self.host.items()}
        self.positions, self.slots, self.prefix, self.tables = (
            torch.zeros(shapes[name], **long) if self.cuda else self.host[name] for name in shapes)
        self._seq, self._offset = np.divmod(np.arange(rows, dtype=np.int64), q_rows)   # row r: sequence, row in it
        self.row_seq = torch.from_numpy(self._seq).to(device)         # fixed: row r is sequence r // Q's
        self.extra_start = torch.zeros(rows + 1, **long)              # fixed: no tree keys
        self.extra_keys = torch.zeros(1, **long)
        self.logit_rows = torch.arange(rows, **long)                  # fixed: every row's logits

    def fill(self, embedded: torch.Tensor, starts: list[int], tables: list[list[int]], block_size: int,
             batch: int) -> None:
        """Write a pass of len(starts) sequences (their embedded rows [S * Q, hidden], first new
        positions and block tables) into the buffers, padded to `batch` sequences with copies of
        the last one."""
        q, real = self.q_rows, len(starts)
        width = max(len(t) for t in tables)           # columns past a table's end are never read
        if width > self.tables.shape[1]:
            raise ValueError(f"a block table longer than the buffers' {self.tables.shape[1]} blocks")
        starts = starts + [starts[-1]] * (batch - real)
        tables = tables + [tables[-1]] * (batch - real)
        n, table, seq = batch * q, self._np["tables"], self._seq[:batch * q]
        for i, t in enumerate(tables):
            table[i, :len(t)] = t
        positions = np.asarray(starts, dtype=np.int64)[seq] + self._offset[:n]
        self._np["positions"][:n] = positions
        self._np["slots"][:n] = table[seq, positions // block_size] * block_size + positions % block_size
        self._np["prefix"][:n] = positions + 1
        if self.cuda:
            for name, host in self.host.items():
                getattr(self, name).copy_(host, non_blocking=True)
        self.h[:real * q].copy_(embedded)
        if batch > real:
            self.h[real * q:n].copy_(embedded[-q:].repeat(batch - real, 1))

    def views(self, kv, mode: str, batch: int) -> tuple:
        """(the graph's row-wise inputs, its logits rows, the GraphPass) over views of the buffers
        for `batch` sequences in attention `mode`."""
        n = batch * self.q_rows
        positions = self.positions[:n]
        graph = attention_op.GraphPass(
            positions=positions, slots=self.slots[:n], tables=self.tables[:batch], row_seq=self.row_seq[:n],
            prefix=self.prefix[:n], extra_start=self.extra_start[:n + 1], extra_keys=self.extra_keys,
            uniform=self.q_rows if mode == KERNELS else 0, **attention_op.pool_args(kv, mode))
        return (self.h[:n], positions), self.logit_rows[:n], graph


class _Call:
    """The CPU's stand-in for a CUDA graph: it records the step's call over the buffers' views
    and replays it by calling it again (the graph reads the buffers as they were refilled).
    After the first call (which may build the graph) the arguments are prepared once: a replay
    is the graph's call alone, as a CUDA graph's is (about 0.1 ms of Python a step saved)."""

    def __init__(self, compiled, inputs, rows, graph):
        self.compiled, self.args = compiled, (inputs, rows, graph)
        self.out = compiled.run(*self.args)
        prepared = compiled.prepare(*self.args)
        # kept where they are the buffers' own tensors (nothing padded or copied): refilling the
        # buffers refills them; else (a bucket padded further on CUDA) prepared at each replay
        self.prepared = prepared if prepared.holds(*self.args) else None

    def replay(self):
        self.out = self.compiled.run_prepared(self.prepared or self.compiled.prepare(*self.args))
        return self.out


class _CudaGraph:
    """The step's call captured as a CUDA graph over the buffers (after one warm call), replayed
    with torch.cuda.CUDAGraph.replay; its outputs copied out of the recording's own tensors."""

    def __init__(self, call):
        call()
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.recorded = call()
        self.out = self.replay()                # a capture computes nothing: this pass's outputs

    def replay(self):
        self.graph.replay()
        return tuple(t.clone() for t in self.recorded)     # the next replay overwrites the recording's own


# Batch sizes recorded per device (None: every size is its own recording, nothing padded).
BATCH_SIZES = {"cuda": CUDA_BATCH_SIZES, "cpu": None}
# The buffers' first capacity; a pass with more sequences or a longer table makes new ones, twice
# as large (and records again): max_num_seqs is a live setting, contexts grow.
FIRST_SEQS, FIRST_BLOCKS = 8, 64


class DecodeGraphs:
    """Uniform passes of a runner's pool (the module's docstring): `run` fills the buffers for
    the pass's Q and replays the recording of its padded batch size. `refusal` says why CUDA
    graphs are not in use, where a capture failed (the pass then replays by calling)."""

    def __init__(self, compiled, kv):
        self.compiled, self.kv = compiled, kv
        self.device = kv.k.device
        self.sizes = BATCH_SIZES.get(self.device.type)
        self.buffers: dict[int, StepBuffers] = {}
        self.recordings: dict[tuple[str, int, int], object] = {}
        self.refusal: str | None = None
        self.replays = 0                          # passes run here (tests read it)

    @property
    def state(self) -> str:
        """How uniform passes run here ("In effect")."""
        if self.device.type != "cuda":
            return "persistent buffers, each batch size replayed by calling the graph (nothing padded)"
        sizes = f"batches padded up to one of {len(self.sizes)} sizes, {self.sizes[0]} to {self.sizes[-1]}"
        if self.refusal is not None:
            return f"persistent buffers, replayed by calling the graph ({sizes}): {self.refusal}"
        return f"a CUDA graph per batch size, recorded at first use ({sizes})"

    def batch_for(self, count: int) -> int:
        """The batch size a pass of `count` sequences is padded to."""
        if self.sizes is None or count > self.sizes[-1]:
            return count
        return next(b for b in self.sizes if b >= count)

    def run(self, mode: str, embedded: torch.Tensor, starts: list[int], tables: list[list[int]],
            q_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 logits [S * Q, V], hidden states [S * Q, hidden]) of a uniform pass in attention
        `mode`: S sequences from `starts` (their block tables), Q rows each (their embedded rows
        [S * Q, ...], sequence by sequence), their new K/V stored."""
        batch = self.batch_for(len(starts))
        buffers = self._buffers(q_rows, batch, max(len(t) for t in tables), embedded)
        buffers.fill(embedded, starts, tables, self.kv.block_size, batch)
        key = (mode, q_rows, batch)
        recording = self.recordings.get(key)
        if recording is None:
            recording = self.recordings[key] = self._record(buffers, mode, batch)
            out = recording.out
        else:
            out = recording.replay()
        self.replays += 1
        n = len(starts) * q_rows
        return out[0][:n], out[1][:n]

    def _buffers(self, q_rows: int, seqs: int, blocks: int, embedded: torch.Tensor) -> StepBuffers:
        """The buffers for Q rows a sequence, made (again, larger, dropping Q's recordings) where
        the pass does not fit."""
        have = self.buffers.get(q_rows)
        if have is not None and seqs <= have.max_seqs and blocks <= have.tables.shape[1]:
            return have
        grow = (have.max_seqs, have.tables.shape[1]) if have is not None else (FIRST_SEQS // 2, FIRST_BLOCKS // 2)
        size = (max(seqs, 2 * grow[0]), max(blocks, 2 * grow[1]))
        self.recordings = {k: r for k, r in self.recordings.items() if k[1] != q_rows}
        with torch.inference_mode():
            self.buffers[q_rows] = StepBuffers(*size, q_rows, embedded.shape[1], embedded.dtype, self.device)
        return self.buffers[q_rows]

    def _record(self, buffers: StepBuffers, mode: str, batch: int):
        inputs, rows, graph = buffers.views(self.kv, mode, batch)
        if self.device.type == "cuda" and self.refusal is None:
            try:
                return _CudaGraph(lambda: self.compiled.run(inputs, rows, graph))
            except Exception as error:      # noqa: BLE001 - any capture failure: replay by calling
                self.refusal = f"CUDA graph capture failed ({type(error).__name__}: {first_line(error)})"
        return _Call(self.compiled, inputs, rows, graph)
