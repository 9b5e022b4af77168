"""The routing policy inside Ray Serve's request router (`ray.serve.request_router`, alpha API).

Serve runs the router in the process that holds the deployment handle — the ingress — and calls
`choose_replicas` for each request; the ranks it returns are tried in order, and within a rank
Serve skips a replica whose queue is full. This adapter feeds the pure policy (`routing.py`): the
replicas' routing stats as reports, the requests it routed as its own memory. Each time the
replicas report (Serve hands the router their stats with `update_replicas`), it also tells the
ingress's transport what each replica reported (`listen`), for /health, /metrics and admission.
"""

from __future__ import annotations

import threading
from typing import Callable

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from stratum.cluster.routing import make_policy
from stratum.engine.client import ReplicaView
from stratum.engine.protocol import ROUTING_STATS_KEY, EngineSnapshot, ReplicaReport, decode

Listener = Callable[[list[ReplicaView]], None]
_LISTENERS: dict[str, Listener] = {}  # deployment name -> what the ingress's transport is told
_LATEST: dict[str, list[ReplicaView]] = {}  # deployment name -> the replicas' latest reports
_LOCK = threading.Lock()


def listen(deployment: str, listener: Listener) -> None:
    """Tell `listener` each report of the deployment's replicas (in name order, from the router's
    thread), starting with the latest one, if the router has had one."""
    with _LOCK:
        _LISTENERS[deployment] = listener
        if deployment in _LATEST:
            listener(_LATEST[deployment])


def publish(deployment: str, views: list[ReplicaView]) -> None:
    with _LOCK:
        _LATEST[deployment] = views
        listener = _LISTENERS.get(deployment)
        if listener is not None:
            listener(views)


class StratumRouter(RequestRouter):
    def initialize_state(self, policy: str = "prefix", **kwargs) -> None:
        self.policy = make_policy(policy, **kwargs)
        # Serve ships this class to the handle by value (cloudpickle), so its functions' globals are a
        # copy: the registry the ingress listens on is the imported module's.
        from stratum.cluster import router

        self._registry = router

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.policy.set_replicas(sorted(r.replica_id.unique_id for r in replicas))
        views = []
        for r in replicas:
            encoded = (r.routing_stats or {}).get(ROUTING_STATS_KEY)  # none until its first report
            views.append(self._report(r.replica_id.unique_id, decode(encoded) if encoded is not None else None))
        self._registry.publish(self._deployment_id.name, sorted(views, key=lambda v: v.name))

    def _report(self, name: str, report: ReplicaReport | None) -> ReplicaView:
        """A replica's routing stats (`EngineReplica.record_routing_stats`), told to the policy once;
        None before its first."""
        if report is not None:
            snapshot = report.snapshot
            free = snapshot.kv_blocks.free if snapshot.kv_blocks.total else None
            self.policy.report(name, report.at, report.calls, free, report.held, report.held_at, snapshot.alive)
        state = self.policy.replicas.get(name)
        load = state.load if state else 0
        if report is None:
            return ReplicaView(name, None, EngineSnapshot(alive=True), load, 0, 0.0)
        return ReplicaView(name, report.pid, report.snapshot, load, len(report.held), report.at)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
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
