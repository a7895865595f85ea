"""The forced engine replays scripted completions exactly, scored by the real model."""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path

import pytest
from engine_refs import (
    IM_END,
    MODEL,
    agreement,
    chat_prompt,
    collect,
    reference_logprobs,
    reference_model,
    tokenizer,
)

from legorl.engines import ForcedEngine, ForcedScript, make_engine
from legorl.protocols import ContextLengthError, Engine, EngineError, GenerationRequest


def forced(script: list | str, **options: object) -> ForcedEngine:
    engine = make_engine("forced", model_path=str(MODEL), script=script, **options)
    assert isinstance(engine, ForcedEngine) and isinstance(engine, Engine)
    return engine


def request(text: str, **fields: object) -> GenerationRequest:
    fields.setdefault("stop_token_ids", [IM_END])
    fields.setdefault("max_tokens", 200)
    return GenerationRequest(prompt_ids=chat_prompt(text), **fields)


@pytest.mark.asyncio
async def test_replays_text_exactly_with_real_logprobs() -> None:
    text = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n</tool_call>'
    engine = forced([{"text": text}], chunk_tokens=3)
    req = request("List the files.", temperature=0.8)
    steps, chunks = await collect(engine, req)
    ids = [s.token_id for s in steps]
    assert ids == [*tokenizer().encode(text, add_special_tokens=False), IM_END]
    assert tokenizer().decode(ids[:-1]) == text
    assert chunks == -(-len(ids) // 3)  # streamed in chunks of three
    ref = reference_logprobs(reference_model(), req.prompt_ids + ids, len(req.prompt_ids), 0.8)
    max_delta, pearson = agreement([s.logprob for s in steps], ref)
    assert max_delta < 1e-4 and pearson > 0.9999
    await engine.close()


@pytest.mark.asyncio
async def test_ids_stop_flag_and_limits() -> None:
    engine = forced(
        [
            {"ids": [300, 301, 302], "stop": False},
            {"ids": [300, IM_END, 305]},  # cut after the first stop token
            {"text": "a fairly long answer that will not fit"},
        ]
    )
    steps, _ = await collect(engine, request("one"))
    assert [s.token_id for s in steps] == [300, 301, 302]
    steps, _ = await collect(engine, request("two"))
    assert [s.token_id for s in steps] == [300, IM_END]
    steps, _ = await collect(engine, request("three", max_tokens=4))
    assert len(steps) == 4
    with pytest.raises(EngineError, match="no scripted completion left"):
        await collect(engine, request("four"))
    assert len(engine.requests) == 3
    await engine.close()


@pytest.mark.asyncio
async def test_match_and_repeat() -> None:
    engine = forced(
        [
            {"text": "title", "match": "Generate a title"},
            {"text": "step one"},
            {"text": "fallback", "repeat": True},
        ]
    )

    async def text_of(prompt: str) -> str:
        steps, _ = await collect(engine, request(prompt))
        return tokenizer().decode([s.token_id for s in steps], skip_special_tokens=True)

    assert await text_of("Fix the bug") == "step one"  # the title entry does not match
    assert await text_of("Generate a title for this chat") == "title"
    assert await text_of("Fix the bug") == "fallback"
    assert await text_of("Generate a title again") == "fallback"  # used up: repeat serves
    assert engine.script.remaining == 1
    await engine.close()


@pytest.mark.asyncio
async def test_scripts_from_files_and_bad_scripts(tmp_path: Path) -> None:
    jsonl = tmp_path / "script.jsonl"
    jsonl.write_text('{"text": "first"}\n\n{"ids": [400, 401], "stop": false}\n')
    engine = forced(str(jsonl))
    a, _ = await collect(engine, request("x"))
    b, _ = await collect(engine, request("y"))
    assert [s.token_id for s in b] == [400, 401] and a[-1].token_id == IM_END
    await engine.close()
    as_json = tmp_path / "script.json"
    as_json.write_text(json.dumps([{"text": "only", "repeat": True}]))
    assert len(ForcedScript.load(as_json).entries) == 1
    for bad in ({"text": "a", "ids": [1]}, {"txt": "a"}, {"ids": [-1]}, {"text": "a", "repeat": 1}):
        with pytest.raises(ValueError):
            ForcedScript([bad])
    (tmp_path / "broken.jsonl").write_text('{"text": "a"}\n{oops\n')
    with pytest.raises(ValueError, match=r"broken\.jsonl:2"):
        ForcedScript.load(tmp_path / "broken.jsonl")


@pytest.mark.asyncio
async def test_concurrent_sessions_context_and_weights(tmp_path: Path) -> None:
    engine = forced([{"text": "ok", "repeat": True}], max_context=24)
    with pytest.raises(ContextLengthError):
        await collect(engine, GenerationRequest(prompt_ids=[5] * 24, max_tokens=3))
    results = await asyncio.gather(
        *(collect(engine, GenerationRequest(prompt_ids=[5] * 10, max_tokens=8)) for _ in range(5))
    )
    assert all(len(steps) == len(tokenizer().encode("ok")) for steps, _ in results)
    reference_model().save_pretrained(tmp_path / "ckpt")
    assert await engine.load_weights(str(tmp_path / "ckpt")) == 1
    assert engine.policy_version == 1
    await engine.close()


@pytest.mark.asyncio
async def test_a_call_that_repeats_the_last_one_reuses_its_prefix_and_scores_the_same(
    tmp_path: Path,
) -> None:
    import torch

    first, second = "Run the tests.", "Done: 3 passed."
    engine = forced([{"text": first}, {"text": second, "repeat": True}])
    req = request("Fix the bug.", temperature=0.7)
    steps, _ = await collect(engine, req)
    # the harness's next call: the last prompt and completion, then the tool's result
    tool = tokenizer().encode("<|im_start|>user\nok<|im_end|>\n", add_special_tokens=False)
    nxt = GenerationRequest(
        prompt_ids=[*req.prompt_ids, *(s.token_id for s in steps), *tool],
        stop_token_ids=[IM_END], max_tokens=200, temperature=0.7,
    )  # fmt: skip
    steps2, _ = await collect(engine, nxt)
    assert engine.reused_tokens == len(req.prompt_ids) + len(steps)
    ids = nxt.prompt_ids + [s.token_id for s in steps2]
    ref = reference_logprobs(reference_model(), ids, len(nxt.prompt_ids), 0.7)
    max_delta, pearson = agreement([s.logprob for s in steps2], ref)
    assert max_delta < 1e-4 and pearson > 0.9999
    # New weights drop the kept K/V: the same call is scored afresh, by the new weights.
    model = copy.deepcopy(reference_model())  # the shared reference stays as it is
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    model.save_pretrained(tmp_path / "ckpt")
    await engine.load_weights(str(tmp_path / "ckpt"))
    reused = engine.reused_tokens
    steps3, _ = await collect(engine, nxt)
    assert engine.reused_tokens == reused
    ref = reference_logprobs(model, ids, len(nxt.prompt_ids), 0.7)
    max_delta, _ = agreement([s.logprob for s in steps3], ref)
    assert max_delta < 1e-4
    # Control: with no cache kept the call is scored in full, to the same numbers.
    plain = forced([{"text": second, "repeat": True}], prefix_cache_tokens=0)
    steps4, _ = await collect(plain, nxt)
    assert plain.reused_tokens == 0
    max_delta, _ = agreement([s.logprob for s in steps4], [s.logprob for s in steps2])
    assert max_delta < 1e-4
    await engine.close()
    await plain.close()
