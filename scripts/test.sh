#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite, headless.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export QT_QPA_PLATFORM=offscreen
exec .venv/bin/python -m pytest "$@"
