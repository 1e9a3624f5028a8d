"""The main window: layout only. Chat in the centre, settings docked right, plots docked
below (beside the chat in a short window), an error banner, and a status bar with the load
progress.

Menu actions and shortcuts emit intents; the controller acts on them.
"""
from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QAction, QIcon, QKeySequence, QShortcut
from PySide6.QtWidgets import (QDockWidget, QFileDialog, QHBoxLayout, QInputDialog, QLabel, QMainWindow,
                               QProgressBar, QPushButton, QScrollArea, QStyle, QVBoxLayout, QWidget)

from app.chat_view import ChatView
from app.load_history import LoadHistory
from app.load_panel import LoadPanel
from app.metrics_history import MetricsHistory
from app.plots_panel import PlotsPanel
from app.quality_history import QualityHistory
from app.quality_panel import QualityPanel
from app.settings_panel import SettingsPanel
from app.theme import APP_ICON
from app.window_geometry import initial_geometry, restore_layout, save_layout

PROFILE_FILTER = "Workbench profiles (*.json)"
SETTINGS_MIN_WIDTH = 340        # the settings' labels and spin boxes stay readable
SETTINGS_WIDTH_SHARE = 0.22
PLOTS_HEIGHT_SHARE = 0.45
# Below this window height the plots under the chat would leave the transcript a few lines
# (at 768 px, four): the plots and the load test go beside the chat instead, left of the
# settings, and the conversation keeps the window's full height.
PLOTS_BESIDE_BELOW_HEIGHT = 900
PLOTS_WIDTH_SHARE = 0.3


class MainWindow(QMainWindow):
    saveProfileRequested = Signal()
    saveProfileAsRequested = Signal(str)          # a profile name
    loadProfileRequested = Signal(str)            # a name or a file path
    deleteProfileRequested = Signal(str)
    closing = Signal()

    def __init__(self, history: MetricsHistory, parent=None, layout_file: Path | None = None,
                 load_history: LoadHistory | None = None, quality_history: QualityHistory | None = None):
        """`layout_file`: where the window's geometry and docks are kept between runs
        (app.window_geometry); None keeps nothing. `load_history`, `quality_history`: what the
        load and quality panels draw."""
        super().__init__(parent)
        self.setWindowTitle("Inference Workbench")
        self.setWindowIcon(QIcon(str(APP_ICON)))
        self._layout_file = layout_file
        self.setGeometry(initial_geometry(self.screen().availableGeometry()))
        self.chat = ChatView()
        self.settings = SettingsPanel()
        self.plots = PlotsPanel(history)
        self.load_panel = LoadPanel(load_history if load_history is not None else LoadHistory())
        self.quality_panel = QualityPanel(quality_history if quality_history is not None else QualityHistory())
        self._build_central()
        self._build_docks()
        self._build_status_bar()
        self._build_menus()
        if layout_file is not None:
            restore_layout(self, layout_file)
        QShortcut(QKeySequence(Qt.Key.Key_Escape), self, self.chat.stopRequested.emit)
        # Ctrl+Enter sends from anywhere in the window, not only from the message box.
        for keys in ("Ctrl+Return", "Ctrl+Enter"):
            QShortcut(QKeySequence(keys), self, self.chat.request_send)
        self.chat.input.setFocus()

    # ---- layout ----------------------------------------------------------------
    def _build_central(self) -> None:
        self.error_banner = QLabel()
        self.error_banner.setObjectName("errorBanner")
        self.error_banner.setWordWrap(True)
        self.error_banner.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        dismiss = QPushButton("Dismiss")
        dismiss.clicked.connect(self.clear_error)
        self._error_row = QWidget()
        row = QHBoxLayout(self._error_row)
        row.setContentsMargins(8, 8, 8, 0)
        row.addWidget(self.error_banner, 1)
        row.addWidget(dismiss)
        self._error_row.hide()
        central = QWidget()
        layout = QVBoxLayout(central)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self._error_row)
        layout.addWidget(self.chat, 1)
        self.setCentralWidget(central)

    def _build_docks(self) -> None:
        # The settings take the full height on the right; the plots sit under the chat.
        self.setCorner(Qt.Corner.BottomRightCorner, Qt.DockWidgetArea.RightDockWidgetArea)
        self.setCorner(Qt.Corner.TopRightCorner, Qt.DockWidgetArea.RightDockWidgetArea)
        scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setWidget(self.settings)
        # Never narrower than its widest row (it does not scroll sideways), with room for its scroll bar.
        bar = scroll.style().pixelMetric(QStyle.PixelMetric.PM_ScrollBarExtent)
        scroll.setMinimumWidth(max(SETTINGS_MIN_WIDTH, self.settings.minimumSizeHint().width() + bar + 2))
        scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)   # it scrolls down only
        self.settings_dock = self._dock("Settings", scroll, Qt.DockWidgetArea.RightDockWidgetArea)
        self.plots_dock = self._dock("Live metrics", self.plots, Qt.DockWidgetArea.BottomDockWidgetArea)
        self.load_dock = self._dock("Load test", self.load_panel, Qt.DockWidgetArea.BottomDockWidgetArea)
        self.quality_dock = self._dock("Quality", self.quality_panel, Qt.DockWidgetArea.BottomDockWidgetArea)
        self.plots_beside: bool | None = None         # not placed yet
        for dock in (self.plots_dock, self.load_dock, self.quality_dock):
            # Wherever the dock goes (placed, restored, or dragged by the user), its plots fit it.
            dock.dockLocationChanged.connect(self._fit_panels_to_docks)
        self.size_docks()

    def size_docks(self) -> None:
        """Place the plots for the window's height (under the chat, or beside it in a short
        window: PLOTS_BESIDE_BELOW_HEIGHT) and size the docks as shares of the window, not
        pixels. Called when the window opens; a layout the user left is restored after it."""
        size = self.size()
        self._place_plots(beside=size.height() < PLOTS_BESIDE_BELOW_HEIGHT)
        settings_width = max(self.settings_dock.widget().minimumWidth(), int(size.width() * SETTINGS_WIDTH_SHARE))
        if self.plots_beside:
            plots_width = int(size.width() * PLOTS_WIDTH_SHARE)
            self.resizeDocks([self.plots_dock, self.load_dock, self.quality_dock, self.settings_dock],
                             [plots_width, plots_width, plots_width, settings_width], Qt.Orientation.Horizontal)
            return
        self.resizeDocks([self.plots_dock, self.load_dock, self.quality_dock],
                         [int(size.height() * PLOTS_HEIGHT_SHARE)] * 3, Qt.Orientation.Vertical)
        self.resizeDocks([self.settings_dock], [settings_width], Qt.Orientation.Horizontal)

    def _place_plots(self, beside: bool) -> None:
        """The live metrics, the load test and the quality, as three tabs of one dock: under the
        chat, or in the right area beside the chat, left of the settings (all stay in view)."""
        if beside == self.plots_beside:
            return
        if beside:
            self.addDockWidget(Qt.DockWidgetArea.RightDockWidgetArea, self.plots_dock)
            self.splitDockWidget(self.plots_dock, self.settings_dock, Qt.Orientation.Horizontal)
        else:
            self.addDockWidget(Qt.DockWidgetArea.BottomDockWidgetArea, self.plots_dock)
        self.tabifyDockWidget(self.plots_dock, self.load_dock)
        self.tabifyDockWidget(self.load_dock, self.quality_dock)
        self.plots_dock.raise_()
        self.plots_beside = beside
        self._fit_panels_to_docks()

    def _fit_panels_to_docks(self, *_area) -> None:
        """A panel docked at a side is narrow (one plot a row); under the chat or floating, wide."""
        sides = (Qt.DockWidgetArea.LeftDockWidgetArea, Qt.DockWidgetArea.RightDockWidgetArea)
        for panel, dock in ((self.plots, self.plots_dock), (self.load_panel, self.load_dock),
                            (self.quality_panel, self.quality_dock)):
            panel.set_narrow(not dock.isFloating() and self.dockWidgetArea(dock) in sides)

    def _dock(self, title: str, widget: QWidget, area) -> QDockWidget:
        dock = QDockWidget(title, self)
        dock.setObjectName(title)
        dock.setWidget(widget)
        dock.setFeatures(QDockWidget.DockWidgetFeature.DockWidgetMovable
                         | QDockWidget.DockWidgetFeature.DockWidgetFloatable)
        self.addDockWidget(area, dock)
        return dock

    def _build_status_bar(self) -> None:
        self.progress = QProgressBar()
        self.progress.setRange(0, 100)
        self.progress.hide()
        self.busy_label = QLabel()
        self.statusBar().addPermanentWidget(self.busy_label)
        self.statusBar().addPermanentWidget(self.progress)

    def _build_menus(self) -> None:
        model_menu = self.menuBar().addMenu("&Model")
        panel = self.settings
        model_menu.addAction("Default model", panel.default_model_button.click)
        model_menu.addAction("Open model folder…", panel.model_folder_button.click)
        model_menu.addAction("Open GGUF file…", panel.model_gguf_button.click)
        model_menu.addAction("Connect to server…", panel.connect_server_button.click)
        self.profile_menu = self.menuBar().addMenu("&Profile")
        self.save_action = QAction("Save profile", self, shortcut=QKeySequence.StandardKey.Save)
        self.save_action.triggered.connect(self.saveProfileRequested)
        self.save_as_action = QAction("Save profile as…", self, shortcut=QKeySequence("Ctrl+Shift+S"))
        self.save_as_action.triggered.connect(self._ask_save_as)
        self.load_action = QAction("Load profile file…", self, shortcut=QKeySequence.StandardKey.Open)
        self.load_action.triggered.connect(self._ask_load_file)
        self.delete_action = QAction("Delete a saved profile…", self)
        self.delete_action.triggered.connect(self._ask_delete)
        self.saved_menu = self.profile_menu.addMenu("Saved")
        self.recent_menu = self.profile_menu.addMenu("Recent")
        self.builtin_menu = self.profile_menu.addMenu("Built-in")
        for action in (self.save_action, self.save_as_action, self.load_action, self.delete_action):
            self.profile_menu.addAction(action)
        plots_menu = self.menuBar().addMenu("P&lots")
        plots_menu.addAction("Export plots as PNG…", self.plots.ask_png_path)
        plots_menu.addAction("Export metrics as CSV…", self.plots.ask_csv_path)
        view_menu = self.menuBar().addMenu("&View")
        view_menu.addAction(self.settings_dock.toggleViewAction())
        view_menu.addAction(self.plots_dock.toggleViewAction())
        view_menu.addAction(self.load_dock.toggleViewAction())
        view_menu.addAction(self.quality_dock.toggleViewAction())

    # ---- what the controller shows ----------------------------------------------
    def show_error(self, text: str) -> None:
        self.error_banner.setText(text)
        self._error_row.show()
        self.statusBar().showMessage(text.splitlines()[0], 10000)

    def clear_error(self) -> None:
        self._error_row.hide()
        self.error_banner.clear()

    def error_text(self) -> str:
        return self.error_banner.text() if self._error_row.isVisibleTo(self) else ""

    def show_progress(self, message: str, fraction: float) -> None:
        self.progress.setValue(int(round(fraction * 100)))
        self.progress.setFormat(f"{message} — %p%")
        self.progress.show()

    def hide_progress(self) -> None:
        self.progress.hide()

    def show_busy(self, text: str) -> None:
        self.busy_label.setText(text)

    def show_message(self, text: str) -> None:
        self.statusBar().showMessage(text, 8000)

    def set_profile_menus(self, saved: list[str], recent: list[Path], builtins: list[str]) -> None:
        _fill(self.saved_menu, [(name, name) for name in saved], self.loadProfileRequested.emit)
        _fill(self.recent_menu, [(p.stem, str(p)) for p in recent], self.loadProfileRequested.emit)
        _fill(self.builtin_menu, [(name, name) for name in builtins], self.loadProfileRequested.emit)
        offered = saved + [name for name in builtins if name not in saved]
        self.load_panel.set_profiles(offered)          # A/B's choices
        self.quality_panel.set_profiles(offered)       # the configurations to measure

    # ---- dialogs (they only ask; the answer goes out as an intent) ----------------------
    def ask_profile_name(self, suggestion: str = "") -> str | None:
        name, ok = QInputDialog.getText(self, "Save profile as", "Profile name:", text=suggestion)
        return name.strip() if ok and name.strip() else None

    def _ask_save_as(self) -> None:
        name = self.ask_profile_name()
        if name:
            self.saveProfileAsRequested.emit(name)

    def _ask_load_file(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Load profile", "", PROFILE_FILTER)
        if path:
            self.loadProfileRequested.emit(path)

    def _ask_delete(self) -> None:
        names = [a.text() for a in self.saved_menu.actions()]
        if not names:
            self.show_message("there are no saved profiles to delete")
            return
        name, ok = QInputDialog.getItem(self, "Delete profile", "Profile:", names, editable=False)
        if ok and name:
            self.deleteProfileRequested.emit(name)

    def closeEvent(self, event) -> None:
        if self._layout_file is not None:
            save_layout(self, self._layout_file)
        self.closing.emit()
        super().closeEvent(event)


def _fill(menu, items: list[tuple[str, str]], emit) -> None:
    menu.clear()
    for label, value in items:
        menu.addAction(label, lambda value=value: emit(value))
    menu.setEnabled(bool(items))
