"""Host half of the proxy relay: a unix socket per sandbox, connected to one TCP address.

    relay = open_relay(Path("/tmp/…/run/proxy.sock"), "http://127.0.0.1:8000/s/abc")
    relay.inside_url   # 'http://127.0.0.1:8000/s/abc': what code in the sandbox uses
    relay.close()

Sandboxes run with no network at all (Docker ``--network none``, bubblewrap
``--unshare-net``). The socket's folder is bind-mounted into the sandbox, where
``forwarder.py`` listens on 127.0.0.1:PORT and forwards each connection through the socket;
here each connection is joined to the proxy's host and port and to nothing else. The relay
does not read the bytes: which session a request reaches is the proxy's decision, on the
capability route the sandbox was given (``legorl.proxy.core``), so no second HTTP parser here
can disagree with the proxy's about where a request goes. All relays
of a process share one event loop in a daemon thread, so they keep working whatever the
caller's own loop is doing.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from legorl.protocols import SandboxError

FORWARDER = Path(__file__).with_name("forwarder.py")

_loop: asyncio.AbstractEventLoop | None = None
_loop_guard = threading.Lock()


_live: set[asyncio.Task[None]] = set()  # connections being relayed
_GRACE = 30.0  # seconds the other direction may go on after one has ended
#: Connections one sandbox may hold through its relay at once; one more is closed as it comes.
#: A harness holds a few (its calls, a keep-alive pool); each costs this process's open files
#: and the proxy a request body of up to its limit, which no cgroup of the sandbox's is
#: charged for (round 72: 19,500 connections took every file this process may open, and 40
#: unfinished bodies of 31 MB held 1.3 GB).
MAX_CONNECTIONS = 16


def _hub() -> asyncio.AbstractEventLoop:
    global _loop
    with _loop_guard:
        if _loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="legorl-relay", daemon=True).start()
            _loop = loop
        return _loop


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            if writer.can_write_eof():
                writer.write_eof()


def inside_port(port: int) -> int:
    """The port the forwarder listens on inside: the proxy's own, unless that needs privilege
    (below 1024; sandboxes hold no capabilities), then 10000 above it."""
    return port if port >= 1024 else 10000 + port


def split_proxy_url(url: str) -> tuple[str, int, str]:
    """(host, port, inside_url) of a proxy URL; inside it is on 127.0.0.1 (see inside_port)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise SandboxError(f"proxy_url {url!r}: expected http://HOST:PORT/…")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    inside = urlunsplit(
        (parts.scheme, f"127.0.0.1:{inside_port(port)}", parts.path, parts.query, "")
    )
    return parts.hostname, port, inside


@dataclass(slots=True)
class Relay:
    socket_path: Path
    host: str
    port: int
    inside_url: str
    _server: asyncio.AbstractServer | None = None

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:

            async def _stop() -> None:
                server.close()

            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(_stop(), _hub()).result(timeout=5)
        with contextlib.suppress(OSError):
            self.socket_path.unlink()


def open_relay(socket_path: Path, proxy_url: str) -> Relay:
    """Listen on ``socket_path`` (its folder must exist) and join connections to the proxy."""
    host, port, inside = split_proxy_url(proxy_url)
    held: set[asyncio.StreamWriter] = set()  # this relay's connections

    async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(held) >= MAX_CONNECTIONS:
            writer.close()
            return
        held.add(writer)
        try:
            await _join(reader, writer)
        finally:
            held.discard(writer)

    async def _join(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(host, port)
        except OSError:
            writer.close()
            return
        # The loop keeps only weak references to tasks: hold this connection's until it ends,
        # or a collected pending task is all that is left of it.
        me = asyncio.current_task()
        if me is not None:
            _live.add(me)
        pipes = {
            asyncio.ensure_future(_pipe(reader, up_writer)),
            asyncio.ensure_future(_pipe(up_reader, writer)),
        }
        try:
            # once one side is done, the other gets a grace period to finish what it was sending
            _, pending = await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
            if pending:
                await asyncio.wait(pending, timeout=_GRACE)
        finally:
            for w in (writer, up_writer):
                with contextlib.suppress(Exception):
                    w.close()
            for task in pipes:
                task.cancel()
            if me is not None:
                _live.discard(me)

    async def _start() -> asyncio.AbstractServer:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(socket_path)
        server = await asyncio.start_unix_server(_handle, path=str(socket_path))
        os.chmod(socket_path, 0o666)  # the sandbox's user may differ from ours
        return server

    server = asyncio.run_coroutine_threadsafe(_start(), _hub()).result(timeout=10)
    return Relay(Path(socket_path), host, port, inside, server)
