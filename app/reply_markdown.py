"""A reply's Markdown rendered into the chat transcript, every token still coloured by where
it came from (the engine's token kinds: target, accepted, resampled, bonus).

Qt renders the Markdown: `QTextDocument.setMarkdown` (CommonMark with GitHub's tables, task
lists and strikethrough; raw HTML is shown as text, never interpreted) into a document of the
reply's own. Its blocks are then copied into the transcript after the reply's header, each
fragment cut where the token kind changes. The rendered text is the reply's text less its
markup, in order, so each rendered character is matched to the character of the reply it
shows (`source_offsets`) and takes the colour of the token that character came from.
Copying block by block, rather than `QTextCursor.insertMarkdown`, keeps the first block's
own format (a reply that opens with a heading, a list or a code block) and lets code blocks
be drawn as a monospace box.

A streaming reply is rendered again as it grows (`RenderedReply.render`): the whole text is
parsed again (Qt's parser, fast), but only the top-level blocks from the first one that
differs from the last render are copied again; the blocks before it stay as they are.

An image in a reply is shown as its text, never loaded: a reply cannot make the app read a
file. Links keep their look and are not followed.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from itertools import groupby

from PySide6.QtGui import (QColor, QFont, QFontDatabase, QTextBlockFormat, QTextCharFormat, QTextCursor, QTextDocument,
                           QTextFormat, QTextTable)

from app.theme import CODE_BACKGROUND, MUTED_COLOUR, TOKEN_COLOURS

FEATURES = QTextDocument.MarkdownFeature(QTextDocument.MarkdownFeature.MarkdownDialectGitHub.value
                                         | QTextDocument.MarkdownFeature.MarkdownNoHTML.value)
# Markup between two shown characters (a fence line, a list marker, `**`) is shorter than this;
# past it (a link's long target) a character is matched only where the shown text after it agrees.
SEARCH_WINDOW = 64
CONFIRM = 6
_SPACE = re.compile(r"\s")
CODE_MARGIN = 8.0           # px each side of a code block's box
SPACE_AROUND = 6.0          # px above a code block's box and around a table


@dataclass
class ReplyText:
    """A reply as the model wrote it, and the token kind each character came from."""
    text: str = ""
    char_kinds: list[str] = field(default_factory=list)

    def append(self, piece: str, kind: str) -> None:
        self.text += piece
        self.char_kinds.extend([kind] * len(piece))

    def runs(self):
        """(text, kind) for each run of one kind, in order."""
        start = 0
        for kind, group in groupby(self.char_kinds):
            length = sum(1 for _ in group)
            yield self.text[start:start + length], kind
            start += length


def token_format(kind: str) -> QTextCharFormat:
    fmt = QTextCharFormat()
    colour, background = TOKEN_COLOURS.get(kind, TOKEN_COLOURS["target"])
    fmt.setForeground(QColor(colour))
    if background:
        fmt.setBackground(QColor(background))
    fmt.setProperty(QTextCharFormat.Property.UserProperty, kind)   # tests and exports read the kind back
    return fmt


def insert_raw(cursor: QTextCursor, reply: ReplyText) -> None:
    """The reply as typed, in one new block (its own newlines make more)."""
    cursor.insertBlock(_reply_block_format())
    for piece, kind in reply.runs():
        cursor.insertText(piece, token_format(kind))


def is_code_block(block) -> bool:
    fmt = block.blockFormat()
    return fmt.hasProperty(QTextFormat.Property.BlockCodeFence) or fmt.hasProperty(
        QTextFormat.Property.BlockCodeLanguage)


def source_offsets(shown: str, source: str, start: int) -> tuple[list[int], int]:
    """For each character of `shown` (one rendered block's text), the index in `source` of the
    character it shows, or -1 where none does (an entity's decoded character); and where the
    next block's search starts. Greedy and in order: a rendered block is its source less the
    markup, with soft line breaks shown as spaces."""
    at = source.find(shown, start, start + len(shown) + SEARCH_WINDOW) if len(shown) >= CONFIRM else -1
    if at >= 0:                               # the common case: the block's text as typed
        return list(range(at, at + len(shown))), at + len(shown)
    offsets, j, end = [], start, len(source)
    for i, ch in enumerate(shown):
        if j < end and source[j] == ch:
            k = j
        elif ch.isspace():
            found = _SPACE.search(source, j, j + SEARCH_WINDOW)
            k = found.start() if found else -1
        else:
            k = source.find(ch, j, j + SEARCH_WINDOW)
            if k < 0:
                k = source.find(shown[i:i + CONFIRM], j)
        offsets.append(k)
        if k >= 0:
            j = k + 1
    return offsets, j


@dataclass
class _Item:
    """One top-level block or table of a render, as copied into the transcript."""
    signature: tuple
    start: int                  # transcript position where its copy begins
    formats: tuple              # the block there before the copy: its block and char formats
    searched_to: int            # the copy's state before it: where the source search resumes,
    kind: str                   # the kind of the last character matched,
    lists: dict                 # and the lists made so far (source list's object index -> ours)


class RenderedReply:
    """A reply rendered into the transcript from `start`; render() again as it grows."""

    def __init__(self, start: int):
        self.end = start                        # where the copy ends in the transcript
        self.items: list[_Item] = []
        self._after = (0, "target", {})         # the copy's state after the last item

    def render(self, cursor: QTextCursor, reply: ReplyText) -> None:
        """Bring the transcript's copy up to `reply`; `cursor` (any, in the transcript) ends
        after it. Blocks whose rendering did not change are left as they are."""
        source = QTextDocument()
        source.setMarkdown(reply.text, FEATURES)
        new = _top_level(source)
        keep = 0
        while keep < min(len(new), len(self.items)) and new[keep][1] == self.items[keep].signature:
            keep += 1
        if keep == len(new) == len(self.items):
            cursor.setPosition(self.end)
            return
        cursor.setPosition(self.items[keep].start if keep < len(self.items) else self.end)
        cursor.setPosition(self.end, QTextCursor.MoveMode.KeepAnchor)
        cursor.removeSelectedText()
        if keep < len(self.items):          # the block it was copied after may take a removed block's format
            cursor.setBlockFormat(self.items[keep].formats[0])
            cursor.setBlockCharFormat(self.items[keep].formats[1])
        searched_to, kind, lists = ((self.items[keep].searched_to, self.items[keep].kind, self.items[keep].lists)
                                    if keep < len(self.items) else self._after)
        copy = _Copy(cursor, reply, searched_to, kind, dict(lists))
        del self.items[keep:]
        for item, signature in new[keep:]:
            self.items.append(_Item(signature, cursor.position(), (cursor.blockFormat(), cursor.blockCharFormat()),
                                    copy.searched_to, copy.kind, dict(copy.lists)))
            copy.item(item)
        self.end = cursor.position()
        self._after = (copy.searched_to, copy.kind, dict(copy.lists))


def insert_rendered(cursor: QTextCursor, reply: ReplyText) -> RenderedReply:
    """The reply's Markdown rendered, from a new block at `cursor`; the cursor ends after it."""
    rendered = RenderedReply(cursor.position())
    rendered.render(cursor, reply)
    return rendered


def _top_level(document: QTextDocument) -> list[tuple[object, tuple]]:
    """(block or table, signature) for each top-level item of a rendered document; the
    signature is equal between two renders exactly where the item renders the same."""
    items, after_table = [], False
    it = document.rootFrame().begin()
    while not it.atEnd():
        child = it.currentFrame()
        if isinstance(child, QTextTable):
            items.append((child, _table_signature(child)))
            after_table = True
        elif child is None:
            block = it.currentBlock()
            if not (after_table and block.text() == ""):        # the empty block after a table: ours has one
                items.append((block, _block_signature(block)))
            after_table = False
        it += 1
    return items


def _block_signature(block) -> tuple:
    source_list = block.textList()
    in_list = (source_list.format(), source_list.itemNumber(block)) if source_list is not None else None
    runs = tuple((run.start, run.length, QTextCharFormat(run.format)) for run in block.textFormats())
    return block.text(), block.blockFormat(), in_list, runs


def _table_signature(table: QTextTable) -> tuple:
    cells = tuple(_block_signature(block) for row in range(table.rows()) for column in range(table.columns())
                  for block in _cell_blocks(table.cellAt(row, column)))
    return "table", table.rows(), table.columns(), table.format(), cells


class _Copy:
    """Copies a rendered document's top-level items to a cursor in the transcript, colouring
    each character by its token kind."""

    def __init__(self, cursor: QTextCursor, reply: ReplyText, searched_to: int, kind: str, lists: dict):
        self.cursor, self.reply = cursor, reply
        self.searched_to = searched_to        # where the next block's source text is looked for
        self.kind = kind                      # of the last character matched
        self.lists = lists                    # the source list's object index -> ours
        self.formats: dict[tuple[int, str, bool], QTextCharFormat] = {}

    def item(self, item) -> None:
        if isinstance(item, QTextTable):
            self.table(item)
        else:
            self.cursor.insertBlock(self._block_format(item), item.charFormat())
            self._into_list(item)
            self.fragments(item, self.cursor)

    def table(self, table: QTextTable) -> None:
        fmt = table.format()
        fmt.setBorder(1)
        fmt.setBorderBrush(QColor(MUTED_COLOUR))
        fmt.setBorderCollapse(True)
        fmt.setCellPadding(3)
        fmt.setCellSpacing(0)
        fmt.setTopMargin(SPACE_AROUND)
        fmt.setBottomMargin(SPACE_AROUND)
        ours = self.cursor.insertTable(table.rows(), table.columns(), fmt)
        for row in range(table.rows()):
            for column in range(table.columns()):
                into = ours.cellAt(row, column).firstCursorPosition()
                # A cell keeps its text and alignment only: after a code block, Qt's reader gives
                # a table's first cell an empty block and a paragraph's format, and drops its bold
                # (row 0 is GitHub's header row, bold in every cell).
                for number, block in enumerate(_cell_blocks(table.cellAt(row, column))):
                    cell_format = QTextBlockFormat()
                    cell_format.setAlignment(block.blockFormat().alignment())
                    if number:
                        into.insertBlock(cell_format)
                    else:
                        into.setBlockFormat(cell_format)
                    self.fragments(block, into, bold=row == 0)
        self.cursor.setPosition(ours.lastPosition() + 1)         # the block Qt keeps after a table

    def fragments(self, block, cursor: QTextCursor, bold: bool = False) -> None:
        text = block.text()
        offsets, self.searched_to = source_offsets(text, self.reply.text, self.searched_to)
        char_kinds, kinds = self.reply.char_kinds, []
        if offsets and offsets[-1] - offsets[0] == len(offsets) - 1 and min(offsets[0], offsets[-1]) >= 0:
            kinds = char_kinds[offsets[0]:offsets[-1] + 1]      # matched as typed: one slice
            self.kind = kinds[-1]
        else:
            for offset in offsets:
                if offset >= 0:
                    self.kind = char_kinds[offset]
                kinds.append(self.kind)
        it = block.begin()
        while not it.atEnd():
            fragment = it.fragment()
            if fragment.isValid():
                start = fragment.position() - block.position()
                self._insert(cursor, fragment, kinds[start:start + fragment.length()], bold)
            it += 1

    def _insert(self, cursor: QTextCursor, fragment, kinds: list[str], bold: bool = False) -> None:
        text, fmt, index = fragment.text(), fragment.charFormat(), fragment.charFormatIndex()
        if fmt.isImageFormat():                     # shown as text, never loaded
            text, fmt, index = f"[image: {fmt.toImageFormat().name()}]", QTextCharFormat(), -1
            kinds = kinds[:1] * len(text)
        start = 0
        for kind, group in groupby(kinds):
            length = sum(1 for _ in group)
            cursor.insertText(text[start:start + length], self._format(fmt, index, kind, bold))
            start += length

    def _format(self, fmt: QTextCharFormat, index: int, kind: str, bold: bool) -> QTextCharFormat:
        """The rendered fragment's format (by its index in the rendered document) in `kind`'s colours."""
        key = (index, kind, bold)
        cached = self.formats.get(key)
        if cached is None:
            cached = QTextCharFormat(fmt)
            cached.clearProperty(QTextFormat.Property.ObjectIndex)
            if bold:
                cached.setFontWeight(QFont.Weight.Bold)
            if cached.fontFamilies() and "monospace" in cached.fontFamilies():
                cached.setFont(_monospace(), QTextCharFormat.FontPropertiesInheritanceBehavior.FontPropertiesSpecifiedOnly)
                cached.setFontFixedPitch(True)
            cached.merge(token_format(kind))
            self.formats[key] = cached
        return cached

    def _block_format(self, block) -> QTextBlockFormat:
        fmt = block.blockFormat()
        fmt.clearProperty(QTextFormat.Property.ObjectIndex)     # the list it was in: _into_list
        if is_code_block(block):
            fmt.setBackground(QColor(CODE_BACKGROUND))
            fmt.setLeftMargin(fmt.leftMargin() + CODE_MARGIN)
            fmt.setRightMargin(fmt.rightMargin() + CODE_MARGIN)
            if not (block.previous().isValid() and is_code_block(block.previous())):
                fmt.setTopMargin(max(fmt.topMargin(), SPACE_AROUND))       # the box's first line
        return fmt

    def _into_list(self, block) -> None:
        source_list = block.textList()
        if source_list is None:
            return
        ours = self.lists.get(source_list.objectIndex())
        if ours is None:
            self.lists[source_list.objectIndex()] = self.cursor.createList(source_list.format())
        else:
            ours.add(self.cursor.block())


def _cell_blocks(cell) -> list:
    """A table cell's blocks that hold text."""
    blocks, block = [], cell.firstCursorPosition().block()
    while block.isValid() and block.position() <= cell.lastPosition():
        if block.text():
            blocks.append(block)
        block = block.next()
    return blocks


def _reply_block_format() -> QTextBlockFormat:
    fmt = QTextBlockFormat()
    fmt.setTopMargin(2)
    return fmt


def _monospace():
    return QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont)
