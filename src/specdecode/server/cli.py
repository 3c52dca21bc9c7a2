"""`specdecode serve MODEL`: its flags and its command."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from specdecode.cli_args import add_weight_flags, json_object
from specdecode.engine.scheduler import SchedulerConfig
from specdecode.errors import UserError
from specdecode.llm import LLM
from specdecode.model.transformer import Transformer

if TYPE_CHECKING:
    from specdecode.server.app import ServeConfig

_DEFAULT = SchedulerConfig()
DEFAULT_MAX_NUM_SEQS = 16  # a CPU's batch: past ~16 rows a verification pass is compute-bound
DEFAULT_KV_CACHE_GIB = 4.0


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    """Register `specdecode serve`."""
    p = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API (continuous batching)",
        description="Serves /v1/completions, /v1/chat/completions (streamed or not), "
        "/v1/models, /tokenize, /detokenize, /health and /metrics (Prometheus). Requests join "
        "the running batch between steps; a request that does not fit waits. See "
        "docs/serving.md.",
    )
    p.add_argument("model", help="alias, Hugging Face folder or .gguf file")
    p.add_argument("--served-model-name", help="the name clients use (default: MODEL)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1")
    p.add_argument(
        "--speculative-config",
        type=json_object,
        action="append",
        default=None,
        help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 8}\'; give it more '
        'than once to serve several drafters, each picked per request by its "name" (the '
        'request\'s "drafter"; default name: the method, e.g. "ngram"; the first is the default)',
    )
    add_weight_flags(p)
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=DEFAULT_MAX_NUM_SEQS,
        help=f"requests running at once (default {DEFAULT_MAX_NUM_SEQS})",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=_DEFAULT.max_num_batched_tokens,
        help="tokens one step may feed: prompts admitted + verification "
        f"(default {_DEFAULT.max_num_batched_tokens})",
    )
    p.add_argument(
        "--kv-cache-memory",
        type=float,
        default=DEFAULT_KV_CACHE_GIB,
        help=f"GiB the running batch's KV cache may take (default {DEFAULT_KV_CACHE_GIB:g})",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="serve N replicas of the engine behind Ray Serve's HTTP proxy (a local Ray "
        "instance, or the cluster RAY_ADDRESS names; needs `pip install 'ray[serve]'`); "
        "default: one server, no Ray",
    )
    p.add_argument(
        "--threads-per-replica",
        type=int,
        default=None,
        help="CPU threads (and Ray CPUs) each replica takes (default: this machine's cores / N)",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


@dataclass(frozen=True, slots=True)
class ServeSpec:
    """What a server process needs to load the model and build its app; plain values, so a
    Ray replica (another process, maybe another machine) builds its own from a copy.

    model, dtype, device, quantization: as `LLM` takes them.
    speculative_configs: one per drafter served (`LLM.with_drafters`); () = plain decoding.
    max_num_seqs, max_num_batched_tokens: the continuous batch's limits.
    kv_cache_gib: GiB of KV cache the running batch may take.
    served_model_name, api_key: as `ServeConfig` has them.
    """

    model: str
    dtype: str = "bfloat16"
    device: str = "cpu"
    quantization: str | None = "auto"
    speculative_configs: tuple[dict[str, Any], ...] = ()
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = _DEFAULT.max_num_batched_tokens
    kv_cache_gib: float = DEFAULT_KV_CACHE_GIB
    served_model_name: str | None = None
    api_key: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeSpec:
        return cls(
            model=args.model,
            dtype=args.dtype,
            device=args.device,
            quantization=args.quantization,
            speculative_configs=tuple(args.speculative_config or ()),
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            kv_cache_gib=args.kv_cache_memory,
            served_model_name=args.served_model_name,
            api_key=args.api_key,
        )

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
        scheduler = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            kv_cache_tokens=kv_cache_tokens(llm.model, self.kv_cache_gib),
        )
        config = ServeConfig(self.name, self.api_key, scheduler, replica_id)
        return llm, config


def kv_cache_tokens(model: Transformer, gib: float) -> int:
    """KV slots that `gib` GiB hold for `model` (keys and values of every layer)."""
    cfg = model.config
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * model.dtype.itemsize
    tokens = int(gib * 2**30) // per_token
    if tokens < 1:
        raise UserError(f"--kv-cache-memory {gib:g} GiB holds no token ({per_token} bytes each)")
    return tokens


def run_serve(args: argparse.Namespace) -> int:
    """Load the model and serve it until interrupted: one uvicorn server, or `--replicas N`
    behind Ray Serve."""
    try:  # the server's stack loads only here
        import uvicorn

        from specdecode.server.app import build_app
    except ImportError as err:
        raise UserError(
            f"specdecode serve needs the server's packages ({err.name} is missing): "
            "pip install 'specdecode[serve]'"
        ) from err

    spec = ServeSpec.from_args(args)
    if args.replicas is not None or args.threads_per_replica is not None:
        from specdecode.server.ray_serve import run_replicas

        return run_replicas(
            spec, args.replicas or 1, args.host, args.port, args.threads_per_replica
        )
    llm, config = spec.load()
    scheduler = config.scheduler
    print(
        f"specdecode: serving {args.model} as {config.served_model_name!r} on "
        f"http://{args.host}:{args.port}/v1 (max {scheduler.max_num_seqs} running, "
        f"KV cache {scheduler.kv_cache_tokens} tokens)",
        file=sys.stderr,
    )
    uvicorn.run(build_app(llm, config), host=args.host, port=args.port, log_level=args.log_level)
    return 0
