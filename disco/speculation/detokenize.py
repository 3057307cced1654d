"""Incremental detokenization with stop strings and EOS, for streaming."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

Decode = Callable[[Sequence[int]], str]  # token ids -> text, special tokens skipped


@dataclass(frozen=True)
class TextDelta:
    text: str  # new text safe to show
    stopped: bool  # a stop string or EOS ended the generation with this token


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Uses the prefix-offset technique of TGI/vLLM: decode a small window before the new
    tokens so that byte-level BPE merges and multi-byte characters come out right, and
    hold back text ending in an incomplete character (U+FFFD). Text that could be the
    start of a stop string is held back until it is decided. When a stop string
    appears, the text is cut before it (vLLM's default) and generation stops.
    """

    def __init__(self, decode: Decode, stop: Sequence[str] = (), eos_token_ids: Sequence[int] = ()) -> None:
        self._decode = decode
        self._stop = tuple(stop)
        self._eos = frozenset(eos_token_ids)
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._text = ""  # all decided-or-pending text so far
        self._emitted = 0  # characters of _text already returned

    @property
    def text(self) -> str:
        return self._text[: self._emitted]

    def push(self, token_id: int) -> TextDelta:
        """Add one token; returns the text that became final because of it."""
        self._ids.append(token_id)
        if token_id in self._eos:
            return self._flush(stopped=True)
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._text += new_text[len(prefix_text):]
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        for stop in self._stop:
            search_from = max(0, self._emitted - len(stop) + 1)
            index = self._text.find(stop, search_from)
            if index >= 0:
                self._text = self._text[:index]
                return self._flush(stopped=True)
        held_back = max((self._partial_stop_len(stop) for stop in self._stop), default=0)
        return self._release(len(self._text) - held_back, stopped=False)

    def finish(self) -> TextDelta:
        """Generation ended for another reason: release everything held back,
        including a trailing incomplete character."""
        if self._read_offset < len(self._ids):
            prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
            self._text += self._decode(self._ids[self._prefix_offset:])[len(prefix_text):]
            self._prefix_offset = self._read_offset = len(self._ids)
        return self._flush(stopped=False)

    def _flush(self, stopped: bool) -> TextDelta:
        return self._release(len(self._text), stopped)

    def _release(self, upto: int, stopped: bool) -> TextDelta:
        upto = max(upto, self._emitted)
        delta, self._emitted = self._text[self._emitted:upto], upto
        return TextDelta(text=delta, stopped=stopped)

    def _partial_stop_len(self, stop: str) -> int:
        """Length of the longest suffix of the text that is a proper prefix of ``stop``."""
        for length in range(min(len(stop) - 1, len(self._text) - self._emitted), 0, -1):
            if stop.startswith(self._text[-length:]):
                return length
        return 0
