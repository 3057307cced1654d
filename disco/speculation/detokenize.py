"""Incremental detokenization with stop strings and EOS, for streaming."""

from __future__ import annotations

from collections import deque
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
    appears, the text is cut before it (vLLM's default) and generation stops; of the stop
    strings the text contains, the one that ends first wins (as when the tokens come one
    at a time). Stop strings are matched by a :class:`StopMatcher`, which reads each
    character of the text once.

    As in vLLM: ``stop_token_ids`` end the generation as EOS does (the token is returned, its
    text is not); neither they, EOS nor a stop string count before ``min_tokens`` tokens (a stop
    token from the ``min_tokens``-th token on, a stop string ending in the text of a later
    token); ``include_stop_str_in_output`` keeps the stop string (the text is cut after it,
    and nothing is held back) and the stop token's text.
    """

    def __init__(self, decode: Decode, stop: Sequence[str] = (), eos_token_ids: Sequence[int] = (),
                 stop_token_ids: Sequence[int] = (), min_tokens: int = 0,
                 include_stop_str_in_output: bool = False) -> None:
        self._decode = decode
        self._stops = StopMatcher(stop)
        self._eos = frozenset(eos_token_ids) | frozenset(stop_token_ids)
        self._min_tokens = min_tokens
        self._include = include_stop_str_in_output
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
        if token_id in self._eos and len(self._ids) >= self._min_tokens:
            if self._include:
                self._decode_new()
            return self._flush(stopped=True)
        added = self._decode_new()
        if added:
            index = self._find_stop(added, armed=len(self._ids) > self._min_tokens)
            if index is not None:
                self._text = self._text[:self._stops.read if self._include else index]
                return self._flush(stopped=True)
        return self._release(len(self._text) - (0 if self._include else self._stops.pending), stopped=False)

    def _decode_new(self) -> str:
        """The text the last token completes (appended to the text), or "" while it ends in an
        incomplete character."""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            added = new_text[len(prefix_text):]
            self._text += added
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            return added
        return ""

    def _find_stop(self, added: str, armed: bool) -> int | None:
        """Where the first stop string ending in ``added`` starts; before ``min_tokens`` tokens
        (not ``armed``) none counts, and the matcher reads on past them."""
        while True:
            read = self._stops.read
            index = self._stops.feed(added)
            if index is None or armed:
                return index
            added = added[self._stops.read - read:]

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



class StopMatcher:
    """Finds stop strings in a text fed piece by piece, reading each character once.

    An Aho-Corasick automaton (Aho & Corasick, "Efficient string matching", CACM 1975)
    over the stop strings: its state is the longest suffix of the text read so far that
    is a prefix of some stop string, so it also says how much text could still become a
    stop string (:attr:`pending`, the text to hold back). Feeding ``n`` characters takes
    at most ``2 n`` transitions whatever the number of stop strings (:attr:`steps` counts
    them); building it takes time linear in their total length.
    """

    def __init__(self, stops: Sequence[str] = ()) -> None:
        self._next: list[dict[str, int]] = [{}]  # trie edges
        self._depth = [0]  # length of the prefix a state stands for
        self._done = [0]  # length of the longest stop string ending at a state (0: none)
        for stop in stops:
            state = 0
            for char in stop:
                if char not in self._next[state]:
                    self._next.append({})
                    self._depth.append(self._depth[state] + 1)
                    self._done.append(0)
                    self._next[state][char] = len(self._next) - 1
                state = self._next[state][char]
            self._done[state] = len(stop)
        self._fail = [0] * len(self._next)
        queue = deque(self._next[0].values())  # depth 1: their fallback is the root
        while queue:  # breadth first: a state's fallback is shallower, so already final
            state = queue.popleft()
            for char, child in self._next[state].items():
                fallback = self._fail[state]
                while fallback and char not in self._next[fallback]:
                    fallback = self._fail[fallback]
                self._fail[child] = self._next[fallback].get(char, 0)
                self._done[child] = self._done[child] or self._done[self._fail[child]]
                queue.append(child)
        self._state = 0
        self._read = 0  # characters fed so far
        self.steps = 0

    @property
    def pending(self) -> int:
        """Characters at the end of the text that are the start of a stop string."""
        return self._depth[self._state]

    @property
    def read(self) -> int:
        """Characters read so far (after a match: up to the end of the stop string found)."""
        return self._read

    def feed(self, text: str) -> int | None:
        """Read ``text`` (the continuation of what was fed before); the index, in the whole
        text, where the first stop string to end in it starts, or ``None``."""
        state, steps = self._state, 0
        for offset, char in enumerate(text):
            while state and char not in self._next[state]:
                state, steps = self._fail[state], steps + 1
            state, steps = self._next[state].get(char, 0), steps + 1
            if self._done[state]:
                self.steps += steps
                self._state, self._read = state, self._read + offset + 1
                return self._read - self._done[state]
        self.steps += steps
        self._state, self._read = state, self._read + len(text)
        return None
