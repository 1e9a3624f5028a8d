"""Moving a pyqtgraph layout's plots to other cells: the panels lay their plots out wide
(under the chat) or one a row (beside the chat, in a short window)."""
from __future__ import annotations

import pyqtgraph as pg


def place_plots(graphics: pg.GraphicsLayoutWidget, places: dict) -> int:
    """Put each plot of `places` ({plot: (row, column, column span)}) in its cell; returns
    the number of rows now used. Items not named keep their cells."""
    grid = graphics.ci
    for plot in places:
        grid.removeItem(plot)
    for plot, (row, column, span) in places.items():
        grid.addItem(plot, row=row, col=column, colspan=span)
    # Columns share the width evenly, whatever spans them now (the grid keeps sizes it had).
    for column in range(max(column + span for _, column, span in places.values())):
        grid.layout.setColumnStretchFactor(column, 1)
        grid.layout.setColumnPreferredWidth(column, 100)
        grid.layout.setColumnMinimumWidth(column, 0)
    grid.layout.invalidate()
    return 1 + max(row for row, _, _ in places.values())
