"""`python -m engine.bench SCENARIO [--json]` (engine.bench.cli)."""
import sys

from engine.bench.cli import exit_on_signals, main

exit_on_signals()
sys.exit(main())
