"""Our quantized CPU linear (cpu_quant_linear.cpp, the torch op `workbench_cpu::linear_q`):
4-bit weights in groups of 32 and 8-bit weights in groups of 32 or 16, each weight w = d * u + m
with u an unsigned integer, activations quantized per row to int8 in blocks of 32. Each group's
dot is an exact integer (AVX-512 VNNI; AVX-VNNI; AVX2; scalar), the floats are accumulated in
order over K, so a row's bits depend neither on the row count nor on the instruction set.
The 256-bit paths are one source (cpu_quant_tile256.h) built three ways: AVX2, AVX-VNNI (its
VEX vpdpbusd: Intel's Alder Lake and later desktops), and the same code in AVX-512 VL's
encoding (`avx512vl_vnni`), which AVX-512 machines run in the tests so the AVX-VNNI code is
tested where no AVX-VNNI CPU is at hand.

Built with our CPU linear, into the same library (engine.kernels.cpu_linear.load). Tried before
it is used (`refusal`): on random weights of both widths, each instruction set this CPU offers
must give the scalar path's bits for 1, 5 and 9 rows and agree with the dequantized weight.
Of the sets that pass, each row count runs the one measured fastest here (`plan`,
engine.kernels.cpu_quant_paths); `force_isa` (or WORKBENCH_CPU_ISA=avx2|avx_vnni|scalar...) runs
one at every row count.

Scales are stored in fp16 when every d and m is exactly an fp16 number (a GGUF's are), else
in fp32: exact either way, and fp16 saves a sixth of a 4-bit weight's bytes.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from engine import cpu_features
from engine.errors import first_line
from engine.kernels import cpu_linear, cpu_quant_paths

COLS, XBLOCK = 16, 32           # output columns per tile; activation block
GROUPS = {4: (32,), 5: (32,), 8: (32, 16)}
ISAS = cpu_linear.ISAS
NEEDS = {"scalar": (), "avx2": ("avx2", "fma", "f16c"), "avx_vnni": ("avx2", "fma", "f16c", "avx_vnni"),
         "avx512vl_vnni": ("avx2", "fma", "f16c", "avx512f", "avx512vl", "avx512_vnni"),
         "avx512": ("avx512f", "avx512bw", "avx512_vnni")}
OFFSET8 = 128                   # an 8-bit q is stored as u = q + 128
KQUANT_BLOCK_BYTES = {4: 144, 5: 176, 6: 210}   # Q4_K, Q5_K, Q6_K: a file's bytes per super-block and row
_chosen: dict[str, str] = {}
_measured: dict[str, cpu_quant_paths.Plan] = {}     # the measured plan, once per process
_codes: dict[tuple, int] = {}                       # code() per state of the two above


class Fused(NamedTuple):
    """What the op folds around its product (cpu_fused.h), in its schema's order: an RMSNorm's
    weight and eps before it, or a SwiGLU gate (the input is [gate | up]); a residual added after."""
    norm: torch.Tensor | None = None
    eps: float = 0.0
    glu: bool = False
    residual: torch.Tensor | None = None


NOTHING_FUSED = Fused()


@functools.cache
def refusal() -> str | None:
    """Why our quantized CPU linear cannot serve here (None: it built and passed its trials)."""
    return cpu_linear.tried("our quantized CPU linear", _chosen, NEEDS, _trial, _register_fake)


@functools.cache
def _register_fake() -> None:
    """The op's output shape for the compiler (torch.compile traces with fake tensors)."""
    torch.library.register_fake("workbench_cpu::linear_q")(
        lambda x, w, scales, bias, bits, group, isa, norm=None, eps=0.0, glu=False, residual=None:
        x.new_empty(x.shape[0], w.shape[0] * COLS))
    torch.library.register_fake("workbench_cpu::linear_at")(
        lambda x, index, out_features, bias, norm=None, eps=0.0, glu=False, residual=None:
        x.new_empty(x.shape[0], out_features))
    torch.library.register_fake("workbench_cpu::embed_rows")(
        lambda w, scales, bits, ids: w.new_empty(ids.numel(), w.shape[1] * (w.shape[2] // COLS if bits == 8 else 32),
                                                 dtype=torch.float32))


def _trial(isa: str) -> str | None:
    gen = torch.Generator().manual_seed(0)
    for bits, group in ((4, 32), (5, 32), (8, 32), (8, 16)):
        n, k = 3 * COLS, 96
        u = torch.randint(0, 2 ** bits, (n, k), generator=gen)
        d = (torch.rand(n, k // group, generator=gen) / 8 + 1e-3).half().float()
        m = (torch.randn(n, k // group, generator=gen) / 8).half().float()
        w, scales = pack(u, d, m, bits)
        x = torch.randn(9, k, generator=gen)
        try:
            got = torch.ops.workbench_cpu.linear_q(x, w, scales, None, bits, group, ISAS[isa])
            scalar = torch.ops.workbench_cpu.linear_q(x, w, scales, None, bits, group, ISAS["scalar"])
            rows = [torch.ops.workbench_cpu.linear_q(x[:r], w, scales, None, bits, group, ISAS[isa]) for r in (1, 5)]
        except RuntimeError as error:
            return f"{isa} {bits}-bit failed ({first_line(error)})"
        if not torch.equal(got, scalar) or not all(torch.equal(r, got[:len(r)]) for r in rows):
            return f"{isa} {bits}-bit rounds unlike the scalar path"
        want = x @ unpack(w, scales, bits).t()
        if not torch.allclose(got, want, rtol=5e-2, atol=5e-2 * want.abs().max().item()):
            return f"{isa} {bits}-bit gave wrong results"
    return _fused_trial(isa, w, scales, bits, group, gen)


def _fused_trial(isa: str, w: torch.Tensor, scales: torch.Tensor, bits: int, group: int,
                 gen: torch.Generator) -> str | None:
    """What the op folds around its product (a norm; a gate; a residual), in fp32 and bf16, must
    give the scalar path's bits on this path too."""
    k, n = w.shape[1] * group, w.shape[0] * COLS
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(5, 2 * k, generator=gen).mul(4).to(dtype)
        res = torch.randn(5, n, generator=gen).to(dtype)
        norm = torch.rand(k, generator=gen).add(0.5).to(dtype)
        for args in ((x[:, :k], Fused(norm, 1e-5)), (x, Fused(glu=True, residual=res))):
            try:
                got, scalar = (torch.ops.workbench_cpu.linear_q(args[0], w, scales, None, bits, group, ISAS[path], *args[1])
                               for path in (isa, "scalar"))
            except RuntimeError as error:
                return f"{isa} with a norm or gate failed ({first_line(error)})"
            if not torch.equal(got, scalar):
                return f"{isa} rounds a norm, gate or residual unlike the scalar path ({dtype})"
    return None


def isa() -> str:
    """The widest path that passed its trial, or the one forced."""
    return _chosen.get("isa", "scalar")


def plan() -> cpu_quant_paths.Plan:
    """The path each row count runs: measured on this CPU (engine.kernels.cpu_quant_paths) among
    the paths that passed their trials, unless one was forced (WORKBENCH_CPU_ISA, force_isa, a
    test) or only one runs."""
    chosen = isa()
    passed = [p for p in _chosen.get("passed", "").split(",") if p and p != "scalar"]
    if _chosen.get("forced") or chosen != (passed[-1] if passed else "scalar"):
        return cpu_quant_paths.Plan(chosen, chosen, why=f"forced ({chosen})")
    if len(passed) < 2:
        return cpu_quant_paths.Plan(chosen, chosen, why="the only path that runs here")
    if "plan" not in _measured:
        key = (f"{cpu_features.model_name()} | {cpu_features.isa_name()} | {','.join(cpu_features.simd_flags())} | "
               f"{cpu_linear.build_tag()} | torch {torch.__version__} | {torch.get_num_threads()} threads")
        try:
            _measured["plan"] = cpu_quant_paths.measured_plan(
                passed, chosen, key, cpu_linear.build_dir(),
                lambda: cpu_quant_paths.Probe(COLS, ISAS, KQUANT_BLOCK_BYTES[4]).seconds)
        except RuntimeError as error:
            _measured["plan"] = cpu_quant_paths.Plan(chosen, chosen, why=f"the widest: timing failed ({first_line(error)})")
    return _measured["plan"]


def code() -> int:
    """The op's `isa` argument for the plan in effect (asked by every eager call: kept per
    state, a dict lookup instead of the plan's checks)."""
    state = (_chosen.get("isa"), _chosen.get("forced"), _chosen.get("passed"), id(_measured.get("plan")))
    found = _codes.get(state)
    if found is None:
        found = _codes[state] = plan().code(ISAS)
    return found


def force_isa(name: str | None) -> None:
    """Run with `name` ('avx512' meaning VNNI, 'avx512vl_vnni', 'avx_vnni', 'avx2', 'scalar') at
    every row count, or None: the measured plan over the paths that passed."""
    cpu_linear.force(_chosen, name, refusal)
    if name:
        _chosen["forced"] = name


def packable(shape: tuple[int, int], bits: int, group: int) -> str | None:
    """Why a weight [out, in] cannot take this kernel (None: it can)."""
    out, inp = shape
    if group not in GROUPS[bits]:
        return f"{bits}-bit groups of {group} (the kernel takes {', '.join(map(str, GROUPS[bits]))})"
    if out % COLS:
        return f"out_features {out} is not a multiple of {COLS}"
    if inp % XBLOCK or inp % group:
        return f"in_features {inp} is not a multiple of {max(XBLOCK, group)}"
    return None


def _scales(d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """[N, K/G] d and m -> [N/16, K/G, 2, 16], in fp16 where that is exact, else fp32."""
    n, groups = d.shape
    both = torch.stack([d.float(), m.float()], dim=1)                    # [N, 2, K/G]
    both = both.reshape(n // COLS, COLS, 2, groups).permute(0, 3, 2, 1).contiguous()
    half = both.half()
    return half if torch.equal(half.float(), both) else both


def pack(u: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """u [N, K] unsigned integers (0..15, 0..31 or 0..255), d, m [N, K / G] with w = d * u + m
    -> (w [N/16, K/G, bytes], scales [N/16, K/G, 2, 16]): the layout in cpu_quant_linear.cpp
    (5-bit: the 4-bit nibbles, then bit 4 as a bit plane, as a Q5_K group's)."""
    n, k = u.shape
    group = k // d.shape[1]
    tiles, groups = n // COLS, k // group
    u8 = u.to(torch.uint8)
    if bits in (4, 5):
        # [tile, col, group, half, j, i] -> [tile, group, j, col, i]; low nibble: half 0
        v = (u8 & 0x0F).reshape(tiles, COLS, groups, 2, 4, 4)
        lo, hi = (v[:, :, :, h].permute(0, 2, 3, 1, 4) for h in (0, 1))
        w = (lo | (hi << 4)).reshape(tiles, groups, 256)
        if bits == 5:
            w = torch.cat([w, bit_planes(u8, tiles, groups, 1)], dim=-1)
    else:
        w = u8.reshape(tiles, COLS, groups, group // 4, 4).permute(0, 2, 3, 1, 4).reshape(tiles, groups, group * COLS)
    return w.contiguous(), _scales(d, m)


def bit_planes(u: torch.Tensor, tiles: int, groups: int, count: int) -> torch.Tensor:
    """u [N, groups * 32] (uint8) -> bits 4 .. 3 + count of each value as bit planes [tiles,
    groups, 64 * count]: per j < 4, per half (low nibbles, high ones), per plane a 64-bit mask
    over the 64 bytes of j (bit c*4 + i), little-endian."""
    by = u.reshape(tiles, COLS, groups, 2, 4, 4).permute(0, 2, 4, 3, 1, 5).reshape(tiles, groups, 4, 2, 1, 64)
    plane_bits = (by >> (4 + torch.arange(count, dtype=torch.uint8).reshape(1, 1, 1, 1, -1, 1))) & 1
    plane_bits = plane_bits.reshape(*plane_bits.shape[:-1], 8, 8)          # [.., plane, byte, bit]
    planes = plane_bits[..., 0].clone()
    for b in range(1, 8):
        planes |= plane_bits[..., b] << b
    return planes.reshape(tiles, groups, 64 * count)


def _values(w: torch.Tensor, bits: int) -> torch.Tensor:
    """Packed bytes [T, groups, bytes] -> u [T, groups, 32, 16] (group's k, column): the 4-bit
    nibbles with (5-bit) their plane's bit 4."""
    tiles, groups, _ = w.shape
    v = w[..., :256].reshape(tiles, groups, 4, COLS, 4)                         # [tile, group, j, col, i]
    u = torch.stack([v & 0x0F, v >> 4], dim=2)                                   # [tile, group, half, j, col, i]
    if bits == 5:
        planes = w[..., 256:320].reshape(tiles, groups, 4, 2, 8)                 # [tile, group, j, half, byte]
        bit = (planes[..., None] >> torch.arange(8, dtype=torch.uint8)) & 1      # [.., byte, bit]: value c*4 + i
        u = u | (bit.reshape(tiles, groups, 4, 2, COLS, 4).permute(0, 1, 3, 2, 4, 5) << 4)
    return u.permute(0, 1, 2, 3, 5, 4).reshape(tiles, groups, 32, COLS)


def unpack(w: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    """The float weight [N, K] = d * u + m that a packed weight holds, rounded once to fp32
    (exact where fp32 holds it: an 8-bit (u - 128) * d always)."""
    tiles, groups, nbytes = w.shape
    group = nbytes // COLS if bits == 8 else 32
    if bits == 8:
        u = w.reshape(tiles, groups, group // 4, COLS, 4).permute(0, 3, 1, 2, 4)
    else:
        u = _values(w, bits).permute(0, 3, 1, 2)                                 # [tile, col, group, k]
    u = u.reshape(tiles * COLS, groups, group).double()
    s = scales.double().permute(0, 3, 1, 2).reshape(tiles * COLS, groups, 2, 1)
    return (u * s[:, :, 0] + s[:, :, 1]).reshape(tiles * COLS, groups * group).float()


def rows(w: torch.Tensor, scales: torch.Tensor, bits: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the float weight d * u + m (unpack's values, fp32): an embedding looked up
    in its tied head's packed bytes, without a float copy of the table. Our op where the
    library runs (a decode step's lookup: about 1 us against 66), else rows_reference."""
    if refusal() is None:
        return torch.ops.workbench_cpu.embed_rows(w, scales, bits, ids)
    return rows_reference(w, scales, bits, ids)


def rows_reference(w: torch.Tensor, scales: torch.Tensor, bits: int, ids: torch.Tensor) -> torch.Tensor:
    """rows in torch ops: d * u + m in fp64, rounded once to fp32 (the op's reference)."""
    tiles, groups, nbytes = w.shape
    group = nbytes // COLS if bits == 8 else 32
    tile, col = ids // COLS, ids % COLS
    if bits == 8:
        u = w[tile].reshape(len(ids), groups, group // 4, COLS, 4)[torch.arange(len(ids)), :, :, col]
    else:
        u = _values(w[tile], bits)[torch.arange(len(ids)), :, :, col]                            # [n, group, k]
    s = scales[tile].double()[torch.arange(len(ids)), :, :, col]                                # [n, group, 2]
    values = u.reshape(len(ids), groups, group).double() * s[..., :1] + s[..., 1:]
    return values.reshape(len(ids), groups * group).float()


def linear(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, bits: int,
           fused: Fused = NOTHING_FUSED) -> torch.Tensor:
    """x [M, K] -> [M, N] in x's dtype (with `fused`'s norm, gate or residual around the product:
    x [M, 2K] with a gate)."""
    return torch.ops.workbench_cpu.linear_q(x, w, scales, bias, bits, group_of(w, bits), code(), *fused)


def group_of(w: torch.Tensor, bits: int) -> int:
    """The op's group of packed bytes `w`: 4-bit 32; 8-bit a group's bytes over its columns;
    a K-quant's super-block, 256 (engine.kernels.cpu_kquant: its tiles hold more than 512 bytes,
    an 8-bit group of 32 exactly 512)."""
    if w.shape[2] > 32 * COLS:
        return 256
    return w.shape[2] // COLS if bits == 8 else 32


# ---- weights named by index (a compiled graph's calls; see register_weights in the source) --
def register(weights: list[tuple[torch.Tensor, torch.Tensor, int]]) -> int:
    """Keep (packed bytes, scales, bits) of a model's weights for linear_at, in this order: their
    indices. Returns the key `use` takes; `forget` drops them."""
    return torch.ops.workbench_cpu.register_weights([w for w, _, _ in weights], [s for _, s, _ in weights],
                                                    [bits for _, _, bits in weights],
                                                    [group_of(w, bits) for w, _, bits in weights])


def forget(key: int) -> None:
    torch.ops.workbench_cpu.forget_weights(key)


def use(key: int) -> None:
    """The weights linear_at reads on this thread (a step, before its graph runs), on the
    paths planned now."""
    torch.ops.workbench_cpu.use_weights(key, code())


def linear_at(x: torch.Tensor, index: int, out_features: int, bias: torch.Tensor | None,
              fused: Fused = NOTHING_FUSED) -> torch.Tensor:
    """x [M, K] -> [M, out_features] through weight `index` of those in use (`fused`: as `linear`)."""
    return torch.ops.workbench_cpu.linear_at(x, index, out_features, bias, *fused)
