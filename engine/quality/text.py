"""The quality measurement's tokens: a text the project ships (resources/quality/reference_text.txt,
the first topics of Python's pydoc documentation, fixed so that figures compare across machines
and Python versions; checked against its SHA-256), and optionally the chat so far."""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from engine.errors import WorkbenchError
from resources import QUALITY_TEXT

QUALITY_TEXT_FILE = QUALITY_TEXT
# the shipped text's digest: a changed or damaged file is refused (its figures would not compare)
QUALITY_TEXT_SHA256 = "e2dde11bd3b1edecc32ffe66c513c520efb6dd430ae927090e0309ab7f08bfd4"


class QualityTextError(WorkbenchError):
    """The reference text is missing, unreadable or not the one shipped."""


def reference_text(path: Path | None = None, check_digest: bool | None = None) -> str:
    """The reference text: the shipped one (checked against its digest), or the file given."""
    check = path is None if check_digest is None else check_digest
    path = Path(path or QUALITY_TEXT_FILE)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise QualityTextError(f"the quality reference text {path} cannot be read ({exc.strerror or exc}); "
                               "reinstall the workbench to restore it") from exc
    if check and hashlib.sha256(data).hexdigest() != QUALITY_TEXT_SHA256:
        raise QualityTextError(f"the quality reference text {path} is not the one shipped (its SHA-256 differs), "
                               "so its figures would not compare with anyone's; reinstall the workbench to restore it")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise QualityTextError(f"the quality reference text {path} is not UTF-8 text ({exc.reason} at byte "
                               f"{exc.start}); reinstall the workbench to restore it") from exc


def text_ids(tokenizer, tokens: int, chat_ids: list[int] | None = None) -> tuple[list[list[int]], dict]:
    """The sequences scored: the shipped text's first tokens + 1 (each predicts the next), then
    the chat so far as its own sequence; and what they are."""
    ids = tokenizer.encode(reference_text(), add_special_tokens=False)[:tokens + 1]
    if len(ids) < 2:
        raise QualityTextError(f"the quality reference text {QUALITY_TEXT_FILE} holds no tokens to score")
    sequences = [ids] + ([chat_ids] if chat_ids and len(chat_ids) > 1 else [])
    digest = hashlib.sha256(np.asarray([t for s in sequences for t in s], dtype="<i4").tobytes()).hexdigest()
    return sequences, {"source": "shipped text" + (" + the chat so far" if len(sequences) > 1 else ""),
                       "file": QUALITY_TEXT_FILE.name, "tokens": sum(len(s) - 1 for s in sequences),
                       "sha256": digest}
