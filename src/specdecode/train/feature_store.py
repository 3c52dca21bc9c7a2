"""The feature store: the target's passes over training examples, computed once, kept on disk.

A folder of shards (`shard-NNNNN.safetensors`, each read memory-mapped) and an index
(`store.json`). A shard holds the passes of consecutive training examples, flat with offsets:

    tokens   [N] int64          every example's tokens, one after another
    states   [N, S]             the inputs of the store's layers (`TargetPass.states`)
    argmax   [N] int64          the target's top token (NO_ARGMAX before the prompt's end)
    offsets  [E + 1] int64      example e is rows offsets[e]..offsets[e + 1]
    prompts  [E] int64          each example's prompt length
    indices  [E] int64          each example's index in the training stream

`key` says what the passes are of (the target, its format, the layers, how answers were made):
a store opened with another key is refused, so a run never trains on another target's states.
Shards are written whole (a temporary file, then a rename) and the index after them, so a
stopped run loses at most the passes it had not flushed; a later run finds the rest. A
training run's epochs, its resumes, later runs and other methods whose layers the store
holds read the passes instead of running the target again.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specdecode.errors import UserError
from specdecode.train.target_pass import TargetPass

INDEX = "store.json"
VERSION = 1


class FeatureStore:
    """A feature store folder opened for reading and appending.

    Args:
        root: the folder (created if missing).
        key: what the passes are of (JSON-able; compared with the folder's own).
        shard_tokens: tokens buffered before a shard is written.
    """

    def __init__(self, root: Path, key: Mapping[str, object], shard_tokens: int = 16384):
        if shard_tokens < 1:
            raise ValueError(f"shard_tokens must be >= 1, got {shard_tokens}")
        self.root = root
        self.key = json.loads(json.dumps(dict(key)))  # as the index holds it (lists, not tuples)
        self.shard_tokens = shard_tokens
        self._shards: list[dict[str, object]] = []
        index = root / INDEX
        if index.is_file():
            saved = json.loads(index.read_text())
            if saved.get("version") != VERSION or saved.get("key") != self.key:
                raise UserError(
                    f"feature store {root} holds other passes: its key is {saved.get('key')}, "
                    f"this run's is {self.key}; give another --features folder"
                )
            self._shards = saved["shards"]
        root.mkdir(parents=True, exist_ok=True)
        self._where: dict[int, tuple[int, int]] = {}  # stream index -> (shard, example)
        self._lengths: dict[int, int] = {}  # stream index -> tokens
        self._handles: dict[int, object] = {}
        for s, shard in enumerate(self._shards):
            with safe_open(str(root / str(shard["file"])), framework="pt") as f:
                lengths = f.get_tensor("offsets").diff().tolist()
                for e, i in enumerate(f.get_tensor("indices").tolist()):
                    self._where[i] = (s, e)
                    self._lengths[i] = lengths[e]
        self._pending: list[tuple[int, TargetPass]] = []
        self._pending_at: dict[int, int] = {}

    def __len__(self) -> int:
        """Examples stored (flushed or not)."""
        return len(self._lengths)

    def __contains__(self, index: int) -> bool:
        return index in self._lengths

    @property
    def tokens(self) -> int:
        """Tokens in the flushed shards."""
        return sum(int(s["tokens"]) for s in self._shards)

    def indices(self) -> list[int]:
        """The stream indices of the stored examples, ascending."""
        return sorted(self._lengths)

    def length(self, index: int) -> int:
        """Tokens of the example at stream `index` (KeyError when not stored)."""
        return self._lengths[index]

    def get(self, index: int) -> TargetPass:
        """The pass of the example at stream `index` (KeyError when not stored)."""
        if index in self._pending_at:
            return self._pending[self._pending_at[index]][1]
        s, e = self._where[index]
        f = self._handle(s)
        offsets = f.get_slice("offsets")[e : e + 2].tolist()
        rows = slice(offsets[0], offsets[1])
        return TargetPass(
            f.get_slice("tokens")[rows],
            int(f.get_slice("prompts")[e : e + 1][0]),
            f.get_slice("states")[rows],
            tuple(self.key["layers"]),  # type: ignore[arg-type]
            f.get_slice("argmax")[rows],
        )

    def put(self, index: int, p: TargetPass) -> None:
        """Store the pass of the example at stream `index` (after every stored one); a shard
        is written once `shard_tokens` are waiting."""
        if list(p.layers) != self.key["layers"]:
            raise ValueError(
                f"pass of layers {list(p.layers)}; the store holds {self.key['layers']}"
            )
        if index in self:
            raise ValueError(f"example {index} is already stored")
        self._pending_at[index] = len(self._pending)
        self._pending.append((index, p))
        self._lengths[index] = len(p.tokens)
        if sum(len(q.tokens) for _, q in self._pending) >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        """Write the waiting passes as one shard and the index that lists it."""
        if not self._pending:
            return
        passes = [p for _, p in self._pending]
        lengths = torch.tensor([0] + [len(p.tokens) for p in passes])
        tensors = {
            "tokens": torch.cat([p.tokens for p in passes]),
            "states": torch.cat([p.states for p in passes]).contiguous(),
            "argmax": torch.cat([p.argmax for p in passes]),
            "offsets": lengths.cumsum(0),
            "prompts": torch.tensor([p.prompt_length for p in passes]),
            "indices": torch.tensor([i for i, _ in self._pending]),
        }
        name = f"shard-{len(self._shards):05d}.safetensors"
        tmp = self.root / (name + ".tmp")
        save_file(tensors, str(tmp))
        tmp.replace(self.root / name)
        shard = len(self._shards)
        self._shards.append({"file": name, "examples": len(passes), "tokens": int(lengths.sum())})
        self._write_index()
        for e, (i, _) in enumerate(self._pending):
            self._where[i] = (shard, e)
        self._pending, self._pending_at = [], {}

    def _write_index(self) -> None:
        tmp = self.root / (INDEX + ".tmp")
        body = {"version": VERSION, "key": self.key, "shards": self._shards}
        tmp.write_text(json.dumps(body, indent=1) + "\n")
        tmp.replace(self.root / INDEX)

    def _handle(self, shard: int):  # -> safetensors' memory-mapped reader
        if shard not in self._handles:
            path = self.root / str(self._shards[shard]["file"])
            self._handles[shard] = safe_open(str(path), framework="pt")
        return self._handles[shard]


def store_key(
    model: str,
    device: str,
    quantization: str | None,
    dtype: str,
    layers: Sequence[int],
    max_length: int,
    responses: str,
    max_answer_tokens: int,
) -> dict[str, object]:
    """What a store's passes are of (`FeatureStore`'s key): the target (its folder or file),
    the device type it ran on, its format, the layers kept, the sequences' length limit and
    where the answers came from (the answer limit counts only when the target wrote them)."""
    return {
        "model": model,
        "device": device,
        "quantization": quantization,
        "dtype": dtype,
        "layers": list(layers),
        "max_length": max_length,
        "responses": responses,
        "max_answer_tokens": max_answer_tokens if responses == "target" else None,
    }
