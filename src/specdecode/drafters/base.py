"""The drafter's contract: what it may read of a sequence (`SeqView`), what it needs from the
target (`DrafterNeeds`), the `Drafter` protocol and its typed defaults (`DrafterBase`), the
config protocol and build context every method shares, and the checks of its inputs and
outputs."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol

import torch
from torch import Tensor

from specdecode.cache.kv_cache import KVCache
from specdecode.errors import UserError
from specdecode.model.quant import AUTO, parse_quantization
from specdecode.model.tokenizer import Tokenizer
from specdecode.model.transformer import Transformer
from specdecode.sampling_params import MAX_SPECULATIVE_TOKENS, SamplingParams
from specdecode.tree.token_tree import TokenTree
from specdecode.types import Draft, DraftBudget, TargetOutputs, Verdict

DRAFT_LENGTH_POLICIES = ("fixed", "heuristic", "cost")  # see specdecode.engine.draft_length


class SeqView(Protocol):
    """What a drafter may read of a sequence (the engine's `Request` satisfies it)."""

    @property
    def request_id(self) -> str: ...

    @property
    def token_ids(self) -> list[int]:
        """Committed tokens: prompt + generated, in order."""
        ...

    @property
    def num_prompt_tokens(self) -> int:
        """How many of `token_ids` are the prompt's (the rest were generated)."""
        ...

    @property
    def params(self) -> SamplingParams: ...

    @property
    def generator(self) -> torch.Generator | None:
        """The sequence's random generator (None = torch's default)."""
        ...


def is_positive_int(value: object) -> bool:
    """An int >= 1 (a bool is not)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_draft_length(k: object) -> None:
    """Refuse a num_speculative_tokens that is not an int in 1..MAX_SPECULATIVE_TOKENS."""
    if not is_positive_int(k) or k > MAX_SPECULATIVE_TOKENS:  # type: ignore[operator]
        raise UserError(
            f"num_speculative_tokens must be an int in 1..{MAX_SPECULATIVE_TOKENS}, got {k!r}"
        )


def check_draft_length_policy(policy: object) -> None:
    """Refuse a draft_length that is not one of DRAFT_LENGTH_POLICIES."""
    if policy not in DRAFT_LENGTH_POLICIES:
        choices = ", ".join(DRAFT_LENGTH_POLICIES)
        raise UserError(f"draft_length must be one of {choices}, got {policy!r}")


def check_tree_shape(width: object, depth: object, k: int) -> None:
    """Refuse a tree_width that is not an int in 1..64, or a tree_depth that is not None or an
    int in 1..k (a tree cannot be deeper than its node count), or one given for a chain."""
    if not is_positive_int(width) or width > MAX_SPECULATIVE_TOKENS:  # type: ignore[operator]
        raise UserError(
            f"tree_width must be an int in 1..{MAX_SPECULATIVE_TOKENS} (1 = a chain), got {width!r}"
        )
    if depth is not None and width == 1:
        raise UserError(
            f"tree_depth applies to trees (tree_width > 1); a chain's depth is "
            f"num_speculative_tokens = {k}, got tree_depth {depth!r} with tree_width 1"
        )
    if depth is not None and (not is_positive_int(depth) or depth > k):  # type: ignore[operator]
        raise UserError(
            f"tree_depth must be None (= num_speculative_tokens) or an int in "
            f"1..num_speculative_tokens = 1..{k}, got {depth!r}"
        )


@dataclass(frozen=True, slots=True)
class ModelDrafterConfig:
    """The speculative_config fields every drafter with a "model" (a draft model, a trained
    head) has; each such method's config subclasses it (its own class, so the registry tells
    them apart) and sets `WHAT`, its name in error messages.

    model: the draft model or head folder.
    num_speculative_tokens: draft at most this many tokens per step (K, 1..64; a tree's nodes).
    quantization: the drafter's weight format ("none", "int8", "int4", "gguf", or a GGUF block
        type to requantize into: "q4_0", "q4_1", "q5_0", "q5_1", "q8_0"); None = the target's.
    tree_width: children per expanded node of a dynamic tree (1 = a chain).
    tree_depth: levels of the tree, one drafting pass each (default: K).
    """

    WHAT: ClassVar[str] = "a drafter config"
    default_draft_length: ClassVar[str] = "fixed"

    model: str
    num_speculative_tokens: int
    quantization: str | None = None
    tree_width: int = 1
    tree_depth: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise UserError(f"{self.WHAT} needs 'model' (alias or path), got {self.model!r}")
        self.check_drafting()

    def check_drafting(self) -> None:
        """Refuse a bad num_speculative_tokens, tree shape or quantization."""
        check_draft_length(self.num_speculative_tokens)
        check_tree_shape(self.tree_width, self.tree_depth, self.num_speculative_tokens)
        if self.quantization is not None:
            parse_quantization(self.quantization)

    def weight_format(self, target_format: str | None) -> str | None:
        """The drafter's parsed weight format: its own, else (or for "auto", a load-time choice
        its dense head weights have no file for) the target's."""
        inherited = self.quantization is None or self.quantization == AUTO
        return parse_quantization(target_format if inherited else self.quantization)


def cache_with_room(
    cache: KVCache | None,
    seq: SeqView,
    needed: int,
    extra: int,
    new_cache: Callable[[int], KVCache],
) -> KVCache:
    """A drafter's one-row cache for `seq`: `cache` itself when there is one (a paged cache
    grows as it fills), else `new_cache(capacity)`, its pool sized to start with for the
    prompt, the whole `max_tokens` and `extra` slots (at least `needed`)."""
    if cache is not None:
        return cache
    return new_cache(max(needed, len(seq.token_ids) + seq.params.max_tokens) + extra)


def spread_logits(reduced: Tensor, ids: Tensor, vocab_size: int) -> Tensor:
    """Logits over a reduced draft vocabulary ([..., Vd]; `ids` [Vd] their target ids) spread
    over the target's `vocab_size` tokens ([..., V]), -inf elsewhere: q is exactly 0 there."""
    logits = reduced.new_full((*reduced.shape[:-1], vocab_size), float("-inf"))
    return logits.index_copy_(-1, ids, reduced)


def draft_limits(seqs: Sequence[SeqView], budgets: Sequence[DraftBudget]) -> list[int]:
    """Each sequence's `max_tokens` from `propose`'s `budgets`; refuses arguments that are not
    one budget of max_tokens >= 0 per sequence."""
    if len(budgets) != len(seqs):
        raise ValueError(
            f"budgets needs one entry per sequence: got {len(budgets)} entries "
            f"for {len(seqs)} sequences"
        )
    for seq, budget in zip(seqs, budgets, strict=True):
        if budget.max_tokens < 0:
            raise ValueError(
                f"max_tokens must be >= 0, got {budget.max_tokens} for {seq.request_id!r}"
            )
    return [budget.max_tokens for budget in budgets]


@dataclass(frozen=True, slots=True)
class DrafterNeeds:
    """What a drafter needs from each target pass besides the verdict (`TargetOutputs`).

    hidden_layers: the target's hidden states to hand over, as `Transformer.forward`'s
        `hidden_layers` (the inputs of those blocks; the number of layers means the
        final-normed output); () = none, and the pass keeps nothing and costs nothing more.
    target_argmax: hand over the target's most likely token after each token of the pass
        (lookahead's Jacobi window advances on it).
    """

    hidden_layers: tuple[int, ...] = ()
    target_argmax: bool = False


class Drafter(Protocol):
    """Proposes tokens; the engine never asks which kind of drafter it holds.

    needs: what the drafter needs from each target pass (`DrafterNeeds`); the engine hands it
        over as `commit`'s `target`.
    setup_s: seconds of the latest `propose` spent on one-time work, e.g. a draft model
        prefilling a new sequence's prompt; the draft-length policy leaves them out of its
        per-token drafting cost (they are paid once, not per draft token).
    names: the names a request may give as `SamplingParams.drafter` (a `DrafterMux`'s
        drafters); the engine refuses any other name.

    Subclass `DrafterBase` for the defaults (no needs, 0 s, no names, no catch-up, nothing to
    commit or release); a wrapper forwards all of them from the drafter it wraps.
    """

    needs: DrafterNeeds
    setup_s: float
    names: tuple[str, ...]

    def propose(self, seqs: Sequence[SeqView], budgets: Sequence[DraftBudget]) -> list[Draft]:
        """One draft per sequence, of at most `budgets[i].max_tokens` tokens (0 allowed: no
        draft); a drafter that knows how sure it is may stop a chain at its `chain_bounds`.

        A drafter that samples (q not one-hot) must compute q with
        `specdecode.sampling.probs.probs_from_logits` and the sequence's own `params`, and draw
        with the sequence's `generator`.
        """
        ...

    def catch_up(self, seq: SeqView) -> int:
        """How many of `seq`'s tokens the next `propose` would read as one-time work before
        drafting for it (`setup_s`): a draft model's prefill of a new prompt, or the tokens
        committed while it did not draft; 0 = none. The "cost" draft-length policy prices
        them (`engine.draft_length`)."""
        ...

    def commit(self, seq: SeqView, verdict: Verdict, target: TargetOutputs) -> None:
        """Sync own state (cache, index) after `verdict` (`seq.token_ids` already includes
        it), with what the target's pass handed over (`target`: what `needs` asked for). Also
        called after a prompt's prefill, with an empty draft's verdict (the first token)."""
        ...

    def release(self, request_id: str) -> None:
        """Forget everything about a finished sequence; called once per sequence the engine
        ran (an id the drafter never saw, e.g. a request that finished at its first token,
        must be ignored)."""
        ...


class DrafterBase(ABC):
    """The `Drafter` protocol's typed defaults: a subclass writes `propose` and overrides
    what it uses (`needs`, `setup_s`, `names`, `catch_up`, `commit`, `release`)."""

    needs: DrafterNeeds = DrafterNeeds()
    setup_s: float = 0.0
    names: tuple[str, ...] = ()

    @abstractmethod
    def propose(self, seqs: Sequence[SeqView], budgets: Sequence[DraftBudget]) -> list[Draft]:
        """See `Drafter.propose`."""

    def catch_up(self, seq: SeqView) -> int:
        """No one-time work (see `Drafter.catch_up`)."""
        return 0

    def commit(self, seq: SeqView, verdict: Verdict, target: TargetOutputs) -> None:  # noqa: B027
        """Nothing to sync (see `Drafter.commit`)."""

    def release(self, request_id: str) -> None:  # noqa: B027
        """Nothing to forget (see `Drafter.release`)."""


def grows_trees(config: object) -> bool:
    """Whether `config` describes a drafter that grows dynamic trees from its own
    distributions (a draft model or head with tree_width > 1), which the "cost" draft length
    rule prices whole (`specdecode.engine.draft_length`); a lookup drafter's trie is not."""
    return isinstance(config, ModelDrafterConfig) and config.tree_width > 1


class DrafterConfig(Protocol):
    """What every method's config has (each is a frozen dataclass that validates itself and
    names its registry entry in `method`; `default_draft_length`: the draft length policy a
    `SpeculativeConfig` of it takes when none is given)."""

    method: ClassVar[str]
    default_draft_length: ClassVar[str]

    @property
    def num_speculative_tokens(self) -> int: ...


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """A drafter's config and the engine's draft length policy for it: what
    `parse_speculative_config` makes of vLLM's speculative_config dict (its "draft_length"
    key is the engine's, every other key the drafter's).

    drafter: the method's validated config.
    draft_length: how many of the K tokens a step drafts ("fixed", "heuristic", "cost"; see
        `specdecode.engine.draft_length`); default: the method's `default_draft_length`.
    """

    drafter: DrafterConfig
    draft_length: str

    def __post_init__(self) -> None:
        check_draft_length_policy(self.draft_length)

    @staticmethod
    def of(drafter: DrafterConfig) -> SpeculativeConfig:
        """`drafter` under its method's default policy."""
        return SpeculativeConfig(drafter, type(drafter).default_draft_length)


@dataclass(frozen=True, slots=True)
class DrafterContext:
    """What a factory may use to build a drafter for one target.

    target: the target model (its config: vocabulary size, layers, hidden size).
    tokenizer: the target's tokenizer (EOS ids, the vocabulary a draft model must share).
    load_model: (name, weight format or None for the target's) -> a loaded model and its
        tokenizer; the caller shares loaded models between drafters.
    target_path: the target's model folder (None: a target built in memory).
    """

    target: Transformer
    tokenizer: Tokenizer
    load_model: Callable[[str, str | None], tuple[Transformer, Tokenizer]]
    target_path: Path | None = None


def check_drafter(drafter: object, num_layers: int) -> None:
    """Refuse an object that lacks the `Drafter` protocol's members (naming them), or whose
    `needs` asks for hidden states of layers the target (of `num_layers` blocks) does not
    have."""
    members = ("propose", "catch_up", "commit", "release", "needs", "setup_s", "names")
    missing = [name for name in members if not hasattr(drafter, name)]
    if missing:
        raise UserError(
            f"{type(drafter).__name__} is not a Drafter: it lacks {', '.join(missing)} "
            f"(a Drafter has {', '.join(members)}; subclass "
            "specdecode.drafters.base.DrafterBase for the defaults)"
        )
    needs = drafter.needs  # type: ignore[attr-defined]
    layers = needs.hidden_layers if isinstance(needs, DrafterNeeds) else None
    if not (
        isinstance(layers, tuple)
        and all(isinstance(i, int) and 0 <= i <= num_layers for i in layers)
    ):
        raise UserError(
            f"{type(drafter).__name__}.needs must be a DrafterNeeds whose hidden_layers are "
            f"block indices in 0..{num_layers} ({num_layers} = the final-normed output), got "
            f"{needs!r}"
        )


def check_drafts(drafts: Sequence[Draft], max_tokens: Sequence[int], vocab_size: int) -> None:
    """Refuse drafts that break `propose`'s contract (host-side metadata only, no device sync):
    one draft per sequence, a 1-D int64 tensor of at most max_tokens[i] tokens (a tree's
    nodes), q None or [k_i, vocab_size], and a tree None or of k_i nodes."""
    if len(drafts) != len(max_tokens):
        raise ValueError(
            f"the drafter returned {len(drafts)} drafts for {len(max_tokens)} sequences"
        )
    for i, (draft, limit) in enumerate(zip(drafts, max_tokens, strict=True)):
        tokens = draft.tokens
        if tokens.dim() != 1 or tokens.dtype != torch.long or tokens.numel() > limit:
            raise ValueError(
                f"draft {i} must be a 1-D int64 tensor of at most {limit} tokens, got "
                f"{tuple(tokens.shape)} {tokens.dtype}"
            )
        if draft.probs is not None and tuple(draft.probs.shape) != (tokens.numel(), vocab_size):
            raise ValueError(
                f"draft {i}'s probs must be [{tokens.numel()}, {vocab_size}] or None, got "
                f"{tuple(draft.probs.shape)}"
            )
        tree = draft.tree
        if tree is not None and (not isinstance(tree, TokenTree) or tree.num_nodes != len(tokens)):
            raise ValueError(
                f"draft {i}'s tree must be a TokenTree of {tokens.numel()} nodes (one per "
                f"token) or None, got {tree!r}"
            )
