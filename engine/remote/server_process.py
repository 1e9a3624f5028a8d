"""ServerProcess: a local inference server started on 127.0.0.1 for the integration tests,
`python -m engine.bench peer` and the screenshots (engine.remote.llama_server,
engine.remote.vllm_server are its two kinds).

    with SomeServer(...) as server:        # start(): a free port, ready when /health is 200
        backend = RemoteBackend(server.url)

The process runs in its own process group, so stopping it stops what it started too (vLLM
runs its engine core in a child process, whose idle loop spins a core if left behind). Its
output goes to a log file, quoted when it fails to start. `progress`, when given, hears
the command, then every PROGRESS_EVERY_S while the server starts (vLLM takes minutes): the
time so far and the log's last line. Stopping terminates the group (then kills it); `kill()` is SIGKILL,
as a crash would be.

A server never outlives the process that started it (issue 48: a `bench peer` stopped by
`timeout` left its llama-server running, orphaned, at a whole core):
  - the server is started under `setpriv --pdeathsig KILL` where util-linux has it (Linux), so
    the kernel kills it when its parent dies, however the parent died (SIGKILL included);
  - every running server is stopped at interpreter exit (`atexit`), which covers an exception
    or a SystemExit that no `with` block caught;
  - the bench's command line turns SIGTERM into SystemExit (engine.bench.cli), so `with` blocks
    unwind and each server is stopped in order.
The death signal follows the thread that started the server: start servers from a thread that
lives as long as they do (the tests, the bench and the screenshots start them on the main thread).
"""
from __future__ import annotations

import atexit
import functools
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable

import httpx

from engine.errors import WorkbenchError

HOST = "127.0.0.1"
PROGRESS_EVERY_S = 15.0
STOP_WAIT_S = 20.0


_RUNNING: set["ServerProcess"] = set()     # started and not yet stopped


def dies_with_parent(args: list[str]) -> list[str]:
    """`args` run so that the kernel kills the process when its parent dies (SIGKILL): util-linux's
    `setpriv --pdeathsig KILL` execs the command in place, so the pid and the process group stay
    the command's. Where it is missing or refuses (not Linux, a util-linux older than 2.33), the
    command as it is: atexit and the bench's signal handling still stop it."""
    setpriv = _setpriv()
    return [setpriv, "--pdeathsig", "KILL", "--", *args] if setpriv else list(args)


@functools.cache
def _setpriv() -> str | None:
    """setpriv's path where `setpriv --pdeathsig KILL -- true` runs here (tried once per process)."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return None
    try:
        tried = subprocess.run([setpriv, "--pdeathsig", "KILL", "--", "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return setpriv if tried.returncode == 0 else None


@atexit.register
def _stop_all() -> None:
    for server in list(_RUNNING):
        server.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class ServerProcess:
    name = "server"                  # what the messages call it
    log_prefix = "server-"

    def __init__(self, args: list[str], env: dict[str, str] | None = None,
                 progress: Callable[[str], None] | None = None):
        self.progress = progress
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.args, self.env = args, env
        self.process: subprocess.Popen | None = None
        self.log = Path(tempfile.mkstemp(prefix=self.log_prefix, suffix=".log")[1])

    def start(self, timeout_s: float = 120.0) -> "ServerProcess":
        progress = self.progress
        if progress is not None:
            progress(f"starting {self.name}: {' '.join(self.args)}")
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(dies_with_parent(self.args), stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True,
                                            env=None if self.env is None else {**os.environ, **self.env})
        _RUNNING.add(self)
        started = time.monotonic()
        told = started
        while time.monotonic() - started < timeout_s:
            if self.process.poll() is not None:
                returncode = self.process.returncode
                self._stop_group()
                raise WorkbenchError(f"{self.exit_reason(returncode)}; its log ({self.log}) ends with:\n"
                                     f"{self.log_tail()}")
            if self._healthy():
                return self
            if progress is not None and time.monotonic() - told >= PROGRESS_EVERY_S:
                told = time.monotonic()
                progress(f"{self.name} starting ({told - started:.0f} s): {self.log_tail(1)[:160]}")
            time.sleep(0.5)
        self.stop()
        raise WorkbenchError(f"{self.name} did not become ready within {timeout_s:g} s; its log ({self.log}) "
                             f"ends with:\n{self.log_tail()}")

    def exit_reason(self, returncode: int) -> str:
        """Why the server stopped while starting (a kind may say more)."""
        if returncode >= 0:
            return f"{self.name} exited with code {returncode} while starting"
        try:
            signal_name = signal.Signals(-returncode).name
        except ValueError:
            signal_name = f"signal {-returncode}"
        return f"{self.name} ({self.args[0]}) was killed by {signal_name} while starting"

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def kill(self) -> None:
        """SIGKILL to the whole group, as a crash would (the tests' server-dies-mid-stream case)."""
        if self.process is not None and self.process.poll() is None:
            self._signal_group(signal.SIGKILL)
            self.process.wait(timeout=10)
        self._stop_group()

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.process.wait(timeout=10)
        self._stop_group()

    def _stop_group(self) -> None:
        """Whatever the server started and left behind goes too."""
        self._signal_group(signal.SIGKILL)
        _RUNNING.discard(self)

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.process.pid, sig)       # the group's id is the leader's pid
        except (ProcessLookupError, PermissionError):
            pass

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        self.log.unlink(missing_ok=True)
