"""`trajserve serve --replicas N [--ray-address ADDR] [--router kv]`: N
engine replicas as Ray actors behind one front end (cluster/frontend.py).

Actors rather than a Ray Serve deployment: the front end must see every
replica by index (the prefix directory keys blocks by replica, sessions stick
to one), stream through its own router, and tell which replica died under a
request; Serve's proxy and request router would sit between. Each actor is
restarted by Ray when its process dies (max_restarts), asks for
--replica-cpus CPUs (Ray sets its threads to match), and holds its own KV
pool and tiers, sized by the usual engine options.

Without --ray-address a local Ray instance starts (ray.init()); with one the
replicas join that cluster and are placed on its nodes, so the same command
runs across machines (the model path must exist on every node). `ray` comes
with the `cluster` extra: `pip install trajserve[cluster]`.
"""
from __future__ import annotations

import argparse
import logging

from trajserve.cluster.router import make_router
from trajserve.server.config import ServerConfig

log = logging.getLogger("trajserve.cluster")


def _ray():
    try:
        import ray
    except ImportError:
        raise ValueError("--replicas runs the replicas on Ray, which is not installed: "
                         "pip install 'trajserve[cluster]'") from None
    return ray


def _check(args: argparse.Namespace) -> None:
    if args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    if not 0 < args.replica_cpus < float("inf"):
        raise ValueError(f"--replica-cpus must be a number > 0, got {args.replica_cpus}")


def start_replicas(args: argparse.Namespace, config: ServerConfig | None = None) -> list:
    """The replicas' actors (each loads its engine in its own process; call
    Frontend.start to wait for them). Ray must be initialised. config: each
    replica's server (default: from args)."""
    ray = _ray()
    from trajserve.cluster.replica import Replica

    _check(args)
    config = config or ServerConfig.from_args(args)
    actor = ray.remote(Replica)
    return [actor.options(max_restarts=-1, max_task_retries=0, num_cpus=args.replica_cpus,
                          max_concurrency=1000).remote(args, i, config)
            for i in range(args.replicas)]


def make_frontend(actors: list, router: str = "kv", **router_options):
    """The front end over actors, routing by the named policy (cluster/router.py)."""
    ray = _ray()
    from trajserve.cluster.frontend import Frontend

    tokenizer = ray.get(actors[0].tokenizer.remote())  # the replicas' own, chat template included
    policy = make_router(router, len(actors), **router_options)
    if hasattr(policy, "block_size"):
        policy.block_size = ray.get(actors[0].info.remote()).block_size
    return Frontend(actors, policy, tokenizer)


def serve_cluster(args: argparse.Namespace) -> int:
    ray = _ray()
    from trajserve.cluster.frontend import build_frontend
    from trajserve.server.serve import bind, run_uvicorn

    config = ServerConfig.from_args(args)
    if args.replicas is None:
        args.replicas = 1
    _check(args)
    make_router(args.router, args.replicas)  # a bad name fails before anything starts
    sock = bind(args)
    ray.init(address=args.ray_address, include_dashboard=False, log_to_driver=True)
    actors = start_replicas(args, config)
    frontend = make_frontend(actors, args.router)
    app = build_frontend(frontend, config)
    name = config.names_for(ray.get(actors[0].info.remote()).model_id)[0]
    log.info("%d replicas on Ray (%s), router %s", len(actors), ray.get_runtime_context().gcs_address,
             args.router)

    def stop() -> None:
        for a in actors:
            try:
                ray.get(a.close.remote(), timeout=60)
            except Exception as e:  # noqa: BLE001 - a dead replica has nothing left to close
                log.warning("closing a replica: %s", e)
        ray.shutdown()
    return run_uvicorn(app, sock, name, stop, f" ({len(actors)} replicas on Ray, router {args.router})")
