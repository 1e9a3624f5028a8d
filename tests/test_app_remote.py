"""The app driving a real llama.cpp server (issue 12's app side): "Connect to server…" swaps
the tiny local model for the server, replies stream into the same chat and the same metrics
history, and a server that cannot be reached leaves the local model and the transcript as
they were. The Connect dialog lists the server's models off the GUI thread, and the
server's HTTP client is closed whenever the app lets go of the server. The server (scripts/build_llama_server.sh) serves the embedded GGUF on 127.0.0.1
without speculation; these tests never skip: without the binary the fixture fails and names
the build script."""
import math
import time

import pytest
from PySide6.QtCore import Qt

from app.engine_worker import CHANGE_SETTINGS, LOAD_DRAFT, LOAD_MODEL
from test_app import (SETTLE_TIMEOUT_MS, collect, open_workbench, send, set_widget,  # noqa: F401 - fixtures
                      tiny_bench, tiny_profile)

CONNECT_TIMEOUT_MS = 30_000
UNREACHABLE = "http://127.0.0.1:9"      # the discard port: nothing listens there


@pytest.fixture(scope="module")
def server():
    from engine.errors import LlamaServerMissingError
    from engine.loading.loader import default_gguf_path
    from engine.remote.llama_server import LlamaServer
    try:
        # one thread: on a busy 2-core machine llama.cpp's spinning threads starve each other
        running = LlamaServer(default_gguf_path(), metrics=True, threads=1).start()
    except LlamaServerMissingError as e:
        pytest.fail(str(e))
    yield running
    running.stop()


def open_connect_dialog(bench):
    """Open "Connect to server…" from the Model menu, as a user would."""
    window = bench.window
    action = next(a for a in window.menuBar().actions() if a.text() == "&Model")
    next(a for a in action.menu().actions() if a.text() == "Connect to server…").trigger()
    dialog = window.settings.connect_dialog
    assert dialog.isVisible()
    return dialog


def connect(bench, qtbot, url: str, model: str = "", api_key_env: str = "") -> None:
    """Fill in "Connect to server…" and press Connect."""
    dialog = open_connect_dialog(bench)
    dialog.url_edit.setText(url)
    dialog.model_combo.setEditText(model)
    dialog.key_env_edit.setText(api_key_env)
    dialog.buttons.accepted.emit()
    assert not dialog.isVisible()


def connected(bench, qtbot, previous=None):
    """Wait until the worker drives a server (another one than `previous`); returns the backend."""
    qtbot.waitUntil(lambda: bench.controller.effective.get("backend") == "remote" and bench.controller.busy == ""
                    and bench.host.worker.engine is not previous, timeout=CONNECT_TIMEOUT_MS)
    return bench.host.worker.engine


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
    bench.window.chat.set_raw(True)         # as typed: rendered Markdown drops a reply's leading space
    assert reply and reply in bench.window.chat.transcript.toPlainText()
    assert bench.controller.conversation[-1] == {"role": "assistant", "content": reply}
    assert len(bench.controller.conversation) == 4   # the local exchange is kept

    # the history records every server step; the numbers a server does not give are gaps
    assert bench.history.num_steps == local_steps + len(steps) and bench.history.num_requests == 2
    remote = slice(local_steps, None)
    assert all(math.isnan(v) for v in bench.history.step_series("kv_used_mib")[remote])
    assert sum(bench.history.step_series("tokens")[remote]) == done["summary"]["generated_tokens"]
    # the stream's end emits no token: no decode-speed point at 0 tok/s, a gap
    speeds = bench.history.step_series("tok_s")[remote]
    assert steps[-1]["num_tokens"] == 0 and math.isnan(speeds[-1])
    assert all(speed > 0 for speed in speeds if not math.isnan(speed))
    usage = bench.history.step_series("kv_usage")[remote]
    assert any(0 < u <= 1 for u in usage if not math.isnan(u))       # llama.cpp's /slots
    plots = bench.window.plots                  # drawn as % of the server's cache, bytes being unknown
    plots.refresh()
    _, drawn = plots.kv_share_curve.getData()
    assert plots.kv_shows_share and plots.kv_share_curve.isVisible() and not plots.kv_model_curve.isVisible()
    assert list(drawn[-len(usage):]) == pytest.approx(list(usage * 100), nan_ok=True)
    assert all(math.isnan(v) for v in drawn[:local_steps])           # a local step's share is of another cache
    assert "%" in plots.kv_plot.getAxis("left").labelText
    assert bench.history.request_series("ttft_ms")[-1] > 0
    assert bench.window.chat.send_button.isEnabled()


def test_a_speculating_servers_per_position_counters_fill_the_per_position_plot(tiny_bench, qtbot):
    """The server's steps carry no per-position data; its /metrics counters do, and the plot
    shows them, labelled as the server's, with no local speedup verdict (no plain baseline)."""
    from engine.loading.loader import default_gguf_path
    from engine.remote.llama_server import LlamaServer
    bench = tiny_bench
    gguf = default_gguf_path()
    with LlamaServer(gguf, draft=gguf, metrics=True, threads=1) as speculating:
        connect(bench, qtbot, speculating.url)
        connected(bench, qtbot)
        done = send(bench, qtbot, "What is a roux? Answer in one sentence.")
    server_rates = done["summary"]["per_position"]
    assert server_rates and all(0 <= rate <= 1 for rate in server_rates)
    plots = bench.window.plots
    plots.refresh()
    assert list(plots.positions_bars.opts["height"]) == pytest.approx([rate * 100 for rate in server_rates])
    assert "the server's counters" in plots.positions_plot.titleLabel.text
    assert "speculation" not in plots.acceptance_title.text


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
    assert kind == LOAD_DRAFT and "fixed when it is launched" in message and "-md <draft.gguf>" in message
    assert bench.window.settings.values()["draft_model"] is None      # the choice reverts
    assert bench.controller.effective.get("backend") == "remote"


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


def test_the_connect_dialog_lists_the_models_the_server_serves(tiny_bench, server, qtbot):
    from engine.remote.backend import list_served_models
    bench = tiny_bench
    dialog = open_connect_dialog(bench)
    dialog.url_edit.setText(server.url)
    qtbot.mouseClick(dialog.list_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: dialog.model_combo.count() > 0, timeout=CONNECT_TIMEOUT_MS)
    served = list_served_models(server.url)
    assert [dialog.model_combo.itemText(i) for i in range(dialog.model_combo.count())] == served
    assert dialog.model() == served[0] and f"{server.url} serves 1 model" in dialog.models_note.text()
    assert dialog.models_error.isHidden()
    dialog.buttons.accepted.emit()              # the listed model is the one connected to
    connected(bench, qtbot)
    assert bench.controller.effective["model"] == served[0]


def test_a_server_that_cannot_be_asked_for_models_is_reported_in_the_dialog(tiny_bench, silent_port, qtbot):
    bench = tiny_bench
    dialog = open_connect_dialog(bench)
    hung = f"http://127.0.0.1:{silent_port}"
    dialog.url_edit.setText(hung)
    dialog.model_combo.setEditText("my-model")
    dialog.key_env_edit.setText("")
    started = time.monotonic()
    qtbot.mouseClick(dialog.list_button, Qt.MouseButton.LeftButton)
    assert time.monotonic() - started < 1.0     # the GUI thread does not wait for the answer
    assert "Asking" in dialog.models_note.text()
    qtbot.waitUntil(dialog.models_error.isVisible, timeout=CONNECT_TIMEOUT_MS)
    assert "Could not list the models" in dialog.models_error.text() and "no answer from" in dialog.models_error.text()
    dialog.url_edit.setText(UNREACHABLE)        # leaving the field with a new address asks again
    dialog.url_edit.editingFinished.emit()
    qtbot.waitUntil(lambda: "cannot reach" in dialog.models_error.text(), timeout=CONNECT_TIMEOUT_MS)
    assert UNREACHABLE in dialog.models_error.text()
    # nothing the user typed is lost, and nothing changed in the app
    assert dialog.isVisible() and dialog.url_edit.text() == UNREACHABLE and dialog.model() == "my-model"
    assert bench.controller.effective.get("backend") != "remote" and bench.controller.model_ready


def test_the_server_connection_is_closed_when_the_app_lets_go_of_it(open_workbench, tiny_profile, server, qtbot):
    bench = open_workbench(tiny_profile())
    connect(bench, qtbot, server.url)
    first = connected(bench, qtbot)
    assert not first.client.is_closed
    connect(bench, qtbot, server.url)           # reconnecting
    second = connected(bench, qtbot, previous=first)
    assert first.client.is_closed and not second.client.is_closed
    bench.controller.load_model(bench.controller.model_reference)       # back to the local model
    qtbot.waitUntil(lambda: bench.controller.effective.get("backend") != "remote" and bench.controller.busy == "",
                    timeout=SETTLE_TIMEOUT_MS)
    assert second.client.is_closed
    connect(bench, qtbot, server.url)
    third = connected(bench, qtbot)
    bench.shutdown(save_session=False)          # the app exits
    assert third.client.is_closed and bench.host.worker.engine is None
