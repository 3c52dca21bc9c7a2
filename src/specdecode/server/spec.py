"""`ServeSpec`: what a server process needs to load the model and build its app, in plain
values. `specdecode serve` (`server/cli.py`) builds one from its flags; a Ray Serve replica
(`server/ray_serve.py`) loads its own from a copy. Both import it from here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from specdecode.cache.block_pool import BLOCK_TOKENS
from specdecode.engine.scheduler import SchedulerConfig
from specdecode.errors import UserError
from specdecode.llm import LLM
from specdecode.model.transformer import Transformer
from specdecode.server.limits import MAX_BODY_BYTES, PUBLIC_PATHS

if TYPE_CHECKING:
    from specdecode.server.app import ServeConfig

DEFAULT_SCHEDULER = SchedulerConfig()
DEFAULT_MAX_NUM_SEQS = 16  # a CPU's batch: past ~16 rows a verification pass is compute-bound
DEFAULT_KV_CACHE_GIB = 4.0
DEFAULT_PREFIX_CACHE_GIB = 1.0


@dataclass(frozen=True, slots=True)
class ServeSpec:
    """What a server process needs to load the model and build its app; plain values, so a
    Ray replica (another process, maybe another machine) builds its own from a copy.

    model, dtype, device, quantization: as `LLM` takes them.
    speculative_configs: one per drafter served (`LLM.with_drafters`); () = plain decoding.
    max_num_seqs, max_num_batched_tokens: the continuous batch's limits.
    kv_cache_gib: GiB of KV cache the running batch may take.
    prefix_cache_gib: GiB of earlier sequences' keys and values kept for prompts that start
        the same way (0 = no prefix caching).
    served_model_name, api_key, public_paths, max_body_bytes, tool_call_parser: as
        `ServeConfig` has them.
    """

    model: str
    dtype: str = "bfloat16"
    device: str = "cpu"
    quantization: str | None = "auto"
    speculative_configs: tuple[dict[str, Any], ...] = ()
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_SCHEDULER.max_num_batched_tokens
    kv_cache_gib: float = DEFAULT_KV_CACHE_GIB
    prefix_cache_gib: float = DEFAULT_PREFIX_CACHE_GIB
    served_model_name: str | None = None
    api_key: str | None = None
    public_paths: tuple[str, ...] = PUBLIC_PATHS
    max_body_bytes: int = MAX_BODY_BYTES
    tool_call_parser: str | None = None

    @property
    def name(self) -> str:
        """The name clients use: served_model_name, else the model as given."""
        return self.served_model_name or self.model

    def load(self, replica_id: str | None = None) -> tuple[LLM, ServeConfig]:
        """Load the model and its drafters; the app's config (naming `replica_id`, if any)."""
        from specdecode.server.app import ServeConfig

        llm = LLM(
            model=self.model, dtype=self.dtype, device=self.device, quantization=self.quantization
        )
        if self.speculative_configs:
            llm = llm.with_drafters(self.speculative_configs)
        llm.set_scheduler(
            SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                kv_cache_tokens=kv_cache_tokens(llm.model, self.kv_cache_gib),
                prefix_cache_tokens=prefix_cache_tokens(llm.model, self.prefix_cache_gib),
            )
        )
        config = ServeConfig(
            self.name,
            self.api_key,
            replica_id,
            self.public_paths,
            self.max_body_bytes,
            self.tool_call_parser,
        )
        return llm, config


def kv_cache_tokens(model: Transformer, gib: float) -> int:
    """KV slots that `gib` GiB hold for `model` (keys and values of every layer)."""
    tokens = int(gib * 2**30) // _token_bytes(model)
    if tokens < 1:
        raise UserError(
            f"--kv-cache-memory {gib:g} GiB holds no token ({_token_bytes(model)} bytes each)"
        )
    return tokens


def prefix_cache_tokens(model: Transformer, gib: float) -> int:
    """Tokens of prefix cache that `gib` GiB hold for `model`, whole blocks (0: off)."""
    if gib < 0:
        raise UserError(f"--prefix-cache-memory must be >= 0 GiB (0 = off), got {gib:g}")
    tokens = int(gib * 2**30) // _token_bytes(model) // BLOCK_TOKENS * BLOCK_TOKENS
    if gib > 0 and tokens == 0:
        raise UserError(f"--prefix-cache-memory {gib:g} GiB holds no block of {BLOCK_TOKENS}")
    return tokens


def _token_bytes(model: Transformer) -> int:
    """Bytes of one token's keys and values, every layer."""
    cfg = model.config
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * model.dtype.itemsize
