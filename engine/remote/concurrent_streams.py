"""Many requests at once against a remote server: N concurrent streams, and the server's load.

    run = run_streams(backend, jobs, max_concurrency=4)    # jobs: .arrival_s, .prompt, .max_tokens
    serving_summary(run.summaries, run.duration_s)          # engine.metrics, as for the local engine

Each job is sent at its arrival time, at most `max_concurrency` outstanding (the others wait,
first come first served, as vLLM's bench serve waits on its semaphore), on a thread of its own
that steps one RemoteRequest (RemoteBackend.open_stream) to the end; the requests share the
backend's httpx client. The client-side timings (TTFT, ITL, E2EL) come from the chunk arrival
times each request's reader thread stamps, so they do not depend on when these threads run.
Greedy, EOS ignored (`ignore_eos`), as the local engine's workload.

While the streams run, a sampler asks the server for its load every `sample_interval_s`
(RemoteBackend.server_load: /metrics running / waiting / KV usage for vLLM and SGLang,
/slots and /metrics for llama.cpp). A request the server refuses, or a stream that breaks, is
counted in `failures` with its message; the others go on.
"""
from __future__ import annotations

import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from engine.config import SamplingParams
from engine.errors import ServerError
from engine.metrics import RequestStats

SAMPLE_INTERVAL_S = 0.25
LOAD_FIELDS = ("running", "waiting", "kv_usage")


@dataclass
class StreamsRun:
    summaries: list[RequestStats]              # the requests that finished, in finishing order
    failures: list[str]                        # one message per request that failed
    duration_s: float                          # first submission to the last request's end
    samples: list[dict] = field(default_factory=list)   # server_load() readings with "t_s"

    def load(self) -> dict:
        """The sampled server load: max_ and mean_ of running, waiting and kv_usage over the
        readings taken during the run (None where the server does not report one, or the run
        was shorter than one interval), how many, and preemptions (the server's counter after
        the run minus before it)."""
        during = [s for s in self.samples if not s["edge"]]
        out: dict = {"samples": len(during)}
        for name in LOAD_FIELDS:
            values = [s[name] for s in during if s.get(name) is not None]
            out[f"max_{name}"] = max(values) if values else None
            out[f"mean_{name}"] = statistics.fmean(values) if values else None
        counters = [s["preemptions"] for s in self.samples if s.get("preemptions") is not None]
        out["preemptions"] = counters[-1] - counters[0] if len(counters) > 1 else None
        return out


def run_streams(backend, jobs, max_concurrency: int, sample_interval_s: float = SAMPLE_INTERVAL_S) -> StreamsRun:
    """Serve every job on `backend` (engine.remote.backend.RemoteBackend); see the module docstring."""
    pending = sorted(jobs, key=lambda j: j.arrival_s)
    summaries, failures, lock = [], [], threading.Lock()

    def serve(job) -> None:
        try:
            summary = _stream_to_end(backend, job)
        except ServerError as e:
            with lock:
                failures.append(str(e))
            return
        with lock:
            summaries.append(summary)

    sampler = LoadSampler(backend, sample_interval_s)
    sampler.sample(edge=True)             # the counters' baseline, before the clock starts
    t0 = time.perf_counter()
    sampler.start(t0)
    try:
        with ThreadPoolExecutor(max_workers=max(1, min(max_concurrency, len(pending))),
                                thread_name_prefix="stream") as pool:
            for job in pending:
                time.sleep(max(0.0, t0 + job.arrival_s - time.perf_counter()))
                pool.submit(serve, job)
        duration = time.perf_counter() - t0
    finally:
        sampler.stop()
    return StreamsRun(summaries, failures, duration, sampler.samples)


def _stream_to_end(backend, job) -> RequestStats:
    request = backend.open_stream(job.prompt, SamplingParams(max_tokens=job.max_tokens, stop_on_eos=False))
    try:
        event = None
        while not request.finished:
            event = request.step()
        return event.summary
    finally:
        request.close()


class LoadSampler:
    """server_load() every interval on a thread of its own from start() to stop(), plus the
    readings at the edges (`edge`: one taken before the run, one at stop(); the counters'
    baseline and end; the gauges count the readings taken while it ran)."""

    def __init__(self, backend, interval_s: float):
        self.backend, self.interval_s = backend, interval_s
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="server-load", daemon=True)
        self.t0 = time.perf_counter()

    def start(self, t0: float) -> None:
        self.t0 = t0
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.sample(edge=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self, edge: bool = False) -> None:
        try:
            load = self.backend.server_load()
        except ServerError:         # a missed reading; the streams report a dead server themselves
            return
        self.samples.append({"t_s": time.perf_counter() - self.t0, "edge": edge, **load})
