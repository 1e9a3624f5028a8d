"""ChunkStream: one streamed /v1/chat/completions call, read on a background thread.

The thread stamps each server-sent event with its arrival time (so TTFT and decode speed
are what the network delivered, whatever the consumer does between steps) and queues it.
`next(timeout)` hands the items over in order: ("chunk", t, json), then exactly one of
("done", t) after [DONE], ("http_error", status, body), ("lost", t, reason) when the
connection broke or the stream ended without [DONE].
SSE framing is httpx-sse's; this file only moves its events across threads.
"""
from __future__ import annotations

import json
import queue
import threading
import time

import httpx
from httpx_sse import SSEError, connect_sse

CHAT_PATH = "/v1/chat/completions"
DONE = "[DONE]"


class ChunkStream:
    def __init__(self, client: httpx.Client, body: dict):
        self.items: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._response: httpx.Response | None = None
        self.t_submit = time.perf_counter()
        self._thread = threading.Thread(target=self._read, args=(client, body), name="chunk-stream", daemon=True)
        self._thread.start()

    def next(self, timeout: float):
        """The next item, or None when none arrived within timeout seconds."""
        try:
            return self.items.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        """Stop reading and drop the connection (the server then aborts the request)."""
        self._stop.set()
        response = self._response
        if response is not None:
            response.close()
        self._thread.join(timeout=5)

    def _read(self, client: httpx.Client, body: dict) -> None:
        try:
            with connect_sse(client, "POST", CHAT_PATH, json=body) as source:
                self._response = source.response
                if source.response.status_code != 200:
                    self.items.put(("http_error", source.response.status_code, source.response.read().decode(errors="replace")))
                    return
                self._pump(source)
        except (httpx.HTTPError, SSEError, ValueError) as e:
            if not self._stop.is_set():
                self.items.put(("lost", time.perf_counter(), f"{type(e).__name__}: {e}"))

    def _pump(self, source) -> None:
        for sse in source.iter_sse():
            now = time.perf_counter()
            if self._stop.is_set():
                return
            if sse.data.strip() == DONE:
                self.items.put(("done", now))
                return
            self.items.put(("chunk", now, json.loads(sse.data)))
        if not self._stop.is_set():
            self.items.put(("lost", time.perf_counter(), "the stream ended without [DONE]"))
