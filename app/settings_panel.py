"""The settings side panel: model picker, speculation, KV cache, sampling, settings in effect.

Layout only. Each control emits the user's intent as soon as it changes; the controller
applies it live and tells the panel what is actually in effect.
"""
from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (QFileDialog, QFormLayout, QGroupBox, QHBoxLayout, QLabel, QPushButton,
                               QVBoxLayout, QWidget)

from app.connect_dialog import ConnectDialog
from app.setting_controls import SettingControl, select, shrinkable_combo
from engine import config

# The rows of engine.config.SETTINGS that have a group, grouped; names, limits and choices
# all come from the table.
GROUPS = config.groups()
PANEL_KEYS = tuple(key for keys in GROUPS.values() for key in keys)
# Draft model presets (any folder or .gguf can be browsed for, too).
DRAFTS = (("None", ""), ("Self (target drafts for itself)", "self"))
# Draft tree presets after its default ("off"); any TOPK:DEPTH:NODES can be typed.
TREE_PRESETS = ("auto", str(config.AUTO_SHAPE))


class SettingsPanel(QWidget):
    engineSettingChanged = Signal(str, object)    # a LLMEngine.reconfigure key and its new value
    draftModelChosen = Signal(object)             # None, "self" or a path
    samplingChanged = Signal()
    modelRequested = Signal(str)                  # "default", a folder or a .gguf file
    serverRequested = Signal(str, str, str)       # url, model, API key variable name (app.connect_dialog)

    def __init__(self, parent=None):
        super().__init__(parent)
        self._build_controls()
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 8, 8, 8)
        layout.addWidget(self._model_group())
        for title, keys in GROUPS.items():
            layout.addWidget(self._group(title, keys))
        layout.addWidget(self._effect_group())
        layout.addStretch(1)
        self._connect()

    # ---- controls --------------------------------------------------------------
    def _build_controls(self) -> None:
        self.model_label = QLabel("no model loaded")
        self.model_label.setObjectName("modelName")
        self.model_label.setWordWrap(True)
        self.default_model_button = QPushButton("Default")
        self.model_folder_button = QPushButton("Folder…")
        self.model_gguf_button = QPushButton("GGUF…")
        self.connect_server_button = QPushButton("Connect to server…")
        self.connect_dialog = ConnectDialog(self)
        self.controls = {key: SettingControl(config.BY_KEY[key], self) for key in PANEL_KEYS if key != "draft_model"}
        for preset in TREE_PRESETS:
            self.controls["draft_tree"].widget.addItem(preset, preset)
        self.draft_combo = shrinkable_combo()
        for label, data in DRAFTS:
            self.draft_combo.addItem(label, data)
        self.draft_folder_button = QPushButton("Folder…")
        self.draft_gguf_button = QPushButton("GGUF…")
        self.eagle_folder_button = QPushButton("Folder…")
        self.effective_label = QLabel("—")
        self.effective_label.setObjectName("effectiveSettings")
        self.effective_label.setWordWrap(True)
        self.deferred_label = QLabel()
        self.deferred_label.setObjectName("deferredSettings")
        self.deferred_label.setWordWrap(True)
        self.deferred_label.hide()

    def widget(self, key: str) -> QWidget:
        """The control for a setting key (tests and scripts drive it like a user)."""
        return self.draft_combo if key == "draft_model" else self.controls[key].widget

    def _model_group(self) -> QGroupBox:
        box = QGroupBox("Model")
        layout = QVBoxLayout(box)
        layout.addWidget(self.model_label)
        layout.addLayout(_row(self.default_model_button, self.model_folder_button, self.model_gguf_button))
        layout.addWidget(self.connect_server_button)
        return box

    def _group(self, title: str, keys) -> QGroupBox:
        box = QGroupBox(title)
        form = QFormLayout(box)
        for key in keys:
            setting = config.BY_KEY[key]
            label = "" if setting.type is bool else setting.label
            form.addRow(label, self.widget(key))
            if key == "draft_model":
                form.addRow("", _row(self.draft_folder_button, self.draft_gguf_button))
            if key == "eagle_head":
                form.addRow("", _row(self.eagle_folder_button))
        return box

    def _effect_group(self) -> QGroupBox:
        box = QGroupBox("In effect")
        layout = QVBoxLayout(box)
        layout.addWidget(self.effective_label)
        layout.addWidget(self.deferred_label)
        return box

    def _connect(self) -> None:
        for key, control in self.controls.items():
            if config.BY_KEY[key].section == config.SAMPLING:
                control.changed.connect(self.samplingChanged)
            else:
                control.changed.connect(self.engineSettingChanged)
        self.draft_combo.currentIndexChanged.connect(lambda: self.draftModelChosen.emit(self.draft_combo.currentData() or None))
        self.default_model_button.clicked.connect(lambda: self.modelRequested.emit("default"))
        self.model_folder_button.clicked.connect(lambda: self._pick_folder(self.modelRequested.emit, "model"))
        self.model_gguf_button.clicked.connect(lambda: self._pick_gguf(self.modelRequested.emit, "model"))
        self.connect_server_button.clicked.connect(self.connect_dialog.open)
        self.connect_dialog.serverRequested.connect(self.serverRequested)
        self.draft_folder_button.clicked.connect(lambda: self._pick_folder(self.choose_draft, "draft model"))
        self.draft_gguf_button.clicked.connect(lambda: self._pick_gguf(self.choose_draft, "draft model"))
        self.eagle_folder_button.clicked.connect(
            lambda: self._pick_folder(lambda f: select(self.controls["eagle_head"].widget, f), "EAGLE head"))

    def _pick_folder(self, then, what: str) -> None:
        folder = QFileDialog.getExistingDirectory(self, f"Choose a Hugging Face {what} folder")
        if folder:
            then(folder)

    def _pick_gguf(self, then, what: str) -> None:
        path, _ = QFileDialog.getOpenFileName(self, f"Choose a {what} GGUF file", "", "GGUF files (*.gguf)")
        if path:
            then(path)

    # ---- values ----------------------------------------------------------------
    def choose_draft(self, reference: str | None) -> None:
        """Select (adding if new) a draft model reference, as if the user picked it."""
        select(self.draft_combo, reference or "")

    def values(self) -> dict:
        """The chosen settings, keyed like engine.profiles.SessionProfile."""
        return {key: control.value() for key, control in self.controls.items()} | {
            "draft_model": self.draft_combo.currentData() or None}

    def set_values(self, values: dict) -> None:
        """Show settings without emitting change signals (the controller applies them itself)."""
        for key, control in self.controls.items():
            control.set_value(values[key])
        self.show_draft(values["draft_model"])

    def show_draft(self, reference: str | None) -> None:
        """Show a draft choice without emitting it (e.g. back to the one in effect)."""
        self.draft_combo.blockSignals(True)
        select(self.draft_combo, reference or "")
        self.draft_combo.blockSignals(False)

    def show_model(self, name: str) -> None:
        self.model_label.setText(name)

    def show_effective(self, html: str) -> None:
        self.effective_label.setText(html)

    def show_deferred(self, text: str) -> None:
        self.deferred_label.setText(text)
        self.deferred_label.setVisible(bool(text))


def _row(*widgets) -> QHBoxLayout:
    row = QHBoxLayout()
    for w in widgets:
        row.addWidget(w)
    return row
