"""The app driving a real llama.cpp server (issue 12's app side): "Connect to server…" swaps
the tiny local model for the server, replies stream into the same chat and the same metrics
history, and a server that cannot be reached leaves the local model and the transcript as
they were. The server (scripts/build_llama_server.sh) serves the embedded GGUF on 127.0.0.1
without speculation; these tests never skip: without the binary the fixture fails and names
the build script."""
import math

import pytest

from app.engine_worker import CHANGE_SETTINGS, LOAD_DRAFT, LOAD_MODEL
from test_app import (SETTLE_TIMEOUT_MS, collect, open_workbench, send, set_widget,  # noqa: F401 - fixtures
                      tiny_bench, tiny_profile)

CONNECT_TIMEOUT_MS = 30_000
UNREACHABLE = "http://127.0.0.1:9"      # the discard port: nothing listens there


@pytest.fixture(scope="module")
def server():
    from engine.errors import LlamaServerMissingError
    from engine.llama_server import LlamaServer
    from engine.loader import default_gguf_path
    try:
        # one thread: on a busy 2-core machine llama.cpp's spinning threads starve each other
        running = LlamaServer(default_gguf_path(), metrics=True, threads=1).start()
    except LlamaServerMissingError as e:
        pytest.fail(str(e))
    yield running
    running.stop()


def connect(bench, qtbot, url: str, model: str = "", api_key_env: str = "") -> None:
    """Fill in "Connect to server…" (opened from the Model menu) and press Connect."""
    window = bench.window
    action = next(a for a in window.menuBar().actions() if a.text() == "&Model")
    next(a for a in action.menu().actions() if a.text() == "Connect to server…").trigger()
    dialog = window.settings.connect_dialog
    assert dialog.isVisible()
    dialog.url_edit.setText(url)
    dialog.model_edit.setText(model)
    dialog.key_env_edit.setText(api_key_env)
    dialog.buttons.accepted.emit()
    assert not dialog.isVisible()


def test_a_connected_server_streams_replies_into_the_chat_and_the_plots(tiny_bench, server, qtbot):
    bench = tiny_bench
    send(bench, qtbot, "Hello!")                  # a local reply first: the plots carry on across backends
    local_steps = bench.history.num_steps
    connect(bench, qtbot, server.url)
    qtbot.waitUntil(lambda: bench.controller.effective.get("backend") == "remote" and bench.controller.busy == "",
                    timeout=CONNECT_TIMEOUT_MS)
    assert server.url in bench.window.settings.model_label.text()
    assert bench.controller.effective["server_kind"] == "llama.cpp"

    steps = collect(bench.probe.stepReady)
    done = send(bench, qtbot, "What is a roux? Answer in one sentence.")
    assert done["finish_reason"] in ("stop", "length") and done["summary"]["generated_tokens"] > 0
    reply = "".join(e["text_delta"] for e in steps)
    assert reply and reply in bench.window.chat.transcript.toPlainText()
    assert bench.controller.conversation[-1] == {"role": "assistant", "content": reply}
    assert len(bench.controller.conversation) == 4   # the local exchange is kept

    # the history records every server step; the numbers a server does not give are gaps
    assert bench.history.num_steps == local_steps + len(steps) and bench.history.num_requests == 2
    remote = slice(local_steps, None)
    assert all(math.isnan(v) for v in bench.history.step_series("kv_used_mib")[remote])
    assert sum(bench.history.step_series("tokens")[remote]) == done["summary"]["generated_tokens"]
    usage = bench.history.step_series("kv_usage")[remote]
    assert any(0 < u <= 1 for u in usage if not math.isnan(u))       # llama.cpp's /slots
    assert bench.history.request_series("ttft_ms")[-1] > 0
    assert bench.window.chat.send_button.isEnabled()


def test_settings_fixed_at_server_launch_are_reported_and_nothing_changes(tiny_bench, server, qtbot):
    bench = tiny_bench
    connect(bench, qtbot, server.url)
    qtbot.waitUntil(lambda: bench.controller.effective.get("backend") == "remote", timeout=CONNECT_TIMEOUT_MS)
    with qtbot.waitSignal(bench.probe.failed, timeout=SETTLE_TIMEOUT_MS) as failed:
        set_widget(bench.window.settings.widget("kv_cache_dtype"), "fp8_e4m3")     # as a user would
    kind, _, message = failed.args
    assert kind == CHANGE_SETTINGS and "--cache-type-k" in message and "--cache-type-k" in bench.window.error_text()
    assert bench.controller.effective.get("backend") == "remote"
    with qtbot.waitSignal(bench.probe.failed, timeout=SETTLE_TIMEOUT_MS) as failed:
        bench.window.settings.choose_draft("self")
    kind, _, message = failed.args
    assert kind == LOAD_DRAFT and "fixed when it is launched" in message
    assert bench.window.settings.values()["draft_model"] is None      # the choice reverts


def test_an_unreachable_server_keeps_the_local_model_and_the_transcript(tiny_bench, qtbot):
    bench = tiny_bench
    send(bench, qtbot, "Hello!")
    name, conversation = bench.window.settings.model_label.text(), list(bench.controller.conversation)
    transcript = bench.window.chat.transcript.toPlainText()
    with qtbot.waitSignal(bench.probe.failed, timeout=CONNECT_TIMEOUT_MS) as failed:
        connect(bench, qtbot, UNREACHABLE)
    kind, doing, message = failed.args
    assert kind == LOAD_MODEL and doing == f"Connecting to {UNREACHABLE}" and "cannot reach" in message
    assert UNREACHABLE in bench.window.error_text()
    qtbot.waitUntil(lambda: bench.controller.busy == "", timeout=SETTLE_TIMEOUT_MS)
    assert bench.window.settings.model_label.text() == name and bench.controller.effective.get("backend") != "remote"
    assert bench.controller.conversation == conversation
    assert bench.window.chat.transcript.toPlainText() == transcript
    assert bench.window.chat.send_button.isEnabled() and not bench.window.progress.isVisible()
    send(bench, qtbot, "Still there?")                # the local model still answers
    assert len(bench.controller.conversation) == 4


def test_the_session_remembers_the_server_but_never_the_api_key(open_workbench, tiny_profile, server, qtbot,
                                                                 tmp_path, monkeypatch):
    import json
    monkeypatch.setenv("WORKBENCH_TEST_KEY", "secret-key-123")       # llama-server without --api-key ignores it
    bench = open_workbench(tiny_profile())
    connect(bench, qtbot, server.url, api_key_env="WORKBENCH_TEST_KEY")
    qtbot.waitUntil(lambda: bench.controller.effective.get("backend") == "remote", timeout=CONNECT_TIMEOUT_MS)
    bench.controller.save_last_session()
    saved = (bench.store.root / "last_session.json").read_text()
    data = json.loads(saved)
    assert (data["backend"], data["server_url"], data["api_key_env"]) == ("remote", server.url, "WORKBENCH_TEST_KEY")
    assert data["model"] == bench.controller.profile.model            # the local model is kept too
    assert "secret-key-123" not in saved
    # The next start connects to the same server.
    reopened = open_workbench(store=bench.store, start=False)
    reopened.controller.start()
    qtbot.waitUntil(lambda: reopened.controller.effective.get("url") == server.url, timeout=CONNECT_TIMEOUT_MS)
