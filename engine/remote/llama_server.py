"""LlamaServer: a llama.cpp `llama-server` process on 127.0.0.1, for the integration tests
and `python -m engine.bench peer`.

    with LlamaServer(gguf, draft=gguf, metrics=True) as server:
        backend = RemoteBackend(server.url)

The binary comes from scripts/build_llama_server.sh (engine.remote.llama_server_binary).
`parallel` is llama-server's --parallel: that many slots, each serving one request at a time
(the rest wait). llama-server splits --ctx-size across its slots, so `ctx_size` here is the
context of ONE slot and the server gets ctx_size x parallel. The process gets a free port,
its output goes to a log file (quoted when it fails to start), and it is terminated (then
killed) on exit (engine.remote.server_process).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

from engine import cpu_features
from engine.remote.llama_server_binary import BUILD_SCRIPT, binary, built_with
from engine.remote.server_process import HOST, ServerProcess

SPEC_TYPE = "draft-simple"
DEFAULT_KV_CACHE_TYPE = "f16"      # llama-server's -ctk / -ctv when not given
KV_CACHE_LINE = re.compile(r"K \((\w+)\):.*V \((\w+)\):")   # llama_kv_cache: ..., K (f16): 45.00 MiB, V (f16): ...


class LlamaServer(ServerProcess):
    name = "llama-server"
    log_prefix = "llama-server-"

    def __init__(self, gguf: str | os.PathLike, *, draft: str | os.PathLike | None = None, draft_max: int = 4,
                 metrics: bool = True, slots: bool = True, slot_save_path: str | os.PathLike | None = None,
                 ctx_size: int = 2048, parallel: int = 1, threads: int | None = None, extra: tuple[str, ...] = ()):
        super().__init__([])
        self.threads = threads or os.cpu_count() or 1
        self.args = [str(binary()), "-m", str(gguf), "--host", HOST, "--port", str(self.port),
                     "-c", str(ctx_size * parallel), "--parallel", str(parallel), "-t", str(self.threads)]
        if draft is not None:
            self.args += ["-md", str(draft), "--spec-type", SPEC_TYPE, "--spec-draft-n-max", str(draft_max)]
        self.args += ["--metrics"] if metrics else []
        self.args += ["--slots"] if slots else ["--no-slots"]
        self.args += ["--slot-save-path", str(slot_save_path)] if slot_save_path else []
        self.args += list(extra)

    def exit_reason(self, returncode: int) -> str:
        """Why llama-server stopped while starting, naming the signal and, for a crash on an
        instruction, what the binary was built for against what this CPU has."""
        said = super().exit_reason(returncode)
        path = self.args[0]
        if returncode == -signal.SIGILL:
            said += (f" (illegal instruction): it was built with {built_with(Path(path))}, and this CPU is "
                     f"{cpu_features.isa_name()} ({' '.join(cpu_features.simd_flags())}). Remove "
                     f"{Path(path).parent.parent} and run `bash {BUILD_SCRIPT}` on this machine to build it for this CPU")
        return said

    def kv_cache_types(self) -> str:
        """The KV cache's K and V types as the server logged them ("f16" when both are), or
        its default with the reason when the log does not say."""
        found = KV_CACHE_LINE.findall(self.log.read_text(errors="replace")) if self.log.exists() else []
        if not found:
            return f"{DEFAULT_KV_CACHE_TYPE} (llama-server's default; its log did not name it)"
        key, value = found[0]
        return key if key == value else f"K {key}, V {value}"

    def version(self) -> str:
        """`llama-server --version` (the build number and commit)."""
        done = subprocess.run([self.args[0], "--version"], capture_output=True, text=True, timeout=30)
        return (done.stdout + done.stderr).strip().splitlines()[0] if (done.stdout + done.stderr).strip() else "unknown"
