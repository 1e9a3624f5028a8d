"""A results table as the load test and the Quality tab show it: the table above a row of
buttons (and a lead widget on the left), and its rows written to a CSV the user picked."""
from __future__ import annotations

from PySide6.QtWidgets import QHBoxLayout, QTableWidget, QVBoxLayout, QWidget

MIN_HEIGHT = 90           # a header and two rows stay visible when the dock is short


def results_box(table: QTableWidget, buttons: list[QWidget], lead: QWidget | None = None) -> QWidget:
    """The table, then the lead widget (stretching; else empty space) and the buttons in a row."""
    bar = QHBoxLayout()
    if lead is not None:
        bar.addWidget(lead, 1)
    else:
        bar.addStretch(1)
    for button in buttons:
        bar.addWidget(button)
    box = QWidget()
    layout = QVBoxLayout(box)
    layout.setContentsMargins(0, 0, 0, 0)
    layout.addWidget(table, 1)
    layout.addLayout(bar)
    box.setMinimumHeight(MIN_HEIGHT)
    return box


def export_csv(window, history, path: str, what: str) -> None:
    """history.write_csv(path), and the window says where it went or why it could not."""
    try:
        written = history.write_csv(path)
    except OSError as exc:
        window.show_error(f"Could not write {path}: {exc.strerror or exc}")
        return
    window.show_message(f"Saved the {what} to {written}")
