"""A build of our CPU kernels killed midway does not make the next load wait forever.

torch's build lock (a `lock` file in the build folder) outlives a build killed with SIGKILL,
and torch waits while it exists. engine.kernels.build_lock recognises such a lock (its
builder is gone, or has held the build longer than any build takes) and takes it over with
a message. Each process here builds a tiny library (one small .cpp in place of ours) into
its own WORKBENCH_CACHE_DIR, so a test takes seconds, not the full build's minute; every
process runs under a timeout, so a wait that never ends fails the test instead of hanging it.
"""
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from filelock import FileLock
from torch.utils.cpp_extension import get_cxx_compiler

REPO = Path(__file__).resolve().parent.parent
LOAD_TIMEOUT_S = 120        # a tiny build takes a few seconds; a process still waiting then never ends

# In a fresh process: build the tiny library as cpu_linear.load() builds ours. With "hang",
# the build stops inside torch's lock, as a compile in progress does, until it is killed.
BUILD = textwrap.dedent("""
    import sys
    from pathlib import Path
    from engine.kernels import build_lock, cpu_linear
    cpu_linear.SOURCES, cpu_linear.HEADERS = [Path(sys.argv[1])], []
    if len(sys.argv) > 3:
        build_lock.STALE_AFTER_S = float(sys.argv[3])
    if sys.argv[2] == "hang":
        import time
        import torch.utils.cpp_extension as cpp_extension
        def compiling(*args, **kwargs):
            print("compiling", flush=True)
            time.sleep(600)
        cpp_extension._write_ninja_file_and_build_library = compiling
    cpu_linear.load()
    print("loaded", cpu_linear.build_dir() / cpu_linear.build_tag(), flush=True)
""")


@pytest.fixture
def tiny_build(tmp_path):
    try:
        get_cxx_compiler()
    except Exception as error:        # noqa: BLE001 - no compiler: no build to kill
        pytest.skip(f"no C++ compiler here: {error}")
    source = tmp_path / "tiny.cpp"
    source.write_text("extern \"C\" int workbench_tiny() { return 1; }\n")
    env = os.environ | {"WORKBENCH_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(REPO)}

    def start(mode: str, *extra: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", BUILD, str(source), mode, *extra], cwd=REPO, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)

    def load(*extra: str) -> subprocess.CompletedProcess:
        process = start("build", *extra)
        try:
            out, err = process.communicate(timeout=LOAD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            out, err = process.communicate()
            pytest.fail(f"the load still waited after {LOAD_TIMEOUT_S} s (a stale lock waited on):\n{err[-2000:]}")
        assert process.returncode == 0, err
        return subprocess.CompletedProcess(process.args, 0, out, err)
    start.load = load
    return start


def test_a_load_after_a_build_killed_midway_takes_its_lock_over_and_finishes(tiny_build):
    building = tiny_build("hang")
    try:
        assert building.stdout.readline().strip() == "compiling"      # inside torch's lock
    finally:
        os.killpg(building.pid, signal.SIGKILL)
        building.communicate()
    assert building.returncode == -signal.SIGKILL

    loaded = tiny_build.load()
    folder = Path(loaded.stdout.split("loaded ", 1)[1].strip())
    assert "did not finish" in loaded.stderr and "its process is gone" in loaded.stderr
    assert f"pid {building.pid}" in loaded.stderr            # the build that died, named
    assert not (folder / "lock").exists() and list(folder.glob("*.so"))

    again = tiny_build.load()                                 # built: a plain load, nothing to take over
    assert "did not finish" not in again.stderr


def test_a_build_held_longer_than_any_build_takes_is_taken_over(tiny_build, tmp_path):
    """A builder that is alive but hung (here: this test holding the lock) is not waited on
    past STALE_AFTER_S (set to 2 s for the test)."""
    first = tiny_build.load()
    folder = Path(first.stdout.split("loaded ", 1)[1].strip())
    (folder / "lock").touch()                                 # torch's lock, as a hung build holds it
    with FileLock(folder / "build.lock"):
        started = time.monotonic()
        loaded = tiny_build.load("2")
    assert "longer than a build takes: taking it over" in loaded.stderr
    assert "its process is hung" in loaded.stderr
    assert time.monotonic() - started < LOAD_TIMEOUT_S
