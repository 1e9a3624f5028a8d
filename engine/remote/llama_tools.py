"""llama.cpp as the reference for one GGUF file: its command-line tools (`llama-quantize`,
`llama-perplexity`, built beside llama-server by scripts/build_llama_server.sh) and
llama-server's token-level endpoints (`/tokenize`, `/completion` on prompt ids), which the
chat stream (engine.remote.request) does not give. `python -m engine.bench quality --against
llama.cpp` and the real-file tests read them.

llama-perplexity's protocol, which `perplexity` runs and engine.bench.quality copies for
ours: the text is tokenized with BOS (where the vocabulary adds one), cut into chunks of
n_ctx tokens, each chunk's first token replaced by BOS, and only the second half of each chunk
is scored (positions n_ctx/2 .. n_ctx-2 predict the next token), so every scored token has
at least n_ctx/2 tokens of context.
"""
from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import httpx

from engine.errors import WorkbenchError
from engine.remote.llama_server_binary import binary

TIMEOUT_S = 600.0
PPL_CHUNK = re.compile(r"\[(\d+)\](\d+\.\d+),")
PPL_FINAL = re.compile(r"Final estimate: PPL = (\d+\.\d+) \+/- (\d+\.\d+)")
PPL_CHUNKS = re.compile(r"calculating perplexity over (\d+) chunks, n_ctx=(\d+)")


def run(args: list[str], what: str, timeout_s: float = TIMEOUT_S) -> str:
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s)
    said = done.stdout + done.stderr
    if done.returncode != 0:
        tail = "\n".join(said.strip().splitlines()[-8:])
        raise WorkbenchError(f"{what} failed (exit {done.returncode}): {' '.join(args)}\n{tail}")
    return said


def quantize(source: Path, dest: Path, kind: str, *, allow_requantize: bool = False, threads: int = 2) -> str:
    """`llama-quantize [--allow-requantize] SOURCE DEST KIND THREADS` (KIND: Q4_K_M, Q8_0,
    F32, ...); llama.cpp's log."""
    args = [str(binary("llama-quantize")), *(["--allow-requantize"] if allow_requantize else []),
            str(source), str(dest), kind, str(threads)]
    return run(args, f"llama-quantize to {kind}")


@dataclass
class PerplexityRun:
    ppl: float
    stderr: float                  # llama-perplexity's +/- (its estimate of the mean's error)
    per_chunk: list[float]         # the running estimate after each chunk, as it prints them
    chunks: int
    n_ctx: int
    args: list[str]


def perplexity(model: Path, text_file: Path, n_ctx: int, chunks: int, *, threads: int = 2,
               extra: tuple[str, ...] = ()) -> PerplexityRun:
    """`llama-perplexity` on `chunks` chunks of `n_ctx` tokens of the text file (one batch
    per chunk, llama.cpp's defaults otherwise: K/V in f16, flash attention auto)."""
    args = [str(binary("llama-perplexity")), "-m", str(model), "-f", str(text_file), "-c", str(n_ctx),
            "-b", str(n_ctx), "--chunks", str(chunks), "-t", str(threads), *extra]
    said = run(args, "llama-perplexity")
    final, counted = PPL_FINAL.search(said), PPL_CHUNKS.search(said)
    if final is None or counted is None:
        raise WorkbenchError(f"llama-perplexity printed no estimate: {' '.join(args)}\n{said[-2000:]}")
    return PerplexityRun(float(final[1]), float(final[2]), [float(v) for _, v in PPL_CHUNK.findall(said)],
                         int(counted[1]), int(counted[2]), args)


# ---- llama-server's token endpoints -----------------------------------------------------
def tokenize(url: str, text: str, add_special: bool = True) -> list[int]:
    """The server's tokenization of `text` (with BOS where the vocabulary adds one, as
    llama-perplexity tokenizes its file)."""
    reply = httpx.post(f"{url}/tokenize", json={"content": text, "add_special": add_special}, timeout=TIMEOUT_S)
    reply.raise_for_status()
    return [int(t) for t in reply.json()["tokens"]]


@dataclass
class GreedyReply:
    tokens: list[int]
    top_logprobs: list[list[tuple[int, float]]]   # per generated token: the server's top 2 (id, logprob)


def greedy(url: str, prompt_ids: list[int], max_tokens: int) -> GreedyReply:
    """llama-server's greedy continuation of exactly these prompt ids (top-k 1, no prompt
    cache reuse, stops at EOS as ours does), with its top-2 log-probabilities at each step."""
    body = {"prompt": prompt_ids, "n_predict": max_tokens, "temperature": 0.0, "top_k": 1, "samplers": ["top_k"],
            "cache_prompt": False, "return_tokens": True, "n_probs": 2, "post_sampling_probs": False,
            "stream": False}
    reply = httpx.post(f"{url}/completion", json=body, timeout=TIMEOUT_S)
    reply.raise_for_status()
    out = reply.json()
    probs = [[(int(p["id"]), float(p["logprob"])) for p in step.get("top_logprobs", [])]
             for step in out.get("completion_probabilities", [])]
    return GreedyReply([int(t) for t in out["tokens"]], probs)
