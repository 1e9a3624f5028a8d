"""The engine on its own thread: the ONLY module in app/ that imports both Qt and engine.

EngineWorker is a QObject moved to a QThread (not a QThread subclass). Requests come in
through public methods that are safe to call from the GUI thread:
  - load_model / generate / set_draft_model emit queued signals, so the work runs on the
    worker thread, in order;
  - reconfigure puts changes on a thread-safe queue that the worker drains between
    generation steps (a queued signal cannot arrive while generate() loops) and, when
    idle, on a queued wake-up;
  - cancel only sets flags (LLMEngine.cancel is thread-safe and runs no forward pass),
    so Stop takes effect at the next step.
Results go out as signals carrying plain data (dicts, lists, str), never engine objects.
The GUI thread never runs a forward pass.
"""
from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
from collections import Counter
from dataclasses import fields

from PySide6.QtCore import QObject, QThread, Qt, Signal, Slot

import torch

from engine import LLMEngine
from engine.config import EngineConfig, SamplingParams
from engine.errors import WorkbenchError
from engine.metrics import TARGET, StepEvent

log = logging.getLogger(__name__)
IDLE, LOADING, GENERATING, LOADING_DRAFT = "", "loading", "generating", "loading draft"
DETOKENIZE_CONTEXT = 4     # tokens of left context when decoding per token (as the engine does)


class EngineWorker(QObject):
    # ---- out (plain data) -------------------------------------------------------
    loadProgress = Signal(str, float)           # message, fraction 0..1
    modelLoaded = Signal(dict)                  # {"name", "reference", "settings"}
    stepReady = Signal(dict)                    # one StepEvent as a dict + "request_id", "segments"
    requestDone = Signal(dict)                  # {"request_id", "finish_reason", "summary", "settings"}
    settingsChanged = Signal(dict, dict, dict)  # settings in effect, applied, deferred to the request's end
    failed = Signal(str, str)                   # what was being done, a readable message
    busyChanged = Signal(str)                   # IDLE, LOADING, GENERATING or LOADING_DRAFT

    # ---- in (queued to the worker thread) ------------------------------------------
    _loadRequested = Signal(str, object)
    _generateRequested = Signal(int, object, object)
    _draftRequested = Signal(object)
    _wakeRequested = Signal()

    def __init__(self):
        super().__init__()
        self.engine: LLMEngine | None = None
        self._reconfigure_queue: queue.SimpleQueue[dict] = queue.SimpleQueue()
        self._request_ids = itertools.count(1)
        self._ids_lock = threading.Lock()
        self._last_submitted = 0
        self._cancelled_upto = 0      # every request id <= this one is cancelled
        self._recent_ids: list[int] = []
        self._closing = threading.Event()     # set on exit: queued requests are dropped
        queued = Qt.ConnectionType.QueuedConnection
        self._loadRequested.connect(self._load, queued)
        self._generateRequested.connect(self._generate, queued)
        self._draftRequested.connect(self._set_draft, queued)
        self._wakeRequested.connect(self._drain_reconfigure, queued)

    # ---- public API: safe from any thread ---------------------------------------
    def load_model(self, reference: str, config: EngineConfig) -> None:
        """Load a target (and the config's draft); the current engine stays until it succeeds."""
        self._loadRequested.emit(reference or "default", config)

    def generate(self, messages: list[dict], params: SamplingParams) -> int:
        with self._ids_lock:
            request_id = next(self._request_ids)
            self._last_submitted = request_id
        self._generateRequested.emit(request_id, [dict(m) for m in messages], params)
        return request_id

    def reconfigure(self, **changes) -> None:
        self._reconfigure_queue.put(changes)
        self._wakeRequested.emit()

    def set_draft_model(self, reference: str | None) -> None:
        """Runs between requests: queued behind a running generation."""
        self._draftRequested.emit(reference)

    def close(self) -> None:
        """On exit: stop the running request and drop every request still queued."""
        self._closing.set()
        self.cancel()

    def cancel(self) -> None:
        """Stop the running request and any already submitted, at their next step."""
        with self._ids_lock:
            self._cancelled_upto = self._last_submitted
        engine = self.engine
        if engine is not None:
            engine.cancel()

    # ---- worker thread -----------------------------------------------------------
    @Slot(str, object)
    def _load(self, reference: str, config: EngineConfig) -> None:
        if self._closing.is_set():
            return
        self.busyChanged.emit(LOADING)
        leave_a_core_for_the_gui()
        draft = config.spec.draft_model
        try:
            # The draft loads separately so a bad draft never costs the user the target.
            engine = LLMEngine.load(reference, config.with_changes(draft_model=None), progress=self.loadProgress.emit)
        except Exception as exc:                  # noqa: BLE001 - any failure becomes a message
            self._fail(f"Loading model {reference!r}", exc)
        else:
            self.engine = engine
            self.modelLoaded.emit({"name": engine.target_model.display_name, "reference": reference,
                                   "settings": engine.settings()})
            if draft:
                self._set_draft(draft)
        self.busyChanged.emit(IDLE)

    @Slot(object)
    def _set_draft(self, reference: str | None) -> None:
        if self._closing.is_set() or not self._need_engine("Setting the draft model"):
            return
        self.busyChanged.emit(LOADING_DRAFT)
        try:
            self.engine.set_draft_model(reference, progress=self.loadProgress.emit)
        except Exception as exc:                  # noqa: BLE001
            self._fail(f"Loading draft model {reference!r}", exc)
        self.settingsChanged.emit(self.engine.settings(), {"draft_model": self.engine.draft_name}, {})
        self.busyChanged.emit(IDLE)

    @Slot()
    def _drain_reconfigure(self) -> None:
        if self.engine is None or self._closing.is_set():
            return        # changes wait in the queue for the first model to load
        while True:
            try:
                changes = self._reconfigure_queue.get_nowait()
            except queue.Empty:
                return
            try:
                result = self.engine.reconfigure(**changes)
            except Exception as exc:              # noqa: BLE001
                self._fail("Changing settings", exc)
                self.settingsChanged.emit(self.engine.settings(), {}, {})
            else:
                self.settingsChanged.emit(self.engine.settings(), result.applied, result.deferred)

    @Slot(int, object, object)
    def _generate(self, request_id: int, messages: list[dict], params: SamplingParams) -> None:
        done = {"request_id": request_id, "finish_reason": "error", "summary": None, "settings": {}}
        if self._closing.is_set():
            return
        if self._is_cancelled(request_id):
            done["finish_reason"] = "cancelled"
        elif self._need_engine("Generating"):
            self.busyChanged.emit(GENERATING)
            done.update(self._run_request(request_id, messages, params))
            self.busyChanged.emit(IDLE)
        if self.engine is not None:
            self._drain_reconfigure()
            done["settings"] = self.engine.settings()    # deferred settings are in effect now
        self.requestDone.emit(done)

    def _run_request(self, request_id: int, messages: list[dict], params: SamplingParams) -> dict:
        result = {}
        self._recent_ids = []
        try:
            for event in self.engine.generate(messages, params):
                self._drain_reconfigure()     # live changes apply at the next step
                if self._is_cancelled(request_id):
                    self.engine.cancel()
                self.stepReady.emit(self._event_data(event, request_id))
                if event.finished:
                    result = {"finish_reason": event.finish_reason, "summary": event.summary.as_dict()}
        except Exception as exc:                  # noqa: BLE001
            self._fail("Generating", exc)
        return result

    # ---- helpers ---------------------------------------------------------------
    def _is_cancelled(self, request_id: int) -> bool:
        with self._ids_lock:
            return request_id <= self._cancelled_upto

    def _need_engine(self, doing: str) -> bool:
        if self.engine is None:
            self.failed.emit(doing, "no model is loaded yet: wait for loading to finish, or pick a model")
        return self.engine is not None

    def _fail(self, doing: str, exc: Exception) -> None:
        if isinstance(exc, WorkbenchError):
            message = str(exc)
        else:
            log.exception("%s failed", doing)
            message = f"unexpected {type(exc).__name__}: {exc} (details are in the log)"
        self.failed.emit(doing, message)

    def _event_data(self, event: StepEvent, request_id: int) -> dict:
        data = {f.name: getattr(event, f.name) for f in fields(event) if f.name != "summary"}
        data["summary"] = event.summary.as_dict() if event.summary is not None else None
        data["request_id"] = request_id
        data["segments"] = self._segments(event)
        self._recent_ids = (self._recent_ids + list(event.token_ids))[-DETOKENIZE_CONTEXT:]
        return data

    def _segments(self, event: StepEvent) -> list[tuple[str, str]]:
        """The step's text split into (text, kind) runs, exact per token where the text allows."""
        kinds = event.token_kinds
        if not event.text_delta:
            return []
        if len(set(kinds)) <= 1:
            return [(event.text_delta, kinds[0] if kinds else TARGET)]
        pieces = per_token_text(self.engine.tokenizer, self._recent_ids, event.token_ids)
        if "".join(pieces) != event.text_delta:
            # A character split across steps: colour the step by its most common kind.
            return [(event.text_delta, Counter(kinds).most_common(1)[0][0])]
        return merge_runs(zip(pieces, kinds))


def per_token_text(tokenizer, context_ids: list[int], token_ids: list[int]) -> list[str]:
    """Text each token adds, decoded after some left context (tokenizers that drop a leading
    space at the start of a decode would otherwise lose it)."""
    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)
    pieces, previous = [], decode(context_ids)
    for i in range(1, len(token_ids) + 1):
        text = decode(context_ids + token_ids[:i])
        pieces.append(text[len(previous):] if text.startswith(previous) else "\ufffd")
        previous = text
    return pieces


def merge_runs(pieces) -> list[tuple[str, str]]:
    runs: list[list] = []
    for text, kind in pieces:
        if runs and runs[-1][1] == kind:
            runs[-1][0] += text
        elif text:
            runs.append([text, kind])
    return [(text, kind) for text, kind in runs]


def leave_a_core_for_the_gui() -> None:
    """PyTorch's CPU pool takes every core by default and its threads spin while they wait.
    On a small machine that starves the GUI thread, and when the cores are oversubscribed
    it slows the forward pass itself many times over (measured on 2 shared cores: 0.7 s per
    step with 2 threads, 0.035 s with 1). Keep one core for the window, unless the user
    already chose fewer threads (OMP_NUM_THREADS / torch.set_num_threads). Called on the
    worker thread: the setting is per thread (OpenMP), so it touches nothing else."""
    cores = os.cpu_count() or 1
    if cores > 1 and torch.get_num_threads() >= cores:
        torch.set_num_threads(cores - 1)


class EngineHost:
    """Owns the worker's QThread: start on construction, stop() on exit."""

    def __init__(self):
        self.thread = QThread()
        self.thread.setObjectName("engine-worker")
        self.worker = EngineWorker()
        self.worker.moveToThread(self.thread)
        self.thread.start()

    def stop(self) -> None:
        """Cancel any generation (it ends within a step), drop queued requests, end the
        thread's event loop and wait for it. No time limit: a QThread destroyed while it
        runs aborts the process, so a model half-way through loading is let finish."""
        self.worker.close()
        self.thread.quit()
        self.thread.wait()
