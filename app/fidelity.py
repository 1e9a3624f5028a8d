"""Does the app distort what it measures? `python -m app.fidelity [--json] [--fresh-cache]`.

Runs the real app offscreen (window, worker thread, plots, chat) and the headless engine on
the same prompt and the same settings, interleaved, and compares their decode speeds
(engine.metrics' definition: tokens after the first / decode wall time). The headless engine
runs at the engine's default torch threads (torch's own count, or OMP_NUM_THREADS), and the
app with whatever it chose itself. Prints app_tok_s, headless_tok_s, ratio (app / headless,
medians), app_threads and headless_threads.

--fresh-cache points the user cache (WORKBENCH_CACHE_DIR: the embedded model's conversion,
the inductor cache, the CPU dtype probe) at an empty folder, as on a new machine, and adds
first_reply_tok_s and second_reply_tok_s: the decode speed the app shows under its first
and second reply to the same prompt. --compile picks the `compile` setting (on: the compiled
step, which the app builds at load).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

from app.screenshot import wait_until

PROMPT = "Write a long story about a dragon who learns to cook."
REPLY_TIMEOUT_MS = 600_000


class AppRunner:
    """The real workbench, offscreen, driven as a user would: type, send, wait."""

    def __init__(self, config_dir: str, max_tokens: int, compile_mode: str | None = None):
        from PySide6.QtWidgets import QApplication
        from app.__main__ import build
        from app.theme import style_sheet
        from engine.profiles import ProfileStore, SessionProfile
        self.qapp = QApplication.instance() or QApplication([])
        self.qapp.setStyleSheet(style_sheet())
        store = ProfileStore(config_dir)
        if compile_mode is not None:
            store.save_last_session(SessionProfile(compile=compile_mode))     # the session it starts from
        self.workbench = build(store=store)
        self.workbench.window.show()
        wait_until(lambda: self.workbench.controller.model_ready)
        self.workbench.window.settings.widget("max_tokens").setValue(max_tokens)
        self.done: list[dict] = []
        self.workbench.host.worker.requestDone.connect(self.done.append)

    def reply(self) -> dict:
        """Send the prompt and run Qt's event loop until the reply ends. A blocking loop, as
        the app's own (QApplication.exec), not wait_until's polling: waking the GUI thread
        every 2 ms takes the interpreter from the worker hundreds of times a second, a cost
        the app itself does not have."""
        from PySide6.QtCore import QEventLoop, QTimer
        controller = self.workbench.controller
        controller.new_chat()
        before = len(self.done)
        loop = QEventLoop()
        worker = self.workbench.host.worker
        worker.requestDone.connect(loop.quit)           # after the controller's own slot (connected first)
        QTimer.singleShot(REPLY_TIMEOUT_MS, loop.quit)
        try:
            controller.send(PROMPT)
            if len(self.done) == before:
                loop.exec()
        finally:
            worker.requestDone.disconnect(loop.quit)
        wait_until(lambda: len(self.done) > before and controller.request_id is None)
        return self.done[-1]

    def threads(self) -> int:
        return self.workbench.controller.effective["threads"]

    def close(self) -> None:
        self.workbench.window.close()
        self.workbench.shutdown(save_session=False)


def headless_engine(profile):
    """The engine as a script gets it: on this (main) thread, at torch's default threads."""
    from engine import LLMEngine
    engine = LLMEngine.load(profile.model, profile.engine_config())
    engine.warm_compiled_step()             # as the app does at load (a no-op when eager)
    return engine


def measure(repeats: int, max_tokens: int, compile_mode: str | None = None) -> dict:
    import torch
    headless_threads = torch.get_num_threads()       # before anything in this process sets it
    with tempfile.TemporaryDirectory() as config_dir:
        app = AppRunner(config_dir, max_tokens, compile_mode)
        try:
            profile = app.workbench.controller.current_profile()
            app_threads = app.threads()
            first = app.reply()["summary"]                               # warm-up: the app's first reply
            second = app.reply()["summary"]
            engine = headless_engine(profile)
            messages = [{"role": "system", "content": profile.system_prompt}, {"role": "user", "content": PROMPT}]
            params = profile.sampling_params()
            engine.generate_text(messages, params)                       # warm-up
            app_speeds, headless_speeds, tokens = [], [], []
            for _ in range(repeats):                                      # interleaved: drift hits both
                done = app.reply()
                app_speeds.append(done["summary"]["decode_tok_s"])
                stats = engine.generate_text(messages, params)[2]
                headless_speeds.append(stats.decode_tok_s)
                tokens.append((done["summary"]["generated_tokens"], stats.generated_tokens))
        finally:
            app.close()
    a, h = statistics.median(app_speeds), statistics.median(headless_speeds)
    return {"app_tok_s": a, "headless_tok_s": h, "ratio": a / h, "app_threads": app_threads,
            "headless_threads": headless_threads, "compile": engine.settings()["compile"], "repeats": repeats,
            "max_tokens": max_tokens, "generated_tokens_app_headless": tokens,
            "app_tok_s_runs": app_speeds, "headless_tok_s_runs": headless_speeds,
            "first_reply_tok_s": first["decode_tok_s"], "second_reply_tok_s": second["decode_tok_s"],
            "first_reply_compile_s": first.get("compile_s", 0.0)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.fidelity", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--fresh-cache", action="store_true",
                        help="an empty user cache, as on a new machine (WORKBENCH_CACHE_DIR in a temporary folder)")
    parser.add_argument("--compile", choices=("off", "on", "auto"), default=None,
                        help="the compile setting (default: the default profile's)")
    args = parser.parse_args(argv)
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    with tempfile.TemporaryDirectory() as fresh:
        if args.fresh_cache:
            os.environ["WORKBENCH_CACHE_DIR"] = fresh
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)      # the compiler's cache goes there too
        result = measure(args.repeats, args.max_tokens, args.compile)
    result["fresh_cache"] = args.fresh_cache
    if not args.fresh_cache:     # a warm cache: the first two replies are not what this run is about
        result.pop("first_reply_tok_s"), result.pop("second_reply_tok_s"), result.pop("first_reply_compile_s")
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
