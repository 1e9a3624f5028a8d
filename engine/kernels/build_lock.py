"""One build of our CPU kernel library at a time, and never a wait on a build that died.

torch.utils.cpp_extension marks a build in progress with a file named `lock` in the build
folder (created with O_EXCL, removed when the build ends), and every other process waits
while that file exists, with no limit. A build killed midway (SIGKILL, a closed terminal, a
machine that lost power) leaves it behind, and every later load of the library then hangs.

So each build first takes our own lock, `build.lock` in the same folder: an flock (the
filelock package), which the operating system releases when its holder dies, however it
dies. A process holding ours is the only builder, so a torch `lock` it finds was left by a
build that died: it is removed, with a message on stderr, and the build runs again. A
holder that keeps ours longer than any build takes (`STALE_AFTER_S`) is taken to be hung:
the next process takes the build over, also with a message, rather than wait on it.
"""
from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock, Timeout

TORCH_LOCK = "lock"           # torch.utils.cpp_extension's (torch.utils.file_baton.FileBaton)
OUR_LOCK = "build.lock"
OWNER = "build.owner"         # the pid of the process that last took our lock, for the messages
# A full build of the library takes about 45 s on 2 cores; no build takes a quarter of an hour.
STALE_AFTER_S = 15 * 60


@contextmanager
def build_lock(folder: Path, stale_after_s: float | None = None):
    """Hold the build folder's lock for a build (or a load, which may rebuild) in `folder`;
    wait for a live builder at most `stale_after_s` (default STALE_AFTER_S), never forever."""
    stale_after_s = STALE_AFTER_S if stale_after_s is None else stale_after_s
    lock = FileLock(folder / OUR_LOCK)
    try:
        lock.acquire(timeout=stale_after_s)
        held = True
    except Timeout:
        say(f"the build of our CPU kernels in {folder} has been held by {_owner(folder)} for more than "
            f"{stale_after_s:.0f} s, longer than a build takes: taking it over")
        held = False
    try:
        _clear_dead_build(folder, why="its process is gone" if held else "its process is hung")
        (folder / OWNER).write_text(f"{os.getpid()}\n")
        yield
    finally:
        if held:
            lock.release()


def _clear_dead_build(folder: Path, why: str) -> None:
    stale = folder / TORCH_LOCK
    try:
        age_s = time.time() - stale.stat().st_mtime
    except FileNotFoundError:
        return
    say(f"a build of our CPU kernels did not finish ({_owner(folder)}, {age_s:.0f} s ago; {why}): removing its "
        f"lock {stale} and building again")
    stale.unlink(missing_ok=True)


def _owner(folder: Path) -> str:
    try:
        return f"pid {int((folder / OWNER).read_text())}"
    except (OSError, ValueError):
        return "a process that did not say which"


def say(message: str) -> None:
    print(f"engine.kernels: {message}", file=sys.stderr, flush=True)
