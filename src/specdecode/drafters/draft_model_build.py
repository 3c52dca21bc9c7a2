"""The draft_model method's config (`DraftModelConfig`, checked as it is built) and factory: a
draft model of the target's vocabulary (`check_same_vocabulary`), its head trimmed (FR-Spec),
its own drafts staged by a model-free drafter, the next draft prepared during verification
(SSD), the end of each prompt alone read (a prompt window)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from specdecode.drafters.base import (
    MAX_SPECULATIVE_TOKENS,
    Drafter,
    DrafterContext,
    ModelDrafterConfig,
    is_positive_int,
)
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.ngram import NgramConfig, NgramDrafter
from specdecode.drafters.overlap import OverlapDrafter
from specdecode.drafters.staged import StagedDrafter, Stager
from specdecode.drafters.suffix import SuffixConfig, SuffixDrafter
from specdecode.drafters.trimmed_head import trimmed_draft_model
from specdecode.drafters.window import PromptWindow
from specdecode.errors import UserError
from specdecode.model.tokenizer import Tokenizer

STAGERS = (None, "ngram", "suffix")  # the model-free drafters that can stage a draft model


@dataclass(frozen=True, slots=True)
class DraftModelConfig(ModelDrafterConfig):
    """speculative_config of a draft model, method "draft_model" (vLLM's form: a "model" key).

    model: the draft model (alias, Hugging Face folder or .gguf), with the target's vocabulary.
    num_speculative_tokens: draft at most this many tokens per step (K, 1..64; a tree's nodes).
    quantization: the draft model's weight format ("none", "int8", "int4", "gguf", "q4_0" ...:
        `model.quant`); None = the target's. "q4_0" with draft_vocab_size is the cheapest.
    tree_width: children per expanded node of a dynamic tree (1 = a chain of sampled tokens).
    tree_depth: levels of the tree, one draft pass each (default: K).
    draft_vocab_size: keep only this many of the draft model's output rows, those of the most
        frequent target tokens (FR-Spec, `drafters.trimmed_head`): an int in 1..vocabulary, at
        least tree_width; None = the whole head.
    staged: "ngram" or "suffix": that model-free drafter guesses the draft model's own drafts,
        checked in one draft-model pass each (staged drafting, `drafters.staged`; chains);
        None = token by token.
    ssd: draft the next step on a second thread while the target verifies (speculative-
        speculative decoding, `drafters.overlap`; chains, greedy requests, K <= 63).
    confidence_threshold: stop a chain after a token the draft model gives a probability below
        this (0..1; HF's assistant_confidence_threshold); None = always K tokens.
    prompt_window: the draft model reads only the last this many tokens of a prompt and its
        first generated token together (fixed then; everything after them too), so its
        prefill costs at most that many (`drafters.window`); None = the whole prompt.

    Its draft length policy is "cost" by default (`default_draft_length`): a draft model
    costs enough that a fixed K loses where its drafts are rarely accepted (docs/drafters.md).
    """

    method: ClassVar[str] = "draft_model"
    WHAT: ClassVar[str] = "a draft_model"
    default_draft_length: ClassVar[str] = "cost"

    draft_vocab_size: int | None = None
    staged: str | None = None
    ssd: bool = False
    confidence_threshold: float | None = None
    prompt_window: int | None = None

    def __post_init__(self) -> None:
        ModelDrafterConfig.__post_init__(self)  # (slots dataclasses break a bare super())
        window = self.prompt_window
        if window is not None and not is_positive_int(window):
            raise UserError(
                f"prompt_window must be None (the whole prompt) or an int >= 1, got {window!r}"
            )
        if self.staged not in STAGERS:
            raise UserError(
                f"staged must be one of {', '.join(repr(s) for s in STAGERS)}, got {self.staged!r}"
            )
        if not isinstance(self.ssd, bool):
            raise UserError(f"ssd must be true or false, got {self.ssd!r}")
        bound = self.confidence_threshold
        if bound is not None and (
            isinstance(bound, bool) or not isinstance(bound, int | float) or not 0 <= bound <= 1
        ):
            raise UserError(f"confidence_threshold must be None or in 0..1, got {bound!r}")
        if bound is not None and (self.staged or self.tree_width > 1):
            raise UserError(
                "confidence_threshold stops a token-by-token chain: it takes neither staged "
                "nor tree_width > 1"
            )
        for name, on in (("staged drafting", self.staged), ("ssd", self.ssd)):
            if on and self.tree_width > 1:
                raise UserError(
                    f"{name} prepares chains: use tree_width 1, got tree_width {self.tree_width}"
                )
        if self.ssd and self.num_speculative_tokens >= MAX_SPECULATIVE_TOKENS:
            raise UserError(
                f"ssd needs num_speculative_tokens <= {MAX_SPECULATIVE_TOKENS - 1} (it drafts "
                f"the predicted bonus token too), got {self.num_speculative_tokens}"
            )
        size = self.draft_vocab_size
        if size is not None and not is_positive_int(size):
            raise UserError(
                "draft_vocab_size must be None (the whole head) or an int in 1..vocabulary "
                f"size, got {size!r}"
            )
        if size is not None and size < self.tree_width:
            raise UserError(
                f"draft_vocab_size {size} is smaller than tree_width {self.tree_width}: each "
                "tree node's children are tree_width distinct kept tokens"
            )


def check_same_vocabulary(target: Tokenizer, draft: Tokenizer, draft_name: str) -> None:
    """Refuse a draft model whose tokens differ from the target's, saying what differs."""
    ours, theirs = target.vocab(), draft.vocab()
    if ours == theirs:
        return
    differ = sorted(
        (t for t in set(ours) | set(theirs) if ours.get(t) != theirs.get(t)),
        key=lambda t: (ours.get(t, -1), t),
    )
    examples = ", ".join(f"{t!r}: target {ours.get(t)}, draft {theirs.get(t)}" for t in differ[:3])
    raise UserError(
        f"draft model {draft_name!r} has a different vocabulary from the target "
        f"({len(theirs)} vs {len(ours)} tokens, {len(differ)} differ, e.g. {examples}); "
        "a draft model must share the target's tokenizer; for a draft model with its own "
        'tokenizer use "method": "cross_tokenizer"'
    )


def build_draft_model_drafter(config: DraftModelConfig, context: DrafterContext) -> Drafter:
    """The registry's factory: load (or share) the draft model, check its vocabulary, trim its
    head to `draft_vocab_size` tokens, stage it, overlap it, window its prompts, as the config
    asks."""
    model, tokenizer = context.load_model(config.model, config.quantization)
    check_same_vocabulary(context.tokenizer, tokenizer, config.model)
    size = config.draft_vocab_size
    draft = model if size is None else trimmed_draft_model(model, context.tokenizer, size)
    k = config.num_speculative_tokens + int(config.ssd)  # SSD drafts the bonus token too
    vocab = context.target.config.vocab_size
    drafter: Drafter
    if config.staged is not None:
        drafter = StagedDrafter(draft, k, vocab, stager(config.staged, k, context))
    else:
        drafter = DraftModelDrafter(
            draft, k, vocab, config.tree_width, config.tree_depth, config.confidence_threshold
        )
    if config.ssd:
        drafter = OverlapDrafter(drafter, config.num_speculative_tokens)
    if config.prompt_window is not None:  # outermost: SSD's hypotheses are windowed too
        drafter = PromptWindow(drafter, config.prompt_window)
    return drafter


def stager(name: str, k: int, context: DrafterContext) -> Stager:
    """The model-free drafter `name` ("ngram" or "suffix", default settings, K = k) that
    guesses a draft model's drafts."""
    eos = context.tokenizer.eos_token_ids
    if name == "ngram":
        return NgramDrafter(NgramConfig(k), eos)
    return SuffixDrafter(SuffixConfig(num_speculative_tokens=k), eos)
