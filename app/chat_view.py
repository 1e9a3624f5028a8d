"""The chat pane: system prompt, transcript with coloured tokens, input, Send / Stop / New chat.

Layout and rendering only. It emits what the user wants (send, stop, new chat); the
controller decides what happens.

Replies are shown with their Markdown rendered (app.reply_markdown: emphasis, lists,
headings, tables, code blocks in a monospace box), each token still coloured by where it
came from; "Raw text" (a check box, and the transcript's context menu) shows them as the
model wrote them. The transcript keeps what it shows (`_parts`) so it can draw it again
either way. A streaming reply is drawn again whole as its tokens arrive, but at most a
quarter of the GUI thread's time goes to that (RENDER_SHARE): a long reply is redrawn less
often, never behind (`python -m app.render_bench` measures what a redraw costs).
"""
from __future__ import annotations

import time

from PySide6.QtCore import QEvent, QObject, Qt, QTimer, Signal
from PySide6.QtGui import QAction, QColor, QFont, QTextBlockFormat, QTextCharFormat, QTextCursor
from PySide6.QtWidgets import (QApplication, QCheckBox, QHBoxLayout, QLabel, QPlainTextEdit, QPushButton,
                               QTextBrowser, QVBoxLayout, QWidget)

from app.reply_markdown import RenderedReply, ReplyText, insert_raw, insert_rendered, is_code_block, token_format
from app.theme import ERROR_COLOUR, MUTED_COLOUR, TOKEN_COLOURS, TOKEN_LEGEND

RENDER_SHARE = 0.25          # of the GUI thread's time, at most, spent drawing a streaming reply again


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
        self.transcript = _Transcript()
        self.transcript.setObjectName("transcript")
        self.raw_toggle = QCheckBox("Raw text")
        self.raw_toggle.setObjectName("rawToggle")
        self.raw_toggle.setToolTip("Show replies as the model wrote them, their Markdown not rendered")
        self.transcript.raw_action.toggled.connect(self.raw_toggle.setChecked)
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
        self._parts: list[tuple] = []                 # what the transcript shows, in order
        self._reply: ReplyText | None = None          # the reply streaming now
        self._rendered: RenderedReply | None = None   # its rendering in the transcript
        self._reply_end = 0                           # where it ends in the transcript
        self._render_timer = QTimer(self, singleShot=True)
        self._render_timer.timeout.connect(self._render_reply)
        self._next_render_at = 0.0
        self.render_share = RENDER_SHARE              # 1.0: drawn again after every token (app.render_bench)
        self._lay_out()
        self._connect()
        self.set_state(ready=False, generating=False)

    def _lay_out(self) -> None:
        prompt_label = QLabel("System prompt")
        prompt_label.setObjectName("sectionLabel")
        buttons = QHBoxLayout()
        buttons.addWidget(self.new_chat_button)
        buttons.addWidget(self.raw_toggle)
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
        self.raw_toggle.toggled.connect(self.set_raw)
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
        self._render_timer.stop()
        self._parts.clear()
        self._reply = self._rendered = None
        self.transcript.clear()

    def add_user_message(self, text: str) -> None:
        self._add(("header", "You", "#0969da"), ("user", text))

    def begin_assistant_message(self) -> None:
        self._reply = ReplyText()
        self._add(("header", "Assistant", "#8250df"), ("reply", self._reply))

    def append_segments(self, segments) -> None:
        """segments: (text, kind) runs; kind is an engine token kind."""
        if self._reply is None:
            return
        for text, kind in segments:
            self._reply.append(text, kind)
        if self.raw:
            cursor = self._cursor_at(self._reply_end)
            for text, kind in segments:
                cursor.insertText(text, token_format(kind))
            self._reply_end = cursor.position()
        elif not self._render_timer.isActive():
            wait_s = self._next_render_at - time.perf_counter()
            if wait_s > 0:
                self._render_timer.start(max(1, round(wait_s * 1000)))
            else:
                self._render_reply()

    def finish_assistant_message(self, stats_text: str) -> None:
        self.flush()
        self._reply = self._rendered = None
        self._add(("stats", stats_text))

    def flush(self) -> None:
        """Draw the streaming reply's latest text now, if a redraw is pending."""
        if self._render_timer.isActive():
            self._render_timer.stop()
            self._render_reply()

    def add_error(self, text: str) -> None:
        self._add(("error", text))

    @property
    def raw(self) -> bool:
        return self.raw_toggle.isChecked()

    def set_raw(self, raw: bool) -> None:
        """Show replies as typed (raw) or rendered; the whole transcript is drawn again."""
        self.raw_toggle.setChecked(raw)
        self.transcript.raw_action.setChecked(raw)
        self._render_timer.stop()
        follow = self._follow
        self.transcript.clear()
        for part in self._parts:
            self._draw(part)
        self._follow = follow

    def _add(self, *parts: tuple) -> None:
        for part in parts:
            self._parts.append(part)
            self._draw(part)

    def _draw(self, part: tuple) -> None:
        kind, *content = part
        cursor = self._cursor_at(None)
        if kind == "header":
            who, colour = content
            header = QTextCharFormat()
            header.setFontWeight(QFont.Weight.Bold)
            header.setForeground(QColor(colour))
            if not self.transcript.document().isEmpty():
                cursor.insertBlock(_block_format(top_margin=12))
            cursor.insertText(who, header)
        elif kind == "user":
            cursor.insertBlock(_block_format(top_margin=2))
            cursor.insertText(content[0], token_format("target"))
        elif kind == "reply":
            if self.raw:
                insert_raw(cursor, content[0])
            else:
                self._rendered = insert_rendered(cursor, content[0])
            self._reply_end = cursor.position()
        elif kind == "stats":
            fmt = QTextCharFormat()
            fmt.setForeground(QColor(MUTED_COLOUR))
            fmt.setFontPointSize(max(self.font().pointSizeF() - 1, 7))
            cursor.insertBlock(_block_format(top_margin=2))
            cursor.insertText(content[0], fmt)
        elif kind == "error":
            fmt = QTextCharFormat()
            fmt.setForeground(QColor(ERROR_COLOUR))
            fmt.setFontItalic(True)
            cursor.insertBlock(_block_format(top_margin=4))
            cursor.insertText(f"⚠ {content[0]}", fmt)

    def _render_reply(self) -> None:
        """Render the streaming reply again, in place (one edit: one layout)."""
        if self._reply is None or self.raw:
            return
        started = time.perf_counter()
        cursor = self._cursor_at(self._reply_end)
        cursor.beginEditBlock()
        self._rendered.render(cursor, self._reply)
        self._reply_end = cursor.position()
        cursor.endEditBlock()
        spent = time.perf_counter() - started
        self._next_render_at = time.perf_counter() + spent * (1 / self.render_share - 1)

    def _scrolled(self, value: int) -> None:
        bar = self.transcript.verticalScrollBar()
        self._follow = value >= bar.maximum() - 4     # the user scrolled up to read: stop following

    def _range_changed(self, _minimum: int, maximum: int) -> None:
        if self._follow:                              # text arrived: keep the newest in view
            self.transcript.verticalScrollBar().setValue(maximum)

    def _cursor_at(self, position: int | None) -> QTextCursor:
        """A cursor at `position` in the transcript (None: its end)."""
        cursor = QTextCursor(self.transcript.document())
        if position is None:
            cursor.movePosition(QTextCursor.MoveOperation.End)
        else:
            cursor.setPosition(position)
        return cursor


def _block_format(top_margin: int) -> QTextBlockFormat:
    block = QTextBlockFormat()
    block.setTopMargin(top_margin)
    return block


class _Transcript(QTextBrowser):
    """The transcript: read-only, links not followed, no undo history (a streaming reply is
    drawn again many times); its context menu copies a code block and shows the raw text."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setOpenLinks(False)
        self.document().setUndoRedoEnabled(False)
        self.raw_action = QAction("Show raw text (Markdown not rendered)", self, checkable=True)

    def contextMenuEvent(self, event) -> None:
        menu = self.createStandardContextMenu(event.pos())
        code = code_block_text(self.cursorForPosition(event.pos()).block())
        if code is not None:
            copy = menu.addAction("Copy code block")
            copy.triggered.connect(lambda: QApplication.clipboard().setText(code))
        menu.addSeparator()
        menu.addAction(self.raw_action)
        menu.exec(event.globalPos())


def code_block_text(block) -> str | None:
    """The text of the code block `block` is in (its consecutive code lines), or None."""
    if not is_code_block(block):
        return None
    first = block
    while first.previous().isValid() and is_code_block(first.previous()):
        first = first.previous()
    lines = []
    while first.isValid() and is_code_block(first):
        lines.append(first.text())
        first = first.next()
    return "\n".join(lines)


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
