"""Cross-tokenizer draft model: a small model with its OWN vocabulary drafts through text.

Hugging Face's "universal assisted decoding" (Timor et al. 2025), method "cross_tokenizer":
e.g. SmolLM2-135M (49,152 tokens) drafting for Qwen2.5-Coder-1.5B (151,936 tokens). Per step
and sequence:

    committed target tokens --target decode--> text --draft encode--> draft-side tokens
    draft model's greedy continuation --draft decode--> draft text
    draft text --target encode (after the committed tokens)--> at most K target tokens

Special tokens travel as text: the target decodes with them kept (`<|im_start|>`), and the
draft tokenizer encodes that text to its own special ids where it has them.

Why it is lossless: the draft is deterministic (`probs=None`, q one-hot), a function of the
committed tokens alone, chosen independently of the verifier's random draws. The verifier then
accepts draft token d with probability p(d) and at the first rejection samples from
norm(max(p - onehot(d), 0)), p without d. Greedy: a draft token is kept iff it is the
target's argmax, so the output is plain greedy decoding token for token. Sampling: the output
distribution is exactly the target's p (rejection sampling with a one-hot q); the acceptance is
lower than true rejection sampling with the draft model's sampled q would give, since the draft
is the draft model's greedy path, not a sample of its q.

Token boundary. The committed text ends wherever the target's last token ended, and a word
may continue across it. The draft text is re-encoded together with the text of the last
`LOOKBACK` committed tokens; when that encoding starts with exactly those tokens, the tokens
after them are proposed, else the draft text is encoded alone. E.g. committed [..., "def",
" ad"], draft text "d(a, b):" -> " ad" + "d(a, b):" encodes to [" add", "(a", ...], which does
not start with " ad" (the target cannot take back " ad"), so "d(a, b):" alone -> ["d", "(a",
...] is proposed. The last target token of the draft text may be the start of a longer token
(the draft stopped mid-word), so it is dropped unless the draft model ended at its EOS; a
target EOS is never proposed (the draft is cut before it); committed text that ends inside a
character (an incomplete UTF-8 sequence, U+FFFD) gets no draft this step.

Cache reuse. Each sequence keeps a one-row KV cache of the draft model and the draft-side
tokens it holds. A step re-encodes the committed text, keeps the cache's longest common prefix
with that encoding (at least one token is fed) and feeds the rest, then the drafted tokens
(all but the last). Worked example: last step the cache held draft-side tokens [a, b, c] and
the draft fed d1, d2 (holding [a, b, c, d1, d2]); the target accepted d1's text and then
committed other text, which encodes to [a, b, c, d1, e]: truncate to 4, feed [e] at position
4, and draft on from there.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from specdecode.cache.kv_cache import KVCache
from specdecode.drafters.base import (
    DrafterBase,
    DrafterContext,
    ModelDrafterConfig,
    SeqView,
    cache_with_room,
    check_draft_length,
    draft_limits,
)
from specdecode.drafters.draft_model import DraftLM, feed
from specdecode.errors import UserError
from specdecode.model.tokenizer import Tokenizer
from specdecode.sampling.argmax import argmax
from specdecode.types import Draft, DraftBudget, TargetOutputs, Verdict

LOOKBACK = 4  # committed target tokens re-encoded with the draft text (the token boundary)
STEPS_PER_TOKEN = 2  # draft-model tokens per step at most: this many per proposed target token
INCOMPLETE = "\ufffd"  # what a decode shows for a character cut across tokens


@dataclass(frozen=True, slots=True)
class CrossTokenizerConfig(ModelDrafterConfig):
    """speculative_config of a draft model with its own tokenizer, method "cross_tokenizer".

    model: the draft model (alias, Hugging Face folder or .gguf), whose vocabulary differs from
        the target's (a model sharing it is method "draft_model").
    num_speculative_tokens: propose at most this many target tokens per step (K, 1..64).
    quantization: the draft model's weight format ("none", "int8", "int4", "gguf", "q4_0" ...:
        `model.quant`); None = the target's.
    tree_width: must be 1 (the draft is a chain).
    tree_depth: must be None.
    """

    method: ClassVar[str] = "cross_tokenizer"
    WHAT: ClassVar[str] = "a cross_tokenizer draft model"

    def __post_init__(self) -> None:
        ModelDrafterConfig.__post_init__(self)
        if self.tree_width != 1:
            raise UserError(
                f"{self.WHAT} drafts a chain: tree_width must be 1, got {self.tree_width!r} "
                "(token trees need a draft model with the target's tokenizer, "
                'method "draft_model")'
            )


def build_cross_tokenizer_drafter(
    config: CrossTokenizerConfig, context: DrafterContext
) -> CrossTokenizerDrafter:
    """The registry's factory: load (or share) the draft model and its own tokenizer."""
    model, tokenizer = context.load_model(config.model, config.quantization)
    return CrossTokenizerDrafter(
        model, tokenizer, context.tokenizer, config.num_speculative_tokens, config.model
    )


@dataclass(slots=True)
class _DraftState:
    """One sequence's draft-model cache and the draft-side tokens it holds (`fed[i]` at slot i)."""

    cache: KVCache | None = None
    fed: list[int] = field(default_factory=list)


class CrossTokenizerDrafter(DrafterBase):
    """Proposes up to K target tokens per sequence from a draft model with another vocabulary,
    bridged through text (module docstring); deterministic drafts (`probs=None`).

    Sequences are drafted one after another; each keeps its draft-model cache, keyed by
    `request_id`, until `release`.

    Args:
        model: the draft model (`DraftLM`).
        draft_tokenizer: the draft model's own tokenizer.
        target_tokenizer: the target's tokenizer.
        num_speculative_tokens: propose at most this many target tokens per step (K, 1..64).
        draft_name: the draft model's name (alias, path) in error messages, if known.

    Raises:
        UserError: K is out of range, the draft tokenizer has more tokens than the draft model,
            or the two vocabularies are the same.
    """

    def __init__(
        self,
        model: DraftLM,
        draft_tokenizer: Tokenizer,
        target_tokenizer: Tokenizer,
        num_speculative_tokens: int,
        draft_name: str | None = None,
    ) -> None:
        check_draft_length(num_speculative_tokens)
        what = "the draft model" if draft_name is None else f"draft model {draft_name!r}"
        if draft_tokenizer.vocab_size > model.config.vocab_size:
            raise UserError(
                f"{what} has a tokenizer of {draft_tokenizer.vocab_size} tokens but only "
                f"{model.config.vocab_size} output rows: they do not belong together"
            )
        if draft_tokenizer.vocab() == target_tokenizer.vocab():
            raise UserError(
                f"{what} has the target's vocabulary; a cross_tokenizer draft model has its "
                'own, so use "method": "draft_model" for this one'
            )
        self.model = model
        self.draft_tokenizer = draft_tokenizer
        self.target_tokenizer = target_tokenizer
        self.num_speculative_tokens = num_speculative_tokens
        self._draft_eos = frozenset(draft_tokenizer.eos_token_ids)
        self._target_eos = frozenset(target_tokenizer.eos_token_ids)
        self._states: dict[str, _DraftState] = {}

    def propose(self, seqs: Sequence[SeqView], budgets: Sequence[DraftBudget]) -> list[Draft]:
        """One deterministic draft per sequence, of at most min(K, `budgets[i].max_tokens`) tokens.

        Args:
            seqs: the sequences to draft for.
            budgets: per sequence, the most tokens its draft may have (`max_tokens`, 0 = no
                draft).

        Returns:
            drafts: `Draft(tokens [k_i] int64, probs=None)` per sequence, k_i may be 0.
        """
        max_tokens = draft_limits(seqs, budgets)
        with torch.inference_mode():
            return [
                Draft(torch.tensor(self._propose_one(seq, m), dtype=torch.long))
                for seq, m in zip(seqs, max_tokens, strict=True)
            ]

    def commit(self, seq: SeqView, verdict: Verdict, target: TargetOutputs) -> None:
        """Nothing to do: the next `propose` realigns the cache with the committed text."""

    def release(self, request_id: str) -> None:
        """Drop the draft-model cache of a finished sequence (unknown ids are ignored)."""
        self._states.pop(request_id, None)

    def _propose_one(self, seq: SeqView, max_tokens: int) -> list[int]:
        """The target tokens proposed for one sequence (module docstring), possibly none."""
        ids = seq.token_ids
        k = min(self.num_speculative_tokens, max_tokens)
        text = self._committed_text(ids) if k else None
        context = self._draft_context(text) if text else []
        # drafted token j (1-based) is fed at position len(context) + j - 1, j < steps
        room = self.model.config.max_position_embeddings - len(context) + 1
        steps = min(STEPS_PER_TOKEN * (k + 1), room)
        if text is None or not context or steps <= 0:
            return []
        state = self._state_for(seq, context, steps)
        proposal: list[int] = []
        for draft_text, ended in self._greedy_texts(state, context, steps):
            proposal = self._target_tokens(ids, text, draft_text.rstrip(INCOMPLETE))
            if ended:  # the draft model's text is complete: so is its last target token
                return self._before_eos(proposal)[:k]
            if len(proposal) > k:
                break
        return self._before_eos(proposal[:-1])[:k]  # the last token may continue: drop it

    def _committed_text(self, ids: list[int]) -> str | None:
        """The text of the committed target tokens, special tokens kept; None when there are
        none or the text ends inside a character (its last bytes are still to come)."""
        text = self.target_tokenizer.decode(ids, skip_special_tokens=False) if ids else ""
        return text if text and not text.endswith(INCOMPLETE) else None

    def _before_eos(self, tokens: list[int]) -> list[int]:
        """`tokens` up to, not including, the first target EOS."""
        for i, token in enumerate(tokens):
            if token in self._target_eos:
                return tokens[:i]
        return tokens

    def _draft_context(self, text: str) -> list[int]:
        """The draft-side tokens of the committed `text`, with the draft model's BOS first when
        its tokenizer adds one (and the text did not bring it)."""
        tokenizer = self.draft_tokenizer
        ids = tokenizer.encode(text, add_special_tokens=False)
        bos = tokenizer.bos_token_id
        if tokenizer.add_bos and bos is not None and ids[:1] != [bos]:
            ids = [bos, *ids]
        return ids

    def _state_for(self, seq: SeqView, context: list[int], steps: int) -> _DraftState:
        """The sequence's state, its cache allocated or grown to hold the context and the
        `steps` - 1 drafted tokens that are fed (`cache_with_room`)."""
        state = self._states.setdefault(seq.request_id, _DraftState())
        state.cache = cache_with_room(
            state.cache,
            seq,
            len(context) + steps,
            STEPS_PER_TOKEN * (self.num_speculative_tokens + 1),
            lambda capacity: self.model.new_cache(1, capacity),
        )
        return state

    def _greedy_texts(
        self, state: _DraftState, context: list[int], steps: int
    ) -> Iterator[tuple[str, bool]]:
        """Draft the greedy continuation of `context`, at most `steps` tokens; after each,
        yield (the drafted tokens' text, whether the draft model ended at its EOS).

        The cache keeps its longest common prefix with `context` (at least one token is fed);
        every fed token is recorded in `state.fed`, so stopping early leaves `state` exact.
        """
        assert state.cache is not None
        keep = min(_common_prefix(state.fed, context), len(context) - 1)
        state.cache.truncate(keep)
        del state.fed[keep:]
        new, drafted = context[keep:], []
        for _ in range(steps):
            token = self._greedy_next(state.cache, new, len(state.fed))
            state.fed += new
            if token in self._draft_eos:
                yield self._text_after(context, drafted), True
                return
            drafted.append(token)
            new = [token]
            yield self._text_after(context, drafted), False

    def _greedy_next(self, cache: KVCache, new: list[int], start: int) -> int:
        """Feed `new` at positions start.. and return the draft model's argmax after the last
        of them (over the tokenizer's ids: a padded vocabulary's extra rows never win)."""
        logits = feed(self.model, cache, new, start)  # [1, V]
        return int(argmax(logits[0, : self.draft_tokenizer.vocab_size]))

    def _text_after(self, context: list[int], drafted: list[int]) -> str:
        """The text `drafted` adds after `context`, decoded with the last `LOOKBACK` context
        tokens in front (a decoder may treat a sequence's first token specially)."""
        tail = context[-LOOKBACK:]
        decode = self.draft_tokenizer.decode
        before = decode(tail, skip_special_tokens=False)
        both = decode(tail + drafted, skip_special_tokens=False)
        if both.startswith(before):
            return both[len(before) :]
        return decode(drafted, skip_special_tokens=False)

    def _target_tokens(self, ids: list[int], text: str, draft_text: str) -> list[int]:
        """Target tokens of `draft_text`, continuing the committed `ids` (whose text is `text`):
        the tokens after the last `LOOKBACK` committed ones when re-encoding their text plus
        `draft_text` reproduces them, else `draft_text` encoded alone (module docstring)."""
        encode = self.target_tokenizer.encode
        if not draft_text:
            return []
        window = ids[-LOOKBACK:]
        window_text = self.target_tokenizer.decode(window, skip_special_tokens=False)
        if text.endswith(window_text):
            tokens = encode(window_text + draft_text, add_special_tokens=False)
            if tokens[: len(window)] == window:
                return tokens[len(window) :]
        return encode(draft_text, add_special_tokens=False)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of `a` and `b`."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
