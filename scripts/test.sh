#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite, headless.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The remote-backend tests run a real llama.cpp server: built once per machine into the
# user cache (docs/remote.md; 6-22 min on 2 cores), instant when already built. Only the
# tests need it, so launching the app never waits for it.
server=$(bash scripts/build_llama_server.sh)     # its own line: a failed build fails the run
echo "test: llama-server at $server" >&2
export QT_QPA_PLATFORM=offscreen
exec .venv/bin/python -m pytest "$@"
