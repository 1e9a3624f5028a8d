"""oneDNN's prepacked weights for linear layers in CPU inference.

oneDNN reads a weight fastest in its own blocked layout (VNNI for bf16, which the AMX and
AVX512-BF16 units consume); given a plain `[out, in]` tensor it reorders the weight on every
call. Inductor's `freezing` packs weights once, but it also folds them into the compiled
graph as constants, so its disk cache can never hit. We pack them ourselves, once, when a
model is set up for CPU inference: the eager step calls the packed kernel directly, and a
compiled graph calls it through the custom op below, so the weights stay out of the graph
and inductor's on-disk cache works across processes.

Measured on this 2-core CPU (SmolLM2-135M shapes, 2 threads, one row): bf16 packed reads a
weight 1.8-2.2x faster than bf16 plain (the 49,152 x 576 head: 1.43 ms against 3.1 ms);
fp32 is the same for one row and about 2x faster for the 5 rows of a k=4 verify pass. A
packed weight alone does not make a row's result independent of the pass it is in: a 1-row
call takes oneDNN's matrix-vector kernel, which rounds differently from the matrix kernel of
every call with 2 rows or more (fp32: every shape; bf16: the 1536 -> 576 down projection).
So a 1-row input is padded to 2 rows. From 2 rows up, every row count gave each row the same
bits on this CPU (2..512 rows, every shape of the default model, fp32 and bf16); pack time
checks that on the machine it runs on (`check_rows`), and where it does not hold, every call
is cut into fixed ROW_TILE-row tiles instead (a function of the row alone by construction).
That is what makes the engine batch-invariant (engine.scheduler).

Not every CPU runs every dtype here: on an AVX2-only CPU (no AVX-512, no AVX-NE-CONVERT)
oneDNN refuses bf16 altogether ("bf16 path needs the cpu support avx_ne_convert or
avx512bw, avx512vl and avx512dq"). So a linear takes one of BACKENDS, each tried on this CPU
before it serves (`refusals`): our CPU linear (engine.kernels.cpu_linear, row-invariant by
construction: no padding), oneDNN (`refusal`: pack a tiny weight, call it, compare with
F.linear), or torch's own matmul through the same row padding and row check. Of those
that run, the CPU probe's fastest (`prefer`, engine.runtime.cpu_dtype) serves each dtype.
"""
from __future__ import annotations

import contextlib
import functools
import threading

import torch
import torch.nn.functional as F

from engine.errors import first_line
from engine.kernels import cpu_linear

AVAILABLE = (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
             and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
DTYPES = (torch.float32, torch.bfloat16)


def refusal(dtype: torch.dtype) -> str | None:
    """Why oneDNN's linear cannot serve `dtype` on this CPU (None: it can). Tried once per
    process on a tiny weight; tests replace this function to force the fallback."""
    return _tried(dtype)


@functools.cache
def _tried(dtype: torch.dtype) -> str | None:
    if not AVAILABLE:
        return f"this torch ({torch.__version__}) has no oneDNN linear"
    if dtype not in DTYPES:
        return f"oneDNN's packed linear is used for {', '.join(str(d).removeprefix('torch.') for d in DTYPES)} only"
    gen = torch.Generator().manual_seed(0)
    weight, x = torch.randn(48, 64, generator=gen), torch.randn(3, 64, generator=gen)
    try:
        got = _onednn(x.to(dtype), _onednn_pack(weight.to(dtype)), None).float()
    except RuntimeError as error:
        return f"oneDNN refused {str(dtype).removeprefix('torch.')} here: {first_line(error)}"
    want = F.linear(x.to(dtype).float(), weight.to(dtype).float())
    if not torch.allclose(got, want, rtol=2e-2, atol=2e-2):
        return f"oneDNN's {str(dtype).removeprefix('torch.')} linear gave wrong results here"
    return None


# The kernels a float linear can take on the CPU, fastest first where each runs:
#   ours   - engine.kernels.cpu_linear: row-invariant by construction (no padding), needs a compiler
#   onednn - oneDNN's inner product on its packed layout (1-row calls padded to MIN_ROWS)
#   torch  - torch's matmul on the plain weight (the same padding)
BACKENDS = ("ours", "onednn", "torch")
_preferred: dict[torch.dtype, str] = {}      # what the CPU probe measured fastest (engine.runtime.cpu_dtype)


def refusals(dtype: torch.dtype) -> dict[str, str]:
    """Why each backend cannot serve `dtype` here (absent: it can)."""
    found = {"ours": cpu_linear.refusal() if dtype in cpu_linear.DTYPES else f"our CPU linear has no {dtype}",
             "onednn": refusal(dtype)}
    return {name: why for name, why in found.items() if why}


def prefer(dtype: torch.dtype, name: str) -> None:
    """Serve `dtype` with backend `name` (the probe's choice) where it runs."""
    if name not in BACKENDS:
        raise ValueError(f"unknown linear backend {name!r}; known: {BACKENDS}")
    _preferred[dtype] = name


@contextlib.contextmanager
def preferring(dtype: torch.dtype, name: str):
    """Prefer `name` for `dtype` inside the block (the probe times each backend)."""
    before = _preferred.get(dtype)
    prefer(dtype, name)
    try:
        yield
    finally:
        _preferred.pop(dtype, None) if before is None else prefer(dtype, before)


def backend(dtype: torch.dtype) -> str:
    """The backend serving `dtype`: the preferred one if it runs here, else the first that does."""
    refused = refusals(dtype)
    wanted = _preferred.get(dtype)
    if wanted is not None and wanted not in refused:
        return wanted
    return next(name for name in BACKENDS if name not in refused)


def path(dtype: torch.dtype) -> str:
    """Which kernel serves a float linear in `dtype` on this CPU, and why ("In effect")."""
    chosen, refused = backend(dtype), refusals(dtype)
    said = {"ours": f"ours ({cpu_linear.isa()}), packed at load", "onednn": "oneDNN, packed at load",
            "torch": "torch matmul"}[chosen]
    skipped = [f"{name}: {why}" for name, why in refused.items() if BACKENDS.index(name) < BACKENDS.index(chosen)]
    if _preferred.get(dtype) not in (None, chosen) and _preferred[dtype] not in refused:
        skipped.append(f"{_preferred[dtype]} measured slower")
    return said + (f" ({'; '.join(skipped)})" if skipped else "")


def _packer(weight: torch.Tensor) -> str | None:
    """The backend that packs this weight: its dtype's, or oneDNN where ours cannot take the
    shape (an out width that is not whole 32-column blocks); None: it stays plain."""
    if not (weight.device.type == "cpu" and weight.dim() == 2 and weight.dtype in DTYPES):
        return None
    chosen = backend(weight.dtype)
    if chosen == "ours" and not cpu_linear.packable(weight):
        chosen = "torch" if "onednn" in refusals(weight.dtype) else "onednn"
    return None if chosen == "torch" else chosen


def packable(weight: torch.Tensor) -> bool:
    return _packer(weight) is not None


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The weight `[out, in]` in its backend's layout: ours [out / 32, in, 32], or oneDNN's
    (an opaque mkldnn tensor of the same shape)."""
    return cpu_linear.pack(weight) if _packer(weight) == "ours" else _onednn_pack(weight)


def _onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """The plain `[out, in]` weight back, bit for bit."""
    if packed.dim() == 3:
        return cpu_linear.unpack(packed)
    return packed.to_dense()


MIN_ROWS = 2        # a 1-row call takes another kernel
ROW_TILE = 16       # rows per call where row counts from 2 up do not agree on this CPU
CHECK_ROWS = (2, 3, 16, 64)
_fixed_tiles = False


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, in] -> [M, out] on the packed (or plain) weight; a row's result does not depend
    on M (see the module docstring)."""
    rows = x.shape[0]
    if packed.dim() == 3 or (rows >= MIN_ROWS and not _fixed_tiles):     # ours needs no padding
        return _call(x, packed, bias)
    tile = ROW_TILE if _fixed_tiles else MIN_ROWS
    pad = -rows % tile
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    tiles = [_call(t, packed, bias) for t in x.split(tile)]
    out = tiles[0] if len(tiles) == 1 else torch.cat(tiles)
    return out[:rows] if pad else out


def _call(x, weight, bias):
    """Ours on its packed layout, oneDNN on its own (or on a plain weight where it serves the
    dtype), else torch's matmul."""
    if weight.dim() == 3:
        return cpu_linear.linear(x, weight, bias)
    if weight.is_mkldnn or refusal(weight.dtype) is None:
        return _onednn(x, weight, bias)
    return F.linear(x, weight, bias)


def _onednn(x, weight, bias):
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def check_rows(weights: list[torch.Tensor]) -> bool:
    """Whether each row's result is the same for every row count in CHECK_ROWS, for each
    weight shape; if not, fixed tiles from now on. Returns whether the check passed."""
    global _fixed_tiles
    gen = torch.Generator().manual_seed(0)
    seen = set()
    for w in weights:
        key = (tuple(w.shape), w.dtype)
        if key in seen:
            continue
        seen.add(key)
        x = torch.randn(max(CHECK_ROWS), w.shape[1], generator=gen).to(w.dtype)
        full = _call(x, w, None)
        if not all(torch.equal(_call(x[:n], w, None), full[:n]) for n in CHECK_ROWS[:-1]):
            _fixed_tiles = True
            return False
    return True


# ---- compiled graphs ---------------------------------------------------------------
# A packed tensor is opaque to the compiler, so a graph names a weight by its index in the
# packed weights of the model whose compiled step is running (set by `use`, per thread).
# Indices follow the model's module order, so the same model gives the same graph, and the
# same cache key, in every process.
_running = threading.local()


def use(weights: list[torch.Tensor]) -> None:
    """The packed weights a compiled graph's `workbench::packed_linear` calls refer to."""
    _running.weights = weights


def _packed_linear(x: torch.Tensor, index: int, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    return linear(x, _running.weights[index], bias)


def _packed_linear_shape(x, index, out_features, bias):
    return x.new_empty(x.shape[0], out_features)


# Registered at the library level with a CPU kernel: measured 1-2 us per call over the bare
# oneDNN call, where torch.library.custom_op's wrapper adds about 16 us (121 calls a step).
_LIBRARY = torch.library.Library("workbench", "DEF")
_LIBRARY.define("packed_linear(Tensor x, int index, int out_features, Tensor? bias) -> Tensor")
_LIBRARY.impl("packed_linear", _packed_linear, "CPU")
torch.library.register_fake("workbench::packed_linear", _packed_linear_shape, lib=_LIBRARY)
packed_linear = torch.ops.workbench.packed_linear.default
