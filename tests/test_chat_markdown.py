"""Replies in the chat read as a chat app shows them: their Markdown rendered (emphasis,
lists, headings, tables, code blocks in a monospace box), every token still coloured by
where it came from, and the text as the model typed it one click away ("Raw text").

The chat view alone (pytest-qt, offscreen), fed (text, kind) pieces as the controller feeds
it a reply's steps."""
import difflib

import pytest
from PySide6.QtGui import QFontInfo, QTextCharFormat, QTextFormat

from app.chat_view import ChatView, code_block_text
from app.reply_markdown import is_code_block

# A reply as a model streams it: (text, kind) per token. The accepted draft tokens are words
# (no markup), so what is coloured as accepted after rendering must be exactly their text.
REPLY = [
    ("## Three", "target"), (" tips\n\n", "target"),
    ("Here are ", "target"), ("**", "target"), ("three", "accepted"), (" tips", "accepted"), ("**", "target"),
    (" for *", "target"), ("clear", "bonus"), ("* docs:\n\n", "target"),
    ("1. ", "target"), ("Know", "accepted"), (" your", "accepted"), (" reader\n", "target"),
    ("2. ", "target"), ("Lead", "resampled"), (" with the task\n", "target"),
    ("3. ", "target"), ("Show", "accepted"), (", then tell\n\n", "target"),
    ("```python\n", "target"), ("def", "accepted"), (" greet", "accepted"), ("(name):\n", "target"),
    ("    return", "accepted"), (" f\"Hi {name}\"\n", "target"), ("```\n\n", "target"),
    ("| tip | why |\n|---|---|\n| short", "target"), (" lines", "accepted"), (" | skimmed |\n\n", "target"),
    ("That", "bonus"), ("'s all.", "target"),
]
TEXT = "".join(text for text, _ in REPLY)
# Everything a reply may hold, streamed 3 characters a token: nested and loose lists, a quote,
# a rule, a link, a table that grows row by row, a code block with a blank line in it.
RICH = """# Notes

Read [the guide](https://example.com/a/rather/long/path/to/the/guide) and `run()` it.

- one
  - one point one
- two

1. first

2. second

> quoted *text*

---

| a | b |
|:--|--:|
| 1 | **2** |
| 3 | 4 |

```
x = 1

y = 2
```
Done &amp; dusted.
"""
RICH_TOKENS = [(RICH[i:i + 3], ("target", "accepted", "bonus")[i % 7 % 3]) for i in range(0, len(RICH), 3)]


@pytest.fixture
def chat(qtbot):
    view = ChatView()
    qtbot.addWidget(view)
    view.resize(800, 900)
    view.show()
    return view


def stream(chat: ChatView, pieces=REPLY, stats: str = "TTFT 12 ms · decode 150 tok/s") -> None:
    chat.add_user_message("Give me three tips for writing clear documentation.")
    chat.begin_assistant_message()
    for piece in pieces:
        chat.append_segments([piece])
    chat.finish_assistant_message(stats)


def blocks(chat: ChatView):
    block = chat.transcript.document().begin()
    while block.isValid():
        yield block
        block = block.next()


def reply_blocks(chat: ChatView):
    """The blocks after the last "Assistant" header."""
    found = list(blocks(chat))
    last_header = max(i for i, b in enumerate(found) if b.text() == "Assistant")
    return found[last_header + 1:]


def fragments(block):
    it = block.begin()
    while not it.atEnd():
        if it.fragment().isValid():
            yield it.fragment()
        it += 1


def kind(fragment) -> str | None:
    return fragment.charFormat().property(QTextCharFormat.Property.UserProperty)


def block_with(chat: ChatView, text: str):
    return next(b for b in reply_blocks(chat) if b.text() == text)


def fragment_with(chat: ChatView, text: str):
    return next(f for b in reply_blocks(chat) for f in fragments(b) if text in f.text())


def test_a_reply_renders_its_emphasis_heading_list_table_and_code_block(chat):
    stream(chat)
    shown = chat.transcript.toPlainText()
    assert "**" not in shown and "```" not in shown and "## " not in shown and "1. " not in shown
    assert block_with(chat, "Three tips").blockFormat().headingLevel() == 2
    assert fragment_with(chat, "three").charFormat().fontWeight() == 700             # **three tips**
    assert fragment_with(chat, "clear").charFormat().fontItalic()                     # *clear*
    items = [block_with(chat, t) for t in ("Know your reader", "Lead with the task", "Show, then tell")]
    assert all(b.textList() is not None for b in items)
    assert [b.textList().itemText(b) for b in items] == ["1.", "2.", "3."]
    code = [block_with(chat, "def greet(name):"), block_with(chat, '    return f"Hi {name}"')]
    for block in code:                                       # a monospace box: code font, shaded block
        assert is_code_block(block) and block.blockFormat().background().style() != 0
        for fragment in fragments(block):
            assert QFontInfo(fragment.charFormat().font()).fixedPitch()
    assert not QFontInfo(fragment_with(chat, "Here are").charFormat().font()).fixedPitch()
    assert code_block_text(code[1]) == 'def greet(name):\n    return f"Hi {name}"'    # "Copy code block"
    header, cell = block_with(chat, "tip"), block_with(chat, "short lines")    # a table after a code block
    assert _in_table(chat, header) and _in_table(chat, cell)
    assert [f.charFormat().fontWeight() for f in fragments(header)] == [700]          # its header row bold
    assert {f.charFormat().fontWeight() for f in fragments(cell)} == {400}
    assert shown.splitlines()[-1] == "TTFT 12 ms · decode 150 tok/s"                 # the stats line last


def _in_table(chat: ChatView, block) -> bool:
    from PySide6.QtGui import QTextCursor
    return QTextCursor(block).currentTable() is not None


def test_draft_colouring_survives_rendering_token_for_token(chat):
    stream(chat)
    for token_kind in ("accepted", "bonus", "resampled"):
        coloured = "".join(f.text() for b in blocks(chat) for f in fragments(b) if kind(f) == token_kind)
        assert coloured == "".join(text for text, k in REPLY if k == token_kind)
    assert kind(fragment_with(chat, "three")) == "accepted" and kind(fragment_with(chat, "Here are")) == "target"
    accepted_code = [f for f in fragments(block_with(chat, "def greet(name):")) if kind(f) == "accepted"]
    assert accepted_code and all(QFontInfo(f.charFormat().font()).fixedPitch() for f in accepted_code)
    bold_accepted = fragment_with(chat, "three")
    assert bold_accepted.charFormat().fontWeight() == 700 and bold_accepted.charFormat().background().color().name() \
        == "#d1f5d9"                                         # both: the emphasis and the draft's colour


def test_every_rendered_character_has_the_colour_of_the_token_it_came_from(chat):
    """Checked against an alignment made another way (difflib's longest matching runs)."""
    stream(chat, RICH_TOKENS)
    shown, kinds = "", []
    for block in reply_blocks(chat)[:-1]:                 # the last is the stats line
        for fragment in fragments(block):
            shown += fragment.text()
            kinds += [kind(fragment)] * fragment.length()
    source_kinds = [k for text, k in RICH_TOKENS for _ in text]
    matcher = difflib.SequenceMatcher(None, shown, RICH, autojunk=False)
    checked = 0
    for match in matcher.get_matching_blocks():
        if match.size >= 3:
            assert kinds[match.a:match.a + match.size] == source_kinds[match.b:match.b + match.size], \
                shown[match.a:match.a + match.size]
            checked += match.size
    assert checked >= 0.9 * len(shown.replace(" ", ""))


def test_the_raw_view_shows_the_reply_as_typed_still_coloured_and_back(chat, qtbot):
    stream(chat)
    rendered = chat.transcript.toPlainText()
    chat.raw_toggle.click()
    assert chat.raw and chat.transcript.raw_action.isChecked()
    shown = chat.transcript.toPlainText()
    assert TEXT in shown and shown.startswith("You\nGive me three tips")
    coloured = "".join(f.text() for b in blocks(chat) for f in fragments(b) if kind(f) == "accepted")
    assert coloured == "".join(text for text, k in REPLY if k == "accepted")
    chat.transcript.raw_action.trigger()                     # the context menu's action: rendered again
    assert not chat.raw_toggle.isChecked()
    assert chat.transcript.toPlainText() == rendered


@pytest.mark.parametrize("tokens", [REPLY, RICH_TOKENS], ids=["words", "rich"])
def test_a_reply_streamed_token_by_token_renders_as_the_whole_reply_at_once(qtbot, tokens):
    """Each redraw copies again only the blocks that changed: the result must be the same
    document a single render of the finished reply gives, at every step of the stream."""
    def look(block):            # its format, less the list's object id (a list drawn again is a new object)
        fmt = block.blockFormat()
        fmt.clearProperty(QTextFormat.Property.ObjectIndex)
        return fmt

    def snapshot(view):
        return [(b.text(), look(b), b.textList() and (b.textList().format(), b.textList().itemText(b)),
                 [(f.text(), f.charFormat()) for f in fragments(b)]) for b in blocks(view)]

    streamed, whole = ChatView(), ChatView()
    for view in (streamed, whole):
        qtbot.addWidget(view)
        view.render_share = 1.0                              # redrawn after every token
        view.begin_assistant_message()
    for count, piece in enumerate(tokens, start=1):
        streamed.append_segments([piece])
        whole.clear_transcript()
        whole.begin_assistant_message()
        whole.append_segments(tokens[:count])
        assert snapshot(streamed) == snapshot(whole), f"after {count} tokens"


def test_the_end_of_a_reply_is_drawn_even_when_a_redraw_was_waiting(chat):
    chat.render_share = 1e-6                                 # every redraw but the first waits
    chat.begin_assistant_message()
    chat.append_segments(REPLY[:1])
    chat.append_segments(REPLY[1:])
    assert "Here are" not in chat.transcript.toPlainText()  # not drawn yet: waiting for its turn
    chat.finish_assistant_message("done")
    assert "Here are three tips for clear docs:" in chat.transcript.toPlainText()


def test_a_reply_cannot_load_an_image_or_inject_html(chat):
    stream(chat, [("See ![secret](/etc/passwd) and <img src='/etc/hostname'><b>bold?</b>", "target")])
    shown = chat.transcript.toPlainText()
    assert "[image: /etc/passwd]" in shown and "<img src='/etc/hostname'><b>bold?</b>" in shown
    for block in blocks(chat):
        for fragment in fragments(block):
            assert not fragment.charFormat().isImageFormat()
            assert fragment.charFormat().objectType() == QTextFormat.ObjectTypes.NoObject
