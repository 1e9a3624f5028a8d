"""Busy cores for `bench peer --busy-cores N`: N processes that spin on the CPU, as other
programs on a user's machine do, each stopping by itself after a deadline (and stopped
earlier when the measurement ends).

A user's desktop runs a browser, an IDE, a build beside the app. OpenMP threads that spin
while they wait for each other lose their core to such a process for a whole time slice:
on 2 cores under load a decode step went from 25 ms to 1,460 ms (issue #20). The thread
policy (engine.thread_policy) is what keeps that in check; this is how it is measured.
"""
from __future__ import annotations

import subprocess
import sys

from engine.remote.server_process import dies_with_parent

SPIN = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"


class BusyCores:
    """with BusyCores(n): n spinning processes for the block's duration (at most max_s)."""

    def __init__(self, count: int, max_s: float = 600.0):
        self.count, self.max_s = count, max_s
        self.processes: list[subprocess.Popen] = []

    def __enter__(self) -> "BusyCores":
        code = SPIN.format(seconds=self.max_s)
        self.processes = [subprocess.Popen(dies_with_parent([sys.executable, "-c", code])) for _ in range(self.count)]
        return self

    def __exit__(self, *exc) -> None:
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        self.processes = []
