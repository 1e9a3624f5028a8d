"""`bench kernels`' `per_type`: each stored type's kernel on its own, so a machine whose memory
is slow still shows what the kernel costs to compute.

For each GGUF type the loaded model serves quantized, two weights of random stored blocks of
that type, made into kernel weights by the loader's own path (engine.loading.weight_quant:
the form the table of stored formats gives the type here, the GGUF reader's decoder,
`stored_weight`; a large weight in slices of rows as the loader packs one), so when the
loader serves a type in another form the bench times that form:
  in cache   IN_CACHE_SHAPE (1.2 to 2.3 MB stored: in L2 where it holds that, else in L3), one
             thread, CALLS calls a timing after one untimed, at 1 and at 16 rows;
  stream     STREAM_SHAPE (tens of MB or more: well over L3), one call a timing, 1 row, on one
             thread and on all threads.
A rate is the weight's stored bytes (its GGUF blocks, what a file of it holds) per second of a
call: the bytes of the weight read per second, at 16 rows as at 1 (16 rows read the weight
once, so a kernel whose 16 rows cost more than one shows a lower rate). Each is the median
over ROUNDS rounds; every round also reads a buffer far larger than the caches (a sum) on one
thread and on all threads, taking turns with the kernel timings so the host's noise hits all
alike. `read_1_thread_gb_s` and `read_all_threads_gb_s` give those reads' best and median, and
the ratios divide a kernel's median rate by the median read of the same thread count.
"""
from __future__ import annotations

import statistics
import time
from contextlib import contextmanager

import numpy as np
import torch

from engine.layers import quantized_linear
from engine.loading.gguf_tensors import READ_BYTES, GGUFTensors, StoredTensor
from engine.loading.stored_formats import format_of
from engine.loading.weight_quant import AUTO, plan_linears, release_freed_memory, stored_weight
from engine.models.llama import Linear, WeightSource
from engine.speculative.step_costs import read_bandwidths

IN_CACHE_SHAPE = (1024, 2048)       # [out, in]
STREAM_SHAPE = (16384, 8192)        # Q8_0: 142 MB stored, the largest type served
ROUNDS = 15
CALLS = 16                          # in-cache calls a timing, so one timing outlasts the clock's grain
MANY_ROWS = 16
ONE, ALL = "1 thread", "all threads"
# The fp16 fields of each GGUF type's block (byte offsets: d, and dmin or m where it has one),
# set to small finite values in random blocks; the file format's, so no served form is assumed.
FP16_AT = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
           "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def served_quantized(report, dtype: torch.dtype) -> list[str]:
    """The GGUF types a load's WeightReport says are served in a kernel (the others: in the
    compute dtype, their description starting with its name)."""
    float_name = str(dtype).removeprefix("torch.")
    return [kind for kind, how in report.served.items()
            if format_of(kind).cpu.form is not None and not how.startswith(float_name)]


def per_type_rates(types: list[str], dtype: torch.dtype, buffer: torch.Tensor, rounds: int = ROUNDS,
                   in_cache_shape: tuple[int, int] = IN_CACHE_SHAPE, stream_shape: tuple[int, int] = STREAM_SHAPE,
                   calls: int = CALLS) -> dict:
    """{"per_type": {type: rates}, "read_1_thread_gb_s": {best, median}, "read_all_threads_gb_s":
    ...}: see the module docstring. `buffer`: the read test's, far larger than the caches.
    One type's weights at a time, freed before the next."""
    reads = {ONE: [], ALL: []}
    rates = {}
    for kind in types:
        rates[kind] = _time_type(kind, dtype, buffer, reads, rounds, in_cache_shape, stream_shape, calls)
    read = {n: {"best": round(max(r) / 1e9, 2), "median": round(statistics.median(r) / 1e9, 2)}
            for n, r in reads.items()}
    per_type = {}
    for kind, r in rates.items():
        gb_s = {name: round(value / 1e9, 2) for name, value in r.items() if name.endswith("_b_s")}
        entry = {"served": r["served"], "kernel_bytes_per_stored_byte": r["kernel_bytes_per_stored_byte"],
                 "in_cache_1_row_gb_s": gb_s["in_cache_1_row_b_s"],
                 "in_cache_16_rows_gb_s": gb_s["in_cache_16_rows_b_s"],
                 "in_cache_16_rows_time_over_1_row": round(r["in_cache_1_row_b_s"] / r["in_cache_16_rows_b_s"], 2),
                 "stream_1_thread_gb_s": gb_s["stream_1_thread_b_s"],
                 "stream_all_threads_gb_s": gb_s["stream_all_threads_b_s"]}
        entry |= {"in_cache_1_row_over_read_1_thread": round(entry["in_cache_1_row_gb_s"] / read[ONE]["median"], 3),
                  "stream_1_thread_over_read_1_thread": round(entry["stream_1_thread_gb_s"] / read[ONE]["median"], 3),
                  "stream_all_threads_over_read_all_threads":
                      round(entry["stream_all_threads_gb_s"] / read[ALL]["median"], 3)}
        per_type[kind] = entry
    return {"per_type": per_type, "per_type_shapes": {"in_cache": list(in_cache_shape), "stream": list(stream_shape)},
            "per_type_rounds": rounds, "read_1_thread_gb_s": read[ONE], "read_all_threads_gb_s": read[ALL]}


def _time_type(kind: str, dtype: torch.dtype, buffer: torch.Tensor, reads: dict[str, list[float]], rounds: int,
               in_cache_shape, stream_shape, calls: int) -> dict:
    """Bytes per second (medians) of one type's kernel, in cache and streaming, its rounds
    taking turns with the reads (appended to `reads`: ONE thread's, ALL threads')."""
    small, small_bytes, served = _weight(kind, in_cache_shape, dtype)
    large, large_bytes, _ = _weight(kind, stream_shape, dtype)
    gen = torch.Generator().manual_seed(0)
    x = {n: torch.randn(n, in_cache_shape[1], generator=gen).to(dtype) for n in (1, MANY_ROWS)}
    x_large = torch.randn(1, stream_shape[1], generator=gen).to(dtype)
    times = {"in_cache_1_row": [], "in_cache_16_rows": [], "stream_1_thread": [], "stream_all_threads": []}
    for repeat in range(rounds + 1):            # the first round warms the caches and the pools: dropped
        with _threads(1):
            read_1 = read_bandwidths(1, buffer, warm=False)
            _seconds(small, x[1], 1)               # the read just evicted it: back into the cache
            cache_1 = _seconds(small, x[1], calls) / calls
            cache_16 = _seconds(small, x[MANY_ROWS], calls) / calls
            stream_1 = _seconds(large, x_large, 1)
        read_all = read_bandwidths(1, buffer, warm=False)
        stream_all = _seconds(large, x_large, 1)
        if repeat:
            reads[ONE] += read_1
            reads[ALL] += read_all
            for name, t in zip(times, (cache_1, cache_16, stream_1, stream_all)):
                times[name].append(t)
    kernel_bytes = large.nbytes / large_bytes
    del large
    release_freed_memory()
    size = {"in_cache_1_row": small_bytes, "in_cache_16_rows": small_bytes,
            "stream_1_thread": large_bytes, "stream_all_threads": large_bytes}
    return {"served": served, "kernel_bytes_per_stored_byte": round(kernel_bytes, 3),
            **{f"{name}_b_s": size[name] / statistics.median(t) for name, t in times.items()}}


def _seconds(qw, x: torch.Tensor, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        quantized_linear.linear(x, qw, None)
    return time.perf_counter() - start


@contextmanager
def _threads(n: int):
    """torch's thread count set to n, restored after (also on an error)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _weight(kind: str, shape: tuple[int, int], dtype: torch.dtype):
    """(the kernel weight the loader makes of a [out, in] linear stored in `kind` with random
    blocks, its stored bytes, how the loader's report names its form)."""
    stored = RandomBlocks({_NAME: (kind, shape)})
    (plan,) = plan_linears(_OneLinear(shape), AUTO, torch.device("cpu"), stored, dtype)
    if not plan.as_stored:
        raise ValueError(f"{kind} is not served as stored here ({plan.why_not or format_of(kind).cpu.why}); "
                         "per_type times only the types the model serves quantized")
    qw = stored_weight(plan, stored, dtype)
    return qw, stored.nbytes(_NAME), format_of(kind).describe(*plan.forms[0])


_NAME = "linear.weight"


class _OneLinear(torch.nn.Module):
    """A model of one linear [out, in] on the meta device, for the loader's plan."""

    def __init__(self, shape: tuple[int, int]):
        super().__init__()
        with torch.device("meta"):
            self.linear = Linear(shape[1], shape[0])

    def weight_sources(self) -> list[WeightSource]:
        return [WeightSource(_NAME, ((_NAME, tuple(self.linear.weight.shape)),))]


class RandomBlocks(GGUFTensors):
    """The GGUF reader over tensors of random blocks of their type, made a slice of rows at a
    time where the reader reads a file's: the reader's own methods (which decoder, its checks,
    the order of rows) run on them, only the bytes come from a generator, and no file is
    opened (so the reader's __init__, which reads a file's header, is not run)."""

    def __init__(self, tensors: dict[str, tuple[str, tuple[int, int]]]):
        import gguf
        self._gguf = gguf
        self.layout = None          # not a hybrid file: transformers' columns are the file's
        self._resolved = {}
        for name, (kind, (out, inp)) in tensors.items():
            qtype = gguf.GGMLQuantizationType[kind]
            block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
            if inp % block_values:
                raise ValueError(f"{kind} stores blocks of {block_values} values; {inp} columns is not whole blocks")
            self._resolved[name] = StoredTensor(name, qtype, (inp, out), out * inp // block_values * block_bytes, 0)

    def _row_order(self, gguf_name: str, out: int) -> np.ndarray:
        return np.arange(out)

    def _read_rows(self, t, decode, dtype: torch.dtype | None, wanted: np.ndarray) -> tuple[torch.Tensor, ...]:
        """`decode` applied to random blocks for the rows `wanted`, a slice of rows at a time."""
        block_values, block_bytes = self._gguf.GGML_QUANT_SIZES[t.tensor_type]
        total = int(t.shape[-1])
        blocks = t.n_bytes // total // block_bytes
        step = max(1, READ_BYTES // (blocks * block_bytes))
        outputs = None
        for start in range(0, len(wanted), step):
            n = min(step, len(wanted) - start)
            raw = random_blocks(t.tensor_type.name, n, blocks, block_bytes, seed=int(wanted[start]))
            parts = [torch.from_numpy(np.ascontiguousarray(a)) for a in decode(raw)]
            if outputs is None:
                outputs = [torch.empty((len(wanted), *p.shape[1:]), dtype=dtype or p.dtype) for p in parts]
            for out, part in zip(outputs, parts):
                out[start:start + n] = part
        return tuple(outputs)


def random_blocks(kind: str, rows: int, blocks: int, block_bytes: int, seed: int) -> np.ndarray:
    """[rows, blocks, block_bytes] uint8 of random blocks of GGUF type `kind`, their fp16 scales
    (FP16_AT) small and finite."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, blocks, block_bytes), dtype=np.uint8)
    for at in FP16_AT.get(kind, ()):
        scale = (rng.random((rows, blocks, 1), dtype=np.float32) / 64 + 1e-3).astype(np.float16)
        raw[..., at:at + 2] = scale.view(np.uint8)
    return raw
