"""A small HTTP/1.1 server on asyncio streams in front of `ProxyCore` (`legorl proxy serve`).

Keep-alive, Content-Length and chunked request bodies, `Expect: 100-continue`, and chunked
streaming responses (SSE) written as the engine samples. It does only what LLM clients need, so
the proxy's CPU per call goes to tokens, not to HTTP: see `nox -s bench` for the measured cost
beside mitmproxy's reverse mode.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import AsyncIterator

from legorl.proxy.chat import ApiError
from legorl.proxy.core import ProxyCore, Response

_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    413: "Payload Too Large",
    429: "Too Many Requests",
    500: "Internal Server Error",
    503: "Service Unavailable",
}
MAX_HEADER_BYTES = 64 * 1024
# Allocations between young-generation collections in a serving process (CPython's default: 700).
GC_YOUNG_THRESHOLD = 200_000


def tune_gc_for_serving() -> None:
    """Tune the cyclic garbage collector for a process whose job is to serve the proxy.

    Every call parses a request body of tens of KB into short-lived containers, freed by
    reference counting; with the default threshold the collector still runs every few calls
    and walks everything alive, which with dozens of sessions in flight costs more CPU than the
    proxy's own work (`nox -s bench`, the 50 ms engine at 64 sessions). Objects built at start
    (tokenizer, template, caches) are frozen out of the collector's walks, and young collections
    run every ``GC_YOUNG_THRESHOLD`` allocations. Called by `legorl proxy serve` and `intercept`
    before serving, not by the library: a process that embeds the proxy keeps its own settings.
    """
    gc.collect()
    gc.freeze()
    _, second, third = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, second, third)


class _BadRequest(Exception):
    pass


class ProxyServer:
    """Serves one ProxyCore on host:port until ``close``."""

    def __init__(self, core: ProxyCore, host: str = "127.0.0.1", port: int = 0) -> None:
        self.core = core
        self.host = host
        self.port = port
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        self._server = await asyncio.start_server(
            self._serve, self.host, self.port, limit=MAX_HEADER_BYTES, backlog=1024
        )
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for task in list(self._connections):
                task.cancel()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)

    async def serve_forever(self) -> None:
        if self._server is None:
            await self.start()
        assert self._server is not None
        async with self._server:
            await self._server.serve_forever()

    # ---- one connection -----------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                except asyncio.LimitOverrunError:
                    await self._plain(writer, 431, b"request headers too large")
                    return
                try:
                    method, target, headers = _parse_head(head)
                except _BadRequest as exc:
                    await self._plain(writer, 400, str(exc).encode())
                    return
                path, _, query = target.partition("?")
                keep_alive = headers.get("connection", "").lower() != "close"
                length = headers.get("content-length")
                chunked = "chunked" in headers.get("transfer-encoding", "").lower()
                if length is not None and int(length) > self.core.config.max_body_bytes:
                    err = ApiError(
                        413,
                        f"request body of {length} bytes exceeds the limit of "
                        f"{self.core.config.max_body_bytes}",
                        kind="request_too_large",
                    )
                    await self._write(writer, self.core.error_response(path, err), False)
                    return
                if headers.get("expect", "").lower() == "100-continue":
                    writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                if chunked:
                    body = await _read_chunked(reader, self.core.config.max_body_bytes + 1)
                else:
                    body = await reader.readexactly(int(length)) if length else b""
                response = await self.core.handle(method, path, query, headers, body)
                if not await self._write(writer, response, keep_alive) or not keep_alive:
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    async def _plain(self, writer: asyncio.StreamWriter, status: int, text: bytes) -> None:
        await self._write(writer, Response(status, text, content_type="text/plain"), False)

    async def _write(
        self, writer: asyncio.StreamWriter, response: Response, keep_alive: bool
    ) -> bool:
        """Send a response; False when the client went away."""
        head = [
            f"HTTP/1.1 {response.status} {_REASONS.get(response.status, 'Status')}",
            f"content-type: {response.content_type}",
            f"connection: {'keep-alive' if keep_alive else 'close'}",
        ]
        head += [f"{k}: {v}" for k, v in response.headers.items()]
        body = response.body
        if isinstance(body, bytes):
            head.append(f"content-length: {len(body)}")
            writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
            try:
                await writer.drain()
            except ConnectionError:
                return False
            return True
        head.append("transfer-encoding: chunked")
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode())
        return await _write_chunks(writer, body)


async def _write_chunks(writer: asyncio.StreamWriter, chunks: AsyncIterator[bytes]) -> bool:
    try:
        async for chunk in chunks:
            if chunk:
                writer.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
                await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True
    except ConnectionError:
        return False
    finally:
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()


def _parse_head(head: bytes) -> tuple[str, str, dict[str, str]]:
    try:
        text = head.decode("latin-1")
    except UnicodeDecodeError:  # pragma: no cover - latin-1 decodes every byte
        raise _BadRequest("undecodable request head") from None
    lines = text.split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise _BadRequest(f"malformed request line {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise _BadRequest(f"malformed header line {line[:80]!r}")
        headers[name.strip().lower()] = value.strip()
    return parts[0].upper(), parts[1], headers


async def _read_chunked(reader: asyncio.StreamReader, limit: int) -> bytes:
    out = bytearray()
    while True:
        size_line = await reader.readuntil(b"\r\n")
        size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
        if size == 0:
            while (await reader.readuntil(b"\r\n")) != b"\r\n":
                pass  # trailers
            return bytes(out)
        out += await reader.readexactly(size)
        await reader.readexactly(2)
        if len(out) > limit:
            return bytes(out)  # the core answers 413
