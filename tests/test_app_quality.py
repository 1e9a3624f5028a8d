"""The quality tab, driven like a user would (offscreen): Measure on the default model gives a
row with its figures and a point on the plot; Stop mid-run leaves the engine serving; a missing
reference text says what is wrong; a setting changed mid-run waits for the run, then applies,
and the next measurement of the current settings says what changed; a saved profile carries
its measured quality and shows it when loaded.

A tiny model finishes a measurement before the window handles one event, so the tests that act
during a run hold the worker between the run's pieces with a StepGate (on QualityRun.steps).
Every run scores a short stretch of the text (QualityController.tokens) to stay quick."""
import csv
from dataclasses import fields

import pytest
from PySide6.QtCore import Qt

import engine.quality.text
from engine.profiles import SessionProfile
from engine.quality import QualityRun
from test_app import StepGate, open_workbench, send, set_widget, tiny_profile  # noqa: F401

RUN_TIMEOUT_MS = 120_000
TOKENS = 128                # scored tokens of the shipped text: a quick run


@pytest.fixture
def eager_profile(tiny_profile):
    """The tiny model, eager: a restored setting never waits on a compile (not what these test)."""
    return lambda **settings: tiny_profile(**{"compile": "off"} | settings)


@pytest.fixture
def quality_gate(open_workbench, monkeypatch):
    """A StepGate before each piece of a QualityRun (closed: no piece runs until allowed);
    opened before the workbenches shut down."""
    gate = StepGate()
    original = QualityRun.steps

    def gated_steps(self):
        if getattr(self, "_gated", None) is None:
            inner = original(self)

            def pieces():
                while True:
                    gate.wait()
                    try:
                        piece = next(inner)
                    except StopIteration:
                        return
                    yield piece
            self._gated = pieces()
        return self._gated
    monkeypatch.setattr(QualityRun, "steps", gated_steps)
    yield gate
    gate.open()


def finished_runs(bench) -> list:
    """(stopped, error) of every quality run that ends from now on."""
    ended = []
    bench.host.worker.qualityFinished.connect(lambda stopped, error: ended.append((stopped, error)))
    return ended


def measure(bench, qtbot, *names):
    """Tick the configurations, click Measure on the raised Quality tab; returns the runs' ends."""
    panel = bench.window.quality_panel
    bench.quality.tokens = TOKENS
    bench.window.quality_dock.raise_()
    if names:
        panel.set_checked(list(names))
    ended = finished_runs(bench)
    qtbot.mouseClick(panel.measure_button, Qt.MouseButton.LeftButton)
    return ended


def wait_finished(bench, qtbot, ended) -> tuple:
    qtbot.waitUntil(lambda: bool(ended) and not bench.quality.running, timeout=RUN_TIMEOUT_MS)
    return ended[-1]


def has_quality_field() -> bool:
    return "quality" in {f.name for f in fields(SessionProfile)}


@pytest.mark.slow
def test_measuring_the_current_settings_of_the_default_model_gives_a_row_with_figures(open_workbench, qtbot,
                                                                                      tmp_path):
    bench = open_workbench(SessionProfile(compile="off", kv_cache_bytes=64 * 2**20))
    panel = bench.window.quality_panel
    ended = measure(bench, qtbot)                       # the current settings are ticked by default
    assert wait_finished(bench, qtbot, ended) == (False, "")
    assert bench.window.error_text() == ""
    [row] = bench.quality.history.rows
    assert row["label"] == "current settings" and row["current"] and row["change"] == ""
    assert row["text"]["tokens"] == TOKENS and row["reference"]["weight_dtype"] == "float"
    # The default model's weights are 4-bit as stored: lossy against the dequantized reference.
    assert row["lossy"] and row["kld_mean"] > 0
    lo, hi = row["kld_mean_ci95"]
    assert lo <= row["kld_mean"] <= hi and row["kld_p99"] >= row["kld_mean"]
    lo, hi = row["ppl_change_pct_ci95"]
    assert lo <= row["ppl_change_pct"] <= hi and 0 < row["same_top_pct"] <= 100
    assert row["decode_tok_s"] > 0 and row["lossless"]["identical"] is not None
    # The table shows the row with its intervals; the plot has its point, on the front (alone).
    assert panel.table.rowCount() == 1
    assert panel.table.item(0, 0).text() == "#1 current settings"
    assert "[" in panel.table.item(0, 1).text() and "[" in panel.table.item(0, 2).text()
    assert len(panel.points.data) == 1 and list(panel.front_curve.getData()[0]) == [row["kld_mean"]]
    assert "Done" in panel.status.text() and panel.measure_button.isEnabled()
    # Export: the CSV row has the figures and their intervals; the PNG is written.
    path = tmp_path / "quality.csv"
    panel.exportCsvRequested.emit(str(path))
    with path.open(newline="") as f:
        [written] = list(csv.DictReader(f))
    assert float(written["kld_mean_ci_low"]) <= float(written["kld_mean"]) <= float(written["kld_mean_ci_high"])
    panel.exportPngRequested.emit(str(tmp_path / "quality.png"))
    assert (tmp_path / "quality.png").stat().st_size > 0


def test_stop_mid_run_leaves_the_engine_serving_and_the_chat_waits_meanwhile(open_workbench, eager_profile, qtbot,
                                                                           quality_gate):
    bench = open_workbench(eager_profile())
    bench.store.save(eager_profile(name="fp8", kv_cache_dtype="fp8_e4m3"))
    bench.controller._show_title()                      # the profile menus and the quality panel's list
    qtbot.waitUntil(lambda: bench.controller.effective.get("kv_cache_dtype") is not None, timeout=RUN_TIMEOUT_MS)
    kv_before = bench.controller.effective["kv_cache_dtype"]
    panel = bench.window.quality_panel
    ended = measure(bench, qtbot, "(current settings)", "fp8")
    quality_gate.allow(4)
    qtbot.waitUntil(lambda: panel.progress_message.text() != "starting…", timeout=RUN_TIMEOUT_MS)
    assert panel.stop_button.isEnabled() and not panel.measure_button.isEnabled()
    # Meanwhile a message is refused with the reason, and kept in the box; so is a load run.
    chat = bench.window.chat
    chat.input.setPlainText("Hello while measuring")
    bench.controller.send("Hello while measuring")
    assert bench.controller.request_id is None
    assert "Quality measurement running: it ends" in bench.window.statusBar().currentMessage()
    assert chat.input_text() == "Hello while measuring"
    bench.window.load_panel.start_button.click()
    assert not bench.load.running and "Quality measurement running" in bench.window.load_panel.status.text()
    qtbot.mouseClick(panel.stop_button, Qt.MouseButton.LeftButton)
    quality_gate.open()
    assert wait_finished(bench, qtbot, ended) == (True, "")
    assert "Stopped" in panel.status.text() and panel.measure_button.isEnabled()
    assert bench.host.worker.quality is None
    # The engine is back on its own settings and answers right away.
    qtbot.waitUntil(lambda: bench.controller.effective.get("kv_cache_dtype") == kv_before, timeout=RUN_TIMEOUT_MS)
    done = send(bench, qtbot, "Hello after the stop")
    assert done["finish_reason"] in ("length", "stop") and done["summary"]["generated_tokens"] > 0


def test_a_missing_reference_text_says_what_is_wrong_and_changes_nothing(open_workbench, eager_profile, qtbot,
                                                                         monkeypatch, tmp_path):
    monkeypatch.setattr(engine.quality.text, "QUALITY_TEXT_FILE", tmp_path / "reference_text.txt")
    bench = open_workbench(eager_profile())
    panel = bench.window.quality_panel
    ended = measure(bench, qtbot)
    stopped, error = wait_finished(bench, qtbot, ended)
    assert "reference_text.txt" in error and "reinstall" in error
    shown = bench.window.error_text()
    assert shown.startswith("Measuring quality: ") and "cannot be read" in shown
    assert bench.quality.history.rows == [] and panel.measure_button.isEnabled()
    assert "Failed" in panel.status.text()
    done = send(bench, qtbot, "Still there?")
    assert done["summary"]["generated_tokens"] > 0


def test_a_setting_changed_mid_run_applies_after_it_and_the_next_measurement_says_what_changed(
        open_workbench, eager_profile, qtbot, quality_gate):
    bench = open_workbench(eager_profile())
    qtbot.waitUntil(lambda: bench.controller.effective.get("kv_cache_dtype") is not None, timeout=RUN_TIMEOUT_MS)
    kv_before = bench.controller.effective["kv_cache_dtype"]
    panel, worker = bench.window.quality_panel, bench.host.worker
    ended = measure(bench, qtbot)
    quality_gate.allow(3)
    qtbot.waitUntil(lambda: panel.progress_message.text() != "starting…", timeout=RUN_TIMEOUT_MS)
    set_widget(bench.window.settings.widget("kv_cache_dtype"), "fp8_e4m3")
    qtbot.waitUntil(lambda: "Changed during the measurement: KV fp8_e4m3" in panel.status.text(),
                    timeout=RUN_TIMEOUT_MS)
    assert worker.quality_deferred == {"kv_cache_dtype": "fp8_e4m3"}
    assert "fp8_e4m3" in bench.window.settings.deferred_label.text()
    quality_gate.open()
    assert wait_finished(bench, qtbot, ended) == (False, "")
    [first] = bench.quality.history.rows
    assert first["in_effect"]["kv_cache_dtype"] == kv_before       # measured on the settings it started with
    qtbot.waitUntil(lambda: bench.controller.effective.get("kv_cache_dtype") == "fp8_e4m3", timeout=RUN_TIMEOUT_MS)
    assert "Now applied: KV fp8_e4m3" in panel.status.text()
    assert not bench.window.settings.deferred_label.isVisibleTo(bench.window)
    # Measured again: a new point, marked with what changed.
    ended = measure(bench, qtbot)
    assert wait_finished(bench, qtbot, ended) == (False, "")
    second = bench.quality.history.rows[1]
    assert second["in_effect"]["kv_cache_dtype"] == "fp8_e4m3" and second["change"] == "KV fp8_e4m3"
    assert panel.table.item(1, 0).text() == "#2 current settings: KV fp8_e4m3"
    assert len(panel.points.data) == 2


@pytest.mark.skipif(not has_quality_field(), reason="SessionProfile has no quality field yet")
def test_a_saved_profile_carries_its_measured_quality_and_shows_it_when_loaded(open_workbench, eager_profile, qtbot):
    bench = open_workbench(eager_profile())
    ended = measure(bench, qtbot)
    assert wait_finished(bench, qtbot, ended) == (False, "")
    [row] = bench.quality.history.rows
    bench.controller.save_profile_as("measured")
    saved = bench.store.load("measured")
    assert saved.quality["kld_mean"] == row["kld_mean"] and saved.quality["measured_at"] == row["measured_at"]
    # A change after measuring: a profile saved now carries no quality (none was measured on it).
    set_widget(bench.window.settings.widget("enable_prefix_caching"), False)
    bench.controller.save_profile_as("unmeasured")
    assert bench.store.load("unmeasured").quality is None
    # Loading the measured profile shows its row, "from profile".
    bench.quality.history.clear()
    bench.controller.load_profile("measured")
    [shown] = bench.quality.history.rows
    assert shown["origin"] == "from profile" and shown["kld_mean"] == row["kld_mean"]
    assert bench.window.quality_panel.table.item(0, 0).text() == "#1 measured (from profile)"
