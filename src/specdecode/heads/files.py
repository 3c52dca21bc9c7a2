"""Reading and writing a draft head's folder: config.json + model.safetensors, checked.

Every head kind (EAGLE-3, Medusa, early exit) stores its tensors under fixed names with known
shapes and a reduced draft vocabulary (`d2t`, EAGLE-3's offsets: target id = draft id +
d2t[draft id]); this module holds what they share: reading the tensors with clear errors for
a missing folder, an unreadable (truncated) file, missing or mis-shaped tensors and a draft
vocabulary outside the target's, and writing a folder.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from specdecode.errors import ModelNotFoundError, UserError

WEIGHTS_FILE = "model.safetensors"


def check_head_folder(path: Path, kind: str) -> None:
    """Refuse a path that is not a folder, naming the head `kind` and how to get one."""
    if not path.is_dir():
        raise ModelNotFoundError(
            f"no such {kind} head folder: {path} (train one with `specdecode train`)"
        )


def check_draft_vocab_size(draft_vocab_size: int, vocab_size: int) -> None:
    """Refuse a draft vocabulary that is empty or larger than the target's."""
    if not 0 < draft_vocab_size <= vocab_size:
        raise UserError(
            f"draft_vocab_size must be in 1..{vocab_size} (the target's vocabulary), "
            f"got {draft_vocab_size}"
        )


def tensors_for_target(
    weights: Mapping[str, Tensor], names: Collection[str], device: torch.device, dtype: torch.dtype
) -> dict[str, Tensor]:
    """The tensors of `weights` named in `names`, on `device`, floating ones in `dtype`."""
    return {
        name: t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
        for name, t in weights.items()
        if name in names
    }


def draft_ids_to_d2t(target_ids: Tensor) -> Tensor:
    """EAGLE-3's `d2t` ([Vd] int64 offsets: target id = draft id + d2t[draft id]) for the
    sorted target ids of the draft vocabulary."""
    return target_ids - torch.arange(len(target_ids))


def d2t_to_draft_ids(d2t: Tensor) -> Tensor:
    """The target ids of the draft vocabulary ([Vd] int64) from `d2t`."""
    return d2t.long() + torch.arange(len(d2t), device=d2t.device)


def read_head_tensors(
    path: Path,
    shapes: Mapping[str, tuple[int, ...]],
    optional: Mapping[str, tuple[int, ...]],
    vocab_size: int,
    rename: Callable[[str], str] = lambda name: name,
) -> dict[str, Tensor]:
    """The tensors of `path`'s *.safetensors files (names through `rename`), checked: every
    name of `shapes` present with its shape, those of `optional` with theirs where present,
    and `d2t`, where a head has one, mapping into 0..vocab_size - 1 (UserError naming what is
    wrong)."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(
            f"{path} has no *.safetensors file; a head folder holds {WEIGHTS_FILE}"
        )
    weights: dict[str, Tensor] = {}
    for file in files:
        try:
            loaded = load_file(str(file))
        except (SafetensorError, OSError, ValueError) as err:
            raise UserError(f"cannot read head weights from {file} (truncated?): {err}") from err
        weights.update({rename(name): t for name, t in loaded.items()})
    missing = [name for name in shapes if name not in weights]
    if missing:
        raise UserError(f"{path} lacks {len(missing)} head tensor(s), e.g. {missing[:3]}")
    expected = {**{n: s for n, s in optional.items() if n in weights}, **shapes}
    wrong = [
        f"{name} {tuple(weights[name].shape)} (config says {shape})"
        for name, shape in expected.items()
        if tuple(weights[name].shape) != shape
    ]
    if wrong:
        raise UserError(f"{path}: head tensors do not match its config.json: {'; '.join(wrong)}")
    if "d2t" not in weights:
        return weights
    target_ids = d2t_to_draft_ids(weights["d2t"])
    if target_ids.min() < 0 or target_ids.max() >= vocab_size:
        raise UserError(
            f"{path}: d2t maps draft tokens outside the target's vocabulary (0..{vocab_size - 1})"
        )
    return weights


def save_head_folder(
    path: Path, config_text: str, weights: Mapping[str, Tensor], vocab_size: int
) -> None:
    """Write `config_text` (config.json) and `weights` (model.safetensors, with the derived
    `t2d` mask over the target's `vocab_size` tokens) into folder `path`."""
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[d2t_to_draft_ids(weights["d2t"].detach().cpu())] = True
    write_folder(path, config_text, {**weights, "t2d": t2d})


def write_folder(path: Path, config_text: str, weights: Mapping[str, Tensor]) -> None:
    """Write `config_text` (config.json) and `weights` as they are (model.safetensors) into
    folder `path`, made if missing."""
    path.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().contiguous().cpu() for name, t in weights.items()}
    save_file(tensors, str(path / WEIGHTS_FILE))
    (path / "config.json").write_text(config_text)
