"""`LLM`: the Python API, shaped like vLLM's (`LLM(...).generate(prompts, SamplingParams(...))`)."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from specdecode.drafters.base import Drafter
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.ngram import NgramConfig, NgramDrafter
from specdecode.engine.engine import Engine
from specdecode.engine.sequence import Sequence
from specdecode.metrics import SpecCounters
from specdecode.model.loading import load_model
from specdecode.model.quant import parse_quantization
from specdecode.model.registry import resolve_model
from specdecode.model.tokenizer import Tokenizer
from specdecode.model.transformer import Transformer
from specdecode.spec_config import SpecConfig
from specdecode.types import RequestOutput, SamplingParams

# A prompt: text, or vLLM's tokens form {"prompt_token_ids": [...]}.
Prompt = str | Mapping[str, Any]
Messages = list[dict[str, str]]


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
    raise ValueError(
        f"draft model {draft_name!r} has a different vocabulary from the target "
        f"({len(theirs)} vs {len(ours)} tokens, {len(differ)} differ, e.g. {examples}); "
        "a draft model must share the target's tokenizer"
    )


class LLM:
    """A loaded model that generates text.

    model: an alias (`specdecode models`), a Hugging Face folder, or a .gguf file.
    dtype: "bfloat16" (default, fast on CPU), "float32" (exact reference), "float16" or "auto".
    speculative_config: None for plain decoding, or vLLM's form, e.g.
        {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4,
        "prompt_lookup_min": 2} (see `SpecConfig`). Output is the same either way (greedy:
        token for token; sampling: the same distribution).
    device: where weights and caches live ("cpu", "cuda", ...).
    quantization: the target's weight format: None (= "none", `dtype`), "int8" (dynamic int8)
        or "int4" (weight-only int4); see `specdecode.model.quant`. A draft model takes the
        same format unless speculative_config's "quantization" says otherwise. Speculation is
        exact relative to the quantized target: the target is the model you run.
    """

    def __init__(
        self,
        model: str,
        dtype: str = "bfloat16",
        speculative_config: Mapping[str, Any] | None = None,
        device: str = "cpu",
        quantization: str | None = None,
    ) -> None:
        self.spec_config = (
            None if speculative_config is None else SpecConfig.from_dict(speculative_config)
        )
        path = resolve_model(model)
        self.model_name = model  # as given: an alias, a folder or a .gguf file
        self.model_path = path
        self.model = load_model(path, dtype=dtype, device=device, quantization=quantization)
        self.tokenizer = Tokenizer.from_folder(path)
        if self.tokenizer.vocab_size > self.model.config.vocab_size:
            raise ValueError(
                f"tokenizer has {self.tokenizer.vocab_size} tokens but the model only "
                f"{self.model.config.vocab_size}: they do not belong together"
            )
        # (path, format) -> loaded draft model, shared with `with_speculative_config`
        self._draft_models: dict[tuple[Path, str | None], Transformer] = {}
        self.engine = Engine(self.model, self._drafter())
        self.spec_metrics = SpecCounters()  # all requests of this LLM added together
        self._ids = itertools.count()

    def with_speculative_config(self, speculative_config: Mapping[str, Any] | None) -> LLM:
        """Another LLM on this one's loaded target and tokenizer, with its own drafter.

        Nothing is loaded twice: the target's weights are shared, and so is every draft model
        that this LLM or one derived from it has loaded. Metrics start from zero. Used to compare
        methods on one set of weights (`specdecode bench`).
        """
        other = copy.copy(self)
        other.spec_config = (
            None if speculative_config is None else SpecConfig.from_dict(speculative_config)
        )
        other.engine = Engine(self.model, other._drafter())
        other.spec_metrics = SpecCounters()
        other._ids = itertools.count()
        return other

    @property
    def draft_model(self) -> Transformer | None:
        """The draft model this LLM speculates with; None for plain decoding and n-gram lookup."""
        if self.spec_config is None or self.spec_config.model is None:
            return None
        return self._draft_models[self._draft_key(self.spec_config)]

    def _draft_key(self, spec: SpecConfig) -> tuple[Path, str | None]:
        """Which loaded draft model `spec` asks for: its path and weight format."""
        assert spec.model is not None  # SpecConfig checks that a draft_model has one
        quantization = self.model.quantization if spec.quantization is None else spec.quantization
        return resolve_model(spec.model), parse_quantization(quantization)

    def _drafter(self) -> Drafter | None:
        """The drafter `speculative_config` asks for (None = plain decoding)."""
        spec = self.spec_config
        if spec is None:
            return None
        if spec.method == "ngram":
            config = NgramConfig(
                spec.num_speculative_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min
            )
            return NgramDrafter(config, self.tokenizer.eos_token_ids)
        key = self._draft_key(spec)
        draft_path, quantization = key
        check_same_vocabulary(self.tokenizer, Tokenizer.from_folder(draft_path), spec.model)
        draft = self._draft_models.get(key)
        if draft is None:
            device = str(self.model.device)
            draft = load_model(draft_path, self.model.dtype, device, quantization)
            self._draft_models[key] = draft
        return DraftModelDrafter(draft, spec.num_speculative_tokens, self.model.config.vocab_size)

    def _sequence(self, prompt: Prompt, params: SamplingParams) -> Sequence:
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
            text, ids = None, [int(t) for t in prompt["prompt_token_ids"]]
            bad = [t for t in ids if not 0 <= t < self.model.config.vocab_size]
            if bad:
                raise ValueError(
                    f"prompt_token_ids {bad[:5]} are outside the vocabulary "
                    f"[0, {self.model.config.vocab_size})"
                )
        else:
            raise TypeError(
                "a prompt must be a str or {'prompt_token_ids': [...]}, "
                f"got {type(prompt).__name__}"
            )
        return Sequence(
            str(next(self._ids)),
            text,
            ids,
            params,
            self.tokenizer,
            self.model.config.max_position_embeddings,
            self.model.device,
        )

    def _sequences(
        self, prompts: Prompt | list[Prompt], params: SamplingParams | list[SamplingParams] | None
    ) -> list[Sequence]:
        prompts = [prompts] if isinstance(prompts, str | Mapping) else list(prompts)
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        return [self._sequence(p, sp) for p, sp in zip(prompts, params, strict=True)]

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate a completion for each prompt, as one batch; outputs keep the prompts' order."""
        seqs = self._sequences(prompts, sampling_params)
        for _ in self.engine.stream(seqs):
            pass
        for seq in seqs:
            self.spec_metrics += seq.spec
        return [s.output() for s in seqs]

    def stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Generate for one prompt, yielding a cumulative `RequestOutput` whenever text lands."""
        (seq,) = self._sequences(prompt, sampling_params)
        for _, _delta in self.engine.stream([seq]):
            yield seq.output()
        self.spec_metrics += seq.spec

    def chat_prompt(self, messages: Messages) -> dict[str, list[int]]:
        """Render one conversation with the model's chat template into a tokens prompt."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return {"prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)}

    def chat(
        self,
        messages: Messages | list[Messages],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate the assistant's reply to one conversation or to each of several."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        return self.generate([self.chat_prompt(c) for c in conversations], sampling_params)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype
