"""llama.cpp's K-quants (Q4_K, Q5_K, Q6_K) read by our quantized CPU linear as stored: a weight
costs the file's bits (4.5, 5.5, 6.5625), repacked at load into the kernel's tiles of 16 output
columns, never widened (cpu_quant_linear.cpp, "K-quants read as stored", has the layout).

The op is `workbench_cpu::linear_q` with group 256 (a super-block) and bits 4, 5 or 6, and no
scales tensor: the super-block's scales travel in its bytes, regrouped by column, and are
decoded in registers. Its arithmetic is the 4- and 8-bit groups' (U exact per group, then the
two fmas in order over K) with d = d_sb * sc and m = -dmin * min (Q6_K: m = -32 d), each exact
in fp32, so a K-quant gives the bits of the same weight widened with fp32 scales; the tests
hold it to that.

Tried before it serves (`refusal`): after our quantized linear's own trial, each K-quant on
random blocks must give the scalar path's bits for 1, 5 and 9 rows on the instruction set in
use and agree with its dequantized weight. A refused one is served in its old widened form
(engine.loading.weight_quant), and the report says why.
"""
from __future__ import annotations

import functools

import torch

from engine.errors import first_line
from engine.kernels import cpu_quant

COLS, SUPER = cpu_quant.COLS, 256
TYPES = {"Q4_K": 4, "Q5_K": 5, "Q6_K": 6}                 # GGUF type -> the op's bits
BLOCK_BYTES = cpu_quant.KQUANT_BLOCK_BYTES               # the file's bytes per super-block and row
PLANES = {4: 0, 5: 1, 6: 2}                              # high bits kept as bit planes
GROUP = {4: 32, 5: 32, 6: 16}                            # k per scale


@functools.cache
def refusal() -> str | None:
    """Why the K-quants cannot be read as stored here (None: they passed their trials)."""
    why = cpu_quant.refusal()
    if why:
        return why
    plan = cpu_quant.plan()
    gen = torch.Generator().manual_seed(0)
    for isa, bits in ((isa, bits) for isa in dict.fromkeys((plan.few, plan.many)) for bits in BLOCK_BYTES):
        raw = random_blocks(3 * COLS, 2 * SUPER, bits, gen)
        w = pack(raw, bits)
        x = torch.randn(9, 2 * SUPER, generator=gen)
        try:
            got = linear(x, w, bits, isa)
            scalar = linear(x, w, bits, "scalar")
            rows = [linear(x[:r], w, bits, isa) for r in (1, 5)]
        except RuntimeError as error:
            return f"our K-quant linear, {isa} Q{bits}_K, failed ({first_line(error)})"
        if not torch.equal(got, scalar) or not all(torch.equal(r, got[:len(r)]) for r in rows):
            return f"our K-quant linear, {isa} Q{bits}_K, rounds unlike the scalar path"
        want = x @ unpack(w, bits).t()
        if not torch.allclose(got, want, rtol=5e-2, atol=5e-2 * want.abs().max().item()):
            return f"our K-quant linear, {isa} Q{bits}_K, gave wrong results"
    return None


def linear(x: torch.Tensor, w: torch.Tensor, bits: int, isa: str | None = None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] -> [M, N] in x's dtype, through packed super-blocks `w`."""
    return torch.ops.workbench_cpu.linear_q(x, w, _NO_SCALES, bias, bits, SUPER,
                                            cpu_quant.ISAS[isa] if isa else cpu_quant.code())


_NO_SCALES = torch.empty(0)


def packable(shape: tuple[int, int]) -> str | None:
    """Why a weight [out, in] cannot be read as K-quant super-blocks (None: it can)."""
    out, inp = shape
    if out % COLS:
        return f"out_features {out} is not a multiple of {COLS}"
    if inp % SUPER:
        return f"in_features {inp} is not a multiple of the super-block {SUPER}"
    return None


# ---- the file's blocks -> integers -----------------------------------------------------------
def _scale_min(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 bytes -> 8 six-bit scales and mins (ggml's get_scale_min_k4)."""
    lo, hi, mix = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = torch.cat([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], dim=-1)
    mn = torch.cat([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], dim=-1)
    return sc, mn


def _nibble_values(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K / Q5_K's 128 bytes of nibbles [..., 128] -> 256 values: bytes 32j .. 32j + 31 hold
    sub-block 2j in their low nibbles, 2j + 1 in their high ones."""
    v = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    return torch.cat([v & 0x0F, v >> 4], dim=-2).reshape(*qs.shape[:-1], SUPER)


def decode(raw: torch.Tensor, bits: int) -> dict[str, torch.Tensor]:
    """The file's rows of super-blocks [N, blocks * bytes] uint8 -> u [N, K] (0 .. 2^bits - 1),
    sc [N, K / group] (Q6_K: int8), mn (Q4_K, Q5_K), and d, dmin as fp16 bytes [N, blocks, 2]."""
    n = raw.shape[0]
    b = raw.reshape(n, -1, BLOCK_BYTES[bits])
    if bits == 6:
        ql, qh = b[..., :128].reshape(n, -1, 2, 1, 64), b[..., 128:192].reshape(n, -1, 2, 1, 32)
        low = torch.cat([ql & 0x0F, ql >> 4], dim=3).reshape(n, -1, 2, 4, 32)
        high = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 1, 4, 1)) & 0x03
        return {"u": (low | (high << 4)).reshape(n, -1), "sc": b[..., 192:208].reshape(n, -1).view(torch.int8),
                "d": b[..., 208:210]}
    sc, mn = _scale_min(b[..., 4:16])
    if bits == 4:
        u = _nibble_values(b[..., 16:144])
    else:
        u = _nibble_values(b[..., 48:176])
        qh = b[..., 16:48].reshape(n, -1, 1, 32)          # bit j of byte l: value l of sub-block j
        u = u | ((((qh >> torch.arange(8, dtype=torch.uint8).reshape(1, 1, 8, 1)) & 1) << 4).reshape(n, -1, SUPER))
    return {"u": u.reshape(n, -1), "sc": sc.reshape(n, -1), "mn": mn.reshape(n, -1), "d": b[..., 0:2],
            "dmin": b[..., 2:4]}


def _fp16_bytes(t: torch.Tensor) -> torch.Tensor:
    """fp16 bytes [..., 2] -> float32 [...]."""
    return t.contiguous().view(torch.float16)[..., 0].float()


def dequantize_blocks(raw: torch.Tensor, bits: int) -> torch.Tensor:
    """The float weight [N, K] of the file's blocks, w = d*sc * u - dmin*m (Q6_K: d*sc * (u - 32)),
    each product exact, rounded once to fp32: gguf's values."""
    f = decode(raw, bits)
    n, k = f["u"].shape
    groups = k // GROUP[bits]
    per = groups // f["d"].shape[1]
    d = _fp16_bytes(f["d"]).double().repeat_interleave(per, dim=1)
    u = f["u"].double().reshape(n, groups, GROUP[bits])
    if bits == 6:
        w = (d * f["sc"].double())[..., None] * (u - 32)
    else:
        dmin = _fp16_bytes(f["dmin"]).double().repeat_interleave(per, dim=1)
        w = (d * f["sc"].double())[..., None] * u - (dmin * f["mn"].double())[..., None]
    return w.reshape(n, k).float()


# ---- integers -> the kernel's tiles ---------------------------------------------------------
def pack(raw: torch.Tensor, bits: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The file's rows of super-blocks [N, K / 256 * bytes] -> [N / 16, K / 256, 16 * bytes] in
    the kernel's layout (the same bytes, regrouped), written into `out` when given (a slice of
    a larger weight's tiles): by our op (cpu_kquant_pack.cpp, at about the speed memory
    copies), else by `pack_reference`, whose bytes the op's are (tests)."""
    raw = torch.as_tensor(raw)
    if cpu_quant.refusal() is not None:     # the library our kernels are built into did not load
        packed = pack_reference(raw, bits)
        return packed if out is None else out.copy_(packed)
    if out is None:
        out = raw.new_empty((raw.shape[0] // COLS, raw.shape[1] // BLOCK_BYTES[bits], COLS * BLOCK_BYTES[bits]))
    torch.ops.workbench_cpu.kquant_pack_into(raw.contiguous(), bits, out)
    return out


def pack_reference(raw: torch.Tensor, bits: int) -> torch.Tensor:
    """`pack` in torch ops: the definition of the layout."""
    raw = torch.as_tensor(raw)
    f = decode(raw, bits)
    n, k = f["u"].shape
    tiles, blocks, groups = n // COLS, k // SUPER, k // 32
    u = f["u"]
    v = (u & 0x0F).reshape(tiles, COLS, groups, 2, 4, 4)        # [tile, col, group, half, j, i]
    lo, hi = (v[:, :, :, h].permute(0, 2, 3, 1, 4) for h in (0, 1))
    parts = [(lo | (hi << 4)).reshape(tiles, groups, 256)]
    if PLANES[bits]:
        parts.append(cpu_quant.bit_planes(u, tiles, groups, PLANES[bits]))
    body = torch.cat(parts, dim=-1).reshape(tiles, blocks, -1)

    def by_column(t: torch.Tensor) -> torch.Tensor:        # [N, blocks, x] -> [tiles, blocks, x, 16]
        return t.reshape(tiles, COLS, blocks, -1).permute(0, 2, 3, 1)

    def fp16_columns(t: torch.Tensor) -> torch.Tensor:     # fp16 bytes [N, blocks, 2] -> [tiles, blocks, 32]
        return t.reshape(tiles, COLS, blocks, 2).permute(0, 2, 1, 3).reshape(tiles, blocks, 2 * COLS)

    if bits == 6:
        scales = [by_column(f["sc"].view(torch.uint8).reshape(n, blocks, 16)).reshape(tiles, blocks, 16 * COLS),
                  fp16_columns(f["d"])]
    else:
        sc, mn = (by_column(f[key].reshape(n, blocks, 8)) for key in ("sc", "mn"))     # [tiles, blocks, 8, 16]
        low = (sc & 0x0F) | ((mn & 0x0F) << 4)
        top = (sc >> 4) | ((mn >> 4) << 2)
        scales = [torch.cat([low, top[..., :8] | (top[..., 8:] << 4)], dim=-1).reshape(tiles, blocks, 8 * 24),
                  fp16_columns(f["d"]), fp16_columns(f["dmin"])]
    return torch.cat([body, *scales], dim=-1).contiguous()


def unpack(w: torch.Tensor, bits: int) -> torch.Tensor:
    """The float weight [N, K] that packed super-blocks hold (the kernel's d * u + m, rounded
    once to fp32): dequantize_blocks' values."""
    return dequantize_blocks(blocks_of(w, bits), bits)


def blocks_of(w: torch.Tensor, bits: int, cols: torch.Tensor | None = None) -> torch.Tensor:
    """Packed tiles [T, blocks, 16 * bytes] -> the file's rows of super-blocks [T * 16, blocks * bytes];
    cols [T]: of each tile only that column's row, [T, blocks * bytes] (a lookup decodes one row, not 16)."""
    tiles, blocks, _ = w.shape
    width = COLS if cols is None else 1

    def pick(t: torch.Tensor, dim: int) -> torch.Tensor:       # the columns kept, along `dim` (of size 16)
        if cols is None:
            return t
        shape = [1] * t.dim()
        shape[0] = tiles
        return t.gather(dim, cols.view(shape).expand(*t.shape[:dim], 1, *t.shape[dim + 1:]))

    groups = blocks * 8
    pl = PLANES[bits]
    body = w[..., :8 * (256 + 64 * pl)].reshape(tiles, groups, 256 + 64 * pl)
    v = pick(body[..., :256].reshape(tiles, groups, 4, COLS, 4), 3)       # [tile, group, j, col, i]
    u = torch.stack([v & 0x0F, v >> 4], dim=2)                             # [tile, group, half, j, col, i]
    if pl:
        planes = body[..., 256:].reshape(tiles, groups, 4, 2, pl, 8)
        bit = (planes[..., None] >> torch.arange(8, dtype=torch.uint8)) & 1        # [.., pl, 8 bytes, 8 bits]
        bit = pick(bit.reshape(tiles, groups, 4, 2, pl, COLS, 4), 5).permute(0, 1, 3, 4, 2, 5, 6)  # [.., half, pl, j, col, i]
        for p in range(pl):
            u = u | (bit[:, :, :, p] << (4 + p))
    rows = tiles * width
    u = u.permute(0, 4, 1, 2, 3, 5).reshape(rows, blocks, SUPER)               # [row, block, 256]
    scales = w[..., 8 * (256 + 64 * pl):]

    def column_major(t: torch.Tensor, x: int) -> torch.Tensor:     # [tiles, blocks, x * 16] -> [rows, blocks, x]
        return pick(t.reshape(tiles, blocks, x, COLS), 3).permute(0, 3, 1, 2).reshape(rows, blocks, x)

    def fp16_rows(t: torch.Tensor) -> torch.Tensor:
        return pick(t.reshape(tiles, blocks, COLS, 2), 2).permute(0, 2, 1, 3).reshape(rows, blocks, 2)

    if bits == 6:
        q = u.reshape(rows, blocks, 2, 4, 32)
        low, high = q & 0x0F, q >> 4
        ql = (low[:, :, :, 0:2] | (low[:, :, :, 2:4] << 4)).reshape(rows, blocks, 128)
        qh = (high[:, :, :, 0] | (high[:, :, :, 1] << 2) | (high[:, :, :, 2] << 4) | (high[:, :, :, 3] << 6))
        return torch.cat([ql, qh.reshape(rows, blocks, 64), column_major(scales[..., :16 * COLS], 16),
                          fp16_rows(scales[..., 16 * COLS:])], dim=-1).reshape(rows, -1)
    low = column_major(scales[..., :8 * 24].reshape(tiles, blocks, 8, 24)[..., :16].reshape(tiles, blocks, -1), 8)
    top8 = scales[..., :8 * 24].reshape(tiles, blocks, 8, 24)[..., 16:]            # [tiles, blocks, 8, 8]
    top = torch.cat([top8 & 0x0F, top8 >> 4], dim=-1).reshape(tiles, blocks, -1)
    top = column_major(top, 8)
    sc, mn = (low & 0x0F) | ((top & 3) << 4), (low >> 4) | ((top >> 2) << 4)
    packed = torch.cat([(sc[..., :4]) | ((sc[..., 4:] >> 4) << 6), (mn[..., :4]) | ((mn[..., 4:] >> 4) << 6),
                        (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4)], dim=-1)
    d, dmin = fp16_rows(scales[..., 192:224]), fp16_rows(scales[..., 224:256])
    nib = u.reshape(rows, blocks, 4, 2, 32)
    qs = (nib[:, :, :, 0] & 0x0F) | ((nib[:, :, :, 1] & 0x0F) << 4)
    if bits == 4:
        return torch.cat([d, dmin, packed, qs.reshape(rows, blocks, 128)], dim=-1).reshape(rows, -1)
    hbit = (u >> 4).reshape(rows, blocks, 8, 32)
    qh = (hbit << torch.arange(8, dtype=torch.uint8).reshape(1, 1, 8, 1)).sum(2, dtype=torch.uint8)
    return torch.cat([d, dmin, packed, qh, qs.reshape(rows, blocks, 128)], dim=-1).reshape(rows, -1)


def rows(w: torch.Tensor, bits: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the float weight (unpack's values): an embedding looked up in its tied
    head's super-blocks, without a float copy of the table."""
    return dequantize_blocks(blocks_of(w[ids // COLS], bits, ids % COLS), bits)


def random_blocks(n: int, k: int, bits: int, gen: torch.Generator) -> torch.Tensor:
    """Random super-blocks [n, k / 256 * bytes] with finite fp16 d and dmin (a trial's, a test's)."""
    raw = torch.randint(0, 256, (n, k // SUPER, BLOCK_BYTES[bits]), dtype=torch.uint8, generator=gen)
    scale = (torch.rand(n, k // SUPER, 2, generator=gen) / 64 + 1e-3).half().view(torch.uint8).reshape(n, k // SUPER, 4)
    if bits == 6:
        raw[..., 208:210] = scale[..., :2]
    else:
        raw[..., 0:4] = scale
    return raw.reshape(n, -1)
