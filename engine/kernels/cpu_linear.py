"""Our CPU linear (cpu_linear.cpp, the torch op `workbench_cpu::linear`): fp32 and bf16
weights packed at load into 32-column blocks, each output one FMA chain over k in order, so
a row's bits do not depend on the row count or on the instruction set (AVX-512, AVX2 + FMA,
scalar). The weights stream once per call for every row, with no 2-row padding and no
second kernel for one row.

Built at first use with torch.utils.cpp_extension (gcc and ninja) into the user cache
folder, keyed by the source's hash, so later processes load it in milliseconds; a build killed
midway is taken over by the next load, never waited on (engine.kernels.build_lock). Tried
before it is used (`refusal`): it must build, and on a random weight each instruction set
this CPU offers must give the scalar path's bits and agree with torch's matmul. The widest
set that passes runs; `force_isa` (or WORKBENCH_CPU_ISA=avx2|scalar in the environment)
picks another (tests force the AVX2 path on an AVX-512 CPU). Where it does not build (no compiler), the engine falls back to oneDNN and says why.
"""
from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from engine import cpu_features
from engine.errors import first_line
from engine.kernels.build_lock import build_lock

# one library: this op, the quantized one (cpu_quant_linear.cpp, engine.kernels.cpu_quant), the
# FP8 cache read (cpu_fp8.cpp, engine.kernels.cpu_fp8), paged attention (cpu_attention.cpp,
# engine.kernels.cpu_attention), a decoder's layers in one call (cpu_decoder.cpp) and the K-quants'
# repacking at load (cpu_kquant_pack.cpp, engine.kernels.cpu_kquant)
SOURCES = [Path(__file__).with_name(name)
           for name in ("cpu_linear.cpp", "cpu_quant_linear.cpp", "cpu_fp8.cpp", "cpu_attention.cpp", "cpu_decoder.cpp",
                        "cpu_kquant_pack.cpp")]
HEADERS = [Path(__file__).with_name(name) for name in ("cpu_bf16.h", "cpu_quant_tile256.h", "cpu_fused.h")]   # in the hash, not compiled alone
BLOCK = 32                          # output columns per packed block (NB in the source)
# narrowest first: the last one a CPU passes runs. avx_vnni and avx512vl_vnni are the quantized
# linear's only (the same 256-bit code with AVX-VNNI's VEX or AVX-512 VL's EVEX vpdpbusd).
ISAS = {"scalar": 0, "avx2": 1, "avx512vl_vnni": 4, "avx_vnni": 3, "avx512": 2}
NEEDS = {"scalar": (), "avx2": ("avx2", "fma"), "avx512": ("avx512f",)}
DTYPES = (torch.float32, torch.bfloat16)
ISA_ENV = "WORKBENCH_CPU_ISA"
_chosen: dict[str, str] = {}        # "isa": the instruction set in use, once tried


def build_dir() -> Path:
    from platformdirs import user_cache_dir
    cache = os.environ.get("WORKBENCH_CACHE_DIR") or user_cache_dir("inference-workbench")
    return Path(cache) / "cpu_kernels" / f"torch-{torch.__version__}"


# -fopenmp: at::parallel_for is inline OpenMP; without it every call ran on one thread. The
# libgomp it links is the one torch loaded already (the same soname), so there is one pool.
FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp"]


@functools.cache
def build_tag() -> str:
    """The hash of the sources and flags: the build's folder, and part of the CPU probe's key."""
    return hashlib.sha256(b"".join(s.read_bytes() for s in SOURCES + HEADERS) + " ".join(FLAGS).encode()).hexdigest()[:12]


def load() -> None:
    """Compile (once per source and torch version) and load the op library; where the build
    failed, raise its error again (with the compiler's output) on every call."""
    error = _built()
    if error is not None:
        raise error


@functools.cache
def _built() -> Exception | None:
    """The build's error, kept: torch does not build a failed extension again in one process,
    so a second try would only say the library is missing, not why."""
    from torch.utils.cpp_extension import load
    folder = build_dir() / build_tag()
    folder.mkdir(parents=True, exist_ok=True)
    try:
        with build_lock(folder):        # torch's own lock, left by a killed build, would be waited on forever
            load(name=f"workbench_cpu_{build_tag()}", sources=[str(source) for source in SOURCES],
                 extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
                 build_directory=str(folder), is_python_module=False, verbose=False)
    except Exception as error:      # noqa: BLE001 - a compiler missing or failing is the answer
        return error
    return None


@functools.cache
def refusal() -> str | None:
    """Why our CPU linear cannot serve here (None: it built and passed its trials)."""
    try:
        load()
    except Exception as error:      # noqa: BLE001 - a compiler missing or failing is the answer
        return f"our CPU linear did not build here ({type(error).__name__}: {first_line(error)})"
    return choose_isa(_chosen, NEEDS, _trial, "our CPU linear")


def tried(what: str, chosen: dict[str, str], needs: dict[str, tuple[str, ...]], trial, register_fake) -> str | None:
    """Why an op of this library cannot serve here (None: it built and an instruction set
    passed its trial, kept in `chosen`). Shared by every op the library holds."""
    try:
        load()
        register_fake()
    except Exception as error:      # noqa: BLE001 - a compiler missing or failing is the answer
        return f"{what} did not build here ({type(error).__name__}: {first_line(error)})"
    return choose_isa(chosen, needs, trial, what)


def choose_isa(chosen: dict[str, str], needs: dict[str, tuple[str, ...]], trial, what: str) -> str | None:
    """Try each instruction set this CPU offers (`needs`: the flags each one needs) and keep
    the widest that passed `trial`, or the one ISA_ENV asks for, in `chosen`; else say why
    none can serve. Shared by our float and quantized linears."""
    flags = cpu_features.flags()
    offered = [isa for isa in ISAS if isa in needs and all(f in flags for f in needs[isa])]
    passed = [isa for isa in offered if trial(isa) is None]
    if "scalar" not in passed:
        return f"{what} failed its trial here: {trial('scalar')}"
    wanted = os.environ.get(ISA_ENV)
    if wanted and wanted not in needs:      # a set only another op of the library has (avx_vnni)
        wanted = None
    if wanted and wanted not in passed:
        return f"{ISA_ENV}={wanted} asks for an instruction set {what} did not pass here (passed: {', '.join(passed)})"
    chosen.setdefault("isa", wanted or passed[-1])
    chosen.setdefault("passed", ",".join(passed))
    chosen.setdefault("forced", wanted or "")
    return None


def force(chosen: dict[str, str], name: str | None, refusal) -> None:
    """Run with `name` ('avx512', 'avx2', 'scalar'), or None: the widest that passed
    (`refusal` is tried again)."""
    for said in ("isa", "passed", "forced"):
        chosen.pop(said, None)
    if name is not None:
        if name not in ISAS:
            raise ValueError(f"unknown instruction set {name!r}; known: {', '.join(ISAS)}")
        chosen["isa"] = name
    refusal.cache_clear()
    refusal()


def _trial(isa: str) -> str | None:
    """None when `isa` gives the scalar path's bits for 1, 3 and 17 rows, in fp32 and bf16,
    and agrees with torch's matmul."""
    gen = torch.Generator().manual_seed(0)
    for dtype in DTYPES:
        weight = torch.randn(2 * BLOCK, 80, generator=gen).to(dtype)
        x = torch.randn(17, 80, generator=gen).to(dtype)
        packed = pack(weight)
        try:
            got = torch.ops.workbench_cpu.linear(x, packed, None, ISAS[isa])
            scalar = torch.ops.workbench_cpu.linear(x, packed, None, ISAS["scalar"])
            rows = [torch.ops.workbench_cpu.linear(x[:n], packed, None, ISAS[isa]) for n in (1, 3)]
        except RuntimeError as error:
            return f"{isa} failed ({first_line(error)})"
        if not torch.equal(got, scalar) or not all(torch.equal(r, got[:len(r)]) for r in rows):
            return f"{isa} rounds unlike the scalar path"
        if not torch.allclose(got.float(), F.linear(x.float(), weight.float()), rtol=2e-2, atol=2e-2):
            return f"{isa} gave wrong results"
    return None


def isa() -> str:
    """The instruction set our CPU linear runs with (after `refusal()` passed)."""
    return _chosen.get("isa", "scalar")


def force_isa(name: str | None) -> None:
    """Run with `name` ('avx512', 'avx2', 'scalar'), or None: the widest that passed."""
    force(_chosen, name, refusal)


def packable(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.dtype in DTYPES and weight.shape[0] % BLOCK == 0


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N / 32, K, 32]: each block of 32 output columns, k-major."""
    n, k = weight.shape
    return weight.detach().reshape(n // BLOCK, BLOCK, k).transpose(1, 2).contiguous()


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """The plain [N, K] weight back, bit for bit."""
    blocks, k, _ = packed.shape
    return packed.transpose(1, 2).reshape(blocks * BLOCK, k)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] -> [M, N] in x's dtype."""
    return torch.ops.workbench_cpu.linear(x, packed, bias, ISAS[isa()])

