"""RequestStream: one request's events, for a caller that follows one request (a chat, a
script): `step()` runs engine steps until this request has its next event.

    stream = engine.start(prompt, params)
    while not stream.finished:
        event = stream.step()        # other requests advance in the same engine steps
    stream.close()                   # cancels it if it has not finished

The events other requests get from those steps go to their own streams (or to whoever
called LLMEngine.step, if they were submitted without one).
"""
from __future__ import annotations

from collections import deque
from typing import Protocol

from engine.metrics import StepEvent
from engine.request import Request


class StreamHost(Protocol):
    def step(self) -> list[StepEvent]: ...
    def cancel(self, request_id: int | None = None) -> None: ...
    def request_closed(self, request: Request) -> None: ...


class RequestStream:
    def __init__(self, engine: StreamHost, request: Request):
        self.engine, self.request = engine, request
        request.events = deque()
        self.finished = False

    @property
    def request_id(self) -> int:
        return self.request.request_id

    @property
    def step_index(self) -> int:
        """Events this request has emitted."""
        return self.request.step_index

    @property
    def stats(self):
        """Its RequestStats so far (engine.metrics)."""
        return self.request.stats

    def step(self) -> StepEvent:
        if self.finished:
            raise RuntimeError("this request has finished")
        while not self.request.events:
            self.engine.step()
        event = self.request.events.popleft()
        self.finished = event.finished
        return event

    def cancel(self) -> None:
        """Stop at the next step. Safe from any thread."""
        self.request.cancel()

    def close(self) -> None:
        """However it ended: a request still running is cancelled and its blocks freed."""
        if not self.request.finished:
            self.request.cancel()
            while not self.request.finished:
                self.engine.step()
        self.finished = True
        self.engine.request_closed(self.request)
