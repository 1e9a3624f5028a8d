"""One compiled step for every pass: prefill chunks, decodes, chains, trees, and any mix of them.

vLLM's piecewise compilation at our size. The model's layers are traced once by torch.compile
with a dynamic token dimension; attention is the op the graph is split at
(engine.layers.attention_op), one call per layer that stores the new K/V and attends over
the paged cache: our CPU kernel on the CPU (engine.kernels.cpu_attention; the torch path
where it is refused), the Triton kernels on CUDA. The
pieces between attention calls are row-wise (linears, norms, RoPE, the MLP), so a row's
result cannot depend on the other rows of the pass, and every pass of every request, of any
row count, takes this one graph: batch invariance holds compiled against compiled. The eager
pass stays the reference (tests compare within a tolerance) and is never mixed into a reply.

Whatever the compiler needs is arranged outside the compiled function: the token embedding
is looked up eagerly (a quantized table is read on the host), on CUDA rows are padded to a
token-count bucket (the padding repeats the last row and is dropped), and the pass's rows are
built on the host once per pass. The pool and the pass's rows are the graph's inputs
(attention_op.GraphPass: every dimension dynamic, the pool's blocks too), written and read by
the attention op, whose schema says it writes the pool; where our C++ attention serves, the
pool travels as bytes, so one graph per model serves every KV dtype, context and batch. A
uniform pass (a decode, a verify of k+1) runs over persistent buffers instead
(engine.runtime.decode_graphs).

On the CPU the linear layers call our kernels or oneDNN through custom ops that name packed
weights by index (engine.layers.packed_linear), so inductor's FX graph cache, kept in the user
cache folder, serves every later process. On CUDA the step records CUDA graphs of the pieces
between attention calls where the Python attention op runs (inductor's graph partitioning
around the cudagraph-unsafe op), one per token-count bucket (CUDA_TOKEN_BUCKETS, vLLM's capture
sizes); a uniform pass's graph has no such op (attention_op.uniform_attention), so it is one
piece.

The graph is built before it is timed: the app warms it at load (ModelRunner.warm_compiled,
with progress), and a call that compiles anyway (a recompile) is counted (`compiles`, and its
seconds in `untaken_compile_s`, which the engine puts on the step's event (`compile_s`) so that
engine.metrics keeps the step out of decode speed).

One graph serves every thread count. The thread governor (engine.thread_policy) moves torch's
count while other programs keep cores busy, and two things tied a CPU graph to the count it was
traced at: dynamo's GlobalStateGuard checks `num_threads` beside grad mode and the default
dtype (`TORCH_LOGS=recompiles`: "GLOBAL_STATE changed: num_threads"), and inductor's C++ kernels
were generated for it (`#pragma omp parallel num_threads(2)`, no parallel region at one
thread; the FX graph cache keys on it too). Each change recompiled the step inside a reply:
4.6 s on the 2-core CPU for the tiny test model, seconds more for a real one. So inductor
generates kernels that run on the calling thread (`cpp.threads = 1`: configure_compiler says
why; `cpp.dynamic_threads` as well, for any kernel that would ask OpenMP for the count), the
graph keeps every guard but the global-state one (`guard_filter_fn`), and `_ModelGraph` checks
the rest of that state itself (`GlobalStateBuilt`). A count change then costs nothing: the
same graph runs at the new count. The thread count never changes a row (every kernel on the
path splits rows or output columns, never a reduction: engine.thread_policy).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import time
import types
import weakref
from pathlib import Path
from typing import NamedTuple

import torch

from engine.errors import first_line
from engine.kernels import cpu_decoder, cpu_quant
from engine.layers import attention_op, packed_linear, quantized_linear
from engine.models.llama import logits_rows

MIN_ROWS = 2
# The pass's row tensors the graph takes (attention_op.GraphPass): every dimension varies.
ROW_TENSORS = ("positions", "slots", "tables", "row_seq", "prefix", "extra_start", "extra_keys")
# Token counts CUDA graphs are recorded for (vLLM's capture sizes up to 512): a pass is padded
# to the next one; past the last it runs in the compiled graph without CUDA graphs.
CUDA_TOKEN_BUCKETS = (2, 4, 8) + tuple(range(16, 257, 16)) + tuple(range(288, 513, 32))


def wanted(mode: str, device: torch.device) -> tuple[bool, str]:
    """(compile?, why) for the `compile` setting: `auto` and `on` compile wherever the compiler runs."""
    if mode == "off":
        return False, "off"
    missing = compiler_refusal(device.type)
    if missing:
        return False, f"off: {missing}"
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


def source_tag(root: Path) -> str:
    """A hash of the Python and C++ sources under `root`, with their paths."""
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".cpp", ".h") and p.is_file()):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


@functools.cache
def engine_source_tag() -> str:
    """The engine's sources' tag: the inductor cache's folder. Inductor keys a graph by its FX
    code, torch and its own settings, not by what our custom ops do behind their names; a graph
    cached by an earlier version of the engine once crashed a later one's first compiled call
    (heap corruption, `free(): invalid pointer`; a fresh folder ran clean), so every version of
    the engine compiles into a folder of its own."""
    return source_tag(Path(__file__).resolve().parents[1])


# The environment that changes what a compiled graph's code does without changing the graph:
# ATen's and inductor's vector ISA (ATEN_CPU_CAPABILITY), oneDNN's and MKL's caps, and our
# kernels' forced instruction set.
PLATFORM_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "WORKBENCH_CPU_ISA")
# The inductor folder configure_compiler chose, set beside TORCHINDUCTOR_CACHE_DIR: a child process
# inherits both, and must choose again for its own platform. Without the mark a child run under
# ATEN_CPU_CAPABILITY=avx2 (a test imitating an AVX2-only CPU) took its parent's folder as the
# user's choice and cached 8-lane kernels under the AVX-512 platform's keys; the parent's next
# process read them as its own and overran its buffers (heap corruption at load).
OUR_FOLDER_VARIABLE = "WORKBENCH_INDUCTOR_FOLDER"


def platform_tag() -> str:
    """A hash of what the compiled code runs with besides the engine's sources: torch's version,
    ATen's CPU capability and the vector ISA inductor generates for, and the variables above. A
    graph cached under ATEN_CPU_CAPABILITY=avx512 and read under =avx2 gave wrong tokens (seen in
    a test that imitates an AVX2-only CPU); one cached under each runs right. (An instruction
    set a test forces in-process with force_isa is not in it.)"""
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    parts = [torch.__version__, torch.backends.cpu.get_cpu_capability(), str(pick_vec_isa()),
             *(f"{name}={os.environ.get(name, '')}" for name in PLATFORM_VARIABLES)]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:8]


def configure_compiler(cache_dir: Path) -> None:
    """Inductor settings for inference, and its on-disk cache in our cache folder unless the
    user chose one (importing torch._dynamo already sets the variable to torch's /tmp default,
    which a reboot may wipe, so that value is replaced). Duck shaping is off: two dynamic
    sizes that happen to be equal at the first call (rows and logits rows) must not be
    assumed equal ever after. Inductor's C++ kernels take the thread count from OpenMP when
    they run instead of being generated for the count at compile time, so that the thread
    governor's changes never recompile (the module's docstring). Past dynamo's recompile limit (a graph per model architecture,
    dtype and weight format) it would run the function eagerly without a word, mixing
    roundings in a reply: it raises instead, and the runner goes eager and says why. Dynamo's
    garbage collection after each compile is off: the app compiles on its worker thread, and a
    collection there finalized Qt objects of the GUI thread while the GUI thread waited for the
    interpreter (a deadlock seen in the app tests)."""
    import torch._dynamo
    import torch._inductor.config as inductor
    import torch.fx.experimental._config as fx_config
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    ours = os.environ.get(OUR_FOLDER_VARIABLE)
    if current is None or os.path.abspath(current) in (os.path.abspath(default_cache_dir()),
                                                       ours and os.path.abspath(ours)):
        folder = str(cache_dir / "inductor" / f"{engine_source_tag()}-{platform_tag()}")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.environ[OUR_FOLDER_VARIABLE] = folder
    inductor.fx_graph_cache = True
    inductor.cpp.dynamic_threads = True
    # The graph's own kernels (norms, rotary, SiLU, residual adds, casts) run on the calling
    # thread: a decode row's are microseconds of work, and an OpenMP region each (a fork, a
    # barrier per loop, a join; about 150 a step of the default model) cost more than they
    # saved. The heavy ops (our linears, attention) keep every thread. Default model, bf16,
    # 2-core Xeon (2026-12-06), two runs each, interleaved: decode 9.36 / 7.79 -> 7.92 / 7.13 ms
    # a token (median of 7 replies), a 400-token prefill 805 / 831 -> 663 / 673 ms.
    inductor.cpp.threads = 1
    inductor.graph_partition = True             # CUDA graphs around the attention op
    # no size, stride and alignment checks of each custom op's output in the graph's wrapper
    # (two calls into torch per op, ~150 ops a step; the ops' fakes give their shapes)
    inductor.size_asserts = inductor.alignment_asserts = False
    fx_config.use_duck_shape = False
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    torch._dynamo.config.run_gc_after_compile = False


def target_pass(model):
    """A model's pass through its layers, inside the graph: (embedded rows [N, hidden], their
    positions [N], logits rows [R], no pool, the pass as attention takes it (GraphPass)) ->
    (float32 logits of those rows [R, V], final hidden states [N, hidden])."""
    def run(h: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, kv: None, graph: attention_op.GraphPass):
        hidden = model.decode_layers(h, positions, kv, graph)
        return model.logits(logits_rows(hidden, rows)), hidden
    return run


def _forward_of(run):
    """`run` (a model's pass: row-wise inputs [N, ...], logits rows, None and the GraphPass ->
    (logits of those rows, hidden states [N, ...])) as a function with a code object of its own."""
    def forward(*inputs: torch.Tensor):
        return run(*inputs)
    return types.FunctionType(forward.__code__.replace(), forward.__globals__, "forward", None, forward.__closure__)


class _ModelGraph:
    """A model's compiled pass, shared by every runner (and engine) serving that model: the
    target's layers (target_pass), or an EAGLE head's draft pass (EagleHead.draft_pass).

    Each model gets a code object of its own (_forward_of), so dynamo keeps its
    graphs apart from other models' (a draft, another dtype): guards never have to tell
    models apart, and once built the ~6,000 guards on the model's modules and weights
    (0.9 ms a call on the 2-core CPU, a sixth of a decode step) are skipped. Nothing they
    check changes: a loaded model is never modified, and the inputs' dtypes are the model's.
    On the CPU the global torch state is checked here, not by dynamo (GlobalStateBuilt: the
    thread count may change, the rest may not). Should anything else a graph is specialised
    to change, dynamo refuses to run under the skipping stance, nothing has run yet, and the
    call is made again with every guard evaluated, which compiles the graph for the new state
    once (or finds it)."""

    def __init__(self, model: torch.nn.Module, device: torch.device, run):
        self.model, self.on_cpu = model, device.type == "cpu"
        # the quantized weights our kernel serves, named by index in the graph (their tensors
        # would each cost a guard at every call), dropped with the model
        self.weights_key = quantized_linear.register_graph_weights(
            [m for m in model.modules() if getattr(m, "quant", None) is not None and hasattr(m, "quant_indices")]) if self.on_cpu else None
        if self.weights_key is not None:
            weakref.finalize(model, cpu_quant.forget, self.weights_key)
            cpu_decoder.register_fake()         # a Llama model's layers may run as one op (LlamaFamilyModel.stack_plan)
        forward = _forward_of(run)
        if not self.on_cpu:
            self.compiled = torch.compile(forward, mode="reduce-overhead", fullgraph=True)
        else:
            self.compiled = torch.compile(forward, fullgraph=True, options={"guard_filter_fn": all_but_global_state})
        self.compile_s: float | None = None            # the first call's seconds, once built
        self.state: GlobalStateBuilt | None = None     # CPU: the global torch state it was built under

    def __call__(self, *inputs):
        if self.compile_s is not None:
            if self.state is not None:
                self.state.check()
            try:
                with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                    return self.compiled(*inputs)
            except RuntimeError as error:
                if "skip_guard_eval_unsafe" not in str(error):
                    raise
        elif self.on_cpu:
            self.state = GlobalStateBuilt()
        return self.compiled(*inputs)


def all_but_global_state(guards) -> list[bool]:
    """torch.compile's guard_filter_fn: keep every guard but dynamo's GlobalStateGuard, which
    would recompile the graph for every thread count (GlobalStateBuilt checks the rest)."""
    return [guard.guard_type != "GLOBAL_STATE" for guard in guards]


def _state_but_threads() -> dict:
    from torch._C._dynamo.guards import GlobalStateGuard
    state = json.loads(GlobalStateGuard().__getstate__())
    state.pop("num_threads", None)
    return state


class GlobalStateBuilt:
    """The global torch state a graph was traced under (grad mode, autocast, default dtype,
    deterministic algorithms, matmul precision, torch function state) but the thread count:
    what dynamo's GlobalStateGuard checks, which the graph's own guards leave out. One dynamo
    guard per thread count seen keeps the check a few microseconds a call."""

    def __init__(self):
        from torch._C._dynamo.guards import GlobalStateGuard
        self.built = _state_but_threads()
        self.guards = {torch.get_num_threads(): GlobalStateGuard()}

    def check(self) -> None:
        """Raises when the state differs from the build's by more than the thread count (the
        runner then runs eagerly and says why)."""
        from torch._C._dynamo.guards import GlobalStateGuard
        threads = torch.get_num_threads()
        guard = self.guards.get(threads)
        if guard is not None and guard.check():
            return
        now = _state_but_threads()
        changed = sorted(name for name in now.keys() | self.built.keys() if now.get(name) != self.built.get(name))
        if changed:
            raise RuntimeError(f"the compiled step runs under other global torch state than it was built "
                               f"under ({', '.join(changed)} changed)")
        self.guards[threads] = GlobalStateGuard()


def model_graph(model: torch.nn.Module, device: torch.device, run=None) -> _ModelGraph:
    """The model's graph of `run` (default: target_pass), built once per model."""
    graph = model.__dict__.get("_workbench_graph")
    if graph is None:
        graph = model.__dict__["_workbench_graph"] = _ModelGraph(model, device, run or target_pass(model))
    return graph


class Prepared(NamedTuple):
    """A pass's arguments as the graph takes them (CompiledStep.prepare); n and r: its real
    rows and logits rows (the rest is padding)."""
    inputs: tuple
    rows: torch.Tensor
    graph: attention_op.GraphPass
    n: int
    r: int

    def holds(self, inputs: tuple, rows: torch.Tensor, graph: attention_op.GraphPass) -> bool:
        """Whether these are the given tensors themselves (nothing padded or copied), so that
        refilling those refills these."""
        given = (*inputs, rows, *(getattr(graph, name) for name in ROW_TENSORS))
        mine = (*self.inputs, self.rows, *(getattr(self.graph, name) for name in ROW_TENSORS))
        return len(given) == len(mine) and all(a is b for a, b in zip(given, mine))


class CompiledStep:
    """Runs a pass (ModelRunner.forward_batch's ids, metadata and logits rows) through the model's
    graph; `run` and `what` name another pass of the model (an EAGLE head's draft pass, whose
    inputs `call` takes) and how progress speaks of it."""

    def __init__(self, model: torch.nn.Module, device: torch.device, progress=None, run=None,
                 what: str = "the model's step"):
        self.model, self.device, self.what = model, device, what
        self.progress = progress or (lambda message, fraction: None)
        from engine.loading.loader import cache_dir
        configure_compiler(cache_dir())
        self.graph = model_graph(model, device, run)
        self.row_counts: set[int] = set()        # pass sizes run compiled by this runner (tests read it)
        # Calls that compiled (the first, or a recompile dynamo made): how many in all, and the
        # seconds and count not yet taken by take_compile_s / take_compiles (the engine marks
        # the step, keeps it out of decode speed and counts it in the step's stats).
        self.compiles = 0
        self.untaken_compile_s, self.untaken_compiles = 0.0, 0
        self._compiled = self.graph                   # per runner: tests replace it to make a step fail

    def __call__(self, ids: torch.Tensor, kv, meta, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 logits of `rows` [R, V], final hidden states [N, hidden]) for the pass whose
        token ids [N] and attention metadata are given; the new K/V are stored by the pass."""
        return self.call((self.model.embed_tokens(ids), meta.positions), kv, meta, rows)

    def call(self, inputs: tuple[torch.Tensor, ...], kv, meta, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The graph's outputs (logits of `rows` [R, ...], hidden states [N, ...]) for its row-wise
        inputs ([N, ...] each: the embedded tokens first); the new K/V are stored by the pass."""
        return self.run(inputs, rows, attention_op.graph_pass(kv, meta))

    def run(self, inputs: tuple[torch.Tensor, ...], rows: torch.Tensor,
            graph: attention_op.GraphPass) -> tuple[torch.Tensor, torch.Tensor]:
        """call's outputs for the pass as the graph takes it (engine.runtime.decode_graphs gives
        views of its persistent buffers: they are the graph's inputs as they are)."""
        return self.run_prepared(self.prepare(inputs, rows, graph))

    def prepare(self, inputs: tuple[torch.Tensor, ...], rows: torch.Tensor,
                graph: attention_op.GraphPass) -> "Prepared":
        """The graph's arguments for a pass: padded where the graph needs more rows, copied where
        dynamo would specialise on a view, their dimensions marked dynamic. Done once for a
        recording over persistent buffers (decode_graphs), whose tensors keep their marks."""
        n, r = inputs[0].shape[0], rows.shape[0]
        # On the CPU the row dimension is unbacked: the graph assumes nothing of its size, so a
        # 1-row decode runs as one row (padded to 2 before, it paid a second row in every linear:
        # 0.34 ms of the default model's 7 ms step; a backed size-oblivious trace still guarded
        # on 1 in view strides). The build itself still sees at least MIN_ROWS.
        least = MIN_ROWS if self.graph.compile_s is None else 1
        padded, padded_r = (max(padded_rows(count, self.device), least) for count in (n, r))
        if padded > n:
            inputs = tuple(torch.cat([t, t[-1:].expand(padded - n, *t.shape[1:])]) for t in inputs)
        if padded_r > r:
            rows = torch.cat([rows, rows.new_zeros(padded_r - r)])
        inputs, rows = tuple(map(_as_built, inputs)), _as_built(rows)
        graph = graph._replace(**{name: _as_built(getattr(graph, name)) for name in ROW_TENSORS})
        dynamic = torch._dynamo.decorators.mark_unbacked if self.device.type == "cpu" else torch._dynamo.mark_dynamic
        for t in (*inputs, rows):
            dynamic(t, 0)
        for name in ROW_TENSORS:
            t = getattr(graph, name)
            for dim in range(t.dim()):
                dynamic(t, dim)
        for pool in (graph.k_pool, graph.v_pool, graph.k_scale, graph.v_scale):
            if pool is None:
                continue
            if self.device.type == "cuda":  # the graph writes it: CUDA graphs need its address fixed
                torch._dynamo.mark_static_address(pool)
            for dim in range(1, pool.dim(), 3):     # its blocks (reconfigure rebuilds it), a row's bytes (its dtype)
                dynamic(pool, dim)
        return Prepared(inputs, rows, graph, n, r)

    def run_prepared(self, prepared: "Prepared") -> tuple[torch.Tensor, torch.Tensor]:
        """run's outputs for arguments `prepare` made (again, for a recording's replay)."""
        first = self.graph.compile_s is None
        if first:
            self.progress(f"compiling {self.what} (about a minute the first time on a small CPU; "
                          "seconds from the disk cache)…", 0.0)
        graphs_before = compiled_graphs()
        t0 = time.perf_counter()
        packed_linear.use(self.model.packed_weights)
        quantized_linear.use(self.graph.weights_key)
        logits, hidden = self._compiled(*prepared.inputs, prepared.rows, None, prepared.graph)
        self.row_counts.add(prepared.n)
        if first or compiled_graphs() != graphs_before:
            self.untaken_compile_s += time.perf_counter() - t0
            self.compiles += 1
            self.untaken_compiles += 1
        if first:
            self.graph.compile_s = time.perf_counter() - t0
            self.progress(f"compiled {self.what} in {self.graph.compile_s:.0f} s", 1.0)
        return logits[:prepared.r], hidden[:prepared.n]

    @property
    def is_built(self) -> bool:
        """Whether the model's graph was compiled already (in this process)."""
        return self.graph.compile_s is not None

    def take_compile_s(self) -> float:
        """Seconds spent in calls that compiled since the last time this was asked."""
        seconds, self.untaken_compile_s = self.untaken_compile_s, 0.0
        return seconds

    def take_compiles(self) -> int:
        """Calls that compiled since the last time this was asked."""
        count, self.untaken_compiles = self.untaken_compiles, 0
        return count


def _as_built(t: torch.Tensor) -> torch.Tensor:
    """A graph input as every call gives it: dynamo guards a tensor input's storage offset (a
    view's, such as one row of a table, specialised at 0 or 1) and its dispatch keys (an
    inference tensor has no ADInplaceOrView), so a view, or a tensor of the other mode, is
    copied into a fresh one of the mode running now."""
    if t.storage_offset() == 0 and t.is_contiguous() and t.is_inference() == torch.is_inference_mode_enabled():
        return t
    return t.clone(memory_format=torch.contiguous_format)


def padded_rows(n: int, device: torch.device) -> int:
    """Rows the graph runs for an n-token pass: on CUDA the next bucket (at least MIN_ROWS); on
    the CPU n itself (its row dimension is unbacked: one graph serves a single row too)."""
    if device.type == "cuda":
        return next((b for b in CUDA_TOKEN_BUCKETS if b >= max(n, MIN_ROWS)), n)
    return n


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process (it counts a graph served from inductor's
    disk cache too: dynamo still traces it)."""
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]
