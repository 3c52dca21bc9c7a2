"""Frozen dataclasses at stage boundaries: sampling parameters, drafts, verdicts, outputs."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from specdecode.errors import UserError
from specdecode.metrics import SpecCounters
from specdecode.tree.token_tree import TokenTree


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens; shaped like vLLM's `SamplingParams`.

    temperature: 0 means greedy (argmax); > 0 scales the logits before softmax.
    top_k: keep the k most likely tokens; -1 or 0 disables.
    top_p: keep the smallest set of most likely tokens whose probability reaches top_p; 1 disables.
    max_tokens: generate at most this many tokens.
    seed: per-request random seed; the same seed gives the same output.
    stop: strings that end generation; the stop string itself is not part of the text.
    ignore_eos: keep generating past the end-of-sequence token.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        if not self.temperature >= 0.0:
            raise UserError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise UserError(f"top_k must be -1 or 0 (disabled) or a positive int, got {self.top_k}")
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise UserError(f"max_tokens must be a positive int, got {self.max_tokens}")
        if self.seed is not None and (
            not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**64
        ):
            raise UserError(f"seed must be None or an int in [-2**63, 2**64), got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise UserError(f"stop must be non-empty strings, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True, slots=True)
class Draft:
    """The tokens a drafter proposes for one sequence in one step: a chain, or a tree.

    tokens: [K] int64, K >= 0: the chain's tokens in order, or the tree's nodes.
    probs: [K, V] float32, the distribution each token was drawn from (for a tree node: given
        its parent's path and its earlier siblings, e.g. q itself for i.i.d. children, q
        without the earlier siblings for children drawn without replacement); None =
        deterministic tokens (one-hot q).
    tree: the tree's shape (`tree.num_nodes == K`), or None for a chain.
    """

    tokens: Tensor  # [K] int64
    probs: Tensor | None = None  # [K, V] float32
    tree: TokenTree | None = None

    @property
    def is_tree(self) -> bool:
        """A tree with a branch (a chain-shaped tree is verified as a chain)."""
        return self.tree is not None and not self.tree.is_chain


@dataclass(frozen=True, slots=True)
class TargetFeatures:
    """Hidden states of the target for some of a sequence's tokens, from one target pass.

    start: index into the sequence's token_ids of the first token they belong to.
    hidden: [n, F] float: row i belongs to token_ids[start + i] (the state after reading it);
        F = len(layers) * hidden size, in the order the drafter asked for the layers.
    Example: a step fed [last, d1, d2] at token index 9 and accepted d1: start 9, n = 2.
    """

    start: int
    hidden: Tensor  # [n, F]


@dataclass(frozen=True, slots=True)
class Verdict:
    """What verification kept of one sequence's draft."""

    num_accepted: int  # accepted draft tokens, 0..K
    tokens: Tensor  # [num_accepted + 1] int64: accepted tokens + the recovered or bonus token
    path: tuple[int, ...] | None = None  # trees with a branch: accepted nodes, depth 1 first


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """Counters and timings of one request; rates are derived on read."""

    num_prompt_tokens: int
    num_generated_tokens: int
    elapsed_s: float  # from the start of the request to its last token
    time_to_first_token_s: float  # from the start of the request to its first generated token
    spec: SpecCounters = field(default_factory=SpecCounters)  # drafting / acceptance counters

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens / elapsed seconds (end to end, prefill included)."""
        return self.num_generated_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def as_dict(self) -> dict[str, float | int]:
        return {
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generated_tokens": self.num_generated_tokens,
            "elapsed_s": self.elapsed_s,
            "time_to_first_token_s": self.time_to_first_token_s,
            "tokens_per_s": self.tokens_per_s,
            "spec": self.spec.as_dict(),
        }


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    """One generated continuation (vLLM's `CompletionOutput`)."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None  # "stop" (EOS or stop string), "length", or None while running
    stop_reason: str | int | None = None  # the stop string or EOS id that ended it


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """Result of one prompt (vLLM's `RequestOutput`), plus `text`/`token_ids` shortcuts."""

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionOutput, ...]
    finished: bool
    metrics: RequestMetrics | None = field(default=None)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.outputs[0].token_ids
