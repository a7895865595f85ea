"""Test helpers: a real `legorl proxy` server on a background event loop, with the `forced`
engine (a fake that replays scripted completions and scores them with the real tiny model)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from legorl.engines import make_engine
from legorl.proxy.core import ProxyConfig, ProxyCore
from legorl.proxy.server import ProxyServer
from legorl.proxy.tokens import ChatTokenizer
from legorl.records import Turn, read_jsonl

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "fixtures" / "models" / "tiny-qwen3"


@dataclass
class RunningProxy:
    url: str
    core: ProxyCore
    out: Path
    loop: asyncio.AbstractEventLoop
    server: ProxyServer | None = None

    def turns(self, session: str) -> list[Turn]:
        path = self.out / f"{session}.jsonl"
        return list(read_jsonl(path, Turn)) if path.exists() else []

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)


@contextlib.contextmanager
def running_proxy(
    out: Path, script: list[dict[str, Any]], *, engine: str = "forced", **config: Any
) -> Iterator[RunningProxy]:
    engine_opts = {k[7:]: config.pop(k) for k in list(config) if k.startswith("engine_")}
    if engine == "forced":
        engine_opts.setdefault("script", script)
    eng = make_engine(engine, model_path=str(MODEL), **engine_opts)
    core = ProxyCore(ProxyConfig(model=MODEL, out=out, **config), eng)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = ProxyServer(core, "127.0.0.1", 0)
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(30)
    try:
        yield RunningProxy(server.url, core, out, loop, server)
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(30)
        asyncio.run_coroutine_threadsafe(eng.close(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def tokenizer() -> ChatTokenizer:
    return ChatTokenizer(MODEL)
