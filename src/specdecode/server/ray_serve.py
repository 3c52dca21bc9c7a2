"""`specdecode serve MODEL --replicas N`: N replicas of the engine behind Ray Serve's HTTP proxy.

Each replica is a Ray actor that loads the model and runs the same FastAPI app as a single
server (`build_app`: the OpenAI routes, /viz, /metrics), built in the replica by Ray Serve's
ingress builder. The proxy spreads requests over the replicas (Ray Serve's power-of-two-choices
router, by ongoing requests) and streams their responses; Ray's controller restarts a replica
that dies, and requests on other replicas go on. Every response names its replica in the
`x-specdecode-replica` header. Ray starts a local instance unless RAY_ADDRESS names a cluster
(docs/serving.md: a multi-node set-up).
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

from specdecode.errors import UserError

if TYPE_CHECKING:
    from fastapi import FastAPI

    from specdecode.server.spec import ServeSpec

APP_NAME = "specdecode"
DEPLOYMENT_NAME = "specdecode"
RAY_REQUIREMENT = "ray[serve]>=2.40"


def ray_serve() -> Any:
    """The `ray.serve` module, or a UserError saying what to install."""
    try:
        from ray import serve
    except ImportError as err:
        raise UserError(
            f"--replicas runs on Ray Serve, which is not installed ({err.name} is missing): "
            f"pip install '{RAY_REQUIREMENT}'"
        ) from err
    return serve


def check_replicas(replicas: int, threads: int | None) -> int:
    """Refuse a replica count or thread count below 1; the threads each replica takes
    (default: this machine's cores / replicas, at least 1)."""
    if replicas < 1:
        raise UserError(f"--replicas must be >= 1, got {replicas}")
    if threads is not None and threads < 1:
        raise UserError(f"--threads-per-replica must be >= 1, got {threads}")
    return threads or max(1, (os.cpu_count() or 1) // replicas)


def replica_app(spec: ServeSpec, threads: int) -> FastAPI:
    """Inside a replica: pin its threads, load the model, build the app (named after the
    replica)."""
    import torch

    from specdecode.server.app import build_app

    torch.set_num_threads(threads)
    replica_id = ray_serve().get_replica_context().replica_id.unique_id
    llm, config = spec.load(replica_id)
    return build_app(llm, config)


def application(spec: ServeSpec, replicas: int, threads: int) -> Any:
    """The Ray Serve application: `replicas` replicas of the app, `threads` CPUs each."""
    serve = ray_serve()
    # each replica's OpenMP team (the engine thread's) takes its share of the cores
    options = {"num_cpus": threads, "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(threads)}}}
    ingress = serve.ingress(lambda: replica_app(spec, threads))
    replica = serve.deployment(
        ingress(),
        name=DEPLOYMENT_NAME,
        num_replicas=replicas,
        ray_actor_options=options,
        max_ongoing_requests=max(1, 4 * spec.max_num_seqs),
    )
    return replica.bind()


def start(spec: ServeSpec, replicas: int, host: str, port: int, threads: int | None) -> Any:
    """Connect to Ray (RAY_ADDRESS, else a new local instance), start Serve's proxy on
    host:port and deploy the replicas; returns once they are all up."""
    import ray

    serve = ray_serve()
    threads = check_replicas(replicas, threads)
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False)
    serve.start(http_options={"host": host, "port": port})
    return serve.run(application(spec, replicas, threads), name=APP_NAME, route_prefix="/")


def run_replicas(spec: ServeSpec, replicas: int, host: str, port: int, threads: int | None) -> int:
    """`specdecode serve --replicas N`: deploy, then serve until interrupted."""
    import time

    serve = ray_serve()
    start(spec, replicas, host, port, threads)
    print(
        f"specdecode: serving {spec.model} as {spec.name!r} on http://{host}:{port}/v1 with "
        f"{replicas} replica(s) on Ray Serve (Ctrl-C stops them)",
        file=sys.stderr,
    )
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()
    return 0
