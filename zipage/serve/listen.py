"""The listening side of `zipage serve`: the socket, uvicorn's connections and the drain.

- `bind` takes the address before the model loads, so a port that is out of range or taken is a
  one-line error at once, not after minutes of loading; uvicorn serves on that socket.
- `GuardedProtocol`: uvicorn's h11 protocol with the limits it lacks. uvicorn never times out a
  client that sends its request slowly (its keep-alive timeout runs only between requests, and
  stops at the first byte) and accepts any number of connections, so thousands of slow clients
  could each hold a connection, and the part of a body it buffered, forever. Here a connection
  that has not sent a complete request head within --header-timeout seconds of opening, or of its
  previous response, is closed; a body not complete --body-timeout seconds after its head is
  answered 408 and closed; a connection opened while --max-connections are open is answered 503
  and closed. A connection closed while its client may still be sending a body (a 413, a 401, a
  408) closes the way well-kept servers do: the response is written, the write side shut, and
  what the client still sends is read and discarded for a bounded time, so the client reads the
  response instead of a reset.
- `DrainingServer`: on SIGTERM or SIGINT uvicorn stops accepting connections and waits for the
  requests in flight; this adds a deadline (--drain-timeout), after which the requests still
  running are failed with a clean error, and exits with status 0 instead of re-raising the signal
  (a drained server has done what was asked).
"""

from __future__ import annotations

import asyncio
import errno
import json
import signal
import socket
from collections.abc import Callable
from http import HTTPStatus

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from zipage.serve import DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S, DEFAULT_MAX_CONNECTIONS
from zipage.serve.protocol import error_body

MAX_PORT = 65535
# Past the drain deadline the failed requests' last events still have to reach their clients.
DRAIN_GRACE_S = 5.0
# A lingering close reads and discards what the client still sends for at most this long and
# this much: enough for a client to finish writing a refused body and read its answer, bounded
# so that one that never stops sending cannot keep its connection.
LINGER_S = 5.0
LINGER_BYTES = 64 * 2**20


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port), not yet listening; `ValueError` with a one-line message
    naming the flag and the fix."""
    if not 1 <= port <= MAX_PORT:
        raise ValueError(f"--port: got {port}, expected 1..{MAX_PORT}")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as error:
        raise ValueError(f"--host: cannot resolve {host!r} ({error.strerror}); give an address "
                         "such as 127.0.0.1 or 0.0.0.0") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: restarts at once
    try:
        sock.bind(address)
    except OSError as error:
        sock.close()
        if error.errno == errno.EADDRINUSE:
            raise ValueError(f"--port: {host}:{port} is already in use (another server?); stop "
                             "it or choose another --port") from None
        if error.errno == errno.EACCES:
            raise ValueError(f"--port: no permission to listen on port {port}; choose one "
                             "above 1023") from None
        raise ValueError(f"--host: cannot listen on {host}:{port} ({error.strerror}); give an "
                         "address of this machine, such as 127.0.0.1 or 0.0.0.0") from None
    sock.set_inheritable(False)  # the engine process must not hold the port
    return sock


class _LingeringTransport:
    """A connection's transport whose `close` is the protocol's (it lingers where the client may
    still be sending); everything else is the transport's own."""

    def __init__(self, transport: asyncio.Transport, protocol: GuardedProtocol) -> None:
        self._transport = transport
        self._protocol = protocol

    def __getattr__(self, name: str):
        return getattr(self._transport, name)

    def close(self) -> None:
        self._protocol.close_connection()

    def is_closing(self) -> bool:  # uvicorn starts nothing new on a connection that lingers
        return self._protocol.lingering or self._transport.is_closing()


class GuardedProtocol(H11Protocol):
    """uvicorn's h11 protocol with deadlines on the request head and body, a connection cap and
    a lingering close (the module docstring says why)."""

    header_timeout_s = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s = DEFAULT_BODY_TIMEOUT_S
    max_connections: int | None = DEFAULT_MAX_CONNECTIONS

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._raw = transport
        self._body_timer: asyncio.TimerHandle | None = None
        self._linger_timer: asyncio.TimerHandle | None = None
        self._discarded: int | None = None  # bytes read and dropped while lingering
        super().connection_made(_LingeringTransport(transport, self))  # type: ignore[arg-type]
        if self.max_connections is not None and len(self.connections) > self.max_connections:
            self.app = _over_capacity(self.max_connections)
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_late)

    # ---------------------------------------------------------------- deadlines

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        cycle = self.cycle
        if cycle is not before and cycle is not None and cycle.more_body:  # a head, no body yet
            self._cancel_body_timer()
            self._body_timer = self.loop.call_later(self.body_timeout_s, self._body_late, cycle)

    def on_response_complete(self) -> None:
        self._cancel_body_timer()
        if not self.transport.is_closing():  # the next request's head is due in the timeout
            self._header_timer.cancel()
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_late)
        super().on_response_complete()

    def _header_late(self) -> None:
        # A request is in progress once its head has arrived (uvicorn starts a cycle then).
        waiting_for_head = self.cycle is None or self.cycle.response_complete
        if waiting_for_head and not self._raw.is_closing():
            try:
                self.conn.send(h11.ConnectionClosed())
            except h11.LocalProtocolError:
                pass  # h11 already knows the connection is over
            self._raw.close()

    def _body_late(self, cycle) -> None:
        """The body of `cycle` is still incomplete at its deadline: a 408 if no response has
        started (the route still waits for the body), and the connection closes."""
        self._body_timer = None
        if (cycle is not self.cycle or not cycle.more_body or self.lingering
                or self._raw.is_closing()):
            return
        answer = not cycle.response_started
        cycle.disconnected = True  # the route's body read ends; its response goes nowhere
        cycle.message_event.set()
        if answer:
            self._write_error(408, f"body: not complete {self.body_timeout_s:g} s after the "
                                   "request's headers (zipage serve --body-timeout); send the "
                                   "whole body at once")
        self.close_connection()

    def _write_error(self, status: int, message: str) -> None:
        """An OpenAI error response written from here, outside any route."""
        body = json.dumps(error_body(message, "invalid_request_error", None, status)).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                   (b"content-length", str(len(body)).encode())]
        try:
            for event in (h11.Response(status_code=status, headers=headers,
                                       reason=HTTPStatus(status).phrase.encode()),
                          h11.Data(data=body), h11.EndOfMessage()):
                self._raw.write(self.conn.send(event))
        except h11.LocalProtocolError:
            pass  # a response had begun after all: the close alone says it

    def _cancel_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    # ---------------------------------------------------------------- the lingering close

    @property
    def lingering(self) -> bool:
        return self._discarded is not None

    def close_connection(self) -> None:
        """Close, lingering while the client may still be sending the request's body (a
        second close while lingering ends it)."""
        cycle = self.cycle
        if (self.lingering or self._raw.is_closing() or cycle is None or not cycle.more_body
                or not self._raw.can_write_eof()):
            self._raw.close()
            return
        self._discarded = 0
        self._raw.write_eof()  # after the response: the client reads it, then the end
        self._raw.resume_reading()  # flow control paused it while the body went unread
        self._linger_timer = self.loop.call_later(LINGER_S, self._raw.close)

    def data_received(self, data: bytes) -> None:
        if self._discarded is None:
            super().data_received(data)
            return
        self._discarded += len(data)
        if self._discarded > LINGER_BYTES:
            self._raw.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._header_timer.cancel()
        self._cancel_body_timer()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        super().connection_lost(exc)


def _over_capacity(limit: int):
    """The ASGI app a connection past the cap gets: 503 and the connection closes."""
    body = json.dumps(error_body(
        f"server busy: {limit} connections are open (zipage serve --max-connections); retry "
        "later", "server_error", None, 503)).encode()

    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close"), (b"retry-after", b"1")]})
        await send({"type": "http.response.body", "body": body})

    return app


def guarded_protocol(header_timeout_s: float, body_timeout_s: float,
                     max_connections: int | None) -> type[GuardedProtocol]:
    return type("GuardedProtocol", (GuardedProtocol,), {
        "header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s,
        "max_connections": max_connections})


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a drain deadline: `on_deadline` fails the requests still running
    `drain_s` seconds after shutdown began."""

    def __init__(self, config: uvicorn.Config, drain_s: float,
                 on_deadline: Callable[[], None]) -> None:
        super().__init__(config)
        self.drain_s = drain_s
        self.on_deadline = on_deadline
        self.deadline_passed = False

    def handle_exit(self, sig: int, frame) -> None:
        # Not uvicorn's: it re-raises the signal after the drain, and the status would be 143.
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop waiting
        else:
            self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        timer = asyncio.get_running_loop().call_later(self.drain_s, self._deadline)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _deadline(self) -> None:
        self.deadline_passed = True
        self.on_deadline()
