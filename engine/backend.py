"""The interface the app talks to, whatever runs the model.

Two backends satisfy it:
  - `engine.engine.LLMEngine`: our own engine, in this process;
  - `engine.remote.backend.RemoteBackend`: an OpenAI-compatible server (vLLM, SGLang, llama.cpp's
    llama-server) whose stream and metrics become the same StepEvents.

The app's worker drives a request one step per turn of its event loop:

    request = backend.start(messages, params)
    while not request.finished:
        event = request.step()     # local: one forward pass; remote: the next streamed chunk
    request.close()                # however it ended

Both are Qt-free. Only `cancel` (backend or request) may be called from another thread.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Protocol, runtime_checkable

from engine.config import SamplingParams
from engine.metrics import StepEvent


@dataclass
class ReconfigureResult:
    """What Backend.reconfigure did with each change."""
    applied: dict
    deferred: dict      # applied when the running request ends


@runtime_checkable
class BackendRequest(Protocol):
    finished: bool

    def step(self) -> StepEvent:
        """Advance to the next event; blocks only until that event is available."""

    def cancel(self) -> None:
        """Stop at the next step (that step is the last, finish_reason "cancelled")."""

    def close(self) -> None:
        """Release what the request holds; safe to call more than once."""


@runtime_checkable
class Backend(Protocol):
    """prompt: text or chat messages ([{"role", "content"}]); the local engine also takes
    token ids."""

    def start(self, prompt, params: SamplingParams | None = None) -> BackendRequest: ...

    def generate(self, prompt, params: SamplingParams | None = None) -> Iterator[StepEvent]: ...

    def reconfigure(self, **changes):
        """Change settings between steps; returns a ReconfigureResult. A setting
        the backend cannot change raises ConfigError naming what can."""

    def cancel(self) -> None: ...

    def settings(self) -> dict:
        """The settings in effect, as the app shows them."""

    def reset_prefix_cache(self) -> None: ...

    def set_draft_model(self, reference: str | None, progress=None) -> None:
        """Load (or clear) the draft model, between requests. A backend whose draft is fixed
        (a server: chosen when it is launched) raises ServerSettingFixedError naming the flag."""


def run_to_end(backend: Backend, prompt, params: SamplingParams | None = None) -> Iterator[StepEvent]:
    """`generate` for any backend: start, step until finished, always close."""
    request = backend.start(prompt, params)
    try:
        while not request.finished:
            yield request.step()
    finally:
        request.close()
