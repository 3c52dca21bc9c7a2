"""What a request asks for: `SamplingParams` and its `StructuredOutputsParams`, shaped like
vLLM's (`vllm/sampling_params.py` holds both too). Plain values, validated when built."""

from __future__ import annotations

import json as jsonlib
from dataclasses import dataclass, fields
from typing import Any

from specdecode.errors import UserError

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """A constraint on the whole output; set exactly one of the first five fields.

    json: a JSON schema (a dict, or its JSON text; kept as text): the output is one JSON value
        that validates against it (objects keep the schema's property order).
    json_object: True = the output is any JSON object (`response_format: {"type":
        "json_object"}`).
    regex: the output matches this regular expression from start to end.
    choice: the output is exactly one of these strings.
    grammar: an EBNF grammar (xgrammar's GBNF dialect, start rule `root`) the output matches.
    disable_any_whitespace: JSON only: no optional whitespace (a compact one-line value)
        instead of any amount of it between tokens of the JSON syntax.
    Example: StructuredOutputsParams(choice=("yes", "no")) lets the model answer "yes" or "no"
    and then only its end-of-sequence token.
    """

    json: str | dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            object.__setattr__(self, "json", jsonlib.dumps(self.json))
        if self.choice is not None and not isinstance(self.choice, str):
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise UserError(
                f"structured outputs take exactly one of {', '.join(KINDS)}, got "
                f"{', '.join(given) or 'none'}"
            )
        if self.json is not None:
            if not isinstance(self.json, str):
                raise UserError(
                    f"json must be a JSON schema (dict or JSON text), got {self.json!r}"
                )
            try:
                schema = jsonlib.loads(self.json)
            except ValueError as err:
                raise UserError(
                    f"json must be a JSON schema, but its text is not JSON: {err}"
                ) from None
            if not isinstance(schema, (dict, bool)):
                raise UserError(
                    f"a JSON schema is an object or a bool, got {type(schema).__name__}"
                )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise UserError(f"{name} must be a non-empty string, got {value!r}")
        if self.choice is not None and (
            isinstance(self.choice, str)
            or not self.choice
            or any(not isinstance(c, str) or not c for c in self.choice)
        ):
            raise UserError(f"choice must be a list of non-empty strings, got {self.choice!r}")
        if not isinstance(self.json_object, bool) or not isinstance(
            self.disable_any_whitespace, bool
        ):
            raise UserError("json_object and disable_any_whitespace must be true or false")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> StructuredOutputsParams:
        """Build from a dict of fields, naming any unknown key."""
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise UserError(f"structured outputs have no field {unknown}; known: {known}")
        return cls(**values)

    @property
    def kind(self) -> str:
        """Which constraint this is: one of KINDS."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))


MAX_SPECULATIVE_TOKENS = 64  # the longest draft; the engine keeps this many spare cache slots
MAX_LOGPROBS = 20  # the most top log-probabilities per token (OpenAI's limit)
MAX_PENALTY = 2.0  # presence / frequency penalties lie in [-2, 2] (OpenAI's range)
MAX_LOGIT_BIAS = 100.0  # a logit bias lies in [-100, 100] (OpenAI's range)


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
    presence_penalty, frequency_penalty: in [-2, 2]; a token's logit loses presence_penalty
        once it has been generated, and frequency_penalty for every time it has (OpenAI's).
    repetition_penalty: > 0; a token in the prompt or generated has its logit divided by it
        when positive, multiplied when negative (vLLM's, from CTRL); 1 disables.
    logit_bias: token id -> a bias in [-100, 100] added to its logit at every step.
        Penalties and biases apply at every verified position with the tokens before it (the
        drafted ones included), so speculation keeps the output exact under them.
    logprobs: with an int n in 0..20, every generated token comes with its log-probability
        and the n most likely tokens' (`CompletionOutput.logprobs`): the target's raw
        distribution (before penalties, temperature and constraints, as vLLM's default), the
        same with speculation as without. None: none.
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None

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
        self._check_adjustments()
        if self.structured_outputs is not None and self.ignore_eos:
            raise UserError(
                "structured_outputs end with the end-of-sequence token; ignore_eos cannot be set "
                "with them"
            )

    def _check_adjustments(self) -> None:
        """Validate the penalties, the logit bias (a dict becomes sorted (id, bias) pairs)
        and logprobs."""
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise UserError(f"{name} must be a number in [-2, 2] (0 = off), got {value!r}")
        rep = self.repetition_penalty
        if not isinstance(rep, int | float) or not 0.0 < rep < float("inf"):
            raise UserError(f"repetition_penalty must be a number > 0 (1 = off), got {rep!r}")
        bias = self.logit_bias
        pairs = bias.items() if isinstance(bias, dict) else bias
        try:
            checked = tuple(sorted((int(t), float(b)) for t, b in pairs))
        except (TypeError, ValueError):
            raise UserError(
                f"logit_bias must map token ids to numbers in [-100, 100], got {bias!r}"
            ) from None
        for token, value in checked:
            if token < 0 or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise UserError(
                    f"logit_bias maps token ids >= 0 to numbers in [-100, 100], got "
                    f"{token}: {value}"
                )
        object.__setattr__(self, "logit_bias", checked)
        n = self.logprobs
        if n is not None and (
            not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_LOGPROBS
        ):
            raise UserError(
                f"logprobs must be None or an int in 0..{MAX_LOGPROBS} (how many top tokens "
                f"besides the chosen one), got {n!r}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether a penalty or a logit bias changes the target's logits."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )
