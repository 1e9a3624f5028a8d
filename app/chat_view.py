"""The chat pane: system prompt, transcript with coloured tokens, input, Send / Stop / New chat.

Layout and rendering only. It emits what the user wants (send, stop, new chat); the
controller decides what happens.
"""
from __future__ import annotations

from PySide6.QtCore import QEvent, QObject, Qt, Signal
from PySide6.QtGui import QColor, QFont, QTextBlockFormat, QTextCharFormat, QTextCursor
from PySide6.QtWidgets import (QHBoxLayout, QLabel, QPlainTextEdit, QPushButton, QTextBrowser, QVBoxLayout,
                               QWidget)

from app.theme import ERROR_COLOUR, MUTED_COLOUR, TOKEN_COLOURS, TOKEN_LEGEND


def token_format(kind: str) -> QTextCharFormat:
    fmt = QTextCharFormat()
    colour, background = TOKEN_COLOURS.get(kind, TOKEN_COLOURS["target"])
    fmt.setForeground(QColor(colour))
    if background:
        fmt.setBackground(QColor(background))
    fmt.setProperty(QTextCharFormat.Property.UserProperty, kind)   # tests and exports read the kind back
    return fmt


def legend_html() -> str:
    items = []
    for kind, meaning in TOKEN_LEGEND:
        colour, background = TOKEN_COLOURS[kind]
        style = f"color:{colour};" + (f"background:{background};" if background else "border:1px solid #d0d7de;")
        items.append(f"<span style='{style} padding:1px 4px;'>&nbsp;{kind}&nbsp;</span> {meaning}")
    return "&nbsp;&nbsp; ".join(items)


class ChatView(QWidget):
    sendRequested = Signal(str)
    stopRequested = Signal()
    newChatRequested = Signal()
    systemPromptEdited = Signal(str)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.system_prompt_edit = QPlainTextEdit()
        self.system_prompt_edit.setObjectName("systemPrompt")
        self.system_prompt_edit.setPlaceholderText("System prompt (empty: the model's default)")
        self.system_prompt_edit.setFixedHeight(44)
        self.transcript = QTextBrowser()
        self.transcript.setObjectName("transcript")
        self.transcript.setOpenLinks(False)
        self.legend = QLabel(legend_html())
        self.legend.setObjectName("legend")
        self.legend.setWordWrap(True)
        self.input = QPlainTextEdit()
        self.input.setObjectName("chatInput")
        self.input.setPlaceholderText("Type a message — Ctrl+Enter sends, Esc stops")
        self.input.setFixedHeight(60)
        self.send_button = QPushButton("Send")
        self.send_button.setObjectName("sendButton")
        self.send_button.setToolTip("Send (Ctrl+Enter)")
        self.stop_button = QPushButton("Stop")
        self.stop_button.setObjectName("stopButton")
        self.stop_button.setToolTip("Stop generating (Esc)")
        self.new_chat_button = QPushButton("New chat")
        self._lay_out()
        self._connect()
        self.set_state(ready=False, generating=False)

    def _lay_out(self) -> None:
        prompt_label = QLabel("System prompt")
        prompt_label.setObjectName("sectionLabel")
        buttons = QHBoxLayout()
        buttons.addWidget(self.new_chat_button)
        buttons.addStretch(1)
        buttons.addWidget(self.stop_button)
        buttons.addWidget(self.send_button)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 8, 8, 8)
        layout.addWidget(prompt_label)
        layout.addWidget(self.system_prompt_edit)
        layout.addWidget(self.transcript, 1)
        layout.addWidget(self.legend)
        layout.addWidget(self.input)
        layout.addLayout(buttons)

    def _connect(self) -> None:
        self.send_button.clicked.connect(self.request_send)
        self.stop_button.clicked.connect(self.stopRequested)
        self.new_chat_button.clicked.connect(self.newChatRequested)
        self.system_prompt_edit.textChanged.connect(
            lambda: self.systemPromptEdited.emit(self.system_prompt_edit.toPlainText()))
        self._follow = True
        bar = self.transcript.verticalScrollBar()
        bar.valueChanged.connect(self._scrolled)
        bar.rangeChanged.connect(self._range_changed)
        self._keys = _ChatKeys(self.request_send, self.stopRequested.emit, self)
        self.input.installEventFilter(self._keys)

    def request_send(self) -> None:
        """Send what is typed, if sending is possible now (Send button, Ctrl+Enter)."""
        if self.send_button.isEnabled():
            self.sendRequested.emit(self.input.toPlainText())

    # ---- state -----------------------------------------------------------------
    def set_state(self, ready: bool, generating: bool) -> None:
        self.send_button.setEnabled(ready and not generating)
        self.stop_button.setEnabled(generating)

    def system_prompt(self) -> str:
        return self.system_prompt_edit.toPlainText()

    def set_system_prompt(self, text: str) -> None:
        self.system_prompt_edit.blockSignals(True)
        self.system_prompt_edit.setPlainText(text)
        self.system_prompt_edit.blockSignals(False)

    def input_text(self) -> str:
        return self.input.toPlainText()

    def set_input_text(self, text: str) -> None:
        self.input.setPlainText(text)

    # ---- transcript --------------------------------------------------------------
    def clear_transcript(self) -> None:
        self.transcript.clear()

    def add_user_message(self, text: str) -> None:
        self._start_message("You", "#0969da")
        self._insert(text, token_format("target"))

    def begin_assistant_message(self) -> None:
        self._start_message("Assistant", "#8250df")

    def append_segments(self, segments) -> None:
        """segments: (text, kind) runs; kind is an engine token kind."""
        for text, kind in segments:
            self._insert(text, token_format(kind))

    def finish_assistant_message(self, stats_text: str) -> None:
        fmt = QTextCharFormat()
        fmt.setForeground(QColor(MUTED_COLOUR))
        fmt.setFontPointSize(max(self.font().pointSizeF() - 1, 7))
        self._new_block(top_margin=2)
        self._insert(stats_text, fmt)

    def add_error(self, text: str) -> None:
        fmt = QTextCharFormat()
        fmt.setForeground(QColor(ERROR_COLOUR))
        fmt.setFontItalic(True)
        self._new_block(top_margin=4)
        self._insert(f"⚠ {text}", fmt)

    def _start_message(self, who: str, colour: str) -> None:
        header = QTextCharFormat()
        header.setFontWeight(QFont.Weight.Bold)
        header.setForeground(QColor(colour))
        if not self.transcript.document().isEmpty():
            self._new_block(top_margin=12)
        self._insert(who, header)
        self._new_block(top_margin=2)

    def _new_block(self, top_margin: int) -> None:
        cursor = self._end_cursor()
        block = QTextBlockFormat()
        block.setTopMargin(top_margin)
        cursor.insertBlock(block)

    def _insert(self, text: str, fmt: QTextCharFormat) -> None:
        self._end_cursor().insertText(text, fmt)

    def _scrolled(self, value: int) -> None:
        bar = self.transcript.verticalScrollBar()
        self._follow = value >= bar.maximum() - 4     # the user scrolled up to read: stop following

    def _range_changed(self, _minimum: int, maximum: int) -> None:
        if self._follow:                              # text arrived: keep the newest in view
            self.transcript.verticalScrollBar().setValue(maximum)

    def _end_cursor(self) -> QTextCursor:
        cursor = QTextCursor(self.transcript.document())
        cursor.movePosition(QTextCursor.MoveOperation.End)
        return cursor


class _ChatKeys(QObject):
    """Ctrl+Enter sends and Esc stops while typing (a plain Enter adds a line)."""

    def __init__(self, send, stop, parent=None):
        super().__init__(parent)
        self._send, self._stop = send, stop

    def eventFilter(self, watched, event) -> bool:
        if event.type() != QEvent.Type.KeyPress:
            return False
        enter = event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter)
        if enter and event.modifiers() & Qt.KeyboardModifier.ControlModifier:
            self._send()
            return True
        if event.key() == Qt.Key.Key_Escape:
            self._stop()
            return True
        return False
