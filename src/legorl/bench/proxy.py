"""Proxy overhead, measured side by side in one run (`python -m legorl.bench --only proxy`).

The server runs in its own process pinned to core 0; the load generator runs here on core 1.
Requests are OpenCode-shaped (a 9.5k-character system prompt, 10 tools, ~31 KB) and each session
really continues its conversation: every request carries the previous answers and a tool result,
so turns after the first take the proxy's incremental path. The engine is a bench-only stand-in
(`_StandInEngine`) that answers a fixed tool call at once, or after a fixed delay; its log-probs
are placeholders, and the Turn records it produces go to a temporary folder and are discarded.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import orjson

from legorl.protocols import GenerationRequest, TokenStep

_TICK = os.sysconf("SC_CLK_TCK")


def _model_dir() -> Path:
    env = os.environ.get("LEGORL_BENCH_MODEL")
    if env:
        return Path(env)
    here = Path(__file__).resolve()
    for base in (Path.cwd(), *here.parents):
        cand = base / "fixtures" / "models" / "tiny-qwen3"
        if (cand / "tokenizer.json").is_file():
            return cand
    raise FileNotFoundError("fixtures/models/tiny-qwen3 not found; set LEGORL_BENCH_MODEL")


@dataclass(slots=True, kw_only=True)
class _StandInConfig:
    completion: list[int]
    delay: float = 0.0


class _StandInEngine:
    """Bench-only: answers one fixed tool call immediately or after ``delay`` seconds."""

    name = "bench-stand-in"
    config_class: ClassVar[type] = _StandInConfig
    policy_version = 0
    max_context = 1_000_000

    def __init__(self, config: _StandInConfig) -> None:
        self.completion = config.completion
        self.delay = config.delay

    async def generate(self, request: GenerationRequest) -> AsyncIterator[list[TokenStep]]:
        if self.delay:
            await asyncio.sleep(self.delay)
        yield [TokenStep(t, 0.0) for t in self.completion]

    async def load_weights(self, path: str) -> int:
        raise NotImplementedError

    async def close(self) -> None:
        return None


def _make_core(delay: float, out: str) -> Any:
    from legorl.proxy.core import ProxyConfig, ProxyCore
    from legorl.proxy.tokens import ChatTokenizer

    model = _model_dir()
    tok = ChatTokenizer(model)
    text = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n</tool_call>'
    engine = _StandInEngine(_StandInConfig(completion=tok.encode(text) + [tok.eos_id], delay=delay))
    return ProxyCore(ProxyConfig(model=model, out=out), engine)


# ---- request shapes ---------------------------------------------------------------------------


def _tools() -> list[dict[str, Any]]:
    tools = []
    for i, name in enumerate(
        [
            "bash",
            "read",
            "write",
            "edit",
            "glob",
            "grep",
            "list",
            "todowrite",
            "todoread",
            "webfetch",
        ]
    ):
        props = {
            f"{name}_arg_{j}": {
                "type": "string",
                "description": f"Argument {j} of the {name} tool. " + "Explains usage. " * 12,
            }
            for j in range(6)
        }
        tools.append(
            {
                "type": "function",
                "function": {
                    "name": name,
                    "description": f"Tool {i}: {name}. "
                    + "Use this tool carefully and precisely. " * 8,
                    "parameters": {
                        "type": "object",
                        "properties": props,
                        "required": [f"{name}_arg_0"],
                    },
                },
            }
        )
    return tools


SYSTEM = ("You are opencode, an interactive CLI coding agent. " * 185)[:9500]


def first_request(session_turn: int = 0) -> dict[str, Any]:
    return {
        "model": "legorl/tiny",
        "stream": False,
        "tool_choice": "auto",
        "messages": [
            {"role": "system", "content": SYSTEM},
            {
                "role": "user",
                "content": f"Fix the failing test in the repository ({session_turn}).",
            },
        ],
        "tools": _tools(),
    }


def continue_request(body: dict[str, Any], answer: dict[str, Any], turn: int) -> dict[str, Any]:
    msg = answer["choices"][0]["message"]
    calls = msg.get("tool_calls") or []
    body["messages"].append(
        {"role": "assistant", "content": msg.get("content") or "", "tool_calls": calls}
    )
    for call in calls:
        body["messages"].append(
            {
                "role": "tool",
                "tool_call_id": call["id"],
                "content": f"total {turn}\nfile_{turn}.py\nREADME.md\n",
            }
        )
    return body


# ---- a minimal keep-alive HTTP client ---------------------------------------------------------


class _Client:
    def __init__(self, host: str, port: int, proxy_host: str | None = None) -> None:
        self.host, self.port, self.proxy_host = host, port, proxy_host
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, session: str, body: bytes) -> dict[str, Any]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        target = f"http://{self.proxy_host}{path}" if self.proxy_host else path
        host = self.proxy_host or f"{self.host}:{self.port}"
        head = (
            f"POST {target} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
            f"authorization: Bearer {session}\r\ncontent-length: {len(body)}\r\n\r\n"
        )
        self.writer.write(head.encode() + body)
        status_head = await self.reader.readuntil(b"\r\n\r\n")
        lines = status_head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ")[1])
        length = 0
        for line in lines[1:]:
            if line.lower().startswith("content-length:"):
                length = int(line.split(":", 1)[1])
        data = await self.reader.readexactly(length)
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {data[:300]!r}")
        return orjson.loads(data)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def _conversation(client: _Client, session: str, turns: int, latencies: list[float]) -> int:
    body = first_request()
    for turn in range(turns):
        t0 = time.perf_counter()
        answer = await client.post("/v1/chat/completions", session, orjson.dumps(body))
        latencies.append(time.perf_counter() - t0)
        body = continue_request(body, answer, turn)
    return turns


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


# ---- the server process -----------------------------------------------------------------------


def _serve_main(mode: str, delay: float, ready_fd: int) -> None:
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, {0})

    async def run() -> None:
        from legorl.proxy.server import tune_gc_for_serving

        with tempfile.TemporaryDirectory(prefix="legorl-bench-turns-") as out:
            core = _make_core(delay, out)
            tune_gc_for_serving()  # as `legorl proxy serve` / `intercept` do
            if mode == "direct":
                from legorl.proxy.server import ProxyServer

                server = ProxyServer(core, "127.0.0.1", 0)
                port = await server.start()
                os.write(ready_fd, f"{port}\n".encode())
                await server.serve_forever()
            else:
                import socket

                from legorl.proxy.addon import make_master

                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    port = s.getsockname()[1]
                confdir = tempfile.mkdtemp(prefix="legorl-bench-mitm-")
                master = make_master(core, host="127.0.0.1", port=port, confdir=confdir)
                task = asyncio.ensure_future(master.run())
                for _ in range(100):
                    await asyncio.sleep(0.05)
                    try:
                        _r, w = await asyncio.open_connection("127.0.0.1", port)
                        w.close()
                        break
                    except OSError:
                        continue
                os.write(ready_fd, f"{port}\n".encode())
                await task

    asyncio.run(run())


class _Server:
    def __init__(self, mode: str = "direct", delay: float = 0.0, src: str | None = None) -> None:
        read_fd, write_fd = os.pipe()
        env = None if src is None else {**os.environ, "PYTHONPATH": src}  # another legorl tree
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "legorl.bench.proxy", mode, str(delay), str(write_fd)],
            pass_fds=(write_fd,),
            env=env,
        )
        os.close(write_fd)
        with os.fdopen(read_fd) as fh:
            line = fh.readline()
        if not line:
            raise RuntimeError("bench server did not start")
        self.port = int(line)
        self.mode = mode

    def client(self) -> _Client:
        if self.mode == "direct":
            return _Client("127.0.0.1", self.port)
        return _Client("127.0.0.1", self.port, proxy_host="api.openai.com")

    def cpu(self) -> float:
        return _cpu_seconds(self.proc.pid)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


# ---- measurements -----------------------------------------------------------------------------


async def _cpu_per_request(
    server: _Server, sessions: int, turns: int, tag: str
) -> dict[str, float]:
    """CPU ms per request on turn 1 and on later turns, 8 sessions at a time."""
    clients = [server.client() for _ in range(8)]
    bodies: dict[int, dict[str, Any]] = {}
    lat: list[float] = []

    async def turn_for(worker: int, sids: list[int], turn: int) -> None:
        for sid in sids:
            body = bodies.get(sid) or first_request()
            t0 = time.perf_counter()
            answer = await clients[worker].post(
                "/v1/chat/completions", f"{tag}-{sid}", orjson.dumps(body)
            )
            lat.append(time.perf_counter() - t0)
            bodies[sid] = continue_request(body, answer, turn)

    groups = [list(range(w, sessions, 8)) for w in range(8)]
    # CPU time is read from /proc in clock ticks (10 ms): measure over many requests at once.
    c0 = server.cpu()
    await asyncio.gather(*(turn_for(w, groups[w], 0) for w in range(8)))
    c1 = server.cpu()
    for turn in range(1, turns):
        await asyncio.gather(*(turn_for(w, groups[w], turn) for w in range(8)))
    c2 = server.cpu()
    for c in clients:
        await c.close()
    return {
        "turn1_cpu_ms": round((c1 - c0) / sessions * 1000, 3),
        "turn2plus_cpu_ms": round((c2 - c1) / (sessions * (turns - 1)) * 1000, 3),
        "turn2plus_requests": sessions * (turns - 1),
        "request_kb_turn1": round(len(orjson.dumps(first_request())) / 1024, 1),
    }


async def _throughput(server: _Server, concurrency: int, seconds: float, tag: str) -> float:
    done = 0
    stop_at = time.perf_counter() + seconds

    async def loop(i: int) -> None:
        nonlocal done
        client = server.client()
        n = 0
        while time.perf_counter() < stop_at:
            body = first_request()
            for turn in range(16):  # a session of 16 turns, then a fresh one
                answer = await client.post(
                    "/v1/chat/completions", f"{tag}-{i}-{n}", orjson.dumps(body)
                )
                done += 1
                if time.perf_counter() >= stop_at:
                    break
                body = continue_request(body, answer, turn)
            n += 1
        await client.close()

    start = time.perf_counter()
    await asyncio.gather(*(loop(i) for i in range(concurrency)))
    return done / (time.perf_counter() - start)


async def _direct_engine_throughput(concurrency: int, seconds: float, delay: float) -> float:
    engine = _StandInEngine(_StandInConfig(completion=[1, 2, 3], delay=delay))
    done = 0
    stop_at = time.perf_counter() + seconds

    async def loop() -> None:
        nonlocal done
        while time.perf_counter() < stop_at:
            async for _ in engine.generate(GenerationRequest(prompt_ids=[1], max_tokens=8)):
                pass
            done += 1

    start = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    return done / (time.perf_counter() - start)


def _prompt_build_growth(turns: int) -> dict[str, float]:
    """Time of Session.plan at turn 2 and at turn ``turns`` of one session (incremental path)."""
    from legorl.proxy.session import Generated, Session
    from legorl.proxy.tokens import ChatTokenizer
    from legorl.proxy.wire import WIRES

    tok = ChatTokenizer(_model_dir())
    wire = WIRES["openai_chat"]
    session = Session("growth", tok)
    body = first_request()
    times: dict[int, float] = {}
    completion = tok.encode(
        '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
    ) + [tok.eos_id]
    for turn in range(1, turns + 1):
        req = wire.parse_request(orjson.dumps(body))
        samples = []
        for _ in range(7 if turn in (2, turns) else 1):
            t0 = time.perf_counter()
            plan = session.plan(req)
            samples.append(time.perf_counter() - t0)
        times[turn] = statistics.median(samples)
        from legorl.proxy.chat import ToolCall

        call = ToolCall(id=f"call_{turn}", name="bash", arguments='{"command": "ls"}')
        session.commit(plan, completion, Generated("", "", [call]))
        answer = {
            "choices": [
                {
                    "message": {
                        "content": "",
                        "tool_calls": [
                            {
                                "id": call.id,
                                "type": "function",
                                "function": {"name": "bash", "arguments": call.arguments},
                            }
                        ],
                    }
                }
            ]
        }
        body = continue_request(body, answer, turn)
    return {
        "plan_ms_turn1_full_render": round(times[1] * 1000, 3),
        "plan_ms_turn2": round(times[2] * 1000, 3),
        f"plan_ms_turn{turns}": round(times[turns] * 1000, 3),
        # The figure: against turn 1 (a full render of the first request).
        f"turn{turns}_over_turn1": round(times[turns] / times[1], 3),
        # Stricter: against the first incremental turn; what grows is the history comparison.
        f"turn{turns}_over_turn2": round(times[turns] / times[2], 3),
    }


def _rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def _memory_per_session(n: int) -> int:
    with tempfile.TemporaryDirectory(prefix="legorl-bench-mem-") as out:
        core = _make_core(0.0, out)
        headers = {"content-type": "application/json"}

        async def two_turns(i: int) -> None:
            body = first_request()
            for turn in range(2):
                resp = await core.handle(
                    "POST", f"/s/mem-{i}/v1/chat/completions", "", headers, orjson.dumps(body)
                )
                assert isinstance(resp.body, bytes)
                body = continue_request(body, orjson.loads(resp.body), turn)

        await two_turns(-1)  # warm caches before the baseline
        gc.collect()
        before = _rss_bytes()
        for i in range(n):
            await two_turns(i)
        gc.collect()
        return (_rss_bytes() - before) // n


def bench_proxy(quick: bool = False) -> dict[str, Any]:
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, {1})
    seconds = 2.0 if quick else 6.0
    report: dict[str, Any] = {
        "targets": {
            "turn2plus_cpu_ms": "<= 1.0",
            "req_per_s_64": ">= 1000",
            "delay50ms_proxy_over_direct_64": ">= 0.95",
            "prompt_build_turn200_over_turn1": "< 2",
        }
    }

    async def measure(mode: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        server = _Server(mode)
        try:
            out.update(
                await _cpu_per_request(
                    server, 32 if quick else 64, 6 if quick else 12, f"cpu-{mode}"
                )
            )
            for c in (1, 16, 64):
                out[f"req_per_s_{c}"] = round(
                    await _throughput(server, c, seconds, f"tp{c}-{mode}"), 1
                )
        finally:
            server.stop()
        return out

    report["serve"] = asyncio.run(measure("direct"))
    report["intercept_mitmproxy"] = asyncio.run(measure("mitm"))

    async def delayed() -> dict[str, float]:
        server = _Server("direct", 0.05)
        try:
            through = await _throughput(server, 64, seconds, "delay")
        finally:
            server.stop()
        direct = await _direct_engine_throughput(64, seconds, 0.05)
        return {
            "proxy_req_per_s": round(through, 1),
            "direct_req_per_s": round(direct, 1),
            "proxy_over_direct": round(through / direct, 3),
        }

    report["engine_50ms_64_sessions"] = asyncio.run(delayed())
    report["prompt_build"] = _prompt_build_growth(50 if quick else 200)
    report["idle_session_bytes"] = asyncio.run(_memory_per_session(50 if quick else 200))
    return report


def compare_cpu_per_call(srcs: list[str], rounds: int = 3) -> dict[str, Any]:
    """The serve section's CPU per call for servers from other source trees, side by side:
    ``python -m legorl.bench.proxy compare /path/to/other/src src`` (rounds interleaved)."""
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, {1})
    runs: dict[str, list[dict[str, float]]] = {src: [] for src in srcs}

    async def one(src: str, i: int) -> dict[str, float]:
        server = _Server("direct", src=str(Path(src).resolve()))
        try:
            return await _cpu_per_request(server, 64, 12, f"cmp{i}")
        finally:
            server.stop()

    for i in range(rounds):
        for src in srcs:
            runs[src].append(asyncio.run(one(src, i)))
    report: dict[str, Any] = {}
    for src, results in runs.items():
        report[src] = {
            key: statistics.median(r[key] for r in results)
            for key in ("turn1_cpu_ms", "turn2plus_cpu_ms")
        }
    first, last = srcs[0], srcs[-1]
    report["turn2plus_last_over_first"] = round(
        report[last]["turn2plus_cpu_ms"] / report[first]["turn2plus_cpu_ms"], 3
    )
    return report


if __name__ == "__main__":
    if sys.argv[1] == "compare":
        print(orjson.dumps(compare_cpu_per_call(sys.argv[2:]), option=orjson.OPT_INDENT_2).decode())
    else:
        _serve_main(sys.argv[1], float(sys.argv[2]), int(sys.argv[3]))
