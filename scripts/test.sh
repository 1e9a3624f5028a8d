#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite, headless.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# First: this CPU's ISA flags and which path each CPU-specific kernel took here (each is tried
# before the engine relies on it; the next machine may have another ISA).
.venv/bin/python -m engine.runtime.cpu_paths >&2
# The remote-backend tests run a real llama.cpp server: built once per machine into the
# user cache (docs/remote.md; 6-22 min on 2 cores), instant when already built. Only the
# tests need it, so launching the app never waits for it.
server=$(bash scripts/build_llama_server.sh)     # its own line: a failed build fails the run
echo "test: llama-server at $server" >&2
export QT_QPA_PLATFORM=offscreen
exec .venv/bin/python -m pytest "$@"
