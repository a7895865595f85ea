"""Figures on REAL vLLM, side by side in one run (`python -m legorl.bench --only vllm`), on one
server that legorl launches (``fixtures/models/tiny-agent``, fp32, the engine's own flags):

* proxy / direct: output tokens/s of 16 concurrent sessions through legorl's proxy (chat API:
  rendering, session bookkeeping, Turns written, one more HTTP hop) against the same 16 sessions
  posting to vLLM's ``/v1/completions`` themselves, with the very bodies the ``vllm`` engine
  sends for the prompts the proxy rendered. Greedy, so both sides decode the same tokens; the
  prefix cache is reset before every pass, so neither side is served the other's prefill.
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
import json
import os
import statistics
import tempfile
import time
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


async def _proxy_pass(
    endpoint: Any, served: str, rounds: int, max_tokens: int, tag: str
) -> tuple[int, float]:
    """(output tokens, seconds) of ``SESSIONS`` sessions x ``rounds`` chat calls via the proxy."""
    import httpx

    async with httpx.AsyncClient(timeout=600) as client:

        async def session(i: int) -> int:
            access = await endpoint.open_session(f"{tag}-{i}")
            tokens = 0
            for r in range(rounds):
                body = {
                    "model": served,
                    "messages": _messages(i, r),
                    "max_tokens": max_tokens,
                    "temperature": 0.0,
                }
                answer = await client.post(f"{access.url}/v1/chat/completions", json=body)
                answer.raise_for_status()
                tokens += answer.json()["usage"]["completion_tokens"]
            await endpoint.close_session(f"{tag}-{i}")
            return tokens

        t0 = time.perf_counter()
        counts = await asyncio.gather(*(session(i) for i in range(SESSIONS)))
        return sum(counts), time.perf_counter() - t0


async def _direct_pass(engine: Any, bodies: list[list[dict[str, Any]]]) -> tuple[int, float]:
    """(output tokens, seconds) of the same sessions posting the engine's bodies to vLLM."""
    import httpx

    from legorl.engines.vllm_client import _steps_of

    async with httpx.AsyncClient(timeout=600) as client:

        async def session(calls: list[dict[str, Any]]) -> int:
            tokens = 0
            for body in calls:
                url = f"{engine.base_url}/v1/completions"
                async with client.stream("POST", url, json=body) as response:
                    response.raise_for_status()
                    async for line in response.aiter_lines():
                        data = line[5:].strip() if line.startswith("data:") else ""
                        if data and data != "[DONE]":
                            tokens += len(_steps_of(json.loads(data)))
            return tokens

        t0 = time.perf_counter()
        counts = await asyncio.gather(*(session(calls) for calls in bodies))
        return sum(counts), time.perf_counter() - t0


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


async def _proxy_ratio(engine: Any, work: Path, passes: int, rounds: int, max_tokens: int) -> dict:
    from legorl.rollout import inprocess_proxy

    proxy_rates, direct_rates, tokens = [], [], {}
    async with inprocess_proxy(_model(), engine, work / "turns") as (endpoint, core):
        await _reset_cache(engine)
        await _proxy_pass(endpoint, core.served_name, rounds, max_tokens, "warm")
        bodies = _recorded_bodies(engine, work / "turns", "warm", rounds, max_tokens)
        for k in range(passes):  # interleaved, so drifting machine load hits both alike
            await _reset_cache(engine)
            n, s = await _direct_pass(engine, bodies)
            direct_rates.append(n / s)
            tokens["direct"] = n
            await _reset_cache(engine)
            n, s = await _proxy_pass(endpoint, core.served_name, rounds, max_tokens, f"p{k}")
            proxy_rates.append(n / s)
            tokens["proxy"] = n
    proxy, direct = statistics.median(proxy_rates), statistics.median(direct_rates)
    return {
        "sessions": SESSIONS,
        "calls_per_session": rounds,
        "max_tokens": max_tokens,
        "passes": passes,
        "output_tokens_per_pass": tokens,
        "proxy_tok_s": round(proxy, 1),
        "direct_tok_s": round(direct, 1),
        "proxy_over_direct": round(proxy / direct, 4),
        "target_proxy_over_direct": 0.95,
    }


async def _weight_sync(engine: Any, work: Path, steps: int, episodes: int) -> dict[str, Any]:
    from legorl.bench.train import toy_like_samples
    from legorl.train.config import TrainConfig
    from legorl.train.model import load_policy
    from legorl.train.trainer import train

    samples = toy_like_samples(load_policy(_model()), episodes)
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
                ratio = await _proxy_ratio(
                    engine, work, passes=1 if quick else 3, rounds=2 if quick else 4, max_tokens=64
                )
                sync = await _weight_sync(engine, work, steps=2 if quick else 4, episodes=4)
                return {"model": _model().name, "dtype": "float32", "proxy": ratio, "sync": sync}
            finally:
                await engine.close()

        return asyncio.run(run())
