"""The "Connect to server…" dialog: the address of an OpenAI-compatible server (vLLM, SGLang, llama.cpp's
llama-server), the model it serves, and the NAME of the environment variable that holds its
API key. The key itself is never typed here, stored or logged: the engine reads it from the
environment when it connects.

Layout only: "List models" (or leaving the URL field with a new address) emits
modelsRequested, and the controller hands the answer back to show_models or
show_models_error; OK emits serverRequested and the window reports how connecting went. The
dialog stays as filled in, whatever the answer, for a retry.
"""
from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (QComboBox, QDialog, QDialogButtonBox, QFormLayout, QHBoxLayout, QLabel, QLineEdit,
                               QPushButton)

DEFAULT_URL = "http://127.0.0.1:8080"


class ConnectDialog(QDialog):
    serverRequested = Signal(str, str, str)     # url, model ("": the server's only one), API key variable name
    modelsRequested = Signal(str, str)          # url, API key variable name: list the models it serves

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setWindowTitle("Connect to server")
        self.asked_url: str | None = None       # the address whose model list is awaited or shown
        self.url_edit = QLineEdit(DEFAULT_URL)
        self.url_edit.setPlaceholderText(DEFAULT_URL)
        self.list_button = QPushButton("List models")
        self.model_combo = QComboBox()
        self.model_combo.setEditable(True)      # a model the list does not show can still be typed
        self.model_combo.lineEdit().setPlaceholderText("empty: the model the server serves, if only one")
        self.models_note = QLabel("“List models” asks the server which models it serves.")
        self.models_note.setObjectName("dialogHint")
        self.models_note.setWordWrap(True)
        self.models_error = QLabel()
        self.models_error.setObjectName("errorBanner")
        self.models_error.setWordWrap(True)
        self.models_error.hide()
        self.key_env_edit = QLineEdit()
        self.key_env_edit.setPlaceholderText("e.g. OPENAI_API_KEY (empty: no key)")
        note = QLabel("vLLM, SGLang or llama.cpp server (OpenAI-compatible). The API key is read from the "
                      "environment variable you name; it is never saved.")
        note.setWordWrap(True)
        self.buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        self.buttons.button(QDialogButtonBox.StandardButton.Ok).setText("Connect")
        self._lay_out(note)
        self.buttons.accepted.connect(self.accept)
        self.buttons.rejected.connect(self.reject)
        self.list_button.clicked.connect(self.request_models)
        self.url_edit.editingFinished.connect(self._url_entered)

    def _lay_out(self, note: QLabel) -> None:
        url_row = QHBoxLayout()
        url_row.addWidget(self.url_edit, 1)
        url_row.addWidget(self.list_button)
        form = QFormLayout(self)
        form.addRow(note)
        form.addRow("Server URL", url_row)
        form.addRow("API key variable", self.key_env_edit)
        form.addRow("Model", self.model_combo)
        form.addRow("", self.models_note)
        form.addRow(self.models_error)
        form.addRow(self.buttons)
        self.setMinimumWidth(520)

    # ---- the served models ------------------------------------------------------------
    def request_models(self) -> None:
        url = self.url_edit.text().strip()
        self.models_error.hide()
        if not url:
            self._show_error("enter the server's URL first, e.g. " + DEFAULT_URL)
            return
        self.asked_url = url
        self.models_note.setText(f"Asking {url} for its models…")
        self.modelsRequested.emit(url, self.key_env_edit.text().strip())

    def _url_entered(self) -> None:
        """Leaving the URL field (or Enter) with an address not asked yet lists its models."""
        url = self.url_edit.text().strip()
        if url and url != self.asked_url:
            self.request_models()

    def show_models(self, url: str, models: list) -> None:
        """The models `url` serves. What the user typed stays; an empty field takes the first."""
        if url != self.asked_url:
            return                              # the answer for an address since changed
        typed = self.model_combo.currentText().strip()
        self.model_combo.clear()
        self.model_combo.addItems(models)
        self.model_combo.setEditText(typed or (models[0] if models else ""))
        served = f"{len(models)} model{'s' if len(models) != 1 else ''}" if models else "no models"
        missing = f" It does not list {typed!r}." if typed and typed not in models else ""
        self.models_note.setText(f"{url} serves {served}.{missing}")

    def show_models_error(self, url: str, message: str) -> None:
        if url == self.asked_url:
            self._show_error(f"Could not list the models: {message}")

    def _show_error(self, text: str) -> None:
        self.models_note.setText("Nothing was changed; correct the address (or the API key variable) and "
                                 "list again.")
        self.models_error.setText(text)
        self.models_error.show()

    # ---- connecting ---------------------------------------------------------------------
    def model(self) -> str:
        return self.model_combo.currentText().strip()

    def accept(self) -> None:
        super().accept()
        self.serverRequested.emit(self.url_edit.text().strip(), self.model(), self.key_env_edit.text().strip())
