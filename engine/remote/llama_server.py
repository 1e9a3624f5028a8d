"""LlamaServer: a llama.cpp `llama-server` process on 127.0.0.1, for the integration tests
and `python -m engine.bench peer`.

    with LlamaServer(gguf, draft=gguf, metrics=True) as server:
        backend = RemoteBackend(server.url)

The binary comes from scripts/build_llama_server.sh (engine.remote.llama_server_binary).
`parallel` is llama-server's --parallel: that many slots, each serving one request at a time
(the rest wait). llama-server splits --ctx-size across its slots, so `ctx_size` here is the
context of ONE slot and the server gets ctx_size x parallel. The process gets a free port,
its output goes to a log file (quoted when it fails to start), and it is terminated (then
killed) on exit.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from engine import cpu_features
from engine.errors import WorkbenchError
from engine.remote.llama_server_binary import BUILD_SCRIPT, binary, built_with

HOST = "127.0.0.1"
SPEC_TYPE = "draft-simple"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def exit_reason(returncode: int, path: str) -> str:
    """Why llama-server stopped while starting, naming the signal and, for a crash on an
    instruction, what the binary was built for against what this CPU has."""
    if returncode >= 0:
        return f"llama-server exited with code {returncode} while starting"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    said = f"llama-server ({path}) was killed by {name} while starting"
    if -returncode == signal.SIGILL:
        said += (f" (illegal instruction): it was built with {built_with(Path(path))}, and this CPU is "
                 f"{cpu_features.isa_name()} ({' '.join(cpu_features.simd_flags())}). Remove "
                 f"{Path(path).parent.parent} and run `bash {BUILD_SCRIPT}` on this machine to build it for this CPU")
    return said


class LlamaServer:
    def __init__(self, gguf: str | os.PathLike, *, draft: str | os.PathLike | None = None, draft_max: int = 4,
                 metrics: bool = True, slots: bool = True, slot_save_path: str | os.PathLike | None = None,
                 ctx_size: int = 2048, parallel: int = 1, threads: int | None = None, extra: tuple[str, ...] = ()):
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.args = [str(binary()), "-m", str(gguf), "--host", HOST, "--port", str(self.port),
                     "-c", str(ctx_size * parallel), "--parallel", str(parallel),
                     "-t", str(threads or os.cpu_count() or 1)]
        if draft is not None:
            self.args += ["-md", str(draft), "--spec-type", SPEC_TYPE, "--spec-draft-n-max", str(draft_max)]
        self.args += ["--metrics"] if metrics else []
        self.args += ["--slots"] if slots else ["--no-slots"]
        self.args += ["--slot-save-path", str(slot_save_path)] if slot_save_path else []
        self.args += list(extra)
        self.process: subprocess.Popen | None = None
        self.log = Path(tempfile.mkstemp(prefix="llama-server-", suffix=".log")[1])

    def start(self, timeout_s: float = 120.0) -> "LlamaServer":
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise WorkbenchError(f"{exit_reason(self.process.returncode, self.args[0])}; "
                                     f"its log ends with:\n{self.log_tail()}")
            if self._healthy():
                return self
            time.sleep(0.2)
        self.stop()
        raise WorkbenchError(f"llama-server did not become ready within {timeout_s:g} s; its log ends with:\n"
                             f"{self.log_tail()}")

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def kill(self) -> None:
        """SIGKILL, as a crash would (the tests' server-dies-mid-stream case)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def version(self) -> str:
        """`llama-server --version` (the build number and commit)."""
        done = subprocess.run([self.args[0], "--version"], capture_output=True, text=True, timeout=30)
        return (done.stdout + done.stderr).strip().splitlines()[0] if (done.stdout + done.stderr).strip() else "unknown"

    def __enter__(self) -> "LlamaServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        self.log.unlink(missing_ok=True)
