"""Where the main window opens: a share of the screen it is on, or where the user left it.

The layout (position, size, maximized, dock sizes and which docks are shown) is kept in a
QSettings ini file in the config folder, written when the window closes and read when the
next one opens. We keep the rectangle ourselves rather than use Qt's restoreGeometry: Qt
refuses a geometry saved on a screen of another width, and before the window is shown it
cannot tell how large the frame will be, so its clamping lets the frame overflow the screen.
"""
from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QByteArray, QMargins, QRect, QSettings, QSize, Qt
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QMainWindow

LAYOUT_FILE = "window.ini"
# Leaves room for the window frame and a panel the screen's available area does not count.
SCREEN_FRACTION = 0.9


def initial_geometry(available: QRect) -> QRect:
    """SCREEN_FRACTION of the available area, centred in it."""
    size = QSize(int(available.width() * SCREEN_FRACTION), int(available.height() * SCREEN_FRACTION))
    geometry = QRect(available.topLeft(), size)
    geometry.moveCenter(available.center())
    return geometry


def restored_geometry(saved: QRect, frame: QMargins, available: QRect) -> QRect:
    """Where a window saved at `saved` (inside a frame of `frame` margins) reopens: the same
    place moved wholly onto the screen, or, when its frame is larger than the screen (it was
    saved on a bigger monitor), the initial geometry."""
    framed = saved.marginsAdded(frame)
    if framed.width() > available.width() or framed.height() > available.height():
        return initial_geometry(available)
    framed.moveLeft(min(max(framed.left(), available.left()), available.right() - framed.width() + 1))
    framed.moveTop(min(max(framed.top(), available.top()), available.bottom() - framed.height() + 1))
    return framed.marginsRemoved(frame)


def restore_layout(window: QMainWindow, path: Path) -> bool:
    """Put the window and its docks back as saved in `path`; False when there is no usable
    geometry there (no file yet, or a damaged one), and the window keeps the one it has."""
    settings = QSettings(str(path), QSettings.Format.IniFormat)
    state = settings.value("state")
    if isinstance(state, QByteArray):
        window.restoreState(state)
    saved = settings.value("normal_geometry")
    if not isinstance(saved, QRect) or not saved.isValid():
        return False
    screen = QGuiApplication.screenAt(saved.center()) or window.screen()
    window.setGeometry(restored_geometry(saved, _frame_margins(settings), screen.availableGeometry()))
    if settings.value("maximized") in (True, "true"):
        window.setWindowState(Qt.WindowState.WindowMaximized)
    return True


def save_layout(window: QMainWindow, path: Path) -> None:
    # A layout that cannot be written (read-only config folder) only costs the next start
    # its window position, so QSettings' silent failure is acceptable here.
    settings = QSettings(str(path), QSettings.Format.IniFormat)
    frame, inner = window.frameGeometry(), window.geometry()
    settings.setValue("normal_geometry", window.normalGeometry())
    settings.setValue("frame_margins", [inner.left() - frame.left(), inner.top() - frame.top(),
                                        frame.right() - inner.right(), frame.bottom() - inner.bottom()])
    settings.setValue("maximized", window.isMaximized())
    settings.setValue("state", window.saveState())
    settings.sync()


def _frame_margins(settings: QSettings) -> QMargins:
    try:
        left, top, right, bottom = (max(0, int(v)) for v in settings.value("frame_margins"))
    except (TypeError, ValueError):
        return QMargins()           # unknown frame: fit the inner rectangle only
    return QMargins(left, top, right, bottom)
