"""The `logprobs` objects of OpenAI's responses, from the engine's `TokenLogprob`s.

Completions (the legacy shape): `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`,
each top entry a {token text: log-probability} dict holding the chosen token too. Chat:
`{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}],
"refusal": null}`. A token's text is its own decoding (special tokens kept); a token that holds
part of a character decodes to U+FFFD, and its `bytes` are those of that text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from specdecode.types import TokenLogprob

Decode = Callable[[int], str]  # one token id -> its text


def completion_logprobs(
    entries: Sequence[TokenLogprob], decode: Decode, offset: int
) -> dict[str, Any]:
    """The completions shape for `entries`, whose text starts at character `offset` of the
    choice's text."""
    tokens = [decode(e.token_id) for e in entries]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    tops = [
        {token: e.logprob, **{decode(t): v for t, v in e.top}}
        for token, e in zip(tokens, entries, strict=True)
    ]
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(entries: Sequence[TokenLogprob], decode: Decode) -> dict[str, Any]:
    """The chat shape for `entries`."""

    def token(token_id: int, logprob: float) -> dict[str, Any]:
        text = decode(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = [
        {**token(e.token_id, e.logprob), "top_logprobs": [token(t, v) for t, v in e.top]}
        for e in entries
    ]
    return {"content": content, "refusal": None}
