"""The quality tab's results: one row per measured configuration (engine.quality's result rows),
what changed between two measurements of the current settings, and the CSV export.

Plain Python (no Qt, no forward pass). A row is the engine's dict as it came, plus what the
app knows about it: "number", "origin" ("measured", or "from profile NAME"), "snapshot" (the
session's engine settings the row was measured with, to match it to a profile on save),
"current" (it measured the settings in effect) and "change" (for a measurement of the current
settings: what the user changed since the previous one, as the plots' markers say it).
The Pareto front is engine maths (engine.quality.figures.pareto_front, plain data).
"""
from __future__ import annotations

import csv
import json
from pathlib import Path

from app.metrics_history import describe_change
from engine import config
from engine.quality.figures import pareto_front

MEASURED = "measured"
FROM_PROFILE = "from profile"
# (CSV column, path into the row); an interval's ends become _ci_low / _ci_high columns.
CSV_FIGURES = (("kld_mean", "kld_mean_ci95"), ("kld_p99", None), ("same_top_pct", "same_top_pct_ci95"),
               ("ppl", None), ("ppl_reference", None), ("ppl_change_pct", "ppl_change_pct_ci95"),
               ("decode_tok_s", None), ("elapsed_s", None))
DTYPE_KEYS = ("dtype", "weight_dtype", "kv_cache_dtype")


def session_snapshot(profile) -> dict:
    """The engine settings a session profile runs with, and its model: what a row was measured
    with, and what a profile must match to carry that row."""
    return {key: getattr(profile, key) for key in config.keys(config.ENGINE)} | {"model": profile.model}


class QualityHistory:
    def __init__(self):
        self.rows: list[dict] = []
        self.version = 0

    def add_row(self, result: dict, snapshot: dict, current: bool, origin: str = MEASURED) -> dict:
        """A finished configuration's result row. `snapshot`: the session's engine settings it
        ran with; a measurement of the current settings says what changed since the last one."""
        change = self._change_since_last_current(snapshot) if current and origin == MEASURED else ""
        row = dict(result, number=len(self.rows) + 1, origin=origin, snapshot=dict(snapshot), current=current,
                   change=change)
        self.rows.append(row)
        self.version += 1
        return row

    def _change_since_last_current(self, snapshot: dict) -> str:
        earlier = next((r for r in reversed(self.rows) if r["current"] and r["origin"] == MEASURED), None)
        if earlier is None:
            return ""
        changed = [describe_change(key, value, snapshot) for key, value in snapshot.items()
                   if earlier["snapshot"].get(key) != value]
        return ", ".join(changed) if changed else "no change"

    def clear(self) -> None:
        self.rows.clear()
        self.version += 1

    def drop_from_profile(self) -> None:
        """Another profile shown: the rows an earlier profile carried go."""
        self.rows[:] = [r for r in self.rows if r["origin"] == MEASURED]
        for number, row in enumerate(self.rows, start=1):
            row["number"] = number
        self.version += 1

    def front(self) -> list[int]:
        """Indices of the rows on the Pareto front (lower mean KLD, higher decode tok/s; rows
        without both figures are on no front)."""
        return pareto_front(self.rows)

    def latest_for(self, snapshot: dict) -> dict | None:
        """The newest row measured with exactly these engine settings (what a profile saved with
        them carries), without the app's own fields; None when no row matches."""
        for row in reversed(self.rows):
            if row["snapshot"] == snapshot:
                return plain_result(row)
        return None

    def write_csv(self, path: str | Path) -> Path:
        """Every row: its figures with their 95% intervals, the dtypes in effect and of the
        reference, the lossless check, the text it was measured on, and its settings (JSON)."""
        path = Path(path)
        figures = []
        for name, interval in CSV_FIGURES:
            figures += [name] + ([f"{name}_ci_low", f"{name}_ci_high"] if interval else [])
        header = (["number", "label", "origin", "change", "measured_at", "model", "lossy"] + figures
                  + ["lossless_identical", "lossless_checked", "lossless_said", "text_source", "text_tokens",
                     "text_sha256"] + [f"in_effect_{k}" for k in DTYPE_KEYS] + [f"reference_{k}" for k in DTYPE_KEYS]
                  + ["settings", "summary"])
        with path.open("w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow(header)
            for row in self.rows:
                writer.writerow(_csv_cells(row))
        return path


def plain_result(row: dict) -> dict:
    """The engine's result row, without what the app added (what a profile stores)."""
    return {k: v for k, v in row.items() if k not in ("number", "origin", "snapshot", "current", "change")}


def _csv_cells(row: dict) -> list:
    cells = [row["number"], row.get("label"), row["origin"], row["change"], row.get("measured_at"),
             row.get("model"), row.get("lossy")]
    for name, interval in CSV_FIGURES:
        cells.append(_cell(row.get(name)))
        if interval:
            low, high = row.get(interval) or (None, None)
            cells += [_cell(low), _cell(high)]
    lossless, text = row.get("lossless") or {}, row.get("text") or {}
    cells += [_cell(lossless.get("identical")), " ".join(lossless.get("checked") or []), lossless.get("said", ""),
              text.get("source", ""), _cell(text.get("tokens")), text.get("sha256", "")]
    cells += [_cell((row.get("in_effect") or {}).get(k)) for k in DTYPE_KEYS]
    cells += [_cell((row.get("reference") or {}).get(k)) for k in DTYPE_KEYS]
    return cells + [json.dumps(row.get("settings") or {}, sort_keys=True), row.get("summary", "")]


def _cell(value):
    return "" if value is None else value
