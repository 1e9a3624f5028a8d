"""Does the app distort what it measures? `python -m app.fidelity [--json]`.

Runs the real app offscreen (window, worker thread, plots, chat) and the headless engine on
the same prompt, the same settings and the same torch thread count, interleaved, and
compares their decode speeds (engine.metrics' definition: tokens after the first / decode
wall time). Prints app_tok_s, headless_tok_s, ratio (app / headless, medians) and threads.
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


class AppRunner:
    """The real workbench, offscreen, driven as a user would: type, send, wait."""

    def __init__(self, config_dir: str, max_tokens: int):
        from PySide6.QtWidgets import QApplication
        from app.__main__ import build
        from app.theme import style_sheet
        from engine.profiles import ProfileStore
        self.qapp = QApplication.instance() or QApplication([])
        self.qapp.setStyleSheet(style_sheet())
        self.workbench = build(store=ProfileStore(config_dir))
        self.workbench.window.show()
        wait_until(lambda: self.workbench.controller.model_ready)
        self.workbench.window.settings.widget("max_tokens").setValue(max_tokens)
        self.done: list[dict] = []
        self.workbench.host.worker.requestDone.connect(self.done.append)

    def reply(self) -> dict:
        controller = self.workbench.controller
        controller.new_chat()
        before = len(self.done)
        controller.send(PROMPT)
        wait_until(lambda: len(self.done) > before and controller.request_id is None)
        return self.done[-1]

    def threads(self) -> int:
        return self.workbench.controller.effective["threads"]

    def close(self) -> None:
        self.workbench.window.close()
        self.workbench.shutdown(save_session=False)


def headless_engine(profile, threads: int):
    import torch
    from engine import LLMEngine
    torch.set_num_threads(threads)
    return LLMEngine.load(profile.model, profile.engine_config())


def measure(repeats: int, max_tokens: int) -> dict:
    with tempfile.TemporaryDirectory() as config_dir:
        app = AppRunner(config_dir, max_tokens)
        try:
            profile = app.workbench.controller.current_profile()
            threads = app.threads()
            engine = headless_engine(profile, threads)
            messages = [{"role": "system", "content": profile.system_prompt}, {"role": "user", "content": PROMPT}]
            params = profile.sampling_params()
            app.reply(), engine.generate_text(messages, params)          # warm-up, both
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
    return {"app_tok_s": a, "headless_tok_s": h, "ratio": a / h, "threads": threads, "repeats": repeats,
            "max_tokens": max_tokens, "generated_tokens_app_headless": tokens,
            "app_tok_s_runs": app_speeds, "headless_tok_s_runs": headless_speeds}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.fidelity", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args(argv)
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    result = measure(args.repeats, args.max_tokens)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
