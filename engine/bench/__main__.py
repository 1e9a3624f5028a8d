"""`python -m engine.bench SCENARIO [--json]` (engine.bench.cli)."""
import sys

from engine.bench.cli import main

sys.exit(main())
