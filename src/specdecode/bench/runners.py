"""Runners: one method bound to loaded weights, timing one request at a time.

Every runner's `run(ids, params)` returns a `Timing` (`records.py`), so ours and a peer's runs
are measured and reported alike: wall and first-token times, the new tokens, when each arrived,
and our speculative counters (None for a peer).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Protocol

import torch

from specdecode.bench.llamacpp import LlamaCppRunner
from specdecode.bench.methods import MethodSpec
from specdecode.bench.openvino import OpenVinoRunner
from specdecode.bench.records import Timing
from specdecode.bench.vllm_peer import VllmRunner
from specdecode.engine.scheduler import ONE_PASS_PREFILL
from specdecode.errors import MissingDependencyError
from specdecode.llm import LLM
from specdecode.model.quant import parse_quantization
from specdecode.model.registry import resolve_model
from specdecode.sampling_params import SamplingParams

HF_REQUIREMENT = "transformers>=4.45 accelerate>=0.34"


def measured_target(model: str, dtype: str, device: str, quantization: str | None) -> LLM:
    """The target as a measurement loads it: `ONE_PASS_PREFILL` (no prefix cache, each prompt
    in one batched pass), since a bench repeats its prompts and its peers cache none."""
    return LLM(model, dtype, device=device, quantization=quantization, scheduler=ONE_PASS_PREFILL)


class Runner(Protocol):
    spec: MethodSpec

    def run(self, ids: list[int], params: SamplingParams) -> Timing: ...


class OursRunner:
    """Our engine with the method's speculative_config, streaming to time each token's arrival."""

    def __init__(self, spec: MethodSpec, llm: LLM) -> None:
        self.spec = spec
        self.llm = llm

    def run(self, ids: list[int], params: SamplingParams) -> Timing:
        """One request, an arrival per stream event (a held-back token arrives with the next)."""
        stamps, out = [], None
        t0 = time.perf_counter()
        for out in self.llm.stream({"prompt_token_ids": ids}, params):
            stamps.append((time.perf_counter(), len(out.token_ids)))
        end = time.perf_counter()
        assert out is not None  # the stream always yields the final output
        return Timing.measured(t0, end, stamps, out.token_ids, out.metrics.spec.as_dict())


class _ArrivalTimer:
    """A `generate(streamer=...)` hook noting when new tokens arrive.

    HF pushes the prompt first, then the new tokens: one per step, several per step when it
    drafts (value: [1, n] int64). stamps: (`time.perf_counter()`, new tokens so far) per push.
    """

    def __init__(self) -> None:
        self.stamps: list[tuple[float, int]] = []
        self._pushes = 0
        self._tokens = 0

    def put(self, value: torch.Tensor) -> None:
        """Called by HF with the prompt, then with each step's new tokens."""
        now = time.perf_counter()
        self._pushes += 1
        if self._pushes > 1:  # the first push is the prompt
            self._tokens += value.numel()
            self.stamps.append((now, self._tokens))

    def end(self) -> None:
        """Called by HF at the end of generation."""


class HFRunner:
    """Hugging Face transformers' `generate()` on the same converted weights as ours.

    hf-assisted runs with `num_assistant_tokens=K` and the "constant" schedule (K never changes,
    as in ours; HF's default heuristic schedule carries state from one call to the next).
    """

    def __init__(self, spec: MethodSpec, model: Any, eos: list[int], assistant: Any = None):
        self.spec = spec
        self.model = model
        self.assistant = assistant
        self.eos = eos

    def _kwargs(self, params: SamplingParams) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"max_new_tokens": params.max_tokens}
        kwargs["eos_token_id"] = None if params.ignore_eos else self.eos
        if params.temperature > 0:
            kwargs.update(do_sample=True, temperature=params.temperature, top_p=params.top_p)
            kwargs["top_k"] = params.top_k if params.top_k > 0 else None
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        if self.spec.kind == "hf-lookup":
            kwargs["prompt_lookup_num_tokens"] = self.spec.options["k"]
            kwargs["max_matching_ngram_size"] = self.spec.option("max")
        if self.spec.kind == "hf-assisted":
            config = self.assistant.generation_config
            config.num_assistant_tokens = self.spec.options["k"]
            config.num_assistant_tokens_schedule = "constant"
            kwargs["assistant_model"] = self.assistant
        return kwargs

    @torch.inference_mode()
    def run(self, ids: list[int], params: SamplingParams) -> Timing:
        """One request, an arrival per streamer push."""
        if params.seed is not None:
            torch.manual_seed(params.seed)
        input_ids = torch.tensor([ids], device=self.model.device)
        timer = _ArrivalTimer()
        t0 = time.perf_counter()
        out = self.model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            streamer=timer,
            pad_token_id=self.eos[0] if self.eos else 0,
            **self._kwargs(params),
        )
        end = time.perf_counter()
        return Timing.measured(t0, end, timer.stamps, out[0, len(ids) :].tolist())


def load_hf(path: Path, dtype: torch.dtype, device: str) -> Any:
    """A model folder in HF transformers; ImportError naming the extra when it is missing."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as err:
        raise MissingDependencyError(
            f"the hf* methods need Hugging Face transformers: pip install {HF_REQUIREMENT}"
        ) from err
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


def build_runners(
    specs: list[MethodSpec], llm: LLM, n_ctx: int
) -> tuple[list[Runner], list[dict[str, str]]]:
    """A runner per spec; returns (runners, skipped peers with the reason).

    Every method of ours shares `llm`'s weights, or, with its own `q=` format, the weights
    loaded once in that format; HF loads each model folder once. A peer whose library is not
    installed is skipped (ImportError's message says what to install), so the rest of the run
    goes on. `n_ctx`: the longest prompt plus new tokens a run needs.
    """
    hf_models: dict[Path, Any] = {}
    targets: dict[str | None, LLM] = {llm.model.quantization: llm}

    def hf(name: str | Path) -> Any:
        path = resolve_model(str(name))
        if path not in hf_models:
            hf_models[path] = load_hf(path, llm.dtype, str(llm.model.device))
        return hf_models[path]

    def ours(quantization: str | None) -> LLM:
        """The target in `quantization` (a method's q=; None: the run's)."""
        key = llm.model.quantization if quantization is None else parse_quantization(quantization)
        if key not in targets:
            device = str(llm.model.device)
            targets[key] = measured_target(llm.model_name, llm.dtype, device, key)
        return targets[key]

    eos = list(llm.tokenizer.eos_token_ids)
    runners: list[Runner] = []
    skipped: list[dict[str, str]] = []
    for spec in specs:
        try:
            if spec.is_peer:
                runners.append(_peer_runner(spec, llm, hf, eos, n_ctx))
            else:
                target = ours(spec.quantization)
                runners.append(OursRunner(spec, target.with_speculative_config(spec.config)))
        except ImportError as err:
            if not spec.is_peer:
                raise
            skipped.append({"method": spec.name, "reason": str(err)})
    return runners, skipped


def _peer_runner(spec: MethodSpec, llm: LLM, hf: Any, eos: list[int], n_ctx: int) -> Runner:
    if spec.engine == "llamacpp":
        return LlamaCppRunner(spec, llm.model_name, llm.model_path, n_ctx, eos)
    draft = resolve_model(spec.model) if spec.model is not None else None
    if spec.engine == "openvino":
        return OpenVinoRunner(spec, llm.model_path, eos, draft)
    if spec.engine == "vllm":
        return VllmRunner(spec, llm.model_path, n_ctx, eos, draft)
    assistant = hf(spec.model) if spec.model is not None else None
    return HFRunner(spec, hf(llm.model_path), eos, assistant)
