"""`python -m engine.bench SCENARIO [--json]` (engine.bench.cli)."""
import sys

from engine import thread_policy

thread_policy.apply()           # before torch loads (the module says why)

from engine.bench.cli import main  # noqa: E402  (after the thread policy)

sys.exit(main())
