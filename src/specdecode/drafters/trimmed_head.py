"""FR-Spec (Zhao et al. 2025, frequency-ranked speculative sampling): a draft model whose output
head covers only the target's most frequent tokens.

On the CPU a draft model's output matrix is a large part of a draft token's cost (Qwen2.5-0.5B:
151,936 x 896, about a quarter of it). `TrimmedHeadLM` multiplies by the rows of the kept
tokens only, in the head's own weight format, and spreads the result back over the whole
vocabulary with -inf elsewhere, so the drafter is unchanged: q (after any temperature, top-k,
top-p) is exactly 0 outside the kept tokens, and only kept tokens are drafted. Verification is
unchanged too: greedy output equals plain greedy, and sampling stays exact because q is the
distribution each draft token was drawn from.

Worked example, kept = [2, 5, 7] of V = 8: the trimmed head computes the logits of rows 2, 5, 7,
say [1.0, 3.0, 0.5]; the draft model returns [-inf, -inf, 1.0, -inf, -inf, 3.0, -inf, 0.5].

The kept tokens (`frequent_tokens`) are the most frequent target tokens of a fixed amount of
training text (`frequency_texts`), never text of the bench's prompt sets; the tokenized text is
cached per tokenizer under `cache_root()/"frequency"`, so only the first load tokenizes.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

from specdecode.cache.attention_metadata import AttentionMetadata
from specdecode.cache.kv_cache import KVCache
from specdecode.corpus.examples import (
    CODE_EVERY,
    BenchFilter,
    bench_texts,
    interleaved,
    sharegpt_examples,
    stdlib_code_examples,
)
from specdecode.corpus.sharegpt import HELD_OUT_CONVERSATIONS
from specdecode.corpus.vocab import draft_vocabulary
from specdecode.drafters.base import spread_logits
from specdecode.errors import UserError
from specdecode.model.registry import cache_root
from specdecode.model.tokenizer import Tokenizer
from specdecode.model.transformer import Transformer, at_positions
from specdecode.model.trimmed_linear import check_kept, trimmed_linear

# Answer text counted for the table: ~1,300 examples, ~335k Qwen2.5 tokens, ~5 s on first use.
FREQUENCY_CHARS = 1_500_000
# What `frequency_texts` reads; part of the cache key, so a change of sources rebuilds the table.
FREQUENCY_SOURCE = f"sharegpt-from-{HELD_OUT_CONVERSATIONS}+stdlib-every-{CODE_EVERY}"


class TrimmedHeadLM:
    """A `DraftLM`: `model` with its output head cut to the rows of `kept`.

    Args:
        model: the draft model (left as it is: the trimmed head is a new module).
        kept: [Vk] int64 sorted, distinct target ids (1 <= Vk <= the model's vocabulary).

    Raises:
        UserError: `kept` is not a sorted, distinct, in-range 1-D set of ids, or the head's
            format cannot be sliced.
    """

    def __init__(self, model: Transformer, kept: Tensor) -> None:
        check_kept(kept, model.config.vocab_size)
        self.model = model
        self.config = model.config
        self.kept = kept.to(model.device)  # [Vk]
        self.lm_head = trimmed_linear(model.lm_head, self.kept)  # [..., hidden] -> [..., Vk]

    @property
    def device(self) -> torch.device:
        return self.model.device

    def new_cache(self, batch_size: int, capacity: int) -> KVCache:
        """An empty cache of the draft model (see `Transformer.new_cache`)."""
        return self.model.new_cache(batch_size, capacity)

    @torch.inference_mode()
    def __call__(
        self,
        tokens: Tensor,  # [B, T] int64
        meta: AttentionMetadata,
        cache: KVCache,
        logits_index: Tensor | None = None,  # [B, N] which of the T positions get logits
    ) -> tuple[Tensor, Tensor]:
        """As `Transformer.forward`: (logits [B, N, V], final-normed hidden [B, T, hidden]),
        the logits -inf outside the kept tokens."""
        x, _ = self.model.body(tokens, meta, cache, self.config.num_layers)
        hidden = self.model.norm(x)  # [B, T, hidden]
        reduced = self.lm_head(at_positions(hidden, logits_index))  # [B, N, Vk]
        return spread_logits(reduced, self.kept, self.config.vocab_size), hidden  # [B, N, V]


def trimmed_draft_model(model: Transformer, tokenizer: Tokenizer, size: int) -> TrimmedHeadLM:
    """`model` with its head cut to the `size` most frequent tokens of `tokenizer` (the
    target's; `frequent_tokens`). UserError when `size` exceeds the model's vocabulary."""
    vocab = model.config.vocab_size
    if size > vocab:
        raise UserError(
            f"draft_vocab_size must be in 1..{vocab} (the draft model's vocabulary), got {size}"
        )
    return TrimmedHeadLM(model, frequent_tokens(tokenizer, size, vocab).to(model.device))


def frequent_tokens(
    tokenizer: Tokenizer, size: int, vocab_size: int, chars: int = FREQUENCY_CHARS
) -> Tensor:
    """The `size` most frequent tokens of `frequency_texts(chars)` under `tokenizer`, always
    with its EOS ids (`draft_vocabulary`: ties lower id first, unused low ids fill up), as
    sorted ids ([size] int64) below `vocab_size`."""
    ids = counted_tokens(tokenizer, chars)  # [n] int32
    return draft_vocabulary([ids.tolist()], size, vocab_size, tokenizer.eos_token_ids)


def counted_tokens(tokenizer: Tokenizer, chars: int = FREQUENCY_CHARS) -> Tensor:
    """The token ids ([n] int32) of `frequency_texts(chars)` under `tokenizer`, one text after
    another; read from the cache file `frequency_path(tokenizer, chars)` when it exists,
    else tokenized and written there."""
    path = frequency_path(tokenizer, chars)
    if path.is_file():
        return torch.load(path, weights_only=True)
    texts = frequency_texts(chars)
    ids = [t for text in texts for t in tokenizer.encode(text, add_special_tokens=False)]
    counted = torch.tensor(ids, dtype=torch.int32)  # [n]
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    torch.save(counted, partial)
    os.replace(partial, path)  # atomic: a concurrent reader sees no half-written table
    return counted


def frequency_path(tokenizer: Tokenizer, chars: int) -> Path:
    """The cache file of the counted tokens: `cache_root()/"frequency"/"<key>.pt"`, the key a
    hash of the tokenizer's vocabulary (token -> id), the sources and `chars`."""
    vocab = json.dumps(sorted(tokenizer.vocab().items()), ensure_ascii=False)
    key = hashlib.sha256(f"{vocab}\n{FREQUENCY_SOURCE}\n{chars}".encode()).hexdigest()[:24]
    return cache_root() / "frequency" / f"{key}.pt"


def frequency_texts(chars: int = FREQUENCY_CHARS) -> Iterator[str]:
    """The answers the table counts, in a fixed order: the draft-head training stream
    (`specdecode.corpus.examples`: ShareGPT answers from conversation HELD_OUT_CONVERSATIONS on,
    with a standard-library function after every CODE_EVERY - 1 of them), until `chars`
    characters are given. An example sharing text with the bench's prompt sets (`BenchFilter`)
    is skipped."""
    bench = BenchFilter(bench_texts())
    total = 0
    for example in interleaved(sharegpt_examples(), stdlib_code_examples()):
        if total >= chars:
            return
        if example.answer and not bench.touches(example):
            total += len(example.answer)
            yield example.answer
