"""The vllm engine against a FAKE vLLM server (tests/engines/fake_vllm.py) that answers in
vLLM's documented response shapes, and the launch path's refusals when there is no vLLM; no vLLM
runs here (tests/engines/test_vllm_real.py runs the real one)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from engine_refs import collect
from fake_vllm import FakeVllm

from legorl.engines import VllmEngine, make_engine
from legorl.protocols import ContextLengthError, Engine, EngineError, GenerationRequest


@pytest.fixture
def server() -> Iterator[FakeVllm]:
    with FakeVllm(max_model_len=64) as fake:
        yield fake


def client(server: FakeVllm, **options: object) -> VllmEngine:
    engine = make_engine("vllm", base_url=server.url, **options)
    assert isinstance(engine, VllmEngine) and isinstance(engine, Engine)
    return engine


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("config_stream", "request_stream"), [(True, True), (False, True), (True, False)]
)
async def test_token_ids_in_and_out(
    server: FakeVllm, config_stream: bool, request_stream: bool
) -> None:
    # a request that needs the completion only whole (request_stream False) gets one answer
    stream = config_stream and request_stream
    engine = client(server, stream=config_stream)
    assert engine.model == "policy" and engine.max_context == 64  # from /v1/models
    server.completion = [11, 12, 2, 13]
    request = GenerationRequest(
        prompt_ids=[1, 5, 9],
        max_tokens=10,
        stop_token_ids=[2],
        seed=7,
        cache_key="s",
        stream=request_stream,
    )
    steps, chunks = await collect(engine, request)
    assert [(s.token_id, s.logprob) for s in steps] == [(11, -0.1), (12, -0.2), (2, -0.3)]
    assert chunks == (3 if stream else 1)
    (body,) = server.bodies("/v1/completions")
    assert body["prompt"] == [1, 5, 9]  # token ids, not text
    assert body["model"] == "policy" and body["stream"] is stream
    assert body["logprobs"] == 0 and body["return_tokens_as_token_ids"] is True
    assert body["return_token_ids"] is True and body["ignore_eos"] is True
    assert body["stop_token_ids"] == [2] and body["seed"] == 7
    assert body["top_k"] == 0 and body["temperature"] == 1.0 and body["top_p"] == 1.0
    await engine.close()


@pytest.mark.asyncio
async def test_ids_from_token_strings_when_token_ids_are_absent() -> None:
    from legorl.engines.vllm_client import _steps_of

    chunk = {
        "choices": [
            {
                "index": 0,
                "text": "",
                "logprobs": {
                    "tokens": ["token_id:42", "token_id:7"],
                    "token_logprobs": [-1.5, -0.25],
                    "top_logprobs": [],
                    "text_offset": [],
                },
                "finish_reason": None,
            }
        ]
    }
    assert [(s.token_id, s.logprob) for s in _steps_of(chunk)] == [(42, -1.5), (7, -0.25)]
    with pytest.raises(EngineError, match="return_tokens_as_token_ids"):
        _steps_of({"choices": [{"logprobs": {"tokens": ["hi"], "token_logprobs": [-1.0]}}]})
    with pytest.raises(EngineError, match="stream error"):
        _steps_of({"error": {"message": "boom"}})
    assert _steps_of({"choices": [], "usage": {"prompt_tokens": 3}}) == []


@pytest.mark.asyncio
async def test_context_and_logprob_modes(server: FakeVllm) -> None:
    engine = client(server, max_context=32, model="policy")
    assert server.bodies("/v1/models") == []  # both given: no need to ask the server
    with pytest.raises(ContextLengthError):
        await collect(engine, GenerationRequest(prompt_ids=[1] * 32, max_tokens=4))
    steps, _ = await collect(engine, GenerationRequest(prompt_ids=[1] * 30, max_tokens=50))
    assert server.bodies("/v1/completions")[-1]["max_tokens"] == 2  # clamped to the context
    assert len(steps) == 2
    # raw_logprobs servers report temperature-1 log-probs: other temperatures are refused
    with pytest.raises(EngineError, match="raw_logprobs"):
        await collect(engine, GenerationRequest(prompt_ids=[1], max_tokens=2, temperature=0.7))
    await collect(engine, GenerationRequest(prompt_ids=[1], max_tokens=2, temperature=0.0))
    processed = client(server, logprobs_mode="processed_logprobs")
    await collect(processed, GenerationRequest(prompt_ids=[1], max_tokens=2, temperature=0.7))
    with pytest.raises(EngineError, match="processed_logprobs"):
        await collect(processed, GenerationRequest(prompt_ids=[1], max_tokens=2, top_p=0.9))
    # the server's own context check maps to ContextLengthError too
    server.max_model_len = 16
    with pytest.raises(ContextLengthError):
        await collect(engine, GenerationRequest(prompt_ids=[1] * 20, max_tokens=4))
    await engine.close()
    await processed.close()


@pytest.mark.asyncio
async def test_load_weights(server: FakeVllm) -> None:
    plain = client(server)
    with pytest.raises(NotImplementedError, match="VLLM_SERVER_DEV_MODE"):
        await plain.load_weights("/ckpt/step-1")
    engine = client(server, weight_reload="collective_rpc")
    server.chunk_delay_s = 0.02
    in_flight = asyncio.create_task(
        collect(engine, GenerationRequest(prompt_ids=[1, 2], max_tokens=6))
    )
    while not server.bodies("/v1/completions"):  # the completion is on the server: reload now
        await asyncio.sleep(0.005)
    assert await engine.load_weights("/ckpt/step-1") == 1
    assert in_flight.done() and len(in_flight.result()[0]) == 6  # finished first, not aborted
    rpc = server.bodies("/collective_rpc")
    assert rpc == [{"method": "reload_weights", "kwargs": {"weights_path": "/ckpt/step-1"}}]
    assert len(server.bodies("/reset_prefix_cache")) == 1
    # the order on the wire: the in-flight completion, then the reload calls
    paths = [p for p, _ in server.requests if p.split("?")[0] not in ("/v1/models", "/server_info")]
    assert paths == ["/v1/completions", "/collective_rpc", "/reset_prefix_cache"]
    await engine.close()
    await plain.close()


def test_unreachable_server() -> None:
    with pytest.raises(EngineError, match="unreachable"):
        make_engine("vllm", base_url="http://127.0.0.1:9", timeout_s=2)


# ---- launching: no vLLM where one must be launched (real subprocesses, no vLLM needed) -----------

MODEL = Path(__file__).resolve().parents[2] / "fixtures" / "models" / "tiny-agent"


def test_no_vllm_to_launch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from legorl.engines.vllm_server import VllmLaunchError

    # this test's own Python has no vllm: named as python=…, as $LEGORL_VLLM_PYTHON, on PATH
    with pytest.raises(VllmLaunchError, match=r"--engine-opt python .*: cannot import vllm"):
        make_engine("vllm", model_path=str(MODEL), python=sys.executable)
    monkeypatch.setenv("LEGORL_VLLM_PYTHON", sys.executable)
    with pytest.raises(VllmLaunchError, match=r"\$LEGORL_VLLM_PYTHON .*: cannot import vllm"):
        make_engine("vllm", model_path=str(MODEL))
    monkeypatch.setenv("LEGORL_VLLM_PYTHON", str(tmp_path / "nothing" / "python"))
    with pytest.raises(VllmLaunchError, match="cannot run it"):
        make_engine("vllm", model_path=str(MODEL))
    monkeypatch.delenv("LEGORL_VLLM_PYTHON")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)
    monkeypatch.setenv("PATH", str(bin_dir))
    with pytest.raises(VllmLaunchError, match=r"python3 on PATH .*: cannot import vllm"):
        make_engine("vllm", model_path=str(MODEL))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(VllmLaunchError, match=r"no vLLM to launch: .*LEGORL_VLLM_PYTHON"):
        make_engine("vllm", model_path=str(MODEL))


def test_no_vllm_through_the_cli(tmp_path: Path) -> None:
    env = {**os.environ, "COLUMNS": "300", "NO_COLOR": "1"}
    common = ["--engine", "vllm", "--engine-opt", f"python={sys.executable}"]
    for args in (
        ["proxy", "serve", "--model", str(MODEL), *common, "--out", str(tmp_path / "t")],
        ["check", "--model", str(MODEL), *common, "--sandbox", "none", "--json", "--exit-zero"],
    ):
        done = subprocess.run(
            [sys.executable, "-m", "legorl.cli.main", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        if args[0] == "proxy":
            assert done.returncode == 1, done.stderr
            (line,) = [x for x in done.stderr.splitlines() if "error:" in x]
            assert line.startswith("legorl proxy: error: --engine vllm: --engine-opt python")
            assert "cannot import vllm" in line
        else:
            rows = {r["name"]: r for r in map(json.loads, done.stdout.splitlines())}
            assert (
                rows["vllm"]["status"] == "fail" and "cannot import vllm" in rows["vllm"]["reason"]
            )
            assert rows["engine"]["status"] == "skip"


def test_connect_mode_needs_no_model_path_and_the_cli_passes_one(server: FakeVllm) -> None:
    # the CLI passes model_path=--model to every engine; it once stopped here for vllm
    engine = make_engine("vllm", base_url=server.url, model_path=str(MODEL))
    assert engine.server is None and engine.config.logprobs_mode == "raw_logprobs"
    assert engine.config.weight_reload == "none"  # no /server_info: not in dev mode


@pytest.mark.asyncio
async def test_the_proxy_streams_from_vllm_only_where_the_call_needs_it() -> None:
    """A non-streamed chat call takes vLLM's completion in one answer; a streamed one, or one
    with stop strings (cut where one appears), takes it token by token. The Turn is the same."""
    import orjson

    from legorl.proxy.core import ProxyConfig, ProxyCore
    from legorl.records import Turn, read_jsonl

    with FakeVllm(max_model_len=4096) as fake, tempfile.TemporaryDirectory() as out:
        engine = make_engine("vllm", base_url=fake.url)
        core = ProxyCore(ProxyConfig(model=MODEL, out=out), engine)
        fake.completion = core.tok.encode("hello there") + [core.tok.stop_ids[0]]
        calls = {"plain": {}, "streamed": {"stream": True}, "stop": {"stop": ["zzz"]}}
        for name, extra in calls.items():
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
            response = await core.handle(
                "POST", f"/s/{name}/v1/chat/completions", "", {}, orjson.dumps(body)
            )
            assert response.status == 200
            if response.streaming:
                assert not isinstance(response.body, bytes)
                _ = [part async for part in response.body]
        core.close()
        sent = [body["stream"] for body in fake.bodies("/v1/completions")]
        assert sent == [False, True, True]
        turns = [next(iter(read_jsonl(Path(out) / f"{name}.jsonl", Turn))) for name in calls]
        assert all(t.completion_ids == fake.completion for t in turns)
        assert all(t.completion_logprobs == turns[0].completion_logprobs for t in turns)
        await engine.close()
