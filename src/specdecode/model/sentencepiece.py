"""SentencePiece BPE vocabularies as a `tokenizers` backend: what a GGUF file whose
`tokenizer.ggml.model` is "llama" describes (Gemma, Llama 2, Mistral v0.1), from its tokens,
scores and token types alone (the file holds no merge list).

Spaces are spelled "▁" (U+2581) inside tokens; text with no token falls back to its UTF-8
bytes (tokens "<0x00>" .. "<0xFF>"). The merges are rebuilt from the scores as transformers'
SentencePiece converter rebuilds them: every split of a normal token into two tokens of the
vocabulary is a merge, ranked by the merged token's score (higher first), then by the longer
left part, then the longer right part, then by the parts' ids. Control and user-defined tokens
are never merged into: they match whole in text (control tokens as special tokens).
"""

from __future__ import annotations

from collections.abc import Sequence

import tokenizers
from tokenizers import decoders, models, normalizers

from specdecode.errors import UserError
from specdecode.model.gguf_vocab import NORMAL, UNKNOWN, add_whole_tokens, vocabulary

SPACE = "\u2581"  # "▁": how a SentencePiece vocabulary spells a space


def sentencepiece_bpe(
    tokens: Sequence[str],
    scores: Sequence[float],
    token_types: Sequence[int],
    add_space_prefix: bool,
) -> tokenizers.Tokenizer:
    """A SentencePiece BPE backend: token `i` is `tokens[i]` with score `scores[i]` and llama.cpp
    type `token_types[i]`; `add_space_prefix` puts a space before the text (Llama 2: yes,
    Gemma: no) and takes it off again when decoding."""
    if len(scores) != len(tokens):
        raise UserError(f"{len(scores)} scores for {len(tokens)} tokens")
    vocab = vocabulary(tokens, token_types)
    unknown = next(
        (t for t, kind in zip(tokens, token_types, strict=True) if kind == UNKNOWN), None
    )
    bpe = models.BPE(
        vocab=vocab,
        merges=_merges(tokens, scores, token_types, vocab),
        unk_token=unknown,
        fuse_unk=True,
        byte_fallback=True,
    )
    backend = tokenizers.Tokenizer(bpe)
    steps: list[normalizers.Normalizer] = [normalizers.Replace(" ", SPACE)]
    decode: list[decoders.Decoder] = [
        decoders.Replace(SPACE, " "),
        decoders.ByteFallback(),
        decoders.Fuse(),
    ]
    if add_space_prefix:
        steps.insert(0, normalizers.Prepend(" "))
        decode.append(decoders.Strip(" ", 1, 0))
    backend.normalizer = normalizers.Sequence(steps)
    backend.decoder = decoders.Sequence(decode)
    add_whole_tokens(backend, tokens, token_types)
    return backend


def _merges(
    tokens: Sequence[str],
    scores: Sequence[float],
    token_types: Sequence[int],
    vocab: dict[str, int],
) -> list[tuple[str, str]]:
    """Every (left, right) pair whose concatenation is a normal token, best first (see the
    module docstring)."""
    ranked: list[tuple[float, int, int, int, int, str, str]] = []
    for token, score, kind in zip(tokens, scores, token_types, strict=True):
        if kind != NORMAL or len(token) < 2:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append(
                    (-score, -len(left), -len(right), vocab[left], vocab[right], left, right)
                )
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]
