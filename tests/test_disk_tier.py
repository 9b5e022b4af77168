"""The disk tier under the prefix cache: what it serves is what compute and the pool serve, to the same
tenant only, bound to the numerics that wrote it, within its size bound, and nothing broken on disk
(corrupt, truncated, half written, a killed writer, a full disk) is ever served or fails a request."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from stratum.engine import LLM
from stratum.engine.block_manager import BlockManager
from stratum.engine.disk_store import HEADER_BYTES, DiskStore
from stratum.engine.disk_tier import DiskTier
from stratum.engine.kv_view import kv_binding
from stratum.engine.request import hash_block, root_hash
from stratum.engine.sampling_params import SamplingParams
from stratum.kernels import native
from tests.factories import make_tiny_gguf

BS = 16
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


_opened: list[LLM] = []  # this test's engines, whose tiers `close_tiers` stops


def tiny_llm(model, kv_dir, gb: float | None = 1.0, **kw) -> LLM:
    settings = dict(num_kv_blocks=64, block_size=BS, dtype="float32", device="cpu", num_threads=1, int4_max_tokens=0)
    llm = LLM(str(model), kv_disk_gb=gb, kv_disk_dir=str(kv_dir), **{**settings, **kw})
    _opened.append(llm)
    return llm


def prompt(seed: int, n: int = 200) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 460) for _ in range(n)]


def run(llm: LLM, prompts: list[list[int]], salt: str | None = None):
    """Each prompt alone (one after another), so each is cached before the next is looked up."""
    outs = []
    for p in prompts:
        seq = llm.engine.add_request(p, GREEDY, cache_salt=salt)
        while llm.engine.has_unfinished():
            llm.engine.step()
        outs.append(seq)
    llm.engine.block_manager.check_integrity()
    return outs


def settled(llm: LLM) -> LLM:
    assert llm.engine.tier.flush(), "the tier's writes did not finish"
    return llm


def written(model, kv_dir, p: list[int]):
    """p served once by an engine with its tier under kv_dir, every block of it written: its output."""
    writer = tiny_llm(model, kv_dir)
    out = run(writer, [p])[0]
    settled(writer)
    return out


@pytest.fixture(autouse=True)
def close_tiers():
    """Each test's tiers stop their threads when it ends."""
    yield
    while _opened:
        _opened.pop().engine.tier.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return make_tiny_gguf(tmp_path_factory.mktemp("tiny-gguf") / "tiny.gguf")


STEPS = ["pytorch",
         pytest.param("native", marks=pytest.mark.skipif(not native.available(), reason="no native kernels"))]


@pytest.mark.parametrize("step", STEPS)
def test_greedy_output_is_the_same_from_compute_the_pool_and_the_disk(step, tiny_gguf, tmp_path):
    """The native step keeps keys transposed per block; the pytorch one slot-major: both round-trip."""
    p = prompt(0, 301)
    kv = tmp_path / "kv"
    computed = run(tiny_llm(tiny_gguf, tmp_path / "off", gb=0, native_step=step == "native"), [p])[0]
    first = tiny_llm(tiny_gguf, kv, native_step=step == "native")
    pooled = run(first, [p, p])
    settled(first)
    assert [s.num_cached_tokens for s in pooled] == [0, 300]  # the second read the pool (with a partial block)
    again = tiny_llm(tiny_gguf, kv, native_step=step == "native")  # a restart: the pool is empty, the disk is not
    assert again.engine.kernel_choices["step"] == ("native, packed blocks" if step == "native" else "pytorch")
    from_disk = run(again, [p])[0]
    assert from_disk.num_cached_tokens == from_disk.cache_stats.num_disk_cached_tokens == 300 // BS * BS
    assert from_disk.cache_stats.disk_read_s > 0 and from_disk.cache_stats.num_prompt_tokens_computed == 301 - 288
    assert (computed.output_token_ids == pooled[0].output_token_ids == pooled[1].output_token_ids
            == from_disk.output_token_ids)
    report = again.engine.tier.report()["disk"]
    assert report["hit_tokens"] == 288 and report["read_bytes"] == 18 * (HEADER_BYTES + again.engine.tier.block_bytes)


def test_pool_evicted_prefix_comes_back_from_disk(tiny_model_dir, tmp_path):
    llm = tiny_llm(tiny_model_dir, tmp_path / "kv", num_kv_blocks=24)  # 24 blocks: room for one prompt at a time
    a, others = prompt(1), [prompt(s) for s in (2, 3, 4)]
    first = run(llm, [a])[0]
    settled(llm)
    run(llm, others)  # their blocks push a's out of the pool
    assert llm.engine.tier.report()["pool"]["evicted_blocks"] > 0
    settled(llm)
    back = run(llm, [a])[0]
    assert back.cache_stats.num_disk_cached_tokens > 0 and back.num_cached_tokens == 192
    assert back.output_token_ids == first.output_token_ids


def test_another_tenants_prefix_is_never_a_disk_hit(tiny_model_dir, tmp_path):
    p = prompt(5)
    writer = tiny_llm(tiny_model_dir, tmp_path / "kv")
    run(writer, [p], salt="tenant-a")
    settled(writer)
    restarted = tiny_llm(tiny_model_dir, tmp_path / "kv")
    b, unsalted, a = (run(restarted, [p], salt=s)[0] for s in ("tenant-b", None, "tenant-a"))
    assert b.num_cached_tokens == 0 and unsalted.num_cached_tokens == 0  # computed: no disk read of a's blocks
    assert a.cache_stats.num_disk_cached_tokens == 192
    assert a.output_token_ids == b.output_token_ids


def test_blocks_written_under_other_numerics_are_never_read(tiny_gguf, tmp_path):
    """The tier's binding is the engine's numerics key, the block size and the pool's layout:
    blocks written under one step, dtype, activation width, weight kernel, kernel-numerics version or model file are a
    miss for every other, and a hit for their own kind."""
    if not native.available():
        pytest.skip("no native kernels")
    p, kv = prompt(6), tmp_path / "kv"
    torch_step = tiny_llm(tiny_gguf, kv, native_step=False)
    run(torch_step, [p])
    settled(torch_step)
    native_step = tiny_llm(tiny_gguf, kv, native_step=True)
    config = native_step.engine.config
    assert native_step.engine.tier.binding == kv_binding(config, native_step.engine.model)  # what the tier uses
    assert torch_step.engine.tier.binding != native_step.engine.tier.binding
    bumped = dataclasses.replace(config, numerics=dataclasses.replace(config.numerics,
                                                                      version=config.numerics.version + 1))
    assert kv_binding(bumped, native_step.engine.model) != native_step.engine.tier.binding  # a kernel change
    assert run(native_step, [p])[0].num_cached_tokens == 0
    settled(native_step)
    assert run(tiny_llm(tiny_gguf, kv, native_step=True), [p])[0].cache_stats.num_disk_cached_tokens == 192
    assert run(tiny_llm(tiny_gguf, kv, native_step=False), [p])[0].cache_stats.num_disk_cached_tokens == 192
    int8 = tiny_llm(tiny_gguf, kv, native_step=True, activations="int8")  # the native step's other numerics
    assert int8.engine.tier.binding != native_step.engine.tier.binding and run(int8, [p])[0].num_cached_tokens == 0
    # the same step and dtype on other weight kernels (packed as stored, int4 copies), or another dtype
    for other in (dict(int4_max_tokens=None), dict(int4_max_tokens=256), dict(dtype="bfloat16")):
        llm = tiny_llm(tiny_gguf, kv, native_step=False, **other)
        assert llm.engine.tier.binding != torch_step.engine.tier.binding, other
        assert run(llm, [p])[0].num_cached_tokens == 0, other
    os.utime(tiny_gguf, ns=(time.time_ns(), time.time_ns() + 10**9))  # a replaced model file is another model
    assert run(tiny_llm(tiny_gguf, kv, native_step=False), [p])[0].num_cached_tokens == 0
    assert run(tiny_llm(tiny_gguf, kv, native_step=True), [p])[0].num_cached_tokens == 0


def _block_files(kv: Path) -> list[Path]:
    return sorted(p for p in kv.rglob("*") if p.is_file() and p.parent.parent.parent == kv)


@pytest.mark.parametrize("damage", ["flip a payload byte", "truncate", "another block's file", "remove"])
def test_a_damaged_block_is_dropped_and_recomputed_never_served(damage, tiny_model_dir, tmp_path):
    p, kv = prompt(7), tmp_path / "kv"
    reference = written(tiny_model_dir, kv, p)
    settled_llm = tiny_llm(tiny_model_dir, kv)
    keys, parent = [], root_hash(None)
    for i in range(len(p) // BS):
        parent = hash_block(parent, p[i * BS : (i + 1) * BS])
        keys.append(parent)
    store = settled_llm.engine.tier.store
    victim = store.path(settled_llm.engine.tier.binding, keys[5])  # the sixth block of twelve
    data = victim.read_bytes()
    if damage == "flip a payload byte":
        victim.write_bytes(data[:-100] + bytes([data[-100] ^ 1]) + data[-99:])
    elif damage == "truncate":
        victim.write_bytes(data[: len(data) // 2])  # as a write cut short would leave it
    elif damage == "another block's file":
        victim.write_bytes(store.path(settled_llm.engine.tier.binding, keys[6]).read_bytes())
    else:
        victim.unlink()
    out = run(settled_llm, [p])[0]
    assert out.cache_stats.num_disk_cached_tokens == 5 * BS  # the blocks before it only
    assert out.output_token_ids == reference.output_token_ids
    assert settled_llm.engine.tier.report()["disk"]["corrupt_blocks"] == (0 if damage == "remove" else 1)
    settled(settled_llm)
    assert victim.exists() and keys[5] in settled_llm.engine.tier.index  # written again once recomputed
    again = run(tiny_llm(tiny_model_dir, kv), [p])[0]
    assert again.cache_stats.num_disk_cached_tokens == 192 and again.output_token_ids == reference.output_token_ids


CHILD = """
import json, random, sys, time
from stratum.engine import LLM
from stratum.engine.sampling_params import SamplingParams
llm = LLM(sys.argv[1], num_kv_blocks=48, block_size=16, dtype="float32", device="cpu", num_threads=1,
          kv_disk_gb=1.0, kv_disk_dir=sys.argv[2])
rng = random.Random(int(sys.argv[3]))
while True:
    llm.generate([[rng.randrange(3, 460) for _ in range(400)]], SamplingParams(max_tokens=2, temperature=0.0))
    print(json.dumps(llm.engine.tier.report()["disk"]), flush=True)
"""


def test_kill_9_while_writing_leaves_a_tier_that_loads_and_serves_correct_text(tiny_model_dir, tmp_path):
    kv = tmp_path / "kv"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    for seed in range(3):  # three kills, at whatever each write had reached
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(tiny_model_dir), str(kv), str(seed)],
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        disk, deadline = {}, time.monotonic() + 180
        while time.monotonic() < deadline:  # until its writer is under way: it runs at nice 10, paced while the
            line = child.stdout.readline()  # child decodes, so a machine busy elsewhere delays it
            assert line, "the writer died on its own"
            disk = json.loads(line)
            if disk["written_bytes"]:
                break
        assert disk["written_bytes"], f"the child's tier wrote nothing: {disk}"
        for _ in range(seed):
            assert child.stdout.readline(), "the writer died on its own"
        child.send_signal(signal.SIGKILL)
        child.wait()
    llm = tiny_llm(tiny_model_dir, kv)
    prompts = [[rng.randrange(3, 460) for _ in range(400)] for rng in map(random.Random, range(3))]
    served = run(llm, prompts)
    settled(llm)
    reference = run(tiny_llm(tiny_model_dir, tmp_path / "off", gb=0), prompts)
    assert [s.output_token_ids for s in served] == [s.output_token_ids for s in reference]
    assert sum(s.cache_stats.num_disk_cached_tokens for s in served) > 0
    assert llm.engine.tier.report()["disk"]["corrupt_blocks"] == 0  # a killed write never left a row behind
    assert not list((kv / "tmp").iterdir())  # its temporary files were swept at the start


def test_the_tier_stays_within_its_bound_least_recently_used_first(tiny_model_dir, tmp_path, monkeypatch):
    from stratum.engine import disk_tier

    monkeypatch.setattr(disk_tier, "TOUCH_EVERY_S", 0.0)  # every hit counts as a use (not once a minute)
    kv = tmp_path / "kv"
    probe = tiny_llm(tiny_model_dir, tmp_path / "probe")
    file_bytes = HEADER_BYTES + probe.engine.tier.block_bytes
    limit = 30 * file_bytes  # 30 blocks: a prompt is 12 full blocks (+1 of output)
    llm = tiny_llm(tiny_model_dir, kv, gb=limit / 2**30)
    prompts = [prompt(s) for s in range(10, 16)]
    run(llm, prompts[:1])
    for p in prompts[1:]:
        settled(llm)
        run(llm, [p])
        run(llm, [prompts[0]])  # the first prompt stays in use
    settled(llm)
    conn = llm.engine.tier.store.connect()
    nbytes, nblocks = DiskStore.totals(conn)
    assert nbytes <= limit and nblocks * file_bytes == nbytes
    assert len(_block_files(kv)) == nblocks  # every file indexed, every row a file
    assert llm.engine.tier.report()["disk"]["evicted_blocks"] > 0
    restarted = tiny_llm(tiny_model_dir, kv, gb=limit / 2**30)
    assert run(restarted, [prompts[0]])[0].cache_stats.num_disk_cached_tokens == 192  # recently used: kept
    assert run(restarted, [prompts[1]])[0].cache_stats.num_disk_cached_tokens == 0  # least recently used: evicted


FULL_DISK_CHILD = """
import json, logging, resource, signal, sys
from stratum.engine import LLM
from stratum.engine.sampling_params import SamplingParams
logging.basicConfig(level=logging.WARNING)
llm = LLM(sys.argv[1], num_kv_blocks=48, block_size=16, dtype="float32", device="cpu", num_threads=1,
          kv_disk_gb=1.0, kv_disk_dir=sys.argv[2])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # then a write past the limit fails with EFBIG, as a full disk's does
resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))
outs = [llm.generate([[i + 3] * 100 + list(range(3, 103))], SamplingParams(max_tokens=4, temperature=0.0))[0]
        for i in range(4)]
llm.engine.tier.flush()
print(json.dumps({"tokens": [o.token_ids for o in outs], "enabled": llm.engine.tier.enabled}))
"""


def test_a_full_disk_turns_the_tier_off_with_one_warning_and_fails_no_request(tiny_model_dir, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    child = subprocess.run([sys.executable, "-c", FULL_DISK_CHILD, str(tiny_model_dir), str(tmp_path / "kv")],
                           capture_output=True, text=True, env=env, timeout=300)
    assert child.returncode == 0, child.stderr[-2000:]
    result = json.loads(child.stdout.strip().splitlines()[-1])
    assert result["enabled"] is False
    assert child.stderr.count("is off from now on") == 1, child.stderr[-2000:]
    reference = tiny_llm(tiny_model_dir, tmp_path / "off", gb=0)
    expected = [o.token_ids for o in reference.generate([[i + 3] * 100 + list(range(3, 103)) for i in range(4)],
                                                       SamplingParams(max_tokens=4, temperature=0.0))]
    assert result["tokens"] == expected


def test_no_usable_folder_means_no_tier_and_a_working_engine(tiny_model_dir, tmp_path, caplog):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    llm = tiny_llm(tiny_model_dir, blocked / "kv")
    assert not llm.engine.tier.enabled and "no KV disk tier" in caplog.text
    assert len(run(llm, [prompt(20)])[0].output_token_ids) == 8


def test_files_are_private_to_the_user(tiny_model_dir, tmp_path):
    kv = tmp_path / "kv"
    run(writer := tiny_llm(tiny_model_dir, kv), [prompt(21)])
    settled(writer)
    files = _block_files(kv)
    assert files and all(f.stat().st_mode & 0o777 == 0o600 for f in files + [kv / "index.sqlite3"])
    folders = [kv, kv / "tmp", *{f.parent for f in files}, *{f.parent.parent for f in files}]
    assert all(d.stat().st_mode & 0o777 == 0o700 for d in folders)


def _listening_tier(tmp_path, staging_limit: int | None = None):
    """A tier on a 4-block pool of one layer, its writer kept waiting by the caller holding its lock."""
    bm = BlockManager(4, 2)
    kv = [(torch.arange(8 * 3, dtype=torch.float32).view(8, 1, 3), torch.zeros(8, 1, 3))]
    tier = DiskTier(DiskStore(tmp_path / "kv", 1 << 30))
    tier.attach(bm, kv, b"b" * 32)
    if staging_limit is not None:
        tier.staging_limit = staging_limit
    return tier, bm, kv


@pytest.mark.parametrize("staging", [True, False])
def test_a_block_evicted_before_its_write_is_written_as_it_was_or_not_at_all(staging, tmp_path):
    tier, bm, kv = _listening_tier(tmp_path, None if staging else 0)
    key = b"k" * 32
    with tier._lock:  # the writer cannot take the job yet
        bm.cache.insert([key], [1])
        original = kv[0][0][2:4].clone()
        bm.cache.evict(1)  # the pool lets block 1 go: from the next step on its bytes may change
        kv[0][0][2:4] = -1.0
    assert tier.flush()
    if staging:
        out = [torch.empty(2 * 3 * 4, dtype=torch.uint8).numpy() for _ in range(2)]
        assert tier.store.read(b"b" * 32, key, out) == "ok"
        assert torch.equal(torch.from_numpy(out[0]).view(torch.float32).view(2, 1, 3), original)
        assert key in tier.index
    else:
        assert key not in tier.index and not tier.store.path(b"b" * 32, key).exists()
        assert tier.report()["disk"]["dropped_blocks"] == 1
    tier.close()


def test_requests_waiting_on_a_read_share_it_and_an_abort_mid_read_leaks_no_block(tiny_model_dir, tmp_path):
    p, kv = prompt(30), tmp_path / "kv"
    reference = written(tiny_model_dir, kv, p)
    llm = tiny_llm(tiny_model_dir, kv)
    engine, tier = llm.engine, llm.engine.tier
    a = engine.add_request(p, GREEDY)
    b = engine.add_request(p, GREEDY)
    gone = engine.add_request(p[:100] + prompt(31, 100), GREEDY)  # its first 6 blocks are a's too
    engine.step()
    assert tier.num_loading == 1  # one read for the three of them
    engine.abort(gone.request_id)
    while engine.has_unfinished():
        engine.step()
    assert tier.num_loading == 0
    assert a.output_token_ids == b.output_token_ids == reference.output_token_ids
    assert a.cache_stats.num_disk_cached_tokens == 192 and b.num_cached_tokens == 192
    bm = engine.block_manager
    bm.check_integrity()
    assert bm.num_used_blocks == 0 and bm.num_free_blocks + bm.num_cached_blocks == bm.num_blocks


def test_a_new_pool_over_the_same_memory_never_gets_the_old_pools_pending_writes(tmp_path):
    """Basic mode renews the block manager over the same KV memory: a write queued for the old pool and
    not yet done would read bytes the new pool's requests compute, so it is dropped."""
    tier, bm, kv = _listening_tier(tmp_path)
    key = b"k" * 32
    with tier._lock:  # the writer cannot take the job yet
        bm.cache.insert([key], [1])
        tier.attach(BlockManager(4, 2, enable_prefix_cache=False), kv, b"b" * 32)
        kv[0][0][2:4] = -1.0  # the new pool's first request writes block 1
    assert tier.flush()
    assert key not in tier.index and not tier.store.path(b"b" * 32, key).exists()
    tier.close()


def test_basic_mode_lets_a_read_in_flight_go_and_serves_the_same_text(tiny_model_dir, tmp_path):
    p, kv = prompt(40), tmp_path / "kv"
    reference = written(tiny_model_dir, kv, p)
    engine = tiny_llm(tiny_model_dir, kv).engine
    seq = engine.add_request(p, GREEDY)
    engine.step()  # its read from disk starts
    engine.enter_basic_mode("a test")  # its pool is let go under the read
    while engine.has_unfinished():
        engine.step()
    assert seq.output_token_ids == reference.output_token_ids and seq.cache_stats.num_disk_cached_tokens == 0
    engine.block_manager.check_integrity()
    assert engine.block_manager.num_used_blocks == 0 and engine.tier.num_loading == 0


def test_engines_sharing_a_folder_read_each_others_blocks(tiny_model_dir, tmp_path):
    """The replicas of a machine share one tier: blocks one engine writes become hits for another engine
    started before they were written (its writer reads the index's new rows)."""
    kv, p = tmp_path / "kv", prompt(41)
    a, b = tiny_llm(tiny_model_dir, kv), tiny_llm(tiny_model_dir, kv)
    reference = run(a, [p])[0]
    settled(a)
    deadline = time.monotonic() + 30
    while not b.engine.tier.index:
        assert time.monotonic() < deadline, "the other engine's blocks never joined this one's index"
        time.sleep(0.1)
    served = run(b, [p])[0]
    assert served.cache_stats.num_disk_cached_tokens == 192 and served.output_token_ids == reference.output_token_ids


def test_processes_opening_a_new_tier_together_all_get_its_index(tmp_path):
    """The first connections to a fresh index race to switch it to WAL, which SQLite answers 'database is
    locked' at once, without its busy timeout: each must still open it (engine processes and a tier's
    threads start together)."""
    import threading

    for round_ in range(50):
        store, errors, start = DiskStore(tmp_path / f"kv{round_}", 1 << 30), [], threading.Barrier(4)

        def open_index():
            start.wait()
            try:
                store.connect().close()
            except Exception as e:  # noqa: BLE001 -- what the test counts
                errors.append(e)

        threads = [threading.Thread(target=open_index) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
