"""Failover figures on REAL vLLM (`python -m legorl.bench --only vllm_failover`): two servers that
legorl launches (``--engine vllm --engine-opt replicas=2``, ``fixtures/models/tiny-agent``,
fp32) behind one in-process proxy, one of them killed (SIGKILL of its process group) while
calls are generating on it.

``SESSIONS`` sessions of ``calls`` streamed OpenAI Chat calls each run at once (half land on
each replica). Once at least two calls are generating on replica 0, its processes are killed.
The figures, from the Turns the proxy wrote:

* ``stalled_s``: per call that failed over, the gap in its token stream: from the dead
  replica's last token (or the call's start, if none had come) to the first token from the
  survivor. Beside it the first-token latency of the calls that did not fail over
  (``first_token_s``), and the ratio of the medians (``stall_over_first_token``).
* ``reprefilled_tokens``: per failed-over call, the prompt tokens (history, plus the tokens the
  dead replica had sent) that the survivor prefilled again; ``reprefilled_over_prompt``: their
  sum over the sum of those calls' own prompt lengths (1.0 when nothing had been sent yet).
* ``kill_to_out_s``: from the SIGKILL to the replica's removal from the rotation.
* ``calls``, ``failed_over``, ``errors`` (always 0 unless failover failed), ``kill_to_done_s``.

Both replicas are warmed first (one short call per session): a fresh vLLM's first calls are
slow, and a stall measured on them would count that too. The kill comes at least 1 s into the
measured rollout.

Without vLLM the section is skipped with a line saying why.
"""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

SESSIONS = 8


async def _episode(core: Any, sid: str, calls: int, max_tokens: int) -> int:
    """One session of ``calls`` streamed calls; returns the number of error answers."""
    import orjson

    route = core.open_session(sid)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a careful coding agent. Use the tools."},
        {"role": "user", "content": f"Task {sid}: area() in geometry/shapes.py is wrong."},
    ]
    tools = [
        {
            "type": "function",
            "function": {
                "name": "bash",
                "description": "Run a command.",
                "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
            },
        }
    ]
    errors = 0
    for k in range(calls):
        body = {
            "model": "policy",
            "messages": messages,
            "tools": tools,
            "max_tokens": max_tokens,
            "temperature": 1.0,
            "stream": True,
        }
        answer = await core.handle(
            "POST", f"{route}/v1/chat/completions", "", {}, orjson.dumps(body)
        )
        text = []
        if answer.status != 200:
            errors += 1
            continue
        async for part in answer.body:
            for line in part.decode().splitlines():
                if line.startswith("data: {"):
                    event = orjson.loads(line[6:])
                    errors += "error" in event
                    for choice in event.get("choices", []):
                        text.append(choice.get("delta", {}).get("content") or "")
        messages += [
            {"role": "assistant", "content": "".join(text)},
            {"role": "user", "content": f"Step {k}: go on."},
        ]
    core.close_session(sid)
    return errors


async def _measure(engine: Any, work: Path, calls: int, max_tokens: int) -> dict[str, Any]:
    from legorl.bench.vllm import _model
    from legorl.proxy.core import ProxyConfig, ProxyCore
    from legorl.records import Turn, read_jsonl

    core = ProxyCore(ProxyConfig(model=_model(), out=work / "turns"), engine)
    # warm both replicas first (a fresh vLLM's first calls are slow), then the measured rollout
    await asyncio.gather(*(_episode(core, f"warm-{i}", 1, 16) for i in range(SESSIONS)))
    sids = [f"fo-{i}" for i in range(SESSIONS)]
    rollout = asyncio.gather(*(_episode(core, sid, calls, max_tokens) for sid in sids))
    await asyncio.sleep(1.0)  # the sessions' calls are under way, some well into their tokens
    deadline = time.monotonic() + 300
    while engine.status()[0]["inflight"] < 2 and not rollout.done():
        if time.monotonic() > deadline:
            raise RuntimeError(f"no calls in flight on replica 0: {engine.status()}")
        await asyncio.sleep(0.02)
    killed = time.monotonic()
    os.killpg(engine.replicas[0].server.proc.pid, signal.SIGKILL)
    errors = sum(await rollout)
    done = time.monotonic()
    core.close()
    turns = [t for sid in sids for t in read_jsonl(work / "turns" / f"{sid}.jsonl", Turn)]
    moved = [t for t in turns if t.failover is not None]
    others = [t.timings.get("first_token_s", 0.0) for t in turns if t.failover is None]
    stalls = [t.failover.stalled_s for t in moved if t.failover is not None]
    prefilled = [t.failover.reprefilled_tokens for t in moved if t.failover is not None]
    first = statistics.median(others) if others else 0.0
    return {
        "sessions": SESSIONS,
        "calls": len(turns),
        "failed_over": len(moved),
        "errors": errors,
        "kill_to_done_s": round(done - killed, 3),
        # from the SIGKILL to the replica's removal from the rotation
        "kill_to_out_s": round(engine.slots[0].down_since - killed, 4),
        "stalled_s": [round(s, 4) for s in stalls],
        "stalled_s_median": round(statistics.median(stalls), 4) if stalls else None,
        "stalled_s_max": round(max(stalls), 4) if stalls else None,
        "first_token_s_median": round(first, 4),
        "stall_over_first_token": round(statistics.median(stalls) / first, 3)
        if stalls and first > 0
        else None,
        "reprefilled_tokens": prefilled,
        "resumed_at": [t.failover.resumed_at for t in moved if t.failover is not None],
        "reprefilled_over_prompt": round(sum(prefilled) / sum(t.prompt_len for t in moved), 4)
        if moved
        else None,
    }


def bench_vllm_failover(quick: bool = False) -> dict[str, Any]:
    from legorl.bench.vllm import _model, _vllm_python

    python = _vllm_python()
    if python is None:
        return {"skipped": "no vLLM installed (set LEGORL_VLLM_PYTHON or make .venv-vllm)"}
    from legorl.engines import make_engine

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        engine: Any = make_engine(
            "vllm",
            model_path=str(_model()),
            python=python,
            replicas=2,
            max_model_len=4096,
            kv_cache_memory="256M",
            relaunch=False,  # the figure is the failover; relaunching would share the CPU
            log_path=str(work / "vllm-server.log"),
        )

        async def run() -> dict[str, Any]:
            try:
                figures = await _measure(
                    engine, work, calls=2 if quick else 4, max_tokens=128 if quick else 256
                )
                return {"model": _model().name, "dtype": "float32", "replicas": 2, **figures}
            finally:
                await engine.close()

        return asyncio.run(run())
