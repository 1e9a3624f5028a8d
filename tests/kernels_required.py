"""Tests that need one of our native CPU kernels (engine.kernels.cpu_*), where it refused here.

On a user's machine a refusal is a skip: the engine falls back and says why (no compiler,
say), and each fallback is forced in its own tests (conftest.forced_fallback). scripts/test.sh
exports WORKBENCH_REQUIRE_KERNELS=1: it runs where every kernel must build and pass its
trials (engine.runtime.kernel_check), so there a refusal fails the test, naming the kernel,
instead of turning its tests into skips.
"""
import os

import pytest

REQUIRE_ENV = "WORKBENCH_REQUIRE_KERNELS"


def required() -> bool:
    return os.environ.get(REQUIRE_ENV, "") not in ("", "0")


def excused(why: str | None, what: str) -> bool:
    """Whether a test may take `what`'s refusal `why` (None: it runs) as this machine's answer:
    True where it refused on a user's machine; under REQUIRE_ENV the test fails, naming it."""
    if why is None:
        return False
    if required():
        pytest.fail(f"{what} refused on a machine that must run it ({REQUIRE_ENV}=1): {why}", pytrace=False)
    return True


def skip_unless_runs(why: str | None, what: str) -> None:
    """Skip the test where `what` refused (`why`); under REQUIRE_ENV fail it."""
    if excused(why, what):
        pytest.skip(f"{what} does not run here: {why}")


def every_test_needs(refusal, what: str):
    """An autouse fixture for a module whose every test needs the kernel: assign it to a module
    name (`_needs_kernel = every_test_needs(cpu_quant.refusal, "our quantized CPU linear")`)."""
    @pytest.fixture(autouse=True)
    def needs_kernel():
        skip_unless_runs(refusal(), what)
    return needs_kernel
