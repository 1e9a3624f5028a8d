"""`python -m engine.bench serve --backend URL` against the real llama.cpp server (built by
scripts/build_llama_server.sh), started here with 4 slots (--parallel 4) and an API key: the
workload runs as concurrent streams and reports the local run's fields. Never skips: without
the binary the fixture fails and names the build script."""
import json

import pytest

from engine.bench.cli import main
from engine.remote.server_process import free_port

SECRET = "sk-serve-bench-7c1e9"
KEY_ENV = "WORKBENCH_TEST_SERVE_KEY"
WORKLOAD = ["--num-prompts", "6", "--max-concurrency", "4", "--output-len", "8", "--json"]


@pytest.fixture(scope="module")
def parallel_server(tmp_path_factory):
    from engine.errors import LlamaServerMissingError
    from engine.loading.loader import default_gguf_path
    from engine.remote.llama_server import LlamaServer
    try:
        # one thread each slot shares (see test_remote_llamacpp.start_server); --cache-ram 0
        # and a slot folder, so the bench's prefix-cache reset really empties it
        server = LlamaServer(default_gguf_path(), parallel=4, threads=1, metrics=True,
                             slot_save_path=tmp_path_factory.mktemp("slots"),
                             extra=("--cache-ram", "0", "--api-key", SECRET))
    except LlamaServerMissingError as e:
        pytest.fail(str(e))
    server.start()
    yield server
    server.stop()


def bench(capsys, *argv) -> tuple[int, dict | None, str]:
    code = main(["serve", *argv])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == 0 else None), out + err


def test_serve_against_llama_server_reports_the_local_runs_fields(parallel_server, make_tiny_engine, capsys,
                                                                 monkeypatch):
    monkeypatch.setenv(KEY_ENV, SECRET)
    code, remote, printed = bench(capsys, "--backend", parallel_server.url, "--api-key-env", KEY_ENV, *WORKLOAD)
    assert code == 0, printed
    # the local run on the tiny model (its fields are the same on every model)
    monkeypatch.setattr("engine.bench.scenarios._engine", lambda args, **config: make_tiny_engine(**config))
    code, local, _ = bench(capsys, *WORKLOAD)
    assert code == 0

    for run in (local, remote):     # every request ran to its 8 tokens (EOS ignored)
        assert run["completed"] == 6 and run["total_output_tokens"] == 6 * 8
        assert run["output_throughput"] > 0 and run["request_throughput"] > 0 and run["single_stream_tok_s"] > 0
        assert 0 < run["median_ttft_ms"] <= run["median_e2el_ms"] and run["median_itl_ms"] > 0
    assert set(local) <= set(remote)
    assert set(remote) - set(local) == {"backend", "failed", "errors", "server_load", "null_reasons"}
    assert set(remote["settings"]) == set(local["settings"]) and set(remote["scheduler"]) == set(local["scheduler"])
    assert remote["failed"] == 0 and remote["errors"] == []
    nulls = {k for k, v in remote.items() if v is None and k != "compare"} | \
        {f"{group}.{k}" for group in ("settings", "scheduler") for k, v in remote[group].items() if v is None}
    assert nulls == set(remote["null_reasons"]) and "steps" in nulls      # every null says why (compare: none asked)

    # the server's own counters: 4 slots, and it served requests side by side
    assert remote["backend"]["server_kind"] == "llama.cpp" and remote["scheduler"]["max_num_seqs"] == 4
    assert remote["server_load"]["samples"] >= 1 and remote["max_concurrent"] >= 2
    assert 0 < remote["server_load"]["max_kv_usage"] < 1
    assert remote["backend"]["prefix_cache_reset"].startswith("before each arm")
    assert SECRET not in printed and remote["backend"]["api_key_env"] == KEY_ENV


def test_serve_against_an_unreachable_server_says_what_to_check(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    code, _, printed = bench(capsys, "--backend", url, *WORKLOAD)
    assert code == 2
    assert f"cannot reach {url}" in printed and "that the server is running" in printed


def test_a_wrong_api_key_is_refused_and_never_printed(parallel_server, capsys, monkeypatch):
    monkeypatch.setenv(KEY_ENV, "not-" + SECRET)
    code, _, printed = bench(capsys, "--backend", parallel_server.url, "--api-key-env", KEY_ENV, *WORKLOAD)
    assert code == 2 and "refused the API key" in printed and KEY_ENV in printed
    assert SECRET not in printed


def test_a_count_the_server_does_not_give_leaves_its_totals_null_not_zero():
    from engine.bench.serve_remote import summary_of
    from engine.metrics import RequestStats
    counted = RequestStats(prompt_tokens=10, prefix_hit_tokens=4, generated_tokens=5, ttft_s=0.1, decode_time_s=0.4,
                           e2e_s=0.5, itl_s=[0.1] * 4)
    uncounted = RequestStats(prompt_tokens=None, prefix_hit_tokens=None, generated_tokens=3, ttft_s=0.2,
                             decode_time_s=0.2, e2e_s=0.4, itl_s=[0.1] * 2)
    s = summary_of([counted, uncounted], duration_s=2.0)
    assert s["total_input_tokens"] is None and s["total_token_throughput"] is None and s["prefix_hit_tokens"] is None
    assert (s["completed"], s["total_output_tokens"], s["output_throughput"]) == (2, 8, 4.0)
    alone = summary_of([counted], 1.0)
    assert (alone["prefix_hit_tokens"], alone["total_input_tokens"]) == (4, 10)
