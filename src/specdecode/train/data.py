"""Training examples as token ids: a prompt (through the chat template) and its answer."""

from __future__ import annotations

from specdecode.corpus.examples import Example
from specdecode.model.tokenizer import Tokenizer


def encode_example(
    tokenizer: Tokenizer, example: Example, max_tokens: int
) -> tuple[list[int], int] | None:
    """(prompt + answer + EOS token ids cut to `max_tokens`, prompt length), or None when the
    prompt leaves no room for an answer. The prompt goes through the chat template when the
    tokenizer has one."""
    if tokenizer.chat_template is not None:
        text = tokenizer.apply_chat_template([{"role": "user", "content": example.prompt}])
        prompt = tokenizer.encode(text, add_special_tokens=False)
    else:
        prompt = tokenizer.encode(example.prompt)
    answer = tokenizer.encode(example.answer, add_special_tokens=False) if example.answer else []
    if tokenizer.eos_token_ids and example.answer:
        answer.append(tokenizer.eos_token_ids[0])
    if len(prompt) + 8 > max_tokens:
        return None
    return (prompt + answer)[:max_tokens], len(prompt)
