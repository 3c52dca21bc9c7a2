"""One request's place in its grammar: which tokens may come next, and moving through drafts.

Masks are xgrammar's packed bitmasks: row [W] int32, W = ceil(V / 32), bit t % 32 of word
t // 32 set = token t allowed. The matcher moves forward by accepted tokens and back by
`rollback` (a draft's tokens are walked, then undone; only committed tokens stay).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from torch import Tensor


def mask_width(vocab_size: int) -> int:
    """Words of a packed mask row: ceil(vocab_size / 32)."""
    return (vocab_size + 31) // 32


def all_allowed(rows: int, vocab_size: int) -> Tensor:
    """[rows, W] int32 masks with every token allowed (-1 = all 32 bits set)."""
    return torch.full((rows, mask_width(vocab_size)), -1, dtype=torch.int32)


class GrammarState:
    """A grammar matcher for one request (`Grammars.start` makes it).

    vocab_size: the model's logits width; tokenizer_size: the tokenizer's tokens (ids at and
    beyond it never decode to text, so they are never allowed).
    """

    def __init__(self, matcher: Any, vocab_size: int, tokenizer_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self._tail = _tail_words(vocab_size, min(tokenizer_size, vocab_size))

    def fill(self, masks: Tensor, row: int) -> None:
        """Write the tokens allowed next into masks[row] ([N, W] int32 on the CPU)."""
        self.matcher.fill_next_token_bitmask(masks, row)
        if self._tail is not None:
            first, words = self._tail
            masks[row, first:] &= words

    def advance(self, token: int) -> bool:
        """Take `token` if the grammar allows it here (True); else stay put (False)."""
        return bool(self.matcher.accept_token(token))

    def rollback(self, count: int) -> None:
        """Undo the last `count` tokens taken."""
        if count:
            self.matcher.rollback(count)

    def commit(self, tokens: Sequence[int]) -> None:
        """Take committed tokens; each was sampled under this grammar's mask, so a refusal is a
        bug (RuntimeError), not bad input."""
        for token in tokens:
            if self.matcher.is_terminated():
                return  # the end-of-sequence token was the last one the grammar takes
            if not self.advance(token):
                raise RuntimeError(f"the grammar refused committed token {token}")

    @property
    def done(self) -> bool:
        """Whether the grammar has taken its end-of-sequence token."""
        return bool(self.matcher.is_terminated())


def allows(mask: Tensor, token: int) -> bool:
    """Whether packed mask row `mask` ([W] int32) allows `token`."""
    return bool((int(mask[token >> 5]) >> (token & 31)) & 1)


def forced_token(mask: Tensor) -> int | None:
    """The one token `mask` ([W] int32) allows, or None when it allows more (or none).

    Example: words [0, 8, 0] -> one word set, 8 = bit 3 -> token 32 + 3 = 35.
    """
    words = mask.numpy()
    if np.count_nonzero(words) != 1:
        return None
    index = int(np.flatnonzero(words)[0])
    word = int(words[index]) & 0xFFFFFFFF
    if word & (word - 1):
        return None  # more than one bit
    return index * 32 + word.bit_length() - 1


@lru_cache(maxsize=8)
def _tail_words(vocab_size: int, usable: int) -> tuple[int, Tensor] | None:
    """(first word, [W - first] int32 words) clearing every token id in usable..vocab_size - 1;
    None when there is none to clear. Built once per vocabulary (read only)."""
    if usable >= vocab_size:
        return None
    first = usable // 32
    bits = torch.zeros(mask_width(vocab_size) * 32, dtype=torch.bool)
    bits[first * 32 : usable] = True
    weights = torch.tensor([1 << b for b in range(31)] + [-(1 << 31)], dtype=torch.int64)
    words = (bits.view(-1, 32)[first:].long() * weights).sum(-1)  # [W - first]
    return first, words.to(torch.int32)
