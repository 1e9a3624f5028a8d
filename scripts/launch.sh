#!/usr/bin/env bash
# Set up (if needed) and open the workbench on the embedded default model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m app "$@"
