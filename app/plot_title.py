"""PlotTitle: a pyqtgraph plot's title of any number of lines, wrapped to the plot's width.

pyqtgraph's own title is one line in a 30-pixel row, and its minimum width is its text's, so
a long line would widen the plot's column and squeeze its neighbours. This one takes the
title's place in the plot's layout: its width follows the plot, its height the text (a
legend in the title row, a verdict line under it). PlotItem.setTitle keeps working.
"""
from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtGui import QTextOption

TITLE_ROW = 0      # where PlotItem lays out its title


class PlotTitle(pg.LabelItem):
    def __init__(self, plot: pg.PlotItem, html: str, **style):
        super().__init__(" ", parent=plot, **style)
        self.item.document().setDefaultTextOption(QTextOption(Qt.AlignmentFlag.AlignCenter))
        self.plot = plot
        plot.layout.removeItem(plot.titleLabel)
        plot.titleLabel.hide()
        plot.titleLabel = self
        plot.layout.addItem(self, TITLE_ROW, 1)
        self.setText(html)

    def resizeEvent(self, ev) -> None:
        width = self.rect().width()
        if width > 0 and abs(width - self.item.textWidth()) > 0.5:
            self.item.setTextWidth(width)
        super().resizeEvent(ev)

    def updateMin(self) -> None:
        """As tall as the wrapped text, as wide as the layout makes it."""
        height = self.itemRect().height()
        self.setMinimumWidth(0)
        self.setMinimumHeight(height)
        self.setMaximumHeight(height)
        self._sizeHint = {Qt.SizeHint.MinimumSize: (0, height), Qt.SizeHint.PreferredSize: (0, height),
                          Qt.SizeHint.MaximumSize: (-1, height), Qt.SizeHint.MinimumDescent: (0, 0)}
        plot = getattr(self, "plot", None)         # None while LabelItem.__init__ runs
        if plot is not None:
            plot.layout.setRowFixedHeight(TITLE_ROW, height)
        self.updateGeometry()
