"""A Qt control for one row of the settings table (engine.config.SETTINGS).

The control's kind, range, step and choices come from the row, so a setting's limits are
defined once. Each control reads and writes plain values and emits `changed` on edits.
"""
from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtWidgets import QCheckBox, QComboBox, QDoubleSpinBox, QSpinBox, QWidget

from engine.config import Setting

DECIMALS = 2


class SettingControl(QObject):
    """Wraps the widget for one setting: `value()`, `set_value(v)` (silent), `changed`."""
    changed = Signal(str, object)        # key, new value

    def __init__(self, setting: Setting, parent=None):
        super().__init__(parent)
        self.setting = setting
        self.widget = _make_widget(setting)
        self._unset = _unset_value(setting)
        self._connect()

    def _connect(self) -> None:
        w, emit = self.widget, lambda *_: self.changed.emit(self.setting.key, self.value())
        if isinstance(w, QComboBox):
            w.currentIndexChanged.connect(emit)
        elif isinstance(w, QCheckBox):
            w.toggled.connect(emit)
        else:
            w.valueChanged.connect(emit)

    def value(self):
        w = self.widget
        if isinstance(w, QComboBox):
            data = w.currentData()
            if data is None and w.isEditable():        # typed in: the engine checks its form
                return w.currentText().strip()
            return None if data == "" and self.setting.optional else data
        if isinstance(w, QCheckBox):
            return w.isChecked()
        value = w.value()
        if self._unset is not None and value == self._unset:
            return None
        return round(value, 4) if isinstance(w, QDoubleSpinBox) else value

    def set_value(self, value) -> None:
        w = self.widget
        w.blockSignals(True)
        try:
            if isinstance(w, QComboBox):
                select(w, "" if value is None else value)
            elif isinstance(w, QCheckBox):
                w.setChecked(bool(value))
            else:
                w.setValue(self._unset if value is None else value)
        finally:
            w.blockSignals(False)


def _make_widget(setting: Setting) -> QWidget:
    if setting.choices is not None:
        combo = shrinkable_combo()
        for value, label in setting.choices.items():
            combo.addItem(label, value)
        return combo
    if setting.type is bool:
        return QCheckBox(setting.label)
    if setting.type is str and not setting.optional:     # a value of a form of its own (a tree's shape): typed
        combo = shrinkable_combo()
        combo.setEditable(True)
        combo.addItem(setting.default, setting.default)
        combo.setToolTip(setting.help or "")
        return combo
    if setting.type is str:          # an optional reference (a folder): its default, then what was chosen
        combo = shrinkable_combo()
        combo.addItem(setting.off_text or "none", "")
        if setting.help:
            combo.setToolTip(setting.help)
        return combo
    if setting.type is float:
        spin = QDoubleSpinBox()
        spin.setDecimals(DECIMALS)
        spin.setSingleStep(setting.step or 0.1)
    else:
        spin = QSpinBox()
    low = setting.low if setting.low is not None else -(2**31)
    high = setting.high if setting.high is not None else 2**31 - 1
    unset = _unset_value(setting)
    spin.setRange(unset if unset is not None else low, high)
    if setting.off_text:
        spin.setSpecialValueText(setting.off_text)      # shown for the lowest value
    if setting.help:
        spin.setToolTip(setting.help)
    return spin


def _unset_value(setting: Setting):
    """An optional number shows "not set" one below its range."""
    if setting.optional and setting.type in (int, float) and setting.low is not None:
        return setting.low - 1
    return None


def shrinkable_combo() -> QComboBox:
    """A combo box that fits a narrow side panel (long choices are elided, the list shows them)."""
    combo = QComboBox()
    combo.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
    combo.setMinimumContentsLength(12)
    return combo


def select(combo: QComboBox, data) -> None:
    """Select the item holding `data`; a value from a profile or a browse dialog is added."""
    index = combo.findData(data)
    if index < 0:
        combo.addItem(Path(str(data)).name or str(data), data)
        index = combo.count() - 1
        combo.setItemData(index, str(data), Qt.ItemDataRole.ToolTipRole)
    combo.setCurrentIndex(index)
