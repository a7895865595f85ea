"""LoRA adapters on the embedded engine, proved to be the adapter sampled: after each of several
swaps the served log-probs equal the trainer's recompute under the new adapter and not under the
one before, also on a session whose prefix was cached before the swap; the adapter is read once;
several adapters share one base and one batch; Turns record the adapter and its version."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import orjson
import pytest
from lora_helpers import episodes, mean_gap, recompute, sample, train_adapter

from legorl.engines.embedded import EmbeddedConfig, EmbeddedEngine
from legorl.engines.models import load_tokenizer
from legorl.protocols import BASE_ADAPTER, EngineRequestError
from legorl.proxy.core import ProxyConfig, ProxyCore
from legorl.records import Turn, from_dict, read_jsonl, to_json

pytestmark = pytest.mark.asyncio

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "fixtures" / "models" / "tiny-qwen3"
OTHER = ROOT / "fixtures" / "models" / "tiny-agent"
TOKEN = "lora-admin"


def ids_of(text: str) -> list[int]:
    return load_tokenizer(MODEL)(text)["input_ids"]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Three consecutive adapter versions, each trained from the one before on episodes the
    engine sampled."""
    folder = tmp_path_factory.mktemp("adapters")

    async def make() -> list[Path]:
        engine = EmbeddedEngine(EmbeddedConfig(model_path=str(MODEL)))
        try:
            prompts = [ids_of("def add(a, b):"), ids_of("Fix the failing test in bank.py")]
            samples = await episodes(engine, prompts, seed=0)
        finally:
            await engine.close()
        out, start = [], MODEL
        for v in range(1, 4):
            start = train_adapter(samples, start, folder / f"v{v}")
            out.append(start)
        return out

    return asyncio.run(make())


async def test_each_swap_serves_the_new_adapter_even_on_a_cached_prefix(
    adapters: list[Path], tmp_path: Path
) -> None:
    engine = EmbeddedEngine(EmbeddedConfig(model_path=str(MODEL)))
    try:
        prompt = ids_of("The interval merge is off by one. " * 6)
        ids, _ = await sample(engine, prompt, 8, key="s", seed=1)
        history = prompt + ids
        reused = engine.stats.reused_tokens
        previous = MODEL
        for version, adapter in enumerate(adapters, start=1):
            assert await engine.load_weights(str(adapter)) == version
            assert (engine.policy_adapter, engine.adapter_versions) == (
                "policy",
                {"policy": version},
            )
            # the session goes on from the prefix cached under the previous weights
            history += ids_of(" go on")
            ids, served = await sample(engine, history, 8, key="s", seed=version)
            assert engine.stats.reused_tokens == reused  # the stale prefix was not reused
            assert mean_gap(served, recompute(adapter, history, ids)) < 1e-3
            assert mean_gap(served, recompute(previous, history, ids)) > 1e-2
            # within one version the session's prefix is reused, and still exact
            more = history + ids + ids_of(" next")
            again, served = await sample(engine, more, 8, key="s", seed=10 + version)
            assert engine.stats.reused_tokens > reused
            assert mean_gap(served, recompute(adapter, more, again)) < 1e-3
            history, ids, reused, previous = more, again, engine.stats.reused_tokens, adapter
            history += ids
        # read once: with the folder gone after the swap, the engine serves that adapter on
        served = shutil.copytree(adapters[0], tmp_path / "served")
        assert await engine.load_weights(str(served)) == 4
        shutil.rmtree(served)
        ids, lps = await sample(engine, prompt, 8, seed=7)
        assert mean_gap(lps, recompute(adapters[0], prompt, ids)) < 1e-3
        assert engine.stats.weight_loads == 4
        # full weights after adapters: the policy is the full model again, exactly
        assert await engine.load_weights(str(MODEL)) == 5
        assert engine.policy_adapter is None and engine.adapter_versions == {}
        with pytest.raises(EngineRequestError, match=r"'__base__' .* full weights were loaded"):
            await sample(engine, prompt, 4, adapter=BASE_ADAPTER)  # the base may differ now
        ids, served = await sample(engine, prompt, 8, seed=8)
        assert mean_gap(served, recompute(MODEL, prompt, ids)) < 1e-3
    finally:
        await engine.close()


async def test_several_adapters_share_one_base_and_one_batch(adapters: list[Path]) -> None:
    engine = EmbeddedEngine(EmbeddedConfig(model_path=str(MODEL)))
    try:
        await engine.load_weights(str(adapters[2]))  # the policy: v3
        assert await engine.load_adapter("early", str(adapters[0])) == 1
        assert await engine.load_adapter("early", str(adapters[0])) == 2  # a new version
        assert await engine.load_adapter("mid", str(adapters[1])) == 1
        prompt = ids_of("Return the total of the cart.")
        runs = [
            (None, adapters[2]),
            ("early", adapters[0]),
            ("mid", adapters[1]),
            (BASE_ADAPTER, MODEL),  # the base model, no adapter, in the same batch
        ] * 2
        results = await asyncio.gather(
            *(sample(engine, prompt, 12, adapter=name, seed=i) for i, (name, _) in enumerate(runs))
        )
        assert engine.stats.max_batch >= 2  # they really decoded together
        for (_, folder), (ids, served) in zip(runs, results, strict=True):
            assert mean_gap(served, recompute(folder, prompt, ids)) < 1e-3
        with pytest.raises(EngineRequestError, match="adapter 'late' is not loaded"):
            await sample(engine, prompt, 4, adapter="late")
    finally:
        await engine.close()


async def test_an_adapter_of_another_base_is_refused_by_name(adapters: list[Path]) -> None:
    engine = EmbeddedEngine(EmbeddedConfig(model_path=str(OTHER)))
    try:
        with pytest.raises(EngineRequestError) as err:
            await engine.load_weights(str(adapters[0]))
        assert f"trained on base model {MODEL.resolve()}" in str(err.value)
        assert f"this engine serves {OTHER.resolve()}" in str(err.value)
        assert engine.policy_version == 0 and engine.policy_adapter is None
    finally:
        await engine.close()


async def test_the_proxy_routes_sessions_to_adapters_and_turns_record_them(
    adapters: list[Path], tmp_path: Path
) -> None:
    engine = EmbeddedEngine(EmbeddedConfig(model_path=str(MODEL)))
    core = ProxyCore(ProxyConfig(model=MODEL, out=tmp_path, admin_token=TOKEN), engine)
    admin = {"authorization": f"Bearer {TOKEN}"}

    async def post(path: str, body: dict) -> tuple[int, dict]:
        response = await core.handle("POST", path, "", admin, orjson.dumps(body))
        assert isinstance(response.body, bytes)
        return response.status, json.loads(response.body)

    async def chat(route: str) -> None:
        body = {"model": "m", "max_tokens": 6, "messages": [{"role": "user", "content": "hi"}]}
        response = await core.handle(
            "POST", f"{route}/v1/chat/completions", "", {}, orjson.dumps(body)
        )
        assert response.status == 200, response.body

    try:
        status, answer = await post("/admin/weights", {"path": str(adapters[1])})
        assert (status, answer) == (200, {"policy_version": 1})
        status, answer = await post("/admin/weights", {"path": str(adapters[0]), "adapter": "ab"})
        assert (status, answer) == (
            200,
            {"adapter": "ab", "adapter_version": 1, "policy_version": 1},
        )
        _, opened = await post("/admin/sessions", {"id": "b-side", "adapter": "ab"})
        _, plain = await post("/admin/sessions", {"id": "a-side"})
        await chat(opened["route"])
        await chat(plain["route"])
        (b,) = read_jsonl(tmp_path / "b-side.jsonl", Turn)
        (a,) = read_jsonl(tmp_path / "a-side.jsonl", Turn)
        assert (b.adapter, b.adapter_version, b.policy_version) == ("ab", 1, 1)
        assert (a.adapter, a.adapter_version, a.policy_version) == ("policy", 1, 1)
        # a Turn written before adapters existed reads back with none
        old = orjson.loads(to_json(a))
        del old["adapter"], old["adapter_version"]
        assert from_dict(old, Turn).adapter is None
        gone = {"path": str(ROOT / "fixtures" / "models" / "tiny-agent"), "adapter": "x"}
        status, answer = await post("/admin/weights", gone)
        assert status == 400 and "adapter_config.json: cannot read it" in answer["error"]["message"]
    finally:
        core.close()
        await engine.close()
