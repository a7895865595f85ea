"""The vllm engine's replicas (engines/replicas.py): placement, fleet weight sync, failover and
rejoining, against FAKE vLLM servers (tests/engines/fake_vllm.py: vLLM's HTTP shapes, no model;
``kill`` ends one as a killed process would). These check the routing logic; the acceptance
test with two real vLLM servers, one killed mid-rollout, is tests/engines/test_vllm_replicas.py.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from engine_refs import collect
from fake_vllm import FakeVllm

from legorl.engines import VllmEngine, make_engine
from legorl.engines.replicas import session_of
from legorl.engines.vllm_client import replica_devices
from legorl.protocols import ConfigError, EngineError, EngineRequestError, GenerationRequest

MODEL = Path(__file__).resolve().parents[2] / "fixtures" / "models" / "tiny-agent"


@pytest.fixture
def pair() -> Iterator[tuple[FakeVllm, FakeVllm]]:
    journal: list[tuple[str, str]] = []
    with (
        FakeVllm(max_model_len=256, journal=journal) as a,
        FakeVllm(max_model_len=256, journal=journal) as b,
    ):
        b.completion = [21, 22, 23, 24, 25, 26]
        b.logprob_step = 0.01  # B's log-probs differ from A's: which one sampled shows
        yield a, b


def fleet(a: FakeVllm, b: FakeVllm, **options: object) -> VllmEngine:
    engine = make_engine("vllm", base_url=f"{a.url},{b.url}", **options)
    assert isinstance(engine, VllmEngine)
    return engine


def request(session: str, *, prompt: list[int] | None = None, **extra: object) -> GenerationRequest:
    return GenerationRequest(
        prompt_ids=prompt or [1, 5, 9], max_tokens=6, cache_key=f"{session}#0", **extra
    )  # type: ignore[arg-type]


async def until(condition: object, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():  # type: ignore[operator]
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def completions(fake: FakeVllm) -> list[dict]:
    return fake.bodies("/v1/completions")


def test_session_keys() -> None:
    assert session_of("run-1#0") == session_of("run-1#3") == "run-1"
    assert session_of("run-1~aux-ab12cd#0") == "run-1"  # a session's aux calls stick with it
    assert session_of(None) is None


@pytest.mark.asyncio
async def test_sticky_sessions_and_least_loaded_placement(pair: tuple[FakeVllm, FakeVllm]) -> None:
    a, b = pair
    engine = fleet(a, b, health_interval_s=0)
    a.hold.clear()  # s1's call stays in flight on A
    first = request("s1")
    held = asyncio.create_task(collect(engine, first))
    await until(lambda: completions(a))
    assert first.placement.replica == a.url and not completions(b)
    # a new session goes to the replica with the fewest calls in flight: B
    second = request("s2")
    await collect(engine, second)
    assert second.placement.replica == b.url and len(completions(b)) == 1
    # s1 sticks to A although A is the busier one; s2 sticks to B
    again = request("s1")
    also = asyncio.create_task(collect(engine, again))
    await until(lambda: len(completions(a)) == 2)
    await collect(engine, request("s2"))
    assert len(completions(b)) == 2
    a.hold.set()
    (steps, _), _ = await asyncio.gather(held, also)
    assert [s.token_id for s in steps] == a.completion
    assert again.placement.replica == a.url and again.placement.failed == []
    assert engine.replica_of("s1") == a.url and engine.replica_of("s2") == b.url
    # with nothing in flight, new sessions spread: the fewer sessions first
    third, fourth = request("s3"), request("s4")
    await collect(engine, third)
    await collect(engine, fourth)
    assert {third.placement.replica, fourth.placement.replica} == {a.url, b.url}
    await engine.close()


@pytest.mark.asyncio
async def test_weight_sync_reaches_every_replica_before_any_call(
    pair: tuple[FakeVllm, FakeVllm],
) -> None:
    a, b = pair
    engine = fleet(a, b, weight_reload="collective_rpc", health_interval_s=0)
    a.hold.clear()
    in_flight = asyncio.create_task(collect(engine, request("s1")))
    await until(lambda: completions(a))
    sync = asyncio.create_task(engine.load_weights("/ckpt/step-1"))
    await asyncio.sleep(0.2)
    assert not sync.done()  # it waits for the call in flight (on A)...
    assert not a.bodies("/collective_rpc") and not b.bodies("/collective_rpc")
    late = asyncio.create_task(collect(engine, request("s2")))  # ...and holds new calls
    await asyncio.sleep(0.2)
    assert len(completions(b)) == 0
    a.hold.set()
    assert await sync == 1 and engine.policy_version == 1
    assert engine.last_drain_s is not None and engine.last_drain_s >= 0.4  # held that long
    await late
    await in_flight
    journal = [(url, path) for url, path in a.journal if path != "/v1/models"]
    resets = [i for i, (_, path) in enumerate(journal) if path == "/reset_prefix_cache"]
    reloads = {url for url, path in journal if path == "/collective_rpc"}
    assert reloads == {a.url, b.url} and len(resets) == 2
    calls = [i for i, (_, path) in enumerate(journal) if path == "/v1/completions"]
    # the call in flight before both reloads; the held one after both resets
    assert calls[0] < min(resets) and calls[1] > max(resets)
    assert [s["state"] for s in engine.status()] == ["up", "up"]
    assert [s["version"] for s in engine.status()] == [1, 1]
    await engine.close()


@pytest.mark.asyncio
async def test_a_killed_replica_s_call_goes_on_elsewhere(pair: tuple[FakeVllm, FakeVllm]) -> None:
    a, b = pair
    engine = fleet(a, b, health_interval_s=0)
    a.hold.clear()
    call = request("s1", stream=False)
    task = asyncio.create_task(collect(engine, call))
    await until(lambda: completions(a))
    a.kill()  # A dies with s1's call on it, before any token came back
    steps, _ = await task
    # everything recorded is B's: its tokens and its log-probs
    assert [(s.token_id, s.logprob) for s in steps] == [
        (t, round(-0.01 * (i + 1), 6)) for i, t in enumerate(b.completion)
    ]
    assert call.placement.replica == b.url and call.placement.failed == [a.url]
    assert call.placement.reprefilled_tokens == 3 and call.placement.resumed_at == 0
    assert completions(b)[0]["prompt"] == [1, 5, 9]  # the whole prompt, as token ids
    assert [s["state"] for s in engine.status()] == ["down", "up"]
    assert "out of rotation" in engine.events[0] and a.url in engine.events[0]
    # s1 now sticks to B; a new session goes to B without trying A
    later = request("s1")
    await collect(engine, later)
    fresh = request("s9")
    await collect(engine, fresh)
    assert later.placement.replica == fresh.placement.replica == b.url
    assert later.placement.failed == fresh.placement.failed == []
    await engine.close()


@pytest.mark.asyncio
async def test_a_stream_cut_mid_way_goes_on_from_the_tokens_already_sent(
    pair: tuple[FakeVllm, FakeVllm],
) -> None:
    a, b = pair
    engine = fleet(a, b, health_interval_s=0)
    call = request("s1", stream=True)
    got: list[tuple[int, float]] = []
    gen = engine.generate(call)
    a.chunk_delay_s = 0.5  # A sends its first token; it dies before the second
    first = await anext(gen)
    got += [(s.token_id, s.logprob) for s in first]
    a.kill()
    async for chunk in gen:
        got += [(s.token_id, s.logprob) for s in chunk]
    assert got[0] == (a.completion[0], -0.1)  # what went out from A stays
    assert got[1:] == [(t, round(-0.01 * (i + 1), 6)) for i, t in enumerate(b.completion[:5])]
    (resumed,) = completions(b)
    assert resumed["prompt"] == [1, 5, 9, a.completion[0]] and resumed["max_tokens"] == 5
    assert call.placement.resumed_at == 1 and call.placement.reprefilled_tokens == 4
    assert call.placement.failed == [a.url] and call.placement.replica == b.url
    await engine.close()


@pytest.mark.asyncio
async def test_a_hung_replica_is_taken_out_and_its_call_cut(
    pair: tuple[FakeVllm, FakeVllm],
) -> None:
    a, b = pair
    engine = fleet(a, b, health_interval_s=0.05, health_timeout_s=0.2)
    a.hold.clear()
    a.stall_health = True  # neither its completions nor its /health answer
    call = request("s1", stream=False)
    steps, _ = await asyncio.wait_for(collect(engine, call), 10)
    assert [s.token_id for s in steps] == b.completion
    assert call.placement.failed == [a.url] and call.placement.stalled_s > 0.2
    assert "no answer to /health within 0.2 s, 2 times in a row" in engine.status()[0]["why"]
    a.hold.set()
    await engine.close()


@pytest.mark.asyncio
async def test_the_control_without_the_watcher_a_hung_replica_holds_its_call(
    pair: tuple[FakeVllm, FakeVllm],
) -> None:
    a, b = pair
    engine = fleet(a, b, health_interval_s=0)
    a.hold.clear()
    a.stall_health = True
    task = asyncio.create_task(collect(engine, request("s1", stream=False)))
    await asyncio.sleep(1.0)
    assert not task.done() and not completions(b)  # nothing else would have cut it
    a.hold.set()
    await task
    await engine.close()


@pytest.mark.asyncio
async def test_no_replica_left_is_an_engine_error_and_the_api_s_error(
    pair: tuple[FakeVllm, FakeVllm],
) -> None:
    from legorl.proxy.core import ProxyConfig, ProxyCore

    a, b = pair
    engine = fleet(a, b, health_interval_s=0)
    with tempfile.TemporaryDirectory() as out:
        core = ProxyCore(ProxyConfig(model=MODEL, out=out), engine)
        route = core.open_session("run-1")
        a.kill()
        b.kill()
        answer = await core.handle(
            "POST",
            f"{route}/v1/messages",
            "",
            {},
            orjson.dumps(
                {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
            ),
        )
        assert answer.status == 503
        error = orjson.loads(answer.body)  # type: ignore[arg-type]
        assert error["type"] == "error" and "no vLLM replica left" in error["error"]["message"]
        assert a.url in error["error"]["message"] and b.url in error["error"]["message"]
        report = core.close_session("run-1")
        # the rollout records such an episode as proxy_error (the engine failed it last)
        assert report is not None and report.failed_last and report.completions == 0
        core.close()
    with pytest.raises(EngineError, match="no vLLM replica left"):
        await collect(engine, request("s2"))
    await engine.close()


@pytest.mark.asyncio
async def test_a_replica_rejoins_only_after_a_sync_to_the_current_weights(
    pair: tuple[FakeVllm, FakeVllm],
) -> None:
    a, b = pair
    engine = fleet(a, b, weight_reload="collective_rpc", health_interval_s=0.05)
    await collect(engine, request("s0"))  # the watcher runs
    a.kill()
    await until(lambda: engine.status()[0]["state"] == "down")  # its probe is refused
    assert await engine.load_weights("/ckpt/step-1") == 1
    assert not a.bodies("/collective_rpc") and len(b.bodies("/collective_rpc")) == 1
    for _ in range(3):  # meanwhile every session goes to B
        call = request("s1")
        await collect(engine, call)
        assert call.placement.replica == b.url
    a.revive()
    await until(lambda: engine.status()[0]["state"] == "up")
    # it was reloaded with the current checkpoint and its cache reset before it took a call
    rpc = a.bodies("/collective_rpc")
    assert rpc == [{"method": "reload_weights", "kwargs": {"weights_path": "/ckpt/step-1"}}]
    assert len(a.bodies("/reset_prefix_cache")) == 1
    assert (
        engine.status()[0]["version"] == 1 and "rejoined at policy version 1" in engine.events[-1]
    )
    fresh = request("s2")
    await collect(engine, fresh)
    assert fresh.placement.replica == a.url  # the least loaded again
    await engine.close()


def test_a_replica_that_never_answers_at_start(
    pair: tuple[FakeVllm, FakeVllm], capfd: pytest.CaptureFixture[str]
) -> None:
    a, b = pair
    b.kill()
    with pytest.raises(EngineError) as caught:
        fleet(a, b)
    message = str(caught.value)
    assert message.startswith("1 of 2 vLLM replicas answer, min_replicas=2: ")
    assert f"{b.url}: vLLM server at {b.url} unreachable" in message and a.url not in message
    engine = fleet(a, b, min_replicas=1, health_interval_s=0)
    (line,) = [x for x in capfd.readouterr().err.splitlines() if "does not answer" in x]
    assert line.startswith(f"legorl: vLLM replica {b.url} does not answer, going on with 1 of 2")
    assert [s["state"] for s in engine.status()] == ["up", "down"]
    with pytest.raises(ConfigError, match="min_replicas: must be between 1 and 2, got 3"):
        fleet(a, b, min_replicas=3)
    with pytest.raises(ConfigError, match="replicas=2 launches servers"):
        fleet(a, b, replicas=2)


def test_replicas_that_serve_different_models_are_refused() -> None:
    differ = r"the vLLM replicas differ: .*max_model_len 64,.*max_model_len 128"
    with (
        FakeVllm(max_model_len=64) as a,
        FakeVllm(max_model_len=128) as b,
        pytest.raises(EngineError, match=differ),
    ):
        make_engine("vllm", base_url=f"{a.url},{b.url}")


def test_each_launched_replica_gets_its_own_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert replica_devices(2, 0, None) == [None, None]  # CPU: nothing set
    assert replica_devices(4, 1, None) == ["0", "1", "2", "3"]
    assert replica_devices(2, 2, "4,5,6,7") == ["4,5", "6,7"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert replica_devices(2, 1, None) == ["2", "3"]
    with pytest.raises(ConfigError, match="needs 4 GPUs, but only 2 are given"):
        replica_devices(2, 2, None)


@pytest.mark.asyncio
async def test_the_turn_records_the_replica_and_the_failover(
    pair: tuple[FakeVllm, FakeVllm],
) -> None:
    from legorl.proxy.core import ProxyConfig, ProxyCore
    from legorl.records import Turn, read_jsonl

    a, b = pair
    engine = fleet(a, b, health_interval_s=0)
    with tempfile.TemporaryDirectory() as out:
        core = ProxyCore(ProxyConfig(model=MODEL, out=out), engine)
        stop = core.tok.stop_ids[0]
        a.completion = [*core.tok.encode("from A"), stop]
        b.completion = [*core.tok.encode("from B"), stop]
        route = core.open_session("run-1")

        async def call(text: str) -> dict:
            messages = [{"role": "user", "content": text}]
            body = {"model": "m", "max_tokens": 16, "messages": messages}
            answer = await core.handle(
                "POST", f"{route}/v1/chat/completions", "", {}, orjson.dumps(body)
            )
            assert answer.status == 200
            return orjson.loads(answer.body)  # type: ignore[arg-type]

        first = await call("one")
        assert first["choices"][0]["message"]["content"] == "from A"
        a.hold.clear()
        second = asyncio.create_task(call("two"))
        await until(lambda: len(completions(a)) == 2)
        a.kill()
        assert (await second)["choices"][0]["message"]["content"] == "from B"
        core.close()
        one, two = read_jsonl(Path(out) / "run-1.jsonl", Turn)
    assert one.replica == a.url and one.failover is None
    assert two.replica == b.url and two.failover is not None
    assert two.failover.failed == [a.url] and two.failover.resumed_at == 0
    assert (
        two.failover.reprefilled_tokens == len(two.prompt_delta) == len(completions(b)[0]["prompt"])
    )
    assert two.completion_ids == b.completion  # B's tokens and log-probs, none of A's
    assert two.completion_logprobs == [round(-0.01 * (i + 1), 6) for i in range(len(b.completion))]
    await engine.close()


def test_check_asks_every_replica(pair: tuple[FakeVllm, FakeVllm]) -> None:
    from legorl.check import RunConfig, check_vllm

    a, b = pair
    urls = f"{a.url},{b.url}"
    row = check_vllm(RunConfig(engine="vllm", engine_options={"base_url": urls}))
    assert row.status == "pass" and f"{a.url} serves policy" in row.reason
    assert f"{b.url} serves policy" in row.reason
    b.kill()
    row = check_vllm(RunConfig(engine="vllm", engine_options={"base_url": urls}))
    assert row.status == "fail" and "1 of 2 replicas answer (min_replicas=2)" in row.reason
    assert f"no vLLM server at {b.url}" in row.reason
    options = {"base_url": urls, "min_replicas": 1}
    row = check_vllm(RunConfig(engine="vllm", engine_options=options))
    assert row.status == "pass" and f"no vLLM server at {b.url}" in row.reason


def test_the_cli_names_a_replica_that_does_not_answer(
    pair: tuple[FakeVllm, FakeVllm], tmp_path: Path
) -> None:
    import os
    import subprocess
    import sys

    a, b = pair
    b.kill()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "legorl.cli.main",
            "proxy",
            "serve",
            "--engine",
            "vllm",
            "--model",
            str(MODEL),
            "--engine-opt",
            f"base_url={a.url},{b.url}",
            "--out",
            str(tmp_path / "turns"),
            "--port",
            "0",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "400", "NO_COLOR": "1"},
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    (line,) = [x for x in done.stderr.splitlines() if "error:" in x]
    assert line.startswith("legorl proxy: error: --engine vllm: 1 of 2 vLLM replicas answer")
    assert f"{b.url}: vLLM server at {b.url} unreachable" in line


def fake_adapter(folder: Path) -> Path:
    """A PEFT adapter folder on the fixture model (the fakes load no weights, only its name)."""
    import json

    folder.mkdir(parents=True)
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "base_model_name_or_path": str(MODEL)}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    (folder / "adapter_model.safetensors").write_bytes(b"")
    return folder


@pytest.fixture
def lora_pair() -> Iterator[tuple[FakeVllm, FakeVllm]]:
    journal: list[tuple[str, str]] = []
    with (
        FakeVllm(model="tiny-agent", max_model_len=256, journal=journal) as a,
        FakeVllm(model="tiny-agent", max_model_len=256, journal=journal) as b,
    ):
        a.lora = b.lora = True
        yield a, b


@pytest.mark.asyncio
async def test_an_adapter_reaches_every_replica_before_any_call_and_a_rejoin_gets_it(
    lora_pair: tuple[FakeVllm, FakeVllm], tmp_path: Path
) -> None:
    a, b = lora_pair
    engine = fleet(a, b, weight_reload="collective_rpc", health_interval_s=0.05)
    adapter = fake_adapter(tmp_path / "adapter")
    a.hold.clear()
    in_flight = asyncio.create_task(collect(engine, request("s1")))
    await until(lambda: completions(a))
    swap = asyncio.create_task(engine.load_weights(str(adapter)))
    await asyncio.sleep(0.2)
    assert not swap.done() and not a.bodies("/v1/load_lora_adapter")  # waits for the call
    late = asyncio.create_task(collect(engine, request("s2")))  # and holds new ones
    await asyncio.sleep(0.2)
    a.hold.set()
    assert await swap == 1
    await late
    await in_flight
    assert (engine.policy_adapter, engine.adapter_versions) == ("policy", {"policy": 1})
    journal = [(url, path) for url, path in a.journal if path != "/health"]
    loads = [i for i, (_, path) in enumerate(journal) if path == "/v1/load_lora_adapter"]
    calls = [i for i, (_, path) in enumerate(journal) if path == "/v1/completions"]
    assert {journal[i][0] for i in loads} == {a.url, b.url}
    assert calls[0] < min(loads) and calls[1] > max(loads)
    served = completions(a) + completions(b)
    assert [body["model"] for body in served] == ["tiny-agent", "policy-v1"]
    # a named adapter beside it: a new LoRA name per version, the one before unloaded
    assert await engine.load_adapter("early", str(adapter)) == 1
    assert await engine.load_adapter("early", str(adapter)) == 2
    assert a.loras == b.loras == {"policy-v1", "early-v2"}
    for key in ("s1", "s2"):  # on whichever replica serves it
        call = request(key, adapter="early")
        await collect(engine, call)
        assert completions(a if call.placement.replica == a.url else b)[-1]["model"] == "early-v2"
    with pytest.raises(EngineRequestError, match="adapter 'late' is not loaded"):
        await collect(engine, request("s1", adapter="late"))
    # a replica that went away (a relaunch holds no adapter) gets them before its first call
    a.kill()
    await until(lambda: engine.status()[0]["state"] == "down")
    a.revive()
    await until(lambda: engine.status()[0]["state"] == "up")
    assert a.loras == {"policy-v1", "early-v2"}
    # full weights again: the policy's adapter goes from every replica, the named one stays
    assert await engine.load_weights("/ckpt/step-2") == 2
    assert engine.policy_adapter is None and engine.adapter_versions == {"early": 2}
    assert a.loras == b.loras == {"early-v2"}
    call = request("s3")
    await collect(engine, call)
    assert completions(a if call.placement.replica == a.url else b)[-1]["model"] == "tiny-agent"
    await engine.close()


@pytest.mark.asyncio
async def test_kept_adapter_versions_serve_requests_that_name_them_and_rejoin_with_them(
    lora_pair: tuple[FakeVllm, FakeVllm], tmp_path: Path
) -> None:
    a, b = lora_pair
    engine = fleet(a, b, weight_reload="collective_rpc", health_interval_s=0.05, keep_versions=2)
    adapter = fake_adapter(tmp_path / "adapter")
    for version in (1, 2, 3):
        assert await engine.load_weights(str(adapter)) == version
    assert engine.held_versions == {"policy": [2, 3]}
    assert a.loras == b.loras == {"policy-v2", "policy-v3"}  # v1 unloaded everywhere

    async def served(**extra: object) -> str:
        call = request("s1", **extra)
        await collect(engine, call)
        return str(completions(a if call.placement.replica == a.url else b)[-1]["model"])

    assert await served(adapter_version=2) == "policy-v2"  # an episode that started on v2
    assert await served() == "policy-v3"
    assert await served(adapter_version=1) == "policy-v3"  # no longer held: the current one
    # a replica that went away rejoins holding both kept versions
    a.kill()
    await until(lambda: engine.status()[0]["state"] == "down")
    a.revive()
    await until(lambda: engine.status()[0]["state"] == "up")
    assert a.loras == {"policy-v2", "policy-v3"}
    await engine.close()


@pytest.mark.asyncio
async def test_an_adapter_refused_by_every_replica_changes_nothing_by_one_takes_it_out(
    lora_pair: tuple[FakeVllm, FakeVllm], tmp_path: Path
) -> None:
    a, b = lora_pair
    a.lora = b.lora = False  # neither has runtime LoRA loading
    engine = fleet(a, b, health_interval_s=0)
    adapter = fake_adapter(tmp_path / "adapter")
    with pytest.raises(EngineRequestError, match="has no runtime LoRA loading") as err:
        await engine.load_adapter("x", str(adapter))
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in str(err.value)
    assert [s["state"] for s in engine.status()] == ["up", "up"]  # the request's fault
    assert engine.adapter_versions == {} and engine.policy_version == 0
    a.lora = True  # servers started apart: the one without LoRA cannot serve the version
    assert await engine.load_adapter("x", str(adapter)) == 1
    assert [s["state"] for s in engine.status()] == ["up", "down"]
    assert "has no runtime LoRA loading" in engine.status()[1]["why"]
    await engine.close()
