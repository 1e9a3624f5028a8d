"""The main window gives the conversation the room a chat needs: on a 1366x768 laptop the
plots move beside the chat (the transcript keeps the window's height), on a desktop-sized
window they sit under it. Offscreen Qt, no model."""
import pytest
from PySide6.QtCore import Qt

from app.main_window import MainWindow
from app.metrics_history import MetricsHistory
from app.theme import style_sheet

LAPTOP, DESKTOP = (1366, 768), (1600, 1000)


@pytest.fixture
def window(qtbot, qapp):
    qapp.setStyleSheet(style_sheet())
    window = MainWindow(MetricsHistory())
    qtbot.addWidget(window)
    return window


def shown_at(window, qtbot, size) -> None:
    window.resize(*size)
    window.size_docks()            # what opening the window does for its size
    window.show()
    qtbot.waitExposed(window)
    for number in range(40):
        window.chat.add_user_message(f"message {number}: a line of the conversation")


def test_on_a_1366x768_window_the_transcript_gets_half_the_height_and_fifteen_lines(window, qtbot):
    shown_at(window, qtbot, LAPTOP)
    transcript = window.chat.transcript.viewport()
    assert transcript.height() >= 0.5 * window.height()
    assert transcript.height() / window.chat.transcript.fontMetrics().lineSpacing() >= 15
    # Nothing hidden for it: the plots and the settings stay in view beside the chat.
    assert window.plots_beside and window.plots_dock.isVisible() and window.settings_dock.isVisible()
    chat, plots, settings = (w.geometry() for w in (window.centralWidget(), window.plots_dock, window.settings_dock))
    assert chat.right() < plots.left() < plots.right() < settings.left()
    assert chat.width() >= 0.35 * window.width()                # a readable line, not a column of words
    # Every live plot keeps the panel's width: one plot a row.
    assert all(plot.vb.sceneBoundingRect().width() >= 0.6 * plots.width() for plot in window.plots.graphics.ci.items)


def test_on_a_desktop_window_the_plots_sit_under_the_chat(window, qtbot):
    shown_at(window, qtbot, DESKTOP)
    assert not window.plots_beside
    assert window.dockWidgetArea(window.plots_dock) == Qt.DockWidgetArea.BottomDockWidgetArea
    assert window.dockWidgetArea(window.load_dock) == Qt.DockWidgetArea.BottomDockWidgetArea
    assert window.dockWidgetArea(window.quality_dock) == Qt.DockWidgetArea.BottomDockWidgetArea
    assert window.plots_dock.geometry().top() > window.chat.transcript.mapTo(window, window.chat.transcript.rect().bottomLeft()).y()
    assert window.chat.transcript.viewport().height() / window.chat.transcript.fontMetrics().lineSpacing() >= 12


def test_a_window_made_short_moves_the_plots_beside_the_chat_and_back(window, qtbot):
    shown_at(window, qtbot, DESKTOP)
    shown_at(window, qtbot, LAPTOP)
    assert window.dockWidgetArea(window.plots_dock) == Qt.DockWidgetArea.RightDockWidgetArea
    tabs = [window.load_dock, window.quality_dock]
    assert window.tabifiedDockWidgets(window.plots_dock) == tabs        # still one dock, three tabs
    assert window.plots.narrow and window.load_panel.narrow and window.quality_panel.narrow
    shown_at(window, qtbot, DESKTOP)
    assert window.dockWidgetArea(window.plots_dock) == Qt.DockWidgetArea.BottomDockWidgetArea
    assert window.tabifiedDockWidgets(window.plots_dock) == tabs
    assert not window.plots.narrow and not window.load_panel.narrow and not window.quality_panel.narrow


def test_export_png_beside_the_chat_still_draws_the_plots_wide(window, qtbot, tmp_path):
    from PySide6.QtGui import QImage
    shown_at(window, qtbot, LAPTOP)
    assert window.plots.save_png(str(tmp_path / "plots.png"))
    image = QImage(str(tmp_path / "plots.png"))
    assert image.width() > 2 * window.plots_dock.width() and image.width() > image.height()
    assert window.plots.narrow and window.plots.scroll.widget() is window.plots.graphics     # the panel as it was


def test_plots_moved_under_the_chat_by_the_user_lay_out_wide_again(window, qtbot):
    shown_at(window, qtbot, LAPTOP)
    window.addDockWidget(Qt.DockWidgetArea.BottomDockWidgetArea, window.plots_dock)     # as a drag there does
    assert not window.plots.narrow and window.load_panel.narrow      # the load test stayed at the side
    window.addDockWidget(Qt.DockWidgetArea.LeftDockWidgetArea, window.plots_dock)
    assert window.plots.narrow
