"""The routing policy inside Ray Serve's request router (`ray.serve.request_router`, alpha API).

Serve runs the router in the process that holds the deployment handle — the ingress — and calls
`choose_replicas` for each request; the ranks it returns are tried in order, and within a rank
Serve skips a replica whose queue is full. This adapter feeds the pure policy (`routing.py`): the
replicas' routing stats as reports, the requests it routed as its own memory. It also keeps the latest stats per replica, which the ingress reads for /health and /metrics.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from stratum.cluster.routing import make_policy
from stratum.engine.protocol import decode

ROUTERS: dict[str, "StratumRouter"] = {}  # deployment name -> its router in this process


class StratumRouter(RequestRouter):
    def initialize_state(self, policy: str = "prefix", **kwargs) -> None:
        self.policy = make_policy(policy, **kwargs)
        self.policy_name = policy
        # Serve ships this class to the handle by value (cloudpickle), so its functions' globals are a
        # copy: the registry the ingress reads is the imported module's.
        from stratum.cluster import router

        router.ROUTERS[self._deployment_id.name] = self

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.policy.set_replicas(sorted(r.replica_id.unique_id for r in replicas))

    def stats(self) -> dict[str, dict[str, Any]]:
        """Each replica's latest routing stats (what /health and /metrics show), by replica name."""
        return {r.replica_id.unique_id: dict(r.routing_stats or {}) for r in self._replicas_list}

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        for name, r in by_name.items():
            stats = r.routing_stats
            if stats and "snapshot" in stats:
                s = decode(stats["snapshot"])
                self.policy.report(name, stats["at"], stats["calls"], s.kv_blocks.free if s.kv_blocks.total else None,
                                   stats["held"], stats["held_at"], s.alive)
        ranked = self.policy.rank(_keys_of(pending_request), sorted(by_name))
        return [[by_name[n]] for n in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        # Only accepted requests get here. Completions are left to the replicas' reports: Serve also
        # reports a rejected attempt as completed, and a fast request may complete before it is
        # reported routed.
        self.policy.routed(replica_id.unique_id, _keys_of(pending_request))


def _keys_of(pending_request: PendingRequest | None) -> list[int]:
    """A `generate` call carries its prompt's block keys; other calls (describe) have none."""
    if pending_request is None or not pending_request.args or not isinstance(pending_request.args[0], dict):
        return []
    return pending_request.args[0].get("keys") or []
