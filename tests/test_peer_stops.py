"""Every server a bench or test starts is stopped, however the process that started it ends
(issue 48: a `bench peer` stopped by `timeout` left its llama-server running, orphaned, at a
whole core). And the busy scenario ends in time, cutting what would not finish.

The first two tests run the real llama-server (scripts/build_llama_server.sh builds it)."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine.bench import peer as peer_bench

ROOT = Path(__file__).resolve().parent.parent


def children_named(parent: int, name: str) -> list[int]:
    """Pids of live processes whose parent is `parent` and whose program is `name`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            comm = stat.read_text().split("(", 1)[1].rsplit(")", 1)[0]
        except (OSError, IndexError):
            continue
        if int(fields[1]) == parent and comm == name[:15] and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_for(predicate, timeout_s: float, what: str):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        found = predicate()
        if found:
            return found
        time.sleep(0.2)
    pytest.fail(f"waited {timeout_s:g} s for {what}")


def wait_gone(pid: int, timeout_s: float = 30.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and alive(pid):
        time.sleep(0.1)
    return not alive(pid)


@pytest.fixture
def llama_server_binary():
    from engine.errors import LlamaServerMissingError
    from engine.remote.llama_server_binary import binary
    try:
        return binary()
    except LlamaServerMissingError as e:
        pytest.fail(str(e))          # CI builds it (scripts/test.sh runs the build script)


def test_a_bench_peer_stopped_by_sigterm_leaves_no_server(llama_server_binary):
    """`kill -TERM` of a running `bench peer` while its llama-server serves: the bench ends
    with 143 and the server is gone."""
    bench = subprocess.Popen([sys.executable, "-m", "engine.bench", "peer", "--prompts", "1", "--tokens", "4",
                              "--compile", "off", "--dtype", "float32", "--json"],
                             cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        server = wait_for(lambda: children_named(bench.pid, "llama-server"), 600, "bench peer to start llama-server")[0]
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=60) == 128 + signal.SIGTERM
        assert wait_gone(server), f"llama-server {server} outlived the bench stopped by SIGTERM"
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()


START_AND_HANG = """
import sys, time
from engine.loading.loader import default_gguf_path
from engine.remote.llama_server import LlamaServer
server = LlamaServer(default_gguf_path(), threads=1, metrics=False).start()
print(server.process.pid, flush=True)
time.sleep(600)
"""


def test_a_server_dies_with_the_process_that_started_it_even_by_sigkill(llama_server_binary):
    """SIGKILL runs no handler at all: the kernel's parent-death signal (setpriv --pdeathsig)
    is what stops the server then."""
    owner = subprocess.Popen([sys.executable, "-c", START_AND_HANG], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        server = int(owner.stdout.readline())
        assert alive(server)
        owner.kill()
        owner.wait(timeout=30)
        assert wait_gone(server), f"llama-server {server} outlived its parent killed by SIGKILL"
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()


# ---- the busy scenario's time bound, on stand-in backends and a stand-in clock --------------
class Clock:
    def __init__(self):
        self.now = 0.0

    def monotonic(self):
        return self.now


class SlowRequest:
    """A reply of `tokens` tokens, each step one token and `step_s` seconds of the clock."""

    def __init__(self, clock, tokens, step_s):
        self.clock, self.left, self.step_s = clock, tokens, step_s
        self.finished, self.cancelled, self.closed, self.decoded = False, False, False, 0

    def step(self):
        self.clock.now += self.step_s
        if self.cancelled or self.left == 1:
            self.finished = True
        self.left -= 1
        self.decoded += 1
        summary = SimpleNamespace(decode_tokens=self.decoded, cancelled=self.cancelled) if self.finished else None
        return SimpleNamespace(summary=summary)

    def cancel(self):
        self.cancelled = True

    def close(self):
        self.closed = True


class SlowBackend:
    def __init__(self, clock, tokens, step_s):
        self.clock, self.tokens, self.step_s, self.requests = clock, tokens, step_s, []

    def start(self, prompt, params):
        self.requests.append(SlowRequest(self.clock, self.tokens, self.step_s))
        return self.requests[-1]


@pytest.mark.parametrize("tokens, until, counts, decoded", [
    # the first reply overruns: cancelled at 30 s (its last step counted), the others never start
    (100, 30.0, {"finished": 0, "cut": 1, "not_started": 2}, [31]),
    (10, 100.0, {"finished": 3, "cut": 0, "not_started": 0}, [10, 10, 10]),
], ids=["past-its-share", "within-its-share"])
def test_replies_run_until_their_share_ends(monkeypatch, tokens, until, counts, decoded):
    clock = Clock()
    monkeypatch.setattr(peer_bench, "time", clock)
    backend = SlowBackend(clock, tokens=tokens, step_s=1.0)
    stats, said = peer_bench._replies_until(backend, ["a", "b", "c"], None, until=until)
    assert said == counts
    assert [s.decode_tokens for s in stats] == decoded
    assert [s.cancelled for s in stats] == [counts["cut"] > 0] * len(stats)
    assert len(backend.requests) == 3 - counts["not_started"] and all(r.closed for r in backend.requests)


def test_without_a_working_setpriv_a_server_runs_as_it_is(monkeypatch):
    """The parent-death signal is tried before it is relied on: where setpriv is missing or
    refuses, the command is started unchanged (atexit and the bench's signals still stop it)."""
    from engine.remote import server_process
    server_process._setpriv.cache_clear()
    monkeypatch.setattr(server_process.shutil, "which", lambda name: None)
    try:
        assert server_process.dies_with_parent(["llama-server", "-m", "x"]) == ["llama-server", "-m", "x"]
        server_process._setpriv.cache_clear()
        monkeypatch.setattr(server_process.shutil, "which", lambda name: "/bin/false")      # refuses
        assert server_process.dies_with_parent(["llama-server"]) == ["llama-server"]
    finally:
        server_process._setpriv.cache_clear()


def test_where_setpriv_runs_the_server_is_wrapped_in_it():
    from engine.remote import server_process
    setpriv = server_process._setpriv()
    if setpriv is None:
        pytest.skip("setpriv --pdeathsig does not run here")
    assert server_process.dies_with_parent(["llama-server"]) == [setpriv, "--pdeathsig", "KILL", "--", "llama-server"]
