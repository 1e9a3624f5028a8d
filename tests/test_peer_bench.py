"""`python -m engine.bench peer`: which dtype each side runs in, in every mode (engine.bench.peer).

No server is started and no model is timed here: the local engine's load and the servers are
stand-ins, so these tests check what each side is asked to run and what the report says of it.
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


@pytest.mark.parametrize("peer_dtype, server_dtype", [("float32", "float32"), (None, "bfloat16")])
def test_the_peer_runs_in_peer_dtype_or_else_in_ours(fake_peer, monkeypatch, peer_dtype, server_dtype):
    engine = FakeEngine("bfloat16")
    info = {"precision": "bfloat16", "threads": 2, "compile": "off", "dtype": "bfloat16",
            "side": peer_bench.local_side(engine, "bfloat16")}
    monkeypatch.setattr(peer_bench, "_local", lambda peer, prompts, tokens, k, compile_mode, dtype:
                        ({m: SUMMARY for m in peer_bench.MODES}, info, engine))
    monkeypatch.setattr(peer_bench, "_through_server", lambda url, prompts, tokens: SUMMARY)
    out = peer_bench.run_peer_bench(None, [[{"role": "user", "content": "hi"}]], 4, 2, engine_name="vllm",
                                    dtype="bfloat16", peer_dtype=peer_dtype)
    assert fake_peer.started == [server_dtype] * len(peer_bench.MODES)
    assert (out["local_dtype"], out["server_dtype"]) == ("bfloat16", server_dtype)
    assert out["sides"]["local"]["dtype_setting"] == "bfloat16" and out["sides"]["local"]["threads"] == 2
    assert out["server_precision"].startswith(server_dtype)


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
