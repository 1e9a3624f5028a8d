"""How the engine's CPU threads share the machine with other programs.

torch's CPU kernels run on OpenMP threads that meet at a barrier after every parallel op,
and GNU OpenMP spins there (about 300,000 turns) before it sleeps. On an idle machine that
is the fastest way to decode. On a busy one it is the slowest: when another program holds
one of two cores, the thread that shares its core runs half the time, in slices of
milliseconds, and every op waits for it (issue #20: steps from 25 ms to 1,460 ms).

Measured on the 2-core AVX-512 machine (2026-12-01), SmolLM2-135M fp32, decode tok/s quiet /
beside one spinning process: libgomp's default 32.6 / 10.2; OMP_WAIT_POLICY=PASSIVE
22.8 / 21.3 (every barrier sleeps and wakes: a third slower when quiet); GOMP_SPINCOUNT 3,000
27.5 / 12.3; one thread 23.1 / 21.8. No wait policy is good at both. So the policy is:
keep OpenMP's default wait, and run as many threads as there are cores that other programs
leave free (`ThreadGovernor`, asked once per engine step, sampling at most every
SAMPLE_S): a busy core costs its thread, not every op. A thread count the user set
(OMP_NUM_THREADS, torch.set_num_threads before the engine starts) is the most it uses.

The thread count never changes a reply: every kernel on the path splits work by output
columns or rows, never by the reduction (tests/test_cpu_fallbacks.py checks tokens and
logits at one thread and at two). Nor does a change cost a compile: the compiled step's one
graph runs at whatever count torch has (engine.runtime.compiled_step; tests/test_compiled_step.py
moves the count between steps of a reply and counts no compile).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

SAMPLE_S = 0.25         # how often the governor looks at the machine
AGREE = 2               # samples in a row that must agree before the count changes


def runnable_elsewhere() -> int:
    """Threads of other processes that are running or waiting for a core right now: the
    machine's runnable count (/proc/loadavg) less this process's own runnable threads."""
    try:
        total = int(Path("/proc/loadavg").read_text().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return 0
    ours = 0
    for task in Path("/proc/self/task").iterdir():
        try:
            state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        ours += state == "R"
    return max(0, total - ours)


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


# (the count a governor last set, the most that governor allowed): a count an earlier engine's
# governor lowered is not a count the user chose
_last_set: tuple[int, int] | None = None


def starting_threads() -> int:
    """The most threads a new engine may use: torch's count, unless an earlier engine's
    governor lowered it (its program left since, or the engine is gone), then the count that
    governor started from, restored."""
    import torch
    now = torch.get_num_threads()
    if _last_set is not None and _last_set[0] == now and _last_set[1] != now:
        torch.set_num_threads(_last_set[1])
        return _last_set[1]
    return now


def choose_threads(count: int) -> None:
    """Run torch with `count` threads because the user chose it (OMP_NUM_THREADS, the app on
    their behalf): the next engine starts from it, even where an earlier engine's governor had
    lowered torch's count to the same number (starting_threads would restore that one)."""
    import torch
    global _last_set
    torch.set_num_threads(count)
    _last_set = None


class ThreadGovernor:
    """torch's thread count follows the cores other programs leave free, between `most`
    (the count when the engine started) and 1."""

    def __init__(self, most: int, sample=runnable_elsewhere, clock=time.monotonic, cores: int | None = None):
        self.most, self.sample, self.clock = max(1, most), sample, clock
        self.cores = cores or usable_cores()
        self.threads = self.most
        self.busy_cores = 0
        self._last = float("-inf")
        self._pending: tuple[int, int] | None = None    # (threads wanted, samples that agreed)

    def tick(self) -> bool:
        """Look at the machine if SAMPLE_S passed; True when the thread count changed."""
        now = self.clock()
        if now - self._last < SAMPLE_S:
            return False
        self._last = now
        busy = min(self.sample(), self.cores - 1)
        wanted = max(1, min(self.most, self.cores - busy))
        if wanted == self.threads:
            self._pending = None
            return False
        agreed = self._pending[1] + 1 if self._pending and self._pending[0] == wanted else 1
        self._pending = (wanted, agreed)
        if agreed < AGREE:
            return False
        import torch
        global _last_set
        torch.set_num_threads(wanted)
        _last_set = (wanted, self.most)
        self.threads, self.busy_cores, self._pending = wanted, busy, None
        return True

    def describe(self) -> str:
        if self.threads == self.most:
            return f"{self.threads} (OpenMP's default wait; fewer while other programs keep cores busy)"
        return f"{self.threads} of {self.most}: other programs keep {self.busy_cores} of {self.cores} cores busy"
