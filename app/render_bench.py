"""What drawing a streaming reply costs in the chat view: a Markdown reply streamed token by
token into a real ChatView (offscreen), drawn again whole after every token.

    QT_QPA_PLATFORM=offscreen python -m app.render_bench [--tokens 500] [--json]

Prints the milliseconds a redraw takes at the reply's end (the dearest: a redraw covers the
whole reply) and on average, the tokens per second the view keeps up with when it redraws
after every token (1000 / the redraw at the end), and the same for the raw view, which only
appends. Tokens are 4 characters of a reply with a heading, emphasis, lists, a table and
code blocks, a third of them coloured as accepted draft tokens (the colouring is part of the
cost). The chat view itself spends at most RENDER_SHARE of the GUI thread on redraws, so a
reply longer than this keeps up by redrawing less often; these figures say when that starts.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from PySide6.QtWidgets import QApplication

from app.chat_view import RENDER_SHARE, ChatView

REPLY = """## Writing clear documentation

Here are **three tips** that make *any* page easier to read:

1. **Know your reader.** Say who the page is for and what they will be able to do after it.
2. **Lead with the task.** Put the command first, then explain it:
   - what it does,
   - what it prints.
3. **Show, then tell.** A short example beats a long paragraph.

| tip | why it helps |
|---|---|
| one idea per paragraph | readers skim |
| `code` in monospace | it is copied, not read |

```python
def greet(name: str) -> str:
    \"\"\"Return a greeting for `name`.\"\"\"
    return f"Hello, {name}!"
```

> Keep sentences short; cut every word that does not earn its place.

"""
TOKEN_CHARS = 4
ACCEPTED_SHARE = 1 / 3


def tokens(count: int, seed: int = 0) -> list[tuple[str, str]]:
    """`count` (text, kind) pieces of the sample reply, repeated as needed."""
    rng = random.Random(seed)
    text = REPLY * (count * TOKEN_CHARS // len(REPLY) + 1)
    return [(text[i * TOKEN_CHARS:(i + 1) * TOKEN_CHARS], "accepted" if rng.random() < ACCEPTED_SHARE else "target")
            for i in range(count)]


def stream(view: ChatView, pieces: list[tuple[str, str]], raw: bool) -> list[float]:
    """Seconds each token took to show, drawn after every token (no redraw skipped)."""
    view.clear_transcript()
    view.set_raw(raw)
    view.add_user_message("Give me three tips for writing clear documentation.")
    view.begin_assistant_message()
    spent = []
    for piece in pieces:
        started = time.perf_counter()
        view.append_segments([piece])
        QApplication.processEvents()        # the layout and paint the user sees
        spent.append(time.perf_counter() - started)
    view.finish_assistant_message("done")
    return spent


def run(count: int) -> dict:
    app = QApplication.instance() or QApplication([])
    view = ChatView()
    view.resize(900, 700)
    view.show()
    view.render_share = 1.0                  # drawn again after every token, none skipped
    pieces = tokens(count)
    out = {"tokens": count, "reply_chars": sum(len(text) for text, _ in pieces), "render_share": RENDER_SHARE}
    for name, raw in (("rendered", False), ("raw", True)):
        spent = stream(view, pieces, raw)
        tail = spent[-max(1, count // 10):]
        end_ms = statistics.median(tail) * 1000
        out[name] = {"ms_per_token_mean": round(statistics.fmean(spent) * 1000, 3),
                     "ms_per_token_at_end": round(end_ms, 3),
                     "tok_s_at_end": round(1000 / end_ms, 1)}
    view.close()
    app.processEvents()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=500)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    result = run(args.tokens)
    print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
