"""Incremental detokenization: text deltas per generated token that never split a UTF-8 character.

Byte-level BPE tokens can end mid-character (one CJK character or emoji is often two or three tokens), and
decoding such a prefix yields U+FFFD. Decoding only a short window of recent ids and holding back text that
ends in U+FFFD keeps each step O(window) and makes the concatenated deltas equal to decoding all ids at once.
"""

from __future__ import annotations

from collections.abc import Callable

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self.ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # ids before this index have been released as text

    def push(self, token_id: int) -> str:
        """Add one id; return the newly complete text ("" while a character is still incomplete)."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        new_text = self._decode(self.ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT):
            delta = new_text[len(prefix_text) :]
            self._prefix, self._read = self._read, len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is held back (an incomplete character decodes as U+FFFD); call once at the end."""
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        new_text = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return new_text[len(prefix_text) :]
