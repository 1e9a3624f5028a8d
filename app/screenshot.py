"""Take docs/screenshot.png from the real app: a short scripted session, captured mid-reply.

    QT_QPA_PLATFORM=offscreen python -m app.screenshot [--out docs/screenshot.png]

It chats with the default model, turning optimizations on between replies (so the plots
show markers and their effect), then grabs the window while the last reply streams.
Settings go to a temporary config folder, never the user's.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from PySide6.QtWidgets import QApplication

from app.__main__ import build
from app.theme import style_sheet
from engine.profiles import ProfileStore

# (what to change in the side panel before the message, the message)
SCRIPT = (
    ({}, "What is the capital of France?"),
    ({"proposer": "ngram"}, "Repeat this sentence twice: the quick brown fox jumps over the lazy dog."),
    ({"kv_cache_dtype": "fp8_e4m3"}, "Now say it once more, then name the animals in it."),
    ({"proposer": "draft", "draft_model": "self"}, "Give me three tips for writing clear documentation."),
)
CHARACTERS_BEFORE_GRAB = 120      # of the last reply
LAST_REPLY_MAX_TOKENS = 200


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


def run(out: Path) -> None:
    app = QApplication.instance() or QApplication([])
    app.setStyleSheet(style_sheet())
    with tempfile.TemporaryDirectory() as config:
        workbench = build(store=ProfileStore(config))
        try:
            chat_and_grab(workbench, out)
        finally:
            workbench.controller.stop()
            workbench.shutdown()
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


def chat_and_grab(workbench, out: Path) -> None:
    window, controller = workbench.window, workbench.controller
    window.resize(1600, 1000)     # the README picture: a desktop-sized window
    window.size_docks()
    window.show()
    wait_until(lambda: controller.model_ready)
    warm_up(workbench)
    window.settings.widget("max_tokens").setValue(48)
    for number, (changes, message) in enumerate(SCRIPT, start=1):
        apply(window.settings, changes)
        if number == len(SCRIPT):
            window.settings.widget("max_tokens").setValue(LAST_REPLY_MAX_TOKENS)
        controller.send(message)
        if number < len(SCRIPT):
            wait_until(lambda: controller.request_id is None)
    # Mid-reply: the last answer is still streaming when the picture is taken.
    wait_until(lambda: len("".join(controller.reply_parts)) >= CHARACTERS_BEFORE_GRAB or controller.request_id is None)
    window.plots.refresh()
    QApplication.processEvents()
    out.parent.mkdir(parents=True, exist_ok=True)
    window.grab().save(str(out), "PNG")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/screenshot.png"))
    run(parser.parse_args().out)


if __name__ == "__main__":
    main()
