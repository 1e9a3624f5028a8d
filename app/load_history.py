"""A load test's series (what the load panel plots) and its results table (one row per run).

Plain Python and numpy (no Qt, no forward pass). The worker sends one dict per engine step
(engine.workload.WorkloadRun.step_figures); the windowed series are derived here with
engine.metrics' formulas (percentile, ratio), and each finished run's figures and 95%
intervals come from engine.metrics.run_figures / bootstrap_ci over its requests.
"""
from __future__ import annotations

import csv
from collections import deque
from pathlib import Path

import numpy as np

from engine.metrics import (RUN_FIGURES, RequestStats, bootstrap_ci, bootstrap_difference, excludes_zero,
                            experts_active_by_batch, percentile, ratio, run_figures, run_statistic,
                            speculation_speedup_by_batch)
from engine.workload import WORKLOAD_SETTINGS

MIB = 2**20
WINDOW_S = 5.0        # the latency percentiles and the throughput: over the last WINDOW_S seconds
FIGURE_LABELS = {"output_throughput": "output tok/s", "median_ttft_ms": "TTFT p50 (ms)", "p99_ttft_ms": "TTFT p99 (ms)",
                 "median_tpot_ms": "TPOT p50 (ms)", "p99_tpot_ms": "TPOT p99 (ms)", "preemptions": "preemptions"}


class LoadHistory:
    STEP_COLUMNS = ("t", "running", "waiting", "kv_used_mib", "kv_capacity_mib", "kv_usage_pct", "output_tok_s",
                    "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "preemptions_total", "completed",
                    "experts_active")

    def __init__(self):
        self.version = 0
        self.rows: list[dict] = []          # the results table, kept across runs
        self.clear_series()

    def clear_series(self) -> None:
        """A new load test: its plots start empty (the results table stays)."""
        self.steps = {name: [] for name in self.STEP_COLUMNS}
        self.markers: list[tuple[float, str]] = []
        self._ttft: deque = deque()
        self._itl: deque = deque()
        self._tokens: deque = deque()
        self._preemptions = 0
        self.engine_steps: list[dict] = []      # batch size, drafts, step time: speculation by batch size
        self.experts: tuple[int, int] | None = None     # an MoE model's (experts per layer, top_k)
        self.progress = 0.0
        self.version += 1

    # ---- a step ----------------------------------------------------------------------
    def record_step(self, step: dict) -> None:
        t = step["t"]
        self._ttft.extend((t, 1000 * v) for v in step["ttft_s"])
        self._itl.extend((t, 1000 * v) for v in step["itl_s"])
        self._tokens.append((t, step["output_tokens"]))
        for samples in (self._ttft, self._itl, self._tokens):
            while samples and samples[0][0] < t - WINDOW_S:
                samples.popleft()
        self._preemptions += step["preemptions"]
        if "engine_step" in step:
            self.engine_steps.append(step["engine_step"] | {"experts_active": step.get("experts_active")})
        if step.get("experts"):
            self.experts = (step["experts"], step["top_k"])
        ttft, itl = [v for _, v in self._ttft], [v for _, v in self._itl]
        start = self.steps["t"][0] if self.steps["t"] else t
        span = min(WINDOW_S, t - start)
        row = {"t": t, "running": step["running"], "waiting": step["waiting"],
               "kv_used_mib": step["kv_bytes_used"] / MIB, "kv_capacity_mib": step["kv_bytes_capacity"] / MIB,
               "kv_usage_pct": 100 * step["kv_usage"],
               "output_tok_s": ratio(sum(n for _, n in self._tokens), span),
               "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
               "itl_p50_ms": percentile(itl, 50), "itl_p99_ms": percentile(itl, 99),
               "preemptions_total": self._preemptions, "completed": step["completed"],
               "experts_active": step.get("experts_active")}
        for name in self.STEP_COLUMNS:
            self.steps[name].append(np.nan if row[name] is None else row[name])
        rounds = step.get("rounds", 1)
        self.progress = (step.get("round", 0) + (step["completed"] + step["cancelled"]) / step["total"]) / rounds
        self.version += 1

    def speculation_speedup(self) -> dict[int, dict]:
        """Speculation's measured speedup per batch size over this load test's steps."""
        return speculation_speedup_by_batch(self.engine_steps)

    def experts_by_batch(self) -> dict[int, dict]:
        """An MoE model's experts woken per decode step, by batch size, over this load test."""
        return experts_active_by_batch(self.engine_steps)

    def series(self, name: str) -> np.ndarray:
        return np.asarray(self.steps[name], dtype=float)

    @property
    def num_steps(self) -> int:
        return len(self.steps["t"])

    def mark(self, t: float | None, label: str) -> None:
        """A marker at load time t (None: the latest step's), e.g. a setting changed."""
        if t is None:
            t = self.steps["t"][-1] if self.steps["t"] else 0.0
        self.markers.append((t, label))
        self.version += 1

    # ---- the results table -----------------------------------------------------------------
    def add_row(self, row: dict) -> dict:
        """A finished run (the worker's row): its figures and their 95% bootstrap intervals."""
        stats = [RequestStats.from_plain(r) for r in row["requests"]]
        done = dict(row, stats=stats, number=len(self.rows) + 1,
                    figures=run_figures(stats, row["duration_s"]),
                    intervals=bootstrap_ci(stats, run_statistic(stats, row["duration_s"])))
        self.rows.append(done)
        self.version += 1
        return done

    def compare(self, a: dict, b: dict) -> dict:
        """B against A per figure: the ratio B / A, the 95% interval of B - A, and whether it excludes 0."""
        diff = bootstrap_difference(a["stats"], run_statistic(a["stats"], a["duration_s"]),
                                    b["stats"], run_statistic(b["stats"], b["duration_s"]))
        return {name: {"ratio": ratio(b["figures"][name], a["figures"][name]) if a["figures"][name] is not None
                       and b["figures"][name] is not None else None,
                       "difference": diff.get(name), "excludes_zero": excludes_zero(diff.get(name))}
                for name in RUN_FIGURES}

    def write_csv(self, path: str | Path) -> Path:
        """The results table: a run per row, every figure with its interval, the settings and the workload."""
        path = Path(path)
        settings = sorted({k for row in self.rows for k in row["settings"]})
        workload = [s.key for s in WORKLOAD_SETTINGS]
        header = (["run", "label", "requests", "cancelled", "duration_s", "rounds", "stopped"]
                  + [f"{name}{suffix}" for name in RUN_FIGURES for suffix in ("", "_ci_low", "_ci_high")]
                  + settings + [f"workload_{k}" for k in workload])
        with path.open("w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow(header)
            for row in self.rows:
                figures = []
                for name in RUN_FIGURES:
                    interval = row["intervals"].get(name) or ("", "")
                    figures += [_cell(row["figures"][name]), _cell(interval[0]), _cell(interval[1])]
                writer.writerow([row["number"], row["label"], len(row["stats"]), row["cancelled"], row["duration_s"],
                                 row["rounds"], row["stopped"]] + figures
                                + [_cell(row["settings"].get(k)) for k in settings]
                                + [_cell(row["workload"].get(k)) for k in workload])
        return path


def _cell(value):
    return "" if value is None else value
