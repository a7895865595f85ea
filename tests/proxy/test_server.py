"""`legorl.proxy.server` on the request side: malformed, smuggling-shaped and slow requests get
their 4xx from a real server over raw sockets on 127.0.0.1, and the serving process settings."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import orjson

from legorl.engines import make_engine
from legorl.proxy import server
from legorl.proxy.core import ProxyConfig, ProxyCore
from legorl.proxy.server import ProxyServer, ServerLimits

MODEL = Path(__file__).resolve().parents[2] / "fixtures" / "models" / "tiny-qwen3"
CHAT = "/s/srv-test/v1/chat/completions"
CHAT_BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
MAX_BODY = 4096


# ---- a real server in this event loop, and a raw HTTP client --------------------------------


@contextlib.asynccontextmanager
async def serving(**limits: Any) -> AsyncIterator[ProxyServer]:
    engine = make_engine("forced", model_path=str(MODEL), script=[{"text": "hello"}] * 64)
    core = ProxyCore(ProxyConfig(model=MODEL, max_body_bytes=MAX_BODY), engine)
    srv = ProxyServer(core, "127.0.0.1", 0, ServerLimits(**limits))
    await srv.start()
    try:
        yield srv
    finally:
        await srv.close()
        await engine.close()


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding") == "chunked":
        body = bytearray()
        while size := int((await reader.readuntil(b"\r\n"))[:-2], 16):
            body += (await reader.readexactly(size + 2))[:-2]
        await reader.readuntil(b"\r\n")
        return status, headers, bytes(body)
    return status, headers, await reader.readexactly(int(headers.get("content-length", "0")))


async def exchange(
    port: int, data: bytes, responses: int = 1, timeout: float = 20.0
) -> tuple[list[tuple[int, dict[str, str], bytes]], bool]:
    """Send ``data``; the responses read, and whether the server closed the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    got = []
    try:
        async with asyncio.timeout(timeout):
            writer.write(data)
            await writer.drain()
            for _ in range(responses):
                status, headers, body = await read_response(reader)
                got.append((status, headers, body))
                if status == 100:
                    got.pop()
                    got.append(await read_response(reader))
            # A connection the server keeps open is not waited on.
            closed = got[-1][1].get("connection") == "close" and await reader.read(1) == b""
    finally:
        writer.close()
    return got, closed


def request(
    method: str = "POST",
    path: str = CHAT,
    body: bytes = CHAT_BODY,
    headers: list[str] | None = None,
    version: str = "HTTP/1.1",
) -> bytes:
    lines = [f"{method} {path} {version}", "host: 127.0.0.1"]
    lines += headers if headers is not None else [f"content-length: {len(body)}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def chunked(body: bytes, size: int = 7) -> bytes:
    parts = [
        b"%x\r\n%b\r\n" % (len(body[i : i + size]), body[i : i + size])
        for i in range(0, len(body), size)
    ]
    return b"".join(parts) + b"0\r\n\r\n"


def run(test: Callable[[ProxyServer], Coroutine[Any, Any, None]], **limits: Any) -> None:
    async def go() -> None:
        async with serving(**limits) as srv:
            await test(srv)

    asyncio.run(go())


async def rejected(
    srv: ProxyServer, data: bytes, status: int, *, api_shaped: bool = True
) -> dict[str, Any] | bytes:
    [(got, headers, body)], closed = await exchange(srv.port, data)
    assert got == status, body
    assert closed and headers["connection"] == "close"
    if api_shaped:
        assert headers["content-type"] == "application/json"
        return orjson.loads(body)["error"]
    assert headers["content-type"] == "text/plain"
    return body


# ---- framing ----------------------------------------------------------------------------------


def test_a_bad_content_length_gets_400_in_the_apis_error_shape() -> None:
    async def t(srv: ProxyServer) -> None:
        for bad in ["-1", "+5", "5 5", "0x10", "1.5", "", "9" * 25, "5, 6"]:
            error = await rejected(srv, request(headers=[f"content-length: {bad}"]), 400)
            assert "Content-Length" in error["message"]  # type: ignore[index]
        anthropic = request(path="/s/x/v1/messages", headers=["content-length: -1"])
        error = await rejected(srv, anthropic, 400)
        assert isinstance(error, dict) and error["type"] == "invalid_request_error"

    run(t)


def test_duplicate_framing_and_identity_headers() -> None:
    async def t(srv: ProxyServer) -> None:
        n = len(CHAT_BODY)
        two_lengths = [f"content-length: {n}", f"content-length: {n + 1}"]
        await rejected(srv, request(headers=two_lengths), 400)
        two_keys = [f"content-length: {n}", "authorization: Bearer a", "authorization: Bearer b"]
        await rejected(srv, request(headers=two_keys), 400)
        await rejected(srv, request(headers=[f"content-length: {n}", "host: evil"]), 400)
        # The same length twice is one length (RFC 9110 8.6).
        [(status, _, _)], _ = await exchange(
            srv.port, request(headers=[f"content-length: {n}", f"content-length: {n}"])
        )
        assert status == 200

    run(t)


def test_smuggling_shapes_are_refused_and_the_connection_closed() -> None:
    async def t(srv: ProxyServer) -> None:
        smuggled = b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n"
        cl_te = request(
            headers=["content-length: 5", "transfer-encoding: chunked"], body=b"0\r\n\r\n"
        )
        await rejected(srv, cl_te + smuggled, 400)  # one answer, then closed: nothing smuggled
        te_cl = request(headers=["transfer-encoding: chunked", "content-length: 5"])
        await rejected(srv, te_cl + smuggled, 400)
        for codings, status in [
            ("gzip, chunked", 501),
            ("chunked, gzip", 400),
            ("xchunked", 400),
            ("chunkedx", 400),
            ("identity", 400),
        ]:
            data = request(headers=[f"transfer-encoding: {codings}"], body=chunked(CHAT_BODY))
            await rejected(srv, data, status)
        http10 = request(headers=["transfer-encoding: chunked"], version="HTTP/1.0")
        await rejected(srv, http10 + chunked(CHAT_BODY), 400)

    run(t)


def test_chunk_sizes_are_strict_hex_and_bounded() -> None:
    async def t(srv: ProxyServer) -> None:
        te = ["transfer-encoding: chunked"]
        for size_line in [b"zz", b"-1", b"0x10", b" 5", b"1" * 17, b"", b"5;\x00ext"]:
            await rejected(
                srv, request(headers=te, body=size_line + b"\r\nhello\r\n0\r\n\r\n"), 400
            )
        await rejected(srv, request(headers=te, body=b"5;" + b"e" * 2000 + b"\r\n"), 400)
        await rejected(srv, request(headers=te, body=b"5\r\nhelloXY0\r\n\r\n"), 400)
        await rejected(srv, request(headers=te, body=b"0\r\nbad trailer\r\n\r\n"), 400)
        trailers = b"".join(b"x-t%d: %s\r\n" % (i, b"v" * 100) for i in range(100))
        await rejected(srv, request(headers=te, body=b"0\r\n" + trailers + b"\r\n"), 431)
        # Extensions and trailers within bounds are fine.
        body = chunked(CHAT_BODY).replace(b"\r\n", b";name=value\r\n", 1)[:-2]
        [(status, _, _)], _ = await exchange(
            srv.port, request(headers=te, body=body + b"x-trailer: 1\r\n\r\n")
        )
        assert status == 200

    run(t)


def test_one_chunk_over_the_limit_is_refused_before_its_data_is_read() -> None:
    async def t(srv: ProxyServer) -> None:
        # Only the size line is sent: an answer proves the server did not wait for the data.
        data = request(headers=["transfer-encoding: chunked"], body=b"%x\r\n" % (MAX_BODY + 1))
        error = await rejected(srv, data, 413)
        assert isinstance(error, dict) and "exceeds the limit" in error["message"]
        # Several chunks that together pass the limit: refused at the one that would cross it.
        body = b"800\r\n" + b"a" * 0x800 + b"\r\n" + b"801\r\n"
        await rejected(srv, request(headers=["transfer-encoding: chunked"], body=body), 413)
        big = request(headers=[f"content-length: {MAX_BODY + 1}"], body=b"")
        await rejected(srv, big, 413)

    run(t)


# ---- the head ---------------------------------------------------------------------------------


def test_malformed_heads_get_400_and_bounded_ones_414_or_431() -> None:
    async def t(srv: ProxyServer) -> None:
        n = len(CHAT_BODY)
        folded = request(headers=[f"content-length: {n}", "x-a: 1", " folded"])
        await rejected(srv, folded, 400)
        await rejected(srv, request(headers=[f"content-length : {n}"]), 400)
        await rejected(srv, request(headers=[f"content-length: {n}", "x-a: a\x01b"]), 400)
        await rejected(srv, request(headers=[f"content-length: {n}", "no colon"]), 400)
        for line in [b"GET", b"GET  / HTTP/1.1", b"GET / HTTP/1.1 x", b"G\x00T / HTTP/1.1"]:
            await rejected(srv, line + b"\r\nhost: x\r\n\r\n", 400, api_shaped=False)
        await rejected(srv, b"GET healthz HTTP/1.1\r\n\r\n", 400, api_shaped=False)
        await rejected(srv, b"GET / HTTP/2.0\r\n\r\n", 505, api_shaped=False)
        await rejected(srv, b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n", 414, api_shaped=False)
        many = request(headers=[f"x-h{i}: 1" for i in range(200)], body=b"")
        await rejected(srv, many, 431)
        huge = request(headers=[f"x-h: {'a' * 70000}"], body=b"")
        await rejected(srv, huge, 431, api_shaped=False)
        expect = request(headers=[f"content-length: {n}", "expect: 200-ok"])
        await rejected(srv, expect, 417)

    run(t)


def test_keep_alive_follows_the_version_and_connection_tokens() -> None:
    async def t(srv: ProxyServer) -> None:
        get10 = b"GET /healthz HTTP/1.0\r\n\r\n"
        [(status, headers, _)], closed = await exchange(srv.port, get10)
        assert status == 200 and closed and headers["connection"] == "close"
        keep10 = b"GET /healthz HTTP/1.0\r\nconnection: Keep-Alive\r\n\r\n"
        got, closed = await exchange(srv.port, keep10 * 2 + get10, responses=3)
        assert [g[1]["connection"] for g in got] == ["keep-alive", "keep-alive", "close"]
        assert closed
        get11 = b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n"
        close11 = b"GET /healthz HTTP/1.1\r\nconnection: te, Close\r\n\r\n"
        got, closed = await exchange(srv.port, get11 + close11, responses=2)
        assert [g[1]["connection"] for g in got] == ["keep-alive", "close"] and closed
        # Pipelined, with a chunked body and Expect, all on one connection.
        te = ["transfer-encoding: chunked", "expect: 100-continue"]
        batch = get11 + request(headers=te, body=chunked(CHAT_BODY)) + get11
        got, closed = await exchange(srv.port, batch, responses=3)
        assert [g[0] for g in got] == [200, 200, 200] and not closed
        assert b"hello" in got[1][2]

    run(t)


# ---- waits ------------------------------------------------------------------------------------


def test_slow_heads_and_bodies_get_408_and_idle_connections_close() -> None:
    async def t(srv: ProxyServer) -> None:
        head = b"POST " + CHAT.encode() + b" HTTP/1.1\r\nhost: x\r\n"
        await rejected(srv, head, 408, api_shaped=False)  # the head never ends
        slow_body = request(headers=[f"content-length: {len(CHAT_BODY)}"], body=CHAT_BODY[:5])
        error = await rejected(srv, slow_body, 408)
        assert isinstance(error, dict) and "body" in error["message"]
        # Idle after a full exchange: closed without a response.
        reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
        writer.write(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        async with asyncio.timeout(20):
            status, headers, _ = await read_response(reader)
            assert status == 200 and headers["connection"] == "keep-alive"
            assert await reader.read(1) == b""
        writer.close()

    run(t, header_s=0.3, body_s=0.3, idle_s=0.3)


async def _slowloris(srv: ProxyServer, n: int) -> tuple[int, int]:
    """Open ``n`` connections that never finish their head; then one normal request. The most
    connections the server held at once, and the normal request's status."""
    slow = []
    peak = 0
    for _ in range(n):
        slow.append(await asyncio.open_connection("127.0.0.1", srv.port))
        slow[-1][1].write(b"POST " + CHAT.encode() + b" HTTP/1.1\r\nhost: x\r\nx-slow: ")
        await asyncio.sleep(0)
        peak = max(peak, srv.connections)
    await asyncio.sleep(0.2)
    peak = max(peak, srv.connections)
    got, _ = await exchange(srv.port, request(), timeout=20)
    peak = max(peak, srv.stats["connections_peak"])
    for _, writer in slow:
        writer.close()
    return peak, got[0][0]


def test_slow_clients_cannot_hold_more_than_the_connection_cap() -> None:
    async def t(srv: ProxyServer) -> None:
        peak, status = await _slowloris(srv, 60)
        assert status == 200  # the normal client displaced the longest waiter
        assert peak <= 16 and srv.stats["displaced"] >= 60 - 16

    run(t, max_connections=16)


def test_control_without_the_cap_slow_clients_pile_up() -> None:
    async def t(srv: ProxyServer) -> None:
        peak, status = await _slowloris(srv, 60)
        assert status == 200 and peak >= 60

    run(t, max_connections=100_000)


# ---- process settings -------------------------------------------------------------------------


def test_serving_processes_tune_the_garbage_collector() -> None:
    # In a fresh interpreter: the library leaves the collector alone, the serving helper tunes it.
    code = (
        "import gc; from legorl.proxy import server; before = gc.get_threshold()[0]; "
        "server.tune_gc_for_serving(); "
        "print(before, gc.get_threshold()[0], gc.get_freeze_count() > 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    before, after, frozen = out.stdout.split()
    assert int(before) == 700  # CPython's default, untouched by importing the proxy
    assert int(after) == server.GC_YOUNG_THRESHOLD and frozen == "True"
