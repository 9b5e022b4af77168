"""Scale-out: N engine replicas on Ray Serve behind one server, routed by the prefix cache.

Ray is imported only here (`pip install 'stratum-serve[ray]'`); `stratum serve` with one replica
never loads it. `routing.py` is the routing policy as a plain object; `router.py` plugs it into Ray
Serve's request router; `replica.py` is one engine replica; `client.py` is the transport that the
server's engine client uses to reach the replicas; `launch.py` deploys them.
"""
