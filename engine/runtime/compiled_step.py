"""The decode and verify step, compiled: torch.compile over the paged cache (gpt-fast's way).

One graph serves decode and verify: the row count (2..17; a decode step runs as two identical
rows, see CompiledStep.__call__), the context and the pool's size are dynamic dimensions, so
neither a growing chat nor a new k recompiles. Whatever the compiler needs is arranged outside
the compiled function: the block table is padded to at least MIN_TABLE_BLOCKS (a size-1
dimension would be specialised; on CUDA it grows in buckets, one CUDA graph each), the mask
hides padding and the future, and the slots are computed on the host. Prefill (many tokens,
run once per reply) stays eager. A new KV dtype (FP8 on or off) compiles once more.

On the CPU the linear layers call oneDNN on weights packed once at load (engine.layers.packed_linear,
through a custom op), so the weights are graph inputs, not constants: inductor's FX graph
cache, kept in the user cache folder, then serves every later process. The eager path is the
reference; the `compile` setting (off / on / auto) picks between them, and a compiled step
that fails (compiling, or CUDA graph capture) hands over to it with the reason in settings().

Measured on the 2-core CPU (SmolLM2-135M, bf16, 2 threads, one run): eager about 38 tok/s,
compiled 41-48 (noisy machine); compiling takes 57-60 s on a cold cache and 8-10 s from the
disk cache. 73 % of a compiled step is oneDNN's matrix-vector products, which read bf16
weights at 15-22 GB/s here. fp32 gains about 1.1x from compiling. `auto` compiles on
CUDA only: on the CPU the compiled step serves one request at a time and rounds unlike the
batched pass (batch invariance), so `on` asks for it there.

A compile is built before it is timed: the app warms the step at load (ModelRunner.warm_compiled,
with progress), and a call that compiles anyway (a new KV dtype, a recompile) is counted in
`untaken_compile_s`, which the engine puts on the step's event (`compile_s`) so that
engine.metrics keeps the step out of decode speed.
"""
from __future__ import annotations

import functools
import os
import shutil
import time
import weakref
from pathlib import Path

import torch

from engine.config import MAX_SPEC_TOKENS
from engine.errors import first_line
from engine.layers import packed_linear
from engine.layers.attention import write_kv
from engine.layers.attention_metadata import AttentionMetadata, pass_positions

MAX_COMPILED_TOKENS = MAX_SPEC_TOKENS + 1
MIN_TABLE_BLOCKS = 2
# CUDA graphs record one graph per shape, so on CUDA the block table grows in buckets of this
# many blocks (one recording per 256 tokens at block size 16, not one per block); the CPU
# graph is shape-generic, and padding would only add masked reads there.
TABLE_BUCKET_BLOCKS = {"cuda": 16}


def wanted(mode: str, device: torch.device, dtype: torch.dtype, use_kernels: bool) -> tuple[bool, str]:
    """(compile?, why) for the `compile` setting."""
    if mode == "off":
        return False, "off"
    missing = compiler_refusal(device.type)
    if missing:
        return False, f"off: {missing}"
    if use_kernels:
        return False, "off: the Triton kernels run eagerly"
    if mode == "auto" and device.type == "cpu":
        return False, "off (auto: the compiled step serves one request at a time and is not batch-invariant)"
    return True, "on" if mode == "on" else "on (auto)"


@functools.cache
def compiler_refusal(device_type: str) -> str | None:
    """Why inductor cannot build a CPU graph here (None: its C++ compiler is installed). A
    compile that fails anyway hands over to the eager step (ModelRunner._compile_failed)."""
    if device_type != "cpu":
        return None
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
        compiler = get_cpp_compiler()
    except Exception as error:      # noqa: BLE001 - any failure to find one is the answer
        return f"torch.compile finds no C++ compiler here ({first_line(error)}); install g++"
    if shutil.which(compiler) is None:
        return f"torch.compile's C++ compiler {compiler!r} is not installed; install g++"
    return None


def configure_compiler(cache_dir: Path) -> None:
    """Inductor settings for inference, and its on-disk cache in our cache folder unless the
    user chose one (importing torch._dynamo already sets the variable to torch's /tmp default,
    which a reboot may wipe, so that value is replaced)."""
    import torch._dynamo
    import torch._inductor.config as inductor
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir / "inductor")
    inductor.fx_graph_cache = True
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 4 * MAX_COMPILED_TOKENS)


class CompiledStep:
    """Calls the model's forward through torch.compile for N <= MAX_COMPILED_TOKENS tokens."""

    def __init__(self, model: torch.nn.Module, block_size: int, device: torch.device, progress=None):
        self.model, self.block_size, self.device = model, block_size, device
        self.progress = progress or (lambda message, fraction: None)
        from engine.loading.loader import cache_dir
        configure_compiler(cache_dir())
        mode = "reduce-overhead" if device.type == "cuda" else None     # CUDA graphs on CUDA
        self._compiled = torch.compile(self._forward, mode=mode, fullgraph=True)
        self.compiled_counts: set[int] = set()       # token counts already run compiled (this process)
        # Seconds of the first call per KV dtype: the compiles (a new KV dtype compiles again).
        self.compile_seconds: dict[str, float] = {}
        # Seconds of the calls that compiled (a first call, or a recompile dynamo made), not yet
        # taken by take_compile_s: the engine marks the step and keeps it out of decode speed.
        self.untaken_compile_s = 0.0
        self.table_bucket = TABLE_BUCKET_BLOCKS.get(device.type, 1)
        self._dynamic_pool = lambda: None            # weakref to the pool whose block dimension is marked

    def _forward(self, ids, kv, positions, slots, table, mask, logits_for):
        """A pure function of the cache: it reads the pool and returns the new K/V (writing the
        pool inside the graph made inductor copy the whole pool every step)."""
        meta = AttentionMetadata(positions, slots, table, table.shape[0] * self.block_size, False, mask, [])
        out = self.model.forward_with_hidden(ids, kv, meta, logits_for)
        # Every layer's new K/V (and FP8 scales) stacked, [L, N, ...]: written in one copy each.
        return out, [None if parts[0] is None else torch.stack(parts) for parts in zip(*meta.pending_kv)]

    def __call__(self, ids: list[int], kv, start: int, block_table: list[int], logits_for) -> tuple:
        """(logits as ModelRunner.forward gives them, final hidden states [N, hidden]).

        One graph serves decode and verify: a decode step runs as a 2-row pass whose second row
        repeats the first (same token, same position; its K/V are not written). Inductor
        computes a row the same way whatever the row count, but a graph specialised to one
        row fuses and rounds differently, and in bf16 that flipped near-tied greedy tokens
        between plain and speculative decoding. The extra row costs little (a 2-row pass
        reads the same weights) and halves the compile time."""
        n, bs = len(ids), self.block_size
        rows = max(n, 2)
        padded = max(MIN_TABLE_BLOCKS, -(-len(block_table) // self.table_bucket) * self.table_bucket)
        blocks = block_table + [block_table[0]] * (padded - len(block_table))      # masked out
        positions, table, slots = pass_positions(start, n, blocks, bs, self.device)
        if rows > n:
            positions, slots, ids = positions.repeat(rows), slots.repeat(rows), ids * rows
        mask = torch.arange(len(blocks) * bs, device=self.device)[None, :] <= positions[:, None]   # [rows, T]
        ids_t = torch.tensor(ids, dtype=torch.int64, device=self.device)
        # Dynamic dimensions: one graph for every row count, context and pool size, and a disk
        # cache key that does not depend on which came first.
        for t, dim in ((table, 0), (mask, 1), (ids_t, 0), (positions, 0), (slots, 0), (mask, 0)):
            torch._dynamo.mark_dynamic(t, dim)
        if kv is not self._dynamic_pool():                   # once per pool, not per step
            for pool in (kv.k, kv.v, kv.k_scale, kv.v_scale):
                if pool is not None and pool.shape[1] > 1:  # a size-1 dimension is always specialised
                    torch._dynamo.mark_dynamic(pool, 1)
            self._dynamic_pool = weakref.ref(kv)             # a released pool must be freed
        dtype = kv.name              # the scheme: the rotated FP8 cache is a graph of its own
        first = dtype not in self.compile_seconds
        if first:
            self.progress("compiling the decode and verify step (about a minute the first time on a small "
                          "CPU; seconds from the disk cache)…", 0.0)
        graphs_before = compiled_graphs()
        t0 = time.perf_counter()
        packed_linear.use(self.model.packed_weights)
        (logits, hidden), new_kv = self._compiled(ids_t, kv, positions, slots, table, mask, "all")
        # Written after the graph, all layers at once; the repeated row of a decode step is not.
        write_kv(kv.all_layers, tuple(None if x is None else x[:, :n] for x in new_kv), slots[:n])
        self.compiled_counts.add(n)
        if first or compiled_graphs() != graphs_before:
            self.untaken_compile_s += time.perf_counter() - t0
        if first:
            self.compile_seconds[dtype] = time.perf_counter() - t0
            self.progress(f"compiled the decode and verify step in {self.compile_seconds[dtype]:.0f} s", 1.0)
        keep = 1 if logits_for == "last" else logits_for
        return logits[n - keep:n], hidden[:n]

    def is_built(self, kv) -> bool:
        """Whether a graph for this pool's KV scheme was compiled already (in this process)."""
        return kv.name in self.compile_seconds

    def take_compile_s(self) -> float:
        """Seconds spent in calls that compiled since the last time this was asked."""
        seconds, self.untaken_compile_s = self.untaken_compile_s, 0.0
        return seconds


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process (it counts a graph served from inductor's
    disk cache too: dynamo still traces it)."""
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]
