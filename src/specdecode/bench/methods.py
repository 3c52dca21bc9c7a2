"""Method specs of `specdecode bench`: what to run, written as short strings.

    plain[:q=int8]                 our plain decoding
    ngram:k=8[:max=4][:min=2]      our prompt lookup (speculative_config method "ngram")
    draft:MODEL:k=4                our draft-model speculation with MODEL (alias, folder, .gguf)
    hf                             Hugging Face transformers `generate()` on the same weights
    hf-assisted:MODEL:k=4          HF assisted generation (`assistant_model=`, K draft tokens)
    hf-lookup:k=8[:max=4]          HF prompt lookup (`prompt_lookup_num_tokens=`)
    llamacpp                       llama.cpp (llama-cpp-python) on the model's GGUF file
    llamacpp-lookup:k=10[:max=2]   llama.cpp with its prompt-lookup drafting

Our methods take `q=none|int8|int4`: the target's weight format for this method, instead of
the run's `--quantization`; e.g. `ngram:k=8:q=int4`. A draft model follows its target's format,
or takes its own with `dq=`: `draft:qwen2.5-coder-0.5b:k=3:q=int8:dq=int4`.

Example: `MethodSpec.parse("draft:qwen2.5-coder-0.5b:k=4").speculative_config()` is
`{"model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 4}`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specdecode.model.quant import QUANTIZATIONS

# kind -> (takes a MODEL field, allowed options, required options)
KINDS: dict[str, tuple[bool, frozenset[str], frozenset[str]]] = {
    "plain": (False, frozenset(), frozenset()),
    "ngram": (False, frozenset({"k", "max", "min"}), frozenset({"k"})),
    "draft": (True, frozenset({"k"}), frozenset({"k"})),
    "hf": (False, frozenset(), frozenset()),
    "hf-assisted": (True, frozenset({"k"}), frozenset({"k"})),
    "hf-lookup": (False, frozenset({"k", "max"}), frozenset({"k"})),
    "llamacpp": (False, frozenset(), frozenset()),
    "llamacpp-lookup": (False, frozenset({"k", "max"}), frozenset({"k"})),
}
FORMATS = ("none", *QUANTIZATIONS)  # values of our methods' q= option
# Our method that an HF peer method corresponds to (for "ours / HF" ratios).
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
    kind: one of KINDS.
    model: the draft model for "draft" and "hf-assisted", else None.
    options: integer options, e.g. {"k": 8, "max": 4}.
    quantization: our target's weight format for this method ("none", "int8", "int4"); None =
        the run's.
    draft_quantization: the draft model's format ("draft" only); None = the target's.
    """

    name: str
    kind: str
    model: str | None = None
    options: dict[str, int] = field(default_factory=dict)
    quantization: str | None = None
    draft_quantization: str | None = None

    @classmethod
    def parse(cls, text: str) -> MethodSpec:
        """Parse one spec (see the module docstring); ValueError says what is wrong."""
        kind, *fields = text.strip().split(":")
        if kind not in KINDS:
            raise ValueError(f"unknown method {kind!r} in {text!r}; known: {', '.join(KINDS)}")
        takes_model, allowed, required = KINDS[kind]
        model = None
        if takes_model:
            if not fields or "=" in fields[0] or not fields[0]:
                raise ValueError(f"method {kind!r} needs a model: {kind}:MODEL:k=4, got {text!r}")
            model, *fields = fields
        options: dict[str, int] = {}
        formats: dict[str, str] = {}
        for item in fields:
            key, eq, value = item.partition("=")
            if (key == "q" and kind not in PEER_OF) or (key == "dq" and kind == "draft"):
                if value not in FORMATS:
                    raise ValueError(
                        f"bad {key}={value!r} in {text!r}; allowed: {', '.join(FORMATS)}"
                    )
                formats[key] = value
                continue
            if not eq or key not in allowed or not value.isdigit() or int(value) < 1:
                raise ValueError(
                    f"bad option {item!r} in {text!r}; {kind!r} takes "
                    f"{', '.join(sorted(allowed)) or 'no options'} as key=positive integer"
                    + ("" if kind in PEER_OF else ", and q=none|int8|int4")
                )
            options[key] = int(value)
        missing = sorted(required - set(options))
        if missing:
            raise ValueError(f"method {text!r} needs {', '.join(f'{m}=N' for m in missing)}")
        return cls(text.strip(), kind, model, options, formats.get("q"), formats.get("dq"))

    @property
    def is_peer(self) -> bool:
        """True for another library's method (reported beside ours, never as ours)."""
        return self.kind in PEER_OF

    def weight_format(self, default: str) -> str:
        """Our target's format for this method: its q= or the run's `default` ("none" ...)."""
        return self.quantization or default

    def speculative_config(self) -> dict[str, Any] | None:
        """Our `speculative_config` for this method (None for plain; ValueError for a peer)."""
        if self.kind == "plain":
            return None
        if self.kind == "ngram":
            config: dict[str, Any] = {
                "method": "ngram",
                "num_speculative_tokens": self.options["k"],
            }
            config["prompt_lookup_max"] = self.options.get("max", 4)
            config["prompt_lookup_min"] = self.options.get(
                "min", min(2, config["prompt_lookup_max"])
            )
            return config
        if self.kind == "draft":
            config = {"model": self.model, "num_speculative_tokens": self.options["k"]}
            if self.draft_quantization is not None:
                config["quantization"] = self.draft_quantization
            return config
        raise ValueError(f"{self.name!r} is a peer library's method, not a speculative_config")

    def peer_of(self, ours: list[MethodSpec]) -> MethodSpec | None:
        """For a peer's method, our corresponding method among `ours` (same kind, model, K; the
        first listed when several formats match)."""
        kind = PEER_OF.get(self.kind)
        matches = [
            m
            for m in ours
            if m.kind == kind
            and m.model == self.model
            and m.options.get("k") == self.options.get("k")
        ]
        return matches[0] if matches else None


def parse_methods(text: str) -> list[MethodSpec]:
    """A comma-separated list of specs; ValueError for a bad or repeated one."""
    specs = [MethodSpec.parse(part) for part in text.split(",") if part.strip()]
    if not specs:
        raise ValueError("--methods needs at least one method, e.g. plain,ngram:k=8")
    names = [s.name for s in specs]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"methods given twice: {', '.join(repeated)}")
    return specs
