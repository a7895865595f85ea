"""A small HTTP/1.1 server on asyncio streams in front of `ProxyCore` (`legorl proxy serve`).

Keep-alive, Content-Length and chunked request bodies, `Expect: 100-continue`, and chunked
streaming responses (SSE) written as the engine samples. It does only what LLM clients need, so
the proxy's CPU per call goes to tokens, not to HTTP: see `nox -s bench` for the measured cost
beside mitmproxy's reverse mode.

Sandboxed code reaches this server (through the relay), so requests are parsed strictly, after
RFC 9112: every malformed request gets a 4xx (501/505 for what is well-formed but unsupported),
in the API's error shape once the path is known, and the connection closes whenever its framing
cannot be trusted (both or conflicting lengths, a transfer coding other than ``chunked``, a bad
chunk). Every part of a request is bounded before it is read: request line, header count and
size, chunk lines, trailers, the body; and so is every wait: the next request on an idle
connection, its head, its body. Connections are capped; at the cap a new one displaces the
connection that has waited longest for its client, so slow clients cannot crowd out the others.
A call whose client has gone (its connection read to the end while the server works) is ended,
so calls a client sent and left do not stay queued behind their session's.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import re
import resource
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from legorl.proxy.chat import ApiError
from legorl.proxy.core import ProxyCore, Response

_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    411: "Length Required",
    413: "Payload Too Large",
    414: "URI Too Long",
    417: "Expectation Failed",
    429: "Too Many Requests",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    501: "Not Implemented",
    503: "Service Unavailable",
    505: "HTTP Version Not Supported",
}
MAX_HEADER_BYTES = 64 * 1024  # the whole request head, and the stream reader's buffer limit
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


@dataclass(slots=True, kw_only=True)
class ServerLimits:
    """Bounds on what one client may make the server hold; defaults fit LLM harnesses."""

    max_connections: int = 1024  # lowered to what the process's open-file limit allows
    request_line_bytes: int = 8 * 1024  # 414 beyond
    header_count: int = 128  # 431 beyond; MAX_HEADER_BYTES bounds the head's size
    chunk_line_bytes: int = 1024  # a chunk's size line with its extensions; 400 beyond
    trailer_bytes: int = 8 * 1024  # 431 beyond
    idle_s: float = 120.0  # keep-alive: the wait for a request's first byte (announced)
    header_s: float = 30.0  # from a request's first byte to the end of its head; 408 after
    body_s: float = 300.0  # for the whole body; 408 after


class _Reject(Exception):
    """A request answered with ``status``; the connection is closed after it."""

    def __init__(self, status: int, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.path = path  # known: answered in that API's error shape


_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_TARGET = re.compile(rb"[\x21-\x7e]+")
_FIELD_VALUE = re.compile(rb"[^\x00-\x08\x0a-\x1f\x7f]*")  # no CTL but HTAB; no CR, LF, NUL
_CONTROL = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")  # CTL but HTAB, CR, LF
_FIELDS = re.compile(rb"(?:\r\n[!#$%&'*+\-.^_`|~0-9A-Za-z]+:[^\r\n]*)*")
_VERSION = re.compile(rb"HTTP/(\d)\.(\d)")
_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")
_DIGITS = re.compile(r"[0-9]{1,19}")
_ABSOLUTE = re.compile(r"https?://[^/?#]*", re.IGNORECASE)
# Fields that may appear once: a second copy with another value is an ambiguity an attacker
# could aim at one reader or another (the session key, the framing).
_SINGLE = frozenset(
    {
        "host",
        "authorization",
        "x-api-key",
        "x-goog-api-key",
        "content-type",
        "expect",
        "content-length",
    }
)


@dataclass(slots=True)
class _Conn:
    """One connection: what it waits for since when (the sweeper's and the cap's view)."""

    task: asyncio.Task[None]
    reader: asyncio.StreamReader | None = None
    # idle | head | body: waiting for the client; busy: the server works; closing: after a 4xx
    phase: str = "idle"
    since: float = 0.0
    path: str | None = None  # once the head is read: a late body is answered in its API's shape
    expired: str | None = None  # the wait that ran out, "displaced", or "gone" (the client)


@dataclass(slots=True)
class _Request:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    version: int  # minor version: 0 or 1
    keep_alive: bool
    length: int | None  # Content-Length; None when chunked or absent
    chunked: bool


def _tokens(value: str) -> list[str]:
    return [t.strip().lower() for t in value.split(",") if t.strip()]


def parse_head(head: bytes, limits: ServerLimits) -> _Request:
    """The request in ``head`` (request line and fields, CRLF-terminated); _Reject otherwise."""
    while head.startswith(b"\r\n"):  # RFC 9112 2.2: empty lines before a request line
        head = head[2:]
    end = head.find(b"\r\n")
    line, rest = (head, b"") if end < 0 else (head[:end], head[end:])
    if not line:
        raise _Reject(400, "empty request")
    if len(line) > limits.request_line_bytes:
        raise _Reject(414, f"request line longer than {limits.request_line_bytes} bytes")
    parts = line.split(b" ")
    if len(parts) != 3 or not _TOKEN.fullmatch(parts[0]) or not _TARGET.fullmatch(parts[1]):
        raise _Reject(400, f"malformed request line {line[:80]!r}")
    version = _VERSION.fullmatch(parts[2])
    if version is None:
        raise _Reject(400, f"malformed request line {line[:80]!r}")
    if version.group(1) != b"1" or version.group(2) not in (b"0", b"1"):
        raise _Reject(505, f"HTTP version {parts[2].decode()} is not supported")
    target = parts[1].decode("ascii")
    if not target.startswith("/"):
        absolute = _ABSOLUTE.match(target)
        if absolute is None:
            raise _Reject(400, f"request target {target[:80]!r} is not a path")
        target = target[absolute.end() :] or "/"
    path, _, query = target.partition("?")
    crlf = rest.count(b"\r\n")  # one per field
    if crlf > limits.header_count:
        raise _Reject(431, f"more than {limits.header_count} header fields", path)
    if _CONTROL.search(rest) or rest.count(b"\r") != crlf or rest.count(b"\n") != crlf:
        raise _Reject(400, "control character in a header field", path)
    if not _FIELDS.fullmatch(rest):
        # A line without a colon, one folded onto the previous (obs-fold), space before a colon.
        bad = next(f for f in rest.split(b"\r\n")[1:] if not _FIELDS.fullmatch(b"\r\n" + f))
        raise _Reject(400, f"malformed header line {bad[:80]!r}", path)
    headers: dict[str, str] = {}
    for field in rest.decode("latin-1").split("\r\n")[1:]:
        name, _, value = field.partition(":")
        key = name.lower()
        text = value.strip(" \t")
        if key in headers:
            if key in _SINGLE and headers[key] != text:
                raise _Reject(400, f"conflicting {key} headers", path)
            if key not in _SINGLE:
                text = f"{headers[key]}, {text}"  # RFC 9110 5.3: a list, in order
        headers[key] = text
    minor = int(version.group(2))
    connection = _tokens(headers.get("connection", ""))
    keep_alive = "keep-alive" in connection if minor == 0 else "close" not in connection
    length: int | None = None
    chunked = False
    if "transfer-encoding" in headers:
        codings = _tokens(headers["transfer-encoding"])
        if "content-length" in headers:
            raise _Reject(400, "both Content-Length and Transfer-Encoding", path)
        if minor == 0:
            raise _Reject(400, "Transfer-Encoding in an HTTP/1.0 request", path)
        if not codings or codings[-1] != "chunked":
            raise _Reject(400, "Transfer-Encoding must end with chunked", path)
        if codings != ["chunked"]:
            raise _Reject(501, f"transfer coding {codings[0][:40]!r} is not supported", path)
        chunked = True
    elif "content-length" in headers:
        values = set(_tokens(headers["content-length"]))
        if len(values) != 1 or not _DIGITS.fullmatch(raw := values.pop()):
            raise _Reject(400, f"invalid Content-Length {headers['content-length'][:40]!r}", path)
        length = int(raw)
    return _Request(
        parts[0].decode("ascii").upper(), path, query, headers, minor, keep_alive, length, chunked
    )


class ProxyServer:
    """Serves one ProxyCore on host:port until ``close``."""

    def __init__(
        self,
        core: ProxyCore,
        host: str = "127.0.0.1",
        port: int = 0,
        limits: ServerLimits | None = None,
    ) -> None:
        self.core = core
        self.host = host
        self.port = port
        self.limits = limits = limits or ServerLimits()
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and limits.max_connections > soft - 64:
            self.limits = replace(limits, max_connections=max(1, soft - 64))
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._connections: dict[asyncio.Task[None], _Conn] = {}
        self.stats = {
            "connections_peak": 0,
            "displaced": 0,
            "refused": 0,
            "rejected": 0,
            "gone": 0,
        }

    @property
    def connections(self) -> int:
        return len(self._connections)

    async def start(self) -> int:
        self._server = await asyncio.start_server(
            self._serve, self.host, self.port, limit=MAX_HEADER_BYTES, backlog=1024
        )
        self.port = self._server.sockets[0].getsockname()[1]
        self._sweeper = asyncio.ensure_future(self._sweep())
        return self.port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
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

    # ---- waits: one sweeper for all connections, cheaper per call than a timer per read ------

    async def _sweep(self) -> None:
        waits = {
            "idle": self.limits.idle_s,
            "head": self.limits.header_s,
            "body": self.limits.body_s,
        }
        every = max(0.02, min(1.0, min(waits.values()) / 4))
        while True:
            await asyncio.sleep(every)
            now = time.monotonic()
            for conn in list(self._connections.values()):
                if conn.expired is not None:
                    continue
                wait = waits.get(conn.phase)
                if wait is not None and now - conn.since > wait:
                    conn.expired = conn.phase
                    conn.task.cancel()
                elif conn.phase == "busy" and conn.reader is not None and conn.reader.at_eof():
                    # The client closed (or half-closed) its side while its call runs: nobody
                    # reads the answer, so the call ends, lock and engine request with it.
                    conn.expired = "gone"
                    self.stats["gone"] += 1
                    conn.task.cancel()

    def _admit(self, task: asyncio.Task[None], reader: asyncio.StreamReader) -> _Conn | None:
        if len(self._connections) >= self.limits.max_connections:
            waiting = [c for c in self._connections.values() if c.phase != "busy" and not c.expired]
            if not waiting:
                return None
            oldest = min(waiting, key=lambda c: c.since)
            oldest.expired = "displaced"
            oldest.task.cancel()
            del self._connections[oldest.task]
            self.stats["displaced"] += 1
        conn = self._connections[task] = _Conn(task, reader, since=time.monotonic())
        self.stats["connections_peak"] = max(self.stats["connections_peak"], len(self._connections))
        task.add_done_callback(lambda t: self._connections.pop(t, None))
        return conn

    # ---- one connection -----------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        conn = self._admit(task, reader)
        try:
            if conn is None:
                self.stats["refused"] += 1
                await self._plain(writer, 503, b"too many connections")
                return
            await self._requests(conn, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        except asyncio.CancelledError:
            if conn is None or conn.expired not in ("head", "body"):
                return  # idle, displaced, gone, or the server closing: closed without an answer
            task.uncancel()
            rej = _Reject(408, f"request {conn.expired} not received in time", conn.path)
            writer.write(self._frame(self._rejection(rej), False))  # sent by close()
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    def _rejection(self, rej: _Reject) -> Response:
        if rej.path is None:
            return Response(rej.status, rej.message.encode(), content_type="text/plain")
        kind = _KIND.get(rej.status, "invalid_request_error")
        return self.core.error_response(rej.path, ApiError(rej.status, rej.message, kind=kind))

    async def _requests(
        self, conn: _Conn, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        while True:
            conn.phase, conn.since, conn.path = "idle", time.monotonic(), None
            first = await reader.readexactly(1)
            conn.phase, conn.since = "head", time.monotonic()
            try:
                req, body = await self._read_request(conn, first, reader, writer)
            except _Reject as rej:
                conn.phase = "busy"
                self.stats["rejected"] += 1
                await self._write(writer, self._rejection(rej), False)
                conn.phase = "closing"
                await _linger(reader, writer)
                return
            conn.phase = "busy"
            response = await self.core.handle(req.method, req.path, req.query, req.headers, body)
            if not await self._write(writer, response, req.keep_alive) or not req.keep_alive:
                return

    async def _read_request(
        self,
        conn: _Conn,
        first: bytes,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> tuple[_Request, bytes]:
        limits = self.limits
        try:
            head = first + await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            raise _Reject(431, f"request head larger than {MAX_HEADER_BYTES} bytes") from None
        except asyncio.IncompleteReadError:
            raise ConnectionError from None
        req = parse_head(head[:-4], limits)
        conn.phase, conn.since, conn.path = "body", time.monotonic(), req.path
        max_body = self.core.config.max_body_bytes
        if req.length is not None and req.length > max_body:
            raise _Reject(
                413, f"request body of {req.length} bytes exceeds the limit of {max_body}", req.path
            )
        expect = req.headers.get("expect")
        if expect is not None:
            if expect.lower() != "100-continue":
                raise _Reject(417, f"unsupported expectation {expect[:40]!r}", req.path)
            if req.version == 1:
                writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        if req.chunked:
            body = await _read_chunked(reader, max_body, limits, req.path)
        else:
            body = await reader.readexactly(req.length) if req.length else b""
        return req, body

    async def _plain(self, writer: asyncio.StreamWriter, status: int, text: bytes) -> None:
        await self._write(writer, Response(status, text, content_type="text/plain"), False)

    def _frame(self, response: Response, keep_alive: bool) -> bytes:
        """The status line and header fields (and a bytes body) of ``response``."""
        head = [
            f"HTTP/1.1 {response.status} {_REASONS.get(response.status, 'Status')}",
            f"content-type: {response.content_type}",
            f"connection: {'keep-alive' if keep_alive else 'close'}",
        ]
        if keep_alive:
            head.append(f"keep-alive: timeout={int(self.limits.idle_s)}")
        head += [f"{k}: {v}" for k, v in response.headers.items()]
        body = response.body
        if isinstance(body, bytes):
            head.append(f"content-length: {len(body)}")
            return ("\r\n".join(head) + "\r\n\r\n").encode() + body
        head.append("transfer-encoding: chunked")
        return ("\r\n".join(head) + "\r\n\r\n").encode()

    async def _write(
        self, writer: asyncio.StreamWriter, response: Response, keep_alive: bool
    ) -> bool:
        """Send a response; False when the client went away."""
        writer.write(self._frame(response, keep_alive))
        if isinstance(response.body, bytes):
            try:
                await writer.drain()
            except ConnectionError:
                return False
            return True
        return await _write_chunks(writer, response.body)


_LINGER_S, _LINGER_BYTES = 0.5, 1 << 20
_KIND = {413: "request_too_large", 408: "timeout_error", 501: "not_implemented_error"}


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


async def _linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Half-close, then drop what the client still sends for a moment: closing with unread
    input would reset the connection and could destroy the answer before the client reads it."""
    with contextlib.suppress(OSError, RuntimeError):
        writer.write_eof()
    with contextlib.suppress(TimeoutError, ConnectionError):
        async with asyncio.timeout(_LINGER_S):
            left = _LINGER_BYTES
            while left > 0 and (data := await reader.read(min(left, 65536))):
                left -= len(data)


async def _read_line(reader: asyncio.StreamReader, limit: int, what: str, path: str) -> bytes:
    """One CRLF-terminated line of at most ``limit`` bytes, without its CRLF."""
    try:
        line = await reader.readuntil(b"\r\n")
    except asyncio.LimitOverrunError:
        raise _Reject(400, f"{what} longer than {limit} bytes", path) from None
    if len(line) - 2 > limit:
        raise _Reject(400, f"{what} longer than {limit} bytes", path)
    return line[:-2]


async def _read_chunked(
    reader: asyncio.StreamReader, max_body: int, limits: ServerLimits, path: str
) -> bytes:
    out = bytearray()
    while True:
        line = await _read_line(reader, limits.chunk_line_bytes, "chunk size line", path)
        size_text, _, extensions = line.partition(b";")
        size_text = size_text.rstrip(b" \t")
        if not _HEX.fullmatch(size_text) or not _FIELD_VALUE.fullmatch(extensions):
            raise _Reject(400, f"malformed chunk size line {line[:40]!r}", path)
        size = int(size_text, 16)
        if size == 0:
            break
        if len(out) + size > max_body:  # before reading it
            raise _Reject(
                413,
                f"request body of {len(out) + size}+ bytes exceeds the limit of {max_body}",
                path,
            )
        out += await reader.readexactly(size)
        if await reader.readexactly(2) != b"\r\n":
            raise _Reject(400, "chunk data not followed by CRLF", path)
    trailers = 0
    while line := await _read_line(reader, limits.trailer_bytes, "trailer field", path):
        trailers += len(line) + 2
        name, sep, value = line.partition(b":")
        if not sep or not _TOKEN.fullmatch(name) or not _FIELD_VALUE.fullmatch(value):
            raise _Reject(400, f"malformed trailer field {line[:40]!r}", path)
        if trailers > limits.trailer_bytes:
            raise _Reject(431, f"trailer fields larger than {limits.trailer_bytes} bytes", path)
    return bytes(out)
