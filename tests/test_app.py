"""The desktop app, driven like a user would (pytest-qt, offscreen) with the real engine.

Every test opens its own workbench (window, worker thread, tmp profile store) and closes
it after, so no test depends on another. The wiring tests run on a tiny random model
(conftest's `tiny_model`; its replies are gibberish, which is all they need); one test,
marked slow, loads the embedded default model and checks that it actually answers. Tests
that act in the middle of a reply hold the worker with a StepGate, because a tiny model
finishes a reply before the window has handled its first step.
"""
import csv
import json
import os
import subprocess
import sys
import threading
import time

import pytest
from PySide6.QtCore import QObject, Qt, Signal, Slot
from PySide6.QtGui import QImage, QTextCharFormat
from PySide6.QtWidgets import QApplication, QCheckBox, QComboBox

from app.__main__ import build, parse_args
from app.engine_worker import GENERATE, LOAD_DRAFT, LOAD_MODEL
from app.theme import style_sheet
from engine.profiles import VERSION, ProfileStore, SessionProfile
from tests.conftest import KEPT_WINDOWS

LOAD_TIMEOUT_MS = 180_000           # the first run converts the default model's GGUF
REPLY_TIMEOUT_MS = 120_000          # a shared 2-core CI box can be slow; no test depends on speed
SETTLE_TIMEOUT_MS = 30_000
TINY_POOL_BYTES = 16 * 2**20        # a profile setting the panel does not show; the default 512 MiB
                                    # pool would take longer to allocate than the tiny model to load
GATE_TIMEOUT_S = 120


class Probe(QObject):
    """The worker's signals, re-emitted on the GUI thread. A plain function connected to a
    worker signal would run on the worker thread; tests must act where the user does."""
    loadProgress = Signal(str, float)
    stepReady = Signal(dict)
    requestDone = Signal(dict)
    settingsChanged = Signal(dict, dict, dict)
    failed = Signal(str, str, str)

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

    @Slot(str, str, str)
    def _failed(self, kind, doing, message):
        self.failed.emit(kind, doing, message)


# ---- fixtures ------------------------------------------------------------------------
@pytest.fixture
def open_workbench(qapp, qtbot, tmp_path):
    """Open a workbench on its own profile store (tmp_path/config unless given), with a Probe
    on its worker; start=True loads the profile's model and waits until it is ready.
    `profile` is saved as the store's last session first, so the workbench starts from it.
    Every workbench opened is closed and shut down after the test."""
    if qapp.styleSheet() != style_sheet():
        qapp.setStyleSheet(style_sheet())      # setting it again would restyle every widget alive
    opened = []

    def open_one(profile=None, *, profile_path=None, store=None, start=True, show=True):
        store = store or ProfileStore(tmp_path / "config")
        if profile is not None:
            store.save_last_session(profile)
        workbench = build(profile_path=profile_path, store=store, start=False)
        opened.append(workbench)
        workbench.probe = Probe(workbench.host.worker)      # before loading starts: it logs the progress
        workbench.progress_log = []
        workbench.probe.loadProgress.connect(lambda message, fraction:
                                             workbench.progress_log.append((message, fraction)))
        if show:
            workbench.window.show()
        if start:
            workbench.controller.start()
            qtbot.waitUntil(lambda: workbench.controller.model_ready and workbench.controller.busy == "",
                            timeout=LOAD_TIMEOUT_MS)
        return workbench
    yield open_one
    for workbench in reversed(opened):
        workbench.window.close()
        workbench.shutdown(save_session=False)
        # Closed and its engine let go, but not deleted: Qt deleting a window's pyqtgraph scenes
        # crashed the process now and then (CI twice, here about 1 run in 3 of four app tests:
        # a Python override called from a half-deleted item, shiboken crashing on the call's
        # failure; not yet understood). The windows live until the run ends without
        # finalization (tests/conftest.py, pytest_unconfigure), as Python's collector would
        # otherwise delete them at a random moment.
        KEPT_WINDOWS.append(workbench)


@pytest.fixture
def tiny_profile(tiny_model):
    """A session profile on the tiny model, short replies, a small KV pool, and speculation
    at the k the test sets (the batch-size policy would turn a self draft off: it cannot pay)."""
    def make(**settings):
        return SessionProfile(**{"model": str(tiny_model.folder), "kv_cache_bytes": TINY_POOL_BYTES,
                                 "max_tokens": 8, "speculation_policy": "fixed"} | settings)
    return make


@pytest.fixture
def tiny_bench(open_workbench, tiny_profile):
    """A fresh workbench with the tiny model loaded."""
    return open_workbench(tiny_profile())


class StepGate:
    """Holds the worker before each engine step until the test lets it go. A tiny model
    steps far faster than the window handles events, so a reply would end before a
    click made on its first step arrived; the gate lets the worker run exactly the steps
    allowed, as a real model does while the user clicks."""

    def __init__(self):
        self._permits = threading.Semaphore(0)
        self._open = threading.Event()

    def allow(self, steps: int) -> None:
        for _ in range(steps):
            self._permits.release()

    def open(self) -> None:
        self._open.set()

    def is_open(self) -> bool:
        return self._open.is_set()

    def wait(self) -> None:
        deadline = time.monotonic() + GATE_TIMEOUT_S
        while not self._open.is_set():
            if self._permits.acquire(timeout=0.02):
                return
            if time.monotonic() > deadline:
                raise RuntimeError("the test never let this step run")


@pytest.fixture
def step_gate(open_workbench, monkeypatch):
    """A StepGate on RequestStream.step (closed: no step runs until allowed). It opens before the
    workbenches shut down (it depends on open_workbench), so no worker is left waiting."""
    from engine.stream import RequestStream
    gate = StepGate()
    original = RequestStream.step

    def gated_step(self):
        gate.wait()
        return original(self)
    monkeypatch.setattr(RequestStream, "step", gated_step)
    yield gate
    gate.open()


# ---- helpers -------------------------------------------------------------------------
def collect(signal) -> list:
    """Every value the (one-argument) signal carries from now on."""
    received = []
    signal.connect(received.append)
    return received


def set_widget(widget, value) -> None:
    """Change a settings control like a user would (this emits its change signal)."""
    if isinstance(widget, QComboBox):
        index = widget.findData("" if value is None else value)
        assert index >= 0, f"{value!r} is not offered"
        widget.setCurrentIndex(index)
    elif isinstance(widget, QCheckBox):
        widget.setChecked(value)
    else:
        widget.setValue(widget.minimum() if value is None else value)     # "not set" is shown below the range


ENGINE_KEYS = ("proposer", "num_speculative_tokens", "draft_model", "kv_cache_dtype", "enable_prefix_caching")


def set_options(workbench, qtbot, **values) -> None:
    """Set side-panel controls (keys as in engine.config.SETTINGS), then wait until the
    engine reports the engine settings among them in effect."""
    panel = workbench.window.settings
    for key, value in values.items():
        set_widget(panel.widget(key), value)
    controller = workbench.controller
    want = {key: values[key] for key in ENGINE_KEYS if key in values}
    if want.get("kv_cache_dtype") == "auto":
        want["kv_cache_dtype"] = controller.effective["dtype"]     # the model's dtype
    if "proposer" in want or "draft_model" in want:
        chosen = panel.values()
        want["proposer"] = "off" if chosen["proposer"] == "draft" and not chosen["draft_model"] else chosen["proposer"]
    qtbot.waitUntil(lambda: all(controller.effective.get(k) == v for k, v in want.items()) and controller.busy == "",
                    timeout=SETTLE_TIMEOUT_MS)


def send(workbench, qtbot, text: str) -> dict:
    """Type a message, press Ctrl+Enter, wait for the reply to finish; returns requestDone's data."""
    chat = workbench.window.chat
    chat.input.setPlainText(text)
    with qtbot.waitSignal(workbench.probe.requestDone, timeout=REPLY_TIMEOUT_MS) as done:
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


# ---- the default model: start-up and a real answer ---------------------------------------
@pytest.mark.slow
def test_the_default_model_loads_with_progress_then_streams_an_answer(open_workbench, qtbot):
    bench = open_workbench()            # a new store: default settings, the embedded default model
    messages = [m for m, _ in bench.progress_log]
    compiling = next(i for i, m in enumerate(messages) if m.startswith("compiling the model's step"))
    fractions = [f for _, f in bench.progress_log]
    assert any("loading weights" in m for m in messages[:compiling]) and fractions[-1] == 1.0
    # Loading, then the compiled step (compile auto) built at load: each phase's bar only grows.
    assert fractions[:compiling] == sorted(fractions[:compiling]) and fractions[compiling:] == [0.0, 1.0]
    assert not bench.window.progress.isVisible()
    panel, chat = bench.window.settings, bench.window.chat
    assert "SmolLM2" in panel.model_label.text()
    assert chat.send_button.isEnabled() and not chat.stop_button.isEnabled()
    # "In effect" says what the engine runs with, down to the torch threads (the headless
    # engine's count: test_the_engine_runs_with_the_headless_thread_count).
    settings = bench.controller.effective
    assert settings["threads"] >= 1
    effective = panel.effective_label.text()
    assert f"<b>Runs on</b>: {settings['device']}, {settings['dtype']} activations, {settings['threads']} torch thread" \
        in effective
    # and how the weights are served (weight_dtype), with what a decode step reads
    assert f"<b>Weights</b>: {settings['weight_dtype']}, {settings['weight_bytes_per_token'] / 2**20:.0f} MiB read " \
        "per token" in effective

    set_options(bench, qtbot, max_tokens=8)
    steps = collect(bench.probe.stepReady)
    # "What is the capital of France?" gets a French non-answer from this 4-bit file with int8
    # activations: llama-server gives the same one, token for token
    done = send(bench, qtbot, "Name the capital of France.")
    reply = "".join(e["text_delta"] for e in steps)
    assert len(steps) == done["summary"]["generated_tokens"] > 1          # streamed, one event per token
    assert done["summary"]["generated_tokens"] <= 8
    assert done["finish_reason"] in ("stop", "length")
    assert "Paris" in reply
    chat.set_raw(True)          # as typed: rendered Markdown drops a reply's leading space
    transcript = chat.transcript.toPlainText()
    assert reply in transcript and "TTFT" in transcript and "tok/s" in transcript
    assert bench.controller.conversation[-1] == {"role": "assistant", "content": reply}
    assert bench.history.num_steps == len(steps) and bench.history.num_requests == 1
    plots = bench.window.plots
    qtbot.waitUntil(lambda: points(plots.kv_capacity_curve) == bench.history.num_steps, timeout=SETTLE_TIMEOUT_MS)
    assert points(plots.decode_points) >= len(steps) - 1                # every step after the first
    assert plots.ttft_bars.opts["height"][-1] == pytest.approx(done["summary"]["ttft_s"] * 1000)


def test_command_line_takes_a_profile_path():
    assert parse_args(["--profile", "/tmp/p.json"]).profile == "/tmp/p.json"
    assert parse_args([]).profile is None
    out = subprocess.run([sys.executable, "-m", "app", "--help"], capture_output=True, text=True, check=True).stdout
    assert "--profile PATH" in out


# ---- chat ---------------------------------------------------------------------------
def test_a_model_from_a_profile_loads_and_its_replies_stream_into_the_chat(open_workbench, tiny_profile, tiny_model,
                                                                          qtbot):
    bench = open_workbench(tiny_profile(max_tokens=6))
    assert bench.window.settings.model_label.text() == tiny_model.display_name
    assert any("loading weights" in m for m, _ in bench.progress_log) and bench.progress_log[-1][1] == 1.0
    assert not bench.window.progress.isVisible()
    steps = collect(bench.probe.stepReady)
    done = send(bench, qtbot, "Hello!")
    reply = "".join(e["text_delta"] for e in steps)
    assert [e["step"] for e in steps] == list(range(done["summary"]["generated_tokens"]))
    assert done["summary"]["generated_tokens"] <= 6
    assert "".join(text for e in steps for text, _ in e["pieces"]) == reply
    bench.window.chat.set_raw(True)         # as typed: rendered Markdown drops a reply's leading space
    assert reply and reply in bench.window.chat.transcript.toPlainText()
    assert bench.controller.conversation == [{"role": "user", "content": "Hello!"},
                                             {"role": "assistant", "content": reply}]
    assert bench.history.num_steps == len(steps) and bench.history.num_requests == 1


def test_accepted_draft_tokens_are_coloured_apart_from_target_tokens(tiny_bench, tiny_model, qtbot):
    bench = tiny_bench
    set_options(bench, qtbot, proposer="draft", draft_model="self", max_tokens=10)
    steps = collect(bench.probe.stepReady)
    done = send(bench, qtbot, "Name three colours.")
    assert done["summary"]["acceptance_rate"] == 1.0                     # the target drafting for itself
    kinds = {kind for _, kind in transcript_fragments(bench.window.chat) if kind}
    assert "accepted" in kinds and kinds & {"bonus", "target", "resampled"}
    # Exact per token: the accepted-coloured text is exactly the accepted tokens' text, as typed
    # (tests/test_chat_markdown.py: the colours of a rendered reply).
    bench.window.chat.set_raw(True)
    tokenizer = tiny_model.tokenizer
    for kind in ("accepted", "bonus"):
        coloured = "".join(t for t, k in transcript_fragments(bench.window.chat) if k == kind)
        expected = "".join(tokenizer.decode([t], skip_special_tokens=True) for e in steps
                           for t, k in zip(e["token_ids"], e["token_kinds"]) if k == kind)
        assert coloured == expected
    assert "accepted draft token" in bench.window.chat.legend.text()
    assert "acceptance 100%" in bench.window.chat.transcript.toPlainText()
    plots = bench.window.plots
    qtbot.waitUntil(lambda: len(plots.positions_bars.opts["height"]) == 4, timeout=SETTLE_TIMEOUT_MS)
    assert list(plots.positions_bars.opts["height"]) == [100.0] * 4


def test_fp8_and_prefix_toggles_mid_reply_apply_live_or_at_the_next_request(tiny_bench, qtbot, step_gate):
    bench = tiny_bench
    set_options(bench, qtbot, kv_cache_dtype="auto", enable_prefix_caching=True, max_tokens=12)
    panel = bench.window.settings
    deferred_seen = []

    def toggle_on_first_step(event):
        if event["step"] == 0:
            set_widget(panel.widget("kv_cache_dtype"), "fp8_e4m3")
            set_widget(panel.widget("enable_prefix_caching"), False)
            step_gate.open()

    def note_deferred(settings, applied, deferred):
        deferred_seen.append((dict(deferred), panel.deferred_label.isVisibleTo(panel), panel.deferred_label.text()))
    steps = collect(bench.probe.stepReady)
    bench.probe.stepReady.connect(toggle_on_first_step)
    bench.probe.settingsChanged.connect(note_deferred)
    step_gate.allow(1)          # the reply cannot end before the toggles arrive
    send(bench, qtbot, "Tell me a fact about the sea.")
    bench.probe.stepReady.disconnect(toggle_on_first_step)
    # The cache dtype waits for the reply to end (and the UI says so); prefix caching is live.
    assert ({"kv_cache_dtype": "fp8_e4m3"}, True) in [(d, shown) for d, shown, _ in deferred_seen]
    assert any("Applies when the current reply ends" in text and "KV fp8_e4m3" in text for _, _, text in deferred_seen)
    assert {e["kv_dtype"] for e in steps} == {bench.controller.effective["dtype"]}      # "auto": the model's
    # Steps carry the settings on the first step and when they change: prefix caching went
    # off at the next step (step 1 may already be under way when the toggle arrives).
    prefix_reported = [(e["step"], e["settings"]["enable_prefix_caching"]) for e in steps if e["settings"]]
    assert prefix_reported in ([(0, True), (1, False)], [(0, True), (2, False)]) and len(steps) > 3
    assert not panel.deferred_label.isVisibleTo(panel)
    assert "fp8_e4m3" in panel.effective_label.text() and "<b>Prefix cache</b>: off" in panel.effective_label.text()
    steps.clear()
    done = send(bench, qtbot, "And one about the moon?")
    assert {e["kv_dtype"] for e in steps} == {"fp8_e4m3"}
    assert steps[0]["settings"]["enable_prefix_caching"] is False
    assert all(e["settings"] is None or e["settings"]["enable_prefix_caching"] is False for e in steps)
    assert done["summary"]["prefix_hit_tokens"] == 0
    # On the request axis: the prefix change during request 1, the dtype between 1 and 2.
    assert [(request, label) for _, request, label in bench.history.markers] == [
        (1, "prefix cache off"), (1.5, "KV fp8_e4m3")]
    assert bench.history.markers_added == 2


def test_stop_ends_the_reply_within_a_step_and_keeps_what_was_said(tiny_bench, qtbot, step_gate):
    bench = tiny_bench
    set_options(bench, qtbot, max_tokens=200)
    chat = bench.window.chat
    steps = collect(bench.probe.stepReady)
    stopped_after = []

    def stop_on_second_step(event):
        if event["step"] == 1 and not stopped_after:
            qtbot.keyClick(chat.input, Qt.Key.Key_Escape)
            stopped_after.append(len(steps))
            step_gate.open()
    bench.probe.stepReady.connect(stop_on_second_step)
    step_gate.allow(2)
    done = send(bench, qtbot, "Write a long story about a dragon.")
    assert done["finish_reason"] == "cancelled"
    # The step running when Esc arrived may finish; the one after it does not start.
    assert len(steps) - stopped_after[0] <= 2 and done["summary"]["generated_tokens"] < 10
    assert steps[-1]["finish_reason"] == "cancelled"
    partial = "".join(e["text_delta"] for e in steps)
    assert partial and bench.controller.conversation[-1] == {"role": "assistant", "content": partial}
    assert "stopped" in chat.transcript.toPlainText()
    assert chat.send_button.isEnabled() and not chat.stop_button.isEnabled()


def test_a_message_sent_right_after_new_chat_mid_reply_is_answered(tiny_bench, qtbot, step_gate):
    bench = tiny_bench
    chat, window = bench.window.chat, bench.window
    set_options(bench, qtbot, max_tokens=50)
    errors_after_new_chat = []

    def new_chat_and_send_on_second_step(event):
        if event["step"] == 1 and not step_gate.is_open():
            chat.new_chat_button.click()
            chat.input.setPlainText("Second question")
            qtbot.keyClick(chat.input, Qt.Key.Key_Return, Qt.KeyboardModifier.ControlModifier)   # if Send allows
            step_gate.open()
    bench.probe.stepReady.connect(new_chat_and_send_on_second_step)
    bench.probe.failed.connect(lambda kind, doing, message: errors_after_new_chat.append(message))
    step_gate.allow(2)
    chat.input.setPlainText("First question")
    qtbot.keyClick(chat.input, Qt.Key.Key_Return, Qt.KeyboardModifier.ControlModifier)
    qtbot.waitUntil(lambda: step_gate.is_open() and bench.controller.busy == ""
                    and bench.controller.request_id is None, timeout=REPLY_TIMEOUT_MS)
    assert errors_after_new_chat == [] and not window.error_text()
    if chat.input_text():                   # Send was held back until the old reply ended: send now
        send(bench, qtbot, chat.input_text())
    assert [m["content"] for m in bench.controller.conversation][:1] == ["Second question"]
    assert len(bench.controller.conversation) == 2


def test_an_engine_error_is_shown_and_the_conversation_is_kept(tiny_bench, qtbot):
    bench = tiny_bench
    chat, window = bench.window.chat, bench.window
    send(bench, qtbot, "Hello!")
    conversation = list(bench.controller.conversation)
    too_long = "hello " * 9000                        # more tokens than the model's context
    with qtbot.waitSignal(bench.probe.failed, timeout=REPLY_TIMEOUT_MS) as failed:
        send(bench, qtbot, too_long)
    assert failed.args[0] == GENERATE
    assert "context holds" in window.error_text() and "start a new chat" in window.error_text()
    assert "context holds" in chat.transcript.toPlainText()
    assert bench.controller.conversation == conversation and len(conversation) == 2
    assert chat.input_text() == too_long.strip()      # given back for a retry
    assert chat.send_button.isEnabled()


def test_a_model_that_cannot_load_leaves_the_current_one(tiny_bench, qtbot):
    bench = tiny_bench
    name = bench.window.settings.model_label.text()
    with qtbot.waitSignal(bench.probe.failed, timeout=SETTLE_TIMEOUT_MS) as failed:
        bench.window.settings.modelRequested.emit("/no/such/model")
    assert failed.args[0] == LOAD_MODEL and "model not found: /no/such/model" in failed.args[2]
    assert "/no/such/model" in bench.window.error_text()
    qtbot.waitUntil(lambda: bench.controller.busy == "", timeout=SETTLE_TIMEOUT_MS)
    assert bench.controller.model_ready and bench.window.settings.model_label.text() == name
    assert bench.window.chat.send_button.isEnabled() and not bench.window.progress.isVisible()


def test_a_draft_that_cannot_load_is_reported_and_the_choice_reverts(tiny_bench, qtbot):
    bench = tiny_bench
    panel = bench.window.settings
    with qtbot.waitSignal(bench.probe.failed, timeout=SETTLE_TIMEOUT_MS) as failed:
        panel.choose_draft("/no/such/draft")
    kind, doing, message = failed.args
    assert kind == LOAD_DRAFT and doing == "Loading draft model '/no/such/draft'" and "model not found" in message
    assert "/no/such/draft" in bench.window.error_text()
    assert panel.values()["draft_model"] is None and bench.controller.effective["draft_model"] is None
    qtbot.waitUntil(lambda: bench.controller.busy == "", timeout=SETTLE_TIMEOUT_MS)


# ---- profiles -------------------------------------------------------------------------
def test_ctrl_s_saves_a_profile_that_loads_back_every_setting(tiny_bench, tiny_model, qtbot, monkeypatch):
    bench = tiny_bench
    window, panel = bench.window, bench.window.settings
    set_options(bench, qtbot, proposer="ngram", kv_cache_dtype="fp8_e4m3", enable_prefix_caching=False,
                num_speculative_tokens=6, max_tokens=32, temperature=0.5, seed=7)
    window.chat.set_system_prompt("Be brief.")
    saved_values = panel.values()
    monkeypatch.setattr(window, "ask_profile_name", lambda suggestion="": "mine")
    window.activateWindow()
    qtbot.waitUntil(window.isActiveWindow, timeout=SETTLE_TIMEOUT_MS)
    qtbot.keyClick(window, Qt.Key.Key_S, Qt.KeyboardModifier.ControlModifier)
    path = bench.store.path_for("mine")
    assert path.is_file()
    saved = json.loads(path.read_text())
    assert saved["num_speculative_tokens"] == 6 and saved["version"] == VERSION
    # The settings the panel does not show are kept too.
    assert saved["kv_cache_bytes"] == TINY_POOL_BYTES and saved["model"] == str(tiny_model.folder)
    assert "mine" in window.windowTitle()

    set_options(bench, qtbot, proposer="off", kv_cache_dtype="auto", enable_prefix_caching=True,   # change back
                num_speculative_tokens=4, max_tokens=8, temperature=0.0, seed=None)
    window.chat.set_system_prompt("Something else.")
    window.loadProfileRequested.emit("mine")
    assert panel.values() == saved_values and window.chat.system_prompt() == "Be brief."
    want = {"kv_cache_dtype": "fp8_e4m3", "enable_prefix_caching": False, "proposer": "ngram",
            "num_speculative_tokens": 6}
    qtbot.waitUntil(lambda: all(bench.controller.effective.get(k) == v for k, v in want.items()),
                    timeout=SETTLE_TIMEOUT_MS)
    assert bench.controller.current_profile().kv_cache_bytes == TINY_POOL_BYTES


@pytest.mark.parametrize("content, message", [
    ("{ this is not json", "not valid JSON"),
    (json.dumps({"format": "inference-workbench-profile", "version": 99}), "newer workbench"),
])
def test_a_corrupt_profile_changes_nothing_and_says_why(tiny_bench, qtbot, monkeypatch, tmp_path, content, message):
    bench = tiny_bench
    window, panel = bench.window, bench.window.settings
    set_options(bench, qtbot, kv_cache_dtype="fp8_e4m3", enable_prefix_caching=False)
    values, effective = panel.values(), dict(bench.controller.effective)
    sent = []                                        # what the controller asks of the worker
    for request in ("load_model", "reconfigure", "set_draft_model", "generate"):
        monkeypatch.setattr(bench.host.worker, request, lambda *args, _name=request, **kwargs: sent.append(_name))
    bad = tmp_path / "broken.json"
    bad.write_text(content)
    window.loadProfileRequested.emit(str(bad))
    assert message in window.error_text() and str(bad) in window.error_text()
    assert "nothing was changed" in window.error_text()
    assert panel.values() == values
    assert sent == []                                # no change was sent to the engine
    assert bench.controller.effective == effective


def test_settings_are_saved_as_the_last_session(open_workbench, tiny_profile, tiny_model, qtbot):
    bench = open_workbench(tiny_profile(ngram_max=3), start=False)
    set_widget(bench.window.settings.widget("top_k"), 40)
    qtbot.waitUntil(lambda: getattr(bench.store.load_last_session(), "top_k", None) == 40, timeout=SETTLE_TIMEOUT_MS)
    session = bench.store.load_last_session()
    assert (session.model, session.kv_cache_bytes, session.ngram_max) == (str(tiny_model.folder), TINY_POOL_BYTES, 3)


def test_the_next_start_restores_the_last_session(open_workbench, tiny_profile, tiny_model, qtbot):
    bench = open_workbench(tiny_profile())
    set_options(bench, qtbot, num_speculative_tokens=9, kv_cache_dtype="fp8_e4m3")
    bench.window.chat.set_system_prompt("Restored prompt.")
    bench.window.close()                      # closing saves the session
    reopened = open_workbench(store=bench.store, start=False, show=False)
    values = reopened.window.settings.values()
    assert values["num_speculative_tokens"] == 9 and values["kv_cache_dtype"] == "fp8_e4m3"
    assert reopened.window.chat.system_prompt() == "Restored prompt."
    profile = reopened.controller.current_profile()
    assert profile.model == str(tiny_model.folder) and profile.kv_cache_bytes == TINY_POOL_BYTES


def test_profile_option_starts_from_that_profile(open_workbench, tmp_path):
    path = ProfileStore(tmp_path / "elsewhere").save(SessionProfile(name="fast", proposer="ngram",
                                                                    num_speculative_tokens=5))
    started = open_workbench(profile_path=str(path), start=False, show=False)
    assert started.window.settings.values()["proposer"] == "ngram"
    assert started.window.settings.values()["num_speculative_tokens"] == 5
    assert "fast" in started.window.windowTitle()


def test_a_broken_profile_option_starts_with_defaults_and_says_why(open_workbench, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    started = open_workbench(profile_path=str(bad), start=False, show=False)
    assert "not valid JSON" in started.window.error_text() and "default settings" in started.window.error_text()
    assert started.window.settings.values()["proposer"] == "off"


# ---- exports --------------------------------------------------------------------------
def test_plots_export_as_png_and_metrics_as_csv(tiny_bench, qtbot, tmp_path):
    bench = tiny_bench
    send(bench, qtbot, "Hello!")
    send(bench, qtbot, "Again!")
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
    assert len(requests) == bench.history.num_requests == 2 and float(requests[0]["ttft_ms"]) > 0


# ---- threads ----------------------------------------------------------------------------
def test_the_gui_thread_never_runs_the_engine(tiny_bench, qtbot, monkeypatch, step_gate):
    """Forward passes, reconfiguring and draft loading all happen on the worker thread,
    even when the user toggles settings and stops mid-reply."""
    from engine.engine import LLMEngine
    from engine.runtime.model_runner import ModelRunner
    from engine.stream import RequestStream
    bench = tiny_bench
    threads = []

    def record(original):
        def wrapper(*args, **kwargs):
            threads.append(threading.current_thread())
            return original(*args, **kwargs)
        return wrapper
    for cls, name in ((ModelRunner, "forward_batch"), (LLMEngine, "reconfigure"), (LLMEngine, "set_draft_model"),
                      (LLMEngine, "start"), (LLMEngine, "settings"), (LLMEngine, "step"), (RequestStream, "step")):
        monkeypatch.setattr(cls, name, record(getattr(cls, name)))
    gui_updates = []      # and the other way round: widgets are only touched on the GUI thread
    chat = bench.window.chat
    original_append = chat.append_segments
    monkeypatch.setattr(chat, "append_segments",
                        lambda segments: (gui_updates.append(threading.current_thread()), original_append(segments)))
    panel = bench.window.settings

    def meddle(event):
        if event["step"] == 1:
            panel.widget("enable_prefix_caching").toggle()
            set_widget(panel.widget("num_speculative_tokens"), 3)
            set_widget(panel.widget("draft_model"), "self")
            bench.controller.stop()
            step_gate.open()
    bench.probe.stepReady.connect(meddle)
    set_options(bench, qtbot, max_tokens=16)
    step_gate.allow(2)
    send(bench, qtbot, "Hello!")
    qtbot.waitUntil(lambda: bench.controller.busy == "" and bench.controller.effective.get("draft_model") == "self",
                    timeout=SETTLE_TIMEOUT_MS)
    assert len(threads) > 5
    assert threading.main_thread() not in threads
    assert {t.name for t in threads} and all(t is threads[0] for t in threads)     # one worker thread
    assert gui_updates and set(gui_updates) == {threading.main_thread()}


def test_the_engine_runs_with_the_headless_thread_count(open_workbench, tiny_profile, monkeypatch, tmp_path):
    """The app's engine gets the torch threads a script's engine gets (the main thread's
    default), not one fewer; OMP_NUM_THREADS, the user's choice, still wins."""
    import torch
    default = torch.get_num_threads()
    assert open_workbench(tiny_profile()).controller.effective["threads"] == default
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    chosen = open_workbench(tiny_profile(), store=ProfileStore(tmp_path / "fewer"))
    assert chosen.controller.effective["threads"] == 1


def test_compile_on_builds_the_step_at_load_so_the_first_reply_times_no_compile(open_workbench, tiny_profile, qtbot):
    bench = open_workbench(tiny_profile(compile="on", max_tokens=6))
    messages = [m for m, _ in bench.progress_log]
    assert any("compiling the model's step" in m for m in messages)      # at load, with progress
    assert bench.controller.effective["compile"] == "on"
    steps = collect(bench.probe.stepReady)
    send(bench, qtbot, "Hello!")
    decode = [s for s in steps if s["ttft_s"] is None]
    assert decode and all(s["compile_s"] == 0 for s in decode) and all(s["step_tok_s"] for s in decode)
    # A new KV dtype takes the same graph (the cache never enters it): nothing compiles again.
    compiles = sum("compiling the model's step" in m for m, _ in bench.progress_log)
    set_options(bench, qtbot, kv_cache_dtype="fp8_e4m3")
    qtbot.waitUntil(lambda: bench.controller.busy == "", timeout=SETTLE_TIMEOUT_MS)
    assert sum("compiling the model's step" in m for m, _ in bench.progress_log) == compiles
    del steps[:]
    send(bench, qtbot, "Hello again!")
    assert steps and all(s["compile_s"] == 0 for s in steps) and steps[-1]["kv_dtype"] == "fp8_e4m3"
    assert "compile not counted" not in bench.window.chat.transcript.toPlainText()
    assert not bench.window.progress.isVisible()


# ---- the metrics history behind the plots (no Qt needed) -----------------------------------
class FakeRequest:
    """Step events as the worker emits them, without a model: real StepEvents with their
    request's aggregates (engine.metrics.RequestStats), as_dict()."""

    def __init__(self):
        from engine.metrics import RequestStats
        self.stats = RequestStats(prompt_tokens=10)
        self.kv_dtype = None        # from the settings last sent (a step sends them only on a change)

    def step(self, step: int, settings: dict | None = None, proposed: int = 0, accepted: int = 0,
             step_time_s: float = 0.05, compile_s: float = 0.0, tree: tuple[int, int, float] | None = None) -> dict:
        """`tree`: (nodes verified, depth tried, predicted accepted) of a draft tree's step;
        `accepted` is then its accepted path, tried depth by depth up to a failure."""
        from engine.metrics import ACCEPTED, BONUS, RESAMPLED, TARGET, StepEvent
        nodes, depth, predicted = tree or (0, proposed, None)
        proposed = nodes or proposed
        kinds = [ACCEPTED] * accepted + [BONUS if accepted == depth else RESAMPLED] if proposed else [TARGET]
        self.kv_dtype = settings["kv_cache_dtype"] if settings else self.kv_dtype
        event = StepEvent(
            step=step, token_ids=[1] * len(kinds), token_kinds=kinds, pieces=[("x" * len(kinds), TARGET)],
            time_s=0.1 * (step + 1), step_time_s=step_time_s, target_time_s=0.04, draft_time_s=0.01 if proposed else 0.0,
            target_passes=1, proposed=proposed, accepted=accepted,
            accepted_per_position=[True] * accepted + ([False] if accepted < depth else []),
            kv_bytes_used=2**20, kv_bytes_capacity=2**29, kv_bytes_per_token=2**10, kv_dtype=self.kv_dtype,
            prefix_hit_tokens=0, prompt_tokens=10, generated_tokens=self.stats.generated_tokens + len(kinds),
            ttft_s=0.2 if step == 0 else None, settings=settings, compile_s=compile_s, tree_nodes=nodes,
            tree_predicted_accepted=predicted)
        self.stats.record_step(event)
        event.running = self.stats.as_dict()
        return event.as_dict()


def test_a_compiling_step_is_marked_on_the_decode_plot_and_left_out_of_the_running_line():
    import numpy as np
    from app.formatting import message_stats
    from app.metrics_history import MetricsHistory
    history, reply = MetricsHistory(), FakeRequest()
    history.record_step(reply.step(0, {"kv_cache_dtype": "float32"}))
    history.record_step(reply.step(1, step_time_s=40.0, compile_s=39.9))        # compiled mid-reply
    for i in range(2, 6):
        history.record_step(reply.step(i))                                     # 0.05 s a token
    tok_s, marked = history.step_series("tok_s"), history.step_series("compile_tok_s")
    assert np.isnan(tok_s[1]) and marked[1] == pytest.approx(1 / 40.0)         # a marker, not a speed point
    assert np.isnan(marked[[0, 2, 3, 4, 5]]).all() and tok_s[2:] == pytest.approx([20.0] * 4)
    assert history.step_series("running_tok_s")[2:] == pytest.approx([20.0] * 4)    # the compile is not in it
    assert list(history.step_series("compile_s")) == [0.0, 39.9, 0.0, 0.0, 0.0, 0.0]
    line = message_stats(reply.stats.as_dict(), "length")
    assert "decode 20.0 tok/s (a 40.0 s compile not counted)" in line


def test_history_marks_setting_changes_and_resets_per_position_on_new_speculation():
    from app.metrics_history import MetricsHistory
    history = MetricsHistory()
    plain = {"kv_cache_dtype": "float32", "enable_prefix_caching": True, "proposer": "off",
             "num_speculative_tokens": 4, "draft_model": None}
    spec = plain | {"proposer": "ngram"}
    first = FakeRequest()
    history.record_step(first.step(0, plain))
    history.record_step(first.step(1))                          # no change: no settings sent
    history.record_step(first.step(2, spec, proposed=4, accepted=2))
    history.record_step(first.step(3, spec | {"kv_cache_dtype": "fp8_e4m3"}, proposed=4, accepted=4))
    assert [(x, label) for x, _, label in history.markers] == [(1.5, "spec ngram"), (2.5, "KV fp8_e4m3")]
    assert list(history.per_position_acceptance()) == [1.0, 1.0, 0.5, 1.0]
    acceptance = history.step_series("acceptance")
    assert list(acceptance[2:]) == [0.5, 1.0] and all(a != a for a in acceptance[:2])    # NaN: nothing proposed
    assert list(history.step_series("running_acceptance")[2:]) == [0.5, 0.75]
    assert list(history.step_series("is_fp8")) == [0, 0, 0, 1]
    assert [label["proposer"] for label in history.step_labels] == ["off", "off", "ngram", "ngram"]
    history.record_step(FakeRequest().step(0, spec | {"num_speculative_tokens": 2, "kv_cache_dtype": "fp8_e4m3"}))
    assert history.markers[-1][1:] == (1.5, "k=2")       # between request 1 and request 2
    assert len(history.per_position_acceptance()) == 0      # a new set-up starts a new tally
    eagle = spec | {"num_speculative_tokens": 2, "kv_cache_dtype": "fp8_e4m3", "proposer": "eagle",
                    "eagle_head": "shipped", "draft_tree": "4:6:24"}
    history.record_step(FakeRequest().step(0, eagle))
    assert history.markers[-1][2] == "spec eagle (shipped), tree 4:6:24"


def test_a_draft_tree_plots_its_accepted_path_and_nodes_against_the_budget(qtbot):
    import numpy as np
    from app.metrics_history import MetricsHistory
    from app.plots_panel import PlotsPanel
    history, nan = MetricsHistory(), float("nan")
    chain = {"kv_cache_dtype": "float32", "enable_prefix_caching": True, "proposer": "eagle",
             "num_speculative_tokens": 4, "draft_model": None, "draft_tree": "off"}
    reply = FakeRequest()
    history.record_step(reply.step(0, chain))
    history.record_step(reply.step(1, proposed=4, accepted=2))
    history.record_step(reply.step(2, chain | {"draft_tree": "4:6:24"}, accepted=3, tree=(24, 6, 1.5)))  # mid-reply
    history.record_step(reply.step(3, accepted=0, tree=(17, 6, 0.4)))      # the policy verified 17 of 24
    history.record_step(reply.step(4))                                      # nor a tree nor a chain
    assert [(x, label) for x, _, label in history.markers] == [(1.5, "tree 4:6:24")]
    np.testing.assert_equal(history.step_series("tree_accepted_path"), [nan, nan, 3, 0, nan])
    np.testing.assert_equal(history.step_series("tree_nodes"), [0, 0, 24, 17, 0])
    np.testing.assert_equal(history.step_series("tree_predicted"), [nan, nan, 1.5, 0.4, nan])
    np.testing.assert_equal(history.step_series("tree_node_budget"), [nan, nan, 24, 24, 24])
    np.testing.assert_equal(history.step_series("tree_depth"), [nan, nan, 6, 6, 6])
    # The tree change started the per-position counts again: now acceptance by depth.
    assert list(history.per_position_acceptance()) == [0.5, 1.0, 1.0, 0.0]
    panel = PlotsPanel(history)
    qtbot.addWidget(panel)         # closed and deleted with the test (a panel left to exit crashed Qt)
    panel.refresh()
    for item, (x, y) in ((panel.tree_path_points, ([2, 3], [3, 0])), (panel.tree_nodes_points, ([2, 3], [24, 17])),
                         (panel.tree_predicted_points, ([2, 3], [1.5, 0.4])),
                         (panel.tree_budget_curve, ([0, 1, 2, 3, 4], [nan, nan, 24, 24, 24])),
                         (panel.tree_depth_curve, ([0, 1, 2, 3, 4], [nan, nan, 6, 6, 6]))):
        np.testing.assert_equal(item.getData(), (x, y))
    # Acceptance per step is the chain's: 2 accepted of 24 nodes would read as a failure.
    np.testing.assert_equal(panel.acceptance_points.getData(), ([1], [50.0]))
    assert "Draft tree nodes — 4:6:24" in panel.tree_nodes_plot.titleLabel.text
    assert "Acceptance rate (chains)" in panel.acceptance_title.text
    assert panel.positions_plot.titleLabel.text == "Acceptance by depth"
    assert panel.positions_plot.getAxis("bottom").labelText == "tree depth"
    assert "tree 4:6:24" in [line.label.toPlainText() for plot, line in panel._marker_lines
                             if plot is panel.tree_nodes_plot]
    history.record_step(FakeRequest().step(0, chain))                       # back to a chain
    panel.refresh()
    assert history.markers[-1][2] == "tree off" and len(history.per_position_acceptance()) == 0
    assert panel.positions_plot.titleLabel.text == "Per-position acceptance"
    assert "Draft tree nodes — off" in panel.tree_nodes_plot.titleLabel.text


def test_the_draft_tree_control_offers_presets_and_takes_a_typed_shape(qtbot):
    from app.settings_panel import SettingsPanel
    panel = SettingsPanel()
    qtbot.addWidget(panel)
    combo, emitted = panel.widget("draft_tree"), []
    panel.engineSettingChanged.connect(lambda key, value: emitted.append((key, value)))
    assert [combo.itemData(i) for i in range(combo.count())] == ["off", "auto", "4:6:24"]
    combo.setCurrentIndex(combo.findData("auto"))
    combo.lineEdit().setText("8:7:60")
    combo.lineEdit().returnPressed.emit()
    assert emitted == [("draft_tree", "auto"), ("draft_tree", "8:7:60")]
    assert panel.values()["draft_tree"] == "8:7:60"


def test_ring_buffer_keeps_the_newest_values_in_order():
    from app.metrics_history import RingBuffer
    ring = RingBuffer(4)
    for v in range(7):
        ring.append(v)
    assert list(ring.values()) == [3, 4, 5, 6] and len(ring) == 4


def test_void_qt_calls_keep_none_referenced():
    """PySide6 6.12.0 on Python 3.11 loses a reference to None per void call, which aborts a
    long session ("none_dealloc"); pyproject pins below it. This fails on such bindings."""
    probe = QObject()
    before = sys.getrefcount(None)
    for _ in range(5_000):
        probe.setObjectName("x")
    assert before - sys.getrefcount(None) < 100


def test_signals_carrying_true_keep_it_referenced():
    """The same bindings lose a reference to True per bool a signal delivers."""
    class Emitter(QObject):
        flag = Signal(bool)
    emitter, received = Emitter(), []
    emitter.flag.connect(received.append)
    before = sys.getrefcount(True)
    for _ in range(5_000):
        emitter.flag.emit(True)
    assert len(received) == 5_000 and before - sys.getrefcount(True) < 100

