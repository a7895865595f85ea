"""The vllm engine against a FAKE vLLM server (tests/engines/fake_vllm.py) that answers in
vLLM's documented response shapes; no vLLM runs here."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

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
@pytest.mark.parametrize("stream", [True, False])
async def test_token_ids_in_and_out(server: FakeVllm, stream: bool) -> None:
    engine = client(server, stream=stream)
    assert engine.model == "policy" and engine.max_context == 64  # from /v1/models
    server.completion = [11, 12, 2, 13]
    request = GenerationRequest(
        prompt_ids=[1, 5, 9], max_tokens=10, stop_token_ids=[2], seed=7, cache_key="s"
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
    await asyncio.sleep(0.03)
    assert await engine.load_weights("/ckpt/step-1") == 1
    assert in_flight.done() and len(in_flight.result()[0]) == 6  # finished first, not aborted
    rpc = server.bodies("/collective_rpc")
    assert rpc == [
        {"method": "update_config", "args": [{"model_config": {"model": "/ckpt/step-1"}}]},
        {"method": "reload_weights"},
    ]
    assert len(server.bodies("/reset_prefix_cache")) == 1
    # the order on the wire: the in-flight completion, then the reload calls
    paths = [p for p, _ in server.requests if p != "/v1/models"]
    assert paths == ["/v1/completions", "/collective_rpc", "/collective_rpc", "/reset_prefix_cache"]
    await engine.close()
    await plain.close()


def test_unreachable_server() -> None:
    with pytest.raises(EngineError, match="unreachable"):
        make_engine("vllm", base_url="http://127.0.0.1:9", timeout_s=2)
