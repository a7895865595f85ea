"""Proxy CPU per call for Codex CLI's real request shape (`python -m legorl.bench --only
proxy_codex`), beside the OpenCode-shaped figure of the `proxy` section.

The request is the one Codex CLI 0.169 sent on its second turn (``data/codex_0169_turn2.json``,
captured against `legorl proxy serve`, its prose trimmed to stand-ins of the same length): no
``instructions``, the system prompt as a ``developer`` message, four function tools and a
namespace, ``stream: true``, ``store: false``. Each session starts from that body without its
last three items and then continues as Codex does: it appends the streamed answer's output
items (with their ids and status) and a ``function_call_output`` in Codex's own format, so turns
after the first take the proxy's incremental path. The server, the stand-in engine and the CPU
accounting are the `proxy` section's (``legorl.bench.proxy``): its own process on core 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
from pathlib import Path
from typing import Any

import orjson

from legorl.bench.proxy import _Server

CAPTURED = Path(__file__).parent / "data" / "codex_0169_turn2.json"
_OUTPUT = "Chunk ID: 000000\nWall time: 0.0010 seconds\nProcess exited with code 0\nOutput:\n"


def codex_first_request() -> dict[str, Any]:
    """Codex's first-turn body: the captured turn-2 body before its answer and tool result."""
    body = orjson.loads(CAPTURED.read_bytes())
    kinds = [item["type"] for item in body["input"][-3:]]
    assert kinds == ["reasoning", "function_call", "function_call_output"], kinds
    body["input"] = body["input"][:-3]
    return body


def codex_continue(body: dict[str, Any], output: list[dict[str, Any]], turn: int) -> None:
    """Append the answer's items and a tool result, as Codex sends them on its next turn."""
    for item in output:
        body["input"].append(item)
        if item["type"] == "function_call":
            text = f"{_OUTPUT}total {turn}\nfile_{turn}.py\nREADME.md\n"
            body["input"].append(
                {"type": "function_call_output", "call_id": item["call_id"], "output": text}
            )


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    parts: list[bytes] = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).strip(), 16)
        data = await reader.readexactly(size + 2)
        if size == 0:
            return b"".join(parts)
        parts.append(data[:-2])


class _StreamClient:
    """Keep-alive POSTs of streamed Responses calls; returns the final response's output."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def respond(self, session: str, body: bytes) -> list[dict[str, Any]]:
        if self.conn is None:
            self.conn = await asyncio.open_connection("127.0.0.1", self.port)
        reader, writer = self.conn
        writer.write(
            (
                f"POST /v1/responses HTTP/1.1\r\nhost: 127.0.0.1:{self.port}\r\n"
                f"content-type: application/json\r\naccept: text/event-stream\r\n"
                f"authorization: Bearer {session}\r\ncontent-length: {len(body)}\r\n\r\n"
            ).encode()
            + body
        )
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        if " 200 " not in head.split("\r\n", 1)[0]:
            raise RuntimeError(f"bench request failed: {head[:200]!r}")
        events = (await _read_chunked(reader)).split(b"\n\n")
        for frame in events:
            if b"event: response.completed" in frame:
                data = frame.split(b"data: ", 1)[1]
                output: list[dict[str, Any]] = orjson.loads(data)["response"]["output"]
                return output
        raise RuntimeError("the stream ended without response.completed")

    async def close(self) -> None:
        if self.conn is not None:
            self.conn[1].close()


async def _cpu_per_call(server: _Server, sessions: int, turns: int) -> dict[str, float]:
    workers = 8
    clients = [_StreamClient(server.port) for _ in range(workers)]
    first = codex_first_request()
    bodies = {sid: copy.deepcopy(first) for sid in range(sessions)}

    async def one_turn(worker: int, turn: int) -> None:
        for sid in range(worker, sessions, workers):
            body = bodies[sid]
            output = await clients[worker].respond(f"codex-{sid}", orjson.dumps(body))
            codex_continue(body, output, turn)

    # Clock ticks are 10 ms: read CPU over a whole round of requests, never one.
    c0 = server.cpu()
    await asyncio.gather(*(one_turn(w, 0) for w in range(workers)))
    c1 = server.cpu()
    for turn in range(1, turns):
        await asyncio.gather(*(one_turn(w, turn) for w in range(workers)))
    c2 = server.cpu()
    for client in clients:
        await client.close()
    return {
        "turn1_cpu_ms": round((c1 - c0) / sessions * 1000, 3),
        "turn2plus_cpu_ms": round((c2 - c1) / (sessions * (turns - 1)) * 1000, 3),
        "turn2plus_requests": sessions * (turns - 1),
        "request_kb_turn2": round(CAPTURED.stat().st_size / 1024, 1),
    }


def bench_proxy_codex(quick: bool = False) -> dict[str, Any]:
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, {1})
    server = _Server("direct")
    try:
        sessions, turns = (16, 4) if quick else (64, 12)
        figures = asyncio.run(_cpu_per_call(server, sessions, turns))
    finally:
        server.stop()
    return {"shape": "codex-cli 0.169, /v1/responses, streamed", "serve": figures}
