"""`legorl proxy intercept` streams: a streamed answer reaches the client event by event while
the engine is still sampling, through real mitmproxy with its CA, over TLS to the API host.

The engine is a fake defined here (a gate you can observe): it samples the first tokens of a
fixed answer, then waits until the test releases it before it samples the rest. The client reads
the first content event while the engine is held, so an addon that sends answers whole makes
the read time out and the test fail.
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from proxy_harness import MODEL, tokenizer

from legorl.protocols import GenerationRequest, TokenStep
from legorl.proxy.core import ProxyConfig, ProxyCore

ANSWER = "Streaming through the interception proxy works one event at a time."


class GatedEngine:
    """Samples ``head`` tokens, then blocks until ``release`` before sampling the rest."""

    name = "gated"
    policy_version = 0
    max_context = 100_000

    def __init__(self, completion: list[int], head: int) -> None:
        self.completion = completion
        self.head = head
        self.sampled = 0
        self.release = asyncio.Event()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[list[TokenStep]]:
        for i, token in enumerate(self.completion):
            if i == self.head:
                await self.release.wait()
            self.sampled = i + 1
            yield [TokenStep(token, -0.5)]

    async def load_weights(self, path: str) -> int:
        raise NotImplementedError

    async def close(self) -> None:
        return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def _intercept(
    tmp: Path, engine: GatedEngine
) -> Iterator[tuple[int, Path, asyncio.AbstractEventLoop]]:
    from legorl.proxy.addon import make_master

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    port, confdir = _free_port(), tmp / "mitm"
    core = ProxyCore(ProxyConfig(model=MODEL, out=tmp / "turns"), engine)

    async def start() -> tuple[object, asyncio.Future[None]]:
        master = make_master(core, host="127.0.0.1", port=port, confdir=str(confdir))
        return master, asyncio.ensure_future(master.run())

    master, task = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    try:
        deadline = time.monotonic() + 30
        ca = confdir / "mitmproxy-ca-cert.pem"
        while time.monotonic() < deadline:
            assert not task.done(), task
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    if ca.exists():
                        break
            except OSError:
                pass
            time.sleep(0.1)
        yield port, ca, loop
    finally:
        loop.call_soon_threadsafe(master.shutdown)  # type: ignore[attr-defined]
        deadline = time.monotonic() + 10
        while not task.done() and time.monotonic() < deadline:
            time.sleep(0.05)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def _deltas(lines: Iterator[str]) -> Iterator[dict]:
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])["choices"][0]["delta"]


def test_first_event_arrives_before_the_last_token_is_sampled(tmp_path: Path) -> None:
    tok = tokenizer()
    completion = tok.encode(ANSWER) + [tok.eos_id]
    engine = GatedEngine(completion, head=3)
    with _intercept(tmp_path, engine) as (port, ca, loop):
        client = httpx.Client(
            proxy=f"http://127.0.0.1:{port}",
            verify=ssl.create_default_context(cafile=str(ca)),
            timeout=httpx.Timeout(60, read=30),
        )
        body = {
            "model": "tiny",
            "stream": True,
            "messages": [{"role": "user", "content": "Say something."}],
        }
        with (
            client,
            client.stream(
                "POST",
                "https://api.openai.com/v1/chat/completions",
                json=body,
                headers={"authorization": "Bearer streamed-session"},
            ) as response,
        ):
            assert response.status_code == 200, response.read()
            assert response.headers["content-type"].startswith("text/event-stream")
            deltas = _deltas(response.iter_lines())
            first = next(d for d in deltas if d.get("content"))
            # The client holds text while the engine has sampled only the head.
            assert engine.sampled <= engine.head < len(completion)
            loop.call_soon_threadsafe(engine.release.set)
            rest = [d.get("content") or "" for d in deltas]
    assert engine.sampled == len(completion)
    assert first["content"] + "".join(rest) == ANSWER
    (turn,) = [json.loads(ln) for ln in (tmp_path / "turns/streamed-session.jsonl").open()]
    assert turn["completion_ids"] == completion


def test_non_api_hosts_are_still_refused(tmp_path: Path) -> None:
    engine = GatedEngine([1], head=5)
    with _intercept(tmp_path, engine) as (port, _, _):
        refused = httpx.get("http://example.com/", proxy=f"http://127.0.0.1:{port}", timeout=30)
        assert refused.status_code == 403
        assert b"not an API host" in refused.content
        with pytest.raises(httpx.ProxyError):
            httpx.get("https://example.com/", proxy=f"http://127.0.0.1:{port}", timeout=30)
