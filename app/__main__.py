"""`python -m app` / `workbench`: open the main window on the default model, a profile's, or
the model (and draft) named on the command line."""
from __future__ import annotations

import argparse
import signal
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from PySide6.QtGui import QIcon
from PySide6.QtWidgets import QApplication

from app.controller import Controller
from app.engine_worker import EngineHost
from app.load_controller import LoadController
from app.load_history import LoadHistory
from app.main_thread_gc import MainThreadGarbageCollector
from app.main_window import MainWindow
from app.metrics_history import MetricsHistory
from app.platform_check import platform_problem
from app.quality_controller import QualityController
from app.quality_history import QualityHistory
from app.theme import APP_ICON, style_sheet
from app.window_geometry import LAYOUT_FILE
from engine.profiles import ProfileStore


@dataclass
class Workbench:
    """Everything a running workbench holds; tests and the screenshot script drive it too."""
    window: MainWindow
    controller: Controller
    host: EngineHost
    store: ProfileStore
    history: MetricsHistory
    collector: MainThreadGarbageCollector
    load: LoadController
    quality: QualityController

    def shutdown(self, save_session: bool = True) -> None:
        """Save the session, stop the worker thread, give garbage collection back."""
        if save_session:
            self.controller.save_last_session()
        self.host.stop()
        self.collector.stop()


def build(profile_path: str | None = None, store: ProfileStore | None = None, start: bool = True,
          model: str | None = None, draft: str | None = None) -> Workbench:
    """Create the window, the worker thread and the controller; start loading the model
    (or leave that to the caller, who may want to connect to the worker first). `model` and
    `draft` override the start-up profile's; a draft also turns draft speculation on."""
    # Before the worker thread starts; the module says why.
    collector = MainThreadGarbageCollector()
    collector.start()
    store = store or ProfileStore()
    profile, warning = store.startup_profile(profile_path)
    profile = with_models(profile, model, draft)
    history, load_history, quality_history = MetricsHistory(), LoadHistory(), QualityHistory()
    window = MainWindow(history, layout_file=store.root / LAYOUT_FILE, load_history=load_history,
                        quality_history=quality_history)
    host = EngineHost()
    controller = Controller(window, host.worker, store, history, profile, host.model_lister)
    load = LoadController(controller, host.worker, window.load_panel, load_history)
    quality = QualityController(controller, host.worker, window.quality_panel, quality_history, load)
    if warning:
        window.show_error(warning)
    if start:
        controller.start()
    return Workbench(window, controller, host, store, history, collector, load, quality)


def with_models(profile, model: str | None, draft: str | None):
    """The profile with the command line's model and draft (paths made absolute, so the
    saved session finds them from any folder)."""
    changes = {}
    if model:
        changes["model"] = _reference(model)
    if draft:
        changes |= {"draft_model": _reference(draft), "proposer": "draft"}
    return replace(profile, **changes) if changes else profile


def _reference(reference: str) -> str:
    path = Path(reference).expanduser()
    return str(path.resolve()) if path.exists() else reference


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="workbench", description="Inference Workbench: chat with a model and "
                                     "watch speculative decoding, the FP8 KV cache and prefix caching live.")
    parser.add_argument("--profile", metavar="PATH", help="start from a saved session profile (.json)")
    parser.add_argument("--model", metavar="MODEL", help="open this model: a Hugging Face folder or a .gguf file "
                        "(instead of the profile's)")
    parser.add_argument("--draft", metavar="DRAFT", help="load this draft model and speculate with it: a folder, "
                        "a .gguf, 'self' or 'self:N'")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    # Qt aborts with a generic message when its platform plugin cannot load; say why first.
    problem = None if QApplication.instance() else platform_problem()
    if problem:
        print(problem, file=sys.stderr)
        return 1
    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setApplicationName("Inference Workbench")
    app.setWindowIcon(QIcon(str(APP_ICON)))
    app.setStyleSheet(style_sheet())
    workbench = build(args.profile, model=args.model, draft=args.draft)
    # Ctrl+C in the terminal closes the window properly (the session is saved, the worker
    # stopped). The plots' timer lets Python see the signal while Qt's loop runs.
    signal.signal(signal.SIGINT, lambda *_: workbench.window.close())
    workbench.window.show()
    try:
        return app.exec()
    finally:
        workbench.shutdown()


if __name__ == "__main__":
    sys.exit(main())
