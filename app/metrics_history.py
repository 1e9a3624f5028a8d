"""The session's metrics as numpy ring buffers: what the plots draw and the CSV export writes.

Plain Python and numpy (no Qt, no forward pass): it stores the plain step/request dicts the
engine worker emits, whose ratios the engine computed (engine.metrics holds every formula).
Step series are indexed by the session step (x axis of the step plots); request series by
the request number. A number a remote server does not report (None) is stored as NaN: a gap
in the plots and an empty CSV cell, never a made-up 0.

Speculation's speedup per step (the reply's engine.metrics.speculation_report so far):
speedup_measured, speedup_predicted, break_even_alpha (inf: it cannot pay at any alpha with
the measured costs; empty: no report). The session's figure for the current set-up is
`speculation` (app.speculation_tally).

A draft tree's step (tree_nodes > 0, engine.metrics.StepEvent): tree_accepted_path is its
accepted path length (`accepted`), tree_predicted what the draft's confidences predicted
it accepts, and tree_node_budget / tree_depth the draft_tree setting in effect (NaN: no
tree), so the nodes the engine verified show against the nodes it could have.

drafted_by_code: which proposer drafted the step (the step event's `proposer`; under
`proposer: auto` the one the engine chose for it), as its index in DRAFTERS; NaN when the
step says none (nothing drafted, or a server that does not say). The CSV also has it by
name (drafted_by), beside the proposer setting.
"""
from __future__ import annotations

import csv
from collections import deque
from pathlib import Path

import numpy as np

from app.speculation_tally import SpeculationTally
from engine import config
from engine.config import TreeShape, parse_tree
from engine.metrics import PositionCounts

MIB = 2**20
STEP_CAPACITY = 8192          # steps kept for plots and CSV; older ones scroll out
REQUEST_CAPACITY = 1024
# Settings whose change gets a marker on the plots: the engine's, from the settings panel.
MARKED_SETTINGS = config.groups()[config.SPECULATION_GROUP] + config.groups()[config.CACHE_GROUP]
SPECULATION_SETTINGS = config.groups()[config.SPECULATION_GROUP]
# What the session's speedup figure depends on: speculation, and what times a plain step
# (the cache settings, compilation, threads: engine.speculative.speculator.Speculator.plain_step_key).
SPEEDUP_SETTINGS = MARKED_SETTINGS + ("compile", "threads")
STEPS, SERVER = "steps", "server"      # where per-position acceptance comes from
# The proposers that draft (the setting's choices less "off" and "auto"): drafted_by_code's codes.
DRAFTERS = tuple(name for name in next(s for s in config.SETTINGS if s.key == "proposer").choices
                 if name not in ("off", "auto"))


class RingBuffer:
    """Fixed-capacity float series; `values()` is a contiguous view, oldest first.

    Each value is written twice (at i and i + capacity) so the window is always one slice."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._data = np.full(2 * capacity, np.nan)
        self._next = 0
        self._size = 0

    def append(self, value: float) -> None:
        i = self._next
        self._data[i] = self._data[i + self.capacity] = value
        self._next = (i + 1) % self.capacity
        self._size = min(self._size + 1, self.capacity)

    def values(self) -> np.ndarray:
        start = (self._next - self._size) % self.capacity
        return self._data[start:start + self._size]

    def __len__(self) -> int:
        return self._size


def describe_change(key: str, value, settings: dict | None = None) -> str:
    """A marker label short enough to sit on a plot."""
    if key == "kv_cache_dtype":
        return f"KV {value}"
    if key == "enable_prefix_caching":
        return "prefix cache " + ("on" if value else "off")
    if key == "proposer":
        by = (settings or {}).get({"draft": "draft_model", "assistant": "draft_model",
                                   "eagle": "eagle_head"}.get(value, ""))
        return f"spec {value} ({by})" if by else f"spec {value}"
    if key == "num_speculative_tokens":
        return f"k={value}"
    if key == "draft_model":
        return f"draft {value or 'none'}"
    if key == "eagle_head":
        return f"EAGLE head {value or 'shipped'}"
    if key == "draft_tree":
        return f"tree {value}"
    return f"{key}={value}"


class MetricsHistory:
    STEP_COLUMNS = ("session_step", "request", "step", "time_s", "step_time_s", "tokens", "proposed", "accepted",
                    "acceptance", "running_acceptance", "tok_s", "running_tok_s", "kv_used_mib",
                    "kv_capacity_mib", "kv_usage", "is_fp8", "prefix_hit_tokens", "prompt_tokens", "generated_tokens",
                    "ttft_s", "speedup_measured", "speedup_predicted", "break_even_alpha", "compile_s",
                    "compile_tok_s", "tree_nodes", "tree_accepted_path", "tree_predicted", "tree_node_budget",
                    "tree_depth", "drafted_by_code")
    REQUEST_COLUMNS = ("request", "session_step", "ttft_ms", "prefix_hit_tokens", "prompt_tokens",
                       "generated_tokens", "decode_tok_s", "acceptance_rate", "mean_accepted_len")

    def __init__(self):
        self.version = 0           # bumps on every change, so views redraw only when needed
        self._reset()

    def clear(self) -> None:
        """Forget everything (the version keeps counting, so views notice)."""
        self._reset()
        self.version += 1

    def _reset(self) -> None:
        self.steps = {name: RingBuffer(STEP_CAPACITY) for name in self.STEP_COLUMNS}
        self.requests = {name: RingBuffer(REQUEST_CAPACITY) for name in self.REQUEST_COLUMNS}
        self.step_labels: deque[dict] = deque(maxlen=STEP_CAPACITY)       # text columns for the CSV
        self.request_labels: deque[dict] = deque(maxlen=REQUEST_CAPACITY)
        self.markers: deque[tuple[float, float, str]] = deque(maxlen=256)  # (session step, request, label)
        self.positions = PositionCounts()      # this speculation set-up, across replies
        self.server_positions = PositionCounts()   # the same from a server's counters (its steps have none)
        self.speculation = SpeculationTally()  # does speculation pay, over this set-up's replies
        self.markers_added = 0     # total ever added (the deque drops old ones)
        self.kv_dtype = ""
        self._session_step = 0
        self._request_count = 0
        self._last_settings: dict | None = None

    # ---- recording -------------------------------------------------------------
    def record_step(self, event: dict) -> None:
        if event["settings"] is not None:         # sent on a request's first step and on a change
            self._note_setting_changes(event["settings"], mid_request=event["step"] > 0)
        if event["step"] == 0:
            self._request_count += 1
        self.positions.add(event["accepted_per_position"])
        self._add_server_positions(event.get("server"))
        self.speculation.record_step(event)
        self._append_step(event)
        self.kv_dtype = event["kv_dtype"]
        self._session_step += 1
        self.version += 1

    def forget_setup(self) -> None:
        """Another model or server: the per-position and speedup tallies start again (the
        plotted series and markers stay)."""
        self.positions, self.server_positions = PositionCounts(), PositionCounts()
        self.speculation.reset()
        self.version += 1

    def _add_server_positions(self, figures: dict | None) -> None:
        """A server's per-position counters for a request (engine.remote.server_metrics figures)."""
        if figures and figures.get("drafts") is not None and figures.get("accepted_per_position"):
            self.server_positions.merge(PositionCounts.from_cumulative(int(figures["drafts"]),
                                                                       figures["accepted_per_position"]))

    def record_request(self, done: dict) -> None:
        summary = done.get("summary")
        if not summary:
            return       # failed before its first step: nothing was measured
        row = {"request": self._request_count, "session_step": self._session_step - 1,
               "ttft_ms": summary["ttft_s"] * 1000, "prefix_hit_tokens": _nan_if_none(summary["prefix_hit_tokens"]),
               "prompt_tokens": _nan_if_none(summary["prompt_tokens"]),
               "generated_tokens": _nan_if_none(summary["generated_tokens"]),
               "decode_tok_s": summary["decode_tok_s"] or np.nan,
               "acceptance_rate": _nan_if_none(summary["acceptance_rate"]),
               "mean_accepted_len": _nan_if_none(summary["mean_accepted_len"])}
        for name, value in row.items():
            self.requests[name].append(value)
        settings = done.get("settings") or {}
        self.request_labels.append({"finish_reason": done.get("finish_reason"), "kv_dtype": self.kv_dtype,
                                    "proposer": settings.get("proposer"),
                                    "prefix_caching": settings.get("enable_prefix_caching")})
        self.version += 1

    def _note_setting_changes(self, settings: dict, mid_request: bool) -> None:
        previous, self._last_settings = self._last_settings, dict(settings)
        if previous is None:
            return       # the first step sets the baseline; there is nothing to compare with
        if any(k in settings and settings.get(k) != previous.get(k) for k in SPEEDUP_SETTINGS):
            self.speculation.reset(mid_reply=mid_request)     # the speedup describes the current set-up
        changed = [k for k in MARKED_SETTINGS if k in settings and settings.get(k) != previous.get(k)]
        if not changed:
            return
        for proposer, reference in (("draft", "draft_model"), ("assistant", "draft_model"), ("eagle", "eagle_head")):
            if "proposer" in changed and settings.get("proposer") == proposer and reference in changed:
                changed.remove(reference)       # "spec draft (self)", "spec eagle (shipped)" say both
        label = ", ".join(describe_change(k, settings[k], settings) for k in changed)
        # On the request axis: on the running request's bar, or between two requests.
        request = self._request_count if mid_request else self._request_count + 0.5
        self.markers.append((self._session_step - 0.5, request, label))
        self.markers_added += 1
        if any(k in SPECULATION_SETTINGS for k in changed):
            # per-position acceptance describes the current set-up
            self.positions, self.server_positions = PositionCounts(), PositionCounts()

    def _append_step(self, event: dict) -> None:
        running = event["running"]
        used, capacity = _nan_if_none(event["kv_bytes_used"]), _nan_if_none(event["kv_bytes_capacity"])
        tokens = _step_tokens(event)
        row = {"session_step": self._session_step, "request": self._request_count, "step": event["step"],
               "time_s": event["time_s"], "step_time_s": event["step_time_s"], "tokens": tokens,
               "proposed": event["proposed"], "accepted": event["accepted"],
               "acceptance": _nan_if_none(event["step_acceptance"]),
               "running_acceptance": _nan_if_none(running["acceptance_rate"]),
               "tok_s": _nan_if_none(event["step_tok_s"]) if tokens else np.nan,   # no token (a stream's end): no speed
               "running_tok_s": running["decode_tok_s"] if running["decode_tokens"] else np.nan,
               # A step that compiled: marked on the decode plot, left out of its speed figures.
               "compile_s": event.get("compile_s") or 0.0,
               "compile_tok_s": tokens / event["step_time_s"] if event.get("compile_s") and tokens else np.nan,
               "kv_used_mib": used / MIB, "kv_capacity_mib": capacity / MIB,
               "kv_usage": _kv_usage(event),
               "is_fp8": float((event["kv_dtype"] or "").startswith("fp8")),
               "prefix_hit_tokens": _nan_if_none(event["prefix_hit_tokens"]),
               "prompt_tokens": _nan_if_none(event["prompt_tokens"]),
               "generated_tokens": _nan_if_none(event["generated_tokens"]), "ttft_s": _nan_if_none(event.get("ttft_s")),
               "drafted_by_code": _drafter_code(event.get("proposer")),
               **_speedup_columns(event.get("speculation")), **_tree_columns(event, self.tree_shape)}
        for name, value in row.items():
            self.steps[name].append(value)
        settings = self._last_settings or {}
        self.step_labels.append({"kv_dtype": event["kv_dtype"], "proposer": settings.get("proposer"),
                                 "drafted_by": event.get("proposer") or "",
                                 "k": settings.get("num_speculative_tokens"), "draft_tree": settings.get("draft_tree"),
                                 "prefix_caching": settings.get("enable_prefix_caching"),
                                 "finish_reason": event.get("finish_reason") or ""})

    # ---- reading ---------------------------------------------------------------
    def step_series(self, name: str) -> np.ndarray:
        return self.steps[name].values()

    def request_series(self, name: str) -> np.ndarray:
        return self.requests[name].values()

    def per_position_acceptance(self) -> np.ndarray:
        """P(draft token i accepted | tokens < i accepted), for positions tried so far: from
        the steps, or from a server's counters when its steps carry none (per_position_source)."""
        counts = self.server_positions if self.per_position_source == SERVER else self.positions
        return np.array(counts.rates())

    @property
    def per_position_source(self) -> str | None:
        """STEPS, SERVER (a server's per-position counters), or None: nothing tried yet."""
        if any(self.positions.attempts):
            return STEPS
        return SERVER if any(self.server_positions.attempts) else None

    @property
    def tree_shape(self) -> TreeShape | None:
        """The draft tree in effect (the engine's `draft_tree`), or None: a chain, or a
        backend without trees."""
        return parse_tree((self._last_settings or {}).get("draft_tree") or "off")

    @property
    def num_steps(self) -> int:
        return len(self.steps["session_step"])

    @property
    def num_requests(self) -> int:
        return len(self.requests["request"])

    # ---- export ----------------------------------------------------------------
    def write_csv(self, path: str | Path) -> list[Path]:
        """Steps to `path`, requests to `<stem>-requests.csv` beside it; returns both paths."""
        path = Path(path)
        requests_path = path.with_name(f"{path.stem}-requests.csv")
        _write_table(path, self.steps, self.step_labels)
        _write_table(requests_path, self.requests, self.request_labels)
        return [path, requests_path]


def _write_table(path: Path, columns: dict[str, RingBuffer], labels: deque) -> None:
    names = list(columns)
    arrays = [columns[n].values() for n in names]
    label_names = list(labels[0]) if labels else []
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(names + label_names)
        for i, label in enumerate(labels):
            writer.writerow([_csv_value(a[i]) for a in arrays] + [label[n] for n in label_names])


def _csv_value(value: float) -> str:
    if np.isnan(value):
        return ""
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def _speedup_columns(report: dict | None) -> dict:
    """The reply's speedup so far (engine.metrics.speculation_report) as step columns."""
    if not report:
        return {"speedup_measured": np.nan, "speedup_predicted": np.nan, "break_even_alpha": np.nan}
    even = report["break_even_alpha"]
    return {"speedup_measured": _nan_if_none(report["measured_speedup"]),
            "speedup_predicted": _nan_if_none(report["predicted_speedup"]),
            "break_even_alpha": np.inf if even is None else even}      # None: no alpha <= 1 pays


def _tree_columns(event: dict, shape: TreeShape | None) -> dict:
    """A tree step's path and nodes (NaN on a chain step), and the tree the setting allows."""
    nodes = event["tree_nodes"]
    return {"tree_nodes": nodes, "tree_accepted_path": event["accepted"] if nodes else np.nan,
            "tree_predicted": _nan_if_none(event["tree_predicted_accepted"]) if nodes else np.nan,
            "tree_node_budget": shape.nodes if shape else np.nan, "tree_depth": shape.depth if shape else np.nan}


def _drafter_code(proposer: str | None) -> float:
    """The step's proposer as its index in DRAFTERS; NaN for none or one this app does not know."""
    return float(DRAFTERS.index(proposer)) if proposer in DRAFTERS else np.nan


def _kv_usage(event: dict) -> float:
    """Share of the KV cache in use: the local pool's bytes, or the share a server reports."""
    used, capacity = event["kv_bytes_used"], event["kv_bytes_capacity"]
    if used is not None and capacity:
        return used / capacity
    return _nan_if_none(event.get("kv_usage"))


def _step_tokens(event: dict) -> float:
    """Tokens emitted by the step: a server counts them (num_tokens) as it streams text without
    ids; NaN when it streamed text without counting."""
    if "num_tokens" not in event:
        return len(event["token_ids"])
    if event.get("token_count") is None and not event["token_ids"] and event.get("pieces"):
        return np.nan
    return event["num_tokens"]


def _nan_if_none(value) -> float:
    return np.nan if value is None else value
