"""A small threaded TCP proxy on 127.0.0.1 that puts network faults between a client and a real
server (latency, dropped connections, a refusing or a stalled server) for fault-injection tests.

    with RedisServer() as server, TcpProxy(server.port) as proxy:
        client = redis.Redis.from_url(proxy.url)
        proxy.latency = 0.05        # each round trip now takes 0.1 s more
        proxy.drop_connections()    # the client's next command fails, the one after reconnects

Each client connection gets its own upstream connection and two pump threads, one per
direction. The pumps only block in select() for at most POLL seconds, so every thread notices a
drop or stop() quickly, and sockets are closed only once both pumps of a link are done with them.
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading
import time
from collections import deque

POLL = 0.05  # the longest a thread goes without looking at its link's and the proxy's state
CHUNK = 65536
CONNECT_TIMEOUT = 2.0
JOIN_TIMEOUT = 5.0


def _abort(sock: socket.socket) -> None:
    """Close with SO_LINGER 0, so the peer gets a RST rather than a FIN."""
    with contextlib.suppress(OSError):  # already reset by the peer: closing is all that is left
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


class _Link:
    """A client connection, its upstream connection and the two pumps between them."""

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client, self.upstream = client, upstream
        self.closing = False  # set by drop(), or by a pump that hit a socket error
        self.threads: list[threading.Thread] = []
        self._active = 2
        self._lock = threading.Lock()

    def drop(self) -> None:
        """Abort both connections (RST) and return once the pumps have stopped."""
        self.closing = True
        for thread in self.threads:
            if thread is not threading.current_thread():
                thread.join(JOIN_TIMEOUT)

    def pump_done(self) -> bool:
        """Called by each pump on its way out; True for the last one, which closed the sockets."""
        # Gracefully if both directions ended with an EOF (already passed on as a FIN), with a
        # RST if the link was dropped or broke.
        with self._lock:
            self._active -= 1
            if self._active:
                return False
        for sock in (self.client, self.upstream):
            if self.closing:
                _abort(sock)
            else:
                sock.close()
        return True


class TcpProxy:
    """Forwards connections to 127.0.0.1:port (proxy.port) to (target_host, target_port).

    Faults, all settable while running, from any thread:

    * latency: seconds by which every chunk of bytes is held back, in each direction (a request
      and its reply: 2 * latency more per round trip). Bytes keep their order; a new value
      applies to bytes read from then on.
    * late_replies = (every, delay): every n-th chunk from the server on each connection (a
      reply, on a link that is not busy) is held back *delay* seconds more, and the bytes after
      it wait behind it, like a client that reads some replies late (a busy process does). The
      requests and the other replies are not held. None (the default): none is.
    * drop_connections(): abort every open connection, both sides, with a RST. New connections
      are served as before.
    * refuse(True): drop every open connection and RST every new one right after accepting it,
      like a server that is down (the client sees a reset instead of "connection refused").
    * blackhole(True): connections stay open (and new ones are accepted and connected upstream)
      but every byte read, in either direction, is silently discarded, like a stalled network:
      clients wait until their own timeout. Bytes discarded meanwhile are never delivered, so
      a connection used during the blackhole is usually out of step afterwards; bytes read before
      it was switched on but still held back by latency are delivered.

    connections_accepted counts every connection accepted, refused ones included.
    """

    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.latency = 0.0
        self.late_replies: tuple[int, float] | None = None
        self.connections_accepted = 0
        self._refusing = False
        self._blackholed = False
        self._replies_lost = False
        self._stopping = threading.Event()
        self._links: set[_Link] = set()
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(POLL)
        self._port: int = self._listener.getsockname()[1]
        self._acceptor = threading.Thread(target=self._accept_loop, name="tcp-proxy-accept")

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self._port}/0"

    def start(self) -> TcpProxy:
        self._acceptor.start()
        return self

    def stop(self) -> None:
        """Close the listener and abort every connection; all threads are joined."""
        self._stopping.set()
        if self._acceptor.is_alive():
            self._acceptor.join(JOIN_TIMEOUT)
        self._listener.close()
        self.drop_connections()

    def drop_connections(self) -> None:
        with self._lock:
            links = list(self._links)
        for link in links:
            link.drop()

    def refuse(self, on: bool) -> None:
        self._refusing = on
        if on:
            self.drop_connections()

    def blackhole(self, on: bool) -> None:
        self._blackholed = on

    def lose_replies(self, on: bool) -> None:
        """Requests still reach the server, which runs them; its replies are lost."""
        self._replies_lost = on

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            self.connections_accepted += 1
            if self._refusing:
                _abort(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=CONNECT_TIMEOUT)
            except OSError:  # the server is down: so is the proxied connection
                _abort(client)
                continue
            for sock in (client, upstream):
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            link = _Link(client, upstream)
            link.threads = [
                threading.Thread(
                    target=self._pump, args=(link, src, dst, replies), name=f"tcp-proxy-{n}"
                )
                for n, src, dst, replies in (
                    ("up", client, upstream, False),
                    ("down", upstream, client, True),
                )
            ]
            with self._lock:  # started under the lock: drop_connections() joins only started pumps
                self._links.add(link)
                for thread in link.threads:
                    thread.start()

    def _pump(self, link: _Link, src: socket.socket, dst: socket.socket, replies: bool) -> None:
        """Move bytes from src to dst, each chunk no earlier than latency after it was read (and
        late_replies's delay, for every n-th chunk of the *replies*)."""
        held: deque[tuple[float, bytes]] = deque()  # (when to send, bytes), in order
        eof = False
        chunks = 0
        try:
            while not (link.closing or self._stopping.is_set() or (eof and not held)):
                now = time.monotonic()
                due = bool(held) and held[0][0] <= now
                timeout = POLL if due or not held else min(POLL, held[0][0] - now)
                readable, writable, _ = select.select(
                    [] if eof else [src], [dst] if due else [], [], timeout
                )
                if readable:
                    data = src.recv(CHUNK)
                    if not data:
                        eof = True
                    elif not (self._blackholed or (replies and self._replies_lost)):
                        chunks += 1
                        when = time.monotonic() + self.latency
                        late = self.late_replies if replies else None
                        if late is not None and chunks % late[0] == 0:
                            when += late[1]
                        held.append((when, data))  # behind the bytes ahead of it
                if writable:
                    when, data = held.popleft()
                    try:
                        sent = dst.send(data)
                    except BlockingIOError:  # select() said writable, but the buffer filled up
                        sent = 0
                    if sent < len(data):  # the rest goes first next time
                        held.appendleft((when, data[sent:]))
            if eof and not link.closing:
                dst.shutdown(socket.SHUT_WR)  # pass the EOF on; the other direction carries on
        except OSError:  # a reset, or a peer gone: break the whole link, as a real network would
            link.closing = True
        finally:
            if self._stopping.is_set():
                link.closing = True
            if link.pump_done():
                with self._lock:
                    self._links.discard(link)
