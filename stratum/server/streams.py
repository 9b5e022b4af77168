"""Adapting an engine request (an async iterator) for HTTP handlers: timeouts without aborting."""

from __future__ import annotations

import asyncio

_END = object()


class EngineStream:
    """Pumps an engine output iterator into a queue, so a handler can wait with a timeout.

    Closing cancels the pump, which closes the iterator, which aborts the request in the engine
    and frees its blocks (client disconnects end up here).
    """

    def __init__(self, outputs):
        self._outputs = outputs
        self._queue: asyncio.Queue = asyncio.Queue()
        self._task = asyncio.create_task(self._pump())
        self.done = False

    async def _pump(self):
        try:
            async for out in self._outputs:
                self._queue.put_nowait(out)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._queue.put_nowait(e)
        finally:
            self._queue.put_nowait(_END)

    async def next(self, timeout: float | None = None):
        """The next output; None on timeout; raises the engine's error; StopAsyncIteration at the end."""
        try:
            item = await asyncio.wait_for(self._queue.get(), timeout) if timeout else await self._queue.get()
        except asyncio.TimeoutError:
            return None
        if item is _END:
            self.done = True
            raise StopAsyncIteration
        if isinstance(item, Exception):
            self.done = True
            raise item
        return item

    async def close(self) -> None:
        if not self._task.done():
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
