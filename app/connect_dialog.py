"""The "Connect to server…" dialog: the address of an OpenAI-compatible server (vLLM, SGLang, llama.cpp's
llama-server), the model it serves, and the NAME of the environment variable that holds its
API key. The key itself is never typed here, stored or logged: the engine reads it from the
environment when it connects.

Layout only: OK emits serverRequested; the controller connects, and the window reports how
it went (the dialog stays as filled in, for a retry).
"""
from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QDialog, QDialogButtonBox, QFormLayout, QLabel, QLineEdit

DEFAULT_URL = "http://127.0.0.1:8080"


class ConnectDialog(QDialog):
    serverRequested = Signal(str, str, str)     # url, model ("": the server's only one), API key variable name

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setWindowTitle("Connect to server")
        self.url_edit = QLineEdit(DEFAULT_URL)
        self.url_edit.setPlaceholderText(DEFAULT_URL)
        self.model_edit = QLineEdit()
        self.model_edit.setPlaceholderText("empty: the model the server serves, if only one")
        self.key_env_edit = QLineEdit()
        self.key_env_edit.setPlaceholderText("e.g. OPENAI_API_KEY (empty: no key)")
        note = QLabel("vLLM, SGLang or llama.cpp server (OpenAI-compatible). The API key is read from the "
                      "environment variable you name; it is never saved.")
        note.setWordWrap(True)
        self.buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        self.buttons.button(QDialogButtonBox.StandardButton.Ok).setText("Connect")
        self.buttons.accepted.connect(self.accept)
        self.buttons.rejected.connect(self.reject)
        form = QFormLayout(self)
        form.addRow(note)
        form.addRow("Server URL", self.url_edit)
        form.addRow("Model", self.model_edit)
        form.addRow("API key variable", self.key_env_edit)
        form.addRow(self.buttons)

    def accept(self) -> None:
        super().accept()
        self.serverRequested.emit(self.url_edit.text().strip(), self.model_edit.text().strip(),
                                  self.key_env_edit.text().strip())

