"""Suffix index: where the context's last tokens occurred before in some text, and what followed.

Suffix decoding (Arctic Inference's SuffixDecoding, arXiv 2411.04975) asks one question each
step: what is the longest suffix of the context that occurs in this text, and how often did
each continuation follow it? A suffix tree answers it from counts on its nodes (a node's count
is the number of suffixes of the text that pass through it). This index answers the same
question from the tokens themselves, which is cheap to keep up to date in Python:

  - the text is one token array, documents one after another with a SEPARATOR between them
    (so no match and no continuation crosses from one document into the next);
  - every position is filed under its token and under the pair (previous token, token): the
    candidates for a match are the recent positions of the context's last pair (or last token);
  - a candidate's match length is how far back the text agrees with the context, computed for
    every candidate at once (numpy, at most `max_match` tokens back);
  - the continuations of a match are the `depth` tokens after each of its occurrences: the
    number of occurrences whose continuation starts with a path is that path's count in the
    suffix tree.

Appending a token is O(1) (two dict appends and a store), so an index grows with its request
and is never rebuilt while it grows. The `max_occurrences` most recent positions of the last
pair are looked at: a very common pair's counts are those of its recent occurrences.

A bounded index (`max_tokens`, the global one) evicts whole documents, oldest first, when one
is added; evicted positions are filtered out of lookups, and the array and its files are
rebuilt from the live documents once the dead part is as large as the live one (amortised
O(1) per token).
"""
from __future__ import annotations

from array import array
from collections import deque
from dataclasses import dataclass

import numpy as np

SEPARATOR = -1              # between documents, and past the end: never a token
MAX_MATCH = 32              # how many context tokens a match may span
MAX_OCCURRENCES = 256       # recent occurrences of the last pair (or token) looked at


@dataclass
class Match:
    """Occurrences of the context's suffix: each occurrence's last position and how many
    tokens of the context it matches (at least 1), most recent last."""
    positions: np.ndarray       # [C] int64, absolute positions in the index
    lengths: np.ndarray         # [C] int64

    def __len__(self) -> int:
        return len(self.positions)

    @property
    def longest(self) -> int:
        return int(self.lengths.max()) if len(self.lengths) else 0


class SuffixIndex:
    def __init__(self, max_tokens: int | None = None, max_match: int = MAX_MATCH,
                 max_occurrences: int = MAX_OCCURRENCES):
        self.max_tokens, self.max_match, self.max_occurrences = max_tokens, max_match, max_occurrences
        self._clear()

    def _clear(self) -> None:
        self._buf = np.full(1024, SEPARATOR, dtype=np.int64)   # positions base..; past `end`: SEPARATOR
        self._base = 0                  # the absolute position of _buf[0]
        self.start = 0                  # the first live position (older ones were evicted)
        self.end = 0                    # one past the last token
        self._doc_start = 0             # the open document's first position
        self._last: int | None = None   # the open document's last token
        self._by_token: dict[int, array] = {}
        self._by_pair: dict[int, array] = {}
        self.documents: deque[tuple[int, int]] = deque()       # closed documents' [start, end)
        self._closed_tokens = 0         # tokens in `documents`

    # ---- growing ---------------------------------------------------------------------
    def extend(self, tokens) -> None:
        """Append tokens to the open document."""
        need = self.end + len(tokens) + 1 - self._base
        if need > len(self._buf):
            grown = np.full(max(need, 2 * len(self._buf)), SEPARATOR, dtype=np.int64)
            grown[:len(self._buf)] = self._buf
            self._buf = grown
        buf, base, last = self._buf, self._base, self._last
        by_token, by_pair = self._by_token, self._by_pair
        p = self.end
        for t in tokens:
            t = int(t)
            buf[p - base] = t
            by_token.setdefault(t, array("q")).append(p)
            if last is not None:
                by_pair.setdefault(last << 32 | t, array("q")).append(p)
            last, p = t, p + 1
        self._last, self.end = last, p

    def add_document(self, tokens) -> None:
        """A whole document (a finished request's output): appended, closed, and then the
        oldest documents evicted while the live tokens exceed max_tokens."""
        self.extend(tokens)
        self.close_document()
        self.evict()

    def close_document(self) -> None:
        if self.end > self._doc_start:
            self.documents.append((self._doc_start, self.end))
            self._closed_tokens += self.end - self._doc_start
            self.end += 1                                       # the SEPARATOR's position
        self._doc_start, self._last = self.end, None

    @property
    def num_tokens(self) -> int:
        """Live tokens (separators not counted)."""
        return self._closed_tokens + self.end - self._doc_start

    def evict(self) -> None:
        """Drop the oldest closed documents until at most max_tokens tokens are live."""
        if self.max_tokens is None:
            return
        while self.documents and self.num_tokens > self.max_tokens:
            s, e = self.documents.popleft()
            self._closed_tokens -= e - s
            self.start = self.documents[0][0] if self.documents else self._doc_start
        if self.start - self._base > max(self.end - self.start, 1024):
            self._compact()

    def _compact(self) -> None:
        """Rebuild from the live documents (their positions renumbered from 0)."""
        docs = [self._buf[s - self._base:e - self._base].tolist() for s, e in self.documents]
        max_tokens = self.max_tokens
        self._clear()
        self.max_tokens = max_tokens
        for doc in docs:
            self.extend(doc)
            self.close_document()

    def clear(self) -> None:
        self._clear()

    # ---- asking ----------------------------------------------------------------------
    def tokens(self, start: int, stop: int) -> list[int]:
        return self._buf[start - self._base:stop - self._base].tolist()

    def match(self, context: list[int], before: int | None = None) -> Match:
        """The recent occurrences of the context's last pair (else its last token) that end
        before position `before` (None: anywhere), with their match lengths."""
        if not context:
            return _NO_MATCH
        last = int(context[-1])
        found = None
        if len(context) >= 2:
            found = self._live(self._by_pair.get(int(context[-2]) << 32 | last), before)
        if found is None:
            found = self._live(self._by_token.get(last), before)
        if found is None:
            return _NO_MATCH
        tail = np.asarray(context[-self.max_match:], dtype=np.int64)[::-1]          # [L], last token first
        back = found[:, None] - np.arange(len(tail))[None, :]                      # [C, L] absolute
        seen = np.where(back >= self.start, self._buf[np.maximum(back - self._base, 0)], SEPARATOR)
        agree = np.logical_and.accumulate(seen == tail[None, :], axis=1)
        return Match(found, agree.sum(axis=1))

    def _live(self, positions: array | None, before: int | None) -> np.ndarray | None:
        if not positions:
            return None
        found = np.frombuffer(positions[-self.max_occurrences:], dtype=np.int64)
        keep = found >= self.start
        if before is not None:
            keep &= found < before
        found = found[keep]
        return found if len(found) else None

    def following(self, positions: np.ndarray, depth: int) -> np.ndarray:
        """[C, depth]: the tokens after each position, SEPARATOR from a document's end on."""
        ahead = positions[:, None] + 1 + np.arange(depth)[None, :] - self._base
        out = self._buf[np.minimum(ahead, len(self._buf) - 1)]
        ended = np.logical_or.accumulate((out == SEPARATOR) | (ahead >= self.end - self._base), axis=1)
        out[ended] = SEPARATOR
        return out


_NO_MATCH = Match(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
