"""The request bodies the server accepts (OpenAI's fields, `response_format` included, plus
vLLM's `top_k`, `ignore_eos`, `structured_outputs` and `guided_*`, and ours:
`num_speculative_tokens`, `drafter` and `step_events`, see `SamplingParams`) and the response
objects it sends. Unknown fields are ignored, as vLLM does; a string that is not valid Unicode
is a 400; what we cannot honour (`best_of` other than `n`, `echo` with `logprobs`,
`step_events` with `n` > 1) is refused with a 400 that names the field."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from specdecode import energy
from specdecode.errors import UserError
from specdecode.metrics import SpecCounters
from specdecode.model.tokenizer import check_unicode
from specdecode.sampling_params import (
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_SPECULATIVE_TOKENS,
    SamplingParams,
    StructuredOutputsParams,
)
from specdecode.server.errors import bad_request
from specdecode.types import RequestOutput

MAX_CHOICES = 16  # the most choices (n) one request may ask for: each one runs as a request


class _Body(BaseModel):
    """A request body's part: unknown fields ignored (as vLLM does), and every string in it,
    however deep, valid Unicode (a lone surrogate is a 400 naming the field, not a crash in
    the tokenizer or the JSON encoder)."""

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value: Any, info: ValidationInfo) -> Any:
        for text in _strings(value):
            check_unicode(text, "the text")
        return value


def _strings(value: Any) -> Any:
    """Every str in `value` (lists, tuples and dicts, keys too; a model checks its own)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _strings(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(key)
            yield from _strings(item)


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    """`response_format.json_schema`: OpenAI's named schema."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's `response_format`: "text" (no constraint), "json_object" (any JSON object) or
    "json_schema" (JSON valid against `json_schema.schema`)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Sampling(_Body):
    """Fields shared by completions and chat completions."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    best_of: int | None = None
    ignore_eos: bool = False
    presence_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    repetition_penalty: float = Field(1.0, gt=0.0)
    logit_bias: dict[str, float] | None = None
    num_speculative_tokens: int | None = Field(None, ge=0, le=MAX_SPECULATIVE_TOKENS)
    drafter: str | None = None
    step_events: bool = False
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def constraint(self) -> StructuredOutputsParams | None:
        """The output's constraint, from whichever one of `response_format` (not "text"),
        `structured_outputs` and the `guided_*` fields is given (400 for two, or a bad one)."""
        found: list[tuple[str, dict[str, Any]]] = []
        form = self.response_format
        if form is not None and form.type == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif form is not None and form.type == "json_schema":
            if form.json_schema is None or form.json_schema.json_schema is None:
                raise bad_request(
                    'response_format of type "json_schema" needs json_schema.schema',
                    "response_format",
                )
            found.append(("response_format", {"json": form.json_schema.json_schema}))
        if self.structured_outputs is not None:
            found.append(("structured_outputs", self.structured_outputs))
        for kind in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{kind}")
            if value is not None:
                found.append((f"guided_{kind}", {kind: value}))
        if not found:
            return None
        if len(found) > 1:
            names = ", ".join(name for name, _ in found)
            raise bad_request(f"give one output constraint, got {names}", found[1][0])
        name, fields = found[0]
        try:
            return StructuredOutputsParams.from_dict(fields)
        except (UserError, TypeError) as error:
            raise bad_request(str(error), name) from error

    def logprob_count(self) -> int | None:
        """How many top tokens each generated token's log-probability comes with (None: no
        log-probabilities); the two routes spell it differently."""
        raise NotImplementedError

    def refuse_unsupported(self) -> None:
        """400 for combinations we cannot honour."""
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request(
                f"best_of is not supported (only equal to n, {self.n}), got {self.best_of}",
                "best_of",
            )
        if self.step_events and self.n > 1:
            raise bad_request("step_events needs n = 1 (one choice)", "step_events")

    def bias(self) -> dict[int, float]:
        """`logit_bias` with int keys (400 for a key that is not a token id)."""
        try:
            return {int(token): value for token, value in (self.logit_bias or {}).items()}
        except ValueError:
            raise bad_request(
                'logit_bias maps token ids (as strings, e.g. "50256") to a bias in '
                f"[-100, 100], got keys {sorted(self.logit_bias or {})[:5]}",
                "logit_bias",
            ) from None

    def sampling_params(
        self, max_tokens: int, choice: int = 0, rule: StructuredOutputsParams | None = None
    ) -> SamplingParams:
        """The engine's parameters for choice number `choice` (its seed is `seed + choice`,
        as vLLM's), with `max_tokens` already resolved; `rule`: the tool choice's constraint
        (400 when the body gives its own too)."""
        self.refuse_unsupported()
        own = self.constraint()
        if rule is not None and own is not None:
            raise bad_request(
                'tool_choice "required" or a named function constrains the output itself; '
                "drop response_format, structured_outputs and guided_*",
                "tool_choice",
            )
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stop):
            raise bad_request("stop strings must not be empty", "stop")
        try:
            return SamplingParams(
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                max_tokens=max_tokens,
                seed=None if self.seed is None else self.seed + choice,
                stop=tuple(stop),
                ignore_eos=self.ignore_eos,
                num_speculative_tokens=self.num_speculative_tokens,
                drafter=self.drafter,
                step_events=self.step_events,
                structured_outputs=rule or own,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty,
                logit_bias=self.bias(),
                logprobs=self.logprob_count(),
            )
        except UserError as error:
            raise bad_request(str(error)) from error

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    """POST /v1/completions: one prompt, as text or token ids."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def logprob_count(self) -> int | None:
        return self.logprobs

    def prompt_one(self) -> str | list[int]:
        """The prompt as one text or one list of token ids (400 for several prompts)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise bad_request(
                    f"one prompt per request is supported, got {len(prompt)}", "prompt"
                )
            prompt = prompt[0]
        if not prompt:
            raise bad_request("the prompt is empty", "prompt")
        if self.echo and self.logprobs is not None:
            raise bad_request(
                "echo with logprobs is not supported (the prompt's log-probabilities are not "
                "computed); drop one of them",
                "echo",
            )
        return prompt  # type: ignore[return-value]


class ChatMessage(_Body):
    """One message of a conversation: a text, or a list of text parts; an assistant's may
    hold the `tool_calls` it made, a `tool` message answers one (`tool_call_id`)."""

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def as_template(self) -> dict[str, Any]:
        """The message as the chat template reads it (fields left unset are left out)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        return message

    def text(self) -> str:
        """The message's text (a list of parts must hold only text parts)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(
                    f"only text content parts are supported, got {part.get('type')!r}",
                    "messages",
                )
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True

    # OpenAI's fields we do not implement, refused by name (the rest of what we do not read,
    # e.g. `user`, `metadata`, `store`, is accepted and ignored: docs/serving.md lists it).
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        for field, instead in (
            ("functions", "tools"),
            ("function_call", "tool_choice"),
            ("prediction", "a drafter (--speculative-config)"),
            ("audio", "text"),
        ):
            if getattr(self, field) is not None:
                raise bad_request(f"{field} is not supported; use {instead}", field)
        if self.modalities not in (None, ["text"]):
            raise bad_request(
                f'only the "text" modality is served, got {self.modalities}', "modalities"
            )

    def logprob_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def conversation(self) -> list[dict[str, Any]]:
        return [m.as_template() for m in self.messages]


class TokenizeRequest(_Body):
    """POST /tokenize: a prompt or a conversation (vLLM's shape)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(_Body):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[int]


def usage(outs: Sequence[RequestOutput]) -> dict[str, Any]:
    """OpenAI's usage object for a response's choices (the prompt counted once, with the
    tokens the prefix cache gave as `prompt_tokens_details.cached_tokens`; the completions
    summed) plus `speculative_decoding` (their drafting counters, summed) and
    `energy` (their CPU seconds and the energy they are estimated at, `specdecode.energy`)."""
    spec = SpecCounters()
    cpu_s = energy_j = 0.0
    for out in outs:
        assert out.metrics is not None
        spec += out.metrics.spec
        cpu_s += out.metrics.cpu_s
        energy_j += out.metrics.energy_j
    prompt = len(outs[0].prompt_token_ids)
    completion = sum(len(out.token_ids) for out in outs)
    cached = outs[0].metrics.num_cached_tokens if outs[0].metrics is not None else 0
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        "speculative_decoding": {
            "num_drafts": spec.num_drafts,
            "num_draft_tokens": spec.num_draft_tokens,
            "num_accepted_tokens": spec.num_accepted_tokens,
            "acceptance_rate": spec.acceptance_rate,
            "mean_acceptance_length": spec.mean_acceptance_length,
            "accepted_per_position": list(spec.accepted_per_position),
        },
        "energy": {
            "cpu_s": cpu_s,
            "joules_estimate": energy_j,
            "joules_per_token_estimate": energy_j / max(1, completion),
            "method": energy.method(),
        },
    }


def envelope(kind: str, request_id: str, model: str, created: int | None = None) -> dict:
    """The fields every completion object and chunk starts with."""
    return {
        "id": request_id,
        "object": kind,
        "created": int(time.time()) if created is None else created,
        "model": model,
    }
