"""The load panel, driven like a user would (offscreen, the tiny model): a load run fills the
plots and the results table while the chat keeps answering, Stop ends every request and
frees every block, A/B gives two rows with intervals and a comparison, the results export
as CSV, and at 1366x768 every plot keeps its size, its axis titles and a clear data area.

The tiny model serves a whole workload before the window handles one event, so the tests
that act during a run hold the worker between the run's steps with a StepGate."""
import csv
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QApplication

from engine.profiles import SessionProfile
from engine.workload import WorkloadRun
from test_app import (LOAD_TIMEOUT_MS, REPLY_TIMEOUT_MS, TINY_POOL_BYTES, StepGate, collect,  # noqa: F401
                      open_workbench, points, tiny_profile, transcript_fragments)
from test_window import REPO

RUN_TIMEOUT_MS = 120_000


@pytest.fixture
def load_gate(open_workbench, monkeypatch):
    """A StepGate on WorkloadRun.step (closed: the run takes no step until allowed); opened
    before the workbenches shut down."""
    gate = StepGate()
    original = WorkloadRun.step

    def gated_step(self):
        gate.wait()
        return original(self)
    monkeypatch.setattr(WorkloadRun, "step", gated_step)
    yield gate
    gate.open()


def set_workload(bench, **values):
    for key, value in values.items():
        bench.window.load_panel.controls[key].set_value(value)


def start_run(bench, qtbot, button):
    finished = collect(bench.host.worker.loadFinished)
    bench.window.load_dock.raise_()
    qtbot.mouseClick(button, Qt.MouseButton.LeftButton)
    return finished


def engine_blocks_in_use(bench, qtbot) -> int:
    """KV blocks held, read once the worker is idle (nothing else touches the engine then)."""
    engine = bench.host.worker.engine
    qtbot.waitUntil(lambda: not engine.has_work, timeout=RUN_TIMEOUT_MS)
    return sum(r.blocks.num_used_blocks for r in engine.runners())


def test_a_load_run_fills_the_plots_and_the_results_table_while_a_chat_is_answered(open_workbench, tiny_profile,
                                                                                  qtbot, load_gate):
    bench = open_workbench(tiny_profile(proposer="draft", draft_model="self:1", num_speculative_tokens=2))
    set_workload(bench, num_prompts=16, max_concurrency=4, output_len=8, request_rate=None)
    panel, history = bench.window.load_panel, bench.load.history
    finished = start_run(bench, qtbot, panel.start_button)
    load_gate.allow(3)                          # the run is under way...
    chat_steps = collect(bench.probe.stepReady)
    bench.window.chat.input.setPlainText("Hello during the load test")
    with qtbot.waitSignal(bench.probe.requestDone, timeout=REPLY_TIMEOUT_MS) as done:
        bench.controller.send("Hello during the load test")     # ...when the chat's message arrives
        load_gate.open()
    qtbot.waitUntil(lambda: bool(finished) and not bench.load.running, timeout=RUN_TIMEOUT_MS)
    assert finished == [False]
    # The chat was answered, one more request in the engine: its steps were shared with the load.
    assert done.args[0]["finish_reason"] in ("length", "stop") and done.args[0]["summary"]["generated_tokens"] > 0
    assert max(step["engine_step"]["running"] for step in chat_steps) >= 2
    drafted = {kind for step in chat_steps for kind in step["token_kinds"]} & {"accepted", "resampled", "bonus"}
    shown = {kind for _, kind in transcript_fragments(bench.window.chat)}
    assert drafted and drafted <= shown                               # still coloured token by token
    # The plots: one point per engine step of the run, every series (clipped to the view, whose
    # auto-range follows the data at the next event loop pass).
    panel.refresh()
    QApplication.processEvents()
    steps = history.num_steps
    assert steps >= 16
    for name, curve in panel.curves.items():       # latencies start at the first token
        if name not in ("speedup", "experts"):      # per batch size, below; and a dense model has no experts
            assert steps / 2 <= len(curve.getData()[0]) <= steps, name
    assert history.experts is None and points(panel.curves["experts"]) == 0
    assert "a dense model: no experts" in panel.experts_plot.titleLabel.text
    # speculation's speedup by batch size: a point where steps with and without drafts met
    by_batch = history.speculation_speedup()
    assert by_batch and sum(r["spec_steps"] + r["plain_steps"] for r in by_batch.values()) <= steps
    measured = [size for size, r in by_batch.items() if r["speedup"] is not None]
    assert list(panel.curves["speedup"].getData()[0] if measured else []) == measured
    assert 4 <= max(history.series("running")) <= 5                 # the run's 4, and the chat
    assert max(history.series("kv_usage_pct")) > 0 and history.series("kv_capacity_mib")[-1] > 0
    assert np.nanmax(history.series("output_tok_s")) > 0 and np.nanmax(history.series("ttft_p99_ms")) > 0
    assert panel.progress.value() == 1000
    # The results table: one row, 16 requests, every figure inside its interval.
    [row] = history.rows
    assert len(row["stats"]) == 16 and not row["stopped"] and panel.table.rowCount() == 1
    assert row["settings"]["proposer"] == "draft"
    for name, value in row["figures"].items():
        lo, hi = row["intervals"][name]
        assert lo <= value <= hi, name
    assert "[" in panel.table.item(0, 4).text()
    # The workload is part of the session profile.
    assert bench.controller.current_profile().workload.num_prompts == 16
    assert engine_blocks_in_use(bench, qtbot) == 0


def test_an_moe_model_shows_its_experts_in_effect_and_the_experts_each_step_woke(open_workbench, qtbot, tmp_path):
    from engine.loading.synthetic import write_checkpoint
    folder = write_checkpoint(tmp_path / "moe", "tiny-qwen3-moe")
    bench = open_workbench(SessionProfile(model=str(folder), kv_cache_bytes=TINY_POOL_BYTES, max_tokens=8))
    effect = bench.window.settings.effective_label.text()
    assert "<b>MoE</b>: 8 experts in each of 2 layers, 2 active per token; a token reads " in effect
    set_workload(bench, num_prompts=8, max_concurrency=4, output_len=6, request_rate=None)
    panel, history = bench.window.load_panel, bench.load.history
    finished = start_run(bench, qtbot, panel.start_button)
    qtbot.waitUntil(lambda: bool(finished) and not bench.load.running, timeout=RUN_TIMEOUT_MS)
    panel.refresh()
    QApplication.processEvents()                        # the view's range follows the data
    assert history.experts == (8, 2)                    # experts per layer, top-k
    woken = history.series("experts_active")
    assert len(woken) == history.num_steps == points(panel.curves["experts"]) and (woken >= 2).all()
    assert (woken <= 8).all() and panel.all_experts_line.value() == 8
    by_batch = history.experts_by_batch()                # decode steps: 4 tokens wake 2..8 experts a layer
    assert 4 in by_batch and 2 <= by_batch[4]["experts_active"] <= 8
    assert "top-2 of 8" in panel.experts_plot.titleLabel.text and "decode batch" in panel.experts_plot.titleLabel.text


def test_stop_ends_every_request_and_no_block_leaks(open_workbench, tiny_profile, qtbot, load_gate):
    bench = open_workbench(tiny_profile())
    set_workload(bench, num_prompts=64, max_concurrency=8, output_len=32, request_rate=None)
    panel = bench.window.load_panel
    finished = start_run(bench, qtbot, panel.start_button)
    load_gate.allow(6)
    qtbot.waitUntil(lambda: bench.load.history.num_steps >= 5, timeout=RUN_TIMEOUT_MS)
    assert panel.stop_button.isEnabled()
    qtbot.mouseClick(panel.stop_button, Qt.MouseButton.LeftButton)
    load_gate.open()
    qtbot.waitUntil(lambda: bool(finished) and not bench.load.running, timeout=RUN_TIMEOUT_MS)
    assert finished == [True]
    [row] = bench.load.history.rows
    assert row["stopped"] and row["cancelled"] == 8 and len(row["stats"]) < 64
    assert engine_blocks_in_use(bench, qtbot) == 0
    assert panel.start_button.isEnabled() and not panel.stop_button.isEnabled()


def test_a_b_gives_two_rows_with_intervals_a_comparison_and_a_csv(open_workbench, tiny_profile, qtbot, tmp_path):
    bench = open_workbench(tiny_profile())
    store = bench.store
    store.save(tiny_profile(name="prefix on", enable_prefix_caching=True))
    store.save(tiny_profile(name="prefix off", enable_prefix_caching=False, kv_cache_dtype="fp8_e4m3"))
    bench.controller._show_title()                 # the profile menus and A/B's choices
    qtbot.waitUntil(lambda: bench.controller.effective.get("kv_cache_dtype") is not None, timeout=RUN_TIMEOUT_MS)
    model_dtype = bench.controller.effective["kv_cache_dtype"]      # dtype auto's pick on this CPU
    panel = bench.window.load_panel
    panel.profile_a.setCurrentText("prefix on")
    panel.profile_b.setCurrentText("prefix off")
    set_workload(bench, num_prompts=8, max_concurrency=4, output_len=6, shared_prefix_len=48, request_rate=None)
    finished = start_run(bench, qtbot, panel.ab_button)
    qtbot.waitUntil(lambda: bool(finished) and not bench.load.running, timeout=RUN_TIMEOUT_MS)
    a, b = bench.load.history.rows
    assert (a["label"], b["label"]) == ("A: prefix on", "B: prefix off")
    assert a["rounds"] == b["rounds"] == 2 and len(a["stats"]) == len(b["stats"]) == 16    # A B B A
    assert (a["settings"]["enable_prefix_caching"], b["settings"]["enable_prefix_caching"]) == (True, False)
    assert (a["settings"]["kv_cache_dtype"], b["settings"]["kv_cache_dtype"]) == (model_dtype, "fp8_e4m3")
    assert sum(s.prefix_hit_tokens for s in a["stats"]) > 0 == sum(s.prefix_hit_tokens for s in b["stats"])
    for row in (a, b):
        assert all(row["intervals"][name] is not None for name in row["figures"])
    assert [label for _, label in bench.load.history.markers] == ["A: prefix on", "B: prefix off",
                                                                  "B: prefix off", "A: prefix on"]
    # The session's own settings come back after the A/B.
    qtbot.waitUntil(lambda: bench.controller.effective.get("kv_cache_dtype") == model_dtype
                    and bench.controller.effective.get("enable_prefix_caching") is True, timeout=RUN_TIMEOUT_MS)
    # Two selected rows: B over A, and whether the interval of the difference excludes 0.
    panel.table.selectRow(0)
    panel.table.selectRow(1)
    text = panel.comparison.text()
    assert "#2 over #1" in text and "x (B−A" in text and ("differs" in text or "no clear difference" in text)
    comparison = bench.load.history.compare(a, b)
    ratio = comparison["median_ttft_ms"]["ratio"]
    assert ratio == pytest.approx(b["figures"]["median_ttft_ms"] / a["figures"]["median_ttft_ms"])
    lo, hi = comparison["median_ttft_ms"]["difference"]
    assert comparison["median_ttft_ms"]["excludes_zero"] == (lo > 0 or hi < 0)
    # Export CSV: a row per run, every figure with its interval.
    path = tmp_path / "results.csv"
    panel.exportCsvRequested.emit(str(path))
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["label"] for r in rows] == ["A: prefix on", "B: prefix off"]
    assert float(rows[0]["median_ttft_ms_ci_low"]) <= float(rows[0]["median_ttft_ms"]) <= \
        float(rows[0]["median_ttft_ms_ci_high"])
    assert rows[1]["kv_cache_dtype"] == "fp8_e4m3" and rows[1]["workload_num_prompts"] == "8"


def test_a_run_on_no_model_or_a_bad_workload_says_why(open_workbench, qtbot):
    bench = open_workbench(SessionProfile(), start=False)
    panel = bench.window.load_panel
    panel.start_button.click()
    assert "Load a model first" in panel.status.text() and not bench.load.running


# At 1366x768 (a laptop): every plot of both panels, its tab raised, is tall enough to read,
# its axis titles fit beside their axes, and no legend lies inside a data area; the live
# panel after a reply that drafted trees (its titles then name the tree and its depths).
LEGIBILITY_SCRIPT = """
import json, sys
from PySide6.QtWidgets import QApplication
app = QApplication(sys.argv[:1])
from app.main_window import MainWindow
from app.metrics_history import MetricsHistory
from app.theme import style_sheet
app.setStyleSheet(style_sheet())
from engine.metrics import RequestStats, StepEvent
window = MainWindow(MetricsHistory())
window.setGeometry(window.screen().availableGeometry())
window.show()
stats, tree = RequestStats(), {"proposer": "eagle", "draft_tree": "4:6:24", "kv_cache_dtype": "float32"}
for step in range(3):
    event = StepEvent(step=step, token_ids=[1], token_kinds=["target"], pieces=[("x", "target")], time_s=step + 1.0,
                      step_time_s=0.1, target_time_s=0.1, draft_time_s=0.0, target_passes=1, proposed=24 * (step > 0),
                      accepted=step > 0, accepted_per_position=[True, False] if step else [], kv_bytes_used=2**20,
                      kv_bytes_capacity=2**29, kv_bytes_per_token=1024, kv_dtype="float32", prefix_hit_tokens=0,
                      prompt_tokens=10, generated_tokens=step + 1, ttft_s=None if step else 0.1,
                      settings=None if step else tree, tree_nodes=24 * (step > 0), tree_predicted_accepted=1.2)
    stats.record_step(event)
    event.running = stats.as_dict()
    window.plots.history.record_step(event.as_dict())
window.plots.refresh()
for name, dock, plots in (("live", window.plots_dock, window.plots.graphics.ci.items),
                          ("load", window.load_dock, window.load_panel.graphics.ci.items)):
    dock.raise_()
    for _ in range(5):
        app.processEvents()
    for plot in plots:
        view = plot.vb.sceneBoundingRect()
        report = {"panel": name, "title": plot.titleLabel.text[:40], "view_height": view.height(),
                  "view_width": view.width(), "legend_over_data": bool(plot.legend is not None
                  and plot.legend.isVisible() and plot.legend.sceneBoundingRect().intersects(view))}
        for side in ("left", "bottom"):
            axis = plot.getAxis(side)
            text = axis.label.boundingRect().width()
            room = axis.sceneBoundingRect().height() if side == "left" else axis.sceneBoundingRect().width()
            report[side] = [axis.labelText, text, room]
        print(json.dumps(report), flush=True)
"""


def test_every_plot_is_legible_at_1366x768(tmp_path):
    config = tmp_path / "screen.json"
    config.write_text(json.dumps({"screens": [{"name": "laptop", "x": 0, "y": 0, "width": 1366, "height": 768,
                                               "logicalDpi": 96, "dpr": 1}]}))
    env = os.environ | {"QT_QPA_PLATFORM": f"offscreen:configfile={config}"}
    result = subprocess.run([sys.executable, "-c", LEGIBILITY_SCRIPT], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    reports = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [r["panel"] for r in reports].count("live") == 7 and [r["panel"] for r in reports].count("load") == 8
    for r in reports:
        where = f"{r['panel']}: {r['title']}"
        assert r["view_height"] >= 110 and r["view_width"] >= 150, where
        assert not r["legend_over_data"], where
        for side in ("left", "bottom"):
            label, text, room = r[side]
            assert text <= room, f"{where}: the {side} axis title {label!r} ({text:.0f} px) is cut to {room:.0f} px"
