"""How a server's stream becomes steps (engine.remote.request): the chunks of one server step
make one StepEvent, timed from the previous step's end, so per-step decode speed is tokens
over real time. Driven by a scripted stream with the arrival times a server gave, so the
grouping is checked exactly; tests/test_remote_llamacpp.py checks it on the real server."""
import time

import pytest

from engine.errors import ServerDiedError
from engine.remote.request import BURST_GAP_S, RemoteRequest

GAP_INSIDE_A_BURST = BURST_GAP_S / 5
PASS_TIME_S = 0.1


class ScriptedStream:
    """A ChunkStream stand-in: every item has already arrived, stamped `at` seconds after
    the request was sent (as the reader thread stamps them)."""

    def __init__(self, script: list[tuple]):
        self.t_submit = time.perf_counter() - 10.0         # all in the past: nothing to wait for
        self.items = [(kind, self.t_submit + at, *rest) for kind, at, *rest in script]

    def next(self, timeout: float):
        return self.items.pop(0) if self.items else None

    def close(self) -> None:
        pass


class QuietHost:
    """A server that streams and reports nothing else (no /metrics, no KV usage)."""
    url, model, served_models, kv_cache_dtype, poll_interval_s = "http://h:1", "m", ["m"], None, 1e9

    def settings(self) -> dict:
        return {}

    def kv_usage(self):
        return None

    def scrape(self):
        return None

    def metrics_note(self):
        return None

    def request_closed(self, request) -> None:
        pass


def chunk(text: str = "", finish_reason=None, **counts) -> dict:
    """A /v1/chat/completions stream chunk; counts go in `timings` (llama.cpp) or `usage`."""
    body = {"choices": [{"delta": {"content": text} if text else {}, "finish_reason": finish_reason}]}
    if "completion_tokens" in counts:
        body["usage"] = {"completion_tokens": counts.pop("completion_tokens")}
    if counts:
        body["timings"] = counts
    return body


def steps(script: list[tuple]) -> list:
    request = RemoteRequest(QuietHost(), ScriptedStream(script), before=None)
    events = []
    while not request.finished:
        events.append(request.step())
    return events


def test_a_burst_of_chunks_is_one_step_timed_from_the_step_before():
    """A server without pass stamps (vLLM-like usage per chunk): chunks that arrived within
    BURST_GAP_S of each other are one step."""
    t2 = 0.2 + PASS_TIME_S
    events = steps([
        ("chunk", 0.01, chunk()),                                         # the role chunk, no text
        ("chunk", 0.2, chunk("A", completion_tokens=1)),
        ("chunk", t2, chunk(" b", completion_tokens=2)),
        ("chunk", t2 + GAP_INSIDE_A_BURST, chunk(" c", completion_tokens=3)),
        ("chunk", t2 + 2 * GAP_INSIDE_A_BURST, chunk(" d", completion_tokens=4)),
        ("chunk", t2 + PASS_TIME_S, chunk(" e", completion_tokens=5)),
        ("done", t2 + PASS_TIME_S + GAP_INSIDE_A_BURST),
    ])
    assert [e.text_delta for e in events] == ["A", " b c d", " e", ""]
    assert [e.num_tokens for e in events] == [1, 3, 1, 0]
    assert events[0].ttft_s == pytest.approx(0.2)
    burst = events[1]
    assert burst.step_time_s == pytest.approx(PASS_TIME_S + 2 * GAP_INSIDE_A_BURST)   # from the last step's end
    assert burst.as_dict()["step_tok_s"] == pytest.approx(3 / burst.step_time_s)      # ~30 tok/s, not ~15,000
    assert events[2].step_time_s == pytest.approx(PASS_TIME_S - 2 * GAP_INSIDE_A_BURST)
    assert events[-1].summary.generated_tokens == 5 and events[-1].finish_reason == "stop"


def test_a_pass_the_server_stamps_is_one_step_however_its_chunks_straggle():
    """llama.cpp: every chunk of a pass has the pass's cumulative predicted_ms; a straggler
    arriving later than BURST_GAP_S (a busy machine) still joins its pass, a new stamp
    starts the next step at once."""
    straggle = 4 * BURST_GAP_S
    events = steps([
        ("chunk", 0.2, chunk("A", predicted_n=1, predicted_ms=0.001)),
        ("chunk", 0.33, chunk(" rou", predicted_n=2, predicted_ms=128.0, draft_n=4, draft_n_accepted=2)),
        ("chunk", 0.33 + straggle, chunk("x", predicted_n=3, predicted_ms=128.0, draft_n=4, draft_n_accepted=2)),
        ("chunk", 0.33 + straggle + GAP_INSIDE_A_BURST,
         chunk(" is", predicted_n=4, predicted_ms=128.0, draft_n=4, draft_n_accepted=2)),
        ("chunk", 0.46, chunk(" a", predicted_n=5, predicted_ms=259.0, draft_n=8, draft_n_accepted=2)),
        ("chunk", 0.46 + GAP_INSIDE_A_BURST, chunk(finish_reason="length")),
        ("done", 0.46 + 2 * GAP_INSIDE_A_BURST),
    ])
    assert [e.text_delta for e in events] == ["A", " roux is", " a", ""]
    verify = events[1]       # one verification: 2 of 4 draft tokens accepted, plus the target's own
    assert (verify.num_tokens, verify.proposed, verify.accepted) == (3, 4, 2)
    assert verify.step_time_s == pytest.approx(0.33 + straggle + GAP_INSIDE_A_BURST - 0.2)
    assert (events[2].num_tokens, events[2].proposed, events[2].accepted) == (1, 4, 0)
    assert events[-1].finish_reason == "length"


def test_ttft_is_the_first_chunks_arrival_when_more_chunks_join_the_first_step():
    events = steps([
        ("chunk", 0.25, chunk("Hel", completion_tokens=1)),
        ("chunk", 0.25 + GAP_INSIDE_A_BURST, chunk("lo", completion_tokens=2)),
        ("done", 0.4),
    ])
    assert events[0].text_delta == "Hello" and events[0].num_tokens == 2
    assert events[0].ttft_s == pytest.approx(0.25)
    assert events[-1].summary.ttft_s == pytest.approx(0.25)


def test_a_server_dying_right_after_a_burst_keeps_the_burst_then_says_so():
    request = RemoteRequest(QuietHost(), ScriptedStream([
        ("chunk", 0.2, chunk("A", completion_tokens=1)),
        ("chunk", 0.3, chunk(" b", completion_tokens=2)),
        ("lost", 0.3 + GAP_INSIDE_A_BURST, "connection reset"),
    ]), before=None)
    assert request.step().text_delta == "A"
    assert request.step().text_delta == " b"
    with pytest.raises(ServerDiedError, match="after 2 tokens"):
        request.step()
