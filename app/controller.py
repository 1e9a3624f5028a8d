"""The controller: wires the window's intents to the engine worker, the profile store and
the metrics history, and the worker's results back to the window.

It never calls the engine: every engine request goes through EngineWorker, whose
methods are safe to call from this (the GUI) thread.
"""
from __future__ import annotations

from dataclasses import asdict, fields, replace

from PySide6.QtCore import QObject, QTimer, Signal

from app.engine_worker import (GENERATE, GENERATING, IDLE, LOAD_DRAFT, LOAD_MODEL, LOADING, LOADING_DRAFT, MEASURING,
                               EngineWorker, ServerModelLister)
from app.formatting import describe_deferred, describe_settings, message_stats
from app.main_window import MainWindow
from app.metrics_history import MetricsHistory
from app.quality_history import session_snapshot
from engine import config
from engine.errors import WorkbenchError
from engine.profiles import ProfileError, ProfileStore, SessionProfile, builtin_profiles

UNNAMED = ("untitled", "last_session")
# Where the session's model runs: the load-time session settings other than the local model.
CONNECTION_KEYS = tuple(k for k in config.keys(config.SESSION, applies=(config.LOAD,)) if k != "model")
BUSY_TEXT = {IDLE: "Ready", LOADING: "Loading model…", GENERATING: "Generating…",
             LOADING_DRAFT: "Loading draft model…", MEASURING: "Measuring quality…"}
SAVE_SESSION_DELAY_MS = 400     # typing in the system prompt saves once, not per key


class Controller(QObject):
    profileShown = Signal(object)               # a SessionProfile now shown (loaded, or the session's at start)

    def __init__(self, window: MainWindow, worker: EngineWorker, store: ProfileStore,
                 history: MetricsHistory, profile: SessionProfile, model_lister: ServerModelLister):
        super().__init__(window)
        self.window, self.worker, self.store, self.history = window, worker, store, history
        self.model_lister = model_lister
        self.chat, self.panel = window.chat, window.settings
        self.profile_name = profile.name
        self.profile = profile                  # keeps the settings the panel does not show
        self.model_reference = profile.model
        self.conversation: list[dict] = []
        self.request_id: int | None = None      # the reply being generated
        self.reply_parts: list[str] = []
        self.reply_speculation: dict | None = None     # the reply's speedup report so far
        self.model_ready = False
        self.busy = IDLE
        self.effective: dict = {}               # engine.settings() as last reported
        self.deferred: dict = {}                # changes waiting for the running reply to end
        self.busy_reason = ""                   # why a message cannot be sent now (a quality measurement runs)
        self._save_timer = QTimer(self, singleShot=True, interval=SAVE_SESSION_DELAY_MS)
        self._save_timer.timeout.connect(self.save_last_session)
        self._connect_window()
        self._connect_worker()
        self._connect_model_list()
        self._show_profile(profile)

    def _connect_window(self) -> None:
        self.chat.sendRequested.connect(self.send)
        self.chat.stopRequested.connect(self.stop)
        self.chat.newChatRequested.connect(self.new_chat)
        self.chat.systemPromptEdited.connect(self._settings_edited)
        self.panel.engineSettingChanged.connect(self.change_engine_setting)
        self.panel.draftModelChosen.connect(self.choose_draft_model)
        self.panel.samplingChanged.connect(self._settings_edited)
        self.panel.modelRequested.connect(self.load_model)
        self.panel.serverRequested.connect(self.connect_server)
        w = self.window
        w.saveProfileRequested.connect(self.save_profile)
        w.saveProfileAsRequested.connect(self.save_profile_as)
        w.loadProfileRequested.connect(self.load_profile)
        w.deleteProfileRequested.connect(self.delete_profile)
        w.plots.exportPngRequested.connect(self.export_png)
        w.plots.exportCsvRequested.connect(self.export_csv)
        w.plots.clearRequested.connect(self.history.clear)
        w.closing.connect(self.save_last_session)

    def _connect_worker(self) -> None:
        wk = self.worker
        wk.loadProgress.connect(self.window.show_progress)
        wk.modelLoaded.connect(self._on_model_loaded)
        wk.stepReady.connect(self._on_step)
        wk.requestDone.connect(self._on_request_done)
        wk.settingsChanged.connect(self._on_settings_changed)
        wk.failed.connect(self._on_failed)
        wk.busyChanged.connect(self._on_busy)

    def _connect_model_list(self) -> None:
        """The Connect dialog asks which models a server serves; the lister's answer goes back to it."""
        dialog = self.panel.connect_dialog
        dialog.modelsRequested.connect(self.model_lister.list_models)
        self.model_lister.listed.connect(dialog.show_models)
        self.model_lister.listFailed.connect(dialog.show_models_error)

    # ---- start -------------------------------------------------------------------
    def start(self) -> None:
        """Load the profile's model with the profile's settings, or connect to its server."""
        p = self.profile
        if p.backend == "remote" and p.server_url:
            self.connect_server(p.server_url, p.server_model or "", p.api_key_env or "")
        else:
            self.load_model(self.model_reference)

    def load_model(self, reference: str) -> None:
        self.window.show_progress(f"loading {reference}", 0.0)
        if not self.model_ready:
            self.panel.show_model(f"loading {reference}…")
        self.worker.load_model(reference, self.current_profile(model=reference).engine_config())

    def connect_server(self, url: str, model: str, api_key_env: str) -> None:
        """Drive a remote server; api_key_env is a variable's name, the key stays in the environment."""
        self.window.show_progress(f"connecting to {url}", 0.0)
        if not self.model_ready:
            self.panel.show_model(f"connecting to {url}…")
        self.worker.connect_server(url, model, api_key_env)

    # ---- chat --------------------------------------------------------------------
    def send(self, text: str) -> None:
        text = text.strip()
        if not text or not self.model_ready or self.request_id is not None:
            return
        if self.busy_reason:
            self.window.show_message(self.busy_reason)      # the message stays in the box
            return
        try:
            params = self.current_profile().sampling_params()
        except WorkbenchError as exc:
            self.window.show_error(f"Sampling settings: {exc}")
            return
        self.window.clear_error()
        self.conversation.append({"role": "user", "content": text})
        self.chat.set_input_text("")
        self.chat.add_user_message(text)
        self.chat.begin_assistant_message()
        self.reply_parts = []
        self.reply_speculation = None
        self.request_id = self.worker.generate(self.messages(), params)
        self._refresh_state()

    def messages(self) -> list[dict]:
        system = self.chat.system_prompt().strip()
        return ([{"role": "system", "content": system}] if system else []) + self.conversation

    def stop(self) -> None:
        if self.request_id is not None:
            self.worker.cancel()
            self.window.show_message("Stopping after the current step…")

    def new_chat(self) -> None:
        self.stop()
        self.request_id = None          # late events of a stopped reply are ignored
        self.conversation.clear()
        self.chat.clear_transcript()
        self._refresh_state()

    def _on_step(self, event: dict) -> None:
        """Per token: append the text and store the numbers; the plots redraw on their timer."""
        if event["request_id"] != self.request_id:
            return
        self.chat.append_segments(event["pieces"])
        self.reply_parts.append(event["text_delta"])
        self.reply_speculation = event["speculation"] or self.reply_speculation
        self.history.record_step(event)
        if event["settings"] is not None:         # only when a setting changed
            self._show_effective(event["settings"])

    def _on_request_done(self, done: dict) -> None:
        if done["request_id"] != self.request_id:
            return
        self.request_id = None
        self.history.record_request(done)
        reply = "".join(self.reply_parts)
        if reply:
            self.conversation.append({"role": "assistant", "content": reply})
        elif done["finish_reason"] == "error":
            self._return_unanswered_message()
        self.chat.finish_assistant_message(message_stats(done["summary"], done["finish_reason"], done["settings"],
                                                         self.reply_speculation))
        self.settle_deferred()
        self._show_effective(done["settings"])
        self._refresh_state()

    def _return_unanswered_message(self) -> None:
        """A request that failed outright: take its message out of the history and give
        the text back, so the user can retry without retyping."""
        message = self.conversation.pop()
        if not self.chat.input_text().strip():
            self.chat.set_input_text(message["content"])

    # ---- settings ----------------------------------------------------------------
    def change_engine_setting(self, key: str, value) -> None:
        self.worker.reconfigure(**{key: value})
        self._settings_edited()

    def choose_draft_model(self, reference: str | None) -> None:
        self.worker.set_draft_model(reference)
        self._settings_edited()

    def _on_settings_changed(self, settings: dict, applied: dict, deferred: dict) -> None:
        if deferred:
            self._defer(deferred)
        self._show_effective(settings)

    def _defer(self, changes: dict) -> None:
        self.deferred.update(changes)
        self.panel.show_deferred(describe_deferred(self.deferred))

    def settle_deferred(self) -> None:
        """What waited for a reply (or a measurement) has applied."""
        self.deferred = {}
        self.panel.show_deferred("")

    def _show_effective(self, settings: dict) -> None:
        if settings:
            self.effective = settings
        self.panel.show_effective(describe_settings(self.effective, self.panel.values()))

    def _settings_edited(self, *_) -> None:
        self._save_timer.start()

    # ---- worker state --------------------------------------------------------------
    def _on_model_loaded(self, info: dict) -> None:
        self.model_ready = True
        settings = info["settings"]
        remote = settings.get("backend") == "remote"
        if remote:           # the profile keeps the last local model, and now the server too
            self.connection = {"backend": "remote", "server_url": settings["url"], "server_model": settings["model"],
                               "api_key_env": settings["api_key_env"]}
        else:
            self.model_reference = info["reference"]
            self.connection = dict(self.connection, backend="local")
        self.panel.show_model(info["name"])
        self.history.forget_setup()          # speedups and per-position rates were of the last model
        self.window.hide_progress()
        self.window.show_message(f"{'Connected to' if remote else 'Loaded'} {info['name']}")
        self._show_effective(info["settings"])
        self._settings_edited()
        self._refresh_state()

    def _on_failed(self, kind: str, doing: str, message: str) -> None:
        self.window.show_error(f"{doing} failed: {message}")
        if kind == LOAD_DRAFT:
            self.panel.show_draft(self.effective.get("draft_model"))    # the draft did not change
        if kind in (LOAD_MODEL, LOAD_DRAFT):
            self.window.hide_progress()
            if not self.model_ready:
                self.panel.show_model("no model loaded: pick one below")
        if kind == GENERATE and self.request_id is not None:
            self.chat.add_error(message)

    def _on_busy(self, state: str) -> None:
        self.busy = state
        self.window.show_busy(BUSY_TEXT.get(state, state))
        if state == IDLE:
            self.window.hide_progress()
        self._refresh_state()

    def _refresh_state(self) -> None:
        ready = self.model_ready and self.busy not in (LOADING, LOADING_DRAFT)
        self.chat.set_state(ready=ready, generating=self.request_id is not None)

    # ---- profiles ------------------------------------------------------------------
    def current_profile(self, **overrides) -> SessionProfile:
        """The last profile shown, with what the user changed since (panel, system prompt)."""
        values = dict(name=self.profile_name, model=self.model_reference,
                      system_prompt=self.chat.system_prompt(), **self.connection, **self.panel.values(),
                      workload=self.window.load_panel.workload())
        return replace(self.profile, **(values | overrides))

    def save_profile(self) -> None:
        """Ctrl+S: save under the current name; ask for one if the session has none yet."""
        name = self.profile_name
        if name in UNNAMED or name in builtin_profiles():
            name = self.window.ask_profile_name("my profile" if name in UNNAMED else f"my {name}")
        if name:
            self.save_profile_as(name)

    def save_profile_as(self, name: str) -> None:
        try:
            path = self.store.save(self.with_quality(self.current_profile()), name)
        except (ProfileError, WorkbenchError) as exc:
            self.window.show_error(f"Saving the profile failed: {exc}")
            return
        self.profile_name = name
        self._show_title()
        self.window.show_message(f"Saved profile {name!r} to {path}")

    def with_quality(self, profile: SessionProfile) -> SessionProfile:
        """The profile with the newest quality measured on exactly its settings (or none), so a
        shared profile says what it costs."""
        if "quality" not in {f.name for f in fields(profile)}:
            return profile
        return replace(profile, quality=self.window.quality_panel.history.latest_for(session_snapshot(profile)))

    def load_profile(self, name_or_path: str) -> None:
        try:
            profile = self.store.load(name_or_path)
        except ProfileError as exc:
            self.window.show_error(f"Loading the profile failed (nothing was changed): {exc}")
            return
        self.apply_profile(profile)
        self.window.show_message(f"Loaded profile {profile.name!r}")

    def apply_profile(self, profile: SessionProfile) -> None:
        """Show the profile's settings and apply them live (a new model only if it differs)."""
        on_server = self.effective.get("backend") == "remote"
        self._show_profile(profile)
        if profile.backend == "remote" and profile.server_url:
            if self.effective.get("url") != profile.server_url:
                self.connect_server(profile.server_url, profile.server_model or "", profile.api_key_env or "")
        elif profile.model != self.model_reference or on_server:
            self.load_model(profile.model)
        else:
            self.worker.reconfigure(**profile.engine_settings())     # the draft too, if it differs
        self._settings_edited()

    def _show_profile(self, profile: SessionProfile) -> None:
        self.profile_name, self.profile = profile.name, profile
        self.connection = {key: getattr(profile, key) for key in CONNECTION_KEYS}
        self.panel.set_values(asdict(profile))
        self.window.load_panel.set_workload(profile.workload)
        self.chat.set_system_prompt(profile.system_prompt)
        self._show_title()
        self.profileShown.emit(profile)

    def delete_profile(self, name: str) -> None:
        try:
            self.store.delete(name)
        except ProfileError as exc:
            self.window.show_error(f"Deleting the profile failed: {exc}")
            return
        if name == self.profile_name:
            self.profile_name = "untitled"
        self._show_title()
        self.window.show_message(f"Deleted profile {name!r}")

    def save_last_session(self) -> None:
        try:
            self.store.save_last_session(self.with_quality(self.current_profile()))
        except WorkbenchError as exc:
            self.window.show_message(f"Could not save the session: {exc}")

    def _show_title(self) -> None:
        self.window.setWindowTitle(f"Inference Workbench — {self.profile_name}")
        self.window.set_profile_menus(self.store.names(), self.store.recent(), list(builtin_profiles()))

    # ---- exports -------------------------------------------------------------------
    def export_png(self, path: str) -> None:
        if self.window.plots.save_png(path):
            self.window.show_message(f"Saved the plots to {path}")
        else:
            self.window.show_error(f"Could not write {path}: choose a writable folder and a .png name")

    def export_csv(self, path: str) -> None:
        try:
            written = self.history.write_csv(path)
        except OSError as exc:
            self.window.show_error(f"Could not write {path}: {exc.strerror or exc}")
            return
        self.window.show_message("Saved metrics to " + " and ".join(str(p) for p in written))
