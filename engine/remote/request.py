"""RemoteRequest: one streamed reply from a remote server, as StepEvents.

    request = backend.start(messages, params)       # engine.remote.backend.RemoteBackend
    while not request.finished:
        event = request.step()      # blocks until the next chunk with text (or the end)
    request.close()

One event per server step: the chunks with text that one forward pass produced; the end is
one more event (finished, with the summary and the server's figures). A server may stream a
verified draft's tokens as a burst of chunks, one per token, microseconds apart (llama.cpp
does); one event per chunk would time each at a few microseconds (~40,000 tok/s). So the
chunks of a burst make ONE event, timed from the previous event's last chunk to this one's
last chunk. A chunk joins the event being built when (`_same_step`)
  - the server stamps the pass that made it and the stamp is unchanged (llama.cpp's
    cumulative `timings.predicted_ms` is the same for every chunk of a pass), waiting up to
    PASS_WAIT_S for it (measured: a pass's chunks arrive within ~5 ms of each other on a
    loaded 2-core machine, passes 5-150 ms apart), or
  - the server does not stamp passes, and the chunk arrived (the reader thread's stamp)
    within BURST_GAP_S of the previous one: it was sent in the same burst. Grouping two real
    steps this way only coarsens the plot: tokens over time stays exact.
TTFT stays exact: it is the first chunk's arrival, however many chunks join that event.
What each event holds:
  - text: its chunks' content, kind SERVER (servers do not say which tokens a draft made);
  - tokens: counted by the server (llama.cpp `timings.predicted_n`, vLLM/SGLang per-chunk
    `usage.completion_tokens`); ids are not streamed, so token_ids stays empty;
  - TTFT and step times: measured here, from the chunk arrival times (stamped on arrival);
  - proposed / accepted: llama.cpp's per-request `timings.draft_n` / `draft_n_accepted`
    (deltas); vLLM counts them only server-wide (`vllm:spec_decode_*`), so for the backend's
    one active request they are the counters' deltas between two polls of /metrics (every
    `poll_interval_s`, with KV usage), on the event that read them, the rest on the final
    event: a point per poll, not per server step (on a shared server, others' drafts too);
    other servers give them only in the final figures;
  - prefix hits: `timings.cache_n` or `usage.prompt_tokens_details.cached_tokens`;
  - kv_usage: polled at most every `poll_interval_s` (llama.cpp /slots, else /metrics).
A number the server does not give stays None. If the server dies mid-stream, the events
already returned stand and the next step() raises ServerDiedError.
"""
from __future__ import annotations

import json
import threading
import time
from typing import Protocol

from engine.errors import ServerAuthError, ServerDiedError, ServerRequestError, UnknownServedModelError
from engine.metrics import SERVER, PositionCounts, RequestStats, StepEvent
from engine.remote.chunk_stream import ChunkStream
from engine.remote.server_metrics import MetricsReading, request_figures

CANCEL_CHECK_S = 0.05      # how often a waiting step() looks at the cancel flag
BURST_GAP_S = 0.001        # unstamped chunks closer than this came in one burst: one event
PASS_WAIT_S = 0.05         # how long to wait for more chunks of a pass the server stamps


class RemoteHost(Protocol):
    """What a request uses of its backend (engine.remote.backend.RemoteBackend)."""
    url: str
    model: str
    served_models: list[str]
    kv_cache_dtype: str | None
    poll_interval_s: float
    drafts_per_request: bool

    def settings(self) -> dict: ...
    def kv_usage(self) -> float | None: ...
    def scrape(self) -> MetricsReading | None: ...
    def metrics_note(self) -> str | None: ...
    def request_closed(self, request: "RemoteRequest") -> None: ...


class RemoteRequest:
    def __init__(self, host: RemoteHost, stream: ChunkStream, before: MetricsReading | None):
        self.host, self.stream, self.before = host, stream, before
        self.finished = False
        self.cancelled = threading.Event()
        self.stats = RequestStats(target_passes=None, draft_time_s=None, target_time_s=None)   # not reported
        self.step_index = 0
        self.t_last = stream.t_submit
        self.counted = {"predicted_n": 0, "draft_n": 0, "draft_n_accepted": 0, "completion_tokens": 0}
        self.pending = {"tokens": 0, "proposed": 0, "accepted": 0}   # counted in chunks without text yet
        self.counts_per_chunk = False   # has the server counted the tokens of chunks with text?
        self.last_chunk: dict = {}
        self.held = None                # the item that ended the last event's burst: the next one's
        self.kv_usage: float | None = None
        self.t_polled = 0.0
        self.finish_reason: str | None = None
        self.prompt: tuple[int | None, int | None] = (None, None)   # (prompt tokens, prefix-cache hits)
        # drafts from the server-wide counters, polled (vLLM): the last reading counted
        self.drafts_from_counters = (before is not None and before.draft_tokens is not None
                                     and not host.drafts_per_request)
        self.polled = before

    # ---- the interface (engine.backend.BackendRequest) -------------------------------
    def cancel(self) -> None:
        self.cancelled.set()

    def step(self) -> StepEvent:
        if self.finished:
            raise RuntimeError("this request has finished")
        while True:
            if self.cancelled.is_set():
                return self._final_event(time.perf_counter(), "cancelled")
            item = self._next(CANCEL_CHECK_S)
            event = self._handle(item) if item is not None else None
            if event is not None:
                return event

    def close(self) -> None:
        """Drop the connection (a server aborts the request); safe to call more than once."""
        self.stream.close()
        self.finished = True
        self.host.request_closed(self)

    # ---- stream items ---------------------------------------------------------------
    def _next(self, timeout: float):
        if self.held is not None:
            item, self.held = self.held, None
            return item
        return self.stream.next(timeout)

    def _handle(self, item) -> StepEvent | None:
        kind = item[0]
        if kind == "chunk":
            text = self._chunk(item[2])
            return self._burst(item, text) if text else None
        if kind == "done":
            return self._final_event(item[1], self.finish_reason or "stop")
        self.finished = True
        if kind == "http_error":
            raise self._refused(item[1], item[2])
        raise ServerDiedError(
            f"the server at {self.host.url} stopped in the middle of the reply, after "
            f"{self.stats.generated_tokens or 0} tokens ({item[2]}). The reply so far is kept; check that "
            "the server is still running (it may have crashed or been stopped) and send the message again.")

    def _burst(self, first, text: str) -> StepEvent:
        """One event for the chunks of one server step, from `first` (a chunk with `text`,
        already read) to the last chunk that `_same_step` joins; the item after them is held."""
        texts, last = [text], first
        while True:
            wait = last[1] + (PASS_WAIT_S if _pass_stamp(last[2]) is not None else BURST_GAP_S) - time.perf_counter()
            item = self._next(max(0.0, wait))
            if item is None:
                break
            if not _same_step(last, item):
                self.held = item
                break
            texts.append(self._chunk(item[2]))
            last = item
        return self._event(last[1], "".join(texts), t_first=first[1])

    def _chunk(self, chunk: dict) -> str:
        """Read a chunk's counts and finish reason; its text ("" when it has none)."""
        self.last_chunk = chunk
        counted = self._count(chunk)
        choice = (chunk.get("choices") or [{}])[0]
        self.finish_reason = _finish_reason(choice.get("finish_reason")) or self.finish_reason
        text = (choice.get("delta") or {}).get("content") or ""
        if text:
            self.counts_per_chunk = self.counts_per_chunk or counted
        return text

    def _count(self, chunk: dict) -> bool:
        """Add this chunk's token and draft counts (cumulative in the stream) to pending;
        True when the chunk counted its tokens."""
        timings, usage = chunk.get("timings") or {}, chunk.get("usage") or {}
        self._add_delta("tokens", "predicted_n", timings.get("predicted_n"))
        self._add_delta("tokens", "completion_tokens", None if timings else usage.get("completion_tokens"))
        self._add_delta("proposed", "draft_n", timings.get("draft_n"))
        self._add_delta("accepted", "draft_n_accepted", timings.get("draft_n_accepted"))
        return "predicted_n" in timings or usage.get("completion_tokens") is not None

    def _add_delta(self, pending_key: str, counter: str, cumulative) -> None:
        if cumulative is None:
            return
        self.pending[pending_key] += max(0, int(cumulative) - self.counted[counter])
        self.counted[counter] = max(self.counted[counter], int(cumulative))

    # ---- events ---------------------------------------------------------------------
    def _event(self, t: float, text: str, finish_reason: str | None = None, t_first: float | None = None) -> StepEvent:
        """The event that ends at `t` (its last chunk's arrival); t_first: its first chunk's."""
        first = self.step_index == 0 and bool(text)      # the first token: TTFT
        kv_usage = self._poll()
        tokens = self.pending["tokens"] if self.counts_per_chunk else None
        prompt_tokens, hits = self._prompt_counts()
        event = StepEvent(
            step=self.step_index, token_ids=[], token_kinds=[], pieces=[(text, SERVER)] if text else [],
            time_s=t - self.stream.t_submit, step_time_s=t - self.t_last,
            target_time_s=None, draft_time_s=None, target_passes=None,
            proposed=self.pending["proposed"], accepted=self.pending["accepted"], accepted_per_position=[],
            kv_bytes_used=None, kv_bytes_capacity=None, kv_bytes_per_token=None, kv_dtype=self.host.kv_cache_dtype,
            prefix_hit_tokens=hits, prompt_tokens=prompt_tokens,
            generated_tokens=self._generated(tokens),
            ttft_s=((t if t_first is None else t_first) - self.stream.t_submit) if first else None,
            finished=finish_reason is not None, finish_reason=finish_reason,
            settings=self.host.settings() if self.step_index == 0 else None, token_count=tokens, kv_usage=kv_usage)
        self.pending = dict.fromkeys(self.pending, 0)
        self.t_last = t
        self.step_index += 1
        self.stats.prompt_tokens, self.stats.prefix_hit_tokens = prompt_tokens, hits
        self.stats.record_step(event)
        event.running = self.stats.as_dict()
        return event

    def _final_event(self, t: float, reason: str) -> StepEvent:
        self.finished = True
        # E2EL ends at the last token, as vLLM's client times it (not at [DONE] after it)
        self.stats.e2e_s = (self.t_last if self.step_index else t) - self.stream.t_submit
        after = self.host.scrape() if self.before is not None else None
        if self.drafts_from_counters:       # the drafts since the last poll go with this event
            self._count_drafts(after)
            self.kv_usage = after.kv_usage if after is not None else self.kv_usage
            self.t_polled = time.perf_counter()
        event = self._event(t, "", finish_reason=reason)
        figures = self._figures(after)
        event.server = figures
        self._complete_summary(figures)
        event.summary = self.stats
        event.running = self.stats.as_dict()
        return event

    def _figures(self, after: MetricsReading | None) -> dict:
        """The server's own numbers for this request (engine.remote.server_metrics), and a note
        when it exports none."""
        figures = request_figures(self.before, after) if after is not None else \
            {**request_figures(MetricsReading(), MetricsReading()), "shared_counters": None}   # all missing
        figures["metrics"] = self.host.metrics_note() or "available"
        figures["timings"] = (self.last_chunk.get("timings") or None)
        figures["usage"] = (self.last_chunk.get("usage") or None)
        return figures

    def _complete_summary(self, figures: dict) -> None:
        """Fill what only the end of the stream (or the server's counters) tells."""
        usage = self.last_chunk.get("usage") or {}
        if usage.get("completion_tokens") is not None:
            self.stats.generated_tokens = int(usage["completion_tokens"])
        if not self.counts_per_chunk and self.stats.generated_tokens:
            # only a total: every token after the first one counts as decoded
            self.stats.decode_tokens = self.stats.generated_tokens - 1
        if figures.get("drafts") is not None and figures.get("accepted_per_position"):
            self.stats.positions = PositionCounts.from_cumulative(int(figures["drafts"]),
                                                                  figures["accepted_per_position"])
        if not self.counted["draft_n"] and figures.get("draft_tokens") is not None:
            self.stats.proposed = int(figures["draft_tokens"])
            self.stats.accepted = int(figures["accepted_tokens"] or 0)

    # ---- helpers --------------------------------------------------------------------
    def _generated(self, tokens: int | None) -> int | None:
        if tokens is None:
            return None if not self.stats.generated_tokens else self.stats.generated_tokens
        return (self.stats.generated_tokens or 0) + tokens

    def _prompt_counts(self) -> tuple[int | None, int | None]:
        """(prompt tokens, of which served from the prefix cache), as last reported."""
        timings, usage = self.last_chunk.get("timings") or {}, self.last_chunk.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        if "prompt_n" in timings:
            self.prompt = (int(timings["prompt_n"]) + int(timings.get("cache_n", 0)), timings.get("cache_n"))
        elif usage.get("prompt_tokens") is not None:
            self.prompt = (usage["prompt_tokens"], details.get("cached_tokens", self.prompt[1]))
        return self.prompt

    def _poll(self) -> float | None:
        """KV usage, read at most every poll_interval_s; with it, where drafts are counted
        server-wide only, the drafts since the last reading (into pending)."""
        now = time.perf_counter()
        if now - self.t_polled >= self.host.poll_interval_s:
            self.t_polled = now
            if self.drafts_from_counters:
                reading = self.host.scrape()
                self._count_drafts(reading)
                self.kv_usage = reading.kv_usage if reading is not None else None
            else:
                self.kv_usage = self.host.kv_usage()
        return self.kv_usage

    def _count_drafts(self, reading: MetricsReading | None) -> None:
        if reading is None or reading.draft_tokens is None or self.polled is None:
            return
        self.pending["proposed"] += max(0, int(reading.draft_tokens - (self.polled.draft_tokens or 0)))
        self.pending["accepted"] += max(0, int((reading.accepted_tokens or 0) - (self.polled.accepted_tokens or 0)))
        self.polled = reading

    def _refused(self, status: int, body: str):
        message = _error_message(body)
        if status in (401, 403):
            return ServerAuthError(f"the server refused the API key (HTTP {status}: {message}); check the key in the "
                                   "environment variable named for it, then send again")
        if status == 404 and "model" in message.lower():
            return UnknownServedModelError(
                f"the server does not serve the model {self.host.model!r} ({message}); it serves: "
                f"{', '.join(self.host.served_models)}. Choose one of those.")
        return ServerRequestError(f"the server refused the request (HTTP {status}): {message}. "
                                  "Change the request (shorter conversation, other settings) or check the server's log.")


def _pass_stamp(chunk: dict):
    """Which server pass made the chunk, where the server says: llama.cpp's cumulative
    timings.predicted_ms, the same for every token of a pass. None: not stamped."""
    return (chunk.get("timings") or {}).get("predicted_ms")


def _same_step(last, item) -> bool:
    """Does stream item `item` belong to the step that chunk `last` is part of?"""
    if item[0] != "chunk":
        return False
    stamp, last_stamp = _pass_stamp(item[2]), _pass_stamp(last[2])
    if stamp is not None and last_stamp is not None:
        return stamp == last_stamp
    return item[1] - last[1] < BURST_GAP_S


def _finish_reason(reason: str | None) -> str | None:
    return {"stop": "stop", "length": "length", "eos": "stop"}.get(reason, reason) if reason else None


def _error_message(body: str) -> str:
    try:
        error = json.loads(body).get("error", body)
        return error.get("message", str(error)) if isinstance(error, dict) else str(error)
    except (ValueError, AttributeError):
        return body.strip()[:300] or "no message"
