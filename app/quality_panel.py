"""The quality panel: which configurations to measure against the reference, Measure / Stop
with progress, a results table and a plot of quality against speed (layout only;
app.quality_controller acts).

The plot: x is the mean KL divergence from the reference's next-token distribution (nats,
lower is closer), y the decode speed. Every row is a point labelled with its configuration;
the Pareto front (no other point is both closer and faster) is joined by a line; a lossless
configuration sits at x = 0, on a dashed line of its own. Two measurements of the current
settings are joined by a dashed arrow labelled with what the user changed between them.
"""
from __future__ import annotations

from datetime import datetime
from html import escape

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (QAbstractItemView, QBoxLayout, QCheckBox, QFileDialog, QFrame, QHBoxLayout, QHeaderView,
                               QLabel, QListWidget, QListWidgetItem, QProgressBar, QPushButton, QScrollArea, QSplitter,
                               QTableWidget, QTableWidgetItem, QVBoxLayout, QWidget)

from app.plot_title import PlotTitle
from app.quality_history import FROM_PROFILE, QualityHistory
from app.results_table import results_box
from app.theme import MUTED_COLOUR, PLOT_COLOURS

CURRENT = "(current settings)"
CONTROLS_WIDTH = 290
LIST_HEIGHT = 118               # about five configurations in view; the list scrolls
NARROW_LIST_HEIGHT = 84         # beside the chat: four in view, the plot and the table get the height
PLOT_MIN_HEIGHT = 230
NARROW_SIZES = (290, 280)       # beside the chat: the plot's and the table's heights to start with
WIDE_SIZES = (440, 660)         # under the chat: the plot's and the table's widths to start with
TITLE_STYLE = {"size": "10pt"}
AXIS_TEXT = "#24292f"
COLOURS = {"current": "#2f81f7", "profile": "#8250df", "from_profile": "#8c959f", "lossless": "#1a7f37",
           "front": "#cf222e", "change": PLOT_COLOURS["marker"]}
# Two-line headers, the cost and the speed first: beside the chat (a short window) they stay in view.
COLUMNS = ("configuration", "mean KLD (nats)\n[95% CI]", "perplexity\nchange % [95% CI]", "decode\ntok/s",
           "lossless\ncheck", "same\ntop %", "KLD\np99", "when")
CONFIGURATION_COLUMN, LOSSLESS_COLUMN = 0, 4
# Points closer than these shares of the data's ranges would overlap their labels (a label runs
# right of its point, about a third of the plot wide, a line high): they share one label.
CROWDED_X, CROWDED_Y = 0.3, 0.2
HINT = "Measure compares each configuration's next tokens with the reference's on a shipped text; the chat waits."
TABLE_HINT = "Hover a row for its summary: the text, the reference and how the interval was made."


class QualityPanel(QWidget):
    measureRequested = Signal(list, bool)    # configuration names (CURRENT: the settings in effect), include the chat
    stopRequested = Signal()
    exportPngRequested = Signal(str)
    exportCsvRequested = Signal(str)
    clearRequested = Signal()

    def __init__(self, history: QualityHistory, parent=None):
        super().__init__(parent)
        self.history = history
        self._drawn_version = -1
        self._plot_items: list = []
        self.controls = self._controls_area()
        self.splitter = QSplitter(Qt.Orientation.Horizontal)
        self.splitter.addWidget(self._plot_area())
        self.splitter.addWidget(self._results_area())
        self.splitter.setChildrenCollapsible(False)
        self.splitter.setStretchFactor(0, 1)
        self.splitter.setStretchFactor(1, 1)
        self.splitter.setSizes(list(WIDE_SIZES))
        self._body = QBoxLayout(QBoxLayout.Direction.LeftToRight, self)
        self._body.setContentsMargins(4, 4, 4, 4)
        self._body.addWidget(self.controls)
        self._body.addWidget(self.splitter, 1)
        self.narrow = False
        self.set_running(False)

    # ---- controls --------------------------------------------------------------------
    def _controls_area(self) -> QWidget:
        self.configurations = QListWidget()
        self.configurations.setMaximumHeight(LIST_HEIGHT)
        self.configurations.setToolTip("Tick the configurations to measure: the current settings, and any saved "
                                       "or built-in profile (its engine settings on the loaded model).")
        self.set_profiles([])
        self.include_chat = QCheckBox("Include the chat so far")
        self.include_chat.setToolTip("Measure on the conversation as well as on the shipped reference text.")
        self.measure_button, self.stop_button = QPushButton("Measure"), QPushButton("Stop")
        self.measure_button.clicked.connect(lambda: self.measureRequested.emit(self.checked_names(),
                                                                              self.include_chat.isChecked()))
        self.stop_button.clicked.connect(self.stopRequested)
        self.progress = QProgressBar()
        self.progress.setRange(0, 1000)
        self.progress.setFormat("%p%")
        self.progress.setStyleSheet("QProgressBar { min-width: 120px; }")   # the style's 320 px would widen the column
        self.progress_message = QLabel()
        self.progress_message.setObjectName("plotHint")
        self.progress_message.setWordWrap(True)
        self.progress_message.hide()
        self.status = QLabel(HINT)
        self.status.setWordWrap(True)
        self.status.setObjectName("plotHint")
        actions = QWidget()
        action_column = QVBoxLayout(actions)
        action_column.setContentsMargins(0, 0, 0, 0)
        action_column.addWidget(self.include_chat)
        action_column.addWidget(_row(self.measure_button, self.stop_button))
        action_column.addStretch(1)
        # Under the chat: the list above the buttons, in a column; beside it: side by side.
        self._choose = QBoxLayout(QBoxLayout.Direction.TopToBottom)
        self._choose.setContentsMargins(0, 0, 0, 0)
        self._choose.addWidget(self.configurations, 1)
        self._choose.addWidget(actions)
        box = QWidget()
        column = QVBoxLayout(box)
        column.setContentsMargins(0, 0, 0, 0)
        column.addWidget(QLabel("Configurations to measure"))
        column.addLayout(self._choose)
        column.addWidget(self.progress)
        column.addWidget(self.progress_message)
        column.addWidget(self.status)
        column.addStretch(1)
        # In a scroll area, as the load panel's workload: a short dock squeezes it, never the chat.
        scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setWidget(box)
        scroll.setFrameShape(QFrame.Shape.NoFrame)
        scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        scroll.setFixedWidth(CONTROLS_WIDTH)
        return scroll

    def set_profiles(self, names: list[str]) -> None:
        """The configurations offered: the current settings, then these profiles (ticks kept)."""
        ticked = set(self.checked_names()) if self.configurations.count() else {CURRENT}
        self.configurations.clear()
        for name in [CURRENT] + list(names):
            item = QListWidgetItem(name)
            item.setFlags(item.flags() | Qt.ItemFlag.ItemIsUserCheckable)
            item.setCheckState(Qt.CheckState.Checked if name in ticked else Qt.CheckState.Unchecked)
            self.configurations.addItem(item)

    def checked_names(self) -> list[str]:
        items = (self.configurations.item(i) for i in range(self.configurations.count()))
        return [item.text() for item in items if item.checkState() == Qt.CheckState.Checked]

    def set_checked(self, names: list[str]) -> None:
        for i in range(self.configurations.count()):
            item = self.configurations.item(i)
            item.setCheckState(Qt.CheckState.Checked if item.text() in names else Qt.CheckState.Unchecked)

    def set_running(self, running: bool) -> None:
        self.measure_button.setEnabled(not running)
        self.stop_button.setEnabled(running)
        if not running:
            self.progress_message.setText("")
            self.progress_message.hide()

    def show_progress(self, message: str, fraction: float) -> None:
        self.progress.setValue(int(round(fraction * 1000)))
        self.progress_message.setText(message)
        self.progress_message.setVisible(bool(message))

    def show_status(self, text: str) -> None:
        self.status.setText(text)

    def set_narrow(self, narrow: bool) -> None:
        """Beside the chat (a short window): the controls above, the plot above the table;
        under the chat: the controls on the left, the plot beside the table."""
        if narrow == self.narrow:
            return
        self._body.setDirection(QBoxLayout.Direction.TopToBottom if narrow else QBoxLayout.Direction.LeftToRight)
        self._choose.setDirection(QBoxLayout.Direction.LeftToRight if narrow else QBoxLayout.Direction.TopToBottom)
        self.configurations.setMaximumHeight(NARROW_LIST_HEIGHT if narrow else LIST_HEIGHT)
        self.splitter.setOrientation(Qt.Orientation.Vertical if narrow else Qt.Orientation.Horizontal)
        if narrow:
            self.controls.setMinimumWidth(0)
            self.controls.setMaximumWidth(16777215)
            self.controls.setFixedHeight(self.controls.widget().sizeHint().height())
            self.splitter.setSizes(list(NARROW_SIZES))
        else:
            self.controls.setMinimumHeight(0)
            self.controls.setMaximumHeight(16777215)
            self.controls.setFixedWidth(CONTROLS_WIDTH)
            self.splitter.setSizes(list(WIDE_SIZES))
        self.narrow = narrow

    # ---- the plot --------------------------------------------------------------------
    def _plot_area(self) -> QWidget:
        pg.setConfigOptions(antialias=True)
        self.graphics = pg.GraphicsLayoutWidget()
        self.graphics.setBackground("w")
        self.graphics.setMinimumHeight(PLOT_MIN_HEIGHT)       # its own height: the area around it scrolls
        plot = self.plot = self.graphics.addPlot(row=0, col=0)
        PlotTitle(plot, _legend_title(), **TITLE_STYLE)
        plot.setLabel("left", "decode tok/s")
        plot.setLabel("bottom", "mean KL divergence from the reference (nats)")
        plot.showGrid(x=True, y=True, alpha=0.25)
        plot.setMouseEnabled(x=True, y=False)
        for axis in ("left", "bottom"):
            plot.getAxis(axis).setTextPen(AXIS_TEXT)
            plot.getAxis(axis).enableAutoSIPrefix(False)
        self.lossless_line = pg.InfiniteLine(pos=0, angle=90, movable=False,
                                             pen=pg.mkPen(COLOURS["lossless"], width=1, style=Qt.PenStyle.DashLine),
                                             label="lossless", labelOpts={"position": 0.95, "color": COLOURS["lossless"],
                                                                          "anchors": [(0, 0), (0, 0)]})
        plot.addItem(self.lossless_line)
        # The front joined by a line, each of its points ringed (a front of one point shows too).
        self.front_curve = plot.plot(pen=pg.mkPen(COLOURS["front"], width=2), symbol="o", symbolSize=20,
                                     symbolBrush=None, symbolPen=pg.mkPen(COLOURS["front"], width=1.5))
        self.error_bars = pg.ErrorBarItem(x=np.zeros(0), y=np.zeros(0), pen=pg.mkPen(MUTED_COLOUR, width=1), beam=0)
        plot.addItem(self.error_bars)
        self.points = pg.ScatterPlotItem(size=11, pxMode=True)
        plot.addItem(self.points)
        scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setWidget(self.graphics)
        scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        scroll.setMinimumHeight(100)
        return scroll

    def refresh(self) -> None:
        h = self.history
        if h.version == self._drawn_version:
            return
        self._drawn_version = h.version
        self._refresh_plot()
        self._refresh_table()

    def _refresh_plot(self) -> None:
        for item in self._plot_items:
            self.plot.removeItem(item)
        self._plot_items.clear()
        rows = [r for r in self.history.rows if r.get("kld_mean") is not None and r.get("decode_tok_s") is not None]
        spots, lows, highs = [], [], []
        for row in rows:
            spots.append({"pos": (row["kld_mean"], row["decode_tok_s"]), "data": row["number"], **_symbol(row)})
            low, high = row.get("kld_mean_ci95") or (row["kld_mean"], row["kld_mean"])
            lows.append(row["kld_mean"] - low)
            highs.append(high - row["kld_mean"])
        self.points.setData(spots)
        self.error_bars.setData(x=np.array([r["kld_mean"] for r in rows], dtype=float),
                                y=np.array([r["decode_tok_s"] for r in rows], dtype=float),
                                left=np.array(lows, dtype=float), right=np.array(highs, dtype=float))
        front = [self.history.rows[i] for i in self.history.front()]
        self.front_curve.setData([r["kld_mean"] for r in front], [r["decode_tok_s"] for r in front])
        self._draw_changes(rows)
        if rows:
            top_x = max(max(r["kld_mean"] + h for r, h in zip(rows, highs)), 1e-6)
            top_y = max(max(r["decode_tok_s"] for r in rows), 1e-6)
            self.plot.setXRange(-0.08 * top_x, top_x * 1.6, padding=0)       # room for the labels right of the points
            groups = crowds(rows, top_x, top_y)
            lines = max(len(g) for g in groups)
            self.plot.setYRange(0, top_y * (1.25 + 0.15 * lines), padding=0)    # room for the labels above the points
            for group in groups:
                top = max(group, key=lambda r: r["decode_tok_s"])
                self._add("\n".join(_point_label(r) for r in group), top["kld_mean"], top["decode_tok_s"])

    def _draw_changes(self, rows: list[dict]) -> None:
        """A dashed arrow from a measurement of the current settings to the next, naming what changed."""
        earlier = None
        for row in (r for r in rows if r["current"] and r["origin"] != FROM_PROFILE):
            if earlier is not None and row["change"]:
                line = pg.PlotDataItem([earlier["kld_mean"], row["kld_mean"]],
                                       [earlier["decode_tok_s"], row["decode_tok_s"]],
                                       pen=pg.mkPen(COLOURS["change"], width=1.5, style=Qt.PenStyle.DashLine))
                self.plot.addItem(line)
                self._plot_items.append(line)
            earlier = row

    def _add(self, text: str, x: float, y: float) -> None:
        """A label above the point, running right of it (the x range leaves it room)."""
        label = pg.TextItem(text, color=AXIS_TEXT, anchor=(0, 1.1))
        label.setPos(x, y)
        self.plot.addItem(label)
        self._plot_items.append(label)

    def save_png(self, path: str) -> bool:
        self.refresh()
        return self.graphics.grab().save(path, "PNG")

    # ---- the results table -----------------------------------------------------------------
    def _results_area(self) -> QWidget:
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.verticalHeader().hide()
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        header.setSectionResizeMode(CONFIGURATION_COLUMN, QHeaderView.ResizeMode.Interactive)
        self.table.setColumnWidth(CONFIGURATION_COLUMN, 190)
        self.table.setWordWrap(False)
        png, csv_button, clear = QPushButton("Export PNG…"), QPushButton("Export CSV…"), QPushButton("Clear results")
        png.clicked.connect(self.ask_png_path)
        csv_button.clicked.connect(self.ask_csv_path)
        clear.clicked.connect(self.clearRequested)
        self.table.setToolTip(TABLE_HINT)
        return results_box(self.table, [clear, png, csv_button])

    def _refresh_table(self) -> None:
        rows = self.history.rows
        self.table.setRowCount(len(rows))
        for i, row in enumerate(rows):
            for j, text in enumerate(table_cells(row)):
                item = QTableWidgetItem(text)
                item.setToolTip(row.get("summary") or text)
                if j == LOSSLESS_COLUMN and (row.get("lossless") or {}).get("said"):
                    item.setToolTip(row["lossless"]["said"])
                self.table.setItem(i, j, item)
        self.table.scrollToBottom()

    def ask_png_path(self) -> None:
        path, _ = QFileDialog.getSaveFileName(self, "Export the quality plot", "workbench-quality.png",
                                              "PNG image (*.png)")
        if path:
            self.exportPngRequested.emit(path)

    def ask_csv_path(self) -> None:
        path, _ = QFileDialog.getSaveFileName(self, "Export the quality results", "workbench-quality.csv",
                                              "CSV (*.csv)")
        if path:
            self.exportCsvRequested.emit(path)


def table_cells(row: dict) -> list[str]:
    """A result row as the table shows it (COLUMNS)."""
    return [f"#{row['number']} {configuration_name(row)}",
            _with_interval(row.get("kld_mean"), row.get("kld_mean_ci95"), _kld),
            _with_interval(row.get("ppl_change_pct"), row.get("ppl_change_pct_ci95"), _signed_pct),
            _rate(row.get("decode_tok_s")), lossless_cell(row.get("lossless") or {}),
            _with_interval(row.get("same_top_pct"), None, _pct), _kld(row.get("kld_p99")), when(row)]


def crowds(rows: list[dict], x_range: float, y_range: float) -> list[list[dict]]:
    """The rows in groups of points whose labels would overlap on the plot (CROWDED_X, CROWDED_Y),
    each group labelled once, its labels one per line."""
    groups: list[list[dict]] = []
    for row in rows:
        near = next((g for g in groups if any(abs(r["kld_mean"] - row["kld_mean"]) < CROWDED_X * x_range
                                              and abs(r["decode_tok_s"] - row["decode_tok_s"]) < CROWDED_Y * y_range
                                              for r in g)), None)
        if near is None:
            groups.append([row])
        else:
            near.append(row)
    return groups


def configuration_name(row: dict) -> str:
    name = str(row.get("label", "?"))
    if row["origin"] != "measured":
        return f"{name} ({row['origin']})"
    if row["change"]:
        return f"{name}: {row['change']}"
    return name


def _point_label(row: dict) -> str:
    return f"#{row['number']} {configuration_name(row)}"


def lossless_cell(lossless: dict) -> str:
    """The check's verdict; what it checked is the cell's tooltip (the engine's sentence)."""
    if lossless.get("identical") is None:
        return "—"
    return "identical" if lossless["identical"] else "DIFFERS"


def when(row: dict) -> str:
    """The measurement's local time; the date too when it was not today."""
    try:
        at = datetime.fromisoformat(str(row.get("measured_at"))).astimezone()
    except ValueError:
        return str(row.get("measured_at") or "—")
    return at.strftime("%H:%M:%S" if at.date() == datetime.now().astimezone().date() else "%Y-%m-%d %H:%M")


def _symbol(row: dict) -> dict:
    if row["origin"] != "measured":
        return {"symbol": "o", "brush": pg.mkBrush("#ffffff"), "pen": pg.mkPen(COLOURS["from_profile"], width=2)}
    if row.get("kld_mean") == 0:
        return {"symbol": "d", "size": 14, "brush": pg.mkBrush(COLOURS["lossless"]), "pen": pg.mkPen("#ffffff")}
    colour = COLOURS["current"] if row["current"] else COLOURS["profile"]
    return {"symbol": "o", "brush": pg.mkBrush(colour), "pen": pg.mkPen("#ffffff")}


def _legend_title() -> str:
    keys = (("current", "●", "current settings"), ("profile", "●", "a profile"), ("lossless", "◆", "lossless"),
            ("from_profile", "○", "from a profile file"), ("front", "━", "Pareto front"),
            ("change", "┅", "a setting changed"))
    legend = "&nbsp;&nbsp;".join(f"<span style='color:{COLOURS[k]}'>{mark}</span>&nbsp;{escape(name)}"
                                 for k, mark, name in keys)
    return (f"{escape('Quality against speed (right is further from the reference, up is faster)')}<br>"
            f"<span style='color:{AXIS_TEXT}; font-size:8pt'>{legend}</span>")


def _with_interval(value, interval, fmt) -> str:
    if value is None:
        return "—"
    if not interval:
        return fmt(value)
    return f"{fmt(value)} [{fmt(interval[0])}, {fmt(interval[1])}]"


def _kld(x) -> str:
    if x is None:
        return "—"
    return "0" if x == 0 else f"{x:.2g}" if abs(x) < 0.01 else f"{x:.3f}"


def _pct(x) -> str:
    return f"{x:.1f}"


def _signed_pct(x) -> str:
    return f"{x:+.2f}" if abs(x) < 10 else f"{x:+.1f}"


def _rate(x) -> str:
    return "—" if x is None else f"{x:.1f}" if x < 100 else f"{x:.0f}"


def _row(*widgets) -> QWidget:
    row = QWidget()
    layout = QHBoxLayout(row)
    layout.setContentsMargins(0, 0, 0, 0)
    for w in widgets:
        layout.addWidget(w)
    return row
