"""Frozen dataclasses at stage boundaries: sampling parameters, drafts, verdicts, outputs."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from specdecode.energy import joules
from specdecode.errors import UserError
from specdecode.metrics import SpecCounters
from specdecode.structured.params import StructuredOutputsParams
from specdecode.tree.token_tree import TokenTree

MAX_SPECULATIVE_TOKENS = 64  # the longest draft; the engine keeps this many spare cache slots


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
    num_speculative_tokens: draft at most this many tokens per step for this request (0 = no
        speculation, plain decoding in the same batch); None = as many as the engine's drafter
        and draft-length policy choose. The output is the same either way.
    drafter: which of the engine's drafters drafts for this request, by name, when it serves
        several (`specdecode.drafters.mux`); None = its first (or only) one.
    step_events: record a `StepEvent` per step in the output (`CompletionOutput.steps`): what
        was drafted, accepted, corrected, and when. Off by default; off costs nothing.
    structured_outputs: a constraint the whole output keeps (JSON schema, JSON object, regex,
        choice or grammar; `StructuredOutputsParams`, or a dict of its fields); it ends with
        the end-of-sequence token, so it cannot go with ignore_eos. Speculation stays exact
        under it.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    num_speculative_tokens: int | None = None
    drafter: str | None = None
    step_events: bool = False
    structured_outputs: StructuredOutputsParams | None = None

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
        k = self.num_speculative_tokens
        if k is not None and (
            not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_SPECULATIVE_TOKENS
        ):
            raise UserError(
                f"num_speculative_tokens must be None (the engine's choice) or an int in "
                f"0..{MAX_SPECULATIVE_TOKENS} (0 = no speculation), got {k!r}"
            )
        if self.drafter is not None and (not isinstance(self.drafter, str) or not self.drafter):
            raise UserError(f"drafter must be None or a drafter's name, got {self.drafter!r}")
        if not isinstance(self.step_events, bool):
            raise UserError(f"step_events must be true or false, got {self.step_events!r}")
        constraint = self.structured_outputs
        if isinstance(constraint, dict):
            constraint = StructuredOutputsParams.from_dict(constraint)
            object.__setattr__(self, "structured_outputs", constraint)
        elif constraint is not None and not isinstance(constraint, StructuredOutputsParams):
            raise UserError(
                "structured_outputs must be None, a StructuredOutputsParams or a dict of its "
                f"fields, got {type(constraint).__name__}"
            )
        if self.structured_outputs is not None and self.ignore_eos:
            raise UserError(
                "structured_outputs end with the end-of-sequence token; ignore_eos cannot be set "
                "with them"
            )

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


FINAL_KINDS = ("sampled", "bonus", "correction")  # values of `StepEvent.final`


@dataclass(frozen=True, slots=True)
class StepEvent:
    """One step of one request, recorded when its `SamplingParams.step_events` is set.

    index: the request's step number (0 = its prefill, which drafts nothing).
    drafted: the draft's tokens (a chain in order, or a tree's nodes); () when none.
    parents: a tree draft's parent node of each node (-1 = the last committed token); None for
        a chain.
    num_accepted: draft tokens the target accepted (a tree's: along `path`).
    path: a tree's accepted nodes, depth 1 first; None for a chain.
    final: what the target's own token after the accepted ones is: "sampled" (nothing was
        drafted), "bonus" (the whole draft, or a whole tree branch, was accepted) or
        "correction" (it replaces the first rejected draft token).
    tokens: the tokens this step committed: the accepted ones, then the target's own token;
        fewer when the request ended inside the step (EOS, token limit, stop string).
    pieces: the detokenizer's text for each of `tokens` ("" for a token that completes no
        character yet, and for the EOS token); they join to the step's text before stop
        strings are cut.
    draft_s: seconds of drafting spent on this request in this step.
    verify_s: seconds of the step's target pass and verification (one pass for the batch).
    batch_size: requests in the step's batch.
    elapsed_s: seconds from the request's arrival to this step's commit.
    Example: drafted (5, 6, 7), num_accepted 1, final "correction", tokens (5, 9): 5 was
    accepted, 6 rejected and replaced by the target's 9, 7 never checked.
    """

    index: int
    drafted: tuple[int, ...]
    parents: tuple[int, ...] | None
    num_accepted: int
    path: tuple[int, ...] | None
    final: str
    tokens: tuple[int, ...]
    pieces: tuple[str, ...]
    draft_s: float
    verify_s: float
    batch_size: int
    elapsed_s: float

    def as_dict(self) -> dict[str, object]:
        """The event as JSON-ready values (lists for tuples)."""
        return {
            "index": self.index,
            "drafted": list(self.drafted),
            "parents": None if self.parents is None else list(self.parents),
            "num_accepted": self.num_accepted,
            "path": None if self.path is None else list(self.path),
            "final": self.final,
            "tokens": list(self.tokens),
            "pieces": list(self.pieces),
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
            "batch_size": self.batch_size,
            "elapsed_s": self.elapsed_s,
        }


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """Counters and timings of one request; rates are derived on read."""

    num_prompt_tokens: int
    num_generated_tokens: int
    elapsed_s: float  # from the start of the request to its last token
    time_to_first_token_s: float  # from the start of the request to its first generated token
    spec: SpecCounters = field(default_factory=SpecCounters)  # drafting / acceptance counters
    cpu_s: float = 0.0  # CPU seconds of its prefill and its share of each batch step

    @property
    def energy_j(self) -> float:
        """Estimated joules (`specdecode.energy`: CPU seconds x a per-core power figure)."""
        return joules(self.cpu_s)

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
            "cpu_s": self.cpu_s,
            "energy_j_estimate": self.energy_j,
        }


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    """One generated continuation (vLLM's `CompletionOutput`)."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None  # "stop" (EOS or stop string), "length", or None while running
    stop_reason: str | int | None = None  # the stop string or EOS id that ended it
    steps: tuple[StepEvent, ...] = ()  # with SamplingParams(step_events=True): every step so far


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
