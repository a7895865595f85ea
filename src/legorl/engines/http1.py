"""A small keep-alive HTTP/1.1 client for the ``vllm`` engine's non-streamed completions.

    pool = Http1Pool("http://127.0.0.1:8000", headers={"authorization": "Bearer …"})
    status, body = await pool.post("/v1/completions", orjson.dumps(request))
    await pool.close()

The proxy calls vLLM once per chat call. Through httpx one such call cost about 2 ms of the
proxy's CPU (connection-pool bookkeeping, the head and the body in separate writes), two thirds
of all the proxy did per call (py-spy under `python -m legorl.bench --only vllm`). This client
does only what that call needs: ``http://`` (no TLS, no proxies, no redirects), one request at a
time per connection, the request in one write, a response framed by ``Content-Length`` or
``chunked``. Idle connections are reused; one the server closed while it was idle (no byte of a
response came back) is replaced and the request sent once more on a fresh one. Everything else
(``https://`` servers, streamed completions) goes through httpx.
"""

from __future__ import annotations

import asyncio
import contextlib
from urllib.parse import urlsplit

_MAX_HEAD = 64 * 1024
_MAX_BODY = 256 * 1024 * 1024


class Http1Error(OSError):
    """The server's answer could not be read (closed early, malformed framing)."""


class _Conn:
    __slots__ = ("reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


def supports(base_url: str) -> bool:
    """Whether ``base_url`` is one this client serves (plain ``http://`` with a host)."""
    parts = urlsplit(base_url)
    return parts.scheme == "http" and bool(parts.hostname) and not parts.query


class Http1Pool:
    """Connections to one ``http://host:port`` server, opened as needed and kept alive."""

    def __init__(
        self, base_url: str, *, headers: dict[str, str] | None = None, timeout_s: float = 600.0
    ) -> None:
        parts = urlsplit(base_url)
        if not supports(base_url) or parts.hostname is None:
            raise ValueError(f"Http1Pool serves http://host[:port] URLs, not {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self.timeout_s = timeout_s
        authority = parts.netloc.rpartition("@")[2]
        fields = {"host": authority, "content-type": "application/json", **(headers or {})}
        self._fields = "".join(f"{k}: {v}\r\n" for k, v in fields.items())
        self._idle: list[_Conn] = []

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        """``POST prefix+path`` with a JSON ``body``; (status, response body)."""
        head = (
            f"POST {self.prefix}{path} HTTP/1.1\r\n{self._fields}"
            f"content-length: {len(body)}\r\n\r\n"
        ).encode("latin-1")
        async with asyncio.timeout(self.timeout_s):
            while self._idle:
                try:  # a connection the server closed while idle: try the next one
                    return await self._exchange(self._idle.pop(), head + body, reused=True)
                except _StaleConnection:
                    continue
            reader, writer = await asyncio.open_connection(self.host, self.port, limit=_MAX_HEAD)
            return await self._exchange(_Conn(reader, writer), head + body, reused=False)

    async def _exchange(self, conn: _Conn, request: bytes, *, reused: bool) -> tuple[int, bytes]:
        try:
            conn.writer.write(request)
            await conn.writer.drain()
            try:
                head = await conn.reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError as exc:
                if not exc.partial and reused:
                    raise _StaleConnection from None
                raise Http1Error("the server closed the connection without answering") from None
            except asyncio.LimitOverrunError:
                raise Http1Error(f"response head larger than {_MAX_HEAD} bytes") from None
            status, length, chunked, keep_alive = _parse_head(head)
            if chunked:
                data = await _read_chunked(conn.reader)
            elif length is not None:
                if length > _MAX_BODY:
                    raise Http1Error(f"response body of {length} bytes is too large")
                data = await conn.reader.readexactly(length)
            else:  # framed by the connection's end
                data = await conn.reader.read(_MAX_BODY)
                keep_alive = False
        except (ConnectionResetError, BrokenPipeError) as exc:
            conn.close()
            if reused:  # refused before any answer: the server had dropped it
                raise _StaleConnection from None
            raise Http1Error(f"connection to the server lost: {exc!r}") from None
        except (ConnectionError, asyncio.IncompleteReadError) as exc:
            conn.close()
            raise Http1Error(f"connection to the server lost: {exc!r}") from None
        except BaseException:
            conn.close()  # a bad answer, cancelled or timed out: its framing is unknown
            raise
        if keep_alive:
            self._idle.append(conn)
        else:
            conn.close()
        return status, data

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


class _StaleConnection(Exception):
    """A kept-alive connection the server had closed: nothing was answered on it."""


def _parse_head(head: bytes) -> tuple[int, int | None, bool, bool]:
    """(status, Content-Length, chunked, keep-alive) of a response head."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise Http1Error(f"malformed status line {lines[0][:80]!r}")
    status = int(parts[1])
    length: int | None = None
    chunked = False
    keep_alive = parts[0] == "HTTP/1.1"
    for line in lines[1:]:
        name, _, value = line.partition(":")
        key, value = name.strip().lower(), value.strip()
        if key == "content-length":
            if not value.isdigit():
                raise Http1Error(f"invalid Content-Length {value[:40]!r}")
            length = int(value)
        elif key == "transfer-encoding":
            chunked = value.lower().split(",")[-1].strip() == "chunked"
        elif key == "connection":
            tokens = {t.strip().lower() for t in value.split(",")}
            keep_alive = "close" not in tokens and (keep_alive or "keep-alive" in tokens)
    if 100 <= status < 200:
        raise Http1Error(f"unexpected interim response {status}")
    return status, None if chunked else length, chunked, keep_alive


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    out = bytearray()
    while True:
        line = await reader.readuntil(b"\r\n")
        size_text = line[:-2].split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise Http1Error(f"malformed chunk size {line[:40]!r}") from None
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":
                pass  # trailer fields
            return bytes(out)
        if len(out) + size > _MAX_BODY:
            raise Http1Error("chunked response body too large")
        out += await reader.readexactly(size)
        if await reader.readexactly(2) != b"\r\n":
            raise Http1Error("chunk data not followed by CRLF")
