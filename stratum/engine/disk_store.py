"""The disk tier's storage: one checksummed file per KV block, indexed in SQLite, in a 0700 folder that
every engine process of the machine shares (restarts, `--replicas`); used from the tier's threads only."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import sqlite3
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import xxhash

from stratum.home import stratum_home

log = logging.getLogger("stratum.engine")

FORMAT = 1
_MAGIC = b"STRKVBLK"
# magic, format, binding, key, payload bytes, xxh3-64 of the payload; then xxh3-64 of those bytes
_HEADER = struct.Struct("<8sI32s32sQQ")
_CHECK = struct.Struct("<Q")
HEADER_BYTES = _HEADER.size + _CHECK.size
_IOV_MAX = 1024  # buffers per preadv/pwritev call (Linux's IOV_MAX)
_TMP_MAX_AGE_S = 600.0  # a temporary file this old belongs to no live writer

_SCHEMA = """
CREATE TABLE IF NOT EXISTS blocks (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    binding BLOB NOT NULL, key BLOB NOT NULL, nbytes INTEGER NOT NULL, last_used REAL NOT NULL,
    UNIQUE (binding, key));
CREATE INDEX IF NOT EXISTS blocks_lru ON blocks (last_used);
CREATE TABLE IF NOT EXISTS totals (
    id INTEGER PRIMARY KEY CHECK (id = 0), nbytes INTEGER NOT NULL, nblocks INTEGER NOT NULL);
INSERT OR IGNORE INTO totals VALUES (0, 0, 0);
CREATE TRIGGER IF NOT EXISTS blocks_added AFTER INSERT ON blocks
    BEGIN UPDATE totals SET nbytes = nbytes + NEW.nbytes, nblocks = nblocks + 1; END;
CREATE TRIGGER IF NOT EXISTS blocks_removed AFTER DELETE ON blocks
    BEGIN UPDATE totals SET nbytes = nbytes - OLD.nbytes, nblocks = nblocks - 1; END;
"""

OK, MISSING, CORRUPT = "ok", "missing", "corrupt"
DEFAULT_MAX_BYTES = 16 << 30  # the default bound: a tenth of the free disk, at most this
MIN_BYTES = 256 << 20  # below this the default leaves the tier off (a nearly full disk)


@dataclass
class Evicted:
    binding: bytes
    keys: list[bytes]
    nbytes: int = 0


class DiskStore:
    """Files and index under `root`, bounded to `limit_bytes` (shared by every process using `root`).

        <root>/index.sqlite3                  blocks(binding, key, nbytes, last_used) + running totals
        <root>/tmp/                           files being written (renamed into place when complete)
        <root>/<binding hex 32>/<kk>/<key hex>   header (binding, key, sizes, xxh3-64 checksums) + payload

    A block's row is added only after its file is complete and renamed into place, so a process killed
    mid-write leaves at most a temporary file (swept at the next start) and never a row whose file is
    partial; whatever a read finds that does not match its header and checksum is dropped, never served.

    A connection belongs to one thread (`connect`); file reads and writes need none.
    """

    def __init__(self, root: Path, limit_bytes: int):
        self.root = Path(root)
        self.limit_bytes = limit_bytes
        self.tmp = self.root / "tmp"
        for d in (self.root, self.tmp):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(d, 0o700)  # KV is the prompts' content: nobody else reads it
        self.db_path = self.root / "index.sqlite3"
        self._tmp_names = iter(range(1 << 62))

    # ---- the index ------------------------------------------------------------------------------
    def connect(self) -> sqlite3.Connection:
        """A connection for this thread: WAL, so readers never wait on the writers of other processes."""
        conn = sqlite3.connect(self.db_path, timeout=10.0, isolation_level=None, check_same_thread=True)
        os.chmod(self.db_path, 0o600)
        _set_wal(conn)
        # a killed process loses nothing committed; what a power cut might lose, the checksums catch
        conn.execute("PRAGMA synchronous=NORMAL")
        with _transaction(conn):
            for statement in _statements(_SCHEMA):
                conn.execute(statement)
        return conn

    @staticmethod
    def keys(conn: sqlite3.Connection, binding: bytes, after_id: int = 0) -> tuple[list[bytes], int]:
        """Keys stored for `binding` with ids above after_id, and the highest id seen: the index read at
        start (after_id 0), then what other processes added since."""
        if after_id:  # `+binding`: the rowid range (new rows only) is searched, not the binding's whole index
            rows = conn.execute("SELECT id, key FROM blocks WHERE id > ? AND +binding = ?",
                                (after_id, binding)).fetchall()
        else:
            rows = conn.execute("SELECT id, key FROM blocks WHERE binding = ?", (binding,)).fetchall()
        return [k for _, k in rows], max((i for i, _ in rows), default=after_id)

    @staticmethod
    def data_version(conn: sqlite3.Connection) -> int:
        """Changes whenever another connection commits (SQLite's PRAGMA data_version)."""
        return conn.execute("PRAGMA data_version").fetchone()[0]

    @staticmethod
    def totals(conn: sqlite3.Connection) -> tuple[int, int]:
        """(bytes, blocks) in the tier, every binding and process together."""
        return tuple(conn.execute("SELECT nbytes, nblocks FROM totals").fetchone())

    @staticmethod
    def add(conn: sqlite3.Connection, binding: bytes, rows: list[tuple[bytes, int]]) -> None:
        """Index written blocks (key, file bytes); a key another process indexed first is only touched."""
        now = time.time()
        with _transaction(conn):
            conn.executemany("INSERT INTO blocks (binding, key, nbytes, last_used) VALUES (?, ?, ?, ?) "
                             "ON CONFLICT (binding, key) DO UPDATE SET last_used = excluded.last_used",
                             [(binding, k, n, now) for k, n in rows])

    @staticmethod
    def touch(conn: sqlite3.Connection, binding: bytes, keys: list[bytes]) -> None:
        """Mark blocks recently used (eviction is least recently used first)."""
        now = time.time()
        with _transaction(conn):
            conn.executemany("UPDATE blocks SET last_used = ? WHERE binding = ? AND key = ?",
                             [(now, binding, k) for k in keys])

    def drop(self, conn: sqlite3.Connection, binding: bytes, keys: list[bytes]) -> None:
        """Forget blocks (a corrupt or missing file) and delete their files."""
        with _transaction(conn):
            conn.executemany("DELETE FROM blocks WHERE binding = ? AND key = ?", [(binding, k) for k in keys])
        for k in keys:
            _unlink(self.path(binding, k))

    def evict(self, conn: sqlite3.Connection) -> list[Evicted]:
        """Delete least-recently-used blocks (of any binding) until the tier is 90% of its bound.

        Returns what was deleted, per binding."""
        nbytes, _ = self.totals(conn)
        if nbytes <= self.limit_bytes:
            return []
        excess = nbytes - int(self.limit_bytes * 0.9)
        victims: list[tuple[int, bytes, bytes, int]] = []
        with _transaction(conn):
            # among blocks used together, the later (deeper in their prefix) first: what is left stays a prefix
            rows = conn.execute("SELECT id, binding, key, nbytes FROM blocks ORDER BY last_used, id DESC")
            while excess > 0:
                row = rows.fetchone()
                if row is None:
                    break
                victims.append(row)
                excess -= row[3]
            rows.close()
            conn.executemany("DELETE FROM blocks WHERE id = ?", [(v[0],) for v in victims])
        by_binding: dict[bytes, Evicted] = {}
        for _, binding, key, n in victims:
            _unlink(self.path(binding, key))
            e = by_binding.setdefault(binding, Evicted(binding, []))
            e.keys.append(key)
            e.nbytes += n
        return list(by_binding.values())

    # ---- the files -------------------------------------------------------------------------------
    def path(self, binding: bytes, key: bytes) -> Path:
        h = key.hex()
        return self.root / binding.hex()[:32] / h[:2] / h

    def write(self, binding: bytes, key: bytes, buffers: list) -> int:
        """Write one block's file: a temporary file, renamed into place once complete.

        Args:
            buffers: the payload's pieces (each pool tensor's slice of the block, in pool order).

        Returns:
            The file's bytes. Raises OSError (the disk's), leaving nothing behind.
        """
        digest = xxhash.xxh3_64()
        size = 0
        for b in buffers:
            digest.update(b)
            size += memoryview(b).nbytes
        head = _HEADER.pack(_MAGIC, FORMAT, binding, key, size, digest.intdigest())
        head += _CHECK.pack(xxhash.xxh3_64_intdigest(head))
        final = self.path(binding, key)
        tmp = self.tmp / f"{os.getpid()}-{threading.get_native_id()}-{next(self._tmp_names)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                _pwrite_all(fd, [head, *buffers])
            finally:
                os.close(fd)
            if not final.parent.is_dir():  # each level 0700 (mkdir's parents would take the umask's mode)
                final.parent.parent.mkdir(mode=0o700, exist_ok=True)
                final.parent.mkdir(mode=0o700, exist_ok=True)
            os.replace(tmp, final)
        except BaseException:
            _unlink(tmp)
            raise
        return HEADER_BYTES + size

    def read(self, binding: bytes, key: bytes, buffers: list) -> str:
        """Read one block's payload into `buffers` (writable, the sizes it was written with) and check it.

        Returns:
            OK; MISSING (no file); CORRUPT (truncated, a header that is not this block's, or a payload
            whose checksum differs: the buffers then hold garbage and must not be used).
        """
        try:
            fd = os.open(self.path(binding, key), os.O_RDONLY)
        except FileNotFoundError:
            return MISSING
        try:
            views = [memoryview(b).cast("B") for b in buffers]
            size = sum(v.nbytes for v in views)
            if os.fstat(fd).st_size != HEADER_BYTES + size:
                return CORRUPT
            head = os.pread(fd, HEADER_BYTES, 0)
            magic, fmt, b, k, n, digest = _HEADER.unpack_from(head)
            (check,) = _CHECK.unpack_from(head, _HEADER.size)
            if (check != xxhash.xxh3_64_intdigest(head[: _HEADER.size]) or magic != _MAGIC or fmt != FORMAT
                    or b != binding or k != key or n != size):
                return CORRUPT
            if _pread_all(fd, views, HEADER_BYTES) != size:
                return CORRUPT
            h = xxhash.xxh3_64()
            for v in views:
                h.update(v)
            return OK if h.intdigest() == digest else CORRUPT
        finally:
            os.close(fd)

    def sweep_tmp(self) -> int:
        """Delete temporary files no live writer can own (left by a killed process). Returns how many."""
        now, n = time.time(), 0
        for entry in os.scandir(self.tmp):
            try:
                if now - entry.stat().st_mtime > _TMP_MAX_AGE_S or not _pid_alive(entry.name):
                    os.unlink(entry.path)
                    n += 1
            except OSError:
                pass
        return n


def open_store(gb: float | None, directory: str | None) -> DiskStore | None:
    """The tier's store as configured: `gb` GiB (None: a tenth of the free disk, at most 16 GiB; 0: off)
    under `directory` (None: $STRATUM_HOME/kv). None, with a warning, where it cannot be had."""
    if gb is None and os.environ.get("STRATUM_KV_DISK_GB", "").strip():
        gb = float(os.environ["STRATUM_KV_DISK_GB"])
    if gb is not None and gb <= 0:
        return None
    root = Path(directory) if directory else stratum_home() / "kv"
    try:
        store = _checked_store(root)
        if gb is not None:
            store.limit_bytes = int(gb * 2**30)
        else:
            conn = store.connect()
            used, _ = store.totals(conn)
            conn.close()
            store.limit_bytes = min(DEFAULT_MAX_BYTES, (shutil.disk_usage(root).free + used) // 10)
            if store.limit_bytes < MIN_BYTES:
                log.warning("no KV disk tier: %s has too little free disk (set --kv-disk-gb to force one)", root)
                return None
        return store
    except (OSError, sqlite3.Error) as e:
        log.warning("no KV disk tier under %s: %s", root, e)
        return None


def _checked_store(root: Path) -> DiskStore:
    """A store whose index opens; an unreadable index (and with it the blocks it described) is started over."""
    store = DiskStore(root, 0)
    try:
        store.connect().close()
    except sqlite3.DatabaseError as e:
        log.warning("the KV disk tier's index under %s is unreadable (%s): starting it over", root, e)
        for entry in os.scandir(root):
            if entry.is_dir() and entry.name != "tmp":
                shutil.rmtree(entry.path, ignore_errors=True)
            elif entry.name.startswith("index.sqlite3"):
                os.unlink(entry.path)
        store = DiskStore(root, 0)
        store.connect().close()
    return store


def _set_wal(conn: sqlite3.Connection, timeout_s: float = 10.0) -> None:
    """Put the index in WAL mode. Switching a new database's journal needs its exclusive lock, and SQLite
    answers a connection that races another for it "database is locked" at once, without the busy
    timeout (two engine processes or threads opening a fresh tier together): retry until timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            conn.execute("PRAGMA journal_mode=WAL").fetchall()
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.005)


class _transaction:
    """BEGIN IMMEDIATE ... COMMIT (ROLLBACK on error): one writer at a time across processes."""

    def __init__(self, conn: sqlite3.Connection):
        self.conn = conn

    def __enter__(self):
        self.conn.execute("BEGIN IMMEDIATE")

    def __exit__(self, kind, value, tb):
        self.conn.execute("COMMIT" if kind is None else "ROLLBACK")


def _statements(script: str) -> list[str]:
    """The schema's statements (a trigger's body holds a ';' of its own)."""
    out, current = [], ""
    for part in script.split(";"):
        current += part + ";"
        if current.count("BEGIN") == current.count("END;") and current.strip(" \n;"):
            out.append(current.strip())
            current = ""
    return out


def _pid_alive(name: str) -> bool:
    pid = int(name.split("-", 1)[0]) if name.split("-", 1)[0].isdigit() else 0
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _pwrite_all(fd: int, buffers: list) -> None:
    views = [memoryview(b).cast("B") for b in buffers]
    offset = 0
    while views:
        n = os.pwritev(fd, views[:_IOV_MAX], offset)
        if n <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        offset += n
        _advance(views, n)


def _advance(views: list[memoryview], n: int) -> None:
    """Drop the first n bytes of views (what one vectored call moved), in place."""
    while views and n >= views[0].nbytes:
        n -= views[0].nbytes
        views.pop(0)
    if n:
        views[0] = views[0][n:]


def _pread_all(fd: int, views: list[memoryview], offset: int) -> int:
    total, views = 0, list(views)
    while views:
        n = os.preadv(fd, views[:_IOV_MAX], offset + total)
        if n <= 0:
            break
        total += n
        _advance(views, n)
    return total
