"""The HTTP process's end of the engine socket, on the event loop: whole messages in and out,
however the bytes arrive, and never a blocking call.

The engine process reads and writes with `multiprocessing.connection.Connection` on a blocking
socket of its own (a thread there receives). This end cannot: it runs on the event loop, and the
loop uvicorn uses (uvloop) makes every descriptor it watches non-blocking, so a
`Connection.recv` of a step update larger than what has arrived so far raises `BlockingIOError`
half-way through the message, and a `Connection.send` of a large prompt does the same once the
socket's buffer is full, leaving half a message behind. Here the bytes are buffered instead: a
message is unpickled once all of it has arrived, and what the socket cannot take yet waits in an
outbox that the loop flushes when the socket is writable again. Only an end of file or a real
socket error means the engine is gone.

The framing is `Connection`'s, so the engine side keeps its plain `Connection`: a 4-byte
big-endian signed length, or -1 and an 8-byte unsigned length for a message of 2 GiB or more,
then the pickled message.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import struct
from collections.abc import Callable

_LENGTH = struct.Struct("!i")
_LONG_LENGTH = struct.Struct("!Q")
_LONG = -1  # the short length field's value announcing a long one
READ_BYTES = 1 << 20  # per read call
READS_PER_WAKEUP = 64  # then the loop serves others before reading on (the socket stays readable)


def frame(message) -> bytes:
    """`message` pickled and framed as `Connection.send` frames it."""
    payload = pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
    if len(payload) > 0x7FFFFFFF:
        return _LENGTH.pack(_LONG) + _LONG_LENGTH.pack(len(payload)) + payload
    return _LENGTH.pack(len(payload)) + payload


class FrameReader:
    """Reassembles framed payloads from bytes fed in pieces of any size."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        """Take `data`; return every payload now complete, in order (the rest is kept)."""
        self._buffer += data
        payloads = []
        while True:
            payload = self._next()
            if payload is None:
                return payloads
            payloads.append(payload)

    @property
    def pending(self) -> int:
        """Bytes of a message not yet complete."""
        return len(self._buffer)

    def _next(self) -> bytes | None:
        buffer = self._buffer
        if len(buffer) < _LENGTH.size:
            return None
        size = _LENGTH.unpack_from(buffer)[0]
        start = _LENGTH.size
        if size == _LONG:
            if len(buffer) < start + _LONG_LENGTH.size:
                return None
            size = _LONG_LENGTH.unpack_from(buffer, start)[0]
            start += _LONG_LENGTH.size
        elif size < 0:
            raise ValueError(f"the engine socket carries a bad message length ({size})")
        end = start + size
        if len(buffer) < end:
            return None
        payload = bytes(buffer[start:end])
        del buffer[:end]
        return payload


class EngineChannel:
    """Messages over a socket watched by the event loop. `on_message` gets each message as it
    completes; `on_closed` once, when the engine's end closes or the socket fails."""

    def __init__(self, fd: int, loop: asyncio.AbstractEventLoop, on_message: Callable,
                 on_closed: Callable[[], None]) -> None:
        self.fd = fd
        self.loop = loop
        self.on_message = on_message
        self.on_closed = on_closed
        self.closed = False
        self._reader = FrameReader()
        self._outbox = bytearray()
        os.set_blocking(fd, False)  # as uvloop sets it; the same under asyncio's own loop
        loop.add_reader(fd, self._readable)

    def send(self, message) -> None:
        """Queue a message; it is written now as far as the socket takes it, the rest when the
        socket is writable. A socket that failed calls `on_closed` (soon, not from here)."""
        if self.closed:
            return
        waiting = bool(self._outbox)
        self._outbox += frame(message)
        if not waiting:
            self._flush()

    def close(self) -> None:
        """Stop watching the socket (the caller closes it); nothing more is read or written."""
        if self.closed:
            return
        self.closed = True
        if not self.loop.is_closed():
            self.loop.remove_reader(self.fd)
            self.loop.remove_writer(self.fd)
        self._outbox.clear()

    def _readable(self) -> None:
        for _ in range(READS_PER_WAKEUP):
            try:
                data = os.read(self.fd, READ_BYTES)
            except (BlockingIOError, InterruptedError):
                return  # all that has arrived is read: a partial message waits for the rest
            except OSError:
                self._fail()
                return
            if not data:
                self._fail()  # end of file: the engine process closed its end
                return
            try:
                messages = [pickle.loads(payload) for payload in self._reader.feed(data)]
            except Exception:  # noqa: BLE001 - a garbled stream cannot be resynchronised
                self._fail()
                return
            for message in messages:
                self.on_message(message)
                if self.closed:  # the message made the owner close the channel
                    return

    def _flush(self) -> None:
        while self._outbox:
            try:
                written = os.write(self.fd, self._outbox)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                # Reported from the loop: a send inside a route must not fail every request
                # in flight from within that route.
                self.loop.call_soon(self._fail)
                return
            del self._outbox[:written]
        if self._outbox:
            self.loop.add_writer(self.fd, self._flush)
        else:
            self.loop.remove_writer(self.fd)

    def _fail(self) -> None:
        if not self.closed:
            self.close()
            self.on_closed()
