"""The drafter registry: speculative_config "method" -> (frozen config class, factory).

The API (`LLM(speculative_config=...)`), the CLI (`--speculative-config`), the server and the
bench's method specs (like `ngram:k=8`) all read this one table. Adding a drafter is one module (its
config dataclass, validated in `__post_init__`, and its `Drafter`) plus one `DrafterMethod`
line in `DRAFTERS`.

Example: `parse_speculative_config({"method": "ngram", "num_speculative_tokens": 8})` is
`SpeculativeConfig(NgramConfig(num_speculative_tokens=8, prompt_lookup_max=4,
prompt_lookup_min=2), "fixed")`, and `{"model": "qwen2.5-coder-0.5b", "num_speculative_tokens":
3}` (a model without a method, as in vLLM) is a `DraftModelConfig` under "cost".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from specdecode.drafters.base import Drafter, DrafterConfig, DrafterContext, SpeculativeConfig
from specdecode.drafters.cross_tokenizer import CrossTokenizerConfig, build_cross_tokenizer_drafter
from specdecode.drafters.dflash import DFlashConfig, build_dflash_drafter
from specdecode.drafters.draft_model_build import DraftModelConfig, build_draft_model_drafter
from specdecode.drafters.eagle3 import Eagle3Config, build_eagle3_drafter
from specdecode.drafters.eagle3_parallel import (
    Eagle3ParallelConfig,
    build_eagle3_parallel_drafter,
)
from specdecode.drafters.layer_skip import LayerSkipConfig, build_layer_skip_drafter
from specdecode.drafters.lookahead import LookaheadConfig, build_lookahead_drafter
from specdecode.drafters.medusa import MedusaConfig, build_medusa_drafter
from specdecode.drafters.mtp import MtpConfig, build_mtp_drafter
from specdecode.drafters.ngram import NgramConfig, build_ngram_drafter
from specdecode.drafters.suffix import SuffixConfig, build_suffix_drafter
from specdecode.errors import UserError


@dataclass(frozen=True, slots=True)
class DrafterMethod:
    """One registry entry.

    name: the speculative_config "method" (vLLM's name where vLLM has the method).
    config: the method's frozen config dataclass; its fields are the speculative_config keys.
    build: (config, context) -> the drafter.
    bench_name: the method's name in the bench's method specs, e.g. "ngram" in `ngram:k=8`.
    bench_options: short option in a bench spec -> config field (`k` is num_speculative_tokens
        for every method).
    model_field: the config field that a bench spec's positional MODEL fills (a draft model),
        or None.
    """

    name: str
    config: type
    build: Callable[[Any, DrafterContext], Drafter]
    bench_name: str
    bench_options: Mapping[str, str]
    model_field: str | None = None

    @property
    def model_required(self) -> bool:
        """Whether a bench spec must give MODEL (its config field has no default; "mtp"'s
        defaults to the target's own folder)."""
        if self.model_field is None:
            return False
        field = next(f for f in dataclasses.fields(self.config) if f.name == self.model_field)
        return field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING


# bench spec options of the trained heads (HEAD is the positional folder)
HEAD_OPTIONS = {
    "k": "num_speculative_tokens",
    "hq": "quantization",
    "w": "tree_width",
    "d": "tree_depth",
    "dl": "draft_length",
}

DRAFTERS: dict[str, DrafterMethod] = {
    m.name: m
    for m in (
        DrafterMethod(
            "ngram",
            NgramConfig,
            build_ngram_drafter,
            "ngram",
            {
                "k": "num_speculative_tokens",
                "max": "prompt_lookup_max",
                "min": "prompt_lookup_min",
                "w": "tree_width",
                "d": "tree_depth",
                "dl": "draft_length",
            },
        ),
        DrafterMethod(
            "suffix",
            SuffixConfig,
            build_suffix_drafter,
            "suffix",
            {
                "k": "num_speculative_tokens",
                "depth": "suffix_decoding_max_tree_depth",
                "cached": "suffix_decoding_max_cached_requests",
                "factor": "suffix_decoding_max_spec_factor",
                "p": "suffix_decoding_min_token_prob",
                "w": "tree_width",
                "dl": "draft_length",
            },
        ),
        DrafterMethod(
            "lookahead",
            LookaheadConfig,
            build_lookahead_drafter,
            "lookahead",
            {
                "k": "num_speculative_tokens",
                "W": "window_size",
                "N": "ngram_size",
                "G": "guess_set_size",
                "dl": "draft_length",
            },
        ),
        DrafterMethod(
            "draft_model",
            DraftModelConfig,
            build_draft_model_drafter,
            "draft",
            {
                "k": "num_speculative_tokens",
                "dq": "quantization",
                "w": "tree_width",
                "d": "tree_depth",
                "dl": "draft_length",
                "v": "draft_vocab_size",
                "st": "staged",
                "ssd": "ssd",
                "conf": "confidence_threshold",
                "pw": "prompt_window",
            },
            model_field="model",
        ),
        DrafterMethod(
            "cross_tokenizer",
            CrossTokenizerConfig,
            build_cross_tokenizer_drafter,
            "cross",
            {"k": "num_speculative_tokens", "dq": "quantization", "dl": "draft_length"},
            model_field="model",
        ),
        *(
            DrafterMethod(name, config, build, name, HEAD_OPTIONS, model_field="model")
            for name, config, build in (
                ("eagle3", Eagle3Config, build_eagle3_drafter),
                ("eagle3_parallel", Eagle3ParallelConfig, build_eagle3_parallel_drafter),
                ("medusa", MedusaConfig, build_medusa_drafter),
                ("layer_skip", LayerSkipConfig, build_layer_skip_drafter),
                ("mtp", MtpConfig, build_mtp_drafter),
            )
        ),
        DrafterMethod(
            "dflash",
            DFlashConfig,
            build_dflash_drafter,
            "dflash",
            HEAD_OPTIONS | {"v": "draft_vocab_size"},
            model_field="model",
        ),
    )
}


def method_of(config: DrafterConfig) -> DrafterMethod:
    """The registry entry `config` names (its class's `method`)."""
    entry = _entry_of(config)
    if entry is None:
        raise UserError(f"{type(config).__name__} is not the config of a registered drafter")
    return entry


def _entry_of(config: object) -> DrafterMethod | None:
    """The entry whose config class `config` is exactly, found by its `method`; else None."""
    entry = DRAFTERS.get(getattr(config, "method", None))  # type: ignore[arg-type]
    return entry if entry is not None and type(config) is entry.config else None


def parse_speculative_config(
    cfg: Mapping[str, Any] | SpeculativeConfig | DrafterConfig,
) -> SpeculativeConfig:
    """vLLM's speculative_config dict -> the method's validated config in its envelope, with
    the draft length policy (UserError if bad). A `SpeculativeConfig` is returned as it is, a
    registered method's config (validated when it was built) under its default policy.

    "method" picks the entry; a "model" without a "method" means "draft_model"; "draft_length"
    is the engine's policy (default: the method's `default_draft_length`). Every other key
    must be a field of that method's config; fields without a default are required.
    """
    if isinstance(cfg, SpeculativeConfig):
        return cfg
    if not isinstance(cfg, Mapping):
        if _entry_of(cfg) is not None:
            return SpeculativeConfig.of(cfg)  # validated when it was built
        raise UserError(f"speculative_config must be a dict, got {type(cfg).__name__}")
    name = cfg.get("method", "draft_model" if "model" in cfg else None)
    if name not in DRAFTERS:
        raise UserError(
            f"speculative_config method {name!r} is not supported; use one of "
            f"{', '.join(DRAFTERS)} (or give 'model' for a draft model)"
        )
    config = DRAFTERS[name].config
    fields = dataclasses.fields(config)
    allowed = {f.name for f in fields}
    given = {k: v for k, v in cfg.items() if k not in ("method", "draft_length")}
    unknown = sorted(set(given) - allowed)
    if unknown:
        raise UserError(
            f"unknown speculative_config keys {unknown} for method {name!r}; "
            f"allowed: {sorted(allowed | {'method', 'draft_length'})}"
        )
    missing = [
        f.name
        for f in fields
        if f.name not in given
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise UserError(
            f"a {name!r} speculative_config needs {', '.join(repr(m) for m in missing)}"
        )
    policy = cfg.get("draft_length", config.default_draft_length)
    return SpeculativeConfig(config(**given), policy)


def as_speculative_config(spec: SpeculativeConfig) -> dict[str, Any]:
    """A validated config back in vLLM's form: "method", every field of its drafter's config
    that is not None and "draft_length" (the inverse of `parse_speculative_config`)."""
    fields = dataclasses.asdict(spec.drafter)  # type: ignore[call-overload]
    method = method_of(spec.drafter).name
    given = {k: v for k, v in fields.items() if v is not None}
    return {"method": method, **given, "draft_length": spec.draft_length}


def drafter_name(config: DrafterConfig) -> str:
    """A short name for a drafter: its method, and ":" and the model for one with a model,
    e.g. "ngram" or "draft_model:qwen2.5-coder-0.5b"."""
    method = method_of(config).name
    model = getattr(config, "model", None)
    return method if model is None else f"{method}:{model}"


def build_drafter(config: DrafterConfig, context: DrafterContext) -> Drafter:
    """The drafter `config` describes, built by its method's factory."""
    return method_of(config).build(config, context)
