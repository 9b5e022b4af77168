"""What the port answers while the engine starts: it opens at once, as llama-server's does.

Until the app is ready, `/health` answers 503 with the stage start-up is in ("starting engine",
"loading model", "starting server"), and every other route 503 in its API's error shape
(`overloaded_error`, with Retry-After), so clients and load balancers wait rather than fail. Then
the app is swapped in whole and answers everything; its lifespan (start-up and shutdown handlers)
runs from the swap until the server stops.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

from stratum.server.errors import APIError, error_body, new_request_id

RETRY_AFTER_S = 2


class Starting(APIError):
    status, type = 503, "overloaded_error"


class StartingApp:
    """An ASGI app that stands in for `app` until `serve(app)`.

    Args:
        model_name: the served model's name, for /health.
    """

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.stage = "starting engine"
        self.app = None
        self._started_at = time.monotonic()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listening = threading.Event()
        self._lifespan: _Lifespan | None = None

    def wait_listening(self, timeout: float | None = None) -> bool:
        """Block until the server runs this app's event loop (its port is open)."""
        return self._listening.wait(timeout)

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The server's event loop, once it runs this app (`wait_listening`)."""
        return self._loop

    def serve(self, app) -> None:
        """From any thread, once the server listens: start app's lifespan, then route everything to it.

        Raises:
            RuntimeError: app's start-up failed.
        """
        asyncio.run_coroutine_threadsafe(self._open(app), self._loop).result()

    async def _open(self, app) -> None:
        lifespan = _Lifespan(app)
        await lifespan.startup()
        self._lifespan, self.app = lifespan, app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await self._own_lifespan(receive, send)
        elif self.app is not None:
            await self.app(scope, receive, send)
        elif scope["type"] == "http":
            await self._refuse(scope, send)

    async def _own_lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._loop = asyncio.get_running_loop()
                self._listening.set()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._lifespan is not None:
                    await self._lifespan.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _refuse(self, scope, send) -> None:
        path = scope["path"]
        request_id = new_request_id()
        headers = [(b"content-type", b"application/json"), (b"request-id", request_id.encode())]
        if path == "/health":
            body = {"status": "loading", "stage": self.stage, "model": self.model_name,
                    "elapsed_s": round(time.monotonic() - self._started_at, 1)}
        else:
            body = error_body(Starting(f"the server is starting ({self.stage}); retry shortly"), request_id, path)
            headers.append((b"retry-after", str(RETRY_AFTER_S).encode()))
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": json.dumps(body).encode()})


class _Lifespan:
    """An ASGI app's lifespan protocol, driven by hand: the server ran its own before the app existed."""

    def __init__(self, app):
        self._app = app
        self._inbox: asyncio.Queue = asyncio.Queue()
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._task: asyncio.Task | None = None

    async def startup(self) -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}
        self._task = asyncio.ensure_future(self._app(scope, self._inbox.get, self._outbox.put))
        await self._exchange("startup")

    async def shutdown(self) -> None:
        await self._exchange("shutdown")
        await self._task

    async def _exchange(self, phase: str) -> None:
        await self._inbox.put({"type": f"lifespan.{phase}"})
        reply = await self._outbox.get()
        if reply["type"] != f"lifespan.{phase}.complete":
            raise RuntimeError(f"the app's {phase} failed: {reply.get('message', reply['type'])}")
