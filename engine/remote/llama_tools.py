"""llama.cpp as the reference for one GGUF file: its command-line tools (`llama-quantize`,
`llama-perplexity`, `llama-bench`, built beside llama-server by scripts/build_llama_server.sh)
and llama-server's token-level endpoints (`/tokenize`, `/completion` on prompt ids), which the
chat stream (engine.remote.request) does not give. `python -m engine.bench quality --against
llama.cpp`, `python -m engine.bench peer` (llama-bench's token generation: llama.cpp's kernels
without HTTP) and the real-file tests read them.

llama-perplexity's protocol, which `perplexity` runs and engine.bench.quality copies for
ours: the text is tokenized with BOS (where the vocabulary adds one), cut into chunks of
n_ctx tokens, each chunk's first token replaced by BOS, and only the second half of each chunk
is scored (positions n_ctx/2 .. n_ctx-2 predict the next token), so every scored token has
at least n_ctx/2 tokens of context.
"""
from __future__ import annotations

import json
import re
import statistics
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
    """The tool's stdout and stderr together; a WorkbenchError with its last lines if it fails."""
    done = _run(args, what, timeout_s)
    return done.stdout + done.stderr


def _run(args: list[str], what: str, timeout_s: float) -> subprocess.CompletedProcess:
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-8:])
        raise WorkbenchError(f"{what} failed (exit {done.returncode}): {' '.join(args)}\n{tail}")
    return done


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


# ---- llama-bench: llama.cpp's token generation without HTTP ------------------------------
@dataclass
class LlamaBenchTg:
    tok_s: float                   # the median of its repetitions (samples_ts)
    avg_ts: float                  # llama-bench's own mean and standard deviation of them
    stddev_ts: float
    samples_ts: list[float]
    n_gen: int
    threads: int
    build: str                     # llama.cpp's build_commit (build_number)
    args: list[str]

    @property
    def command(self) -> str:
        return " ".join(self.args)


def llama_bench_tg(model: Path, n_gen: int, threads: int, repetitions: int = 3,
                   timeout_s: float = TIMEOUT_S) -> LlamaBenchTg:
    """`llama-bench -m MODEL -p 0 -n N -t THREADS -r R -o json`: n_gen tokens generated one at a
    time from an empty context, R times after one warm-up token, llama.cpp's defaults otherwise.
    A WorkbenchError (LlamaServerMissingError where it is not built) says why it gave no rate."""
    args = [str(binary("llama-bench")), "-m", str(model), "-p", "0", "-n", str(n_gen), "-t", str(threads),
            "-r", str(repetitions), "-o", "json"]
    try:
        done = _run(args, "llama-bench", timeout_s)
    except subprocess.TimeoutExpired:
        raise WorkbenchError(f"llama-bench ran past {timeout_s:.0f} s: {' '.join(args)}") from None
    return parse_llama_bench_tg(done.stdout, n_gen, args)


def parse_llama_bench_tg(stdout: str, n_gen: int, args: list[str] = ()) -> LlamaBenchTg:
    """The token-generation entry (n_prompt 0, n_gen n_gen, no depth) of llama-bench's `-o json`
    output: a JSON array of one object per test, logs going to stderr."""
    command = " ".join(args)
    try:
        entries = json.loads(stdout)
    except json.JSONDecodeError as e:
        raise WorkbenchError(f"llama-bench's output is not JSON ({e}): {command}\n{stdout[-500:]}") from None
    for entry in entries if isinstance(entries, list) else []:
        if entry.get("n_prompt") == 0 and entry.get("n_gen") == n_gen and not entry.get("n_depth"):
            samples = [float(v) for v in entry["samples_ts"]]
            return LlamaBenchTg(statistics.median(samples), float(entry["avg_ts"]), float(entry["stddev_ts"]),
                                samples, n_gen, int(entry["n_threads"]),
                                f"{entry.get('build_commit')} ({entry.get('build_number')})", list(args))
    raise WorkbenchError(f"llama-bench printed no token-generation entry of {n_gen} tokens: {command}\n"
                         f"{stdout[-500:]}")


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
