"""Method specs of `specdecode bench`: what to run, written as short strings.

    plain[:q=int8]                 our plain decoding
    ngram:k=8[:max=4][:min=2]      our prompt lookup (speculative_config method "ngram")
    draft:MODEL:k=4[:dq=int4]      our draft-model speculation with MODEL (alias, folder, .gguf)
    eagle3:HEAD:k=3[:hq=int8]      a trained head (folder HEAD); also medusa:HEAD, layer_skip:HEAD
    ...:w=3:d=4                    a token tree: tree_width 3, tree_depth 4 (k = its nodes)
    hf                             Hugging Face transformers `generate()` on the same weights
    hf-assisted:MODEL:k=4          HF assisted generation (`assistant_model=`, K draft tokens)
    hf-lookup:k=8[:max=4]          HF prompt lookup (`prompt_lookup_num_tokens=`)
    llamacpp                       llama.cpp (llama-cpp-python) on the model's GGUF file
    llamacpp-lookup:k=10[:max=2]   llama.cpp with its prompt-lookup drafting

Our speculative methods come from the drafter registry (`specdecode.drafters.registry`): a
method's bench name, its short options (`k` = num_speculative_tokens for all) and its MODEL
field are the registry's, and its config is validated by the same dataclass the API uses.
Our methods take `q=none|int8|int4|gguf`: the target's weight format for this method, instead of
the run's `--quantization`; e.g. `ngram:k=8:q=int4`. A draft model follows its target's format,
or takes its own with `dq=`: `draft:qwen2.5-coder-0.5b:k=3:q=int8:dq=int4`.

Prompts that carry a JSON schema (the "extraction" set) run our methods under it as a
structured-output constraint; `schema=off` runs such prompts without it (e.g. `plain:schema=off`,
the constraint's own overhead). Peers cannot constrain their output: they always run without.

Example: `MethodSpec.parse("draft:qwen2.5-coder-0.5b:k=4").speculative_config()` is
`{"method": "draft_model", "model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 4}`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specdecode.drafters.registry import (
    DRAFTERS,
    DrafterConfig,
    as_speculative_config,
    parse_speculative_config,
)
from specdecode.errors import UserError
from specdecode.model.quant import QUANTIZATIONS

# Our speculative methods, by their bench name (the drafter registry's `bench_name`).
OURS = {method.bench_name: method for method in DRAFTERS.values()}
# Plain decoding and the peers: kind -> (takes a MODEL field, allowed options, required options)
KINDS: dict[str, tuple[bool, frozenset[str], frozenset[str]]] = {
    "plain": (False, frozenset(), frozenset()),
    "hf": (False, frozenset(), frozenset()),
    "hf-assisted": (True, frozenset({"k"}), frozenset({"k"})),
    "hf-lookup": (False, frozenset({"k", "max"}), frozenset({"k"})),
    "llamacpp": (False, frozenset(), frozenset()),
    "llamacpp-lookup": (False, frozenset({"k", "max"}), frozenset({"k"})),
}
FORMATS = ("none", *QUANTIZATIONS)  # values of our methods' q= option
# Our method that a peer's method corresponds to (for "ours / peer" ratios).
PEER_OF = {
    "hf": "plain",
    "hf-assisted": "draft",
    "hf-lookup": "ngram",
    "llamacpp": "plain",
    "llamacpp-lookup": "ngram",
}


@dataclass(frozen=True, slots=True)
class MethodSpec:
    """One parsed method.

    name: the spec as written (the method's label in reports).
    kind: "plain", a speculative method's bench name (OURS) or a peer's kind (PEER_OF).
    model: the positional MODEL (a draft model) where the kind takes one, else None.
    options: a peer's integer options, e.g. {"k": 8, "max": 4}; ours: as written.
    quantization: our target's weight format for this method ("none", "int8", "int4", "gguf");
        None = the run's.
    config: our speculative method's validated drafter config (None for plain and peers).
    constrained: whether a prompt's JSON schema constrains this method's output (`schema=off`
        says no; peers never are).
    """

    name: str
    kind: str
    model: str | None = None
    options: dict[str, bool | int | float | str] = field(default_factory=dict)
    quantization: str | None = None
    config: DrafterConfig | None = None
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
            allowed, required = frozenset(OURS[kind].bench_options), frozenset({"k"})
        else:
            takes_model, allowed, required = KINDS[kind]
        model = None
        if takes_model:
            if not fields or "=" in fields[0] or not fields[0]:
                raise UserError(f"method {kind!r} needs a model: {kind}:MODEL:k=4, got {text!r}")
            model, *fields = fields
        options: dict[str, bool | int | float | str] = {}
        quantization = None
        constrained = kind not in PEER_OF
        for item in fields:
            key, eq, value = item.partition("=")
            if key == "q" and kind not in PEER_OF:
                if value not in FORMATS:
                    raise UserError(f"bad q={value!r} in {text!r}; allowed: {', '.join(FORMATS)}")
                quantization = value
                continue
            if key == "schema" and kind not in PEER_OF:
                if value not in ("on", "off"):
                    raise UserError(f"bad schema={value!r} in {text!r}; allowed: on, off")
                constrained = value == "on"
                continue
            numeric = value.isdigit() and int(value) >= 1
            if not eq or key not in allowed or not (numeric or (ours and value)):
                raise UserError(
                    f"bad option {item!r} in {text!r}; {kind!r} takes "
                    f"{', '.join(sorted(allowed)) or 'no options'} as key=positive integer"
                    + ("" if kind in PEER_OF else ", and q=none|int8|int4|gguf, schema=on|off")
                )
            options[key] = _number(value)
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
            return self.config.num_speculative_tokens
        return int(self.options.get("k", 0))

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
) -> DrafterConfig:
    """The registry's validated config for our speculative method `kind`."""
    method = OURS[kind]
    cfg: dict[str, Any] = {"method": method.name}
    if method.model_field is not None:
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
