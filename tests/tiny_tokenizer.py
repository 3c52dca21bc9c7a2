"""A tiny byte-level tokenizer for tests with tiny random models.

Ids 0..255 are the bytes (no merges, so every multi-byte character spans several tokens), then
`<|endoftext|>`, `<|im_start|>`, `<|im_end|>` (eos), then `<|reserved_N|>` fillers (plain added
tokens that decode to their own text) up to `vocab_size`. The chat template is ChatML.
"""

from __future__ import annotations

from pathlib import Path

import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from specdecode.model.tokenizer import Tokenizer

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def byte_alphabet() -> list[str]:
    """GPT-2's byte-level spelling: entry `b` is the printable character standing for byte `b`."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    spelling, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            spelling[byte] = chr(byte)
        else:
            spelling[byte] = chr(256 + extra)
            extra += 1
    return [spelling[byte] for byte in range(256)]


def make_byte_tokenizer(path: Path, vocab_size: int = 300) -> Tokenizer:
    """Write the tiny tokenizer as a Hugging Face folder at `path` and load it back from there."""
    first_filler = 256 + len(SPECIAL_TOKENS)
    if vocab_size < first_filler:
        raise ValueError(f"vocab_size must be at least {first_filler}, got {vocab_size}")
    vocab = {token: byte for byte, token in enumerate(byte_alphabet())}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    fillers = [f"<|reserved_{i}|>" for i in range(first_filler, vocab_size)]
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in fillers])
    endoftext, _, im_end = (backend.token_to_id(t) for t in SPECIAL_TOKENS)
    tokenizer = Tokenizer(
        backend,
        bos_token_id=endoftext,
        eos_token_ids=[im_end],
        pad_token_id=endoftext,
        chat_template=CHATML_TEMPLATE,
    )
    tokenizer.save(path)
    return Tokenizer.from_folder(path)
