"""Connecting to something that is not a usable server: each case raises a WorkbenchError
that says what was wrong and what to do. (The llama.cpp cases — no /metrics, death
mid-stream, unknown model — are in test_remote_llamacpp.py, on the real server.)"""
import http.server
import threading

import pytest

from engine.errors import ConfigError, NotOpenAIServerError, ServerAuthError, ServerUnreachableError
from engine.remote.backend import CONNECT_TIMEOUT_S, RemoteBackend, list_served_models, normalize_url
from engine.remote.server_process import free_port


@pytest.fixture
def web_server(tmp_path):
    """An ordinary web server (a folder with an index.html), not an OpenAI-compatible one."""
    (tmp_path / "index.html").write_text("<html><body>hello</body></html>")
    handler = lambda *a: http.server.SimpleHTTPRequestHandler(*a, directory=str(tmp_path))   # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_nothing_listening_is_reported_as_unreachable():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServerUnreachableError) as info:
        RemoteBackend(url)
    assert url in str(info.value) and "running" in str(info.value)


def test_a_server_that_never_answers_is_reported_after_the_probe_timeout(silent_port):
    with pytest.raises(ServerUnreachableError) as info:
        RemoteBackend(f"http://127.0.0.1:{silent_port}")
    assert f"within {CONNECT_TIMEOUT_S:g} s" in str(info.value)


def test_a_web_server_is_not_taken_for_an_openai_server(web_server):
    with pytest.raises(NotOpenAIServerError) as info:
        RemoteBackend(web_server)
    assert "/v1/models" in str(info.value) and "404" in str(info.value)


def test_listing_models_says_what_connecting_would(web_server):
    """The Connect dialog's model list asks /v1/models with the same checks and messages."""
    with pytest.raises(NotOpenAIServerError, match="/v1/models"):
        list_served_models(web_server)
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServerUnreachableError, match="cannot reach"):
        list_served_models(url)
    with pytest.raises(ConfigError, match="http://127.0.0.1:8080"):
        list_served_models("localhost:8080")


def test_url_without_scheme_is_refused_with_an_example():
    with pytest.raises(ConfigError, match="http://127.0.0.1:8080"):
        RemoteBackend("localhost:8080")


def test_trailing_v1_is_accepted():
    assert normalize_url("https://gpu-box:8000/v1/") == "https://gpu-box:8000"


def test_api_key_variable_that_is_not_set_is_named(monkeypatch):
    monkeypatch.delenv("WORKBENCH_NO_SUCH_KEY", raising=False)
    with pytest.raises(ServerAuthError, match="WORKBENCH_NO_SUCH_KEY"):
        RemoteBackend(f"http://127.0.0.1:{free_port()}", api_key_env="WORKBENCH_NO_SUCH_KEY")


def test_unknown_server_kind_lists_the_known_ones():
    with pytest.raises(ConfigError, match="vllm, sglang, llama.cpp, openai"):
        RemoteBackend("http://127.0.0.1:1", kind="tgi")



def test_a_llama_server_built_for_another_cpu_is_named_with_its_build_flags(tmp_path, monkeypatch):
    """A binary built on an AVX-512 CPU dies with SIGILL on an AVX2-only one: the error says
    so, with the flags it was built with and what to do, not a bare exit code."""
    import signal

    from engine.errors import WorkbenchError
    from engine.remote.llama_server import LlamaServer
    (tmp_path / "bin").mkdir()
    fake = tmp_path / "bin" / "llama-server"
    fake.write_text("#!/bin/sh\nkill -ILL $$\n")
    fake.chmod(0o755)
    (tmp_path / "build-flags.txt").write_text("-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON -DGGML_AMX_INT8=OFF\n")
    monkeypatch.setenv("WORKBENCH_LLAMA_SERVER", str(fake))
    with pytest.raises(WorkbenchError) as info:
        LlamaServer(tmp_path / "model.gguf").start(timeout_s=20)
    said = str(info.value)
    assert signal.SIGILL.name in said and "illegal instruction" in said
    assert "built with GGML_AVX2=ON GGML_AVX512=ON, and this CPU is" in said
    assert f"Remove {tmp_path}" in said and "scripts/build_llama_server.sh" in said


def test_vllm_not_installed_names_the_install_script(tmp_path, monkeypatch):
    """Where scripts/build_vllm.sh has not run, starting vLLM says so and what to run."""
    from engine.errors import VllmMissingError
    from engine.remote import vllm_venv
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(vllm_venv.PYTHON_ENV, raising=False)
    assert not vllm_venv.is_built()
    with pytest.raises(VllmMissingError) as info:
        vllm_venv.python()
    assert str(tmp_path / "vllm" / vllm_venv.VLLM_VERSION / "venv") in str(info.value)
    assert "bash scripts/build_vllm.sh" in str(info.value) and vllm_venv.PYTHON_ENV in str(info.value)


def test_vllm_install_refuses_a_cpu_without_avx2():
    from engine.remote.vllm_venv import cpu_problem
    avx2 = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"})
    assert cpu_problem(avx2) is None
    said = cpu_problem(avx2 - {"avx2", "fma"})
    assert "needs an x86-64 CPU with AVX2" in said and "avx2, fma" in said
