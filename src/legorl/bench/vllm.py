"""Figures on REAL vLLM, side by side in one run (`python -m legorl.bench --only vllm`), on one
server that legorl launches (``fixtures/models/tiny-agent``, fp32, the engine's own flags):

* proxy / direct: output tokens/s of 16 concurrent sessions through legorl's proxy (chat API:
  rendering, session bookkeeping, Turns written, one more HTTP hop) against the same 16 sessions
  posting to vLLM's ``/v1/completions`` themselves, with the very bodies the ``vllm`` engine
  sends for the prompts the proxy rendered (non-streamed chat calls: one JSON answer from vLLM
  per call on both sides). Both sides post over the engine's own lean HTTP/1.1 client, so they
  differ by the proxy alone. The proxy runs as
  ``legorl proxy serve --engine vllm --engine-opt base_url=…`` in its own process, as it is
  deployed; the load generator of both sides runs here. Greedy, so both sides decode the same
  tokens; the prefix cache is reset before every pass, so neither side is served the other's
  prefill; sessions are opened before a pass's clock starts. Passes alternate direct, proxy;
  the figure is the median proxy rate over the median direct rate, with each pass's ratio and
  the CPU ms per output token of the load generator, the proxy's process and the vLLM server
  beside it, and the seconds a sampler thread of the load generator woke late while each
  side's clock ran (``client_wake_late_s``: the machine keeping this process off a CPU, or its
  own main thread holding the GIL).
  Target >= 0.95.
* weight sync: seconds of one full reload into the running server (``collective_rpc``
  ``reload_weights``, then ``reset_prefix_cache``: what ``legorl train --push`` and the loop do
  after every step) beside the seconds of the train step that wrote the checkpoint.

Without vLLM the section is skipped with a line saying why. The Python with vLLM is
``$LEGORL_VLLM_PYTHON``, else the checkout's ``.venv-vllm/bin/python``, else ``python3`` if it
imports vllm.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

SESSIONS = 16
_ROOT = Path(__file__).resolve().parents[3]


def _vllm_python() -> str | None:
    from legorl.engines.vllm_server import probe_python

    for python in (
        os.environ.get("LEGORL_VLLM_PYTHON"),
        str(_ROOT / ".venv-vllm" / "bin" / "python"),
        "python3",
    ):
        if python and (info := probe_python(python)) is not None and info.get("found"):
            return python
    return None


def _model() -> Path:
    return Path(os.environ.get("LEGORL_BENCH_VLLM_MODEL", _ROOT / "fixtures/models/tiny-agent"))


def _messages(session: int, round_: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": "You are a careful coding agent. Use the tools."},
        {
            "role": "user",
            "content": f"Task {session}.{round_}: the function area() in geometry/shapes.py "
            f"returns the wrong value for rectangle {session} x {round_ + 2}. Find and fix it.",
        },
    ]


class _WakeLag:
    """A thread that sleeps 5 ms at a time and adds up how late it wakes (over 20 ms) into the
    bucket of the side being measured: the seconds this process was kept off a CPU (or its main
    thread held the GIL), so that a report shows when the machine set a pass's rate."""

    def __init__(self) -> None:
        self.side: str | None = None
        self.late: dict[str, float] = {"direct": 0.0, "proxy": 0.0}
        self.worst: dict[str, float] = {"direct": 0.0, "proxy": 0.0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            time.sleep(0.005)
            late, side = time.perf_counter() - t0 - 0.005, self.side
            if side is not None and late > 0.02:
                self.late[side] += late
                self.worst[side] = max(self.worst[side], late)

    def __enter__(self) -> _WakeLag:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@contextlib.contextmanager
def _clocked(lag: _WakeLag | None, side: str) -> Iterator[None]:
    """Count ``lag``'s late wake-ups to ``side`` while a pass's clock runs."""
    if lag is not None:
        lag.side = side
    try:
        yield
    finally:
        if lag is not None:
            lag.side = None


async def _post_all(
    base_url: str,
    calls: list[list[tuple[str, bytes]]],
    count: Callable[[Any], int],
    lag: _WakeLag | None,
    side: str,
) -> tuple[int, float]:
    """(output tokens, seconds) of one pass: each session posts its (path, body) calls back to
    back over the engine's own lean HTTP/1.1 client (``engines/http1.py``), the same client on
    both sides, so that they differ by the proxy alone; ``count`` reads an answer's output
    tokens. The bodies are encoded before the clock starts."""
    import orjson

    from legorl.engines.http1 import Http1Pool

    pool = Http1Pool(base_url, timeout_s=600)

    async def session(posts: list[tuple[str, bytes]]) -> int:
        tokens = 0
        for path, body in posts:
            status, answer = await pool.post(path, body)
            if status != 200:
                raise RuntimeError(f"{base_url}{path} answered {status}: {answer[:500]!r}")
            tokens += count(orjson.loads(answer))
        return tokens

    try:
        with _clocked(lag, side):
            t0 = time.perf_counter()
            counts = await asyncio.gather(*(session(posts) for posts in calls))
            return sum(counts), time.perf_counter() - t0
    finally:
        await pool.close()


async def _proxy_pass(
    endpoint: Any, served: str, rounds: int, max_tokens: int, tag: str, lag: _WakeLag | None = None
) -> tuple[int, float]:
    """``SESSIONS`` sessions x ``rounds`` chat calls via the proxy. Sessions are opened before
    the clock starts and closed after it stops: the figure is the calls' (the direct side opens
    nothing)."""
    from urllib.parse import urlsplit

    import orjson

    urls = [(await endpoint.open_session(f"{tag}-{i}")).url for i in range(SESSIONS)]
    calls = []
    for i, url in enumerate(urls):
        path = f"{urlsplit(url).path}/v1/chat/completions"
        bodies = [
            {
                "model": served,
                "messages": _messages(i, r),
                "max_tokens": max_tokens,
                "temperature": 0.0,
            }
            for r in range(rounds)
        ]
        calls.append([(path, orjson.dumps(body)) for body in bodies])
    result = await _post_all(
        endpoint.url, calls, lambda answer: answer["usage"]["completion_tokens"], lag, "proxy"
    )
    for i in range(SESSIONS):
        await endpoint.close_session(f"{tag}-{i}")
    return result


async def _direct_pass(
    engine: Any, bodies: list[list[dict[str, Any]]], lag: _WakeLag | None = None
) -> tuple[int, float]:
    """The same sessions posting the engine's bodies to vLLM's ``/v1/completions``."""
    import orjson

    from legorl.engines.vllm_client import _steps_of

    calls = [[("/v1/completions", orjson.dumps(body)) for body in session] for session in bodies]
    return await _post_all(
        engine.base_url, calls, lambda answer: len(_steps_of(answer)), lag, "direct"
    )


def _recorded_bodies(
    engine: Any, turns: Path, tag: str, rounds: int, max_tokens: int
) -> list[list[dict]]:
    """Per session, the engine's request bodies for the prompts the proxy rendered (its Turns)."""
    from legorl.protocols import GenerationRequest
    from legorl.records import Turn, read_jsonl

    bodies = []
    for i in range(SESSIONS):
        calls = []
        prompt: list[int] = []
        for turn in read_jsonl(turns / f"{tag}-{i}.jsonl", Turn):
            if turn.prompt_offset == 0:
                prompt = []
            prompt = prompt[: turn.prompt_offset] + list(turn.prompt_delta)
            request = GenerationRequest(
                prompt_ids=prompt,
                max_tokens=turn.max_tokens or max_tokens,
                temperature=0.0,
                stop_token_ids=[turn.completion_ids[-1]] if turn.finish_reason == "stop" else [],
                stream=False,  # as the proxy asks for a non-streamed call without stop strings
            )
            calls.append(engine._body(request))  # exactly what the engine posts
            prompt = prompt + list(turn.completion_ids)
        assert len(calls) == rounds, (i, len(calls))
        bodies.append(calls)
    return bodies


async def _reset_cache(engine: Any) -> None:
    import httpx

    async with httpx.AsyncClient(timeout=120) as client:
        (await client.post(f"{engine.base_url}/reset_prefix_cache")).raise_for_status()


def _group_cpu_s(pgid: int | None) -> float:
    """CPU seconds used so far by the processes of group ``pgid`` (the vLLM server's)."""
    if pgid is None:
        return 0.0
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the process ended meanwhile
        if int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def _pid_cpu_s(pid: int | None) -> float:
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.asynccontextmanager
async def _proxy_process(engine: Any, work: Path) -> AsyncIterator[tuple[Any, int]]:
    """``legorl proxy serve`` in its own process, as it is deployed, in front of ``engine``'s
    server (registered sessions only, Turns in ``work/turns``); yields (endpoint, its pid)."""
    import httpx

    from legorl.engines.vllm_server import free_port
    from legorl.rollout import remote_proxy

    port, token = free_port(), secrets.token_hex(16)
    command = [
        sys.executable,
        "-c",
        "from legorl.cli.main import app; app()",
        "proxy",
        "serve",
        "--model",
        str(_model()),
        "--engine",
        "vllm",
        "--engine-opt",
        f"base_url={engine.base_url}",
        "--out",
        str(work / "turns"),
        "--port",
        str(port),
        "--admin-token",
        token,
        "--registered-only",
    ]
    log = (work / "proxy.log").open("wb")
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(timeout=5) as client:
            for _ in range(1200):
                if proc.poll() is not None:
                    tail = (work / "proxy.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"legorl proxy serve exited {proc.returncode}: {tail}")
                try:
                    if (await client.get(f"{url}/healthz")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.1)
            else:
                raise RuntimeError(f"legorl proxy serve not healthy at {url} within 120 s")
        yield remote_proxy(url, work / "turns", token), proc.pid
    finally:
        proc.terminate()
        try:
            await asyncio.to_thread(proc.wait, 10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


async def _proxy_ratio(engine: Any, work: Path, passes: int, rounds: int, max_tokens: int) -> dict:
    rates: dict[str, list[float]] = {"direct": [], "proxy": []}
    cpu: dict[str, list[float]] = {"direct": [], "proxy": []}
    server_cpu: dict[str, list[float]] = {"direct": [], "proxy": []}
    proxy_cpu: list[float] = []
    tokens: dict[str, int] = {}
    pgid = engine.server.proc.pid if engine.server is not None else None

    async def timed(side: str, one_pass: Any, proxy_pid: int | None) -> None:
        await _reset_cache(engine)
        c0, g0, p0 = time.process_time(), _group_cpu_s(pgid), _pid_cpu_s(proxy_pid)
        n, s = await one_pass
        cpu[side].append((time.process_time() - c0) / n * 1000)
        if proxy_pid is not None:
            proxy_cpu.append((_pid_cpu_s(proxy_pid) - p0) / n * 1000)
        server_cpu[side].append((_group_cpu_s(pgid) - g0) / n * 1000)
        rates[side].append(n / s)
        tokens[side] = n

    served = _model().name
    with _WakeLag() as lag:
        async with _proxy_process(engine, work) as (endpoint, proxy_pid):
            await _reset_cache(engine)
            await _proxy_pass(endpoint, served, rounds, max_tokens, "warm")
            bodies = _recorded_bodies(engine, work / "turns", "warm", rounds, max_tokens)
            for k in range(passes):  # interleaved, so drifting machine load hits both alike
                await timed("direct", _direct_pass(engine, bodies, lag), None)
                await timed(
                    "proxy",
                    _proxy_pass(endpoint, served, rounds, max_tokens, f"p{k}", lag),
                    proxy_pid,
                )
    proxy, direct = statistics.median(rates["proxy"]), statistics.median(rates["direct"])
    ratios = [p / d for p, d in zip(rates["proxy"], rates["direct"], strict=True)]
    return {
        "sessions": SESSIONS,
        "calls_per_session": rounds,
        "max_tokens": max_tokens,
        "passes": passes,
        "output_tokens_per_pass": tokens,
        "proxy_tok_s": round(proxy, 1),
        "direct_tok_s": round(direct, 1),
        "proxy_over_direct": round(proxy / direct, 4),
        # each pass's proxy rate over the direct rate measured just before it
        "pass_ratios": [round(r, 4) for r in ratios],
        # CPU ms per output token: the load generator (this process), the proxy's process,
        # and the vLLM server's processes
        "client_cpu_ms_per_token": {k: round(statistics.median(v), 4) for k, v in cpu.items()},
        "proxy_cpu_ms_per_token": round(statistics.median(proxy_cpu), 4),
        "server_cpu_ms_per_token": {
            k: round(statistics.median(v), 4) for k, v in server_cpu.items()
        },
        # seconds the load generator's sampler thread woke late (over 20 ms each) while a
        # side's clock ran, its passes together, and the latest single wake-up
        "client_wake_late_s": {k: round(v, 3) for k, v in lag.late.items()},
        "client_worst_wake_late_s": {k: round(v, 3) for k, v in lag.worst.items()},
        "target_proxy_over_direct": 0.95,
    }


async def _weight_sync(
    engine: Any, work: Path, steps: int, episodes: int, max_len: int = 4096
) -> dict[str, Any]:
    from legorl.bench.train import toy_like_samples
    from legorl.train.config import TrainConfig
    from legorl.train.model import load_policy
    from legorl.train.trainer import train

    samples = toy_like_samples(load_policy(_model()), episodes, max_len=max_len)
    model, sync_s, step_s = _model(), [], []
    for k in range(steps):
        ckpt = work / f"ckpt-{k}"
        config = TrainConfig(steps=1, lr=1e-4, drop_zero_variance_groups=False)
        result = await asyncio.to_thread(train, samples, model=model, out=ckpt, config=config)
        step_s += [float(m.value or 0) for m in result.metrics if m.name == "step_s"]
        t0 = time.perf_counter()
        await engine.load_weights(str(ckpt.resolve()))
        sync_s.append(time.perf_counter() - t0)
        model = ckpt
    sync, step = statistics.median(sync_s), statistics.median(step_s)
    return {
        "steps": steps,
        "samples": len(samples),
        "tokens": sum(len(s.input_ids) for s in samples),
        "policy_version": engine.policy_version,
        "sync_s": round(sync, 4),
        "train_step_s": round(step, 4),
        "sync_over_step": round(sync / step, 4),
    }


def bench_vllm(quick: bool = False) -> dict[str, Any]:
    python = _vllm_python()
    if python is None:
        return {"skipped": "no vLLM installed (set LEGORL_VLLM_PYTHON or make .venv-vllm)"}
    from legorl.engines import make_engine

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        engine = make_engine(
            "vllm",
            model_path=str(_model()),
            python=python,
            max_model_len=4096,
            log_path=str(work / "vllm-server.log"),
        )

        async def run() -> dict[str, Any]:
            try:
                # quick (CI): every step of both figures, once and small
                ratio = await _proxy_ratio(
                    engine, work, passes=1 if quick else 5, rounds=2 if quick else 4, max_tokens=64
                )
                sync = await (
                    _weight_sync(engine, work, steps=1, episodes=1, max_len=2048)
                    if quick
                    else _weight_sync(engine, work, steps=4, episodes=4)
                )
                return {"model": _model().name, "dtype": "float32", "proxy": ratio, "sync": sync}
            finally:
                await engine.close()

        return asyncio.run(run())
