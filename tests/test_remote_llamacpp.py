"""RemoteBackend against the real llama.cpp server (built by scripts/build_llama_server.sh),
started here on 127.0.0.1 with the embedded GGUF, --metrics, and the same GGUF as its draft
(greedy acceptance is then high). These tests never skip: without the binary the fixture
fails and names the build script."""
import json

import httpx
import pytest

from engine.backend import Backend, BackendRequest
from engine.config import SamplingParams
from engine.errors import ServerAuthError, ServerSettingFixedError, UnknownServedModelError
from engine.metrics import SERVER, StepEvent
from engine.remote.server_metrics import parse_samples, read_metrics
from tests.conftest import assert_dies_mid_stream

K = 4
GREEDY = SamplingParams(max_tokens=24)
SYSTEM = ("You are a careful assistant for a cooking school. Answer in plain sentences, keep every answer "
          "short, and never use lists.")


def chat(*turns: str) -> list[dict]:
    """system prompt + alternating user / assistant turns."""
    roles = ["user", "assistant"] * len(turns)
    return [{"role": "system", "content": SYSTEM}] + [{"role": r, "content": t} for r, t in zip(roles, turns)]


def start_server(**kwargs):
    from engine.errors import LlamaServerMissingError
    from engine.loading.loader import default_gguf_path
    from engine.remote.llama_server import LlamaServer
    gguf = default_gguf_path()
    # one thread: with two on a busy 2-core machine llama.cpp's spinning threads wait on
    # each other and a reply takes ten times as long
    kwargs.setdefault("threads", 1)
    try:
        server = LlamaServer(gguf, **kwargs)
    except LlamaServerMissingError as e:
        pytest.fail(str(e))          # CI must build it (scripts/setup.sh runs the build script)
    return server.start()


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory):
    from engine.loading.loader import default_gguf_path
    # --cache-ram 0: no RAM copies of old prompts, so erasing the slots resets the prefix cache
    server = start_server(draft=default_gguf_path(), draft_max=K, metrics=True,
                          slot_save_path=tmp_path_factory.mktemp("slots"), extra=("--cache-ram", "0"))
    yield server
    server.stop()


@pytest.fixture
def backend(spec_server):
    from engine.remote.backend import RemoteBackend
    b = RemoteBackend(spec_server.url)
    yield b
    b.close()


def run(backend, messages, params=GREEDY) -> list[StepEvent]:
    return list(backend.generate(messages, params))


def test_local_and_remote_backends_are_driven_the_same_way(backend, make_tiny_engine):
    """The app's worker loop (start, step until finished, close) on both backends."""
    for b in (make_tiny_engine(), backend):
        assert isinstance(b, Backend)
        request = b.start(chat("Say hi."), SamplingParams(max_tokens=3, stop_on_eos=False))
        assert isinstance(request, BackendRequest)
        events = []
        try:
            while not request.finished:
                events.append(request.step())
        finally:
            request.close()
        assert sum(e.num_tokens for e in events) == events[-1].summary.generated_tokens == 3
        assert events[0].ttft_s is not None and events[-1].finish_reason == "length"


def test_stream_arrives_as_step_events_with_counted_tokens(backend):
    events = run(backend, chat("What is a roux?"))
    assert all(isinstance(e, StepEvent) for e in events)
    first, last = events[0], events[-1]
    assert first.ttft_s is not None and first.ttft_s > 0 and first.text_delta
    assert all(e.ttft_s is None for e in events[1:])
    assert [e.finished for e in events] == [False] * (len(events) - 1) + [True]
    assert last.finish_reason in ("stop", "length")
    assert all(kind == SERVER for e in events for _, kind in e.pieces)
    # the server counts the tokens; they add up to what it reports for the request
    usage = last.server["usage"]
    assert sum(e.num_tokens for e in events) == usage["completion_tokens"] == last.summary.generated_tokens
    assert last.summary.decode_tok_s > 0
    assert last.prompt_tokens == usage["prompt_tokens"]
    # the settings in effect come with the first event, launch-fixed ones with their flag
    assert first.settings["server_kind"] == "llama.cpp"
    assert "--cache-type-k" in first.settings["read_only"]["kv_cache_dtype"]


def test_max_tokens_is_carried_per_request(backend):
    events = run(backend, chat("Tell me a long story about bread."), SamplingParams(max_tokens=5, stop_on_eos=False))
    assert events[-1].finish_reason == "length"
    assert events[-1].summary.generated_tokens == 5


def test_acceptance_and_per_request_draft_counts_are_read(backend):
    events = run(backend, chat("Explain how to boil an egg."), SamplingParams(max_tokens=48))
    summary, figures = events[-1].summary, events[-1].server
    # per-request timings: draft_n / draft_n_accepted, spread over the chunks they arrived with
    assert summary.proposed == figures["timings"]["draft_n"] > 0
    assert summary.accepted == figures["timings"]["draft_n_accepted"] > 0
    assert 0 < summary.acceptance_rate <= 1
    assert summary.acceptance_rate == summary.accepted / summary.proposed
    # /metrics counter deltas: per-position acceptance, at most K positions
    assert figures["metrics"] == "available"
    assert figures["draft_tokens"] == summary.proposed
    assert 1 <= len(figures["per_position"]) <= K
    assert all(0 <= rate <= 1 for rate in figures["per_position"])
    assert summary.per_position == figures["per_position"]


def test_a_verified_drafts_tokens_arrive_as_one_step(backend):
    """llama.cpp streams a verification's tokens as a burst of chunks, one per token, a few
    microseconds apart; they make one step, so its decode speed is the pass's tokens over
    the pass's time (per chunk it read ~40,000 tok/s)."""
    events = run(backend, chat("Explain how to boil an egg."), SamplingParams(max_tokens=48))
    passes = [e for e in events[1:] if e.proposed]
    assert len(passes) == events[-1].server["drafts"] > 1          # one step per verification
    # each pass emits its accepted draft tokens and one of the target's (the last may be cut
    # short by max_tokens or the end of the reply)
    assert [e.num_tokens for e in passes[:-1]] == [e.accepted + 1 for e in passes[:-1]]
    assert any(e.accepted for e in passes[:-1])


def test_second_chat_turn_hits_the_prefix_cache(backend):
    first = run(backend, chat("Name one spice."))
    reply = "".join(e.text_delta for e in first)
    second = run(backend, chat("Name one spice.", reply, "And one herb?"))
    assert second[0].prefix_hit_tokens > 0                       # llama.cpp timings.cache_n
    assert second[-1].server["timings"]["cache_n"] == second[0].prefix_hit_tokens
    assert second[-1].summary.prefix_hit_tokens == second[0].prefix_hit_tokens
    assert second[-1].server["prefix_hit_rate"] > 0               # from /metrics counters


def test_reset_prefix_cache_uses_the_slot_erase_endpoint(backend):
    run(backend, chat("Name one fruit."))
    backend.reset_prefix_cache()
    again = run(backend, chat("Name one fruit."))
    assert again[0].prefix_hit_tokens == 0


def test_metrics_endpoint_parses(spec_server, backend):
    run(backend, chat("Name a vegetable."))
    text = httpx.get(f"{spec_server.url}/metrics", timeout=5).text
    names = {name for name, _, _ in parse_samples(text)}
    assert "llamacpp:spec_decode_num_accepted_tokens_per_pos_total" in names
    reading = read_metrics("llama.cpp", text)
    assert reading.drafts > 0 and reading.draft_tokens >= reading.accepted_tokens > 0
    assert len(reading.accepted_per_pos) == K


def test_kv_usage_is_read_from_slots(backend):
    events = run(backend, chat("What is a sauce?"))
    assert events[0].kv_usage is not None and 0 < events[0].kv_usage <= 1
    assert events[0].kv_bytes_used is None          # llama.cpp does not report bytes: missing, not 0


def test_launch_settings_are_read_only_with_their_flags(backend):
    with pytest.raises(ServerSettingFixedError, match="--cache-type-k"):
        backend.reconfigure(kv_cache_dtype="fp8_e4m3")
    with pytest.raises(ServerSettingFixedError, match="-md"):
        backend.reconfigure(proposer="ngram")
    for change_the_draft in (lambda: backend.set_draft_model("self"), lambda: backend.reconfigure(draft_model="self")):
        with pytest.raises(ServerSettingFixedError, match="draft model is fixed when it is launched.*-md <draft.gguf>"):
            change_the_draft()
    assert backend.settings()["proposer"] == "draft"        # /slots: the slot speculates


def test_settings_a_request_can_carry_reach_the_server(backend):
    backend.reconfigure(enable_prefix_caching=False)
    body = backend.request_body(chat("x"), GREEDY)
    assert body["cache_prompt"] is False and backend.settings()["enable_prefix_caching"] is False
    run(backend, chat("Name one grain."))
    again = run(backend, chat("Name one grain."))
    assert again[0].prefix_hit_tokens == 0


def test_cancel_stops_the_reply_and_keeps_what_arrived(backend):
    request = backend.start(chat("Write a long essay about soup."), SamplingParams(max_tokens=200, stop_on_eos=False))
    events = []
    try:
        while not request.finished:
            events.append(request.step())
            if len(events) == 3:
                request.cancel()
    finally:
        request.close()
    assert events[-1].finish_reason == "cancelled"
    assert len(events) == 4 and all(e.text_delta for e in events[:3])


def test_unknown_model_lists_the_served_ones(spec_server):
    from engine.remote.backend import RemoteBackend
    served = httpx.get(f"{spec_server.url}/v1/models", timeout=5).json()["data"][0]["id"]
    with pytest.raises(UnknownServedModelError) as info:
        RemoteBackend(spec_server.url, model="no-such-model")
    assert "no-such-model" in str(info.value) and served in str(info.value)


def test_api_key_comes_from_the_environment_and_is_never_reported(monkeypatch):
    from engine.remote.backend import RemoteBackend
    secret = "sk-workbench-test-0123456789"
    server = start_server(metrics=True, extra=("--api-key", secret))
    try:
        monkeypatch.setenv("WORKBENCH_TEST_KEY", secret)
        backend = RemoteBackend(server.url, api_key_env="WORKBENCH_TEST_KEY")
        events = run(backend, chat("Say yes."), SamplingParams(max_tokens=3))
        assert events[-1].finished
        dumped = json.dumps([backend.settings()] + [e.as_dict() for e in events], default=str)
        assert secret not in dumped and "WORKBENCH_TEST_KEY" in dumped
        backend.close()
        monkeypatch.setenv("WORKBENCH_TEST_KEY", "sk-wrong")
        with pytest.raises(ServerAuthError, match="WORKBENCH_TEST_KEY|API key"):
            wrong = RemoteBackend(server.url, api_key_env="WORKBENCH_TEST_KEY")
            try:
                run(wrong, chat("Say yes."), SamplingParams(max_tokens=3))
            finally:
                wrong.close()
    finally:
        server.stop()


def test_server_without_metrics_streams_and_says_plots_use_per_request_data():
    from engine.remote.backend import RemoteBackend
    server = start_server(metrics=False)
    try:
        backend = RemoteBackend(server.url)
        note = backend.settings()["metrics"]
        assert "501" in note and "--metrics" in note and "per-request" in note
        events = run(backend, chat("Name a fish."))
        last = events[-1]
        assert last.server["metrics"] == note
        assert last.summary.ttft_s > 0 and last.summary.generated_tokens > 0
        assert last.server["per_position"] is None and last.server["prefix_hit_rate"] is None
        backend.close()
    finally:
        server.stop()


def test_server_dying_mid_stream_gives_a_clear_error_after_the_streamed_events():
    from engine.remote.backend import RemoteBackend
    server = start_server(metrics=True)
    backend = RemoteBackend(server.url)
    try:
        assert_dies_mid_stream(backend, server.kill)
    finally:
        backend.close()
        server.stop()


def test_a_plain_openai_server_gives_totals_only_and_per_step_numbers_stay_missing(spec_server):
    """Treated as a generic OpenAI-compatible server (no timings, no per-chunk usage): the
    text streams, token counts come once from the final usage, per-step speed and
    acceptance are missing rather than 0."""
    from engine.errors import ServerRequestError
    from engine.remote.backend import RemoteBackend
    backend = RemoteBackend(spec_server.url, kind="openai")
    try:
        events = run(backend, chat("Name a bread."), SamplingParams(max_tokens=12, stop_on_eos=False))
        decode_steps = [e.as_dict() for e in events[1:-1]]
        assert decode_steps and all(step["step_tok_s"] is None for step in decode_steps)
        summary = events[-1].summary
        assert summary.generated_tokens == 12 and summary.decode_tokens == 11
        assert all(e.kv_usage is None for e in events)      # no known source for this kind
        assert backend.settings()["read_only"] == {}
        with pytest.raises(ServerRequestError, match="no prefix-cache reset endpoint"):
            backend.reset_prefix_cache()
    finally:
        backend.close()
