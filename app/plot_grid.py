"""Moving a pyqtgraph layout's plots to other cells: the panels lay their plots out wide
(under the chat) or one a row (beside the chat, in a short window).

A plot moves inside the grid layout only: it stays in its scene, a child of the same layout
item. pyqtgraph's GraphicsLayout.removeItem takes an item out of the scene, which hands it to
Python (shiboken) while the layout's parent item still holds it in C++; re-added, the plot
then had two owners, and destroying the window's scene called a Python override of a plot
already half destroyed (a segfault in shiboken's error path, seen in the app tests).
"""
from __future__ import annotations

import pyqtgraph as pg


def place_plots(graphics: pg.GraphicsLayoutWidget, places: dict) -> int:
    """Put each plot of `places` ({plot: (row, column, column span)}) in its cell; returns
    the number of rows now used. Items not named keep their cells."""
    grid = graphics.ci
    for plot in places:
        grid.layout.removeAt(grid.itemIndex(plot))
        for row, column in grid.items[plot]:        # pyqtgraph's own record of the cells
            del grid.rows[row][column]
    for plot, (row, column, span) in places.items():
        grid.items[plot] = [(row, column + j) for j in range(span)]
        for cell_row, cell_column in grid.items[plot]:
            grid.rows.setdefault(cell_row, {})[cell_column] = plot
        grid.layout.addItem(plot, row, column, 1, span)
    # Columns share the width evenly, whatever spans them now (the grid keeps sizes it had).
    for column in range(max(column + span for _, column, span in places.values())):
        grid.layout.setColumnStretchFactor(column, 1)
        grid.layout.setColumnPreferredWidth(column, 100)
        grid.layout.setColumnMinimumWidth(column, 0)
    grid.layout.invalidate()
    return 1 + max(row for row, _, _ in places.values())
