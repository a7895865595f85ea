"""The embedded engine: streaming, exact log-probs, prefix reuse, batching of concurrent
sessions, seeds, context limits, weight swaps under load, bf16, and the registry."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from engine_refs import (
    IM_END,
    MODEL,
    MOE_MODEL,
    agreement,
    chat_prompt,
    collect,
    reference_logprobs,
    reference_model,
)
from transformers import AutoModelForCausalLM

from legorl.engines import ENGINES, EmbeddedEngine, make_engine
from legorl.engines.models import token_logprobs
from legorl.protocols import ContextLengthError, Engine, EngineError, GenerationRequest


@pytest_asyncio.fixture
async def engine() -> AsyncIterator[EmbeddedEngine]:
    eng = make_engine("embedded", model_path=str(MODEL))
    assert isinstance(eng, EmbeddedEngine)
    yield eng
    await eng.close()


def ids_of(steps: list) -> list[int]:
    return [s.token_id for s in steps]


def lps_of(steps: list) -> list[float]:
    return [s.logprob for s in steps]


@pytest.mark.asyncio
async def test_streams_tokens_with_exact_logprobs(engine: EmbeddedEngine) -> None:
    assert isinstance(engine, Engine)
    prompt = chat_prompt("Please list the files in the repository.")
    request = GenerationRequest(
        prompt_ids=prompt, max_tokens=120, temperature=0.7, top_p=0.9, seed=3
    )
    steps = []
    generated_at_first_chunk = None
    async for chunk in engine.generate(request):
        if generated_at_first_chunk is None:
            generated_at_first_chunk = engine.stats.generated_tokens
        steps.extend(chunk)
    assert len(steps) == 120
    # real streaming: the first tokens arrived while the rest were still being sampled
    assert generated_at_first_chunk is not None and generated_at_first_chunk < 120
    ids = ids_of(steps)
    reference = reference_logprobs(reference_model(), prompt + ids, len(prompt), 0.7)
    max_delta, pearson = agreement(lps_of(steps), reference)
    assert max_delta < 1e-4 and pearson > 0.9999, (max_delta, pearson)


def test_chunked_logprob_helper_matches_full_logits() -> None:
    model = reference_model()
    ids = chat_prompt("hello there, how are you?") + list(range(300, 340))
    for temperature in (1.0, 0.6, 0.0):
        ours = token_logprobs(model, ids, start=10, temperature=temperature, chunk=7)
        ref = reference_logprobs(model, ids, 10, temperature)
        assert agreement(ours, ref)[0] < 1e-5


@pytest.mark.asyncio
async def test_stops_after_a_stop_token(engine: EmbeddedEngine) -> None:
    prompt = chat_prompt("Say something short.")
    # find a seed whose completion hits <|im_end|> within the limit, then check it stopped there
    for seed in range(40):
        steps, _ = await collect(
            engine,
            GenerationRequest(
                prompt_ids=prompt, max_tokens=60, seed=seed, stop_token_ids=[IM_END, 201]
            ),
        )
        ids = ids_of(steps)
        if len(ids) < 60:
            assert ids[-1] in (IM_END, 201)
            assert IM_END not in ids[:-1] and 201 not in ids[:-1]
            return
    pytest.fail("no seed stopped early")


@pytest.mark.asyncio
async def test_prefix_reuse_is_exact_and_saves_prefill(engine: EmbeddedEngine) -> None:
    first = chat_prompt("Open the file and read it.")
    turn1, _ = await collect(
        engine, GenerationRequest(prompt_ids=first, max_tokens=40, seed=1, cache_key="sess-1")
    )
    assert engine.stats.reused_tokens == 0
    # the next call of the session extends prompt + completion, like an agent's next turn
    second = first + ids_of(turn1) + chat_prompt("Now fix the bug.")
    prefill_before = engine.stats.prefill_tokens
    reused, _ = await collect(
        engine, GenerationRequest(prompt_ids=second, max_tokens=40, seed=2, cache_key="sess-1")
    )
    # everything but the last completion token (never fed back) came from the cache
    saved = len(first) + len(turn1) - 1
    assert engine.stats.reused_tokens == saved
    assert engine.stats.prefill_tokens - prefill_before == len(second) - saved
    fresh, _ = await collect(
        engine, GenerationRequest(prompt_ids=second, max_tokens=40, seed=2, cache_key=None)
    )
    assert ids_of(reused) == ids_of(fresh)
    assert agreement(lps_of(reused), lps_of(fresh))[0] < 1e-4
    reference = reference_logprobs(reference_model(), second + ids_of(reused), len(second), 1.0)
    assert agreement(lps_of(reused), reference)[0] < 1e-4
    # a diverging prompt (history edited) reuses only the common part
    edited = [*first[:-3], 500, 501, 502, *ids_of(turn1)]
    before = engine.stats.reused_tokens
    await collect(
        engine, GenerationRequest(prompt_ids=edited, max_tokens=5, seed=2, cache_key="sess-1")
    )
    assert engine.stats.reused_tokens - before == len(first) - 3


@pytest.mark.asyncio
async def test_concurrent_sessions_are_batched(engine: EmbeddedEngine) -> None:
    prompts = [chat_prompt(f"Task number {i}: run the tests.") for i in range(8)]

    async def session(i: int) -> list:
        steps, _ = await collect(
            engine, GenerationRequest(prompt_ids=prompts[i], max_tokens=48, seed=i)
        )
        return steps

    results = await asyncio.gather(*(session(i) for i in range(8)))
    assert [len(r) for r in results] == [48] * 8
    assert engine.stats.batched_steps > 0 and engine.stats.max_batch >= 4, engine.stats
    # fewer forwards than tokens: several sessions advanced per decode step
    assert engine.stats.decode_steps < 8 * 47
    for i in (0, 5):
        ids = ids_of(results[i])
        ref = reference_logprobs(reference_model(), prompts[i] + ids, len(prompts[i]), 1.0)
        assert agreement(lps_of(results[i]), ref)[0] < 1e-4
    # batching does not change what a seed samples
    alone, _ = await collect(
        engine, GenerationRequest(prompt_ids=prompts[5], max_tokens=48, seed=5)
    )
    assert ids_of(alone) == ids_of(results[5])


@pytest.mark.asyncio
async def test_seed_and_greedy(engine: EmbeddedEngine) -> None:
    prompt = chat_prompt("Write a function.")
    a, _ = await collect(engine, GenerationRequest(prompt_ids=prompt, max_tokens=30, seed=11))
    b, _ = await collect(engine, GenerationRequest(prompt_ids=prompt, max_tokens=30, seed=11))
    c, _ = await collect(engine, GenerationRequest(prompt_ids=prompt, max_tokens=30, seed=12))
    assert ids_of(a) == ids_of(b) and lps_of(a) == lps_of(b)
    assert ids_of(a) != ids_of(c)
    greedy, _ = await collect(
        engine, GenerationRequest(prompt_ids=prompt, max_tokens=20, temperature=0.0)
    )
    ids = ids_of(greedy)
    with torch.no_grad():
        logits = reference_model()(torch.tensor([prompt + ids])).logits[0]
    assert ids == logits[len(prompt) - 1 : -1].argmax(-1).tolist()
    # greedy log-probs are reported at temperature 1
    ref = reference_logprobs(reference_model(), prompt + ids, len(prompt), 1.0)
    assert agreement(lps_of(greedy), ref)[0] < 1e-4


@pytest.mark.asyncio
async def test_context_length() -> None:
    engine = make_engine("embedded", model_path=str(MODEL), max_context=32)
    try:
        assert engine.max_context == 32
        with pytest.raises(ContextLengthError) as err:
            async for _ in engine.generate(GenerationRequest(prompt_ids=[5] * 32, max_tokens=4)):
                pytest.fail("yielded before the context error")
        assert err.value.prompt_tokens == 32 and err.value.max_context == 32
        # a prompt that fits generates until the context is full, then stops
        steps, _ = await collect(
            engine, GenerationRequest(prompt_ids=[5] * 20, max_tokens=100, seed=0)
        )
        assert len(steps) == 12
        with pytest.raises(EngineError):
            await collect(engine, GenerationRequest(prompt_ids=[], max_tokens=4))
    finally:
        await engine.close()
    default = make_engine("embedded", model_path=str(MODEL))
    assert default.max_context == 4096  # max_position_embeddings of the tiny model
    await default.close()


@pytest.mark.asyncio
async def test_cancelled_request_does_not_disturb_others(engine: EmbeddedEngine) -> None:
    prompt = chat_prompt("Explain the code.")

    async def abandon() -> int:
        got = 0
        stream = engine.generate(GenerationRequest(prompt_ids=prompt, max_tokens=400, seed=1))
        async for chunk in stream:
            got += len(chunk)
            if got >= 3:
                break
        await stream.aclose()
        return got

    other = asyncio.create_task(
        collect(engine, GenerationRequest(prompt_ids=prompt, max_tokens=60, seed=2))
    )
    assert await abandon() >= 3
    steps, _ = await other
    assert len(steps) == 60
    await asyncio.sleep(0.05)
    # the abandoned sequence left the batch long before its 400 tokens
    assert engine.stats.generated_tokens < 400


@pytest.mark.asyncio
async def test_load_weights_while_requests_are_in_flight(
    engine: EmbeddedEngine, tmp_path: Path
) -> None:
    old = reference_model()
    new = AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=torch.float32)
    with torch.no_grad():
        new.lm_head.weight.mul_(0.5)  # a visibly different policy, same architecture
    new.save_pretrained(tmp_path / "ckpt")
    new.eval()

    prompts = [chat_prompt(f"Session {i}: look at the logs.") for i in range(6)]
    first_chunk = [asyncio.Event() for _ in range(4)]

    async def session(i: int) -> list:
        steps = []
        async for chunk in engine.generate(
            GenerationRequest(prompt_ids=prompts[i], max_tokens=60, seed=i, cache_key=f"s{i}")
        ):
            steps.extend(chunk)
            if i < 4:
                first_chunk[i].set()
        return steps

    running = [asyncio.create_task(session(i)) for i in range(4)]
    for event in first_chunk:
        await event.wait()
    load = asyncio.create_task(engine.load_weights(str(tmp_path / "ckpt")))
    assert not any(task.done() for task in running)  # the swap is asked for mid-generation
    await asyncio.sleep(0.01)
    late = [asyncio.create_task(session(i)) for i in (4, 5)]  # arrive during the swap: they wait
    version = await load
    results = await asyncio.gather(*running, *late)
    assert version == 1 and engine.policy_version == 1 and engine.stats.weight_loads == 1
    assert [len(r) for r in results] == [60] * 6
    drained = engine.last_drain_s  # the swap's wait for the four calls' remaining tokens
    assert drained is not None and drained > 0
    for i, steps in enumerate(results):
        ids = ids_of(steps)
        model = old if i < 4 else new  # in flight: old weights throughout; waited: new weights
        ref = reference_logprobs(model, prompts[i] + ids, len(prompts[i]), 1.0)
        assert agreement(lps_of(steps), ref)[0] < 1e-4, i
    # prefix caches from before the swap were dropped: nothing of session 0 is reused
    reused = engine.stats.reused_tokens
    follow = prompts[0] + ids_of(results[0])
    await collect(engine, GenerationRequest(prompt_ids=follow, max_tokens=4, cache_key="s0"))
    assert engine.stats.reused_tokens == reused
    with pytest.raises(EngineError):
        await engine.load_weights(str(tmp_path / "missing"))
    assert engine.policy_version == 1
    assert engine.last_drain_s is not None and engine.last_drain_s < drained  # nothing in flight


@pytest.mark.asyncio
async def test_bfloat16() -> None:
    engine = make_engine("embedded", model_path=str(MODEL), dtype="bfloat16")
    try:
        prompt = chat_prompt("Summarise the issue.")
        results = await asyncio.gather(
            *(
                collect(engine, GenerationRequest(prompt_ids=prompt, max_tokens=30, seed=s))
                for s in range(3)
            )
        )
        model = reference_model(MODEL, torch.bfloat16)
        for steps, _ in results:
            assert len(steps) == 30
            lps = lps_of(steps)
            assert all(lp <= 0 and lp == lp for lp in lps)
            ref = reference_logprobs(model, prompt + ids_of(steps), len(prompt), 1.0)
            max_delta, pearson = agreement(lps, ref)
            # bf16 matmuls differ between a batched decode and one full pass (FACTS.md: ~0.08)
            assert max_delta < 0.25 and pearson > 0.99, (max_delta, pearson)
    finally:
        await engine.close()


@pytest.mark.asyncio
async def test_moe_model_batched() -> None:
    engine = make_engine("embedded", model_path=str(MOE_MODEL))
    try:
        prompts = [chat_prompt(f"MoE session {i}") for i in range(3)]
        results = await asyncio.gather(
            *(
                collect(engine, GenerationRequest(prompt_ids=p, max_tokens=24, seed=i))
                for i, p in enumerate(prompts)
            )
        )
        model = reference_model(MOE_MODEL)
        for p, (steps, _) in zip(prompts, results, strict=True):
            ref = reference_logprobs(model, p + ids_of(steps), len(p), 1.0)
            assert agreement(lps_of(steps), ref)[0] < 1e-4
        assert engine.stats.batched_steps > 0
    finally:
        await engine.close()


def test_registry_and_configs() -> None:
    assert set(ENGINES) == {"embedded", "forced", "vllm"}
    with pytest.raises(ValueError, match="unknown engine"):
        make_engine("nope")
    with pytest.raises(ValueError, match="unknown option"):
        make_engine("embedded", model_path=str(MODEL), batch=3)


def test_importing_engines_does_not_import_torch() -> None:
    code = "import sys, legorl.engines; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.asyncio
async def test_a_failing_step_fails_its_requests_only(engine: EmbeddedEngine) -> None:
    real = engine._model
    calls = 0

    class Flaky:
        """The model, except that its second forward call raises."""

        def __getattr__(self, name: str) -> object:
            return getattr(real, name)

        def __call__(self, *args: object, **kwargs: object) -> object:
            nonlocal calls
            calls += 1
            if calls == 2:
                raise RuntimeError("simulated device error")
            return real(*args, **kwargs)

    engine._model = Flaky()
    prompt = chat_prompt("anything")
    with pytest.raises(EngineError, match="simulated device error"):
        await collect(engine, GenerationRequest(prompt_ids=prompt, max_tokens=10, seed=0))
    steps, _ = await collect(engine, GenerationRequest(prompt_ids=prompt, max_tokens=10, seed=0))
    assert len(steps) == 10  # the engine keeps serving


# ---- the grown K/V cache (engines/kvcache.py) against transformers' DynamicCache -----------


def test_grown_cache_layer_matches_a_full_forward() -> None:
    from legorl.engines.kvcache import GrowingLayer, grown_cache, kv_views

    model = reference_model()
    ids = chat_prompt("Grow the cache past its first buffer.") + list(range(400, 440))
    prompt = 9
    with torch.inference_mode():
        full = model(torch.tensor([ids])).logits[0]  # [T, V]
        # room for 3 tokens: the prompt alone overflows it, then every few steps it doubles
        cache = grown_cache(model.config, None, capacity=3)
        steps = [model(input_ids=torch.tensor([ids[:prompt]]), cache=cache).logits[0, -1]]
        for pos in range(prompt, len(ids)):
            out = model(
                input_ids=torch.tensor([[ids[pos]]]),
                position_ids=torch.tensor([[pos]]),
                cache=cache,
            )
            steps.append(out.logits[0, -1])
    layers = cache.layers
    assert all(isinstance(layer, GrowingLayer) for layer in layers)
    assert layers[0].length == len(ids) and layers[0].grows >= 3, layers[0].grows
    assert layers[0].capacity >= len(ids)
    got = torch.stack(steps)  # logits for positions prompt-1 .. T-1
    assert (got - full[prompt - 1 :]).abs().max() < 1e-4
    # the views cover exactly the filled columns
    keys, values = kv_views(cache)[0]
    assert keys.shape[-2] == values.shape[-2] == len(ids)


@pytest.fixture
def grow_spy(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts real buffer doublings (the method still runs)."""
    from legorl.engines.kvcache import GrowingLayer

    grown: list[int] = []
    real = GrowingLayer._grow

    def counting(self: GrowingLayer, need: int) -> None:
        grown.append(need)
        real(self, need)

    monkeypatch.setattr(GrowingLayer, "_grow", counting)
    return grown


def _mixed_prompts() -> list[list[int]]:
    return [chat_prompt("Hi."), chat_prompt("Read the file. " * 4), [7] * 50]


async def _mixed_batch(kv_cache: str) -> tuple[list[list], EmbeddedEngine]:
    engine = make_engine("embedded", model_path=str(MODEL), kv_cache=kv_cache)
    assert isinstance(engine, EmbeddedEngine)
    # the middle one leaves early (the batch is rebuilt with room for twice its width); the
    # other two then decode past that room, so the buffers double mid-batch
    lengths = (150, 40, 150)
    runs = await asyncio.gather(
        *(
            collect(engine, GenerationRequest(prompt_ids=p, max_tokens=n, seed=20 + i))
            for i, (p, n) in enumerate(zip(_mixed_prompts(), lengths, strict=True))
        )
    )
    return [steps for steps, _ in runs], engine


@pytest.mark.asyncio
async def test_grown_cache_mixed_lengths_in_one_batch(grow_spy: list[int]) -> None:
    grown, engine = await _mixed_batch("grown")
    await engine.close()
    assert engine.stats.max_batch == 3
    assert grow_spy, "decode never outgrew a batch buffer: the test did not exercise growth"
    for prompt, steps in zip(_mixed_prompts(), grown, strict=True):
        ref = reference_logprobs(reference_model(), prompt + ids_of(steps), len(prompt), 1.0)
        assert agreement(lps_of(steps), ref)[0] < 1e-4
    # control: the old DynamicCache path never touches a buffer, and samples the same ids
    before = len(grow_spy)
    dynamic, engine = await _mixed_batch("dynamic")
    await engine.close()
    assert len(grow_spy) == before
    assert [ids_of(s) for s in grown] == [ids_of(s) for s in dynamic]
    worst = max(agreement(lps_of(a), lps_of(b))[0] for a, b in zip(grown, dynamic, strict=True))
    assert worst < 1e-4


@pytest.mark.asyncio
async def test_grown_cache_prefix_eviction_and_reuse() -> None:
    engine = make_engine("embedded", model_path=str(MODEL), prefix_cache_entries=1)
    assert isinstance(engine, EmbeddedEngine)
    try:
        first = {key: chat_prompt(f"Session {key}: open the tests.") for key in "ab"}
        turn1 = {}
        for key in "ab":  # b's prefix evicts a's (one entry kept)
            steps, _ = await collect(
                engine,
                GenerationRequest(prompt_ids=first[key], max_tokens=30, seed=1, cache_key=key),
            )
            turn1[key] = ids_of(steps)
        second = {key: first[key] + turn1[key] + chat_prompt("Go on.") for key in "ab"}
        reused = engine.stats.reused_tokens
        a2, _ = await collect(
            engine, GenerationRequest(prompt_ids=second["a"], max_tokens=30, seed=2, cache_key="a")
        )
        assert engine.stats.reused_tokens == reused  # evicted: prefilled from scratch
        # a's finished turn evicted b's prefix in turn; run b again to store and then reuse it
        await collect(
            engine, GenerationRequest(prompt_ids=first["b"], max_tokens=30, seed=1, cache_key="b")
        )
        b2, _ = await collect(
            engine, GenerationRequest(prompt_ids=second["b"], max_tokens=30, seed=2, cache_key="b")
        )
        assert engine.stats.reused_tokens - reused == len(first["b"]) + len(turn1["b"]) - 1
        for key, steps in (("a", a2), ("b", b2)):
            prompt = second[key]
            ref = reference_logprobs(reference_model(), prompt + ids_of(steps), len(prompt), 1.0)
            assert agreement(lps_of(steps), ref)[0] < 1e-4, key
        fresh, _ = await collect(
            engine, GenerationRequest(prompt_ids=second["b"], max_tokens=30, seed=2)
        )
        assert ids_of(fresh) == ids_of(b2)
    finally:
        await engine.close()


def test_kv_cache_option_is_checked() -> None:
    with pytest.raises(ValueError, match="kv_cache must be 'grown' or 'dynamic', got 'static'"):
        make_engine("embedded", model_path=str(MODEL), kv_cache="static")


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True])
def test_threads_option_is_checked(bad: object) -> None:
    message = f"threads must be a positive integer or None, got {bad!r}"
    with pytest.raises(ValueError, match=re.escape(message)):
        make_engine("embedded", model_path=str(MODEL), threads=bad)


@pytest.mark.asyncio
async def test_threads_option_sets_the_workers_threads_only() -> None:
    import torch

    before = torch.get_num_threads()
    wanted = 2 if before != 2 else 1
    engine = make_engine("embedded", model_path=str(MODEL), threads=wanted)
    try:
        steps, _ = await collect(engine, GenerationRequest(prompt_ids=[5, 6, 7], max_tokens=2))
        assert len(steps) == 2
        assert engine.stats.threads == wanted  # type: ignore[attr-defined]
        assert torch.get_num_threads() == before  # the caller's thread keeps its own
    finally:
        await engine.close()
