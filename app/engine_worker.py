"""The engine on its own thread: the ONLY module in app/ that imports both Qt and engine.

EngineWorker is a QObject moved to a QThread (not a QThread subclass). Every request
(load, connect to a server, generate, reconfigure, draft change, cancel) is an ordinary
queued call: the public methods emit a signal and the slot runs on the worker thread, in
order. A reply runs ONE engine step per turn of the worker's event loop (each step queues
the next), so a change or a Stop queued during a reply is handled before the next step,
with no extra locks, queues or flags. The engine is a local LLMEngine or a RemoteBackend
(engine.backend: both are driven the same way). Results go out as signals carrying plain
data (dicts, lists, str), never engine objects. The GUI thread never runs a forward pass.

A load run (engine.workload.WorkloadRun, the load panel's Start or Run A/B) is driven the same
way: one engine step per turn. While it runs it steps the engine for everyone, the chat's
reply included (its events are routed to the chat as before), so the chat keeps working.

A quality measurement (engine.quality.QualityRun, the quality panel's Measure) is pumped one
bounded piece of work per turn, so Stop gets through between pieces. It runs alone: no chat
reply and no load run beside it (each is refused with the reason), and a setting changed
meanwhile waits for it to end (the run measures the settings it started with), then applies.

ServerModelLister asks a server for its models ("Connect to server…") on a pool thread of
its own: the GUI thread never waits on the network, and a listing never waits behind a
model load or a reply on the worker.
"""
from __future__ import annotations

import itertools
import logging
import os
import time

from PySide6.QtCore import QObject, QThread, QThreadPool, QTimer, Qt, Signal, Slot

import torch

from engine import LLMEngine
from engine.config import EngineConfig, SamplingParams
from engine.errors import WorkbenchError
from engine.quality import Configuration, QualityRun
from engine.remote.backend import RemoteBackend, list_served_models
from engine.stream import RequestStream
from engine.thread_policy import choose_threads
from engine.workload import Workload, WorkloadRun, make_jobs

log = logging.getLogger(__name__)
# The GUI thread's torch thread count when this module was imported: the default the headless
# engine runs with (or what the user set before starting the app).
MAIN_THREAD_TORCH_THREADS = torch.get_num_threads()
IDLE, LOADING, GENERATING, LOADING_DRAFT = "", "loading", "generating", "loading draft"
MEASURING = "measuring quality"
# What failed (the first argument of `failed`): the controller reacts by kind, not by text.
LOAD_MODEL, LOAD_DRAFT, CHANGE_SETTINGS, GENERATE = "load model", "load draft", "change settings", "generate"
LOAD_TEST = "load test"
QUALITY_RUNNING = "a quality measurement is running: wait for it to end, or Stop it in the Quality tab"
# The settings a results-table row shows (engine.settings() keys).
RUN_SETTINGS = ("kv_cache_dtype", "enable_prefix_caching", "proposer", "num_speculative_tokens", "speculation_policy",
                "kv_pool_blocks", "compile", "threads")


class EngineWorker(QObject):
    # ---- out (plain data) -------------------------------------------------------
    loadProgress = Signal(str, float)           # message, fraction 0..1
    modelLoaded = Signal(dict)                  # {"name", "reference", "settings"}
    stepReady = Signal(dict)                    # StepEvent.as_dict() + "request_id"
    requestDone = Signal(dict)                  # {"request_id", "finish_reason", "summary", "settings"}
    settingsChanged = Signal(dict, dict, dict)  # settings in effect, applied, deferred to the request's end
    failed = Signal(str, str, str)              # kind (LOAD_MODEL, ...), what was being done, a readable message
    busyChanged = Signal(str)                   # IDLE, LOADING, GENERATING or LOADING_DRAFT
    loadStep = Signal(dict)                     # a load run's step: WorkloadRun.step_figures() + "arm", "t"
    loadArmStarted = Signal(dict)               # {"arm": label, "t": load time, "settings": in effect}
    loadDone = Signal(dict)                     # a finished arm: its row of the results table (see _arm_row)
    loadFinished = Signal(bool)                 # the whole load ended (True: stopped)
    qualityProgress = Signal(str, float)        # what the quality run is doing, fraction 0..1
    qualityResult = Signal(dict)                # a measured configuration: engine.quality's result row
    qualityFinished = Signal(bool, str)         # the run ended: stopped, and a readable error ("" when none)

    # ---- in (queued to the worker thread) ------------------------------------------
    _loadRequested = Signal(str, object)
    _connectRequested = Signal(str, str, str)
    _generateRequested = Signal(int, object, object)
    _reconfigureRequested = Signal(object)
    _draftRequested = Signal(object)
    _cancelRequested = Signal()
    _stepRequested = Signal(int)                # the request id the step is for
    _loadRequested_ = Signal(object, object, object)
    _loadStopRequested = Signal()
    _loadStepRequested = Signal()
    _qualityRequested = Signal(object, object, object)
    _qualityStopRequested = Signal()
    _qualityStepRequested = Signal()

    def __init__(self):
        super().__init__()
        self.engine: LLMEngine | RemoteBackend | None = None   # engine.backend.Backend
        self.request: RequestStream | None = None
        self.request_id: int | None = None
        self.pending_draft: tuple[str | None] | None = None    # a draft chosen during a reply
        self._request_ids = itertools.count(1)
        queued = Qt.ConnectionType.QueuedConnection
        self._loadRequested.connect(self._load, queued)
        self._connectRequested.connect(self._connect_server, queued)
        self._generateRequested.connect(self._generate, queued)
        self._reconfigureRequested.connect(self._reconfigure, queued)
        self._draftRequested.connect(self._set_draft, queued)
        self._cancelRequested.connect(self._cancel, queued)
        self._stepRequested.connect(self._step, queued)
        self._loadRequested_.connect(self._start_load, queued)
        self._loadStopRequested.connect(self._stop_load, queued)
        self._loadStepRequested.connect(self._load_step, queued)
        self._qualityRequested.connect(self._start_quality, queued)
        self._qualityStopRequested.connect(self._stop_quality, queued)
        self._qualityStepRequested.connect(self._quality_step, queued)
        self.load: LoadTest | None = None
        self.quality: QualityRun | None = None
        self.quality_deferred: dict = {}        # settings changed during a quality run: applied after it

    # ---- public API: safe from any thread ---------------------------------------
    def load_model(self, reference: str, config: EngineConfig) -> None:
        """Load a target (and the config's draft); the current engine stays until it succeeds."""
        self._loadRequested.emit(reference or "default", config)

    def connect_server(self, url: str, model: str = "", api_key_env: str = "") -> None:
        """Drive an OpenAI-compatible server instead (engine.remote.backend); the current engine
        stays until the server answers and serves the model. api_key_env: the NAME of the
        environment variable holding the key ("": none); the key never passes through here."""
        self._connectRequested.emit(url, model, api_key_env)

    def generate(self, messages: list[dict], params: SamplingParams) -> int:
        request_id = next(self._request_ids)      # itertools.count is atomic under the GIL
        self._generateRequested.emit(request_id, [dict(m) for m in messages], params)
        return request_id

    def reconfigure(self, **changes) -> None:
        self._reconfigureRequested.emit(changes)

    def set_draft_model(self, reference: str | None) -> None:
        """Now if idle; a draft chosen during a reply loads when the reply ends."""
        self._draftRequested.emit(reference)

    def cancel(self) -> None:
        """Stop the running reply at its next step (queued behind what was asked before)."""
        self._cancelRequested.emit()

    def start_load(self, workload: Workload, arms: list[dict], restore: dict | None = None) -> None:
        """Serve the workload once per arm ({"label", "settings": reconfigure changes or None});
        two arms run A, B, B, A (each arm's requests pooled into its row), then `restore`
        (the settings to return to) is applied."""
        self._loadRequested_.emit(workload, [dict(a) for a in arms], dict(restore or {}))

    def stop_load(self) -> None:
        """End the load run at its next step: every request cancelled, the finished ones kept."""
        self._loadStopRequested.emit()

    def start_quality(self, configurations: list[dict], chat: list[dict] | None = None,
                      tokens: int | None = None) -> None:
        """Measure each configuration ({"label", "settings": engine settings by key, {} for the
        settings in effect}) against the reference (engine.quality), on the shipped text's first
        `tokens` (None: engine.quality's default) and the chat so far when given."""
        self._qualityRequested.emit([dict(c) for c in configurations], [dict(m) for m in chat] if chat else None, tokens)

    def stop_quality(self) -> None:
        """End the quality run after the piece it is on; the engine gets its settings back."""
        self._qualityStopRequested.emit()

    # ---- worker thread: loading ----------------------------------------------------
    @Slot(str, object)
    def _load(self, reference: str, config: EngineConfig) -> None:
        self._end_load(stopped=True)
        self._end_quality(stopped=True)
        if self.request is not None:
            self._close_request("cancelled")
        self.busyChanged.emit(LOADING)
        use_engine_threads()
        try:
            # The draft loads separately so a bad draft never costs the user the target.
            engine = LLMEngine.load(reference, config.with_changes(draft_model=None), progress=self.loadProgress.emit)
        except Exception as exc:                  # noqa: BLE001 - any failure becomes a message
            self._fail(LOAD_MODEL, f"Loading model {reference!r}", exc)
        else:
            self._replace_engine(engine)
            if config.draft_model:
                self._load_draft(config.draft_model)
            self._warm_compiled_step()
            self.modelLoaded.emit({"name": engine.target_model.display_name, "reference": reference,
                                   "settings": engine.settings()})
        self.busyChanged.emit(IDLE)

    def _warm_compiled_step(self) -> bool:
        """With `compile` on, compile the step now, with progress, so that no reply times a
        compile (engine.LLMEngine.warm_compiled_step; nothing to do once built). True when it
        compiled. A failure leaves the engine eager, and settings() says why."""
        if not isinstance(self.engine, LLMEngine) or self.engine.has_work:
            return False
        try:
            return self.engine.warm_compiled_step() > 0
        except Exception as exc:                  # noqa: BLE001
            self._fail(LOAD_MODEL, "Compiling the decode step", exc)
            return False

    @Slot(str, str, str)
    def _connect_server(self, url: str, model: str, api_key_env: str) -> None:
        self._end_load(stopped=True)
        self._end_quality(stopped=True)
        if self.request is not None:
            self._close_request("cancelled")
        self.busyChanged.emit(LOADING)
        self.loadProgress.emit(f"connecting to {url}", 0.0)
        try:
            backend = RemoteBackend(url, model or None, api_key_env=api_key_env or None)
        except Exception as exc:                  # noqa: BLE001 - any failure becomes a message
            self._fail(LOAD_MODEL, f"Connecting to {url}", exc)
        else:
            self._replace_engine(backend)
            self.modelLoaded.emit({"name": f"{backend.model} on {backend.kind.label} at {backend.url}",
                                   "reference": backend.url, "settings": backend.settings()})
        self.busyChanged.emit(IDLE)

    def _replace_engine(self, engine) -> None:
        if isinstance(self.engine, RemoteBackend):
            self.engine.close()                   # its HTTP connections
        self.engine = engine

    def release(self) -> None:
        """Close what the engine holds outside this process (a server's HTTP connections and
        stream). Called once the worker's thread has ended (EngineHost.stop): nothing else
        touches the engine then."""
        if self.quality is not None:
            self.quality.close()                  # a second engine it loaded is freed
            self.quality = None
        self.request, self.request_id = None, None
        self._replace_engine(None)

    @Slot(object)
    def _set_draft(self, reference: str | None) -> None:
        if not self._need_engine(LOAD_DRAFT, "Setting the draft model"):
            return
        if self.request is not None or self.load is not None or self.quality is not None:
            self.pending_draft = (reference,)
            settings = {} if self.quality is not None else self.engine.settings()     # {}: as last reported
            self.settingsChanged.emit(settings, {}, {"draft_model": reference})
            return
        self.busyChanged.emit(LOADING_DRAFT)
        self._load_draft(reference)
        self.busyChanged.emit(IDLE)

    def _load_draft(self, reference: str | None) -> None:
        """Through the backend (engine.backend): a server answers that its draft is fixed."""
        try:
            self.engine.set_draft_model(reference, progress=self.loadProgress.emit)
        except Exception as exc:                  # noqa: BLE001
            self._fail(LOAD_DRAFT, f"Loading draft model {reference!r}", exc)
        settings = self.engine.settings()
        self.settingsChanged.emit(settings, {"draft_model": settings.get("draft_model")}, {})

    # ---- worker thread: settings and cancel ------------------------------------------
    @Slot(object)
    def _reconfigure(self, changes: dict) -> None:
        if not self._need_engine(CHANGE_SETTINGS, "Changing settings"):
            return
        changes = dict(changes)
        if self.quality is not None:              # the run measures the settings it started with
            self.quality_deferred.update(changes)
            self.settingsChanged.emit({}, {}, changes)       # {}: the settings as last reported
            return
        if "draft_model" in changes:
            draft = changes.pop("draft_model")
            if draft != self.engine.settings().get("draft_model"):
                self._set_draft(draft)
        if not changes:
            return
        try:
            result = self.engine.reconfigure(**changes)
        except Exception as exc:                  # noqa: BLE001
            self._fail(CHANGE_SETTINGS, "Changing settings", exc)
            self.settingsChanged.emit(self.engine.settings(), {}, {})
        else:
            if self.load is None and self._warm_compiled_step():     # e.g. compile on, or a new KV dtype
                self.busyChanged.emit(IDLE)               # the progress it showed is done
            self.settingsChanged.emit(self.engine.settings(), result.applied, result.deferred)

    @Slot()
    def _cancel(self) -> None:
        if self.request is not None:
            self.request.cancel()

    # ---- worker thread: a reply, one step per turn ---------------------------------------
    @Slot(int, object, object)
    def _generate(self, request_id: int, messages: list[dict], params: SamplingParams) -> None:
        if self.request is not None:              # "New chat" during a reply, then a message
            self.request.cancel()
            self._close_request("cancelled")
        if self.quality is not None:
            self.failed.emit(GENERATE, "Generating", QUALITY_RUNNING)
            self.requestDone.emit({"request_id": request_id, "finish_reason": "error", "summary": None, "settings": {}})
            return
        if not self._need_engine(GENERATE, "Generating"):
            self.requestDone.emit({"request_id": request_id, "finish_reason": "error", "summary": None, "settings": {}})
            return
        try:
            self.request = self.engine.start(messages, params)
        except Exception as exc:                  # noqa: BLE001
            self._fail(GENERATE, "Generating", exc)
            self.requestDone.emit({"request_id": request_id, "finish_reason": "error", "summary": None,
                                   "settings": self.engine.settings()})
            return
        self.request_id = request_id
        self.busyChanged.emit(GENERATING)
        self._stepRequested.emit(request_id)

    @Slot(int)
    def _step(self, request_id: int) -> None:
        if self.request is None or request_id != self.request_id or self.load is not None:
            return                                # a reply that has ended, or the load run steps the engine
        try:
            event = self.request.step()
        except Exception as exc:                  # noqa: BLE001
            self._fail(GENERATE, "Generating", exc)
            self._close_request("error")
            return
        if not self._chat_event(event):
            self._stepRequested.emit(request_id)  # behind anything queued meanwhile

    def _chat_event(self, event) -> bool:
        """Hand the chat its event; True when the reply has ended."""
        self.stepReady.emit(event.as_dict() | {"request_id": self.request_id})
        if event.finished:
            self._close_request(event.finish_reason, event.summary.as_dict())
        return event.finished

    def _close_request(self, finish_reason: str, summary: dict | None = None) -> None:
        request_id, request = self.request_id, self.request
        self.request, self.request_id = None, None
        if self.load is not None and not request.request.finished:
            # Its last step must go through the load run, which keeps its own requests' events.
            request.cancel()
            while not request.request.finished:
                self.load.run.step()
                self.load.record_step(self)
        try:
            request.close()                       # deferred settings apply here
        except Exception as exc:                  # noqa: BLE001
            self._fail(CHANGE_SETTINGS, "Applying the deferred settings", exc)
        if self.pending_draft is not None and self.load is None:
            (draft,), self.pending_draft = self.pending_draft, None
            self._load_draft(draft)
        self.requestDone.emit({"request_id": request_id, "finish_reason": finish_reason, "summary": summary,
                               "settings": self.engine.settings()})
        if self.load is None:
            self._warm_compiled_step()            # settings deferred to the reply's end may want a graph
        self.busyChanged.emit(IDLE)

    # ---- worker thread: a load run, one engine step per turn --------------------------
    @Slot(object, object, object)
    def _start_load(self, workload: Workload, arms: list[dict], restore: dict) -> None:
        if not self._need_engine(LOAD_TEST, "Starting the load test"):
            self.loadFinished.emit(True)
            return
        if self.quality is not None:
            self.failed.emit(LOAD_TEST, "Starting the load test", QUALITY_RUNNING)
            self.loadFinished.emit(True)
            return
        if not isinstance(self.engine, LLMEngine):
            self.failed.emit(LOAD_TEST, "Starting the load test", "the load panel drives the local engine; against "
                             "a server, run python -m engine.bench serve --backend URL")
            self.loadFinished.emit(True)
            return
        self._end_load(stopped=True)
        try:
            jobs = make_jobs(self.engine, workload)
        except Exception as exc:                  # noqa: BLE001 - any failure becomes a message
            self._fail(LOAD_TEST, "Starting the load test", exc)
            self.loadFinished.emit(True)
            return
        order = [0] if len(arms) == 1 else [0, 1, 1, 0]       # A B B A: a drift over time hits both arms alike
        self.load = LoadTest(workload, jobs, arms, order, restore)
        self._next_arm()

    def _next_arm(self) -> None:
        load = self.load
        arm = load.arms[load.order[load.position]]
        self.load = None                          # between arms the load is idle: every change (a draft too) applies now
        if arm.get("settings"):
            self._reconfigure(arm["settings"])
        self.load = load
        self.engine.reset_prefix_cache()          # each arm starts cold, as the serving bench's
        load.begin(self.engine)
        settings = self.engine.settings()
        self.loadArmStarted.emit({"arm": arm["label"], "t": load.time_s(),
                                  "settings": {k: settings.get(k) for k in RUN_SETTINGS}})
        self._loadStepRequested.emit()

    @Slot()
    def _load_step(self) -> None:
        load = self.load
        if load is None:
            return
        try:
            events = load.run.step()
        except Exception as exc:                  # noqa: BLE001
            self._fail(LOAD_TEST, "Running the load test", exc)
            self._end_load(stopped=True)
            return
        chat_id = self.request.request_id if self.request is not None else None
        for event in events:
            if event.request_id == chat_id and self.request is not None:
                self._chat_event(self.request.step())        # already queued: no engine step
        load.record_step(self)
        if not load.run.done:
            wait_ms = int(load.run.idle_wait_s() * 1000)
            if wait_ms:
                QTimer.singleShot(wait_ms, self._load_step)   # nothing has arrived yet
            else:
                self._loadStepRequested.emit()
            return
        load.finish_arm()
        for row in load.take_rows():
            self.loadDone.emit(row)
        if load.stopped or load.position + 1 >= len(load.order):
            self._end_load(stopped=load.stopped)
        else:
            load.position += 1
            self._next_arm()

    @Slot()
    def _stop_load(self) -> None:
        if self.load is not None:
            self.load.stopped = True
            self.load.run.cancel()

    def _end_load(self, stopped: bool) -> None:
        load, self.load = self.load, None
        if load is None:
            return
        if not load.run.done:                     # a model load or a new run during this one
            load.run.cancel()
            while not load.run.done:
                load.run.step()
        if load.restore:
            self._reconfigure(load.restore)
        if self.request is not None:
            self._stepRequested.emit(self.request_id)     # the chat steps on its own again
        elif self.pending_draft is not None:
            (draft,), self.pending_draft = self.pending_draft, None
            self._load_draft(draft)
        self.loadFinished.emit(stopped)

    # ---- worker thread: a quality run, one piece of work per turn ------------------------------
    @Slot(object, object, object)
    def _start_quality(self, configurations: list[dict], chat: list[dict] | None, tokens: int | None) -> None:
        refusal = self._quality_refusal()
        if refusal:
            self.qualityFinished.emit(False, refusal)
            return
        try:
            run = QualityRun(self.engine, [Configuration(c["label"], c["settings"]) for c in configurations],
                             chat=chat, tokens=tokens)
        except Exception as exc:                  # noqa: BLE001 - any failure becomes a message
            self.qualityFinished.emit(False, self._message("Measuring quality", exc))
            return
        self.quality = run
        self.busyChanged.emit(MEASURING)
        self._qualityStepRequested.emit()

    def _quality_refusal(self) -> str:
        """Why a quality run cannot start now ("" when it can)."""
        if self.engine is None:
            return "no model is loaded yet: wait for loading to finish, or pick a model"
        if not isinstance(self.engine, LLMEngine):
            return ("quality is measured on the local engine; against a server, run python -m engine.bench "
                    "quality on the model it serves")
        if self.quality is not None:
            return "a quality measurement is already running"
        if self.load is not None:
            return "a load test is running: wait for it to end, or Stop it"
        if self.request is not None:
            return "a reply is being generated: wait for it to end, or Stop it"
        return ""

    @Slot()
    def _quality_step(self) -> None:
        run = self.quality
        if run is None:
            return                                # stopped, or a model load ended it
        try:
            progress = next(run.steps())
        except StopIteration:
            self._end_quality(stopped=False)
            return
        except Exception as exc:                  # noqa: BLE001
            self._end_quality(stopped=True, error=self._message("Measuring quality", exc))
            return
        self.qualityProgress.emit(progress.message, progress.fraction)
        if progress.result is not None:
            self.qualityResult.emit(dict(progress.result))
        self._qualityStepRequested.emit()        # behind anything queued meanwhile (a Stop)

    @Slot()
    def _stop_quality(self) -> None:
        self._end_quality(stopped=True)

    def _end_quality(self, stopped: bool, error: str = "") -> None:
        """Close the run (the engine's settings restored, a second engine freed), then apply
        what the user changed meanwhile."""
        run, self.quality = self.quality, None
        if run is None:
            return
        try:
            run.close()
        except Exception as exc:                  # noqa: BLE001
            error = error or self._message("Restoring the settings after the quality run", exc)
        deferred, self.quality_deferred = self.quality_deferred, {}
        if deferred:
            self._reconfigure(deferred)
        if self.pending_draft is not None:
            (draft,), self.pending_draft = self.pending_draft, None
            self._load_draft(draft)
        self._warm_compiled_step()                # the settings it restored may want a graph: not the next reply's
        self.settingsChanged.emit(self.engine.settings(), {}, {})
        self.busyChanged.emit(IDLE)
        self.qualityFinished.emit(stopped, error)

    # ---- helpers ---------------------------------------------------------------
    def _need_engine(self, kind: str, doing: str) -> bool:
        if self.engine is None:
            self.failed.emit(kind, doing, "no model is loaded yet: wait for loading to finish, or pick a model")
        return self.engine is not None

    def _fail(self, kind: str, doing: str, exc: Exception) -> None:
        self.failed.emit(kind, doing, self._message(doing, exc))

    @staticmethod
    def _message(doing: str, exc: Exception) -> str:
        """A readable message: a WorkbenchError's own; anything else named, with the trace in the log."""
        if isinstance(exc, WorkbenchError):
            return str(exc)
        log.exception("%s failed", doing)
        return f"unexpected {type(exc).__name__}: {exc} (details are in the log)"


class LoadTest:
    """A load test on the worker thread: the workload's jobs served once per arm, in `order`
    (indices into `arms`); each arm's requests and time pooled into its results row."""

    def __init__(self, workload: Workload, jobs, arms: list[dict], order: list[int], restore: dict):
        self.workload, self.jobs, self.arms, self.order, self.restore = workload, jobs, arms, order, restore
        self.position = 0
        self.stopped = False
        self.run: WorkloadRun | None = None
        self.t0: float | None = None
        self.pooled: dict[int, dict] = {}         # arm index -> requests, duration, settings, cancelled

    def time_s(self) -> float:
        """Seconds since the load test began (every arm on one time axis)."""
        now = time.perf_counter()
        self.t0 = now if self.t0 is None else self.t0
        return now - self.t0

    def begin(self, engine) -> None:
        self.offset_s = self.time_s()
        self.run = WorkloadRun(engine, list(self.jobs), self.workload.max_concurrency)
        settings = engine.settings()
        self.settings = {k: settings.get(k) for k in RUN_SETTINGS}
        self.engine, self.moe = engine, settings.get("moe")

    def record_step(self, worker: EngineWorker) -> None:
        figures = self.run.step_figures()
        if figures is not None:
            arm = self.arms[self.order[self.position]]["label"]
            worker.loadStep.emit(figures | {"t": self.offset_s + figures["t"], "arm": arm,
                                            "round": self.position, "rounds": len(self.order)} | self._experts())

    def _experts(self) -> dict:
        """An MoE model's experts woken by the step's pass (mean over its MoE layers), of how many."""
        if not self.moe:
            return {"experts_active": None}
        return {"experts_active": self.engine.last_step.experts_active, "experts": self.moe["experts"],
                "top_k": self.moe["top_k"]}

    def finish_arm(self) -> None:
        """Pool this round into its arm; the arm's row once its last round ran (or on Stop)."""
        index = self.order[self.position]
        pooled = self.pooled.setdefault(index, {"requests": [], "duration_s": 0.0, "cancelled": 0, "rounds": 0,
                                                "settings": self.settings})
        pooled["requests"] += [s.to_plain() for s in self.run.finished]
        pooled["duration_s"] += self.run.elapsed_s()
        pooled["cancelled"] += self.run.cancelled
        pooled["rounds"] += 1

    def take_rows(self) -> list[dict]:
        """The arms' rows, in arm order, once the last round ran (or the run was stopped)."""
        if not self.stopped and self.position + 1 < len(self.order):
            return []
        return [{"label": self.arms[i]["label"], "workload": self.workload.to_dict(), **self.pooled[i],
                 "stopped": self.stopped, "ab": len(self.arms) > 1} for i in sorted(self.pooled)]


def use_engine_threads() -> None:
    """Run the engine with the torch threads the headless engine gets (torch's default, or
    fewer where the user chose them: OMP_NUM_THREADS, or torch.set_num_threads before the
    worker starts), so the app measures what `python -m engine.bench` measures (app.fidelity
    checks it). An earlier version kept a core for the window; on 2 cores that halved decode
    speed against the bench. Called on the worker thread, where the setting is per thread
    (OpenMP): it makes the worker's count the process's own. The count is under "In effect"."""
    wanted = os.environ.get("OMP_NUM_THREADS")
    chosen = int(wanted) if wanted and wanted.isdigit() and int(wanted) > 0 else MAIN_THREAD_TORCH_THREADS
    choose_threads(chosen)


class ServerModelLister(QObject):
    """The models a server serves (GET /v1/models, engine.remote.backend.list_served_models), asked
    on a pool thread; the answer comes back on the GUI thread as plain data."""
    listed = Signal(str, list)          # the URL as asked, the model ids
    listFailed = Signal(str, str)       # the URL as asked, a readable message
    _listed = Signal(str, list)         # emitted on a pool thread; queued to the public ones
    _listFailed = Signal(str, str)

    def __init__(self):
        super().__init__()
        self.pool = QThreadPool(self)
        queued = Qt.ConnectionType.QueuedConnection
        self._listed.connect(self.listed, queued)
        self._listFailed.connect(self.listFailed, queued)

    def list_models(self, url: str, api_key_env: str = "") -> None:
        self.pool.start(lambda: self._list(url, api_key_env))

    def _list(self, url: str, api_key_env: str) -> None:       # on a pool thread
        try:
            models = list_served_models(url, api_key_env=api_key_env or None)
        except WorkbenchError as exc:
            self._listFailed.emit(url, str(exc))
        except Exception as exc:                  # noqa: BLE001 - any failure becomes a message
            log.exception("listing the models of %s failed", url)
            self._listFailed.emit(url, f"unexpected {type(exc).__name__}: {exc} (details are in the log)")
        else:
            self._listed.emit(url, models)

    def stop(self) -> None:
        """Drop listings not started; wait for a running one (at most the 5 s probe timeout)."""
        self.pool.clear()
        self.pool.waitForDone()


class EngineHost:
    """Owns the worker's QThread (start on construction, stop() on exit) and the server
    model lister."""

    def __init__(self):
        self.thread = QThread()
        self.thread.setObjectName("engine-worker")
        self.worker = EngineWorker()
        self.worker.moveToThread(self.thread)
        self.thread.start()
        self.model_lister = ServerModelLister()

    def stop(self) -> None:
        """End the worker's event loop after the step (or load) it is running, and wait.
        No time limit: a QThread destroyed while it runs aborts the process, so a model
        half-way through loading is let finish. Then close the engine's connections."""
        self.thread.quit()
        self.thread.wait()
        self.worker.release()
        self.model_lister.stop()
