"""Live plots of the session's metrics (pyqtgraph).

Three rows: acceptance (each step's point in the colour of the proposer that drafted it)
and KV memory; decode speed, acceptance per position (by depth
with a draft tree) and TTFT; then what each draft tree did: its accepted path against its
depth, and the nodes verified against the node budget.

Curves are created once; a QTimer (at most 10 Hz, see PLOT_TIME_BUDGET) copies the
MetricsHistory ring buffers into them, only when something new arrived. Vertical markers show where a setting changed, so
each optimization's effect is visible as it happens.
"""
from __future__ import annotations

import time
from html import escape

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import QFileDialog, QGridLayout, QLabel, QPushButton, QScrollArea, QVBoxLayout, QWidget

from app.formatting import speculation_verdict
from app.metrics_history import DRAFTERS, SERVER, MetricsHistory
from app.plot_grid import place_plots
from app.plot_title import PlotTitle
from app.theme import ERROR_COLOUR, PAYS_COLOUR, PLOT_COLOURS as C, PROPOSER_COLOURS

# The GUI thread shares the Python interpreter with the engine's worker thread, so every
# millisecond spent redrawing is taken from decoding (app.fidelity measures it). Redraws
# come at most at 10 Hz, and less often when a redraw is slow: the plots' share of wall
# time stays under PLOT_TIME_BUDGET.
MIN_REFRESH_MS, MAX_REFRESH_MS = 100, 2000
PLOT_TIME_BUDGET = 0.03
LEGEND_HEADROOM = 1.5    # the server's KV share: y range = data max x this (room to read the line)
DATA_HEADROOM = 1.1      # every legend sits in its plot's title row: a little room above the data
# Each row of plots keeps this height (the panel scrolls when its dock is shorter), so on a
# 1366x768 screen no plot shrinks to a strip and no axis title is cut.
PLOT_ROW_MIN_HEIGHT = 230
NARROW_ROW_MIN_HEIGHT = 260     # a narrow panel's titles wrap to two lines: the data keeps its height
# (row, column, column span) of each plot in a grid four columns wide: step series two
# columns, bar charts one. Where the panel is narrow (beside the chat in a short window)
# each plot takes a row of its own.
WIDE_PLACES = {"acceptance_plot": (0, 0, 2), "kv_plot": (0, 2, 2), "decode_plot": (1, 0, 2),
               "positions_plot": (1, 2, 1), "ttft_plot": (1, 3, 1), "tree_path_plot": (2, 0, 2),
               "tree_nodes_plot": (2, 2, 2)}
NARROW_PLACES = {name: (row, 0, 4) for row, name in enumerate(WIDE_PLACES)}
PLOT_ROWS = 3
EXPORT_WIDTH = 1400      # px: Export PNG of a narrow panel draws the wide layout this wide
TITLE_STYLE = {"size": "11pt"}      # pyqtgraph's title size
LEGEND_TEXT_COLOUR = "#24292f"
MARKER_LABEL_ROWS = (0.68, 0.54, 0.4)   # label heights, cycled so close markers do not overlap
MAX_MARKER_LINES = 64    # per plot; older markers scroll out anyway
KV_BYTES_AXIS = "MiB (log scale)"
KV_SHARE_AXIS = "in use (%)"
KV_SHARE_MIN_TOP = 5     # %: the KV share axis shows at least 0-10%
POSITION_AXES = {False: "draft position i", True: "tree depth"}     # with a draft tree or not
TREE_PATH_TITLE, TREE_NODES_TITLE = "Draft tree: accepted path", "Draft tree nodes"


def _pen(name: str, width: float = 2, style=Qt.PenStyle.SolidLine):
    return pg.mkPen(C[name], width=width, style=style)


class PlotsPanel(QWidget):
    exportPngRequested = Signal(str)
    exportCsvRequested = Signal(str)
    clearRequested = Signal()

    def __init__(self, history: MetricsHistory, parent=None):
        super().__init__(parent)
        self.history = history
        self._drawn_version = -1
        self._drawn_markers = 0
        self._marker_lines: list[tuple[pg.PlotItem, pg.InfiniteLine]] = []
        pg.setConfigOptions(antialias=True)
        self.graphics = pg.GraphicsLayoutWidget()
        self.graphics.setBackground("w")
        self._build_plots()
        self.narrow = False
        self._lay_out()
        self.timer = QTimer(self)
        self.timer.setInterval(MIN_REFRESH_MS)
        self.timer.timeout.connect(self.refresh)
        self.timer.start()

    # ---- layout ----------------------------------------------------------------
    def _lay_out(self) -> None:
        self.status_label = QLabel("Plots fill in as you chat. Dashed lines: a setting changed.")
        self.status_label.setObjectName("plotHint")
        self.status_label.setWordWrap(True)          # a narrow panel wraps it rather than widening
        clear = QPushButton("Clear")
        clear.clicked.connect(self.clearRequested)
        png = QPushButton("Export PNG…")
        csv = QPushButton("Export CSV…")
        png.clicked.connect(self.ask_png_path)
        csv.clicked.connect(self.ask_csv_path)
        self._bar, self._bar_buttons = QGridLayout(), (clear, png, csv)
        self._bar.setColumnStretch(0, 1)
        self._place_bar(narrow=False)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addLayout(self._bar)
        self.graphics.setMinimumHeight(PLOT_ROWS * PLOT_ROW_MIN_HEIGHT)
        self.scroll = QScrollArea()
        self.scroll.setWidgetResizable(True)
        self.scroll.setWidget(self.graphics)
        self.scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        layout.addWidget(self.scroll, 1)

    def _place_bar(self, narrow: bool) -> None:
        """The hint left of the buttons, or in a narrow panel on a row of its own above them."""
        for widget in (self.status_label, *self._bar_buttons):
            self._bar.removeWidget(widget)
        self._bar.addWidget(self.status_label, 0, 0, 1, 4 if narrow else 1)
        for column, button in enumerate(self._bar_buttons, start=1):
            self._bar.addWidget(button, int(narrow), column)

    def set_narrow(self, narrow: bool) -> None:
        """Lay the plots out for a narrow panel (NARROW_PLACES) or a wide one (WIDE_PLACES)."""
        if narrow == self.narrow:
            return
        self._place_bar(narrow)
        places = NARROW_PLACES if narrow else WIDE_PLACES
        rows = place_plots(self.graphics, {getattr(self, name): place for name, place in places.items()})
        self.graphics.setMinimumHeight(rows * (NARROW_ROW_MIN_HEIGHT if narrow else PLOT_ROW_MIN_HEIGHT))
        self.narrow = narrow

    def ask_png_path(self) -> None:
        self._ask_path(self.exportPngRequested, "PNG image (*.png)", "workbench-plots.png")

    def ask_csv_path(self) -> None:
        self._ask_path(self.exportCsvRequested, "CSV (*.csv)", "workbench-metrics.csv")

    def _ask_path(self, signal, file_filter: str, suggestion: str) -> None:
        path, _ = QFileDialog.getSaveFileName(self, "Export", suggestion, file_filter)
        if path:
            signal.emit(path)

    def _new_plot(self, row: int, col: int, title: str, left: str, bottom: str, colspan: int = 2) -> pg.PlotItem:
        plot = self.graphics.addPlot(row=row, col=col, colspan=colspan)
        PlotTitle(plot, escape(title), **TITLE_STYLE)      # wraps, so a long title never widens its column
        plot.setLabel("left", left)
        plot.setLabel("bottom", bottom)
        plot.showGrid(x=True, y=True, alpha=0.25)
        plot.setClipToView(True)
        plot.setDownsampling(auto=True, mode="peak")
        for axis in ("left", "bottom"):
            plot.getAxis(axis).setTextPen("#24292f")
        return plot

    def _build_plots(self) -> None:
        """Three rows of four columns: step series two columns wide, bar charts one."""
        self._build_acceptance()
        self._build_positions()
        self._build_kv()
        self._build_ttft()
        self._build_decode()
        self._build_tree()
        for plot in (p for p in self._step_plots() if p is not self.kv_plot):
            # One step axis for the step plots, following the KV plot (which has every step).
            plot.enableAutoRange(x=False)
            plot.setXLink(self.kv_plot)
        grid = self.graphics.ci.layout
        for column in range(4):
            grid.setColumnStretchFactor(column, 1)
            grid.setColumnPreferredWidth(column, 100)

    def _step_plots(self) -> tuple[pg.PlotItem, ...]:
        return self.acceptance_plot, self.kv_plot, self.decode_plot, self.tree_path_plot, self.tree_nodes_plot

    def _build_acceptance(self) -> None:
        p = self.acceptance_plot = self._new_plot(0, 0, "Acceptance rate", "accepted (%)", "session step")
        # From a little below 0, so a step that accepted nothing shows its whole dot (and its colour).
        p.setYRange(-4, DATA_HEADROOM * 100, padding=0)
        p.getAxis("left").setTicks([[(v, str(v)) for v in range(0, 101, 25)]])
        self.acceptance_title = p.titleLabel
        self.drafters_shown: tuple[str, ...] = ()       # the proposers whose points are drawn, in the legend
        self.unattributed_shown = False                 # points of steps that did not say which
        p.setTitle(self._acceptance_heading(tree=False))
        # A step that does not say which proposer drafted it (a server's) keeps one colour.
        self.acceptance_points = p.plot(pen=None, symbol="o", symbolSize=5, symbolBrush=C["acceptance"],
                                        symbolPen=None, name="per step")
        # Under `proposer: auto` the engine picks the proposer step by step: each step's point
        # in the colour of the one that drafted it.
        self.acceptance_by_drafter = {name: p.plot(pen=None, symbol="o", symbolSize=6, symbolPen=None,
                                                   symbolBrush=PROPOSER_COLOURS[name], name=name)
                                      for name in DRAFTERS}
        self.acceptance_running = p.plot(pen=_pen("running"), name="running (this reply)")

    def _acceptance_heading(self, tree: bool) -> str:
        """With a draft tree in effect accepted/proposed says little (2 of 24 nodes is a
        success): the plot keeps to chains, the tree row shows what trees did. Its legend
        names the proposers whose points are drawn, and "per step" for steps that did not say
        which (or while nothing is drawn)."""
        points = [("●", PROPOSER_COLOURS[name], name) for name in self.drafters_shown]
        if self.unattributed_shown or not points:
            points.append(("●", C["acceptance"], "per step"))
        return _title_with_legend("Acceptance rate" + (" (chains)" if tree else ""),
                                  (*points, ("━", C["running"], "running (this reply)")))

    def _build_positions(self) -> None:
        p = self.positions_plot = self._new_plot(1, 2, "Per-position acceptance", "accepted (%)",
                                                 POSITION_AXES[False], colspan=1)
        p.setYRange(0, 105, padding=0)
        p.getAxis("left").setTicks([[(v, str(v)) for v in range(0, 101, 25)]])
        self.positions_bars = pg.BarGraphItem(x=[], height=[], width=0.6, brush=C["positions"])
        p.addItem(self.positions_bars)

    def _build_kv(self) -> None:
        p = self.kv_plot = self._new_plot(0, 2, "KV-cache memory", KV_BYTES_AXIS, "session step")
        self.kv_model_curve = p.plot(pen=_pen("kv_model"), connect="finite")
        self.kv_fp8_curve = p.plot(pen=_pen("kv_fp8"), connect="finite")
        self.kv_capacity_curve = p.plot(pen=_pen("capacity", 1.5, Qt.PenStyle.DashLine))
        # A server reports the share of its cache in use, not bytes: drawn instead of the
        # bytes (another unit, another axis) while the latest step has no bytes.
        self.kv_share_curve = p.plot(pen=_pen("kv_share"), connect="finite")
        # Legends in the title row (never over the data): (symbol, colour, name) per curve shown.
        self.kv_legends = {False: (("━", C["kv_model"], "held, model dtype"), ("━", C["kv_fp8"], "held, FP8 E4M3"),
                                   ("┅", C["capacity"], "pool capacity")),
                           True: (("━", C["kv_share"], "in use (% of the server's KV cache)"),)}
        self.kv_curves = {False: (self.kv_model_curve, self.kv_fp8_curve, self.kv_capacity_curve),
                          True: (self.kv_share_curve,)}
        self.kv_shows_share = None
        self._show_kv_share(False)

    def _build_ttft(self) -> None:
        p = self.ttft_plot = self._new_plot(1, 3, "TTFT per request", "TTFT (ms)", "request #", colspan=1)
        self.ttft_bars = pg.BarGraphItem(x=[], height=[], width=0.6, brush=C["ttft"])
        p.addItem(self.ttft_bars)
        # Prefix-hit tokens on a right-hand axis with its own scale.
        self.prefix_view = pg.ViewBox()
        p.showAxis("right")
        p.scene().addItem(self.prefix_view)
        p.getAxis("right").linkToView(self.prefix_view)
        p.getAxis("right").setLabel("prefix-hit tokens", color=C["prefix"])
        p.getAxis("right").setTextPen(C["prefix"])
        self.prefix_view.setXLink(p)
        # Drawn over the bars (a tall bar would hide a diamond), but transparent to the mouse
        # so zooming and panning still reach the TTFT plot underneath.
        self.prefix_view.setZValue(1000)     # a top-level scene item: above the whole plot grid
        self.prefix_view.setAcceptedMouseButtons(Qt.MouseButton.NoButton)
        self.prefix_points = pg.PlotDataItem(pen=None, symbol="d", symbolSize=10, symbolBrush=C["prefix"],
                                             symbolPen="#24292f")
        self.prefix_view.addItem(self.prefix_points)
        p.vb.sigResized.connect(lambda: self.prefix_view.setGeometry(p.vb.sceneBoundingRect()))

    def _build_decode(self) -> None:
        p = self.decode_plot = self._new_plot(1, 0, "Decode speed", "decode speed (tok/s)", "session step")
        p.setTitle(_title_with_legend("Decode speed", (("●", C["tok_s"], "per step"),
                                                       ("━", C["running_tok_s"], "running (this reply)"),
                                                       ("✕", C["compile"], "compile"))))
        self.decode_points = p.plot(pen=None, symbol="o", symbolSize=4, symbolBrush=C["tok_s"], symbolPen=None,
                                    name="per step")
        # A step whose pass compiled the step graph: shown, but left out of every speed figure.
        self.decode_compile_points = p.plot(pen=None, symbol="x", symbolSize=9, symbolBrush=C["compile"],
                                            symbolPen=C["compile"], name="compiling (not counted)")
        self.decode_running = p.plot(pen=_pen("running_tok_s"), name="running (this reply)")

    def _build_tree(self) -> None:
        """A tree step's accepted/proposed says little (2 of 24 nodes is a success): these say
        how long its accepted path was, and how many nodes of the budget the engine verified."""
        p = self.tree_path_plot = self._new_plot(2, 0, TREE_PATH_TITLE, "path (tokens)", "session step")
        p.setTitle(_title_with_legend(TREE_PATH_TITLE, (("●", C["tree_path"], "accepted"),
                                                        ("○", C["tree_predicted"], "predicted"),
                                                        ("┅", C["capacity"], "depth"))))
        self.tree_depth_curve = p.plot(pen=_pen("capacity", 1.5, Qt.PenStyle.DashLine), connect="finite")
        self.tree_predicted_points = p.plot(pen=None, symbol="o", symbolSize=8, symbolBrush=None,
                                            symbolPen=_pen("tree_predicted", 1.5))
        self.tree_path_points = p.plot(pen=None, symbol="o", symbolSize=6, symbolBrush=C["tree_path"], symbolPen=None)
        q = self.tree_nodes_plot = self._new_plot(2, 2, TREE_NODES_TITLE, "nodes", "session step")
        q.setTitle(_tree_nodes_title(None))
        self.tree_budget_curve = q.plot(pen=_pen("capacity", 1.5, Qt.PenStyle.DashLine), connect="finite")
        self.tree_nodes_points = q.plot(pen=None, symbol="s", symbolSize=5, symbolBrush=C["tree_nodes"],
                                        symbolPen=None)

    # ---- refresh ---------------------------------------------------------------
    def refresh(self) -> None:
        if self.history.version == self._drawn_version:
            return
        started = time.perf_counter()
        self._update_items()
        self.graphics.viewport().repaint()        # now, so the cost is measured
        cost_ms = (time.perf_counter() - started) * 1000
        self.timer.setInterval(int(min(max(cost_ms / PLOT_TIME_BUDGET, MIN_REFRESH_MS), MAX_REFRESH_MS)))

    def _update_items(self) -> None:
        h = self.history
        self._drawn_version = h.version
        x, requests = h.step_series("session_step"), h.step_series("request")
        chain = np.isnan(h.step_series("tree_node_budget"))     # no tree in effect (see _acceptance_heading)
        self._refresh_acceptance_points(x, np.where(chain, h.step_series("acceptance") * 100, np.nan))
        _set_runs(self.acceptance_running, x, np.where(chain, h.step_series("running_acceptance") * 100, np.nan),
                  requests)
        self._refresh_positions()
        self._refresh_tree(x)
        self._refresh_kv(x)
        self._refresh_ttft()
        tok_s = h.step_series("tok_s")
        _set_finite(self.decode_points, x, tok_s)
        _set_finite(self.decode_compile_points, x, h.step_series("compile_tok_s"))
        _set_runs(self.decode_running, x, h.step_series("running_tok_s"), requests)
        self.decode_plot.setYRange(0, max(1.0, float(np.nanmax(tok_s, initial=0))) * DATA_HEADROOM, padding=0)
        self._refresh_verdict()
        self._refresh_markers()

    def _refresh_acceptance_points(self, x: np.ndarray, accepted: np.ndarray) -> None:
        """Each step's point in its proposer's colour (MetricsHistory's drafted_by_code)."""
        code = self.history.step_series("drafted_by_code")
        unattributed = np.where(np.isnan(code), accepted, np.nan)
        _set_finite(self.acceptance_points, x, unattributed)
        shown = []
        for number, name in enumerate(DRAFTERS):
            mine = np.where(code == number, accepted, np.nan)
            _set_finite(self.acceptance_by_drafter[name], x, mine)
            if np.isfinite(mine).any():
                shown.append(name)
        self.drafters_shown, self.unattributed_shown = tuple(shown), bool(np.isfinite(unattributed).any())

    def _refresh_verdict(self) -> None:
        """Under the acceptance plot's title: does speculation pay over this set-up's replies?"""
        verdict = speculation_verdict(self.history.speculation.report)
        title = self._acceptance_heading(self.history.tree_shape is not None)
        if verdict is not None:
            headline, details, pays = verdict
            details = f"; <span style='font-size:8pt'>{escape(details)}</span>" if details else ""
            title += (f"<br><span style='color:{PAYS_COLOUR if pays else ERROR_COLOUR}; font-size:9pt'>"
                      f"<b>{escape(headline)}</b>{details}</span>")
        if title != self.acceptance_title.text:
            self.acceptance_plot.setTitle(title)

    def _refresh_positions(self) -> None:
        """Per draft position; with a draft tree in effect, per depth (the counts start again
        when it changes)."""
        tree = self.history.tree_shape is not None
        title = ("Acceptance by depth" if tree else "Per-position acceptance") + (
            " (the server's counters)" if self.history.per_position_source == SERVER else "")
        if title != self.positions_plot.titleLabel.text:
            self.positions_plot.setTitle(title)
            self.positions_plot.setLabel("bottom", POSITION_AXES[tree])
        rates = self.history.per_position_acceptance()
        self.positions_bars.setOpts(x=np.arange(1, len(rates) + 1), height=rates * 100)
        if len(rates):
            self.positions_plot.setXRange(0.4, len(rates) + 0.6, padding=0)
            _integer_ticks(self.positions_plot, 1, len(rates))

    def _refresh_tree(self, x: np.ndarray) -> None:
        h = self.history
        path, predicted, depth = (h.step_series(n) for n in ("tree_accepted_path", "tree_predicted", "tree_depth"))
        nodes, budget = h.step_series("tree_nodes"), h.step_series("tree_node_budget")
        nodes = np.where(nodes > 0, nodes, np.nan)          # a chain step verified no tree
        _set_finite(self.tree_path_points, x, path)
        _set_finite(self.tree_predicted_points, x, predicted)
        self.tree_depth_curve.setData(x, depth, connect="finite")
        _set_finite(self.tree_nodes_points, x, nodes)
        self.tree_budget_curve.setData(x, budget, connect="finite")
        html = _tree_nodes_title(h.tree_shape)
        if html != self.tree_nodes_plot.titleLabel.text:
            self.tree_nodes_plot.setTitle(html)
        for plot, series in ((self.tree_path_plot, (path, predicted, depth)), (self.tree_nodes_plot, (nodes, budget))):
            top = max([1.0] + [float(np.nanmax(s)) for s in series if np.isfinite(s).any()])
            # From a little below 0, so a step that accepted nothing shows its whole dot.
            plot.setYRange(-0.04 * top, top * DATA_HEADROOM, padding=0)
            _integer_ticks(plot, 0, int(top), axis="left", most=5)

    def _refresh_kv(self, x: np.ndarray) -> None:
        h = self.history
        used, fp8 = h.step_series("kv_used_mib"), h.step_series("is_fp8") > 0
        # Only the steps without bytes: a local step's share would be of another cache.
        no_bytes = np.isnan(used)
        server_share = np.where(no_bytes, h.step_series("kv_usage") * 100, np.nan)
        self._show_kv_share(bool(len(used) and no_bytes[-1] and np.isfinite(server_share).any()))
        if self.kv_shows_share:
            self.kv_share_curve.setData(x, server_share, connect="finite")
            dtype = f" — cache dtype {h.kv_dtype}" if h.kv_dtype else ""
            self._set_kv_title(f"KV-cache usage{dtype} (the server reports a share, not bytes)")
            # Zoomed to what is held (a chat holds a few % of a server's cache).
            top = min(2 * max(KV_SHARE_MIN_TOP, float(np.nanmax(server_share))), LEGEND_HEADROOM * 100)
            self.kv_plot.setYRange(0, top, padding=0)
            self.kv_plot.getAxis("left").setTicks(_percent_ticks(top))
            return
        self.kv_model_curve.setData(x, np.where(fp8, np.nan, used), connect="finite")
        self.kv_fp8_curve.setData(x, np.where(fp8, used, np.nan), connect="finite")
        capacity = h.step_series("kv_capacity_mib")
        self.kv_capacity_curve.setData(x, capacity)
        self._set_kv_title(f"KV-cache memory — cache dtype {h.kv_dtype}" if h.kv_dtype else "KV-cache memory")
        if np.isfinite(used).any() and np.isfinite(capacity).any():      # a server may not report bytes
            # Log axis: from half the smallest held to a little above the pool.
            low, high = float(np.nanmin(used)), float(np.nanmax(capacity))
            self.kv_plot.setYRange(np.log10(max(low, 1e-3) / 2), np.log10(high * 2), padding=0)

    def _set_kv_title(self, title: str) -> None:
        html = _title_with_legend(title, self.kv_legends[bool(self.kv_shows_share)])
        if html != self.kv_plot.titleLabel.text:
            self.kv_plot.setTitle(html)

    def _show_kv_share(self, share: bool) -> None:
        """Switch the KV plot between bytes (MiB, log scale) and a server's share (%, linear)."""
        if share == self.kv_shows_share:
            return
        self.kv_shows_share = share
        p = self.kv_plot
        for shown in (False, True):
            for curve in self.kv_curves[shown]:
                curve.setVisible(shown == share)
        self._set_kv_title("KV-cache memory")
        # Bytes on a log scale: a chat holds a few MiB of a pool of hundreds; both stay readable.
        p.setLogMode(y=not share)
        p.setLabel("left", KV_SHARE_AXIS if share else KV_BYTES_AXIS)
        p.getAxis("left").setTicks(None)

    def _refresh_ttft(self) -> None:
        h = self.history
        requests = h.request_series("request")
        self.ttft_bars.setOpts(x=requests, height=h.request_series("ttft_ms"))
        prefix_hits = h.request_series("prefix_hit_tokens")
        self.prefix_points.setData(requests, prefix_hits)
        top = max(16.0, float(np.nanmax(prefix_hits, initial=0)) * 1.15)
        self.prefix_view.setYRange(-0.05 * top, top, padding=0)     # a zero-hit diamond shows whole
        if len(requests):
            self.ttft_plot.setXRange(requests[0] - 0.6, requests[-1] + 0.6, padding=0)
            _integer_ticks(self.ttft_plot, int(requests[0]), int(requests[-1]))

    def _refresh_markers(self) -> None:
        if self.history.markers_added < self._drawn_markers:      # the history was cleared
            self._remove_markers()
        markers = list(self.history.markers)
        new = self.history.markers_added - self._drawn_markers
        for number, (step_x, request_x, label) in enumerate(markers[max(len(markers) - new, 0):],
                                                            start=self._drawn_markers):
            # Labelled on the step plots, at staggered heights; the request plot is too narrow.
            height = MARKER_LABEL_ROWS[number % len(MARKER_LABEL_ROWS)]
            for plot in self._step_plots():
                self._add_marker(plot, step_x, label, height)
            self._add_marker(self.ttft_plot, request_x)
        self._drawn_markers = self.history.markers_added

    def _remove_markers(self) -> None:
        for plot, line in self._marker_lines:
            plot.removeItem(line)
        self._marker_lines.clear()
        self._drawn_markers = 0

    def _add_marker(self, plot: pg.PlotItem, x: float, label: str | None = None, height: float = 0.9) -> None:
        line = pg.InfiniteLine(pos=x, angle=90, movable=False, pen=_pen("marker", 1.5, Qt.PenStyle.DashLine),
                               label=label, labelOpts={"position": height, "color": C["marker"],
                                                       "fill": "#fffffff0", "anchors": [(0, 0.5), (0, 0.5)]})
        if label:
            line.setToolTip(label)
        plot.addItem(line)     # counts for auto-range, so a marker is never just off screen
        self._marker_lines.append((plot, line))
        if len(self._marker_lines) > 4 * MAX_MARKER_LINES:
            old_plot, old_line = self._marker_lines.pop(0)
            old_plot.removeItem(old_line)

    # ---- export ----------------------------------------------------------------
    def save_png(self, path: str) -> bool:
        """The plots as a PNG, in the wide layout (a panel beside the chat is drawn wide for it)."""
        self.refresh()
        if not self.narrow:
            return self.graphics.grab().save(path, "PNG")
        graphics = self.scroll.takeWidget()        # out of the scroll area, which would size it back
        self.set_narrow(False)
        graphics.resize(EXPORT_WIDTH, PLOT_ROWS * PLOT_ROW_MIN_HEIGHT)
        graphics.ci.layout.activate()
        try:
            return graphics.grab().save(path, "PNG")
        finally:
            self.set_narrow(True)
            self.scroll.setWidget(graphics)


def _integer_ticks(plot: pg.PlotItem, first: int, last: int, most: int = 10, axis: str = "bottom") -> None:
    """Whole-number ticks (no "1.5" between two bars, no half a token)."""
    step = max(1, -(-(last - first + 1) // most))
    plot.getAxis(axis).setTicks([[(v, str(v)) for v in range(first, last + 1, step)]])


def _percent_ticks(top: float, most: int = 5) -> list:
    """Round-number ticks from 0 to top, none above 100%."""
    last = min(top, 100)
    step = next((s for s in (1, 2, 5, 10, 20, 25) if last / s <= most), 25)
    return [[(v, str(v)) for v in range(0, int(last) + 1, step)]]


def _title_with_legend(title: str, entries) -> str:
    """A plot title followed by its legend, (symbol, colour, name) each: in the title row the
    legend never covers data, whatever the plot's height."""
    # A narrow plot breaks the line between entries ("&nbsp; "), never inside one.
    keys = "&nbsp; ".join(f"<span style='color:{colour}'>{symbol}</span>&nbsp;{escape(name).replace(' ', '&nbsp;')}"
                               for symbol, colour, name in entries)
    return f"{escape(title)}&nbsp;&nbsp; <span style='color:{LEGEND_TEXT_COLOUR}; font-size:8pt'>{keys}</span>"


def _tree_nodes_title(shape) -> str:
    """The nodes plot's title: with the tree the setting allows (engine.config.TreeShape)."""
    return _title_with_legend(f"{TREE_NODES_TITLE} — {shape or 'off'}",
                              (("■", C["tree_nodes"], "verified"), ("┅", C["capacity"], "budget")))


def _set_finite(item: pg.PlotDataItem, x: np.ndarray, y: np.ndarray) -> None:
    keep = np.isfinite(y)
    item.setData(x[keep], y[keep])


def _set_runs(item: pg.PlotDataItem, x: np.ndarray, y: np.ndarray, requests: np.ndarray) -> None:
    """A line per request: no segment joins the end of one reply to the start of the next."""
    keep = np.isfinite(y)
    x, y, requests = x[keep], y[keep], requests[keep]
    connect = np.append(requests[1:] == requests[:-1], False) if len(x) else "all"
    item.setData(x, y, connect=connect)
