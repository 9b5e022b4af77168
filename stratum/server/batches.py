"""Anthropic's Message Batches, durable in SQLite, run by the server at a priority below interactive work.

`BatchStore` keeps batches and their requests in one SQLite file (WAL mode). A batch is committed
before its creation is answered, and each request's result is written once, by the transaction that
moves it out of `pending`: a process killed at any moment loses no accepted batch and no finished
result, and on restart the requests still pending run again.

`BatchRunner` runs pending requests through the server's own `/v1/messages` route (in process, over
ASGI), so authentication, the tenant's budget and cache isolation, usage and the cost fields are the
interactive ones. Its requests carry the batch priority: the scheduler admits every waiting
interactive request before them. While interactive requests are in flight only `busy_concurrency`
batch requests run at once (their decodes share the step); on an idle server up to `idle_concurrency`.
`batch_routes` is the API over them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import sqlite3
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response

from stratum.server.auth import tenant_of
from stratum.server.body import read_request
from stratum.server.errors import APIError, InvalidRequest, NotFound, error_object
from stratum.server.protocol import BatchCreateRequest

if TYPE_CHECKING:
    from stratum.server.runtime import Runtime
    from stratum.server.settings import ServerSettings

log = logging.getLogger("stratum.batches")

BATCHES_PATH = "/v1/messages/batches"
INTERNAL_HEADER = "x-stratum-internal"  # the runner's calls: the per-process secret
TENANT_HEADER = "x-stratum-batch-tenant"  # the tenant the batch belongs to, honoured with the secret only
FINAL = ("succeeded", "errored", "canceled", "expired")
NOT_NOW = {429, 503, 529}  # the server cannot take it now (budget, drain, engine, queue): waits while its batch lasts
MAX_FAILURES = 5  # a request that failed (a 5xx, an error in the runner) this often is an errored result
BACKOFF_S, MAX_BACKOFF_S = 0.5, 30.0  # the wait before the next try: doubling from BACKOFF_S, at most MAX_BACKOFF_S

_SCHEMA = """
create table if not exists batches (
    id text primary key, tenant text not null, created_at real not null, expires_at real not null,
    cancel_initiated_at real, ended_at real, deleted integer not null default 0);
create table if not exists requests (
    batch_id text not null, seq integer not null, custom_id text not null, params text not null,
    state text not null default 'pending', result text,
    primary key (batch_id, custom_id));
create index if not exists pending on requests (state, batch_id, seq);
"""


def _rfc3339(t: float | None) -> str | None:
    if t is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e6):06d}Z"


@dataclass
class Page:
    data: list[dict[str, Any]]
    has_more: bool


class BatchStore:
    """Batches and their requests in SQLite. One connection, used under a lock from any thread."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self.db.execute("pragma journal_mode=wal")
        self.db.execute("pragma synchronous=full")  # a committed result survives power loss, not only kill -9
        self.db.executescript(_SCHEMA)
        self.lock = threading.Lock()

    def create(self, tenant: str, requests: list[tuple[str, dict[str, Any]]], ttl_s: float) -> str:
        batch_id = "msgbatch_" + uuid.uuid4().hex[:24]
        now = time.time()
        with self.lock:
            self.db.execute("begin immediate")
            self.db.execute("insert into batches (id, tenant, created_at, expires_at) values (?, ?, ?, ?)",
                            (batch_id, tenant, now, now + ttl_s))
            self.db.executemany("insert into requests (batch_id, seq, custom_id, params) values (?, ?, ?, ?)",
                                [(batch_id, i, cid, json.dumps(p)) for i, (cid, p) in enumerate(requests)])
            self.db.execute("commit")
        return batch_id

    def get(self, batch_id: str, tenant: str | None) -> dict[str, Any] | None:
        """The batch in the API's shape; None if absent, deleted, or another tenant's (tenant None: any)."""
        with self.lock:
            row = self.db.execute("select id, tenant, created_at, expires_at, cancel_initiated_at, ended_at "
                                  "from batches where id = ? and deleted = 0", (batch_id,)).fetchone()
            if row is None or (tenant is not None and row[1] != tenant):
                return None
            counts = dict(self.db.execute("select state, count(*) from requests where batch_id = ? group by state",
                                          (batch_id,)).fetchall())
        return self._shape(row, counts)

    def list(self, tenant: str | None, limit: int, after_id: str | None, before_id: str | None) -> Page:
        """Most recent first; after_id / before_id are cursors (the page after or before that batch)."""
        where, args = "deleted = 0", []
        if tenant is not None:
            where += " and tenant = ?"
            args.append(tenant)
        order = "desc"
        for cursor, op in ((after_id, "<"), (before_id, ">")):
            if cursor is not None:
                with self.lock:
                    row = self.db.execute("select created_at from batches where id = ?", (cursor,)).fetchone()
                if row is None:
                    return Page([], False)
                where += f" and (created_at, id) {op} (?, ?)"
                args += [row[0], cursor]
                if op == ">":
                    order = "asc"
        with self.lock:
            ids = [r[0] for r in self.db.execute(f"select id from batches where {where} "
                                                 f"order by created_at {order}, id {order} limit ?",
                                                 (*args, limit + 1)).fetchall()]
        has_more = len(ids) > limit
        ids = ids[:limit]
        if order == "asc":
            ids.reverse()
        return Page([b for b in (self.get(i, None) for i in ids) if b is not None], has_more)

    def num_unended(self) -> int:
        with self.lock:
            return self.db.execute("select count(*) from batches where ended_at is null and deleted = 0").fetchone()[0]

    def cancel(self, batch_id: str) -> None:
        with self.lock:
            self.db.execute("update batches set cancel_initiated_at = ? where id = ? and cancel_initiated_at is null "
                            "and ended_at is null", (time.time(), batch_id))

    def delete(self, batch_id: str) -> None:
        with self.lock:
            self.db.execute("begin immediate")
            self.db.execute("update batches set deleted = 1 where id = ?", (batch_id,))
            self.db.execute("delete from requests where batch_id = ?", (batch_id,))
            self.db.execute("commit")

    def results(self, batch_id: str) -> list[str]:
        """One JSON line per request, in submission order."""
        with self.lock:
            rows = self.db.execute("select custom_id, result from requests where batch_id = ? order by seq",
                                   (batch_id,)).fetchall()
        return [json.dumps({"custom_id": cid, "result": json.loads(result)}, ensure_ascii=False)
                for cid, result in rows]

    # ---- the runner's side ----------------------------------------------------------------------------
    def pending(self, limit: int, skip: set[tuple[str, str]]) -> list[tuple[str, str, str, str]]:
        """(batch id, tenant, custom_id, params) of the oldest pending requests of running batches."""
        with self.lock:
            rows = self.db.execute(
                "select r.batch_id, b.tenant, r.custom_id, r.params "
                "from requests r join batches b on b.id = r.batch_id "
                "where r.state = 'pending' and b.ended_at is null and b.cancel_initiated_at is null "
                "and b.deleted = 0 order by b.created_at, r.seq limit ?", (limit + len(skip),)).fetchall()
        return [r for r in rows if (r[0], r[2]) not in skip][:limit]

    def finish(self, batch_id: str, custom_id: str, result: dict[str, Any]) -> bool:
        """Write a request's result, once: False if it already has one."""
        with self.lock:
            cur = self.db.execute("update requests set state = ?, result = ? where batch_id = ? and custom_id = ? "
                                  "and state = 'pending'", (result["type"], json.dumps(result), batch_id, custom_id))
        return cur.rowcount == 1

    def sweep(self, in_flight: set[tuple[str, str]], retention_s: float) -> None:
        """Close what is due: canceled batches' pending requests, expired batches', batches with nothing
        left pending; purge batches ended longer than retention_s ago."""
        now = time.time()
        with self.lock:
            self.db.execute("begin immediate")
            for batch_id, cancel, expires in self.db.execute(
                    "select id, cancel_initiated_at, expires_at from batches "
                    "where ended_at is null and deleted = 0").fetchall():
                if cancel is not None or expires <= now:
                    kind = "canceled" if cancel is not None else "expired"
                    for (custom_id,) in self.db.execute("select custom_id from requests where batch_id = ? and state = "
                                                        "'pending'", (batch_id,)).fetchall():
                        if (batch_id, custom_id) not in in_flight:
                            self.db.execute("update requests set state = ?, result = ? where batch_id = ? and "
                                            "custom_id = ? and state = 'pending'",
                                            (kind, json.dumps({"type": kind}), batch_id, custom_id))
                left = self.db.execute("select count(*) from requests where batch_id = ? and state = 'pending'",
                                       (batch_id,)).fetchone()[0]
                if not left:
                    self.db.execute("update batches set ended_at = ? where id = ?", (now, batch_id))
            old = [r[0] for r in self.db.execute("select id from batches where ended_at < ? and deleted = 0",
                                                 (now - retention_s,)).fetchall()]
            for batch_id in old:
                self.db.execute("update batches set deleted = 1 where id = ?", (batch_id,))
                self.db.execute("delete from requests where batch_id = ?", (batch_id,))
            self.db.execute("commit")

    @staticmethod
    def _shape(row, counts: dict[str, int]) -> dict[str, Any]:
        batch_id, _, created, expires, cancel, ended = row
        status = "ended" if ended is not None else "canceling" if cancel is not None else "in_progress"
        return {
            "id": batch_id, "type": "message_batch", "processing_status": status,
            "request_counts": {"processing": counts.get("pending", 0), **{k: counts.get(k, 0) for k in FINAL}},
            "created_at": _rfc3339(created), "expires_at": _rfc3339(expires), "ended_at": _rfc3339(ended),
            "cancel_initiated_at": _rfc3339(cancel), "archived_at": None,
            "results_url": f"/v1/messages/batches/{batch_id}/results" if ended is not None else None,
        }


class BatchRunner:
    """Runs pending batch requests through the app, at batch priority, as capacity allows."""

    def __init__(self, store: BatchStore, app, runtime, busy_concurrency: int = 2, idle_concurrency: int = 16,
                 retention_s: float = 29 * 86400, poll_s: float = 0.2):
        self.store = store
        self.app = app
        self.rt = runtime
        self.secret = secrets.token_hex(16)
        self.busy_concurrency = busy_concurrency
        self.idle_concurrency = idle_concurrency
        self.retention_s = retention_s
        self.poll_s = poll_s
        self.in_flight: dict[tuple[str, str], asyncio.Task] = {}
        # requests waiting to be tried again: (failures so far, tries so far, monotonic time of the next try)
        self.backoff: dict[tuple[str, str], tuple[int, int, float]] = {}
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for task in list(self.in_flight.values()):
            task.cancel()

    def is_internal(self, headers) -> bool:
        given = headers.get(INTERNAL_HEADER)
        return given is not None and secrets.compare_digest(given.encode("latin-1"), self.secret.encode())

    async def _run(self) -> None:
        transport = httpx.ASGITransport(app=self.app, raise_app_exceptions=False)  # an app's error is its 500
        async with httpx.AsyncClient(transport=transport, base_url="http://stratum.batch", timeout=None) as client:
            while True:
                try:
                    await asyncio.to_thread(self.store.sweep, set(self.in_flight), self.retention_s)
                    default = self.rt.engine  # None while unloaded: a batch's request starts its model
                    if not self.rt.draining and (default is None or default.is_alive):
                        interactive = sum(1 for j in self.rt.active.values() if not j.is_batch)
                        room = (self.busy_concurrency if interactive else self.idle_concurrency) - len(self.in_flight)
                        if room > 0:
                            now = time.monotonic()
                            waiting = {key for key, (_, _, at) in self.backoff.items() if at > now}
                            for batch_id, tenant, custom_id, params in await asyncio.to_thread(
                                    self.store.pending, room, set(self.in_flight) | waiting):
                                key = (batch_id, custom_id)
                                self.in_flight[key] = asyncio.create_task(self._one(client, key, tenant, params))
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("batch runner step failed")
                await asyncio.sleep(self.poll_s)

    async def _one(self, client: httpx.AsyncClient, key: tuple[str, str], tenant: str, params: str) -> None:
        """Run one request and write its result. A 4xx is an errored result at once (the request is
        wrong, and a retry will not change that); "not now" (429, 503, 529) is tried again after a backoff
        for as long as the batch lasts; a failure (a 5xx, an error here) is tried again after a backoff
        up to MAX_FAILURES times, then is an errored result with the last error. Each failure is one line
        in the log."""
        try:
            result = await self._result(client, key, tenant, params)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            result = self._retry(key, "failure", error_object(APIError(f"{type(e).__name__}: {e}"[:500])))
        finally:
            self.in_flight.pop(key, None)
        if result is None:
            return
        self.backoff.pop(key, None)
        try:
            await asyncio.to_thread(self.store.finish, *key, result)
        except Exception as e:  # the store failed: the request stays pending and runs again
            log.warning("batch request %s/%s: its result was not written: %s: %s", *key, type(e).__name__, e)

    async def _result(self, client: httpx.AsyncClient, key: tuple[str, str], tenant: str,
                      params: str) -> dict[str, Any] | None:
        """The request's result, or None when it is to be tried again."""
        body = json.loads(params)
        if body.get("stream"):
            refused = InvalidRequest("stream is not supported in a batch request")
            return {"type": "errored", "error": error_object(refused)}
        r = await client.post("/v1/messages", content=params, headers={
            INTERNAL_HEADER: self.secret, TENANT_HEADER: tenant, "content-type": "application/json"})
        if r.status_code == 200:  # with the cost the interactive response carries in its headers
            return {"type": "succeeded", "message": r.json(), "stratum_cost": {
                "header": r.headers.get("x-stratum-cost"), "mode": r.headers.get("x-stratum-mode")}}
        try:
            data = r.json()
            error = data["error"] if isinstance(data, dict) and isinstance(data.get("error"), dict) else None
        except ValueError:
            error = None
        error = error or error_object(APIError(f"HTTP {r.status_code}: {r.text[:500]}"))
        if r.status_code in NOT_NOW or r.status_code >= 500:
            return self._retry(key, "not_now" if r.status_code in NOT_NOW else "failure", error,
                               r.status_code)
        return {"type": "errored", "error": error}

    def _retry(self, key, kind: str, error: dict[str, Any], status: int | None = None) -> dict[str, Any] | None:
        """Back off before `key`'s next try (None), or its errored result once its failures are spent."""
        failures, tries, _ = self.backoff.get(key, (0, 0, 0.0))
        tries += 1
        if kind == "failure":
            failures += 1
            log.warning("batch request %s/%s failed (%d of %d): %s%s", *key, failures, MAX_FAILURES,
                        f"HTTP {status}: " if status else "", error.get("message", "")[:200])
            if failures >= MAX_FAILURES:
                self.backoff.pop(key, None)
                return {"type": "errored", "error": error}
        self.backoff[key] = (failures, tries, time.monotonic() + min(MAX_BACKOFF_S, BACKOFF_S * 2 ** (tries - 1)))
        return None


def batch_routes(app: FastAPI, rt: Runtime, settings: ServerSettings, store: BatchStore) -> None:
    """Message Batches: create, retrieve, list, cancel, delete, results (JSONL). With tenants, a batch is
    visible to its own tenant only."""

    def owner(request: Request) -> str | None:
        return tenant_of(request, None) if rt.isolate_tenants else None

    async def get(request: Request, batch_id: str) -> dict[str, Any]:
        batch = await asyncio.to_thread(store.get, batch_id, owner(request))
        if batch is None:
            raise NotFound(f"no message batch {batch_id!r}")
        return batch

    @app.post(BATCHES_PATH)
    async def create_batch(request: Request):
        req = await read_request(request, BatchCreateRequest, settings.max_batch_bytes, settings.body_timeout_s)
        ids = [r.custom_id for r in req.requests]
        if len(set(ids)) != len(ids):
            raise InvalidRequest("requests: custom_id values must be unique within a batch")
        batch_id = await asyncio.to_thread(store.create, tenant_of(request, None),
                                           [(r.custom_id, r.params) for r in req.requests], settings.batch_ttl_s)
        return await get(request, batch_id)

    @app.get(BATCHES_PATH)
    async def list_batches(request: Request, limit: int = 20, after_id: str | None = None,
                           before_id: str | None = None):
        if not 1 <= limit <= 1000:
            raise InvalidRequest("limit must be in [1, 1000]")
        page = await asyncio.to_thread(store.list, owner(request), limit, after_id, before_id)
        return {"data": page.data, "has_more": page.has_more, "first_id": page.data[0]["id"] if page.data else None,
                "last_id": page.data[-1]["id"] if page.data else None}

    @app.get(BATCHES_PATH + "/{batch_id}")
    async def retrieve_batch(request: Request, batch_id: str):
        return await get(request, batch_id)

    @app.post(BATCHES_PATH + "/{batch_id}/cancel")
    async def cancel_batch(request: Request, batch_id: str):
        await get(request, batch_id)
        await asyncio.to_thread(store.cancel, batch_id)
        return await get(request, batch_id)

    @app.delete(BATCHES_PATH + "/{batch_id}")
    async def delete_batch(request: Request, batch_id: str):
        if (await get(request, batch_id))["processing_status"] != "ended":
            raise InvalidRequest("a message batch can be deleted once it has ended: cancel it first")
        await asyncio.to_thread(store.delete, batch_id)
        return {"id": batch_id, "type": "message_batch_deleted"}

    @app.get(BATCHES_PATH + "/{batch_id}/results")
    async def batch_results(request: Request, batch_id: str):
        if (await get(request, batch_id))["processing_status"] != "ended":
            raise InvalidRequest("the batch has not ended: its results are not available yet")
        lines = await asyncio.to_thread(store.results, batch_id)
        return Response("".join(line + "\n" for line in lines), media_type="application/x-jsonl")
