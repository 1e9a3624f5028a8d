"""A kernel this machine should run and refuses fails scripts/test.sh, named, before the suite
runs (engine.runtime.kernel_check, `python -m engine.runtime.cpu_paths --require`); only a
machine without a C++ compiler may refuse, and there the tests skip (tests/kernels_required.py)."""
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from engine import cpu_features
from engine.kernels import cpu_linear
from engine.runtime import kernel_check
from tests import kernels_required

REPO = Path(__file__).resolve().parent.parent
# The library's build, broken on purpose: cpu_attention.cpp with a header that does not exist
# (a fatal error, so the compiler stops at once), built alone into a fresh cache folder (no
# other build's lock file to wait on), then the CLI as scripts/test.sh runs it.
BROKEN_BUILD = """
import runpy, sys
from pathlib import Path
from engine.kernels import cpu_linear
cpu_linear.SOURCES[:] = [Path(sys.argv[1])]
sys.argv = ["cpu_paths", *sys.argv[2:]]
runpy.run_module("engine.runtime.cpu_paths", run_name="__main__")
"""


def _test_sh_check() -> list[str]:
    """The arguments scripts/test.sh gives `python -m engine.runtime.cpu_paths`, checked to run
    under `set -e` before pytest."""
    script = (REPO / "scripts" / "test.sh").read_text()
    assert re.search(r"^set -[a-z]*e", script, re.M), "scripts/test.sh must stop at a failed command"
    check = re.search(r"^\.venv/bin/python -m engine\.runtime\.cpu_paths([^>\n]*)", script, re.M)
    assert check and check.start() < script.index("-m pytest"), "scripts/test.sh runs the kernel check before pytest"
    assert script.index("export WORKBENCH_REQUIRE_KERNELS=1") < script.index("-m pytest")
    return check.group(1).split()


def test_a_kernel_whose_build_breaks_fails_test_sh_naming_it(tmp_path):
    args = _test_sh_check()
    broken = tmp_path / "cpu_attention.cpp"
    source = next(s for s in cpu_linear.SOURCES if s.name == "cpu_attention.cpp")
    broken.write_text('#include "broken_on_purpose.h"\n' + source.read_text())
    env = {**os.environ, "WORKBENCH_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("WORKBENCH_CPU_ISA", None)
    run = subprocess.run([sys.executable, "-c", BROKEN_BUILD, str(broken), *args], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stdout + run.stderr
    for name in kernel_check.NAMES.values():
        assert re.search(f"FAILED: {name} must run here and does not: .*did not build", run.stderr), run.stderr
    assert "broken_on_purpose.h" in run.stderr          # the compiler's own words, not only the refusal's line
    assert "cpu: ours_attention: refused" in run.stdout and "dtype_auto" not in run.stdout     # stopped first


@pytest.fixture
def fake_kernels(monkeypatch):
    """Two kernels that built (no real build runs): each instruction set's trial answers from
    `results` (None: passed), on a CPU with AVX2 and FMA."""
    results: dict[str, dict[str, str | None]] = {"fake_linear": {}, "fake_quant": {}}
    modules = {
        "fake_linear": types.SimpleNamespace(refusal=lambda: None, isa=lambda: "avx2",
                                             NEEDS={"scalar": (), "avx2": ("avx2", "fma"), "avx512": ("avx512f",)},
                                             _trial=lambda isa: results["fake_linear"].get(isa)),
        "fake_quant": types.SimpleNamespace(refusal=lambda: results["fake_quant"].get("refusal"), isa=lambda: "avx2"),
    }
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(kernel_check, "KERNELS", {"ours_linear": "fake_linear", "ours_quantized": "fake_quant"})
    monkeypatch.setattr(kernel_check, "NAMES", {"ours_linear": "our CPU linear", "ours_quantized": "our quantized CPU linear"})
    monkeypatch.setattr(cpu_features, "flags", lambda: frozenset({"avx", "avx2", "fma", "f16c"}))
    monkeypatch.delenv("WORKBENCH_CPU_ISA", raising=False)
    monkeypatch.setenv("CXX", sys.executable)        # a compiler "is installed"
    return results


def test_with_a_compiler_a_refusal_and_a_failed_instruction_set_are_named(fake_kernels, capsys):
    assert kernel_check.failures() == {} and kernel_check.require() == 0
    fake_kernels["fake_quant"]["refusal"] = "our quantized CPU linear, avx2 8-bit, rounds unlike the scalar path"
    # AVX2 fails its trial: the kernel still serves on scalar, which is the silent drop this catches
    fake_kernels["fake_linear"]["avx2"] = "avx2 gave wrong results"
    assert kernel_check.failures() == {
        "our CPU linear": "its avx2 path failed its trial (avx2 gave wrong results)",
        "our quantized CPU linear": "our quantized CPU linear, avx2 8-bit, rounds unlike the scalar path"}
    assert kernel_check.require() == 1
    err = capsys.readouterr().err
    assert "FAILED: our CPU linear must run here and does not: its avx2 path failed" in err
    assert "FAILED: our quantized CPU linear must run here and does not: our quantized CPU linear, avx2" in err


def test_an_instruction_set_the_cpu_lacks_or_the_environment_rules_out_is_not_required(fake_kernels, monkeypatch):
    fake_kernels["fake_linear"]["avx512"] = "would die with SIGILL here"      # no avx512f: never tried
    assert kernel_check.failures() == {}
    fake_kernels["fake_linear"]["avx2"] = "avx2 gave wrong results"
    monkeypatch.setenv("WORKBENCH_CPU_ISA", "scalar")        # an imitated CPU without AVX2, which passes
    assert kernel_check.failures() == {}


def test_without_a_compiler_a_refusal_is_this_machines_answer(fake_kernels, monkeypatch, capsys):
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    fake_kernels["fake_quant"]["refusal"] = "our quantized CPU linear did not build here (RuntimeError: ...)"
    assert kernel_check.failures() == {} and kernel_check.require() == 0
    assert "no C++ compiler here ('no-such-compiler-here' is not installed; install g++)" in capsys.readouterr().err


def test_a_refused_kernel_skips_its_tests_for_a_user_and_fails_them_under_test_sh(monkeypatch):
    monkeypatch.delenv(kernels_required.REQUIRE_ENV, raising=False)
    kernels_required.skip_unless_runs(None, "our CPU linear")
    with pytest.raises(pytest.skip.Exception, match="our CPU linear does not run here: no compiler"):
        kernels_required.skip_unless_runs("no compiler", "our CPU linear")
    monkeypatch.setenv(kernels_required.REQUIRE_ENV, "1")
    kernels_required.skip_unless_runs(None, "our CPU linear")
    with pytest.raises(pytest.fail.Exception, match="our CPU linear refused on a machine that must run it .*: no compiler"):
        kernels_required.skip_unless_runs("no compiler", "our CPU linear")
