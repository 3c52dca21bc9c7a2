"""What every GGUF vocabulary shares, whatever its model (byte-level BPE in `model.tokenizer`,
SentencePiece BPE in `model.sentencepiece`): llama.cpp's token types, the token -> id map, and
the control and user-defined tokens that match whole in text."""

from __future__ import annotations

from collections.abc import Sequence

import tokenizers
from tokenizers import AddedToken

from specdecode.errors import UserError

# llama.cpp token types (tokenizer.ggml.token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED = 1, 2, 3, 4


def vocabulary(tokens: Sequence[str], token_types: Sequence[int]) -> dict[str, int]:
    """Token -> id; refuses a type list of another length and a token spelled twice."""
    if len(token_types) != len(tokens):
        raise UserError(f"{len(token_types)} token types for {len(tokens)} tokens")
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise UserError("the token list spells some tokens twice; ids would be ambiguous")
    return vocab


def add_whole_tokens(
    backend: tokenizers.Tokenizer, tokens: Sequence[str], token_types: Sequence[int]
) -> None:
    """Let `backend` match control tokens (as special tokens) and user-defined tokens (as
    plain ones) whole in text, before its model splits the rest."""
    kinds = {CONTROL: True, USER_DEFINED: False}
    backend.add_tokens(
        [
            AddedToken(token, special=kinds[kind], normalized=False)
            for token, kind in zip(tokens, token_types, strict=True)
            if kind in kinds
        ]
    )
