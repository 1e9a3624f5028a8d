"""The load panel: a serving workload against the engine, live plots while it runs, and a
results table of finished runs with 95% intervals (layout only; app.load_controller acts).

The workload's controls come from engine.workload.WORKLOAD_SETTINGS (names, ranges), as the
settings panel's come from engine.config.SETTINGS. Every plot keeps a minimum height inside a
scroll area and has its legend in its title row, so at 1366x768 none is squeezed or covered.
"""
from __future__ import annotations

from html import escape

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import (QAbstractItemView, QBoxLayout, QComboBox, QFileDialog, QFormLayout, QGroupBox, QHBoxLayout,
                               QHeaderView, QLabel, QProgressBar, QPushButton, QScrollArea, QSplitter,
                               QTableWidget, QTableWidgetItem, QVBoxLayout, QWidget)

from app.load_history import FIGURE_LABELS, WINDOW_S, LoadHistory
from app.plot_grid import place_plots
from app.plot_title import PlotTitle
from app.results_table import results_box
from app.setting_controls import SettingControl
from app.theme import LOAD_COLOURS as C, MUTED_COLOUR, PLOT_COLOURS
from engine.metrics import RUN_FIGURES
from engine.workload import WORKLOAD_SETTINGS, Workload

PLOT_ROW_MIN_HEIGHT = 210       # px per row of plots: axis titles, ticks and a title row all fit
CONTROLS_WIDTH = 345
REFRESH_MS = 200
CURRENT = "(current settings)"
TITLE_STYLE = {"size": "10pt"}
LEGEND_TEXT_COLOUR = "#24292f"


class LoadPanel(QWidget):
    startRequested = Signal(object)          # a Workload
    stopRequested = Signal()
    abRequested = Signal(str, str)           # profile names (CURRENT: the settings in effect)
    exportCsvRequested = Signal(str)
    clearResultsRequested = Signal()
    selectionChanged = Signal(list)          # the selected rows' numbers
    workloadEdited = Signal()

    def __init__(self, history: LoadHistory, parent=None):
        super().__init__(parent)
        self.history = history
        self._drawn_version = -1
        self._drawn_markers = 0
        self._marker_lines: list = []
        self.controls = {s.key: SettingControl(s, self) for s in WORKLOAD_SETTINGS}
        for control in self.controls.values():
            control.changed.connect(lambda *_: self.workloadEdited.emit())
        splitter = QSplitter(Qt.Orientation.Vertical)
        splitter.addWidget(self._plots_area())
        splitter.addWidget(self._results_area())
        splitter.setChildrenCollapsible(False)
        splitter.setStretchFactor(0, 3)
        splitter.setStretchFactor(1, 2)
        self.splitter = splitter
        layout = self._body = QHBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(self._controls_area())
        layout.addWidget(splitter, 1)
        self.narrow = False
        self.timer = QTimer(self, interval=REFRESH_MS)
        self.timer.timeout.connect(self.refresh)
        self.timer.start()
        self.set_running(False)

    # ---- controls --------------------------------------------------------------------
    def _controls_area(self) -> QWidget:
        box = QGroupBox("Workload")
        form = QFormLayout(box)
        for setting in WORKLOAD_SETTINGS:
            label = QLabel(setting.label)
            label.setToolTip(setting.help)
            form.addRow(label, self.controls[setting.key].widget)
        self.start_button, self.stop_button = QPushButton("Start"), QPushButton("Stop")
        self.start_button.clicked.connect(lambda: self.startRequested.emit(self.workload_or_none()))
        self.stop_button.clicked.connect(self.stopRequested)
        form.addRow(_row(self.start_button, self.stop_button))
        self.progress = QProgressBar()
        self.progress.setRange(0, 1000)
        self.progress.setFormat("%p%")
        form.addRow(self.progress)
        self.status = QLabel("Start serves the workload; your chat keeps working meanwhile.")
        self.status.setWordWrap(True)
        self.status.setObjectName("plotHint")
        form.addRow(self.status)
        ab = QGroupBox("A/B: two profiles, same workload (A B B A)")
        ab_form = QFormLayout(ab)
        self.profile_a, self.profile_b = QComboBox(), QComboBox()
        ab_form.addRow("A", self.profile_a)
        ab_form.addRow("B", self.profile_b)
        self.ab_button = QPushButton("Run A/B")
        self.ab_button.clicked.connect(lambda: self.abRequested.emit(self.profile_a.currentText(),
                                                                     self.profile_b.currentText()))
        ab_form.addRow(self.ab_button)
        inner = QWidget()
        column = QVBoxLayout(inner)
        column.setContentsMargins(0, 0, 0, 0)
        column.addWidget(box)
        column.addWidget(ab)
        column.addStretch(1)
        scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setWidget(inner)
        scroll.setFixedWidth(CONTROLS_WIDTH)
        scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        return scroll

    def workload(self) -> Workload:
        """The workload the controls show (raises ConfigError for a value out of range)."""
        return Workload(**{key: control.value() for key, control in self.controls.items()})

    def workload_or_none(self):
        try:
            return self.workload()
        except Exception as exc:                  # noqa: BLE001 - shown, nothing started
            self.status.setText(f"Workload: {exc}")
            return None

    def set_workload(self, workload: Workload) -> None:
        for key, control in self.controls.items():
            control.set_value(getattr(workload, key))

    def set_profiles(self, names: list[str]) -> None:
        for combo in (self.profile_a, self.profile_b):
            chosen = combo.currentText()
            combo.clear()
            combo.addItems([CURRENT] + names)
            if chosen in [CURRENT] + names:
                combo.setCurrentText(chosen)

    def set_running(self, running: bool) -> None:
        self.start_button.setEnabled(not running)
        self.ab_button.setEnabled(not running)
        self.stop_button.setEnabled(running)

    def show_status(self, text: str) -> None:
        self.status.setText(text)

    # ---- plots -----------------------------------------------------------------------------
    def _plots_area(self) -> QWidget:
        pg.setConfigOptions(antialias=True)
        self.graphics = pg.GraphicsLayoutWidget()
        self.graphics.setBackground("w")
        self.requests_plot = self._plot(0, 0, "Requests", "requests",
                                        (("running", "running"), ("waiting", "waiting")))
        self.kv_plot = self._plot(0, 1, "KV cache", "MiB (log scale)", (("kv_used", "held"), ("capacity", "pool capacity")))
        self.kv_plot.setLogMode(y=True)       # a few MiB held of a pool of hundreds: both readable
        self.throughput_plot = self._plot(0, 2, f"Output throughput (last {_window()})", "tok/s",
                                          (("throughput", "output tok/s"),))
        self.ttft_plot = self._plot(1, 0, f"TTFT (last {_window()})", "ms", (("p50", "p50"), ("p99", "p99")))
        self.itl_plot = self._plot(1, 1, f"Inter-token latency (last {_window()})", "ms",
                                   (("p50", "p50"), ("p99", "p99")))
        self.preemption_plot = self._plot(1, 2, "Preemptions", "preemptions (total)", (("preemptions", "so far"),))
        # Not against time: per batch size (engine.metrics.speculation_speedup_by_batch).
        self.spec_plot = self._plot(2, 0, "Speculation speedup by batch size", "speedup (x)",
                                    (("speedup", "measured"),))
        self.spec_plot.setLabel("bottom", "batch size")
        self.spec_plot.setMouseEnabled(x=False, y=False)
        self.spec_plot.addItem(pg.InfiniteLine(pos=1.0, angle=0, movable=False,
                                               pen=pg.mkPen(PLOT_COLOURS["marker"], width=1, style=Qt.PenStyle.DashLine)))
        # An MoE model's experts woken per step: a dense step reads every weight once at any
        # batch size, an MoE step of B tokens reads up to min(experts, B x top_k) per layer.
        self.experts_plot = self._plot(2, 1, "Experts per MoE layer", "experts woken",
                                       (("experts", "woken"), ("all_experts", "all")))
        self.all_experts_line = pg.InfiniteLine(angle=0, movable=False,
                                                pen=pg.mkPen(C["all_experts"], width=1.5, style=Qt.PenStyle.DashLine))
        self.experts_plot.addItem(self.all_experts_line)
        self.experts_plot.setToolTip(
            "Distinct experts the step's pass woke, averaged over the MoE layers. Each woken expert's weights are "
            "read once per step, so on an MoE model a bigger batch reads more weights per step: batching shares "
            "the weight reads less than on a dense model, whose step reads every weight once at any batch size.")
        self.curves = {
            "running": self.requests_plot.plot(pen=_pen("running")),
            "waiting": self.requests_plot.plot(pen=_pen("waiting")),
            "kv_used": self.kv_plot.plot(pen=_pen("kv_used")),
            "capacity": self.kv_plot.plot(pen=_pen("capacity", 1.5, Qt.PenStyle.DashLine)),
            "throughput": self.throughput_plot.plot(pen=_pen("throughput")),
            "ttft_p50": self.ttft_plot.plot(pen=_pen("p50"), connect="finite"),
            "ttft_p99": self.ttft_plot.plot(pen=_pen("p99"), connect="finite"),
            "itl_p50": self.itl_plot.plot(pen=_pen("p50"), connect="finite"),
            "itl_p99": self.itl_plot.plot(pen=_pen("p99"), connect="finite"),
            "preemptions": self.preemption_plot.plot(pen=_pen("preemptions"), stepMode=None),
            "speedup": self.spec_plot.plot(pen=_pen("speedup"), symbol="o", symbolSize=7,
                                           symbolBrush=C["speedup"]),
            "experts": self.experts_plot.plot(pen=_pen("experts"), connect="finite"),
        }
        for plot in self.plots()[1:]:
            plot.setXLink(self.requests_plot)
        grid = self.graphics.ci.layout
        for column in range(3):
            grid.setColumnStretchFactor(column, 1)
            grid.setColumnPreferredWidth(column, 100)
        self.graphics.setMinimumHeight(3 * PLOT_ROW_MIN_HEIGHT)
        scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setWidget(self.graphics)
        scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        scroll.setMinimumHeight(100)       # the plots keep their own height: this area scrolls
        return scroll

    def set_narrow(self, narrow: bool) -> None:
        """A narrow panel (beside the chat in a short window): the workload above the plots,
        and one plot a row; else the workload on the left and three plots a row."""
        if narrow == self.narrow:
            return
        self._body.setDirection(QBoxLayout.Direction.TopToBottom if narrow else QBoxLayout.Direction.LeftToRight)
        columns = 1 if narrow else 3
        places = {plot: (i // columns, i % columns if columns > 1 else 0, 3 if narrow else 1)
                  for i, plot in enumerate(self._grid_order())}
        self.graphics.setMinimumHeight(place_plots(self.graphics, places) * PLOT_ROW_MIN_HEIGHT)
        self.narrow = narrow

    def _grid_order(self) -> list[pg.PlotItem]:
        return [self.requests_plot, self.kv_plot, self.throughput_plot, self.ttft_plot, self.itl_plot,
                self.preemption_plot, self.spec_plot, self.experts_plot]

    def plots(self) -> list[pg.PlotItem]:
        return [self.requests_plot, self.kv_plot, self.throughput_plot, self.ttft_plot, self.itl_plot,
                self.preemption_plot, self.experts_plot]

    def _plot(self, row: int, col: int, title: str, left: str, legend) -> pg.PlotItem:
        plot = self.graphics.addPlot(row=row, col=col)
        plot.heading = title
        plot.legend_entries = legend
        PlotTitle(plot, _title_with_legend(title, legend), **TITLE_STYLE)
        plot.setLabel("left", left)
        plot.setLabel("bottom", "load time (s)")
        plot.showGrid(x=True, y=True, alpha=0.25)
        plot.setClipToView(True)
        plot.setDownsampling(auto=True, mode="peak")
        plot.setMouseEnabled(x=True, y=False)
        for axis in ("left", "bottom"):
            plot.getAxis(axis).setTextPen("#24292f")
            plot.getAxis(axis).enableAutoSIPrefix(False)      # seconds stay seconds (no "x0.001")
        return plot

    def refresh(self) -> None:
        h = self.history
        if h.version == self._drawn_version:
            return
        self._drawn_version = h.version
        t = h.series("t")
        for name, column in (("running", "running"), ("waiting", "waiting"), ("kv_used", "kv_used_mib"),
                             ("capacity", "kv_capacity_mib"), ("throughput", "output_tok_s"),
                             ("ttft_p50", "ttft_p50_ms"), ("ttft_p99", "ttft_p99_ms"), ("itl_p50", "itl_p50_ms"),
                             ("itl_p99", "itl_p99_ms"), ("preemptions", "preemptions_total")):
            self.curves[name].setData(t, h.series(column), connect="finite")
        for plot, columns in ((self.requests_plot, ("running", "waiting")), (self.throughput_plot, ("output_tok_s",)), (self.ttft_plot, ("ttft_p99_ms",)),
                              (self.itl_plot, ("itl_p99_ms",)), (self.preemption_plot, ("preemptions_total",))):
            top = max((float(np.nanmax(h.series(c), initial=0)) for c in columns), default=0)
            plot.setYRange(0, max(top, 1.0) * 1.08, padding=0)
        if len(t):
            used, capacity, share = (h.series(c) for c in ("kv_used_mib", "kv_capacity_mib", "kv_usage_pct"))
            peak = int(np.nanargmax(used)) if np.isfinite(used).any() else -1
            self.kv_plot.setTitle(_title_with_legend(
                f"KV cache: peak {used[peak]:.1f} of {capacity[peak]:.0f} MiB ({share[peak]:.1f}% of blocks)",
                self.kv_plot.legend_entries))
            held = used[used > 0]
            low = float(held.min()) / 2 if len(held) else float(np.nanmax(capacity)) / 1000
            self.kv_plot.setYRange(np.log10(low), np.log10(float(np.nanmax(capacity)) * 2), padding=0)
            self.progress.setValue(int(round(h.progress * 1000)))
        self._refresh_speedup()
        self._refresh_experts(t)
        self._refresh_markers()
        self.refresh_results()

    def _refresh_speedup(self) -> None:
        by_batch = self.history.speculation_speedup()
        measured = [(size, row["speedup"]) for size, row in by_batch.items() if row["speedup"] is not None]
        self.curves["speedup"].setData([s for s, _ in measured], [v for _, v in measured])
        if measured:
            self.spec_plot.setXRange(0, max(s for s, _ in measured) + 1, padding=0)
            self.spec_plot.setYRange(0, max(1.5, max(v for _, v in measured) * 1.1), padding=0)
        note = ("" if measured else " (needs steps with and without drafts at a batch size: a proposer on, "
                "speculation_policy auto)" if by_batch else "")
        self.spec_plot.setTitle(_title_with_legend(self.spec_plot.heading + note, self.spec_plot.legend_entries))

    def _refresh_experts(self, t: np.ndarray) -> None:
        """The experts curve (an MoE model only) and, in the title, the mean per decode batch size."""
        experts = self.history.experts
        self.all_experts_line.setVisible(experts is not None)
        if experts is None:
            self.curves["experts"].setData([], [])
            note = " (a dense model: no experts)" if self.history.num_steps else ""
            self.experts_plot.setTitle(_title_with_legend(self.experts_plot.heading + note,
                                                          self.experts_plot.legend_entries[:1]))
            return
        total, top_k = experts
        self.curves["experts"].setData(t, self.history.series("experts_active"), connect="finite")
        self.all_experts_line.setPos(total)
        self.experts_plot.setYRange(0, total * 1.08, padding=0)
        by_batch = self.history.experts_by_batch()
        readout = ", ".join(f"{size}: {row['experts_active']:.1f}" for size, row in list(by_batch.items())[:4])
        heading = f"Experts per MoE layer (top-{top_k} of {total})" + (f"; decode batch {readout}" if readout else "")
        self.experts_plot.setTitle(_title_with_legend(heading, self.experts_plot.legend_entries))

    def _refresh_markers(self) -> None:
        if len(self.history.markers) < self._drawn_markers:       # a new load test cleared them
            for plot, line in self._marker_lines:
                plot.removeItem(line)
            self._marker_lines.clear()
            self._drawn_markers = 0
        for t, label in self.history.markers[self._drawn_markers:]:
            for plot in self.plots():
                line = pg.InfiniteLine(pos=t, angle=90, movable=False,
                                       pen=pg.mkPen(PLOT_COLOURS["marker"], width=1.5, style=Qt.PenStyle.DashLine),
                                       label=label if plot is self.requests_plot else None,
                                       labelOpts={"position": 0.85, "color": PLOT_COLOURS["marker"],
                                                  "fill": "#fffffff0", "anchors": [(0, 0.5), (0, 0.5)]})
                line.setToolTip(label)
                plot.addItem(line)
                self._marker_lines.append((plot, line))
        self._drawn_markers = len(self.history.markers)

    # ---- results ---------------------------------------------------------------------------
    def _results_area(self) -> QWidget:
        self.table = QTableWidget(0, 4 + len(RUN_FIGURES))
        self.table.setHorizontalHeaderLabels(["#", "run", "settings", "requests"]
                                             + [FIGURE_LABELS[f] + " [95% CI]" for f in RUN_FIGURES])
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.MultiSelection)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.verticalHeader().hide()
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.table.horizontalHeader().setSectionResizeMode(2, QHeaderView.ResizeMode.Interactive)
        self.table.setColumnWidth(2, 220)
        self.table.setWordWrap(False)
        self.table.itemSelectionChanged.connect(self._selection_changed)
        self.comparison = QLabel("Select two rows to compare them (B is the later row).")
        self.comparison.setWordWrap(True)
        self.comparison.setTextFormat(Qt.TextFormat.RichText)
        self.comparison.setObjectName("plotHint")
        export, clear = QPushButton("Export CSV…"), QPushButton("Clear results")
        export.clicked.connect(self.ask_csv_path)
        clear.clicked.connect(self.clearResultsRequested)
        return results_box(self.table, [clear, export], lead=self.comparison)

    def refresh_results(self) -> None:
        rows = self.history.rows
        if self.table.rowCount() == len(rows):
            return
        self.table.setRowCount(len(rows))
        for i, row in enumerate(rows):
            cells = [str(row["number"]), row["label"], describe_run_settings(row["settings"]), str(len(row["stats"]))]
            cells += [format_with_interval(row["figures"][f], row["intervals"].get(f)) for f in RUN_FIGURES]
            for j, text in enumerate(cells):
                item = QTableWidgetItem(text)
                if j == 2:
                    item.setToolTip(text)
                self.table.setItem(i, j, item)
        self.table.scrollToBottom()

    def selected_numbers(self) -> list[int]:
        return sorted({self.history.rows[index.row()]["number"] for index in self.table.selectionModel().selectedRows()})

    def _selection_changed(self) -> None:
        self.selectionChanged.emit(self.selected_numbers())

    def show_comparison(self, a: dict | None, b: dict | None, comparison: dict | None) -> None:
        if comparison is None:
            self.comparison.setText("Select two rows to compare them (B is the later row).")
            return
        parts = []
        for name in RUN_FIGURES:
            c = comparison[name]
            if c["ratio"] is None or c["difference"] is None:
                continue
            lo, hi = c["difference"]
            verdict = ("<b>differs</b>" if c["excludes_zero"] else "<span style='color:%s'>no clear difference</span>"
                       % MUTED_COLOUR)
            parts.append(f"{escape(FIGURE_LABELS[name])}: {c['ratio']:.2f}x (B−A {_num(lo)}..{_num(hi)}, {verdict})")
        self.comparison.setText(f"#{b['number']} over #{a['number']}: " + "; ".join(parts))

    def ask_csv_path(self) -> None:
        path, _ = QFileDialog.getSaveFileName(self, "Export results", "workbench-load-results.csv", "CSV (*.csv)")
        if path:
            self.exportCsvRequested.emit(path)


def describe_run_settings(settings: dict) -> str:
    """A row's settings, short: what a reader compares between rows."""
    proposer = settings.get("proposer") or "off"
    spec = "spec off" if proposer == "off" else f"spec {proposer} k={settings.get('num_speculative_tokens')}"
    prefix = "prefix cache " + ("on" if settings.get("enable_prefix_caching") else "off")
    compile_state = str(settings.get("compile") or "").split(" ")[0]
    return (f"KV {settings.get('kv_cache_dtype')}, {prefix}, {spec}, {settings.get('kv_pool_blocks')} blocks, "
            f"compile {compile_state}, {settings.get('threads')} threads")


def format_with_interval(value, interval) -> str:
    if value is None:
        return "—"
    if interval is None:
        return _num(value)
    return f"{_num(value)} [{_num(interval[0])}, {_num(interval[1])}]"


def _num(x: float) -> str:
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"


def _window() -> str:
    return f"{WINDOW_S:g} s"


def _pen(name: str, width: float = 2, style=Qt.PenStyle.SolidLine):
    return pg.mkPen(C[name], width=width, style=style)


def _title_with_legend(title: str, entries) -> str:
    keys = "&nbsp;&nbsp;".join(f"<span style='color:{C[key]}'>━</span>&nbsp;{escape(name)}" for key, name in entries)
    return f"{escape(title)}&nbsp;&nbsp;<span style='color:{LEGEND_TEXT_COLOUR}; font-size:8pt'>{keys}</span>"


def _row(*widgets) -> QWidget:
    row = QWidget()
    layout = QHBoxLayout(row)
    layout.setContentsMargins(0, 0, 0, 0)
    for w in widgets:
        layout.addWidget(w)
    return row
