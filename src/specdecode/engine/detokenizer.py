"""Incremental detokenization: stream text as tokens arrive, never a broken character."""

from __future__ import annotations

import operator
from collections.abc import Sequence

from specdecode.model.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"  # what decoding an incomplete UTF-8 sequence ends with
_MAX_HELD = 3  # ids an incomplete character can span: its first 1..3 bytes, >= 1 byte per id


class IncrementalDetokenizer:
    """Turn a growing list of token ids into text, emitting only text that is stable.

    A byte-level token may hold part of a character: "é" is the bytes C3 A9 and can arrive as two
    tokens. Decoding up to the first one ends in U+FFFD; that text is held back until the
    character completes. Each push decodes a short window, never the whole sequence:

    - `prefix`: ids already emitted, kept as context (one earlier chunk);
    - `read`: window index where the not-yet-emitted ids start.

    New text = decode(window[:end])[len(decode(window[:read])):], emitted only if it grew and
    does not end in U+FFFD; `end` is the window's end, or up to 3 ids earlier (held back) when
    the window ends inside a character. Decoding the prefix along with the new ids keeps
    decoders that depend on context (a SentencePiece leading space) exact. After an emission
    the old `read` becomes the new window start and `read` moves to `end`.

    Worked example, byte tokens for "hé!" = [h, C3, A9, !]:

        push([h])   window [h]          read 0  "" -> "h"       emit "h";  window [h], read 1
        push([C3])  window [h, C3]      read 1  "h" -> "h\\ufffd"  hold "";   window unchanged
        push([A9])  window [h, C3, A9]  read 1  "h" -> "hé"      emit "é";  window [C3, A9], read 2
        push([!])   window [C3, A9, !]  read 2  "é" -> "é!"      emit "!";  window [!], read 1
        flush()     window [!]          read 1  "!" -> "!"       emit ""

    A push ending inside a character still emits its complete part, "a日" = [a, E6, 97, A5]:

        push([a, E6, 97])  read 0  "" -> "a\\ufffd" (end 3), "a" (end 1)  emit "a";  read 1
        push([A5])         read 1  "a" -> "a日" (end 4)                 emit "日"; read 3
                           window [a, E6, 97, A5] -> [E6, 97, A5]

    The concatenation of all pushes and the final `flush()` equals `tokenizer.decode(all_ids)`.
    Work per push is O(window): the last emitted chunk plus ids held since. Only a run of
    invalid bytes that never completes (or of special tokens, when skipped) keeps it growing.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        """Start an empty stream decoded with `tokenizer`."""
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._window: list[int] = []  # ids from the prefix start on
        self._read = 0  # index in `_window` of the first id whose text is not yet emitted
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._pieces)

    def push(self, new_ids: Sequence[int]) -> str:
        """Append `new_ids`; return the newly stable text (may be "")."""
        self._window.extend(self._checked(new_ids))
        prefix_text = self._decode(self._read)
        # An incomplete character spans at most 3 trailing ids (>= 1 byte each): try the full
        # window first, then hold back its last 1..3 ids, so a multi-token push emits its
        # complete part now.
        last = len(self._window)
        for end in range(last, max(self._read, last - _MAX_HELD - 1), -1):
            text = self._decode(end)
            if len(text) > len(prefix_text) and not text.endswith(_REPLACEMENT):
                return self._emit(text[len(prefix_text) :], end)
        return ""

    def flush(self) -> str:
        """Return all text still held back (at the end of the stream), even an incomplete tail."""
        prefix_text = self._decode(self._read)
        return self._emit(self._decode(len(self._window))[len(prefix_text) :], len(self._window))

    def _decode(self, end: int) -> str:
        return self._tokenizer.decode(self._window[:end], self._skip_special_tokens)

    def _emit(self, text: str, end: int) -> str:
        """Record `text` as the text of `_window[_read:end]`; the old read offset becomes the new
        prefix start and `end` the new read offset."""
        del self._window[: self._read]
        self._read = end - self._read
        self._pieces.append(text)
        return text

    def _checked(self, ids: Sequence[int]) -> list[int]:
        """`ids` as ints, rejected before they enter the window if any is not a token id."""
        checked = [operator.index(i) for i in ids]
        bad = [i for i in checked if not 0 <= i < self._tokenizer.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad} are outside [0, {self._tokenizer.vocab_size})")
        return checked
