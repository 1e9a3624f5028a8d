"""Which instruction-set path our quantized CPU linear runs, by row count, measured on this CPU.

Every path gives the same bits (engine.kernels.cpu_quant: a row's result depends neither on
the row count nor on the instruction set), so the choice is only about speed, and the widest
set is not always the fastest: on a 2-core AMD Zen 4 the AVX2 path read the default model's
int4 weights faster than the AVX-512 VNNI one at one row (3.24 against 3.50 ms for its 120
linears) and slower at 16 rows (10.8 against 9.3 ms). So each path that passed its trial is
timed on weights too big for the L2 cache, at 1, 4 and 16 rows, in the two formats the engine
serves most (int4 groups of 32, the default model's; Q4_K super-blocks, the workstation
GGUFs'), interleaved, the best of REPEATS each. The plan: the path fastest at one row, and
from the first row count at which another is fastest, that one (`Plan`). A path must be
faster by MARGIN to displace the widest, so noise does not move the choice.

Measured once per CPU, instruction set, kernel build, torch version and thread count, kept
in the kernel build folder (`paths.json`); WORKBENCH_CPU_ISA (or cpu_quant.force_isa) runs
one path for every row count, unmeasured.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.user_cache import measured_once

ROW_COUNTS = (1, 4, 16)
REPEATS = 5
MARGIN = 0.05                   # a narrower path must be this much faster to run instead
PROBE_BYTES = 32 * 2**20        # of weights per format: past any core's L2
PROBE_SHAPE = (4096, 2048)      # [out, in] of each probe weight
CACHE_FILE = "paths.json"


@dataclass(frozen=True)
class Plan:
    """`few` below `many_from` rows, `many` from there (many_from 0: `few` always)."""
    few: str
    many: str
    many_from: int = 0
    why: str = ""
    measured: bool = False          # chosen by this CPU's timings (else forced, or the only path)

    def path(self, rows: int) -> str:
        return self.many if self.many_from and rows >= self.many_from else self.few

    def code(self, isas: dict[str, int]) -> int:
        """The op's `isa` argument: the path's number, or few | many << 4 | many_from << 8."""
        if not self.many_from or self.many == self.few:
            return isas[self.few]
        return isas[self.few] | isas[self.many] << 4 | self.many_from << 8

    def describe(self, name=lambda path: path) -> str:
        """'avx2', or 'avx2 below 4 rows, avx512 from 4'; then ', measured fastest here' where
        it was measured (`name`: a path's name as the reader knows it)."""
        said = (name(self.few) if not self.many_from or self.many == self.few
                else f"{name(self.few)} below {self.many_from} rows, {name(self.many)} from {self.many_from}")
        return f"{said}, measured fastest here" if self.measured else said


def plan_from(times: dict[str, dict[int, float]], widest: str) -> Plan:
    """The plan for {path: {rows: seconds}}: at each row count the fastest path, unless the
    widest is within MARGIN of it."""
    def best(rows: int) -> str:
        fastest = min(times, key=lambda path: times[path][rows])
        return widest if times[widest][rows] <= times[fastest][rows] * (1 + MARGIN) else fastest
    counts = sorted(next(iter(times.values())))
    chosen = {rows: best(rows) for rows in counts}
    few = chosen[counts[0]]
    switch = next((rows for rows in counts if chosen[rows] != few), 0)
    many = chosen[switch] if switch else few
    timed = "; ".join(f"{rows} rows " + ", ".join(f"{path} {times[path][rows] * 1e3:.2f} ms" for path in times)
                      for rows in counts)
    return Plan(few, many, switch, f"measured on int4 and Q4_K weights ({timed})", measured=True)


def measured_plan(passed: list[str], widest: str, key: str, folder: Path, make_timer) -> Plan:
    """The plan for the paths that `passed` their trials, from `folder`'s cache under `key`,
    else measured now (by make_timer()(path, rows) -> seconds: a Probe's) and kept."""
    def complete(entry: dict) -> bool:
        return set(entry) == set(passed) and all(isinstance(entry[p], dict) and len(entry[p]) == len(ROW_COUNTS)
                                                 for p in passed)
    entry = measured_once(folder / CACHE_FILE, key, lambda: time_paths(passed, make_timer()), valid=complete)
    times = {path: {int(rows): float(seconds) for rows, seconds in entry[path].items()} for path in passed}
    return plan_from(times, widest)


def time_paths(paths: list[str], timer) -> dict[str, dict[str, float]]:
    """{path: {rows: seconds}}: the best of REPEATS, the paths interleaved."""
    best = {path: {str(rows): float("inf") for rows in ROW_COUNTS} for path in paths}
    for _ in range(REPEATS):
        for rows in ROW_COUNTS:
            for path in paths:
                best[path][str(rows)] = min(best[path][str(rows)], timer(path, rows))
    return best


class Probe:
    """Random weights of the two formats in the op's layout (their bytes only matter for
    speed: `cols` output columns a tile, a Q4_K block of `kq4_block_bytes` a row), and rows;
    `isas`: the op's number of each path."""

    def __init__(self, cols: int, isas: dict[str, int], kq4_block_bytes: int):
        gen = torch.Generator().manual_seed(0)
        out, inp = PROBE_SHAPE
        tiles = out // cols
        int4 = (tiles, inp // 32, 32 * cols // 2)
        kq4 = (tiles, inp // 256, kq4_block_bytes * cols)
        each = (int4[1] * int4[2] + 2 * 2 * cols * inp // 32) * tiles
        self.int4 = [(torch.randint(0, 256, int4, dtype=torch.uint8, generator=gen),
                      (torch.rand(tiles, inp // 32, 2, cols, generator=gen) / 64).half())
                     for _ in range(max(1, PROBE_BYTES // each))]
        self.kq4 = [torch.randint(0, 256, kq4, dtype=torch.uint8, generator=gen)
                    for _ in range(max(1, PROBE_BYTES // (kq4[0] * kq4[1] * kq4[2])))]
        self.x = torch.randn(max(ROW_COUNTS), inp, generator=gen)
        self.no_scales = torch.empty(0)
        self.isas = isas

    def seconds(self, path: str, rows: int) -> float:
        isa, x = self.isas[path], self.x[:rows]
        op = torch.ops.workbench_cpu.linear_q
        t0 = time.perf_counter()
        for w, scales in self.int4:
            op(x, w, scales, None, 4, 32, isa)
        for w in self.kq4:
            op(x, w, self.no_scales, None, 4, 256, isa)
        return time.perf_counter() - t0
