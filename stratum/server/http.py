"""The HTTP server under the app: uvicorn with the limits a public endpoint needs, and a graceful drain.

- Requests the HTTP parser refuses (a malformed Content-Length, a broken request line, headers over
  the size limit) are answered in the error shape of the API the request line names (Anthropic's
  when it names none) with a request id: 400, or 431 for headers;
  headers that do not all arrive within `header_timeout_s` get 408, and a connection that sends
  nothing for that long is closed. A refused connection is half-closed, and what the client still
  sends is read and dropped for a moment, so the client reads the answer instead of a reset.
- Connections beyond `max_connections` have their requests answered 529 (see `app.Envelope`).
- SIGTERM or SIGINT starts a drain (`runtime.drain`); a second signal exits at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
from http import HTTPStatus
from typing import TYPE_CHECKING

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from stratum.server.errors import APIError, BodyTimeout, HeadersTooLarge, InvalidRequest, error_body, new_request_id

if TYPE_CHECKING:
    from stratum.server.runtime import Runtime

log = logging.getLogger("stratum.server")

LINGER_S = 2.0  # how long a refused connection keeps reading (and dropping) what the client still sends
OVER_LIMIT = "stratum_over_connection_limit"  # set in the scope's state of a connection over the limit


def protocol(max_connections: int, header_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol with API-shaped parser errors, a header timeout and a connection limit."""

    class Protocol(H11Protocol):
        _lingering = False
        _header_timer: asyncio.TimerHandle | None = None
        _request_line = b""  # the current request's first line, so a refusal knows its route

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.conn = _Connection(h11.SERVER, self.conn._max_incomplete_event_size)

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                self.app_state = {**self.app_state, OVER_LIMIT: True}
            self._header_timer = self.loop.call_later(header_timeout_s, self._headers_timed_out)

        def connection_lost(self, exc) -> None:
            self._stop_header_timer()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._lingering:
                return
            if self.conn.their_state in (h11.IDLE, h11.DONE) and not self.conn.trailing_data[0]:
                self._request_line = data.split(b"\r\n", 1)[0][:_MAX_REQUEST_LINE]
            super().data_received(data)
            # Still waiting for a request's headers: they must all arrive within header_timeout_s.
            if self.conn.their_state is h11.IDLE and not self._lingering:
                if self._header_timer is None:
                    self._header_timer = self.loop.call_later(header_timeout_s, self._headers_timed_out)
            else:
                self._stop_header_timer()

        def send_400_response(self, msg: str) -> None:
            e = self.conn.error
            if e is not None and e.error_status_hint == 431:
                self._refuse(HeadersTooLarge(f"request headers exceed {self.conn._max_incomplete_event_size} bytes"))
            else:
                self._refuse(InvalidRequest(f"malformed HTTP request: {e or msg}"))

        def _headers_timed_out(self) -> None:
            """A connection that sent nothing is closed; one that sent part of its headers gets 408."""
            self._header_timer = None
            if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
                return
            if self.conn.trailing_data[0]:
                self._refuse(BodyTimeout(f"the request headers did not arrive within {header_timeout_s:g}s"))
            elif self.cycle is None or self.cycle.response_complete:
                self.transport.close()

        def _stop_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _refuse(self, err: APIError) -> None:
            """Answer err and close, written directly: the parser cannot frame a response any more."""
            request_id = new_request_id()
            body = json.dumps(error_body(err, request_id, _target(self._request_line))).encode()
            head = (f"HTTP/1.1 {err.status} {HTTPStatus(err.status).phrase}\r\ncontent-type: application/json\r\n"
                    f"content-length: {len(body)}\r\nrequest-id: {request_id}\r\nconnection: close\r\n\r\n")
            self.transport.write(head.encode() + body)
            self._lingering = True
            self._stop_header_timer()
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self.loop.call_later(LINGER_S, self.transport.close)

    return Protocol


_MAX_REQUEST_LINE = 8192


def _target(request_line: bytes) -> str:
    """The path of `METHOD PATH HTTP/1.1`, or "" when the line is not one: OpenAI routes get
    OpenAI's error shape even from the parser, the rest Anthropic's."""
    parts = request_line.split(b" ")
    return parts[1].split(b"?", 1)[0].decode("latin-1") if len(parts) == 3 else ""


class _Connection(h11.Connection):
    """Keeps the parser's error, whose status hint says 431 for headers over the size limit."""

    error: h11.RemoteProtocolError | None = None

    def next_event(self):
        try:
            return super().next_event()
        except h11.RemoteProtocolError as e:
            self.error = e
            raise


class Server(uvicorn.Server):
    """uvicorn's server, draining on the first SIGTERM or SIGINT instead of cutting requests off.

    `rt` is the app's runtime, None until the app is ready (`startup.StartingApp`): a signal before
    then has nothing to drain and exits at once.
    """

    def __init__(self, config: uvicorn.Config, rt: Runtime | None, drain_timeout_s: float):
        super().__init__(config)
        self.rt = rt
        self.drain_timeout_s = drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None  # held so that the task is not collected while it runs

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if self._loop is None or self.rt is None or self.rt.draining or self.should_exit:  # a second signal: exit now
            self.should_exit = self.force_exit = True
            return
        self.rt.draining = True
        self._loop.call_soon_threadsafe(self._start_drain, signal.Signals(sig).name)

    def _start_drain(self, why: str) -> None:
        self._drain = asyncio.ensure_future(self._drain_then_exit(why))

    async def _drain_then_exit(self, why: str) -> None:
        from stratum.server.runtime import drain

        log.warning("%s: draining %d requests in flight (up to %gs), refusing new ones", why, len(self.rt.active),
                    self.drain_timeout_s)
        num_cut = await drain(self.rt, self.drain_timeout_s)
        if num_cut:
            log.warning("drain timeout: ended %d requests with an error", num_cut)
        self.should_exit = True
