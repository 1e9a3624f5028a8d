"""The main window fits small screens and opens again where the user left it.

Real-window checks run in a subprocess whose offscreen platform is given a screen of a
chosen size (Qt's offscreen plugin reads one from a JSON config file); the test process's
own QApplication has a fixed 800x800 screen.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PySide6.QtCore import QMargins, QRect

from app.main_window import MainWindow
from app.metrics_history import MetricsHistory
from app.window_geometry import SCREEN_FRACTION, initial_geometry, restore_layout, restored_geometry

REPO = Path(__file__).resolve().parent.parent
LAPTOP = (1366, 728)            # a 1366x768 screen less a 40-pixel taskbar

# Opens MainWindow(s) on the configured screen. argv: layout file, then per window a JSON
# list of actions; prints one report per window.
WINDOW_SCRIPT = """
import json, sys
from pathlib import Path
from PySide6.QtCore import QMargins, QRect
from PySide6.QtWidgets import QApplication
app = QApplication(sys.argv[:1])
from app.main_window import MainWindow
from app.metrics_history import MetricsHistory
from app.theme import style_sheet
app.setStyleSheet(style_sheet())

def rect(r):
    return [r.x(), r.y(), r.width(), r.height()]

for actions in sys.argv[2:]:
    window = MainWindow(MetricsHistory(), layout_file=Path(sys.argv[1]))
    window.show()
    app.processEvents()
    for action, *args in json.loads(actions):
        if action == "geometry":
            window.setGeometry(QRect(*args))
        elif action == "hide_plots":
            window.plots_dock.hide()
        app.processEvents()
    hint = window.minimumSizeHint()
    print(json.dumps({
        "available": rect(window.screen().availableGeometry()), "geometry": rect(window.geometry()),
        "frame": rect(window.frameGeometry()), "minimum_size_hint": [hint.width(), hint.height()],
        "plots_height": window.plots_dock.height(), "plots_visible": window.plots_dock.isVisible(),
        "plots_width": window.plots_dock.width(), "plots_beside": window.plots_beside,
        "transcript_height": window.chat.transcript.height(),
        "settings_width": window.settings_dock.width()}), flush=True)
    window.close()
    app.processEvents()
"""


def open_windows(tmp_path: Path, screen: tuple[int, int], layout_file: Path, *windows: list) -> list[dict]:
    """Run WINDOW_SCRIPT on a screen of `screen` size; one report per window opened in turn."""
    width, height = screen
    config = tmp_path / f"screen-{width}x{height}.json"
    config.write_text(json.dumps({"windowFrameMargins": True, "screens": [
        {"name": "test", "x": 0, "y": 0, "width": width, "height": height, "logicalDpi": 96, "dpr": 1}]}))
    env = os.environ | {"QT_QPA_PLATFORM": f"offscreen:configfile={config}"}
    result = subprocess.run([sys.executable, "-c", WINDOW_SCRIPT, str(layout_file), *map(json.dumps, windows)],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    reports = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert all(r["available"] == [0, 0, width, height] for r in reports), "offscreen ignored the screen config"
    return reports


def rect(values: list[int]) -> QRect:
    return QRect(*values)


@pytest.mark.parametrize("available", [QRect(0, 0, 1366, 768), QRect(0, 0, 1920, 1040), QRect(0, 0, 1600, 1000),
                                       QRect(1920, 27, 2560, 1413)])   # a second monitor with a top panel
def test_initial_geometry_is_at_most_ninety_percent_of_the_screen_and_centred(available):
    geometry = initial_geometry(available)
    assert available.contains(geometry)
    assert geometry.width() <= available.width() * SCREEN_FRACTION
    assert geometry.height() <= available.height() * SCREEN_FRACTION
    assert abs(geometry.center().x() - available.center().x()) <= 1
    assert abs(geometry.center().y() - available.center().y()) <= 1


FRAME = QMargins(2, 30, 2, 2)       # a title bar and thin borders


def test_a_window_saved_on_a_larger_screen_reopens_at_the_initial_geometry():
    available = QRect(0, 0, *LAPTOP)
    assert restored_geometry(QRect(60, 50, 1500, 940), FRAME, available) == initial_geometry(available)


def test_a_window_left_partly_off_screen_is_moved_back_frame_and_all_keeping_its_size():
    restored = restored_geometry(QRect(-300, 600, 1000, 500), FRAME, QRect(0, 0, *LAPTOP))
    assert restored == QRect(2, LAPTOP[1] - 2 - 500, 1000, 500)


def test_a_window_that_fits_reopens_where_it_was():
    assert restored_geometry(QRect(40, 60, 1200, 600), FRAME, QRect(0, 0, *LAPTOP)) == QRect(40, 60, 1200, 600)


def test_a_window_as_wide_as_the_screen_counts_its_frame():
    # Its inner rectangle fits, its frame would not: the user could not reach the borders.
    available = QRect(0, 0, *LAPTOP)
    assert restored_geometry(QRect(0, 30, LAPTOP[0], 600), FRAME, available) == initial_geometry(available)


def test_a_damaged_layout_file_leaves_the_initial_geometry(qtbot, tmp_path):
    layout_file = tmp_path / "window.ini"
    layout_file.write_text("[General]\nnormal_geometry=not a saved layout\nframe_margins=2, x\nstate=junk\n")
    window = MainWindow(MetricsHistory())
    qtbot.addWidget(window)
    before = window.geometry()
    assert not restore_layout(window, layout_file)
    assert window.geometry() == before


def test_the_window_opens_inside_a_laptop_screen_with_room_for_chat_and_plots(tmp_path):
    [report] = open_windows(tmp_path, LAPTOP, tmp_path / "config" / "window.ini", [])
    available, geometry = rect(report["available"]), rect(report["geometry"])
    assert available.contains(rect(report["frame"]))
    assert geometry.width() <= LAPTOP[0] * SCREEN_FRACTION and geometry.height() <= LAPTOP[1] * SCREEN_FRACTION
    assert abs(geometry.center().x() - available.center().x()) <= 1
    hint_width, hint_height = report["minimum_size_hint"]
    assert hint_width <= LAPTOP[0] * SCREEN_FRACTION and hint_height <= LAPTOP[1] * SCREEN_FRACTION
    # Plots under the chat left the transcript four lines there: they sit beside it, and
    # the docks take shares of the window (not the 520 px that squeezed the chat).
    assert report["plots_beside"] and report["transcript_height"] >= 0.5 * geometry.height()
    assert 0.25 <= report["plots_width"] / geometry.width() <= 0.4
    assert report["settings_width"] < geometry.width() * 0.36


def test_a_closed_window_opens_again_where_it_was_left(tmp_path):
    layout_file = tmp_path / "fresh config" / "window.ini"      # the folder does not exist yet
    left, reopened = open_windows(tmp_path, (1920, 1040), layout_file,
                                  [["geometry", 150, 90, 1300, 760], ["hide_plots"]], [])
    assert left["geometry"] == [150, 90, 1300, 760]
    assert reopened["geometry"] == [150, 90, 1300, 760]
    assert not reopened["plots_visible"]


@pytest.mark.parametrize("large_screen, saved", [((1600, 1000), [40, 30, 1500, 940]),
                                                 ((2560, 1400), [60, 50, 2400, 1300])])
def test_a_layout_saved_on_a_larger_monitor_opens_on_a_laptop_within_the_screen(tmp_path, large_screen, saved):
    layout_file = tmp_path / "window.ini"
    [large] = open_windows(tmp_path, large_screen, layout_file, [["geometry", *saved], ["hide_plots"]])
    assert large["geometry"] == saved
    [laptop] = open_windows(tmp_path, LAPTOP, layout_file, [])
    assert rect(laptop["available"]).contains(rect(laptop["frame"]))
    assert rect(laptop["geometry"]) == initial_geometry(QRect(0, 0, *LAPTOP))
    assert not laptop["plots_visible"]                  # the docks the user closed stay closed
