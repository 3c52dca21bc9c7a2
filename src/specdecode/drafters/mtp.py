"""MTP drafting: the multi-token prediction layer a checkpoint ships with (method "mtp").

The layer (`specdecode.heads.mtp`) reads the target's final state after token t and the
embedding of token t + 1, and predicts token t + 2; chained, it reads its own output in place
of the target's state, one step per drafted token (vLLM's "mtp" method does the same). It
keeps a one-layer cache of entries exactly as an EAGLE-3 head does, so the EAGLE-3 drafter
drives it (`drafters.eagle3`: the catch-up of the target's new states, chains and dynamic
trees, q over the whole vocabulary). The worked example there holds with s the target's final
states and h the layer's own outputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from specdecode.drafters.base import Drafter, DrafterContext, ModelDrafterConfig
from specdecode.drafters.eagle3 import Eagle3Drafter
from specdecode.errors import UserError
from specdecode.heads.mtp import load_mtp_head


@dataclass(frozen=True, slots=True)
class MtpConfig(ModelDrafterConfig):
    """speculative_config of a checkpoint's MTP layer, method "mtp" (vLLM's keys).

    model: the folder whose *.safetensors hold the MTP layer (None, the default: the target's
        own folder, where the model's publishers put it).
    num_speculative_tokens: draft at most this many tokens per step (K; the layer chained K
        times; a tree's nodes).
    quantization: the layer's weight format ("none", "int8", "int4", a GGUF block type; "gguf"
        runs its dense weights as int8); None = the target's.
    tree_width: children per expanded node of a dynamic tree (1 = a chain).
    tree_depth: levels of the tree, one pass of the layer each (default: K).
    """

    method: ClassVar[str] = "mtp"
    WHAT: ClassVar[str] = "an mtp config"

    model: str | None = None  # type: ignore[assignment]
    num_speculative_tokens: int = 1

    def __post_init__(self) -> None:
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise UserError(
                f"an mtp config's 'model' must be a folder's path (or absent: the target's "
                f"own folder), got {self.model!r}"
            )
        self.check_drafting()


def build_mtp_drafter(config: MtpConfig, context: DrafterContext) -> Drafter:
    """The registry's factory: the MTP layer of the folder `config.model` (else the target's
    own) for the target, refused where the folder belongs to another model or holds none."""
    if config.model is not None:
        path = Path(config.model).expanduser()
    elif context.target_path is not None:
        path = context.target_path
    else:
        raise UserError(
            "method 'mtp' reads the MTP layer from the target's folder, and this target was "
            "built in memory: give speculative_config 'model', the folder that holds the layer"
        )
    head = load_mtp_head(path, context.target, config.weight_format(context.target.quantization))
    return Eagle3Drafter(head, config.num_speculative_tokens, config.tree_width, config.tree_depth)
