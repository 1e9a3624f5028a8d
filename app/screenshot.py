"""Take the README's screenshots from the real app: short scripted sessions.

    QT_QPA_PLATFORM=offscreen python -m app.screenshot [--out docs/screenshot.png]
    QT_QPA_PLATFORM=offscreen python -m app.screenshot --remote [--out docs/screenshot-remote.png]
    QT_QPA_PLATFORM=offscreen python -m app.screenshot --remote vllm [--out docs/screenshot-vllm.png]
    QT_QPA_PLATFORM=offscreen python -m app.screenshot --laptop [--out docs/screenshot-1366x768.png]
    QT_QPA_PLATFORM=offscreen python -m app.screenshot --load [--out docs/screenshot-load.png]
    QT_QPA_PLATFORM=offscreen python -m app.screenshot --plots [--out docs/screenshot-plots.png]
    QT_QPA_PLATFORM=offscreen python -m app.screenshot --moe [--out docs/screenshot-moe.png]
    QT_QPA_PLATFORM=offscreen python -m app.screenshot --quality [--out docs/screenshot-quality.png]

The default mode chats with the default model, turning optimizations on between replies (so
the plots show markers and their effect), then grabs the window while the last reply
streams. --plots adds a turn whose reply the EAGLE head drafts as trees, then saves the
live plots panel whole (every row, as Export PNG writes it). --remote starts llama.cpp's
llama-server on the embedded GGUF, drafting for itself, with --metrics
(engine.remote.llama_server; scripts/build_llama_server.sh builds it), connects to it as
"Connect to server…" does, and grabs the window after two chat turns: acceptance and TTFT
from the server's figures, KV usage from its /slots. --remote vllm does the same with vLLM
(engine.remote.vllm_server; scripts/build_vllm.sh installs it) on the default model's
weights as float safetensors (engine.bench.float_folder), with ngram speculation: acceptance from its spec-decode
counters, KV usage from its /metrics gauge; it takes minutes to start. --moe loads a tiny
random mixture-of-experts model (engine.loading.synthetic "tiny-qwen3-moe"), answers one
message and serves a load run, then grabs the window: "In effect" with its MoE row, the load
panel with the experts each step woke. --quality measures, in a 1366x768 window, the current
settings, the built-in all_optimizations and an FP8 KV cache against the reference, then turns
n-gram speculation on and measures the current settings again (the plot marks the change), and
grabs the window with the Quality tab raised. Settings go to a temporary config folder, never the user's.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QApplication

from app.__main__ import build
from app.quality_panel import CURRENT
from app.theme import style_sheet
from engine.bench.float_folder import float_folder
from engine.loading.loader import default_gguf_path
from engine.loading.synthetic import write_checkpoint
from engine.profiles import ProfileStore
from engine.remote.llama_server import LlamaServer
from engine.remote.vllm_server import VllmServer

# (what to change in the side panel before the message, the message)
SCRIPT = (
    ({}, "What is the capital of France?"),
    ({"proposer": "ngram"}, "Repeat this sentence twice: the quick brown fox jumps over the lazy dog."),
    ({"kv_cache_dtype": "fp8_e4m3"}, "Now say it once more, then name the animals in it."),
    # The last reply streams while the picture is taken: rendered Markdown (a list, emphasis,
    # a code block) coloured by draft outcome.
    ({"proposer": "auto"}, "Show me a Python function that reverses a string, then give three tips for testing it."),
)
# --plots: one more turn, the EAGLE head drafting trees (what the plots' tree row shows)
TREE_TURN = ({"draft_tree": "4:6:24"}, "Now give me three tips for naming functions.")
CODE_FENCES_BEFORE_GRAB = 2       # the last reply's first code block closed
CHARACTERS_BEFORE_GRAB = 700      # or this much of it, whichever comes first
LAST_REPLY_MAX_TOKENS = 200
# --remote: two turns on one system prompt, so the second shows the server's prefix-cache hits
REMOTE_SYSTEM_PROMPT = "You are a concise cooking tutor. Answer in two or three plain sentences."
REMOTE_SCRIPT = ("What is a roux, and what is it used for?", "And how does a béchamel differ from it?")
REMOTE_MAX_TOKENS = 96
REMOTE_MODEL_NAME = "SmolLM2-135M-Instruct"     # what the server calls it (--alias), not its file path
# --remote vllm: turns that repeat text, so ngram speculation has something to look up
VLLM_SCRIPT = ("Write this sentence five times, one per line: the quick brown fox jumps over the lazy dog.",
               "Now write it three more times, then name the animals in it.")
VLLM_NGRAM_K = 4
VLLM_PLOTS_SHARE = 0.6     # the replies are short lines: the plots get the room (TTFT in view)
REMOTE_ENGINES = ("llama-server", "vllm")
WINDOW_SIZE = (1600, 1000)        # the README pictures: a desktop-sized window
LAPTOP_SIZE = (1366, 768)
LOAD_WORKLOAD = {"num_prompts": 16, "max_concurrency": 4, "output_len": 32, "request_rate": None}
LOAD_DOCK_SHARE = 0.68            # --load: the load panel's plots and its table both in view
MOE_PRESET = "tiny-qwen3-moe"     # --moe: a random mixture-of-experts model of 8 experts, top-2
# --quality: the configurations measured (a profile saved for the picture: the FP8 cache alone)
QUALITY_FP8_PROFILE = "fp8 KV cache"
QUALITY_PROFILES = ("all_optimizations", QUALITY_FP8_PROFILE)
QUALITY_TOKENS = 1024             # of the shipped text: a minute or two a configuration on a laptop CPU
QUALITY_DOCK_SHARE = 0.62         # of the window's width: the table's columns in view beside the chat


def wait_until(predicate, timeout_s: float = 600) -> None:
    """Run the app's event loop until predicate() holds, as a user waiting would."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("the app did not get there in time")
        QApplication.processEvents()
        time.sleep(0.002)


def apply(panel, changes: dict) -> None:
    for key, value in changes.items():
        combo = panel.widget(key)
        combo.setCurrentIndex(combo.findData(value))


def run(out: Path, remote: str | None = None, mode: str = "chat") -> None:
    app = QApplication.instance() or QApplication([])
    app.setStyleSheet(style_sheet())
    with tempfile.TemporaryDirectory() as config:
        model = str(write_checkpoint(Path(config) / MOE_PRESET, MOE_PRESET)) if mode == "moe" else None
        workbench = build(store=ProfileStore(config), start=not remote, model=model)     # attached: no local model
        try:
            if remote:
                chat_with_server_and_grab(workbench, out, remote)
            elif mode == "load":
                serve_and_grab(workbench, out)
            elif mode == "moe":
                moe_and_grab(workbench, out)
            elif mode == "quality":
                measure_and_grab(workbench, out)
            else:
                chat_and_grab(workbench, out, LAPTOP_SIZE if mode == "laptop" else WINDOW_SIZE,
                              whole_plots=mode == "plots")
        finally:
            workbench.controller.stop()
            workbench.shutdown()
            # Closed before Python exits: a window left open after a plots grab can crash
            # Qt's teardown at exit (the app's own exit closes its window first).
            workbench.window.close()
    print(f"saved {out}")


def warm_up(workbench) -> None:
    """One unshown reply first: the first forward passes of a process are slow (allocation,
    kernel selection) and would make the first plotted request look worse than it is."""
    window, controller = workbench.window, workbench.controller
    window.settings.widget("max_tokens").setValue(4)
    controller.send("Hi!")
    wait_until(lambda: controller.request_id is None)
    controller.new_chat()
    workbench.history.clear()


def show(window, size=WINDOW_SIZE) -> None:
    window.resize(*size)
    window.size_docks()
    window.show()


def grab(window, out: Path) -> None:
    window.plots.refresh()
    QApplication.processEvents()
    out.parent.mkdir(parents=True, exist_ok=True)
    window.grab().save(str(out), "PNG")


def chat_and_grab(workbench, out: Path, size=WINDOW_SIZE, whole_plots: bool = False) -> None:
    window, controller = workbench.window, workbench.controller
    show(window, size)
    wait_until(lambda: controller.model_ready)
    warm_up(workbench)
    window.settings.widget("max_tokens").setValue(48)
    script = SCRIPT + (TREE_TURN,) if whole_plots else SCRIPT
    for number, (changes, message) in enumerate(script, start=1):
        apply(window.settings, changes)
        if number == len(script):
            window.settings.widget("max_tokens").setValue(LAST_REPLY_MAX_TOKENS)
        controller.send(message)
        if number < len(script):
            wait_until(lambda: controller.request_id is None)
    # Mid-reply: the last answer is still streaming when the picture is taken.
    wait_until(lambda: _shows_enough("".join(controller.reply_parts)) or controller.request_id is None)
    window.chat.flush()                                   # its latest tokens drawn
    if whole_plots:
        out.parent.mkdir(parents=True, exist_ok=True)
        window.plots.save_png(str(out))
    else:
        grab(window, out)


def _shows_enough(reply: str) -> bool:
    return reply.count("```") >= CODE_FENCES_BEFORE_GRAB or len(reply) >= CHARACTERS_BEFORE_GRAB


def _load_dock_ready(workbench) -> None:
    """The window shown with its load dock raised and sized, the model loaded and warm."""
    window = workbench.window
    show(window)
    window.load_dock.raise_()
    window.resizeDocks([window.load_dock], [int(WINDOW_SIZE[1] * LOAD_DOCK_SHARE)], Qt.Orientation.Vertical)
    wait_until(lambda: workbench.controller.model_ready)
    warm_up(workbench)


def serve_and_grab(workbench, out: Path) -> None:
    window, load = workbench.window, workbench.load
    _load_dock_ready(workbench)
    panel = window.load_panel
    for key, value in LOAD_WORKLOAD.items():
        panel.controls[key].set_value(value)
    panel.start_button.click()
    wait_until(lambda: load.history.progress >= 0.5 or not load.running)
    apply(window.settings, {"proposer": "ngram"})          # live, mid-run: a marker on every plot
    wait_until(lambda: not load.running)
    apply(window.settings, {"proposer": "off"})
    panel.profile_a.setCurrentText("baseline")
    panel.profile_b.setCurrentText("all_optimizations")
    panel.ab_button.click()
    wait_until(lambda: load.running)
    wait_until(lambda: not load.running)
    if window.error_text() or len(load.history.rows) != 3:
        raise RuntimeError(f"the load runs failed: {window.error_text()}")
    panel.table.selectRow(1)
    panel.table.selectRow(2)
    QApplication.processEvents()
    panel.refresh()
    grab(window, out)


def moe_and_grab(workbench, out: Path) -> None:
    """One chat reply, then a load run (several requests a step: more experts woken per step)."""
    window, controller, load = workbench.window, workbench.controller, workbench.load
    _load_dock_ready(workbench)
    window.settings.widget("max_tokens").setValue(24)
    controller.send("Hello! Which experts are awake?")
    wait_until(lambda: controller.request_id is None)
    panel = window.load_panel
    for key, value in LOAD_WORKLOAD.items():
        panel.controls[key].set_value(value)
    panel.start_button.click()
    wait_until(lambda: load.running)
    wait_until(lambda: not load.running)
    if window.error_text() or not load.history.rows:
        raise RuntimeError(f"the MoE session failed: {window.error_text()}")
    panel.refresh()
    # In view: "In effect" (the MoE row) and the load panel's last plot row (the experts)
    window.settings_dock.widget().ensureWidgetVisible(window.settings.effective_label)
    plots = panel.graphics.parentWidget().parentWidget()        # the plots' scroll area
    plots.verticalScrollBar().setValue(plots.verticalScrollBar().maximum())
    grab(window, out)


def measure_and_grab(workbench, out: Path) -> None:
    """Measure three configurations, change a setting, measure the current settings again."""
    window, controller, quality = workbench.window, workbench.controller, workbench.quality
    show(window, LAPTOP_SIZE)
    window.quality_dock.raise_()
    window.resizeDocks([window.quality_dock], [int(LAPTOP_SIZE[0] * QUALITY_DOCK_SHARE)], Qt.Orientation.Horizontal)
    wait_until(lambda: controller.model_ready and controller.busy == "")
    fp8 = replace(controller.current_profile(), kv_cache_dtype="fp8_e4m3")
    workbench.store.save(fp8, QUALITY_FP8_PROFILE)
    controller._show_title()                                # the new profile offered
    quality.tokens = QUALITY_TOKENS
    panel = window.quality_panel
    for names in ([CURRENT, *QUALITY_PROFILES], [CURRENT]):
        if names == [CURRENT]:
            apply(window.settings, {"proposer": "ngram"})      # a change between two measurements
            wait_until(lambda: controller.effective.get("proposer") == "ngram")
        panel.set_checked(names)
        panel.measure_button.click()
        wait_until(lambda: quality.running)
        wait_until(lambda: not quality.running, timeout_s=1800)
        if window.error_text():
            raise RuntimeError(f"the quality measurement failed: {window.error_text()}")
    panel.refresh()
    grab(window, out)


def chat_with_server_and_grab(workbench, out: Path, engine: str = "llama-server") -> None:
    window, controller = workbench.window, workbench.controller
    show(window)
    if engine == "vllm":
        window.resizeDocks([window.plots_dock], [int(WINDOW_SIZE[1] * VLLM_PLOTS_SHARE)], Qt.Orientation.Vertical)
    with started_server(engine) as server:
        controller.connect_server(server.url, "", "")
        wait_until(lambda: controller.model_ready and controller.busy == "", timeout_s=120)
        window.chat.set_system_prompt(REMOTE_SYSTEM_PROMPT)
        window.settings.widget("max_tokens").setValue(REMOTE_MAX_TOKENS)
        for message in VLLM_SCRIPT if engine == "vllm" else REMOTE_SCRIPT:
            controller.send(message)
            wait_until(lambda: controller.request_id is None)
        if window.error_text():
            raise RuntimeError(f"the session with {server.url} failed: {window.error_text()}")
        grab(window, out)


def started_server(engine: str):
    """The server the picture is attached to, speculating (one thread: on a busy 2-core
    machine llama.cpp's spinning threads starve each other)."""
    if engine == "vllm":
        return VllmServer(float_folder(), served_model_name=REMOTE_MODEL_NAME, ngram_k=VLLM_NGRAM_K, threads=1,
                          progress=lambda message: print(message, flush=True))
    gguf = default_gguf_path()
    return LlamaServer(gguf, draft=gguf, metrics=True, threads=1, extra=("--alias", REMOTE_MODEL_NAME))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--remote", nargs="?", const="llama-server", choices=REMOTE_ENGINES, default=None,
                        help="attached to a server started for the picture: llama-server (the default) or vllm")
    parser.add_argument("--laptop", action="store_true", help="the chat session in a 1366x768 window")
    parser.add_argument("--load", action="store_true", help="a load run and an A/B with the results table")
    parser.add_argument("--plots", action="store_true", help="the chat session and a turn drafting trees, then the "
                        "whole live plots panel")
    parser.add_argument("--moe", action="store_true", help="a tiny mixture-of-experts model: a reply and a load run")
    parser.add_argument("--quality", action="store_true", help="the Quality tab at 1366x768 after measuring three "
                        "configurations and the current settings again after a change")
    parser.add_argument("--out", type=Path, help="default: docs/screenshot.png, -remote, -vllm, -1366x768, -load, "
                        "-plots, -moe or -quality.png")
    args = parser.parse_args()
    mode = ("load" if args.load else "laptop" if args.laptop else "plots" if args.plots else "moe" if args.moe
            else "quality" if args.quality else "chat")
    default = {"chat": "screenshot.png", "laptop": "screenshot-1366x768.png", "load": "screenshot-load.png",
               "plots": "screenshot-plots.png", "moe": "screenshot-moe.png", "quality": "screenshot-quality.png"}[mode]
    remote_picture = {"llama-server": "screenshot-remote.png", "vllm": "screenshot-vllm.png"}.get(args.remote)
    run(args.out or Path("docs") / (remote_picture or default), args.remote, mode)


if __name__ == "__main__":
    main()
