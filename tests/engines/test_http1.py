"""The vllm engine's lean HTTP/1.1 client (`engines/http1.py`) against a real socket server that
answers as scripted: keep-alive reuse, chunked bodies, a connection the server dropped while
idle, and answers it cannot read."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest
import pytest_asyncio

from legorl.engines.http1 import Http1Error, Http1Pool, supports

Answer = Callable[[int, bytes], bytes | None]  # (request number, body) -> raw answer or None


class _Server:
    def __init__(self, answer: Answer, close_after: set[int]) -> None:
        self.answer = answer
        self.close_after = close_after  # request numbers after whose answer the server closes
        self.requests: list[tuple[int, bytes, bytes]] = []  # (connection, head, body)
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        conn = self.connections
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                body = await reader.readexactly(length)
                self.requests.append((conn, head, body))
                raw = self.answer(len(self.requests), body)
                if raw is None:
                    break  # close without answering
                writer.write(raw)
                await writer.drain()
                if len(self.requests) in self.close_after:
                    break
        except asyncio.IncompleteReadError:
            pass
        finally:
            writer.close()


def _json(body: bytes, extra: str = "") -> bytes:
    return (
        f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n{extra}"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body


@pytest_asyncio.fixture
async def serve() -> AsyncIterator[Callable[[Answer], asyncio.Future[tuple[_Server, str]]]]:
    servers: list[_Server] = []

    async def make(answer: Answer, close_after: set[int] | None = None) -> tuple[_Server, str]:
        server = _Server(answer, close_after or set())
        servers.append(server)
        return server, await server.start()

    yield make  # type: ignore[misc]
    for server in servers:
        assert server.server is not None
        server.server.close()


@pytest.mark.asyncio
async def test_keep_alive_reuses_one_connection(serve: Callable) -> None:
    server, url = await serve(lambda n, body: _json(b'{"n": %d, "echo": %s}' % (n, body)))
    pool = Http1Pool(url + "/base", headers={"authorization": "Bearer k"})
    for n in (1, 2, 3):
        status, data = await pool.post("/v1/completions", b'{"x": 1}')
        assert status == 200 and data == b'{"n": %d, "echo": {"x": 1}}' % n
    assert server.connections == 1
    _conn, head, body = server.requests[0]
    assert head.startswith(b"POST /base/v1/completions HTTP/1.1\r\n")
    assert b"authorization: Bearer k\r\n" in head and body == b'{"x": 1}'
    await pool.close()


@pytest.mark.asyncio
async def test_chunked_and_connection_close_answers(serve: Callable) -> None:
    chunked = (
        b"HTTP/1.1 400 Bad Request\r\ntransfer-encoding: chunked\r\n\r\n"
        b"5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\n\r\n"
    )
    answers = {1: chunked, 2: _json(b"{}", "connection: close\r\n"), 3: _json(b"[]")}
    server, url = await serve(lambda n, body: answers[n])
    pool = Http1Pool(url)
    assert await pool.post("/a", b"{}") == (400, b"hello, world")
    assert await pool.post("/b", b"{}") == (200, b"{}")
    assert await pool.post("/c", b"{}") == (200, b"[]")
    assert server.connections == 2  # the second answer closed its connection
    await pool.close()


@pytest.mark.asyncio
async def test_a_connection_dropped_while_idle_is_replaced(serve: Callable) -> None:
    # request 2 arrives on the kept connection, which the server then closes unanswered
    # (as a server does with an idle connection it timed out): it is sent again on a fresh one
    server, url = await serve(lambda n, body: None if n == 2 else _json(b"%d" % n))
    pool = Http1Pool(url)
    assert await pool.post("/", b"{}") == (200, b"1")
    assert await pool.post("/", b"{}") == (200, b"3")
    assert [conn for conn, _head, _body in server.requests] == [1, 1, 2]
    await pool.close()


@pytest.mark.asyncio
async def test_answers_it_cannot_read_are_errors(serve: Callable) -> None:
    answers = {
        1: None,  # a fresh connection closed unanswered: not retried
        2: b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort",  # then closed mid-body
        3: b"SPDY/3 200 OK\r\ncontent-length: 0\r\n\r\n",
        4: b"HTTP/1.1 200 OK\r\ncontent-length: lots\r\n\r\n",
    }

    server, url = await serve(lambda n, body: answers[n], close_after={2})
    pool = Http1Pool(url)
    with pytest.raises(Http1Error, match="closed the connection without answering"):
        await pool.post("/", b"{}")
    for match in ("connection to the server lost", "malformed status line", "Content-Length"):
        with pytest.raises(Http1Error, match=match):
            await pool.post("/", b"{}")
    assert server.connections == 4  # nothing unreadable was kept for reuse
    await pool.close()


def test_only_plain_http_urls() -> None:
    assert supports("http://127.0.0.1:8000") and supports("http://gpu-host/v1proxy")
    assert not supports("https://gpu-host:8000") and not supports("unix:///tmp/sock")
    with pytest.raises(ValueError, match="http://host"):
        Http1Pool("https://gpu-host")
