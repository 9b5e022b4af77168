"""The disk tier under the radix prefix cache: full blocks the pool caches are written to disk off the
engine step, and a prefix match that misses the pool continues on disk, read back into pool blocks
instead of recomputed -- after a restart too, and across the engine processes of one machine."""

from __future__ import annotations

import logging
import os
import queue
import sqlite3
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from stratum.engine.disk_store import CORRUPT, HEADER_BYTES, OK, DiskStore
from stratum.engine.kv_view import PoolView
from stratum.engine.radix_cache import MatchResult, RadixNode
from stratum.engine.request import Sequence

log = logging.getLogger("stratum.engine")

WRITER_NICE = 10  # the writer thread yields the cores to the engine step (Linux: per-thread priority)
WRITE_BATCH = 32  # blocks indexed per SQLite transaction
TOUCH_EVERY_S = 60.0  # a block's last use is recorded at most this often
MAINTAIN_EVERY_S = 1.0  # the writer looks for other processes' blocks and the bound this often
# While requests decode, the writer uses at most this share of one core (it sleeps in proportion to its
# own CPU time per block): the tier may cost a running decode step at most 5%, and its threads fill the cores.
WRITE_DUTY_WHILE_DECODING = 0.02
DECODING_RECENT_S = 0.25  # the engine stepped decodes this recently: it is decoding


@dataclass(slots=True, eq=False)
class _Write:
    binding: bytes
    key: bytes
    block: int
    epoch: int  # the block's epoch when queued: a write is valid only if no eviction came between
    view: PoolView
    pending: dict  # its generation's pending writes, which it leaves once done
    owned: bytes | None = None  # the block as it was, copied when the pool evicted it before it was written


@dataclass(slots=True, eq=False)
class _Load:
    seq: Sequence
    generation: int
    binding: bytes
    view: PoolView
    keys: list[bytes]  # the prompt's block keys up to the last block read
    start: int  # how many of them the pool already holds (`node`, locked while reading)
    node: RadixNode
    matched: list[int]
    block_ids: list[int]  # pool blocks read into, held by the load
    submitted: float
    num_valid: int = 0
    nbytes: int = 0
    read_s: float = 0.0
    abandoned: bool = False  # its request was aborted: the blocks still go to the tree, held by no one


class DiskTier:
    """The tier under the pool's prefix tree, and the pool tier's figures.

    Writes are write-through from the pool's own memory (no copy on the engine thread): each block has
    an epoch the pool bumps when it evicts the block, and a write whose block was evicted while it was
    read is discarded, unless the eviction copied the block out first (it does within a staging budget).
    Reads go into pool blocks the load holds, while the request waits and other requests run; the step
    never waits on the disk. Blocks are keyed by the pool's own salted chain (`request.hash_block`) and
    bound to the numerics that wrote them (`kv_view.kv_binding`): no tenant or kernel reads another's.

    On the engine thread, the radix cache hands it what enters and leaves the tree (`put`,
    `evicting`: `radix_cache.LowerTier`), and the block manager asks it to continue a match that
    missed the pool (`poll`, `holds_back`, `admitted`, `forget`, `expected_blocks`); nothing else sees
    it but the engine's figures (`report`). A reader and a writer thread do the I/O. With no store
    (the tier off) it only counts the pool's figures.
    """

    def __init__(self, store: DiskStore | None):
        self.store = store
        self.enabled = store is not None
        self.bm = None
        self.view: PoolView | None = None
        self.binding = b""
        self.generation = 0
        self.index: set[bytes] = set()  # keys on disk under this binding
        self._last_id = 0
        self._pending: dict[bytes, _Write] = {}
        self._loads: dict[str, list[_Load]] = {}
        self._loading: set[bytes] = set()
        self._held: dict[str, list[tuple[RadixNode, set[int], float]]] = {}
        self._lock = threading.Condition()
        self._writes: deque[_Write] = deque()
        self._reads: queue.SimpleQueue = queue.SimpleQueue()
        self._done: deque[_Load] = deque()
        self._touches: list[tuple[bytes, bytes]] = []
        self._drops: list[tuple[bytes, bytes]] = []
        self._touched: dict[bytes, float] = {}
        self._staged = 0
        self._busy = False  # the writer holds a batch it took from the queue
        self._reading: _Load | None = None  # the load the reader is reading now
        self._decoded_at = float("-inf")  # when the engine last stepped a decode (the writer paces itself then)
        self._clocks: dict[str, int] = {}  # the I/O threads' CPU clocks: their CPU time, read from any thread
        self._version = self._reported = 0  # batches written; of them, those a report has seen
        self._closed = False
        self.max_pending = self.staging_limit = 0
        self.pool = dict(hit_tokens=0, read_bytes=0, written_bytes=0, evicted_blocks=0)
        self.disk = dict(hit_tokens=0, read_bytes=0, written_bytes=0, evicted_blocks=0, dropped_blocks=0,
                         corrupt_blocks=0, size_bytes=0, blocks=0, write_cpu_s=0.0, read_cpu_s=0.0)
        if self.enabled:
            for target, name in ((self._read_loop, "stratum-kv-read"), (self._write_loop, "stratum-kv-write")):
                threading.Thread(target=target, name=name, daemon=True).start()

    # ---- wiring --------------------------------------------------------------------------------------
    def attach(self, bm, kv_caches, binding: bytes) -> None:
        """Serve the pool `bm` manages (at start, after a kernel switch, in basic mode): what was in
        flight for the previous pool is let go (its reads land in memory nobody uses; its writes finish
        under their own binding)."""
        old = self.view
        with self._lock:
            self.generation += 1
            self._pending, self._loads, self._loading, self._held = {}, {}, set(), {}
            if old is not None:  # the new pool may reuse the old one's memory (basic mode keeps it)
                for b in range(len(old.epochs)):
                    old.epochs[b] += 1  # a write still pending, and not copied, is of bytes that will change
                while self._reading is not None and self._reading.view is old:
                    self._lock.wait(0.01)  # a read into the old pool stops at its next block
        self.bm = bm
        self.view = PoolView(kv_caches, bm.num_blocks)
        self.max_pending = bm.num_blocks
        self.staging_limit = min(256 << 20, max(32 << 20, self.view.block_bytes * bm.num_blocks // 4))
        bm.cache.lower = self
        bm.tier = self if bm.enable_prefix_cache else None
        if self.enabled and binding != self.binding:
            try:  # the index of this binding, read whole: a key set, no block's data
                conn = self.store.connect()
                keys, self._last_id = self.store.keys(conn, binding)
                self.disk["size_bytes"], self.disk["blocks"] = self.store.totals(conn)
                conn.close()
                self.index = set(keys)
            except (OSError, sqlite3.Error) as e:
                self._disable(f"its index cannot be read: {e}")
        self.binding = binding

    @property
    def block_bytes(self) -> int:
        return self.view.block_bytes if self.view is not None else 0

    # ---- the tier under the pool's tree (`radix_cache.LowerTier`; engine thread) --------------------------
    def put(self, keys: list[bytes], blocks: list[int], first: bool = False) -> None:
        """Blocks entered the prefix tree: write each that is not on disk yet. first: a pinned prefix
        (warm-up, cache_control), written before any other."""
        if not first:
            self.pool["written_bytes"] += len(blocks) * self.block_bytes
        self._queue(keys, blocks, first)

    def evicting(self, keys: list[bytes], blocks: list[int]) -> None:
        """The pool evicts these blocks (they may be overwritten from the next step on): a write still
        pending keeps a copy, as long as the staging budget allows."""
        self.pool["evicted_blocks"] += len(blocks)
        view = self.view
        for b in blocks:
            view.epochs[b] += 1
        if not self.enabled:
            return
        with self._lock:
            for key, b in zip(keys, blocks):
                job = self._pending.get(key)
                if job is None or job.owned is not None or job.view is not view or job.block != b:
                    continue
                if self._staged + view.block_bytes <= self.staging_limit:
                    job.owned = view.copy(b)
                    self._staged += view.block_bytes

    def _queue(self, keys: list[bytes], blocks: list[int], first: bool = False) -> None:
        if not self.enabled:
            return
        with self._lock:
            for key, b in zip(keys, blocks):
                if key in self.index or key in self._pending:
                    continue
                if len(self._pending) >= self.max_pending:  # the disk is that far behind: this one is not kept
                    self.disk["dropped_blocks"] += 1
                    continue
                job = _Write(self.binding, key, b, self.view.epochs[b], self.view, self._pending)
                self._pending[key] = job
                self._writes.appendleft(job) if first else self._writes.append(job)
            self._lock.notify_all()

    # ---- the block manager's side (engine thread) ----------------------------------------------------------
    def poll(self) -> None:
        """Loads that finished reading enter the prefix tree, held for their requests until admitted."""
        while self._done:
            self._complete(self._done.popleft())

    def decoding(self) -> None:
        """The engine stepped decodes: while it does, the writer paces itself (`WRITE_DUTY_WHILE_DECODING`)."""
        self._decoded_at = time.monotonic()

    def holds_back(self, seq: Sequence, match: MatchResult | None, reserve: int) -> bool:
        """Whether seq waits on the disk tier now: a read of its next blocks is in flight (its own or
        another request's), or has just started, into pool blocks taken for it (keeping `reserve` free)."""
        if seq.request_id in self._loads:
            return True
        if not self.enabled or match is None:
            return False
        keys, start = self._prompt_keys(seq), match.num_blocks
        if start >= len(keys):
            return False
        if keys[start] in self._loading:
            return True
        n = 0
        while start + n < len(keys) and keys[start + n] in self.index:
            n += 1
        return n > 0 and self._start_load(seq, match, keys[: start + n], start, reserve)

    def _start_load(self, seq: Sequence, match: MatchResult, keys: list[bytes], start: int, reserve: int) -> bool:
        bm = self.bm
        bm.cache.lock(match.node)  # the pool's part of the prefix stays while the rest is read
        room = bm.num_free_blocks + bm.cache.num_evictable_blocks() - reserve
        ids = bm.take_blocks(min(len(keys) - start, room)) if room > 0 else None
        if not ids:
            bm.cache.unlock(match.node)
            return False
        keys = keys[: start + len(ids)]
        load = _Load(seq, self.generation, self.binding, self.view, keys, start, match.node, list(match.block_ids), ids,
                     time.perf_counter())
        self._loads.setdefault(seq.request_id, []).append(load)
        self._loading.update(keys[start:])
        self._reads.put(load)
        return True

    def _complete(self, load: _Load) -> None:
        if load.generation != self.generation:
            return  # read into a pool that is gone
        rid = load.seq.request_id
        loads = self._loads.get(rid, [])
        if load in loads:
            loads.remove(load)
        if not loads:
            self._loads.pop(rid, None)
        self._loading.difference_update(load.keys[load.start:])
        cache, v = self.bm.cache, load.num_valid
        if v:
            bs, ids = self.bm.block_size, load.seq.token_ids
            keys = load.keys[: load.start + v]
            cache.insert(keys, load.matched + load.block_ids[:v], tokens=lambda i: ids[i * bs : (i + 1) * bs])
            if not load.abandoned:
                node = cache.match_prefix(keys).node
                cache.lock(node)
                self._held.setdefault(rid, []).append((node, set(load.block_ids[:v]), load.read_s))
        cache.unlock(load.node)
        self.bm.release_blocks(load.block_ids)  # those the tree took stay cached; the rest are free again

    def admitted(self, seq: Sequence, match: MatchResult | None, first: bool) -> None:
        """seq was given its blocks (the match's locked through its own table now): its loaded blocks
        are let go, and at its first admission its hit is split by tier."""
        loaded: set[int] = set()
        read_s = 0.0
        for node, blocks, secs in self._held.pop(seq.request_id, ()):
            self.bm.cache.unlock(node)
            loaded |= blocks
            read_s += secs
        if not first or match is None or not match.num_blocks:
            return
        bs = self.bm.block_size
        disk = bs * sum(1 for b in match.block_ids if b in loaded)
        seq.cache_stats.num_disk_cached_tokens, seq.cache_stats.disk_read_s = disk, read_s
        pool = seq.num_cached_tokens - disk
        self.pool["hit_tokens"] += pool
        self.pool["read_bytes"] += pool * self.block_bytes // bs
        self.disk["hit_tokens"] += disk
        if self.enabled:  # a prefix served again is kept warm on disk (and written, if it is not there yet)
            keys = self._prompt_keys(seq)[: match.num_blocks]
            now = time.monotonic()
            with self._lock:
                for key in keys:
                    if key in self.index and now - self._touched.get(key, -TOUCH_EVERY_S) >= TOUCH_EVERY_S:
                        self._touched[key] = now
                        self._touches.append((self.binding, key))
            self._queue(keys, match.block_ids)

    def forget(self, seq: Sequence) -> None:
        """seq was aborted: nothing stays held for it (its reads still fill the tree when they land)."""
        for node, _, _ in self._held.pop(seq.request_id, ()):
            self.bm.cache.unlock(node)
        for load in self._loads.get(seq.request_id, ()):
            load.abandoned = True

    def expected_blocks(self, seq: Sequence, match: MatchResult | None) -> int:
        """Blocks after the pool's match that the disk holds: what a read would add to the hit."""
        if not self.enabled or match is None:
            return 0
        keys, n = self._prompt_keys(seq), match.num_blocks
        while n < len(keys) and (keys[n] in self.index or keys[n] in self._loading):
            n += 1
        return n - match.num_blocks

    @property
    def is_settled(self) -> bool:
        """No write is queued or under way, and `report` has seen every one done."""
        return not (self._writes or self._busy) and self._reported == self._version

    @property
    def num_loading(self) -> int:
        return sum(len(v) for v in self._loads.values())

    def wait(self, timeout: float) -> None:
        """Nothing can run until a read lands: wait for one (at most timeout seconds)."""
        with self._lock:
            if not self._done:
                self._lock.wait(timeout)

    def _prompt_keys(self, seq: Sequence) -> list[bytes]:
        """Keys of the prompt blocks a hit may cover (one token is always left to compute)."""
        return seq.full_block_hashes()[: (seq.num_tokens - 1) // self.bm.block_size]

    # ---- figures ----------------------------------------------------------------------------------
    def report(self) -> dict[str, dict[str, float]]:
        """Per tier: hit tokens, bytes read and written, evicted blocks, size (bytes and blocks)."""
        self._reported = self._version
        blocks = len(self.bm.cache.block_node) if self.bm is not None else 0
        for name, clock in self._clocks.items():
            try:
                self.disk[name] = time.clock_gettime(clock)
            except OSError:  # the thread ended: its last reading stays
                pass
        pool = {**self.pool, "size_bytes": blocks * self.block_bytes, "blocks": blocks}
        disk = {**self.disk, "enabled": int(self.enabled), "pending_blocks": len(self._pending),
                "limit_bytes": self.store.limit_bytes if self.store is not None else 0}
        return {"pool": pool, "disk": disk}

    # ---- the I/O threads ------------------------------------------------------------------------------
    def _read_loop(self) -> None:
        self._clocks["read_cpu_s"] = time.pthread_getcpuclockid(threading.get_ident())
        while True:
            load = self._reads.get()
            if load is None:
                return
            with self._lock:
                current = load.generation == self.generation and self.enabled
                self._reading = load if current else None
            if current:
                try:
                    self._read(load)
                except Exception:  # a bug here must cost the read, never the request
                    log.exception("KV disk tier: reading a prefix failed; it is computed instead")
            load.read_s = time.perf_counter() - load.submitted
            with self._lock:
                self._reading = None
                self._done.append(load)
                self._lock.notify_all()

    def _read(self, load: _Load) -> None:
        view, current = load.view, load.binding == self.binding
        for i, key in enumerate(load.keys[load.start:]):
            if load.generation != self.generation:
                break  # its pool was let go (`attach`), and its memory may be another's now
            block = load.block_ids[i]
            buffers = view.target(block)
            try:
                result = self.store.read(load.binding, key, buffers)
            except OSError as e:
                log.warning("KV disk tier: block %s unreadable (%s): computed instead", key.hex()[:16], e)
                result = CORRUPT
            if result != OK:
                if current:
                    self.index.discard(key)
                if result == CORRUPT:
                    self.disk["corrupt_blocks"] += 1
                    log.warning("KV disk tier: block %s failed its check (truncated, corrupt or partly written): "
                                "dropped and computed instead", key.hex()[:16])
                with self._lock:
                    self._drops.append((load.binding, key))
                break
            view.commit(block, buffers)
            load.num_valid += 1
            load.nbytes += HEADER_BYTES + view.block_bytes
        self.disk["read_bytes"] += load.nbytes
        with self._lock:
            self._touches += [(load.binding, k) for k in load.keys[load.start : load.start + load.num_valid]]

    def _write_loop(self) -> None:
        self._clocks["write_cpu_s"] = time.pthread_getcpuclockid(threading.get_ident())
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
        except (AttributeError, OSError):
            pass
        try:
            conn = self.store.connect()
            self.store.sweep_tmp()
            version, last = None, 0.0
            while not self._closed or self._writes:
                with self._lock:
                    if not (self._writes or self._touches or self._drops or self._closed):
                        self._lock.wait(MAINTAIN_EVERY_S)
                    batch = [self._writes.popleft() for _ in range(min(WRITE_BATCH, len(self._writes)))]
                    self._busy = bool(batch)
                    touches, self._touches = self._touches, []
                    drops, self._drops = self._drops, []
                for binding, keys in _by_binding(drops).items():  # before the writes: one may be a block's rewrite
                    self.store.drop(conn, binding, keys)
                if batch:
                    self._write_batch(conn, batch)
                for binding, keys in _by_binding(touches).items():
                    self.store.touch(conn, binding, keys)
                if time.monotonic() - last >= MAINTAIN_EVERY_S or batch:
                    version = self._maintain(conn, version)
                    last = time.monotonic()
                if batch:
                    with self._lock:  # written, indexed and within the bound: what `flush` waits for
                        self._busy = False
                        self._version += 1
                        self._lock.notify_all()
        except (OSError, sqlite3.Error) as e:
            self._disable(str(e))

    def _write_batch(self, conn: sqlite3.Connection, batch: list[_Write]) -> None:
        written: list[tuple[_Write, int]] = []
        try:
            for job in batch:
                cpu = time.thread_time()
                n = self._write_one(job)
                if n:
                    written.append((job, n))
                self._pace(time.thread_time() - cpu)
        finally:
            for binding, rows in _by_binding([(j.binding, (j.key, n)) for j, n in written]).items():
                self.store.add(conn, binding, rows)
            with self._lock:
                for job, n in written:
                    if job.binding == self.binding:
                        self.index.add(job.key)
                    self.disk["written_bytes"] += n
                for job in batch:
                    if job.pending.get(job.key) is job:
                        del job.pending[job.key]
                    if job.owned is not None:
                        self._staged -= job.view.block_bytes
                        job.owned = None

    def _write_one(self, job: _Write) -> int:
        """Write one block; 0 when it was evicted before it could be read whole (and no copy was kept)."""
        view = job.view
        while True:
            with self._lock:
                owned = job.owned
                if owned is None and view.epochs[job.block] != job.epoch:
                    self.disk["dropped_blocks"] += 1
                    return 0
            n = self.store.write(job.binding, job.key, [owned] if owned is not None else view.chunks(job.block))
            if owned is not None or view.epochs[job.block] == job.epoch:
                return n  # no eviction came between the queueing and the end of the read: the bytes are the block's
            with self._lock:
                if job.owned is None:  # overwritten while read, no copy: the file may be torn
                    _unlink(self.store.path(job.binding, job.key))
                    self.disk["dropped_blocks"] += 1
                    return 0

    def _pace(self, cpu_s: float) -> None:
        """While requests decode, sleep so that writing takes at most WRITE_DUTY_WHILE_DECODING of a core;
        otherwise (an idle engine, a prefill alone, closing) write at full speed."""
        if self._closed or time.monotonic() - self._decoded_at > DECODING_RECENT_S:
            return
        time.sleep(min(1.0, cpu_s * (1 / WRITE_DUTY_WHILE_DECODING - 1)))

    def _maintain(self, conn: sqlite3.Connection, version: int | None) -> int:
        """Other processes' new blocks join the index; the bound is kept; the size is read."""
        now_version = self.store.data_version(conn)
        if now_version != version:
            binding = self.binding
            keys, last = self.store.keys(conn, binding, self._last_id)
            if binding == self.binding:
                self.index.update(keys)
                self._last_id = last
        for evicted in self.store.evict(conn):
            self.disk["evicted_blocks"] += len(evicted.keys)
            if evicted.binding == self.binding:
                self.index.difference_update(evicted.keys)
        self.disk["size_bytes"], self.disk["blocks"] = self.store.totals(conn)
        return self.store.data_version(conn)

    def _disable(self, reason: str) -> None:
        """The disk cannot take the tier (full, read-only, gone): from now on there is none."""
        if not self.enabled:
            return
        self.enabled = False
        log.warning("KV disk tier under %s is off from now on (%s): prompts it would have served are computed",
                    self.store.root, reason)
        with self._lock:
            self._writes.clear()
            self._lock.notify_all()

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued write is on disk, indexed and within the bound (at most timeout_s).
        Returns whether it is."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self.enabled and (self._writes or self._busy) and time.monotonic() < deadline:
                self._lock.wait(0.05)
            return not (self._writes or self._busy)

    def close(self, timeout_s: float = 2.0) -> None:
        """Finish the queued writes (for at most timeout_s), then stop the threads."""
        if self._closed or not self.enabled:
            return
        self._decoded_at = float("-inf")  # nothing decodes any more: what is queued is written at full speed
        self.flush(timeout_s)
        with self._lock:
            self._closed = True
            self._writes.clear()
            self._lock.notify_all()
        self._reads.put(None)


def _by_binding(items: list[tuple[bytes, object]]) -> dict[bytes, list]:
    out: dict[bytes, list] = {}
    for binding, value in items:
        out.setdefault(binding, []).append(value)
    return out


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
