"""`specdecode serve MODEL`: its flags and its command."""

from __future__ import annotations

import argparse
import sys

from specdecode.cli_args import add_weight_flags, json_object
from specdecode.errors import UserError
from specdecode.server.limits import MAX_BODY_BYTES, PUBLIC_PATHS
from specdecode.server.spec import (
    DEFAULT_KV_CACHE_GIB,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_PREFIX_CACHE_GIB,
    DEFAULT_SCHEDULER,
    ServeSpec,
)
from specdecode.tool_calls.parsers import PARSERS


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    """Register `specdecode serve`."""
    p = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API (continuous batching)",
        description="Serves /v1/completions, /v1/chat/completions (streamed or not), "
        "/v1/models, /tokenize, /detokenize, /health, /metrics (Prometheus) and /viz (a page "
        "that draws each step's drafted and accepted tokens live). Requests join the running "
        "batch between steps; a request that does not fit waits. See docs/serving.md.",
    )
    p.add_argument("model", help="alias, Hugging Face folder or .gguf file")
    p.add_argument("--served-model-name", help="the name clients use (default: MODEL)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback)")
    p.add_argument("--port", type=int, default=8000, help="(default 8000)")
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' (or HTTP Basic with KEY as the password, "
        "which a browser prompts for) on every route but --public-paths",
    )
    p.add_argument(
        "--public-paths",
        type=_paths,
        default=PUBLIC_PATHS,
        help="comma-separated paths answered without the key "
        f"(default {','.join(PUBLIC_PATHS)}; '' for none)",
    )
    p.add_argument(
        "--max-body-mib",
        type=float,
        default=MAX_BODY_BYTES / 2**20,
        help="the largest request body read, in MiB; a longer one gets a 413 before it is read "
        f"(default {MAX_BODY_BYTES / 2**20:g})",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=sorted(PARSERS),
        default=None,
        help="how the model writes tool calls (vLLM's names); default: the format its chat "
        "template shows (<tool_call>: hermes, [TOOL_CALLS]: mistral, <|python_tag|>: "
        "llama3_json)",
    )
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
        default=DEFAULT_SCHEDULER.max_num_batched_tokens,
        help="tokens one step may feed: prompts admitted + verification "
        f"(default {DEFAULT_SCHEDULER.max_num_batched_tokens})",
    )
    p.add_argument(
        "--kv-cache-memory",
        type=float,
        default=DEFAULT_KV_CACHE_GIB,
        help=f"GiB the running batch's KV cache may take (default {DEFAULT_KV_CACHE_GIB:g})",
    )
    p.add_argument(
        "--prefix-cache-memory",
        type=float,
        default=DEFAULT_PREFIX_CACHE_GIB,
        help="GiB of earlier requests' keys and values kept, so a prompt that starts like one "
        "before (a chat's next turn, a shared system prompt) prefills only what is new "
        f"(default {DEFAULT_PREFIX_CACHE_GIB:g}; 0 = off)",
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


def serve_spec(args: argparse.Namespace) -> ServeSpec:
    """The ServeSpec that `specdecode serve`'s flags describe."""
    return ServeSpec(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        quantization=args.quantization,
        speculative_configs=tuple(args.speculative_config or ()),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_gib=args.kv_cache_memory,
        prefix_cache_gib=args.prefix_cache_memory,
        served_model_name=args.served_model_name,
        api_key=args.api_key,
        public_paths=args.public_paths,
        max_body_bytes=_mib_bytes(args.max_body_mib),
        tool_call_parser=args.tool_call_parser,
    )


def _paths(text: str) -> tuple[str, ...]:
    """'/health,/metrics' -> ('/health', '/metrics'); each must start with '/'."""
    paths = tuple(part.strip() for part in text.split(",") if part.strip())
    for path in paths:
        if not path.startswith("/"):
            raise argparse.ArgumentTypeError(f"a path starts with '/', got {path!r}")
    return paths


def _mib_bytes(mib: float) -> int:
    """--max-body-mib in bytes (UserError unless positive)."""
    if not mib > 0:
        raise UserError(f"--max-body-mib must be positive, got {mib:g}")
    return int(mib * 2**20)


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

    spec = serve_spec(args)
    if args.replicas is not None or args.threads_per_replica is not None:
        from specdecode.server.ray_serve import run_replicas

        return run_replicas(
            spec, args.replicas or 1, args.host, args.port, args.threads_per_replica
        )
    llm, config = spec.load()
    scheduler = llm.scheduler
    print(
        f"specdecode: serving {args.model} as {config.served_model_name!r} on "
        f"http://{args.host}:{args.port}/v1 (max {scheduler.max_num_seqs} running, "
        f"KV cache {scheduler.kv_cache_tokens} tokens, prefix cache "
        f"{scheduler.prefix_cache_tokens} tokens; live steps at "
        f"http://{args.host}:{args.port}/viz)",
        file=sys.stderr,
    )
    uvicorn.run(build_app(llm, config), host=args.host, port=args.port, log_level=args.log_level)
    return 0
