"""The load panel's controller: Start / Stop / Run A/B go to the engine worker (which drives
the engine on its own thread), the worker's load steps and finished runs go into the
LoadHistory the panel draws, and a setting changed during a run leaves a marker.

It never calls the engine. The main controller keeps the chat, settings and profiles; it
asks this one only for the workload to save (and shows the saved one here).
"""
from __future__ import annotations

from PySide6.QtCore import QObject

from app.engine_worker import EngineWorker
from app.load_history import LoadHistory
from app.load_panel import CURRENT, LoadPanel
from app.metrics_history import describe_change
from app.results_table import export_csv
from engine.profiles import ProfileError


class LoadController(QObject):
    def __init__(self, controller, worker: EngineWorker, panel: LoadPanel, history: LoadHistory):
        super().__init__(controller)
        self.controller, self.worker, self.panel, self.history = controller, worker, panel, history
        self.running = False
        self.ab = False
        self.runs_started = 0
        panel.startRequested.connect(self.start)
        panel.stopRequested.connect(self.stop)
        panel.abRequested.connect(self.run_ab)
        panel.exportCsvRequested.connect(self.export_csv)
        panel.clearResultsRequested.connect(self.clear_results)
        panel.selectionChanged.connect(self.compare)
        panel.workloadEdited.connect(controller._settings_edited)
        worker.loadStep.connect(self._on_step)
        worker.loadArmStarted.connect(self._on_arm_started)
        worker.loadDone.connect(self._on_run_done)
        worker.loadFinished.connect(self._on_finished)
        worker.settingsChanged.connect(self._on_settings_changed)

    def _on_step(self, step: dict) -> None:
        """A load step into the history, on the GUI thread (this object's): connected to the
        plain history, the worker's signal ran record_step on the worker's thread while the
        panel read the history (a curve's x and y read a row apart: "X and Y arrays must be
        the same shape--got (17,) and (18,)", seen in CI)."""
        self.history.record_step(step)

    # ---- intents -----------------------------------------------------------------------
    def start(self, workload) -> None:
        if workload is None or self.running or not self._ready():
            return
        self.runs_started += 1
        self._begin(workload, [{"label": f"run {self.runs_started}", "settings": None}], None, ab=False)

    def run_ab(self, name_a: str, name_b: str) -> None:
        workload = self.panel.workload_or_none()
        if workload is None or self.running or not self._ready():
            return
        try:
            profiles = [self._profile(name) for name in (name_a, name_b)]
        except ProfileError as exc:
            self.controller.window.show_error(f"Run A/B: {exc}")
            return
        current = self.controller.current_profile()
        arms = [{"label": f"{side}: {name}", "settings": p.engine_settings()}
                for side, name, p in (("A", name_a, profiles[0]), ("B", name_b, profiles[1]))]
        other_models = sorted({p.model for p in profiles if p.model != current.model})
        if other_models:
            self.panel.show_status(f"A/B takes each profile's engine settings on the loaded model "
                                   f"({current.model}), not {', '.join(other_models)}")
        self._begin(workload, arms, current.engine_settings(), ab=True)

    def stop(self) -> None:
        if self.running:
            self.worker.stop_load()
            self.panel.show_status("Stopping: every request ends at the next step…")

    def _begin(self, workload, arms: list[dict], restore: dict | None, ab: bool) -> None:
        self.running, self.ab = True, ab
        self.history.clear_series()
        self.panel.set_running(True)
        self.panel.show_status(f"Serving {workload.num_prompts} requests at {workload.max_concurrency} at once"
                               + (" for each of A, B, B, A" if ab else "") + "…")
        self.worker.start_load(workload, arms, restore)
        self.controller._settings_edited()         # the workload is saved with the session

    def _ready(self) -> bool:
        if not self.controller.model_ready:
            self.panel.show_status("Load a model first.")
        elif self.controller.busy_reason:               # a quality measurement runs alone
            self.panel.show_status(self.controller.busy_reason)
            return False
        return self.controller.model_ready

    def _profile(self, name: str):
        return self.controller.current_profile() if name == CURRENT else self.controller.store.load(name)

    # ---- results ---------------------------------------------------------------------------
    def _on_arm_started(self, info: dict) -> None:
        if self.ab:
            self.history.mark(info["t"], info["arm"])

    def _on_settings_changed(self, settings: dict, applied: dict, deferred: dict) -> None:
        """A setting the user changed during a run: a marker where it took effect (A/B arms mark themselves)."""
        if self.running and not self.ab and applied:
            self.history.mark(None, ", ".join(describe_change(k, v, settings) for k, v in applied.items()))

    def _on_run_done(self, row: dict) -> None:
        done = self.history.add_row(row)
        self.panel.refresh()
        stopped = " (stopped)" if row["stopped"] else ""
        self.controller.window.show_message(f"{row['label']}{stopped}: {len(done['stats'])} requests finished")

    def _on_finished(self, stopped: bool) -> None:
        self.running = False
        self.panel.set_running(False)
        self.panel.show_status("Stopped: every request ended." if stopped else "Done: a row per run below.")

    def compare(self, numbers: list[int]) -> None:
        if len(numbers) != 2:
            self.panel.show_comparison(None, None, None)
            return
        a, b = (next(r for r in self.history.rows if r["number"] == n) for n in numbers)
        self.panel.show_comparison(a, b, self.history.compare(a, b))

    def clear_results(self) -> None:
        self.history.rows.clear()
        self.history.version += 1
        self.panel.show_comparison(None, None, None)

    def export_csv(self, path: str) -> None:
        export_csv(self.controller.window, self.history, path, "load results")
