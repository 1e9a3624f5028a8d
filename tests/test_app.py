"""The desktop app, driven like a user would (pytest-qt, offscreen) with the real engine
on the embedded default model. One window and one engine for the whole module; each test
sets the settings it relies on."""
import csv
import json
import subprocess
import sys
import threading
import time

import pytest
from PySide6.QtCore import QObject, Qt, Signal, Slot
from PySide6.QtGui import QImage, QTextCharFormat
from PySide6.QtWidgets import QApplication

from app.__main__ import build, parse_args
from app.theme import style_sheet
from engine.profiles import ProfileStore

pytestmark = pytest.mark.slow
REPLY_TIMEOUT_MS = 120_000     # a shared 2-core CI box can be slow; no test depends on speed


def wait_until(predicate, timeout_s: float) -> None:
    """Like qtbot.waitUntil, for the module fixture (which cannot use the function-scoped qtbot)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        QApplication.processEvents()
        time.sleep(0.01)


class Probe(QObject):
    """The worker's signals, re-emitted on the GUI thread. A plain function connected to a
    worker signal would run on the worker thread; tests must act where the user does."""
    loadProgress = Signal(str, float)
    stepReady = Signal(dict)
    requestDone = Signal(dict)
    settingsChanged = Signal(dict, dict, dict)
    failed = Signal(str, str)

    def __init__(self, worker):
        super().__init__()
        worker.loadProgress.connect(self._progress)
        worker.stepReady.connect(self._step)
        worker.requestDone.connect(self._done)
        worker.settingsChanged.connect(self._settings)
        worker.failed.connect(self._failed)

    @Slot(str, float)
    def _progress(self, message, fraction):
        self.loadProgress.emit(message, fraction)

    @Slot(dict)
    def _step(self, event):
        self.stepReady.emit(event)

    @Slot(dict)
    def _done(self, done):
        self.requestDone.emit(done)

    @Slot(dict, dict, dict)
    def _settings(self, settings, applied, deferred):
        self.settingsChanged.emit(settings, applied, deferred)

    @Slot(str, str)
    def _failed(self, doing, message):
        self.failed.emit(doing, message)


@pytest.fixture(scope="module")
def bench(qapp, tmp_path_factory):
    qapp.setStyleSheet(style_sheet())
    store = ProfileStore(tmp_path_factory.mktemp("config"))
    workbench = build(store=store, start=False)
    workbench.probe = Probe(workbench.host.worker)
    workbench.progress_log = []
    workbench.probe.loadProgress.connect(lambda m, f: workbench.progress_log.append((m, f)))
    workbench.window.show()
    workbench.controller.start()
    wait_until(lambda: workbench.controller.model_ready, 180)
    yield workbench
    workbench.window.close()
    workbench.shutdown()


@pytest.fixture
def second_window(qapp):
    """Another workbench on a given store, without loading a model: start-up settings only."""
    opened = []

    def open_window(**kwargs):
        opened.append(build(start=False, **kwargs))
        return opened[-1]
    yield open_window
    for workbench in reversed(opened):
        workbench.window.close()
        workbench.shutdown(save_session=False)


@pytest.fixture
def steps(bench):
    """Every step event the worker emits during the test, as the window receives them."""
    received = []
    bench.probe.stepReady.connect(received.append)
    yield received
    bench.probe.stepReady.disconnect(received.append)


def set_options(bench, qtbot, proposer="off", draft="", kv="auto", prefix=True, max_tokens=8, k=4):
    """Set the side panel like a user would, then wait until the engine reports it in effect."""
    panel = bench.window.settings
    panel.proposer_combo.setCurrentIndex(panel.proposer_combo.findData(proposer))
    panel.k_spin.setValue(k)
    panel.draft_combo.setCurrentIndex(panel.draft_combo.findData(draft))
    panel.kv_dtype_combo.setCurrentIndex(panel.kv_dtype_combo.findData(kv))
    panel.prefix_check.setChecked(prefix)
    panel.max_tokens_spin.setValue(max_tokens)
    want = {"kv_cache_dtype": "float32" if kv == "auto" else kv, "enable_prefix_caching": prefix,
            "num_speculative_tokens": k, "draft_model": draft or None,
            "proposer": "off" if proposer == "draft" and not draft else proposer}
    qtbot.waitUntil(lambda: all(bench.controller.effective.get(key) == v for key, v in want.items())
                    and bench.controller.busy == "", timeout=30_000)


def send(bench, qtbot, text: str) -> dict:
    """Type a message, press Ctrl+Enter, wait for the reply to finish; returns requestDone's data."""
    chat = bench.window.chat
    chat.input.setPlainText(text)
    with qtbot.waitSignal(bench.probe.requestDone, timeout=REPLY_TIMEOUT_MS) as done:
        qtbot.keyClick(chat.input, Qt.Key.Key_Return, Qt.KeyboardModifier.ControlModifier)
    return done.args[0]


def points(item) -> int:
    x = item.getData()[0]
    return 0 if x is None else len(x)


def transcript_fragments(chat) -> list[tuple[str, str | None]]:
    """(text, token kind) for every run of text in the transcript."""
    out = []
    for block in _blocks(chat.transcript.document()):
        for fragment in (it.fragment() for it in block):
            out.append((fragment.text(), fragment.charFormat().property(QTextCharFormat.Property.UserProperty)))
    return out


def _blocks(document):
    block = document.begin()
    while block.isValid():
        yield block
        block = block.next()


# ---- start-up ---------------------------------------------------------------------
def test_loading_reports_progress_then_enables_chat(bench):
    messages = [m for m, _ in bench.progress_log]
    fractions = [f for _, f in bench.progress_log]
    assert any("loading weights" in m for m in messages) and fractions[-1] == 1.0
    assert fractions == sorted(fractions)
    assert not bench.window.progress.isVisible()
    assert "SmolLM2" in bench.window.settings.model_label.text()
    assert bench.window.chat.send_button.isEnabled() and not bench.window.chat.stop_button.isEnabled()


def test_command_line_takes_a_profile_path():
    assert parse_args(["--profile", "/tmp/p.json"]).profile == "/tmp/p.json"
    assert parse_args([]).profile is None
    out = subprocess.run([sys.executable, "-m", "app", "--help"], capture_output=True, text=True, check=True).stdout
    assert "--profile PATH" in out


# ---- chat ---------------------------------------------------------------------------
def test_a_message_streams_a_reply_with_stats_and_fills_the_plots(bench, qtbot, steps):
    set_options(bench, qtbot, max_tokens=8)
    bench.controller.new_chat()
    steps_before, requests_before = bench.history.num_steps, bench.history.num_requests
    done = send(bench, qtbot, "What is the capital of France?")
    reply = "".join(e["text_delta"] for e in steps)
    assert len(steps) == done["summary"]["generated_tokens"] > 1          # streamed, one event per token
    assert done["finish_reason"] in ("stop", "length")
    assert "Paris" in reply
    transcript = bench.window.chat.transcript.toPlainText()
    assert reply in transcript and "TTFT" in transcript and "tok/s" in transcript
    assert bench.controller.conversation[-1] == {"role": "assistant", "content": reply}
    assert bench.history.num_steps == steps_before + len(steps) and bench.history.num_requests == requests_before + 1
    plots = bench.window.plots
    qtbot.waitUntil(lambda: points(plots.kv_capacity_curve) == bench.history.num_steps, timeout=5000)
    assert points(plots.decode_points) >= len(steps) - 1                # every step after the first
    assert plots.ttft_bars.opts["height"][-1] == pytest.approx(done["summary"]["ttft_s"] * 1000)


def test_accepted_draft_tokens_are_coloured_apart_from_target_tokens(bench, qtbot, steps):
    set_options(bench, qtbot, proposer="draft", draft="self", max_tokens=10)
    bench.controller.new_chat()
    done = send(bench, qtbot, "Name three colours.")
    assert done["summary"]["acceptance_rate"] == 1.0                     # the target drafting for itself
    kinds = {kind for _, kind in transcript_fragments(bench.window.chat) if kind}
    assert "accepted" in kinds and kinds & {"bonus", "target", "resampled"}
    # Exact per token: the accepted-coloured text is exactly the accepted tokens' text.
    tokenizer = bench.host.worker.engine.tokenizer
    for kind in ("accepted", "bonus"):
        coloured = "".join(t for t, k in transcript_fragments(bench.window.chat) if k == kind)
        expected = "".join(tokenizer.decode([t], skip_special_tokens=True) for e in steps
                           for t, k in zip(e["token_ids"], e["token_kinds"]) if k == kind)
        assert coloured == expected
    assert "accepted draft token" in bench.window.chat.legend.text()
    assert "acceptance 100%" in bench.window.chat.transcript.toPlainText()
    plots = bench.window.plots
    qtbot.waitUntil(lambda: len(plots.positions_bars.opts["height"]) == 4, timeout=5000)
    assert list(plots.positions_bars.opts["height"]) == [100.0] * 4
    set_options(bench, qtbot)


def test_fp8_and_prefix_toggles_mid_reply_apply_live_or_at_the_next_request(bench, qtbot, steps):
    set_options(bench, qtbot, kv="auto", prefix=True, max_tokens=12)
    panel = bench.window.settings
    deferred_seen = []
    markers_before = bench.history.markers_added

    def toggle_on_first_step(event):
        if event["step"] == 0:
            panel.kv_dtype_combo.setCurrentIndex(panel.kv_dtype_combo.findData("fp8_e4m3"))
            panel.prefix_check.setChecked(False)

    def note_deferred(settings, applied, deferred):
        deferred_seen.append((dict(deferred), panel.deferred_label.isVisibleTo(panel), panel.deferred_label.text()))
    bench.probe.stepReady.connect(toggle_on_first_step)
    bench.probe.settingsChanged.connect(note_deferred)
    try:
        send(bench, qtbot, "Tell me a fact about the sea.")
    finally:
        bench.probe.stepReady.disconnect(toggle_on_first_step)
        bench.probe.settingsChanged.disconnect(note_deferred)
    # The cache dtype waits for the reply to end (and the UI says so); prefix caching is live.
    assert ({"kv_cache_dtype": "fp8_e4m3"}, True) in [(d, shown) for d, shown, _ in deferred_seen]
    assert any("Applies when the current reply ends" in text and "KV fp8_e4m3" in text for _, _, text in deferred_seen)
    assert {e["kv_dtype"] for e in steps} == {"float32"}
    assert steps[0]["settings"]["enable_prefix_caching"] is True
    assert steps[-1]["settings"]["enable_prefix_caching"] is False
    assert not panel.deferred_label.isVisibleTo(panel)
    assert "fp8_e4m3" in panel.effective_label.text() and "<b>Prefix cache</b>: off" in panel.effective_label.text()
    steps.clear()
    done = send(bench, qtbot, "And one about the moon?")
    assert {e["kv_dtype"] for e in steps} == {"fp8_e4m3"}
    assert all(e["settings"]["enable_prefix_caching"] is False for e in steps)
    assert done["summary"]["prefix_hit_tokens"] == 0
    labels = [label for _, _, label in list(bench.history.markers)[-2:]]
    assert bench.history.markers_added >= markers_before + 2
    assert "prefix cache off" in labels[0] and "KV fp8_e4m3" in labels[1]
    set_options(bench, qtbot)


def test_stop_ends_the_reply_within_a_step_and_keeps_what_was_said(bench, qtbot, steps):
    set_options(bench, qtbot, max_tokens=200)
    bench.controller.new_chat()
    chat = bench.window.chat
    stopped_after = []

    def stop_on_second_step(event):
        if event["step"] == 1 and not stopped_after:
            qtbot.keyClick(chat.input, Qt.Key.Key_Escape)
            stopped_after.append(len(steps))
    bench.probe.stepReady.connect(stop_on_second_step)
    try:
        done = send(bench, qtbot, "Write a long story about a dragon.")
    finally:
        bench.probe.stepReady.disconnect(stop_on_second_step)
    assert done["finish_reason"] == "cancelled"
    # The step running when Esc arrived finishes, then the cancel is seen (events in flight aside).
    assert len(steps) - stopped_after[0] <= 3 and done["summary"]["generated_tokens"] < 10
    partial = "".join(e["text_delta"] for e in steps)
    assert partial and bench.controller.conversation[-1] == {"role": "assistant", "content": partial}
    assert "stopped" in chat.transcript.toPlainText()
    assert chat.send_button.isEnabled() and not chat.stop_button.isEnabled()


def test_an_engine_error_is_shown_and_the_conversation_is_kept(bench, qtbot):
    set_options(bench, qtbot, max_tokens=4)
    chat, window = bench.window.chat, bench.window
    conversation = list(bench.controller.conversation)
    too_long = "hello " * 9000                        # more tokens than the model's context
    with qtbot.waitSignal(bench.probe.failed, timeout=REPLY_TIMEOUT_MS):
        send(bench, qtbot, too_long)
    assert "context holds" in window.error_text() and "start a new chat" in window.error_text()
    assert "context holds" in chat.transcript.toPlainText()
    assert bench.controller.conversation == conversation
    assert chat.input_text() == too_long.strip()      # given back for a retry
    assert chat.send_button.isEnabled()
    chat.set_input_text("")
    window.clear_error()


def test_a_model_that_cannot_load_leaves_the_current_one(bench, qtbot):
    name = bench.window.settings.model_label.text()
    with qtbot.waitSignal(bench.probe.failed, timeout=30_000) as failed:
        bench.window.settings.modelRequested.emit("/no/such/model")
    assert "model not found: /no/such/model" in failed.args[1]
    assert "/no/such/model" in bench.window.error_text()
    qtbot.waitUntil(lambda: bench.controller.busy == "", timeout=5000)
    assert bench.controller.model_ready and bench.window.settings.model_label.text() == name
    assert bench.window.chat.send_button.isEnabled() and not bench.window.progress.isVisible()
    bench.window.clear_error()


def test_a_draft_that_cannot_load_is_reported_and_the_choice_reverts(bench, qtbot):
    panel = bench.window.settings
    with qtbot.waitSignal(bench.probe.failed, timeout=30_000) as failed:
        panel.choose_draft("/no/such/draft")
    assert failed.args[0] == "Loading draft model '/no/such/draft'" and "model not found" in failed.args[1]
    assert "/no/such/draft" in bench.window.error_text()
    assert panel.values()["draft_model"] is None and bench.controller.effective["draft_model"] is None
    qtbot.waitUntil(lambda: bench.controller.busy == "", timeout=5000)
    bench.window.clear_error()


# ---- profiles -------------------------------------------------------------------------
def test_ctrl_s_saves_a_profile_that_loads_back_every_setting(bench, qtbot, monkeypatch):
    window, panel = bench.window, bench.window.settings
    set_options(bench, qtbot, proposer="ngram", kv="fp8_e4m3", prefix=False, k=6, max_tokens=32)
    panel.temperature_spin.setValue(0.5)
    panel.seed_spin.setValue(7)
    window.chat.set_system_prompt("Be brief.")
    saved_values = panel.values()
    monkeypatch.setattr(window, "ask_profile_name", lambda suggestion="": "mine")
    window.activateWindow()
    qtbot.waitUntil(window.isActiveWindow, timeout=5000)
    qtbot.keyClick(window, Qt.Key.Key_S, Qt.KeyboardModifier.ControlModifier)
    path = bench.store.path_for("mine")
    assert path.is_file() and json.loads(path.read_text())["num_speculative_tokens"] == 6
    assert "mine" in window.windowTitle()

    set_options(bench, qtbot)                                        # change everything back
    panel.temperature_spin.setValue(0.0)
    window.chat.set_system_prompt("Something else.")
    window.loadProfileRequested.emit("mine")
    assert panel.values() == saved_values and window.chat.system_prompt() == "Be brief."
    want = {"kv_cache_dtype": "fp8_e4m3", "enable_prefix_caching": False, "proposer": "ngram",
            "num_speculative_tokens": 6}
    qtbot.waitUntil(lambda: all(bench.controller.effective.get(k) == v for k, v in want.items()), timeout=30_000)
    set_options(bench, qtbot)
    panel.temperature_spin.setValue(0.0)
    panel.seed_spin.setValue(-1)


@pytest.mark.parametrize("content, message", [
    ("{ this is not json", "not valid JSON"),
    (json.dumps({"format": "inference-workbench-profile", "version": 99}), "newer workbench"),
])
def test_a_corrupt_profile_changes_nothing_and_says_why(bench, qtbot, tmp_path, content, message):
    window, panel = bench.window, bench.window.settings
    set_options(bench, qtbot, kv="fp8_e4m3", prefix=False)
    values, effective = panel.values(), dict(bench.controller.effective)
    bad = tmp_path / "broken.json"
    bad.write_text(content)
    window.loadProfileRequested.emit(str(bad))
    assert message in window.error_text() and str(bad) in window.error_text()
    assert "nothing was changed" in window.error_text()
    assert panel.values() == values
    assert bench.host.worker._reconfigure_queue.empty()             # no change was sent to the engine
    assert bench.controller.effective == effective
    window.clear_error()
    set_options(bench, qtbot)


def test_settings_are_saved_as_the_last_session(bench, qtbot):
    bench.window.settings.top_k_spin.setValue(40)
    qtbot.waitUntil(lambda: getattr(bench.store.load_last_session(), "top_k", None) == 40, timeout=5000)
    bench.window.settings.top_k_spin.setValue(0)


def test_the_next_start_restores_the_last_session(bench, qtbot, second_window):
    panel = bench.window.settings
    panel.k_spin.setValue(9)
    panel.kv_dtype_combo.setCurrentIndex(panel.kv_dtype_combo.findData("fp8_e4m3"))
    bench.window.chat.set_system_prompt("Restored prompt.")
    bench.window.close()                      # closing saves the session
    reopened = second_window(store=bench.store)
    values = reopened.window.settings.values()
    assert values["num_speculative_tokens"] == 9 and values["kv_cache_dtype"] == "fp8_e4m3"
    assert reopened.window.chat.system_prompt() == "Restored prompt."
    bench.window.show()
    bench.window.chat.set_system_prompt("You are a helpful assistant.")
    set_options(bench, qtbot)


def test_profile_option_starts_from_that_profile(bench, second_window, tmp_path):
    from engine.profiles import SessionProfile
    path = ProfileStore(tmp_path).save(SessionProfile(name="fast", proposer="ngram", num_speculative_tokens=5))
    started = second_window(profile_path=str(path), store=bench.store)
    assert started.window.settings.values()["proposer"] == "ngram"
    assert started.window.settings.values()["num_speculative_tokens"] == 5
    assert "fast" in started.window.windowTitle()


def test_a_broken_profile_option_starts_with_defaults_and_says_why(bench, second_window, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    started = second_window(profile_path=str(bad), store=bench.store)
    assert "not valid JSON" in started.window.error_text() and "default settings" in started.window.error_text()
    assert started.window.settings.values()["proposer"] == "off"


# ---- exports --------------------------------------------------------------------------
def test_plots_export_as_png_and_metrics_as_csv(bench, tmp_path):
    png, table = tmp_path / "plots.png", tmp_path / "metrics.csv"
    bench.window.plots.exportPngRequested.emit(str(png))
    bench.window.plots.exportCsvRequested.emit(str(table))
    image = QImage(str(png))
    assert not image.isNull() and image.width() > 400
    with open(table) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == bench.history.num_steps > 0
    assert {"session_step", "acceptance", "kv_used_mib", "tok_s", "kv_dtype"} <= set(rows[0])
    with open(tmp_path / "metrics-requests.csv") as f:
        requests = list(csv.DictReader(f))
    assert len(requests) == bench.history.num_requests and float(requests[0]["ttft_ms"]) > 0


# ---- threads ----------------------------------------------------------------------------
def test_the_gui_thread_never_runs_the_engine(bench, qtbot, monkeypatch):
    """Forward passes, reconfiguring and draft loading all happen on the worker thread,
    even when the user toggles settings and stops mid-reply."""
    from engine.engine import LLMEngine
    from engine.model_runner import ModelRunner
    threads = []

    def record(original):
        def wrapper(*args, **kwargs):
            threads.append(threading.current_thread())
            return original(*args, **kwargs)
        return wrapper
    for cls, name in ((ModelRunner, "forward"), (LLMEngine, "reconfigure"), (LLMEngine, "set_draft_model"),
                      (LLMEngine, "generate"), (LLMEngine, "settings")):
        monkeypatch.setattr(cls, name, record(getattr(cls, name)))
    gui_updates = []      # and the other way round: widgets are only touched on the GUI thread
    chat = bench.window.chat
    original_append = chat.append_segments
    monkeypatch.setattr(chat, "append_segments",
                        lambda segments: (gui_updates.append(threading.current_thread()), original_append(segments)))
    panel = bench.window.settings

    def meddle(event):
        if event["step"] == 1:
            panel.prefix_check.toggle()
            panel.k_spin.setValue(3)
            panel.draft_combo.setCurrentIndex(panel.draft_combo.findData("self"))
            bench.controller.stop()
    bench.probe.stepReady.connect(meddle)
    try:
        set_options(bench, qtbot, max_tokens=16)
        send(bench, qtbot, "Hello!")
    finally:
        bench.probe.stepReady.disconnect(meddle)
    qtbot.waitUntil(lambda: bench.controller.busy == "", timeout=30_000)
    assert len(threads) > 5
    assert threading.main_thread() not in threads
    assert {t.name for t in threads} and all(t is threads[0] for t in threads)     # one worker thread
    assert gui_updates and set(gui_updates) == {threading.main_thread()}
    set_options(bench, qtbot)


# ---- the metrics history behind the plots (no Qt needed) -----------------------------------
def _event(step, settings, proposed=0, accepted=0, tokens=1):
    return {"step": step, "token_ids": [1] * tokens, "token_kinds": ["target"] * tokens, "time_s": 0.1,
            "step_time_s": 0.05, "proposed": proposed, "accepted": accepted,
            "accepted_per_position": [True] * accepted + ([False] if accepted < proposed else []),
            "kv_bytes_used": 2**20, "kv_bytes_capacity": 2**29, "kv_dtype": settings["kv_cache_dtype"],
            "prefix_hit_tokens": 0, "prompt_tokens": 10, "generated_tokens": step + 1,
            "ttft_s": 0.2 if step == 0 else None, "settings": settings}


def test_history_marks_setting_changes_and_resets_per_position_on_new_speculation():
    from app.metrics_history import MetricsHistory
    history = MetricsHistory()
    plain = {"kv_cache_dtype": "float32", "enable_prefix_caching": True, "proposer": "off",
             "num_speculative_tokens": 4, "draft_model": None}
    spec = plain | {"proposer": "ngram"}
    history.record_step(_event(0, plain))
    history.record_step(_event(1, plain))
    history.record_step(_event(2, spec, proposed=4, accepted=2, tokens=3))
    history.record_step(_event(3, spec | {"kv_cache_dtype": "fp8_e4m3"}, proposed=4, accepted=4, tokens=5))
    assert [(x, label) for x, _, label in history.markers] == [(1.5, "spec ngram"), (2.5, "KV fp8_e4m3")]
    assert list(history.per_position_acceptance()) == [1.0, 1.0, 0.5, 1.0]
    acceptance = history.step_series("acceptance")
    assert list(acceptance[2:]) == [0.5, 1.0] and all(a != a for a in acceptance[:2])    # NaN: nothing proposed
    assert list(history.step_series("running_acceptance")[2:]) == [0.5, 0.75]
    assert list(history.step_series("is_fp8")) == [0, 0, 0, 1]
    history.record_step(_event(0, spec | {"num_speculative_tokens": 2, "kv_cache_dtype": "fp8_e4m3"}))
    assert history.markers[-1][1:] == (1.5, "k=2")       # between request 1 and request 2
    assert len(history.per_position_acceptance()) == 0      # a new set-up starts a new tally


def test_ring_buffer_keeps_the_newest_values_in_order():
    from app.metrics_history import RingBuffer
    ring = RingBuffer(4)
    for v in range(7):
        ring.append(v)
    assert list(ring.values()) == [3, 4, 5, 6] and len(ring) == 4


def test_void_qt_calls_keep_none_referenced():
    """PySide6 6.12.0 on Python 3.11 loses a reference to None per void call, which aborts a
    long session ("none_dealloc"); pyproject pins below it. This fails on such bindings."""
    from PySide6.QtCore import QObject
    probe = QObject()
    before = sys.getrefcount(None)
    for _ in range(5_000):
        probe.setObjectName("x")
    assert before - sys.getrefcount(None) < 100


def test_signals_carrying_true_keep_it_referenced():
    """The same bindings lose a reference to True per bool a signal delivers."""
    from PySide6.QtCore import QObject, Signal

    class Emitter(QObject):
        flag = Signal(bool)
    emitter, received = Emitter(), []
    emitter.flag.connect(received.append)
    before = sys.getrefcount(True)
    for _ in range(5_000):
        emitter.flag.emit(True)
    assert len(received) == 5_000 and before - sys.getrefcount(True) < 100
