"""Proxy cost for the request shapes of Qwen Code and mini-swe-agent, and time to the first
streamed byte through `intercept` against `serve` (`python -m legorl.bench --only harness_shapes`).

The shapes copy the sizes measured from the real harnesses' first calls (docs/notes/qwenmini.md),
not their text: Qwen Code sends a 28.9k-character system prompt, a 9.8k-character user message
as a content list, 14 tools (39 KB of schemas), ``stream: true`` with ``include_usage``;
mini-swe-agent sends a one-line system prompt, a ~4k-character task message, one ``bash`` tool,
not streamed. Each session continues its conversation, so turns after the first take the
proxy's incremental path; the server process and the stand-in engine are the proxy bench's
(`legorl.bench.proxy`). Time to first byte is the median over sequential streamed calls on
fresh connections, through mitmproxy in plain-HTTP forward mode against the direct server.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import statistics
import time
from typing import Any

import orjson

from legorl.bench.proxy import _Server

_CALL_ID = re.compile(rb'"id":\s*"(call_[^"]+)"')


def _tool(name: str, props: int, chars: int) -> dict[str, Any]:
    desc = ("Describes what the tool does and when to use it. " * 200)[:chars]
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": desc,
            "parameters": {
                "type": "object",
                "properties": {
                    f"arg_{i}": {"type": "string", "description": "An argument."}
                    for i in range(props)
                },
                "required": ["arg_0"],
            },
        },
    }


def qwen_code_request() -> dict[str, Any]:
    names = [
        "agent",
        "edit",
        "get_goal",
        "glob",
        "grep_search",
        "list_agents",
        "notebook_edit",
        "read_file",
        "run_shell_command",
        "skill",
        "tool_call",
        "tool_search",
        "update_goal",
        "write_file",
    ]
    return {
        "model": "tiny",
        "max_tokens": 32000,
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [
            {"role": "system", "content": ("You are Qwen Code, a coding agent. " * 900)[:28900]},
            {
                "role": "user",
                "content": [
                    {
                        "type": "text",
                        "text": ("<system-reminder>skills</system-reminder> " * 250)[:9800],
                    },
                    {"type": "text", "text": "Fix the failing test in the repository."},
                ],
            },
        ],
        "tools": [_tool(n, 4, 2400) for n in names],
    }


def mini_swe_agent_request() -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [
            {
                "role": "system",
                "content": "You are a helpful assistant that can interact with a computer.",
            },
            {
                "role": "user",
                "content": ("Please solve this issue: fix the failing test. " * 90)[:4000],
            },
        ],
        "tools": [_tool("bash", 1, 300)],
        "drop_params": True,
    }


async def _post(
    port: int, body: dict[str, Any], session: str, proxied: bool
) -> tuple[bytes, float]:
    """One call on a fresh connection: (whole body, seconds to the first body byte)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = orjson.dumps(body)
    target = "http://api.openai.com/v1/chat/completions" if proxied else "/v1/chat/completions"
    t0 = time.perf_counter()
    writer.write(
        f"POST {target} HTTP/1.1\r\nhost: api.openai.com\r\ncontent-type: application/json\r\n"
        f"authorization: Bearer {session}\r\ncontent-length: {len(data)}\r\n"
        "connection: close\r\n\r\n".encode()
        + data
    )
    head = await reader.readuntil(b"\r\n\r\n")
    first = await reader.read(1)
    ttfb = time.perf_counter() - t0
    rest = await reader.read()
    writer.close()
    if b" 200 " not in head.split(b"\r\n", 1)[0]:
        raise RuntimeError(f"bench call failed: {head[:200]!r} {first + rest[:300]!r}")
    return first + rest, ttfb


def _continue(body: dict[str, Any], answer: bytes, turn: int) -> dict[str, Any]:
    found = _CALL_ID.search(answer)
    if found is None:
        raise RuntimeError(f"no tool call in the answer: {answer[:300]!r}")
    call_id = found.group(1).decode()
    call = {
        "id": call_id,
        "type": "function",
        "function": {"name": "bash", "arguments": '{"command": "ls -la"}'},
    }
    body["messages"].append({"role": "assistant", "content": "", "tool_calls": [call]})
    body["messages"].append(
        {"role": "tool", "tool_call_id": call_id, "content": f"total {turn}\nfile_{turn}.py\n"}
    )
    return body


async def _cpu_per_call(server: _Server, shape: Any, sessions: int, turns: int) -> dict[str, float]:
    bodies = {s: shape() for s in range(sessions)}
    c1 = 0.0
    for turn in range(turns):
        if turn == 1:
            c1 = server.cpu()
        answers = await asyncio.gather(
            *(_post(server.port, bodies[s], f"{shape.__name__}-{s}", False) for s in bodies)
        )
        for s, (answer, _) in zip(bodies, answers, strict=True):
            bodies[s] = _continue(bodies[s], answer, turn)
    c2 = server.cpu()
    return {
        "turn2plus_cpu_ms": round((c2 - c1) / (sessions * (turns - 1)) * 1000, 3),
        "request_kb_turn1": round(len(orjson.dumps(shape())) / 1024, 1),
    }


async def _ttfb(server: _Server, calls: int) -> float:
    proxied = server.mode != "direct"
    times = []
    for i in range(calls):
        _, ttfb = await _post(server.port, qwen_code_request(), f"ttfb-{server.mode}-{i}", proxied)
        times.append(ttfb)
    return statistics.median(times)


def bench_harness_shapes(quick: bool = False) -> dict[str, Any]:
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, {1})
    sessions, turns, calls = (8, 4, 8) if quick else (32, 8, 40)
    report: dict[str, Any] = {}
    server = _Server("direct")
    try:
        for shape in (qwen_code_request, mini_swe_agent_request):
            report[shape.__name__.removesuffix("_request")] = asyncio.run(
                _cpu_per_call(server, shape, sessions, turns)
            )
        serve_ttfb = asyncio.run(_ttfb(server, calls))
    finally:
        server.stop()
    server = _Server("mitm")
    try:
        intercept_ttfb = asyncio.run(_ttfb(server, calls))
    finally:
        server.stop()
    report["first_byte"] = {
        "serve_ms": round(serve_ttfb * 1000, 3),
        "intercept_ms": round(intercept_ttfb * 1000, 3),
        "intercept_over_serve": round(intercept_ttfb / serve_ttfb, 3),
    }
    return report
