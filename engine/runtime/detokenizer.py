"""Incremental detokenization: the text each new token adds, decoded once, in the engine.

Each token's text is decoded over a short window of left context (tokenizers that drop a
leading space at the start of a decode would otherwise lose it). A token that ends in an
incomplete UTF-8 sequence adds nothing yet; its bytes appear with the token that
completes the character, in that token's kind.
"""
from __future__ import annotations

CONTEXT_TOKENS = 4


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def push(self, tokens: list[int], kinds: list[str], final: bool = False) -> list[tuple[str, str]]:
        """The new text as (text, kind) runs; adjacent tokens of one kind share a run."""
        runs: list[tuple[str, str]] = []
        for i, (token, kind) in enumerate(zip(tokens, kinds)):
            text = self._push_one(token, final and i == len(tokens) - 1)
            if not text:
                continue
            if runs and runs[-1][1] == kind:
                runs[-1] = (runs[-1][0] + text, kind)
            else:
                runs.append((text, kind))
        return runs

    def _push_one(self, token: int, final: bool) -> str:
        self.ids.append(token)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if full.endswith("\ufffd") and not final:
            return ""        # an incomplete UTF-8 sequence: wait for the next token
        self.prefix_offset = max(self.read_offset - CONTEXT_TOKENS, 0)
        self.read_offset = len(self.ids)
        return full[len(prefix):]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
