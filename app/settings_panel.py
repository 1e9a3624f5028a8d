"""The settings side panel: model picker, speculation, KV cache, sampling, settings in effect.

Layout only. Each control emits the user's intent as soon as it changes; the controller
applies it live and tells the panel what is actually in effect.
"""
from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (QCheckBox, QComboBox, QDoubleSpinBox, QFileDialog, QFormLayout, QGroupBox,
                               QHBoxLayout, QLabel, QPushButton, QSpinBox, QVBoxLayout, QWidget)

PROPOSERS = (("Off", "off"), ("Draft model", "draft"), ("N-gram (prompt lookup)", "ngram"))
KV_DTYPES = (("Model dtype (auto)", "auto"), ("FP8 E4M3", "fp8_e4m3"))
DRAFTS = (("None", ""), ("Shipped draft (distilled, default model)", "default-draft"),
          ("Self (target drafts for itself)", "self"))
BLOCK_SIZES = (8, 16, 32, 64)
ENGINE_KEYS = ("proposer", "num_speculative_tokens", "kv_cache_dtype", "enable_prefix_caching", "block_size")
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "max_tokens", "seed")
RANDOM_SEED = -1       # the seed spin box's "random" value


class SettingsPanel(QWidget):
    engineSettingChanged = Signal(str, object)    # a LLMEngine.reconfigure key and its new value
    draftModelChosen = Signal(object)             # None, "self" or a path
    samplingChanged = Signal()
    modelRequested = Signal(str)                  # "default", a folder or a .gguf file

    def __init__(self, parent=None):
        super().__init__(parent)
        self._build_controls()
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 8, 8, 8)
        for group in (self._model_group(), self._speculation_group(), self._cache_group(),
                      self._sampling_group(), self._effect_group()):
            layout.addWidget(group)
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
        self.proposer_combo = _combo(PROPOSERS)
        self.k_spin = _spin(1, 16, 4)
        self.draft_combo = _combo(DRAFTS)
        self.draft_folder_button = QPushButton("Folder…")
        self.draft_gguf_button = QPushButton("GGUF…")
        self.kv_dtype_combo = _combo(KV_DTYPES)
        self.prefix_check = QCheckBox("Prefix caching")
        self.block_size_combo = _combo([(str(b), b) for b in BLOCK_SIZES])
        self.temperature_spin = _double_spin(0.0, 2.0, 0.05, 0.0)
        self.top_p_spin = _double_spin(0.05, 1.0, 0.05, 1.0)
        self.top_k_spin = _spin(0, 1000, 0)
        self.top_k_spin.setSpecialValueText("off")
        self.max_tokens_spin = _spin(1, 8192, 256)
        self.seed_spin = _spin(RANDOM_SEED, 2**31 - 1, RANDOM_SEED)
        self.seed_spin.setSpecialValueText("random")
        self.effective_label = QLabel("—")
        self.effective_label.setObjectName("effectiveSettings")
        self.effective_label.setWordWrap(True)
        self.deferred_label = QLabel()
        self.deferred_label.setObjectName("deferredSettings")
        self.deferred_label.setWordWrap(True)
        self.deferred_label.hide()

    def _model_group(self) -> QGroupBox:
        box = QGroupBox("Model")
        layout = QVBoxLayout(box)
        layout.addWidget(self.model_label)
        layout.addLayout(_row(self.default_model_button, self.model_folder_button, self.model_gguf_button))
        return box

    def _speculation_group(self) -> QGroupBox:
        box = QGroupBox("Speculative decoding")
        form = QFormLayout(box)
        form.addRow("Proposer", self.proposer_combo)
        form.addRow("k (draft tokens)", self.k_spin)
        form.addRow("Draft model", self.draft_combo)
        form.addRow("", _row(self.draft_folder_button, self.draft_gguf_button))
        return box

    def _cache_group(self) -> QGroupBox:
        box = QGroupBox("KV cache")
        form = QFormLayout(box)
        form.addRow("Cache dtype", self.kv_dtype_combo)
        form.addRow("Block size", self.block_size_combo)
        form.addRow("", self.prefix_check)
        return box

    def _sampling_group(self) -> QGroupBox:
        box = QGroupBox("Sampling (next message)")
        form = QFormLayout(box)
        form.addRow("Temperature", self.temperature_spin)
        form.addRow("Top-p", self.top_p_spin)
        form.addRow("Top-k", self.top_k_spin)
        form.addRow("Max tokens", self.max_tokens_spin)
        form.addRow("Seed", self.seed_spin)
        return box

    def _effect_group(self) -> QGroupBox:
        box = QGroupBox("In effect")
        layout = QVBoxLayout(box)
        layout.addWidget(self.effective_label)
        layout.addWidget(self.deferred_label)
        return box

    def _connect(self) -> None:
        emit = self.engineSettingChanged.emit
        self.proposer_combo.currentIndexChanged.connect(lambda: emit("proposer", self.proposer_combo.currentData()))
        self.k_spin.valueChanged.connect(lambda v: emit("num_speculative_tokens", v))
        self.kv_dtype_combo.currentIndexChanged.connect(
            lambda: emit("kv_cache_dtype", self.kv_dtype_combo.currentData()))
        self.block_size_combo.currentIndexChanged.connect(
            lambda: emit("block_size", self.block_size_combo.currentData()))
        self.prefix_check.toggled.connect(lambda on: emit("enable_prefix_caching", on))
        self.draft_combo.currentIndexChanged.connect(lambda: self.draftModelChosen.emit(self.draft_combo.currentData() or None))
        for spin in (self.temperature_spin, self.top_p_spin, self.top_k_spin, self.max_tokens_spin, self.seed_spin):
            spin.valueChanged.connect(self.samplingChanged)
        self.default_model_button.clicked.connect(lambda: self.modelRequested.emit("default"))
        self.model_folder_button.clicked.connect(lambda: self._pick_folder(self.modelRequested.emit, "model"))
        self.model_gguf_button.clicked.connect(lambda: self._pick_gguf(self.modelRequested.emit, "model"))
        self.draft_folder_button.clicked.connect(lambda: self._pick_folder(self.choose_draft, "draft model"))
        self.draft_gguf_button.clicked.connect(lambda: self._pick_gguf(self.choose_draft, "draft model"))

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
        _select(self.draft_combo, reference or "")

    def values(self) -> dict:
        """The chosen settings, keyed like engine.profiles.SessionProfile."""
        seed = self.seed_spin.value()
        return {"proposer": self.proposer_combo.currentData(), "num_speculative_tokens": self.k_spin.value(),
                "draft_model": self.draft_combo.currentData() or None, "kv_cache_dtype": self.kv_dtype_combo.currentData(),
                "enable_prefix_caching": self.prefix_check.isChecked(),
                "block_size": self.block_size_combo.currentData(),
                "temperature": round(self.temperature_spin.value(), 4), "top_p": round(self.top_p_spin.value(), 4),
                "top_k": self.top_k_spin.value(), "max_tokens": self.max_tokens_spin.value(),
                "seed": None if seed == RANDOM_SEED else seed}

    def set_values(self, values: dict) -> None:
        """Show settings without emitting change signals (the controller applies them itself)."""
        widgets = self.findChildren(QWidget)
        for w in widgets:
            w.blockSignals(True)
        try:
            _select(self.proposer_combo, values["proposer"])
            self.k_spin.setValue(values["num_speculative_tokens"])
            _select(self.draft_combo, values["draft_model"] or "")
            _select(self.kv_dtype_combo, values["kv_cache_dtype"])
            self.prefix_check.setChecked(values["enable_prefix_caching"])
            _select(self.block_size_combo, values["block_size"])
            self.temperature_spin.setValue(values["temperature"])
            self.top_p_spin.setValue(values["top_p"])
            self.top_k_spin.setValue(values["top_k"])
            self.max_tokens_spin.setValue(values["max_tokens"])
            self.seed_spin.setValue(RANDOM_SEED if values["seed"] is None else values["seed"])
        finally:
            for w in widgets:
                w.blockSignals(False)

    def show_draft(self, reference: str | None) -> None:
        """Show a draft choice without emitting it (e.g. back to the one in effect)."""
        self.draft_combo.blockSignals(True)
        _select(self.draft_combo, reference or "")
        self.draft_combo.blockSignals(False)

    def show_model(self, name: str) -> None:
        self.model_label.setText(name)

    def show_effective(self, html: str) -> None:
        self.effective_label.setText(html)

    def show_deferred(self, text: str) -> None:
        self.deferred_label.setText(text)
        self.deferred_label.setVisible(bool(text))


def _combo(items) -> QComboBox:
    combo = QComboBox()
    for label, data in items:
        combo.addItem(label, data)
    return combo


def _select(combo: QComboBox, data) -> None:
    index = combo.findData(data)
    if index < 0:       # a value from a profile or a browse dialog: offer it too
        combo.addItem(Path(str(data)).name or str(data), data)
        index = combo.count() - 1
        combo.setItemData(index, str(data), Qt.ItemDataRole.ToolTipRole)
    combo.setCurrentIndex(index)


def _spin(low: int, high: int, value: int) -> QSpinBox:
    spin = QSpinBox()
    spin.setRange(low, high)
    spin.setValue(value)
    return spin


def _double_spin(low: float, high: float, step: float, value: float) -> QDoubleSpinBox:
    spin = QDoubleSpinBox()
    spin.setRange(low, high)
    spin.setSingleStep(step)
    spin.setDecimals(2)
    spin.setValue(value)
    return spin


def _row(*widgets) -> QHBoxLayout:
    row = QHBoxLayout()
    for w in widgets:
        row.addWidget(w)
    return row
