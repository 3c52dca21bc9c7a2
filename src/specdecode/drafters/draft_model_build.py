"""The draft_model method's factory: a draft model, its head trimmed (FR-Spec), its own drafts
staged by a model-free drafter, the next draft prepared during verification (SSD), the end of
each prompt alone read (a prompt window)."""

from __future__ import annotations

from specdecode.drafters.base import Drafter, DrafterContext
from specdecode.drafters.draft_model import (
    DraftModelConfig,
    DraftModelDrafter,
    check_same_vocabulary,
)
from specdecode.drafters.ngram import NgramConfig, NgramDrafter
from specdecode.drafters.overlap import OverlapDrafter
from specdecode.drafters.staged import StagedDrafter, Stager
from specdecode.drafters.suffix import SuffixConfig, SuffixDrafter
from specdecode.drafters.trimmed_head import trimmed_draft_model
from specdecode.drafters.window import PromptWindow


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
