"""The listening side of `zipage serve`: the socket, uvicorn's connections and the drain.

- `bind` takes the address before the model loads, so a port that is out of range or taken is a
  one-line error at once, not after minutes of loading; uvicorn serves on that socket.
- `HeaderTimeoutProtocol`: uvicorn's h11 protocol never times out a client that sends its
  request headers slowly (its keep-alive timeout runs only between requests, and stops at the
  first byte), so thousands of slow clients could each hold a connection open forever. Here a
  connection that has not sent a complete request head within --header-timeout seconds of
  opening, or of its previous response, is closed.
- `DrainingServer`: on SIGTERM or SIGINT uvicorn stops accepting connections and waits for the
  requests in flight; this adds a deadline (--drain-timeout), after which the requests still
  running are failed with a clean error, and exits with status 0 instead of re-raising the signal
  (a drained server has done what was asked).
"""

from __future__ import annotations

import asyncio
import errno
import signal
import socket
from collections.abc import Callable

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

MAX_PORT = 65535
# Past the drain deadline the failed requests' last events still have to reach their clients.
DRAIN_GRACE_S = 5.0


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


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request head is late."""

    header_timeout_s = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_late)

    def on_response_complete(self) -> None:
        self._header_timer.cancel()  # the next request's head is due within the timeout
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_late)
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._header_timer.cancel()
        super().connection_lost(exc)

    def _header_late(self) -> None:
        # A request is in progress once its head has arrived (uvicorn starts a cycle then).
        waiting_for_head = self.cycle is None or self.cycle.response_complete
        if waiting_for_head and not self.transport.is_closing():
            try:
                self.conn.send(h11.ConnectionClosed())
            except h11.LocalProtocolError:
                pass  # h11 already knows the connection is over
            self.transport.close()


def protocol_with_header_timeout(seconds: float) -> type[HeaderTimeoutProtocol]:
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout_s": seconds})


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
