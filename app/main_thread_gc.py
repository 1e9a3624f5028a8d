"""Run Python's cyclic garbage collector on the GUI thread only.

Python collects garbage on whichever thread happens to allocate when a threshold is
crossed. The engine worker allocates a lot (a new cache pool builds thousands of block
records), so it often is that thread, and it then frees whatever cycles are due,
including Qt wrappers from the GUI (a closed window, pyqtgraph items). Destroying Qt
objects off their thread is unsafe; with shiboken6 6.12 we saw it crash the process in
BindingManager::runDeletionInMainThread. pyqtgraph's answer, followed here: switch
automatic collection off and collect from a QTimer, which always fires on the GUI thread.
"""
from __future__ import annotations

import gc

from PySide6.QtCore import QObject, QTimer

INTERVAL_MS = 1000
THRESHOLDS = (700, 10, 10)    # Python's own defaults: the same pace, on a timer


class MainThreadGarbageCollector(QObject):
    def __init__(self, parent=None):
        super().__init__(parent)
        self._was_enabled = gc.isenabled()
        self.timer = QTimer(self)
        self.timer.setInterval(INTERVAL_MS)
        self.timer.timeout.connect(self.collect)

    def start(self) -> None:
        self._was_enabled = gc.isenabled()
        gc.disable()
        self.timer.start()

    def stop(self) -> None:
        """Collect once more and hand collection back to Python (if it had it before)."""
        self.timer.stop()
        gc.collect()
        if self._was_enabled:
            gc.enable()

    def collect(self) -> None:
        """A generational collection, as Python would run it, but here on this thread."""
        young, middle, old = gc.get_count()
        if young > THRESHOLDS[0]:
            gc.collect(0)
            if middle > THRESHOLDS[1]:
                gc.collect(1)
                if old > THRESHOLDS[2]:
                    gc.collect(2)
