"""The quality panel's controller: Measure / Stop go to the engine worker (which runs the
measurement on its own thread, a piece at a time), each measured configuration goes into the
QualityHistory the panel draws, and profiles carry their measured quality.

While a measurement runs the chat's Send is refused with the reason (the main controller's
`busy_reason`, kept up to date with the time left), and a setting the user changes waits for
the run's end (the worker defers it); the status line says so. It never calls the engine.
"""
from __future__ import annotations

import time
from html import escape

from PySide6.QtCore import QObject

from app.engine_worker import EngineWorker
from app.metrics_history import describe_change
from app.quality_history import FROM_PROFILE, QualityHistory, session_snapshot
from app.quality_panel import CURRENT, QualityPanel
from app.results_table import export_csv
from engine.profiles import ProfileError

CURRENT_LABEL = "current settings"
LOAD_TIME_LOSSY = ("dtype", "weight_dtype")     # load-time settings a configuration may differ in


class QualityController(QObject):
    def __init__(self, controller, worker: EngineWorker, panel: QualityPanel, history: QualityHistory, load=None):
        super().__init__(controller)
        self.controller, self.worker, self.panel, self.history, self.load = controller, worker, panel, history, load
        self.running = False
        self.tokens: int | None = None          # scored tokens of the shipped text (None: engine.quality's default)
        self.pending: dict[str, tuple[dict, bool]] = {}     # label -> (session snapshot, measures the current settings)
        self.deferred: dict = {}                # settings changed during the run
        self.measured = 0                       # configurations of this run measured so far
        self.started_s = 0.0
        panel.measureRequested.connect(self.measure)
        panel.stopRequested.connect(self.stop)
        panel.exportPngRequested.connect(self.export_png)
        panel.exportCsvRequested.connect(self.export_csv)
        panel.clearRequested.connect(self.clear)
        worker.qualityProgress.connect(self._on_progress)
        worker.qualityResult.connect(self._on_result)
        worker.qualityFinished.connect(self._on_finished)
        worker.settingsChanged.connect(self._on_settings_changed)
        controller.profileShown.connect(self.show_profile_quality)
        self.show_profile_quality(controller.profile)

    # ---- intents -----------------------------------------------------------------------
    def measure(self, names: list[str], include_chat: bool) -> None:
        refusal = self._refusal(names)
        if refusal:
            self.panel.show_status(refusal)
            return
        try:
            configurations = [self._configuration(name) for name in names]
        except ProfileError as exc:
            self.controller.window.show_error(f"Measuring quality: {exc}")
            return
        chat = self.controller.messages() if include_chat and self.controller.conversation else None
        self.pending = {c["label"]: (snapshot, current) for c, snapshot, current in configurations}
        self.running, self.deferred, self.measured, self.started_s = True, {}, 0, time.monotonic()
        self.controller.busy_reason = running_reason(0.0, 0.0)
        self.panel.set_running(True)
        self.panel.show_progress("starting…", 0.0)
        note = "" if chat or not include_chat else " (no chat yet: the shipped text only)"
        self.panel.show_status(f"Measuring {len(configurations)} configuration{'s' * (len(configurations) > 1)} "
                               f"against the reference{note}. The chat waits; a setting you change applies after.")
        self.worker.start_quality([c for c, _, _ in configurations], chat, self.tokens)

    def _refusal(self, names: list[str]) -> str:
        """Why Measure cannot start now ("" when it can)."""
        if self.running:
            return "A measurement is running."
        if not self.controller.model_ready:
            return "Load a model first."
        if self.controller.request_id is not None:
            return "A reply is being generated: wait for it to end (or Stop it), then Measure."
        if self.load is not None and self.load.running:
            return "A load test is running: wait for it to end (or Stop it), then Measure."
        if not names:
            return "Tick at least one configuration to measure."
        return ""

    def _configuration(self, name: str) -> tuple[dict, dict, bool]:
        """({"label", "settings"} for the worker, the session's engine settings it measures,
        whether those are the current settings)."""
        current = self.controller.current_profile()
        snapshot = session_snapshot(current)
        if name == CURRENT:
            return {"label": CURRENT_LABEL, "settings": {}}, snapshot, True
        profile = self.controller.store.load(name)
        settings = profile.engine_settings()
        settings |= {k: getattr(profile, k) for k in LOAD_TIME_LOSSY if getattr(profile, k) != getattr(current, k)}
        measured = snapshot | settings
        return {"label": name, "settings": settings}, measured, measured == snapshot

    def stop(self) -> None:
        if self.running:
            self.worker.stop_quality()
            self.panel.show_status("Stopping after the current piece of work…")

    def clear(self) -> None:
        self.history.clear()
        self.panel.refresh()

    # ---- what the worker reports -----------------------------------------------------------
    def _on_progress(self, message: str, fraction: float) -> None:
        if not self.running:
            return
        self.panel.show_progress(message, fraction)
        self.controller.busy_reason = running_reason(fraction, time.monotonic() - self.started_s)

    def _on_result(self, row: dict) -> None:
        snapshot, current = self.pending.get(row.get("label"), ({}, False))
        done = self.history.add_row(row, snapshot, current)
        self.measured += 1
        self.panel.refresh()
        self.controller.window.show_message(f"{done['label']}: {done.get('summary', '')}")

    def _on_settings_changed(self, settings: dict, applied: dict, deferred: dict) -> None:
        if self.running and deferred:
            self.deferred.update(deferred)
            changes = ", ".join(describe_change(k, v) for k, v in self.deferred.items())
            self.controller.panel.show_deferred(f"⏳ Applies when the quality measurement ends: {escape(changes)}")
            self.panel.show_status(f"Changed during the measurement: {changes}. It applies when the measurement "
                                   "ends (the run measures the settings it started with).")

    def _on_finished(self, stopped: bool, error: str) -> None:
        was_running, self.running = self.running, False
        self.controller.busy_reason = ""
        self.panel.set_running(False)
        self.controller.settle_deferred()
        if error:
            self.controller.window.show_error(f"Measuring quality: {error}")
        if not was_running:
            text = f"Not started: {error}" if error else "Not started."
        elif error:
            text = f"Failed: {error}"
        elif stopped:
            text = f"Stopped: {self.measured} of {len(self.pending)} measured; the engine is back on its settings."
        else:
            text = "Done: a row per configuration below; the plot marks the Pareto front."
        if self.deferred:
            text += " Now applied: " + ", ".join(describe_change(k, v) for k, v in self.deferred.items()) + "."
        self.panel.show_status(text)
        if not error and was_running:
            self.panel.show_progress("", 1.0 if not stopped else self.panel.progress.value() / 1000)

    # ---- profiles ----------------------------------------------------------------------------
    def show_profile_quality(self, profile) -> None:
        """A profile shown (loaded, or the session's at start): the quality it carries, as a row."""
        self.history.drop_from_profile()
        quality = getattr(profile, "quality", None)
        if quality:
            self.history.add_row(dict(quality, label=profile.name), session_snapshot(profile), current=False,
                                 origin=FROM_PROFILE)
        self.panel.refresh()

    # ---- exports -----------------------------------------------------------------------------
    def export_png(self, path: str) -> None:
        if self.panel.save_png(path):
            self.controller.window.show_message(f"Saved the quality plot to {path}")
        else:
            self.controller.window.show_error(f"Could not write {path}: choose a writable folder and a .png name")

    def export_csv(self, path: str) -> None:
        export_csv(self.controller.window, self.history, path, "quality results")


def running_reason(fraction: float, elapsed_s: float) -> str:
    """What the chat says when a message is sent during a measurement: the time left, from the
    pace so far."""
    if fraction < 0.02:
        left = "in a while"
    else:
        seconds = elapsed_s * (1 - fraction) / fraction
        left = f"in about {seconds:.0f} s" if seconds < 90 else f"in about {seconds / 60:.0f} min"
    return f"Quality measurement running: it ends {left}, or Stop it in the Quality tab."
