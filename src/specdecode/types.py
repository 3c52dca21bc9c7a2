"""Frozen dataclasses at stage boundaries: draft budgets, drafts, verdicts, what the target
hands a drafter, step events and outputs (the request's parameters:
`specdecode.sampling_params`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from specdecode.energy import joules
from specdecode.metrics import SpecCounters
from specdecode.tree.token_tree import TokenTree


@dataclass(frozen=True, slots=True)
class DraftBudget:
    """What one sequence may draft in one step (the draft-length policy's choice).

    max_tokens: at most this many tokens (a tree's nodes); 0 = no draft.
    chain_bounds: a stopping rule for a drafter that knows how sure it is: after j + 1 draft
        tokens (j = 0, 1, ...), draft another only if the chance that all of them are accepted
        (the product of the drafter's own probabilities of its tokens) is at least
        chain_bounds[j]; () = draft up to max_tokens (`engine.draft_length`).
    """

    max_tokens: int
    chain_bounds: tuple[float, ...] = ()

    def at_most(self, k: int) -> DraftBudget:
        """This budget with at most `k` tokens (the same bounds)."""
        return DraftBudget(min(self.max_tokens, k), self.chain_bounds)


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
class TargetOutputs:
    """What the target's pass over one sequence hands its drafter with the verdict, and only
    what the drafter's `DrafterNeeds` asked for (None otherwise).

    hidden: the hidden states of the tokens the step kept (the last committed token before the
        pass and the accepted ones; after a prefill, every prompt token).
    argmax: the target's most likely token after each token of the pass, kept or not: [0]
        after the last committed token, [n + 1] after draft node n (n + 1 entries for n
        draft tokens).
    """

    hidden: TargetFeatures | None = None
    argmax: tuple[int, ...] | None = None


NO_TARGET_OUTPUTS = TargetOutputs()  # what a drafter that needs nothing receives


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
    num_cached_tokens: int = 0  # prompt tokens the prefix cache gave (not prefilled)

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
            "num_cached_tokens": self.num_cached_tokens,
            "num_generated_tokens": self.num_generated_tokens,
            "elapsed_s": self.elapsed_s,
            "time_to_first_token_s": self.time_to_first_token_s,
            "tokens_per_s": self.tokens_per_s,
            "spec": self.spec.as_dict(),
            "cpu_s": self.cpu_s,
            "energy_j_estimate": self.energy_j,
        }


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A generated token's log-probability under the target's raw distribution at its
    position, and the `top` most likely tokens there ((id, log-probability), best first;
    as many as `SamplingParams.logprobs` asked)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A function call an output holds: the function's name and its arguments as JSON text of
    an object (OpenAI's `function.arguments`), e.g. ToolCall("get_weather", '{"city": "Oslo"}')."""

    name: str
    arguments: str

    def as_openai(self, call_id: str) -> dict[str, Any]:
        """OpenAI's `tool_calls` entry, with the id `call_id`."""
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": call_id, "type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    """One generated continuation (vLLM's `CompletionOutput`)."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None  # "stop" (EOS or stop string), "length", or None while running
    stop_reason: str | int | None = None  # the stop string or EOS id that ended it
    steps: tuple[StepEvent, ...] = ()  # with SamplingParams(step_events=True): every step so far
    logprobs: tuple[TokenLogprob, ...] | None = None  # with SamplingParams(logprobs=n): per token
    tool_calls: tuple[ToolCall, ...] = ()  # LLM.chat with tools: the calls `text` holds


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
