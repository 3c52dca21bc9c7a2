"""Eagle3HeadConfig: the shape of an EAGLE-3 draft head and its config.json (speculators' keys).

The file follows vLLM's `speculators` format (what vLLM and SGLang load):

    {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
     "draft_vocab_size": 32000, "target_hidden_size": 1536, "norm_before_residual": false,
     "eagle_aux_hidden_state_layer_ids": [2, 14, 25],
     "transformer_layer_config": {"model_type": "llama", "hidden_size": 1536, ...},
     "speculators_config": {"algorithm": "eagle3", "proposal_methods": [...],
                            "verifier": {"name_or_path": "...", "architectures": [...]}}}

The original EAGLE-3 layout (a flat Llama config with `draft_vocab_size`) is read too. Our own
writer adds the target's layer count, hidden size and vocabulary under `verifier`, so a head is
refused on a target it was not trained for. A parallel head adds `parallel_draft_tokens` (P)
and `parallel_mask_inputs` (how its mask entries read their inputs: "anchored").
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from specdecode.errors import UserError
from specdecode.heads.files import check_draft_vocab_size
from specdecode.model.config import ModelConfig, read_config_json

MASK_INPUTS = "anchored"  # a parallel head's mask entries: newest entry's feature + offsets


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's fused layers: a low, a middle and a high one (their inputs)."""
    return (2, num_layers // 2, num_layers - 3)


@dataclass(frozen=True, slots=True)
class Eagle3HeadConfig:
    """An EAGLE-3 head: one decoder layer over [token embedding, fused feature].

    layer: the decoder layer's shape (num_layers 1; vocab_size = the target's vocabulary).
    draft_vocab_size: rows of the head's output matrix (the reduced draft vocabulary).
    target_hidden_size: hidden size of the target whose states are fused.
    aux_layers: the target blocks whose inputs are fused (fc: len * target_hidden -> hidden).
    norm_before_residual: the residual is the normed feature (one speculators variant).
    parallel_tokens: 0 for a head that drafts token by token; P > 0 for a parallel head
        (P-EAGLE / PARD style): after the entry of the newest target state, P - 1 mask entries
        at the next positions draft tokens 2..P in the same pass. Mask entry j reads level j's
        learned token embedding (`mask_embed` [P - 1, h]) and, as its feature, the newest
        entry's fused feature plus level j's learned offset (`mask_hidden` [P - 1, h]);
        config.json says so as "parallel_mask_inputs": "anchored".
    verifier: the target's name; verifier_layers / verifier_hidden / verifier_vocab: its layer
        count, hidden size and vocabulary (None when the file does not say).
    """

    layer: ModelConfig
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: tuple[int, ...]
    norm_before_residual: bool = False
    parallel_tokens: int = 0
    verifier: str = ""
    verifier_layers: int | None = None
    verifier_hidden: int | None = None
    verifier_vocab: int | None = None

    def __post_init__(self) -> None:
        check_draft_vocab_size(self.draft_vocab_size, self.layer.vocab_size)
        if not self.aux_layers or min(self.aux_layers) < 0:
            raise UserError(f"aux layer ids must be >= 0, got {list(self.aux_layers)}")
        if not isinstance(self.parallel_tokens, int) or self.parallel_tokens < 0:
            raise UserError(f"parallel_draft_tokens must be >= 0, got {self.parallel_tokens!r}")

    @staticmethod
    def check_mask_inputs(cfg: dict[str, Any]) -> None:
        """Refuse a parallel head's parsed config.json (`parallel_draft_tokens` > 0) whose mask
        entries read other inputs than this version gives them (MASK_INPUTS)."""
        if not cfg.get("parallel_draft_tokens"):
            return
        found = cfg.get("parallel_mask_inputs")
        if found != MASK_INPUTS:
            was = f"is {found!r}" if found is not None else "is missing (an older head)"
            raise UserError(
                f'this parallel head\'s "parallel_mask_inputs" {was}; this version drafts with '
                f"{MASK_INPUTS!r} mask entries (feature = the newest entry's + a learned "
                "offset): train the head again with `specdecode train --method eagle3_parallel`"
            )

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def feature_size(self) -> int:
        """Width of the fused target features (fc's input)."""
        return len(self.aux_layers) * self.target_hidden_size

    @classmethod
    def for_target(
        cls,
        target: ModelConfig,
        draft_vocab_size: int,
        verifier: str = "",
        parallel_tokens: int = 0,
    ) -> Eagle3HeadConfig:
        """The head EAGLE-3 trains for `target`: one layer of the target's own shape
        (`parallel_tokens` > 0: a parallel head drafting that many tokens a pass)."""
        layer = replace(
            target,
            num_layers=1,
            architecture="llama",
            qkv_bias=False,
            tie_word_embeddings=False,
            qk_norm=False,
        )
        return cls(
            layer,
            draft_vocab_size,
            target.hidden_size,
            default_aux_layers(target.num_layers),
            parallel_tokens=parallel_tokens,
            verifier=verifier,
            verifier_layers=target.num_layers,
            verifier_hidden=target.hidden_size,
            verifier_vocab=target.vocab_size,
        )

    def check_target(self, target: ModelConfig) -> None:
        """Refuse a target this head was not trained for, saying what differs."""
        problems = []
        if self.target_hidden_size != target.hidden_size or self.hidden_size != target.hidden_size:
            problems.append(
                f"hidden size: head {self.hidden_size} (fuses {self.target_hidden_size}-wide "
                f"states), target {target.hidden_size}"
            )
        if self.layer.vocab_size != target.vocab_size:
            problems.append(f"vocabulary: head {self.layer.vocab_size}, target {target.vocab_size}")
        if self.verifier_layers not in (None, target.num_layers):
            problems.append(f"layers: head {self.verifier_layers}, target {target.num_layers}")
        elif max(self.aux_layers) > target.num_layers:
            problems.append(
                f"layers: head fuses layers {list(self.aux_layers)}, target has {target.num_layers}"
            )
        if problems:
            name = f" ({self.verifier})" if self.verifier else ""
            raise UserError(
                f"this EAGLE-3 head was trained for another target{name}: " + "; ".join(problems)
            )

    def to_json(self, speculative_tokens: int = 3, extra: dict[str, Any] | None = None) -> str:
        """config.json text in speculators' format (plus `extra` under "specdecode")."""
        layer = self.layer.to_hf_dict()
        layer.update(num_hidden_layers=1, architectures=["LlamaForCausalLMEagle3"])
        verifier: dict[str, Any] = {"name_or_path": self.verifier, "architectures": []}
        for key, value in (
            ("num_hidden_layers", self.verifier_layers),
            ("hidden_size", self.verifier_hidden),
            ("vocab_size", self.verifier_vocab),
        ):
            if value is not None:
                verifier[key] = value
        cfg: dict[str, Any] = {
            "speculators_model_type": "eagle3",
            "architectures": ["Eagle3Speculator"],
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "norm_before_residual": self.norm_before_residual,
            "eagle_aux_hidden_state_layer_ids": list(self.aux_layers),
            "transformer_layer_config": layer,
            "speculators_config": {
                "algorithm": "eagle3",
                "default_proposal_method": "greedy",
                "proposal_methods": [
                    {"proposal_type": "greedy", "speculative_tokens": speculative_tokens}
                ],
                "verifier": verifier,
            },
        }
        if self.parallel_tokens:
            cfg["parallel_draft_tokens"] = self.parallel_tokens
            cfg["parallel_mask_inputs"] = MASK_INPUTS
        if extra:
            cfg["specdecode"] = extra
        return json.dumps(cfg, indent=2) + "\n"

    @classmethod
    def from_folder(cls, path: Path, target_layers: int | None = None) -> Eagle3HeadConfig:
        """Read `path/config.json` (speculators' or the original EAGLE-3 layout); a file that
        does not name the fused layers gets EAGLE-3's default for `target_layers` layers."""
        return read_config_json(
            path,
            lambda cfg: cls.from_dict(cfg, target_layers),
            "an EAGLE-3 head folder holds config.json and model.safetensors "
            "(`specdecode train` writes one)",
        )

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], target_layers: int | None = None) -> Eagle3HeadConfig:
        """Build from a parsed config.json (KeyError for a missing required field); see
        `from_folder` for `target_layers`."""
        kind = cfg.get("speculators_model_type", "eagle3")
        if kind != "eagle3":
            raise UserError(f"not an EAGLE-3 head: speculators_model_type is {kind!r}")
        cls.check_mask_inputs(cfg)
        layer_dict = dict(cfg.get("transformer_layer_config") or cfg)
        layer_dict.setdefault("model_type", "llama")
        layer = replace(ModelConfig.from_hf_dict(layer_dict), num_layers=1)
        spec = cfg.get("speculators_config") or {}
        verifier = spec.get("verifier") or {}
        aux = cfg.get("eagle_aux_hidden_state_layer_ids") or (cfg.get("eagle_config") or {}).get(
            "eagle_aux_hidden_state_layer_ids"
        )
        num_layers = verifier.get("num_hidden_layers")
        if aux is None:
            layers = num_layers or target_layers
            if layers is None:
                raise UserError(
                    "the head's config.json names neither eagle_aux_hidden_state_layer_ids "
                    "nor the verifier's num_hidden_layers: which target layers it fuses is unknown"
                )
            aux = default_aux_layers(layers)
        return cls(
            layer,
            int(cfg["draft_vocab_size"]),
            int(cfg.get("target_hidden_size") or layer.hidden_size),
            tuple(int(i) for i in aux),
            bool(cfg.get("norm_before_residual", False)),
            cfg.get("parallel_draft_tokens", 0),
            str(verifier.get("name_or_path") or ""),
            num_layers,
            verifier.get("hidden_size"),
            verifier.get("vocab_size"),
        )
