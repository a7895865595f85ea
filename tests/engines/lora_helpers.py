"""LoRA adapters for the engine tests, made the way a user makes them: episodes sampled by the
engine under test, a LoRA step of ``legorl train`` on them, and the trainer's own dry-run
recompute of the served tokens' log-probs (π_old) as the reference."""

from __future__ import annotations

import statistics
from pathlib import Path

from legorl.protocols import Engine, GenerationRequest
from legorl.records import Sample

RANK = 4


async def sample(
    engine: Engine,
    prompt: list[int],
    n_new: int,
    *,
    key: str | None = None,
    adapter: str | None = None,
    adapter_version: int | None = None,
    seed: int | None = None,
) -> tuple[list[int], list[float]]:
    """One completion of ``prompt`` at T = 1: its token ids and the served log-probs."""
    request = GenerationRequest(
        prompt_ids=prompt,
        max_tokens=n_new,
        temperature=1.0,
        seed=seed,
        cache_key=key,
        adapter=adapter,
        adapter_version=adapter_version,
    )
    ids: list[int] = []
    lps: list[float] = []
    async for chunk in engine.generate(request):
        ids += [s.token_id for s in chunk]
        lps += [s.logprob for s in chunk]
    return ids, lps


def as_sample(
    sid: str, group: str, prompt: list[int], ids: list[int], lps: list[float], reward: float
) -> Sample:
    return Sample(
        sample_id=sid,
        episode_id=sid,
        group_id=group,
        segment_index=0,
        segment_count=1,
        input_ids=prompt + ids,
        loss_mask=[0] * len(prompt) + [1] * len(ids),
        rollout_logprobs=lps,
        reward=reward,
    )


async def episodes(engine: Engine, prompts: list[list[int]], seed: int) -> list[Sample]:
    """4 episodes per prompt, rewarded by how many of their tokens have even ids."""
    out = []
    for g, prompt in enumerate(prompts):
        for k in range(4):
            ids, lps = await sample(engine, prompt, 12, seed=seed * 100 + g * 10 + k)
            reward = sum(1 for t in ids if t % 2 == 0) / len(ids)
            out.append(as_sample(f"g{g}-{k}", f"g{g}", prompt, ids, lps, reward))
    return out


def train_adapter(samples: list[Sample], start: Path, out: Path) -> Path:
    """Two LoRA steps from ``start`` (a base model or an adapter folder) into ``out``."""
    from legorl.train.config import TrainConfig
    from legorl.train.trainer import train

    config = TrainConfig(lora=True, lora_rank=RANK, lr=0.05, steps=2, gspo_clip_high=0.5)
    result = train(samples, model=start, out=out, config=config)
    assert result.updated
    return out


def recompute(model: Path, prompt: list[int], ids: list[int]) -> list[float]:
    """The trainer's π_old of ``ids`` after ``prompt`` under ``model`` (an adapter folder or a
    full model), from a dry run of ``legorl train``."""
    from legorl.engines.adapters import is_adapter
    from legorl.train.config import TrainConfig
    from legorl.train.trainer import train

    config = TrainConfig(lora=is_adapter(model), lora_rank=RANK)
    one = as_sample("x", "x", prompt, ids, [0.0] * len(ids), 0.0)
    result = train([one], model=model, out=None, config=config, dry_run=True)
    (scored,) = result.logprobs
    return scored.logprobs


def mean_gap(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a
    return statistics.fmean(abs(x - y) for x, y in zip(a, b, strict=True))
