"""Fuzzing `legorl.proxy.server`: over 10,000 malformed or hostile requests, generated from a
seeded corpus of every way a request can break (request line, fields, lengths, transfer codings,
chunks, trailers, bounds, garbage), sent over raw sockets on 127.0.0.1 to a real server. Each
gets the status its class calls for, nothing is left unhandled in the server, valid requests
pipelined between them are answered, and a correct call is answered correctly afterwards."""

from __future__ import annotations

import asyncio
import random
import re
import string
from collections.abc import Callable
from typing import Any

import orjson
from test_server import CHAT, CHAT_BODY, MAX_BODY, chunked, read_response, request, serving

CASES = 10_500
WORKERS = 16
SEED = 20261201
TOKEN = string.ascii_letters + string.digits + "!#$%&'*+-.^_`|~"
NOT_TOKEN = '"(),/;<=>?@[\\]{} \t\x7f\x80\xff'  # not ":": it would end the name
CTL = "".join(chr(c) for c in [*range(0, 9), *range(11, 13), *range(14, 32), 127])
GET = b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n"
Case = tuple[bytes, set[int]]


def _word(rng: random.Random, alphabet: str, lo: int = 1, hi: int = 12) -> str:
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(lo, hi)))


def _insert(rng: random.Random, text: str, what: str) -> str:
    at = rng.randint(0, len(text))
    return text[:at] + what + text[at:]


def _bad_request_line(rng: random.Random) -> Case:
    kind = rng.randrange(5)
    method, target = rng.choice(["GET", "POST", "HEAD"]), rng.choice(["/", CHAT, "/healthz"])
    if kind == 0:  # a NUL or other control byte anywhere in the line
        line = _insert(rng, f"{method} {target} HTTP/1.1", rng.choice(CTL))
        return line.encode("latin-1") + b"\r\n\r\n", {400}
    if kind == 1:  # too few or too many parts
        parts = [method, target, "HTTP/1.1", _word(rng, TOKEN)][: rng.choice([1, 2, 4])]
        return " ".join(parts).encode() + b"\r\n\r\n", {400}
    if kind == 2:
        version = rng.choice(
            ["HTTP/1", "HTTP/1.", "HTTP/11", "http/1.1", "HTTPS/1.1", "HTTP/1.x", "HTTP/a.b", ""]
        )
        return f"{method} {target} {version}\r\n\r\n".encode(), {400}
    if kind == 3:
        version = rng.choice(["HTTP/2.0", "HTTP/0.9", "HTTP/1.2", "HTTP/3.1", "HTTP/9.9"])
        return f"{method} {target} {version}\r\n\r\n".encode(), {505}
    target = rng.choice(["*", "abc", "ftp://x/y", "healthz", "?a=1", _word(rng, TOKEN)])
    return f"{method} {target} HTTP/1.1\r\n\r\n".encode(), {400}


def _bad_field(rng: random.Random) -> Case:
    kind = rng.randrange(5)
    name, value = _word(rng, string.ascii_letters + "-"), _word(rng, string.ascii_letters, 0)
    if kind == 0:
        line = _word(rng, TOKEN)  # no colon
    elif kind == 1:
        line = rng.choice(" \t") + f"{name}: {value}"  # obs-fold
    elif kind == 2:
        line = f"{name}{rng.choice([' ', chr(9), '  '])}: {value}"  # whitespace before the colon
    elif kind == 3:
        line = f"{_insert(rng, name, rng.choice(NOT_TOKEN))}: {value}"
    else:
        line = f"{name}: {_insert(rng, value, rng.choice(CTL))}"
    fields = [f"content-length: {len(CHAT_BODY)}", "x-before: 1"]
    fields.insert(rng.randint(0, 2), line)
    return request(headers=fields), {400}


def _valid_length(text: str) -> bool:
    values = {t.strip() for t in text.split(",") if t.strip()}
    return len(values) == 1 and re.fullmatch(r"[0-9]{1,19}", values.pop()) is not None


def _bad_length(rng: random.Random) -> Case:
    n = len(CHAT_BODY)
    while True:
        text = rng.choice(
            [
                f"-{n}",
                f"+{n}",
                f"{n:x}",
                f"0x{n:x}",
                f"{n}.0",
                f"{n} {n}",
                f"{n}, {n + rng.randint(1, 9)}",
                "",
                "9" * rng.randint(20, 40),
                _word(rng, string.printable.strip()),
                _insert(rng, str(n), rng.choice("abc-+_ /\x80")),
            ]
        )
        if "\r" not in text and "\n" not in text and not _valid_length(text):
            break
    if rng.random() < 0.3:  # two fields that disagree
        fields = [f"content-length: {n}", f"content-length: {n + rng.randint(1, 99)}"]
        return request(headers=fields), {400}
    return request(headers=[f"content-length: {text}"]), {400}


def _bad_coding(rng: random.Random) -> Case:
    pool = ["gzip", "deflate", "compress", "identity", "chunked", "br", "x-" + _word(rng, TOKEN)]
    while (codings := [rng.choice(pool) for _ in range(rng.randint(1, 3))]) == ["chunked"]:
        pass
    fields = [f"transfer-encoding: {', '.join(codings)}"]
    status = {501} if codings[-1] == "chunked" else {400}
    if rng.random() < 0.3:  # and a length beside it: a smuggling shape, refused first
        fields.insert(rng.randint(0, 1), f"content-length: {rng.randint(0, 99)}")
        status = {400}
    elif rng.random() < 0.2:
        fields = ["transfer-encoding: chunked"]
        return request(headers=fields, version="HTTP/1.0", body=chunked(CHAT_BODY)), {400}
    return request(headers=fields, body=chunked(CHAT_BODY)), status


def _bad_size_token(rng: random.Random) -> str:
    while True:
        token = rng.choice(
            [
                _word(rng, string.hexdigits + "gxz-+ .", 1, 8),
                "0" * rng.randint(17, 30),
                f"0x{rng.randint(1, 99):x}",
                f"-{rng.randint(1, 99)}",
                " " + str(rng.randint(1, 9)),
                "",
            ]
        )
        size = token.split(";", 1)[0].rstrip(" \t")
        if not re.fullmatch(r"[0-9A-Fa-f]{1,16}", size):
            return token


def _bad_chunks(rng: random.Random) -> Case:
    te = ["transfer-encoding: chunked"]
    data = b"a" * rng.randint(1, 64)
    kind = rng.randrange(6)
    if kind == 0:
        body = _bad_size_token(rng).encode() + b"\r\n" + data + b"\r\n0\r\n\r\n"
        return request(headers=te, body=body), {400}
    if kind == 1:  # the data not followed by CRLF
        tail = rng.choice([b"XY", b"\n\n", b"\r", b"a\r\n"])
        return request(headers=te, body=b"%x\r\n%b%b0\r\n\r\n" % (len(data), data, tail)), {400}
    if kind == 2:  # over the limit in one chunk, or at the chunk that crosses it
        first = rng.randint(0, MAX_BODY)
        body = (b"%x\r\n%b\r\n" % (first, b"b" * first) if first else b"") + b"%x\r\n" % (
            MAX_BODY - first + rng.randint(1, 1 << 20)
        )
        return request(headers=te, body=body), {413}
    if kind == 3:  # a size line over its bound (a long extension)
        ext = b";" + b"e" * rng.randint(1100, 4000)
        return request(headers=te, body=b"5" + ext + b"\r\nhello\r\n0\r\n\r\n"), {400}
    if kind == 4:
        trailer = rng.choice([_word(rng, TOKEN), " folded: 1", f"x-t: a{rng.choice(CTL)}b"])
        return request(headers=te, body=b"0\r\n" + trailer.encode("latin-1") + b"\r\n\r\n"), {400}
    trailers = b"".join(b"x-t%d: %s\r\n" % (i, b"v" * 200) for i in range(rng.randint(41, 60)))
    return request(headers=te, body=b"0\r\n" + trailers + b"\r\n"), {431}


def _over_bounds(rng: random.Random) -> Case:
    kind = rng.randrange(5)
    if kind == 0:
        path = "/" + "a" * rng.randint(8200, 20000)
        return f"GET {path} HTTP/1.1\r\n\r\n".encode(), {414}
    if kind == 1:
        fields = [f"x-h{i}: 1" for i in range(rng.randint(129, 400))]
        return request(headers=fields, body=b""), {431}
    if kind == 2:
        return request(headers=[f"x-h: {'a' * rng.randint(66000, 90000)}"], body=b""), {431}
    if kind == 3:
        return request(headers=[f"content-length: {rng.randint(MAX_BODY + 1, 10**12)}"]), {413}
    expect = rng.choice(["200-ok", "100-continue-please", _word(rng, TOKEN)])
    return request(headers=[f"content-length: {len(CHAT_BODY)}", f"expect: {expect}"]), {417}


def _garbage(rng: random.Random) -> Case:
    raw = bytes(rng.randrange(256) for _ in range(rng.randint(0, 300)))
    return b"\x00" + raw.replace(b"\r\n", b"") + b"\r\n\r\n", {400}


GENERATORS: list[Callable[[random.Random], Case]] = [
    _bad_request_line,
    _bad_field,
    _bad_length,
    _bad_coding,
    _bad_chunks,
    _over_bounds,
    _garbage,
]


def corpus(n: int, seed: int = SEED) -> list[Case]:
    rng = random.Random(seed)
    return [GENERATORS[i % len(GENERATORS)](rng) for i in range(n)]


def test_the_corpus_covers_every_class() -> None:
    assert _valid_length(str(len(CHAT_BODY))) and not _valid_length(f"-{len(CHAT_BODY)}")
    cases = corpus(CASES)
    assert len(cases) >= 10_000 and len({c for c, _ in cases}) > 6_000  # mostly distinct
    assert {s for _, st in cases for s in st} == {400, 413, 414, 417, 431, 501, 505}


def test_ten_thousand_hostile_requests_get_their_4xx_and_break_nothing() -> None:
    cases = corpus(CASES)
    crashes: list[dict[str, Any]] = []
    wrong: list[tuple[bytes, Any]] = []
    answered = {"bad": 0, "valid": 0}

    async def worker(srv: Any, mine: list[Case], index: int) -> None:
        for i, (data, statuses) in enumerate(mine):
            # Every fourth case rides behind a valid request on the same connection.
            lead = (i + index) % 4 == 0
            reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
            try:
                writer.write((GET if lead else b"") + data)
                async with asyncio.timeout(30):
                    if lead:
                        status, _, body = await read_response(reader)
                        if status != 200 or b'"ok"' not in body:
                            wrong.append((GET, status))
                        answered["valid"] += 1
                    status, headers, _ = await read_response(reader)
                    closed = await reader.read(1) == b""
                if status not in statuses or headers.get("connection") != "close" or not closed:
                    wrong.append((data[:120], (status, headers.get("connection"), closed)))
                answered["bad"] += 1
            except (ConnectionError, asyncio.IncompleteReadError, TimeoutError) as exc:
                wrong.append((data[:120], repr(exc)))
            finally:
                writer.close()

    async def go() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _loop, context: crashes.append(context))
        async with serving() as srv:
            shares = [cases[w::WORKERS] for w in range(WORKERS)]
            await asyncio.gather(*(worker(srv, shares[w], w) for w in range(WORKERS)))
            assert srv.stats["rejected"] == len(cases)
            # Afterwards a correct call is answered correctly, on a fresh connection.
            reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
            writer.write(request() + GET)
            chat_status, _, chat_body = await read_response(reader)
            health_status, _, health = await read_response(reader)
            writer.close()
            assert chat_status == 200, chat_body
            message = orjson.loads(chat_body)["choices"][0]["message"]
            assert message["content"] == "hello"
            assert health_status == 200 and orjson.loads(health)["status"] == "ok"
            await asyncio.sleep(0.6)  # past the lingering close of the last rejected ones
            assert srv.connections == 0

    asyncio.run(go())
    assert crashes == []
    assert wrong == [], f"{len(wrong)} wrong answers, first: {wrong[:5]}"
    assert answered["bad"] == len(cases) >= 10_000
    assert answered["valid"] >= len(cases) // 4 - WORKERS
