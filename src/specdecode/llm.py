"""`LLM`: the Python API, shaped like vLLM's (`LLM(...).generate(prompts, SamplingParams(...))`)."""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Iterator, Mapping, Sequence
from contextlib import closing
from pathlib import Path
from typing import Any

import torch

from specdecode.drafters.base import Drafter, SpeculativeConfig, check_drafter, grows_trees
from specdecode.drafters.mux import DrafterMux
from specdecode.drafters.registry import (
    DrafterConfig,
    DrafterContext,
    build_drafter,
    drafter_name,
    parse_speculative_config,
)
from specdecode.engine.draft_length import DraftLength
from specdecode.engine.engine import Engine
from specdecode.engine.request import Request
from specdecode.engine.scheduler import SchedulerConfig
from specdecode.errors import UserError
from specdecode.metrics import SpecCounters
from specdecode.model.loading import load_model
from specdecode.model.quant import parse_quantization
from specdecode.model.registry import resolve_model
from specdecode.model.tokenizer import Tokenizer
from specdecode.model.transformer import Transformer
from specdecode.sampling_params import SamplingParams, StructuredOutputsParams
from specdecode.tool_calls.request import ToolRequest, tool_request
from specdecode.tool_calls.tools import template_messages
from specdecode.types import RequestOutput

# A prompt: text, or vLLM's tokens form {"prompt_token_ids": [...]}.
Prompt = str | Mapping[str, Any]
Messages = list[dict[str, Any]]


class LLM:
    """A loaded model that generates text.

    model: an alias (`specdecode models`), a Hugging Face folder, or a .gguf file.
    dtype: "bfloat16" (default, fast on CPU), "float32" (exact reference), "float16" or "auto".
    speculative_config: None for plain decoding, or vLLM's form, e.g.
        {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4,
        "prompt_lookup_min": 2} or {"model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 3}
        (the methods and their keys: `specdecode.drafters.registry.DRAFTERS`). Output is the
        same either way (greedy: token for token; sampling: the same distribution).
    device: where weights and caches live ("cpu", "cuda", ...).
    quantization: the target's weight format: "auto" (default: "gguf" for a pulled alias or a
        .gguf file on the CPU, the file's own blocks; None otherwise), None (= "none",
        `dtype`), "int8" (dynamic int8), "int4" (weight-only int4) or "gguf"; see
        `specdecode.model.quant`. `self.model.quantization` is the format it resolved to. A
        draft model takes the same format (resolved for it) unless speculative_config's
        "quantization" says otherwise. Speculation is
        exact relative to the quantized target: the target is the model you run.
    drafter: your own `Drafter` instead of a speculative_config (not both).
    scheduler: the continuous batch's limits (`SchedulerConfig`; default: no KV limit, 256
        requests running at once). `LLM` builds the one `Engine` that `generate`, `stream`
        and a server (`specdecode.server.app.build_app`) all run.
    """

    def __init__(
        self,
        model: str,
        dtype: str = "bfloat16",
        speculative_config: Mapping[str, Any] | None = None,
        device: str = "cpu",
        quantization: str | None = "auto",
        drafter: Drafter | None = None,
        scheduler: SchedulerConfig | None = None,
    ) -> None:
        if speculative_config is not None and drafter is not None:
            raise UserError("give either speculative_config or drafter, not both")
        spec = None if speculative_config is None else parse_speculative_config(speculative_config)
        path = resolve_model(model)
        self.model_name = model  # as given: an alias, a folder or a .gguf file
        self.model_path = path
        self.model = load_model(path, dtype=dtype, device=device, quantization=quantization)
        self.quantization = quantization  # as asked: draft models follow it ("auto" included)
        self.scheduler = scheduler or SchedulerConfig()  # derived LLMs keep it
        self.tokenizer = Tokenizer.from_folder(path)
        if self.tokenizer.vocab_size > self.model.config.vocab_size:
            raise UserError(
                f"tokenizer has {self.tokenizer.vocab_size} tokens but the model only "
                f"{self.model.config.vocab_size}: they do not belong together"
            )
        # (path, format) -> loaded draft model and tokenizer, shared with derived LLMs
        self._loaded: dict[tuple[Path, str | None], tuple[Transformer, Tokenizer]] = {}
        if drafter is not None:
            check_drafter(drafter, self.model.config.num_layers)
        self._use_drafter(spec, drafter)
        self._ids = itertools.count()

    def with_speculative_config(
        self, speculative_config: Mapping[str, Any] | SpeculativeConfig | DrafterConfig | None
    ) -> LLM:
        """Another LLM on this one's loaded target and tokenizer, with its own drafter.

        Nothing is loaded twice: the target's weights are shared, and so is every draft model
        that this LLM or one derived from it has loaded. Metrics start from zero. Used to compare
        methods on one set of weights (the bench). `speculative_config` may also be an
        already validated `SpeculativeConfig`, or a registry config (`DrafterConfig`, under its
        method's default draft length).
        """
        other = copy.copy(self)
        spec = None if speculative_config is None else parse_speculative_config(speculative_config)
        other._use_drafter(spec, None)
        other._ids = itertools.count()
        return other

    def with_drafters(self, configs: Sequence[Mapping[str, Any]]) -> LLM:
        """Another LLM on this one's target whose engine serves several drafters: each
        request picks one with `SamplingParams.drafter` (default: the first). Each config is a
        speculative_config plus an optional "name" (default: its method, and ":" and its
        model for a draft model or head). With several, every config's draft_length must be
        "fixed"."""
        if not configs:
            raise UserError("with_drafters needs at least one speculative_config")
        other = copy.copy(self)  # builds the drafters: loading leaves this LLM as it is
        named: dict[str, tuple[Drafter, int]] = {}
        parsed = []
        for raw in configs:
            if not isinstance(raw, Mapping):
                raise UserError(f"speculative_config must be a dict, got {type(raw).__name__}")
            given = dict(raw)
            name = given.pop("name", None)
            spec = parse_speculative_config(given)
            name = name or drafter_name(spec.drafter)
            if not isinstance(name, str) or name in named:
                raise UserError(
                    f"drafter name {name!r} is taken or not a string; give each "
                    'speculative_config its own "name"'
                )
            default = type(spec.drafter).default_draft_length
            if len(configs) > 1 and spec.draft_length not in ("fixed", default):
                raise UserError(
                    f"drafter {name!r}: draft_length {spec.draft_length!r} needs the "
                    'drafter alone; drafters served together use "fixed"'
                )
            named[name] = (other._build_drafter(spec.drafter), spec.drafter.num_speculative_tokens)
            parsed.append(spec)
        served = tuple((name, k) for name, (_, k) in named.items())
        other._use_drafter(parsed[0], DrafterMux(named), _draft_length(parsed), served)
        other._ids = itertools.count()
        return other

    def _build_drafter(self, config: DrafterConfig) -> Drafter:
        """The drafter `config` describes, on this LLM's target (draft models shared)."""
        context = DrafterContext(
            self.model, self.tokenizer, self._load_draft_model, self.model_path
        )
        return build_drafter(config, context)

    def _use_drafter(
        self,
        spec: SpeculativeConfig | None,
        drafter: Drafter | None,
        draft_length: DraftLength | None = None,
        served: tuple[tuple[str, int], ...] = (),
    ) -> None:
        """Build the engine around `drafter` (with `draft_length`; `served`: the names and K
        of the drafters it muxes, the default first), or the one `spec` describes (neither:
        plain decoding); metrics start from zero."""
        self.speculative_config = spec  # the validated speculative_config, or None
        # the drafters a request may name (`SamplingParams.drafter`) and their K, the default
        # first; empty for one drafter without names
        self.served_drafters = served
        self.draft_model: Transformer | None = None  # the draft model the drafter runs, if any
        if spec is not None and drafter is None:
            drafter = self._build_drafter(spec.drafter)
            draft_length = _draft_length([spec])
        self.engine = Engine(self.model, self.tokenizer, drafter, draft_length, self.scheduler)
        self.spec_metrics = SpecCounters()  # all requests of this LLM added together

    def set_scheduler(self, scheduler: SchedulerConfig) -> None:
        """Set the continuous batch's limits of this LLM's engine (e.g. a KV budget computed
        from the loaded model); refused while a request is in flight."""
        self.engine.configure(scheduler)
        self.scheduler = scheduler

    def _load_draft_model(
        self, name: str, quantization: str | None
    ) -> tuple[Transformer, Tokenizer]:
        """A draft model and its tokenizer in `quantization` (None: the format asked of the
        target, so "auto" picks per model), loaded once per LLM family; remembered as this LLM's
        `draft_model`."""
        fmt = self.quantization if quantization is None else quantization
        key = resolve_model(name), parse_quantization(fmt)
        if key not in self._loaded:
            path, fmt = key
            device = str(self.model.device)
            model = load_model(path, self.model.dtype, device, fmt)
            self._loaded[key] = model, Tokenizer.from_folder(path)
        self.draft_model = self._loaded[key][0]
        return self._loaded[key]

    def make_request(
        self, prompt: Prompt, params: SamplingParams, request_id: str | None = None
    ) -> Request:
        """A `Request` for this LLM's engine (a fresh numeric id unless `request_id` is given);
        refuses a prompt that is empty, too long for the context or outside the vocabulary."""
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
            text, ids = None, [int(t) for t in prompt["prompt_token_ids"]]
            self.check_token_ids(ids, "prompt_token_ids")
        else:
            raise UserError(
                "a prompt must be a str or {'prompt_token_ids': [...]}, "
                f"got {type(prompt).__name__}"
            )
        return Request(
            str(next(self._ids)) if request_id is None else request_id,
            text,
            ids,
            params,
            self.tokenizer.eos_token_ids,
            self.model.config.max_position_embeddings,
            self.model.device,
        )

    def check_token_ids(self, ids: list[int], what: str) -> None:
        """Refuse token ids outside the model's vocabulary, naming them as `what`."""
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise UserError(f"{what} {bad[:5]} are outside the vocabulary [0, {vocab})")

    def _requests(
        self, prompts: Prompt | list[Prompt], params: SamplingParams | list[SamplingParams] | None
    ) -> list[Request]:
        prompts = [prompts] if isinstance(prompts, str | Mapping) else list(prompts)
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise UserError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        return [self.make_request(p, sp) for p, sp in zip(prompts, params, strict=True)]

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate a completion for each prompt, as one batch; outputs keep the prompts' order."""
        reqs = self._requests(prompts, sampling_params)
        finals = {out.request_id: out for out in self._finished(reqs)}
        return [finals[r.request_id] for r in reqs]

    def generate_as_finished(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> Iterator[RequestOutput]:
        """As `generate`, one batch, but each output is yielded when its request finishes
        (finish order; e.g. to count progress)."""
        return self._finished(self._requests(prompts, sampling_params))

    def _finished(self, reqs: list[Request]) -> Iterator[RequestOutput]:
        """Run `reqs` to the end; yield each one's final output once, adding its counters to
        `spec_metrics`."""
        for event in self.engine.stream(reqs):
            if event.output.finished:
                self.spec_metrics += event.request.spec
                yield event.output

    def stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Generate for one prompt, yielding a cumulative `RequestOutput` whenever text lands."""
        (req,) = self._requests(prompt, sampling_params)
        with closing(self.engine.stream([req])) as events:  # released even if we stop early
            for event in events:
                yield event.output
        self.spec_metrics += req.spec

    def chat_prompt(
        self, messages: Messages, tools: ToolRequest | None = None
    ) -> dict[str, list[int]]:
        """Render one conversation (assistant tool calls and tool results included) and the
        tools it offers with the model's chat template into a tokens prompt."""
        offered = None if tools is None else tools.template_tools()
        text = self.tokenizer.apply_chat_template(
            template_messages(messages), add_generation_prompt=True, tools=offered
        )
        return {"prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)}

    def tool_request(
        self,
        tools: Sequence[Mapping[str, Any]] | None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool = True,
        tool_call_parser: str | None = None,
    ) -> ToolRequest | None:
        """A chat's tools checked against this model's chat template (None without tools);
        UserError says what is wrong (`tool_calls.request.tool_request`)."""
        return tool_request(
            tools,
            tool_choice,
            parallel_tool_calls,
            self.tokenizer.chat_template,
            self.model_name,
            tool_call_parser,
        )

    def chat(
        self,
        messages: Messages | list[Messages],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool = True,
        tool_call_parser: str | None = None,
    ) -> list[RequestOutput]:
        """Generate the assistant's reply to one conversation or to each of several.

        tools: functions the model may call, in OpenAI's shape ({"type": "function",
        "function": {"name", "description", "parameters"}}); tool_choice: "auto" (default
        with tools: the model decides, its calls read by its family's parser, which
        `tool_call_parser` may name: hermes, llama3_json, mistral), "none", "required" (at
        least one call) or {"type": "function", "function": {"name": ...}} (that function);
        the last two constrain the output, so the calls always parse. Each output's
        `tool_calls` holds the calls its `text` makes.
        """
        if not isinstance(messages, list) or not messages:
            raise UserError("messages must be a non-empty list of {'role', 'content'} dicts")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        request = self.tool_request(tools, tool_choice, parallel_tool_calls, tool_call_parser)
        prompts = [self.chat_prompt(c, request) for c in conversations]
        if request is None:
            return self.generate(prompts, sampling_params)
        rule = request.constraint()
        if rule is not None:
            sampling_params = _constrained(sampling_params, rule)
        return [request.apply(out) for out in self.generate(prompts, sampling_params)]

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def weight_format(self) -> str:
        """What the target runs in, for people: e.g. "gguf (bfloat16 activations)", "int8
        (float32 activations)" or "bfloat16"."""
        dtype = str(self.model.dtype).removeprefix("torch.")
        fmt = self.model.quantization
        return dtype if fmt is None else f"{fmt} ({dtype} activations)"


def _constrained(
    params: SamplingParams | list[SamplingParams] | None, rule: StructuredOutputsParams
) -> SamplingParams | list[SamplingParams]:
    """`params` with the tool choice's constraint (UserError if one has its own)."""
    many = params if isinstance(params, list) else [params or SamplingParams()]
    if any(p.structured_outputs is not None for p in many):
        raise UserError(
            'tool_choice "required" or a named function constrains the output itself; drop '
            "the sampling params' structured_outputs"
        )
    out = [dataclasses.replace(p, structured_outputs=rule) for p in many]
    return out if isinstance(params, list) else out[0]


def _draft_length(specs: Sequence[SpeculativeConfig]) -> DraftLength:
    """The engine's draft length policy for the drafters of `specs` behind one engine: one
    drafter's own policy (its trees priced whole: `grows_trees`), else "fixed" at the
    largest K (`LLM.with_drafters` refuses another policy for several)."""
    most = max(spec.drafter.num_speculative_tokens for spec in specs)
    if len(specs) > 1:
        return DraftLength("fixed", most)
    return DraftLength(specs[0].draft_length, most, grows_trees(specs[0].drafter))
