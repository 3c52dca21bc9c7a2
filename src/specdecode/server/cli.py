"""`specdecode serve MODEL`: its flags and its command."""

from __future__ import annotations

import argparse
import sys

from specdecode.cli_args import add_weight_flags, json_object
from specdecode.engine.scheduler import SchedulerConfig
from specdecode.errors import UserError
from specdecode.llm import LLM
from specdecode.model.transformer import Transformer

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
        default=None,
        help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 8}\'',
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
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def kv_cache_tokens(model: Transformer, gib: float) -> int:
    """KV slots that `gib` GiB hold for `model` (keys and values of every layer)."""
    cfg = model.config
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * model.dtype.itemsize
    tokens = int(gib * 2**30) // per_token
    if tokens < 1:
        raise UserError(f"--kv-cache-memory {gib:g} GiB holds no token ({per_token} bytes each)")
    return tokens


def run_serve(args: argparse.Namespace) -> int:
    """Load the model and serve it until interrupted."""
    try:  # the server's stack loads only here
        import uvicorn

        from specdecode.server.app import ServeConfig, build_app
    except ImportError as err:
        raise UserError(
            f"specdecode serve needs the server's packages ({err.name} is missing): "
            "pip install 'specdecode[serve]'"
        ) from err

    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        speculative_config=args.speculative_config,
        quantization=args.quantization,
    )
    scheduler = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_tokens=kv_cache_tokens(llm.model, args.kv_cache_memory),
    )
    name = args.served_model_name or args.model
    config = ServeConfig(served_model_name=name, api_key=args.api_key, scheduler=scheduler)
    print(
        f"specdecode: serving {args.model} as {name!r} on http://{args.host}:{args.port}/v1 "
        f"(max {scheduler.max_num_seqs} running, KV cache {scheduler.kv_cache_tokens} tokens)",
        file=sys.stderr,
    )
    uvicorn.run(build_app(llm, config), host=args.host, port=args.port, log_level=args.log_level)
    return 0
