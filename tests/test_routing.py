"""The routing policies on their own (no Ray, no engine), and a one-engine server that never loads them."""

import pytest

from stratum.cluster.routing import PowerOfTwoPolicy, PrefixPolicy, RoundRobinPolicy, make_policy
from stratum.engine.request import Sequence, prompt_block_keys, short_key
from stratum.engine.sampling_params import SamplingParams


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def keys(prefix: int, n: int = 8) -> list[int]:
    """Block keys of a prompt that shares its first n blocks with every prompt of the same prefix."""
    return prompt_block_keys([prefix] * (16 * n) + [1], 16, None)


def policy(**kwargs) -> PrefixPolicy:
    p = PrefixPolicy(clock=Clock(), **kwargs)
    p.set_replicas(["a", "b", "c"])
    return p


def test_block_keys_are_the_engines_chain():
    ids = list(range(100))
    seq = Sequence("r", ids, SamplingParams(), block_size=16, cache_salt="tenant")
    engine_keys = [short_key(h) for h in seq.full_block_hashes()[: (len(ids) - 1) // 16]]
    assert prompt_block_keys(ids, 16, "tenant") == engine_keys
    assert prompt_block_keys(ids, 16, None) != engine_keys  # the salt is part of the chain
    assert prompt_block_keys(list(range(16)), 16, None) == []  # one token is always left to compute


def test_same_prefix_follows_its_placement_before_any_report():
    p = policy()
    first = p.rank(keys(1), ["a", "b", "c"])[0]
    p.routed(first, keys(1))
    for _ in range(5):
        assert p.rank(keys(1), ["a", "b", "c"])[0] == first


def test_new_prefixes_spread_over_idle_replicas():
    p = policy()
    chosen = []
    for prefix in range(3):
        name = p.rank(keys(prefix), ["a", "b", "c"])[0]
        p.routed(name, keys(prefix))
        p.report(name, at=p.clock() + 0.5, load=0, free_blocks=None, held=[])  # done, and said so
        chosen.append(name)
    assert sorted(chosen) == ["a", "b", "c"]


def test_reported_cache_wins_and_partial_matches_rank_by_length():
    p = policy()
    p.report("b", at=999.0, load=0, free_blocks=100, held=keys(7, 4))  # the first 4 blocks
    p.report("c", at=999.0, load=0, free_blocks=100, held=keys(7, 6))  # the first 6 blocks
    assert p.rank(keys(7), ["a", "b", "c"]) [0] == "c"
    assert p.replicas["c"].matched_blocks(keys(7)) == 6


def test_a_long_queue_sends_the_request_elsewhere():
    p = policy(max_imbalance=2)
    p.report("a", at=999.0, load=0, free_blocks=100, held=keys(3))
    for _ in range(3):
        p.routed("a", keys(3))
    overflow = p.rank(keys(3), ["a", "b", "c"])[0]
    assert overflow != "a"  # 3 in flight vs 0: past the imbalance allowed
    assert p.replicas[overflow].matched_blocks(keys(3)) == 8  # the copy it computes there is remembered
    p.report("a", at=p.clock() + 0.5, load=0, free_blocks=100, held=keys(3))  # its three have completed
    third = ({"a", "b", "c"} - {"a", overflow}).pop()
    for _ in range(10):
        assert p.rank(keys(3), ["a", "b", "c"])[0] != third  # one of the two holders, never the third


def test_a_cache_listing_made_after_the_grace_replaces_placements():
    clock = Clock()
    p = PrefixPolicy(clock=clock, placement_grace_s=2.0)
    p.set_replicas(["a", "b"])
    p.routed("a", keys(5))
    assert p.replicas["a"].load == 1
    p.report("a", at=clock.t + 5.0, load=0, free_blocks=100, held=[], held_at=clock.t + 1.0)
    assert p.replicas["a"].load == 0  # the report counts what it serves; what was routed before is in it
    assert p.replicas["a"].matched_blocks(keys(5)) == 8  # listed too soon after: the prefill may still run
    p.report("a", at=clock.t + 6.0, load=0, free_blocks=100, held=[], held_at=clock.t + 3.0)
    assert p.replicas["a"].matched_blocks(keys(5)) == 0  # evicted since, and listed so
    p.report("a", at=clock.t + 5.5, load=7, free_blocks=0, held=keys(5))  # an older report changes nothing
    assert p.replicas["a"].reported_load == 0


def test_requests_routed_after_a_report_count_until_the_next():
    clock = Clock()
    p = PrefixPolicy(clock=clock)
    p.set_replicas(["a"])
    p.report("a", at=clock.t, load=3, free_blocks=100, held=[])
    clock.t += 0.1
    p.routed("a", [])
    p.routed("a", [])
    assert p.replicas["a"].load == 5
    p.report("a", at=clock.t + 0.4, load=2, free_blocks=100, held=[])
    assert p.replicas["a"].load == 2


def test_a_replica_whose_engine_died_is_not_chosen():
    p = policy()
    p.report("a", at=999.0, load=0, free_blocks=100, held=keys(4), alive=False)
    assert "a" not in p.rank(keys(4), ["a", "b", "c"])
    p.report("b", at=999.0, load=0, free_blocks=100, held=[], alive=False)
    p.report("c", at=999.0, load=0, free_blocks=100, held=[], alive=False)
    assert sorted(p.rank(keys(4), ["a", "b", "c"])) == ["a", "b", "c"]  # all dead: Serve is replacing them


def test_short_prompts_go_to_the_shortest_queue():
    """A prompt under one block caches nothing: free memory is no reason to pile onto a replica."""
    p = policy()
    for name, free in (("a", 1000), ("b", 990), ("c", 980)):
        p.report(name, at=999.0, load=0, free_blocks=free, held=[])
    chosen = []
    for _ in range(30):
        name = p.rank([], ["a", "b", "c"])[0]
        p.routed(name, [])
        chosen.append(name)
    assert sorted(chosen.count(n) for n in "abc") == [10, 10, 10]


def test_gone_replicas_are_forgotten_and_new_ones_start_empty():
    p = policy()
    p.routed("a", keys(1))
    p.set_replicas(["b", "d"])
    assert set(p.replicas) == {"b", "d"}
    assert p.rank(keys(1), ["b", "d"])[0] in ("b", "d")
    p.routed("a", keys(1))  # a late routing to a replica that is gone is ignored


def test_placements_are_bounded():
    p = PrefixPolicy(clock=Clock(), max_placed=10)
    p.set_replicas(["a"])
    for prefix in range(5):
        p.routed("a", keys(prefix))
    assert len(p.replicas["a"].placed) == 10


def test_round_robin_and_power_of_two():
    rr = RoundRobinPolicy()
    rr.set_replicas(["a", "b", "c"])
    assert [rr.rank(keys(1), ["a", "b", "c"])[0] for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]
    p2 = PowerOfTwoPolicy(seed=0)
    p2.set_replicas(["a", "b"])
    for _ in range(4):
        p2.routed("a", [])
    assert all(p2.rank([], ["a", "b"])[0] == "b" for _ in range(10))


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="round-robin"):
        make_policy("random")


def test_a_short_shared_opening_does_not_decide():
    """Every chat prompt starts with the template's opening block: holding it is no reason to go there."""
    p = policy()
    opening = keys(9, 1)
    p.report("a", at=999.0, load=0, free_blocks=10, held=opening)
    p.report("b", at=999.0, load=0, free_blocks=50, held=[])
    p.report("c", at=999.0, load=0, free_blocks=20, held=[])
    prompt = opening + keys(10, 8)[1:]  # shares one block of nine
    assert p.rank(prompt, ["a", "b", "c"])[0] == "b"  # the most free KV blocks


def test_a_new_prefix_goes_where_memory_is_free_among_short_queues():
    p = policy(max_imbalance=2)
    p.report("a", at=999.0, load=0, free_blocks=10, held=[])
    p.report("b", at=999.0, load=2, free_blocks=90, held=[])  # busier, but within the imbalance
    p.report("c", at=999.0, load=5, free_blocks=200, held=[])  # the most memory, but too long a queue
    assert p.rank(keys(11), ["a", "b", "c"]) == ["b", "a", "c"]


def test_one_engine_never_imports_ray(tiny_model_dir):
    """`stratum serve` with one replica, serving a request, loads neither Ray nor the cluster package,
    in the server's process or the engine's: Python reports every import (-X importtime) to the log."""
    import httpx

    from tests.conftest import ServerProcess

    server = ServerProcess(str(tiny_model_dir), "--served-model-name", "tiny", "--kv-cache-mb", "8",
                           env={"PYTHONPROFILEIMPORTTIME": "1"}).wait_ready()
    try:
        r = httpx.post(server.url + "/v1/messages", timeout=60,
                       json={"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
    finally:
        server.stop()
    with open(server.log.name) as f:
        imported = {line.rsplit("|", 1)[1].strip() for line in f if line.startswith("import time:")}
    assert {"stratum.server.app", "stratum.engine.core"} <= imported  # both processes' imports are there
    bad = sorted(m for m in imported if m == "ray" or m.startswith(("ray.", "stratum.cluster")))
    assert not bad, bad


def test_a_new_prefix_is_placed_when_ranked():
    """Serve ranks requests concurrently: the second request of a new prefix, ranked before the first
    is sent, follows the first."""
    p = policy()
    first = p.rank(keys(12), ["a", "b", "c"])[0]
    assert p.rank(keys(12), ["a", "b", "c"])[0] == first
    assert p.rank(keys(13), ["a", "b", "c"])[0] != first  # and the next new prefix goes elsewhere
