"""Start N engine replicas on Ray Serve and return the ingress's client to them.

`stratum serve --replicas N` (N > 1) calls `start`: it starts a local Ray cluster, or joins the
one at --ray-address, deploys the replicas (`replica.EngineReplica`) with Stratum's request router,
waits until every replica has loaded its model, and returns the `EngineClient` on them. The server
in front is the same FastAPI/uvicorn app as with one engine, so the API, headers, SSE, errors and
the HTTP hardening are those of the single process.
"""

from __future__ import annotations

import os
from dataclasses import asdict, replace

from stratum.engine.config import EngineConfig, default_threads

DEPLOYMENT = "stratum-engine"


def start(config: EngineConfig, replicas: int, ray_address: str | None = None, routing: str = "prefix",
          app_name: str = "stratum", max_imbalance: int = 8):
    """Deploy `replicas` engines for `config`; returns their EngineClient (its `shutdown` undeploys them,
    and stops the Ray cluster if this call started it; a cluster joined keeps running)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from stratum.cluster.client import connect
    from stratum.cluster.replica import EngineReplica
    from stratum.cluster.routing import POLICIES
    from stratum.engine.protocol import decode

    if ray_address and ray_address.startswith("ray://"):  # Serve streams no handle calls through Ray Client
        raise ValueError("--ray-address: Ray Client addresses (ray://) are not supported; run the server on a "
                         "node of the cluster and give `auto` or the head's host:port")
    if routing not in POLICIES:
        raise ValueError(f"unknown routing policy {routing!r} (one of {', '.join(POLICIES)})")
    started = not ray.is_initialized()
    if started:
        if ray_address:
            ray.init(address=ray_address, log_to_driver=True)
        else:  # a cluster of this machine alone
            ray.init(address="local", num_cpus=os.cpu_count() or 1, include_dashboard=False,
                     _node_ip_address="127.0.0.1", log_to_driver=True)
    threads = config.num_threads or default_threads(serving=True, replicas=replicas)
    # Each replica starts on the prepared kernels (no PyTorch-first start and switch per replica):
    # on this machine they are prepared once, here, rather than by every replica at once, each
    # disturbing the others' measurements; a replica on another node measures its own as it starts.
    config = replace(config, num_threads=threads, replicas=replicas, defer_kernels=False)
    if not ray_address and config.device != "cuda":
        from stratum.engine.prepare import prepare

        resolved = prepare(config)
        if config.kv_cache_memory_mb is None and config.num_kv_blocks is None:  # the replicas share the default pool
            config = replace(config, num_kv_blocks=max(16, resolved.num_kv_blocks // replicas))
    sched = config.scheduler
    # Each replica's engine batches and queues by itself: Serve only has to let that many calls through.
    deployment = serve.deployment(
        EngineReplica, name=DEPLOYMENT, num_replicas=replicas,
        ray_actor_options={"num_cpus": 0, "num_gpus": 1 if config.device == "cuda" else 0},
        max_ongoing_requests=sched.max_num_seqs + sched.max_waiting,
        health_check_period_s=2.0, health_check_timeout_s=30.0, graceful_shutdown_timeout_s=5.0,
        request_router_config=RequestRouterConfig(
            request_router_class="stratum.cluster.router.StratumRouter",
            request_router_kwargs={"policy": routing,
                                   **({"max_imbalance": max_imbalance} if routing == "prefix" else {})},
            request_routing_stats_period_s=0.5, request_routing_stats_timeout_s=5.0),
    )
    serve.start(proxy_location="Disabled")
    handle = serve.run(deployment.bind(asdict(config)), name=app_name, route_prefix=None)
    description = decode(handle.describe.remote().result(timeout_s=120))

    def shutdown() -> None:
        try:
            serve.delete(app_name)
        finally:
            if started and not ray_address:  # our own cluster: Serve and Ray go with it
                serve.shutdown()
            if started:  # a cluster joined is left running, with its other applications
                ray.shutdown()

    return connect(handle, description, DEPLOYMENT, on_shutdown=shutdown)
