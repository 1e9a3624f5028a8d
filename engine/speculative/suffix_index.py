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
  - a candidate's match length is how far back the text agrees with the context (at most
    `max_match` tokens back);
  - the continuations of a match are the `depth` tokens after each of its occurrences: the
    number of occurrences whose continuation starts with a path is that path's count in the
    suffix tree.

Appending a token is O(1) (two dict appends and a store), so an index grows with its request
and is never rebuilt while it grows. The `max_occurrences` most recent positions of the last
pair are looked at: a very common pair's counts are those of its recent occurrences. Tokens and
positions are kept in typed arrays (8 bytes each). A lookup is plain Python over the few
candidates a pair has: it costs what the candidates' match lengths add up to, a few
microseconds, where numpy's fixed cost per call (several microseconds on a busy 2-core CPU,
times the ten calls a vectorised lookup needs) was six times slower (measured on the default
model's tokens).

A bounded index (`max_tokens`, the global one) evicts whole documents, oldest first, when one
is added; evicted positions are filtered out of lookups, and the array and its files are
rebuilt from the live documents once the dead part is as large as the live one (amortised
O(1) per token).
"""
from __future__ import annotations

from array import array
from collections import deque
from dataclasses import dataclass

SEPARATOR = -1              # between documents: never a token
MAX_MATCH = 32              # how many context tokens a match may span
MAX_OCCURRENCES = 256       # recent occurrences of the last pair (or token) looked at


@dataclass
class Match:
    """Occurrences of the context's suffix: each occurrence's last position and how many
    tokens of the context it matches (at least 1), oldest first."""
    positions: list[int]        # absolute positions in the index
    lengths: list[int]

    def __len__(self) -> int:
        return len(self.positions)

    @property
    def longest(self) -> int:
        return max(self.lengths, default=0)


class SuffixIndex:
    def __init__(self, max_tokens: int | None = None, max_match: int = MAX_MATCH,
                 max_occurrences: int = MAX_OCCURRENCES):
        self.max_tokens, self.max_match, self.max_occurrences = max_tokens, max_match, max_occurrences
        self._clear()

    def _clear(self) -> None:
        self._tokens = array("q")        # position p is _tokens[p - _base]; SEPARATOR after each document
        self._base = 0                   # the absolute position of _tokens[0]
        self.start = 0                   # the first live position (older ones were evicted)
        self._doc_start = 0              # the open document's first position
        self._last: int | None = None    # the open document's last token
        self._by_token: dict[int, array] = {}
        self._by_pair: dict[int, array] = {}
        self.documents: deque[tuple[int, int]] = deque()       # closed documents' [start, end)
        self._closed_tokens = 0          # tokens in `documents`

    @property
    def end(self) -> int:
        """One past the last position."""
        return self._base + len(self._tokens)

    # ---- growing ---------------------------------------------------------------------
    def extend(self, tokens) -> None:
        """Append tokens to the open document."""
        store, by_token, by_pair = self._tokens, self._by_token, self._by_pair
        last, p = self._last, self.end
        for t in tokens:
            t = int(t)
            store.append(t)
            by_token.setdefault(t, array("q")).append(p)
            if last is not None:
                by_pair.setdefault(last << 32 | t, array("q")).append(p)
            last, p = t, p + 1
        self._last = last

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
            self._tokens.append(SEPARATOR)
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
        docs = [self.tokens(s, e) for s, e in self.documents]
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
        return self._tokens[start - self._base:stop - self._base].tolist()

    def match(self, context: list[int], before: int | None = None) -> Match:
        """The recent occurrences of the context's last pair (else its last token) that end
        before position `before` (None: anywhere), with their match lengths."""
        if not context:
            return Match([], [])
        last = int(context[-1])
        found = None
        if len(context) >= 2:
            found = self._live(self._by_pair.get(int(context[-2]) << 32 | last), before)
        if not found:
            found = self._live(self._by_token.get(last), before)
        if not found:
            return Match([], [])
        tail = context[:-self.max_match - 1:-1]                   # the last token first
        store, base, start = self._tokens, self._base, self.start
        lengths = []
        for p in found:
            n, limit = 0, min(len(tail), p - start + 1)          # never back into evicted text
            i = p - base
            while n < limit and store[i - n] == tail[n]:          # a SEPARATOR never equals a token
                n += 1
            lengths.append(n)
        return Match(found, lengths)

    def _live(self, positions: array | None, before: int | None) -> list[int]:
        if not positions:
            return []
        recent = positions[-self.max_occurrences:].tolist()
        if recent[0] < self.start or (before is not None and recent[-1] >= before):
            stop = before if before is not None else self.end
            recent = [p for p in recent if self.start <= p < stop]
        return recent

    def following(self, positions: list[int], depth: int) -> list[list[int]]:
        """The tokens after each position, at most `depth`, up to the end of its document."""
        store, base, out = self._tokens, self._base, []
        for p in positions:
            ahead = store[p + 1 - base:p + 1 + depth - base].tolist()
            if SEPARATOR in ahead:
                ahead = ahead[:ahead.index(SEPARATOR)]
            out.append(ahead)
        return out
