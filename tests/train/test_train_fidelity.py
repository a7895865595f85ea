"""Fidelity against an engine's own decode path: the embedded engine samples (its KV cache, its
batching, its sampler), the trainer recomputes the log-probs of those tokens in one packed
forward, and the rollout/trainer figures say they agree. The forced engine's ``align --check``
compares one scoring function with itself (a determinism test); this one compares two paths."""

from __future__ import annotations

import asyncio

import pytest
from train_helpers import MODEL, prompt_ids

from legorl.engines import make_engine
from legorl.protocols import GenerationRequest
from legorl.records import Sample
from legorl.train.config import TrainConfig
from legorl.train.trainer import train


def engine_samples(temperature: float) -> list[Sample]:
    """2 groups × 3 episodes, each one completion sampled by the embedded engine at
    ``temperature``, with the engine's own log-probs as the rollout's."""

    async def sample_all() -> list[Sample]:
        engine = make_engine("embedded", model_path=str(MODEL))
        out = []
        try:
            for g in range(2):
                prompt = prompt_ids(MODEL, g)
                for k in range(3):
                    request = GenerationRequest(
                        prompt_ids=prompt, max_tokens=12, temperature=temperature, seed=10 * g + k
                    )
                    steps = [s async for chunk in engine.generate(request) for s in chunk]
                    out.append(
                        Sample(
                            sample_id=f"g{g}-e{k}/0",
                            episode_id=f"g{g}-e{k}",
                            group_id=f"g{g}",
                            segment_index=0,
                            segment_count=1,
                            input_ids=prompt + [s.token_id for s in steps],
                            loss_mask=[0] * len(prompt) + [1] * len(steps),
                            rollout_logprobs=[s.logprob for s in steps],
                            reward=float(k % 2),
                        )
                    )
        finally:
            await engine.close()
        return out

    return asyncio.run(sample_all())


def figures(samples: list[Sample], temperature: float) -> dict[str, float | None]:
    result = train(
        samples, model=MODEL, out=None, config=TrainConfig(temperature=temperature), dry_run=True
    )
    return {m.name: m.value for m in result.metrics if m.step == 1}


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_trainer_recomputes_what_the_embedded_engine_sampled(temperature: float) -> None:
    samples = engine_samples(temperature)
    assert sum(len(s.rollout_logprobs) for s in samples) == 6 * 12
    same = figures(samples, temperature)
    assert same["rollout_trainer_pearson"] > 0.9999
    assert same["prob_abs_diff_max"] < 1e-4
    # control: the trainer scoring at another temperature than the engine sampled at is seen
    other = figures(samples, 1.0 if temperature != 1.0 else 0.7)
    assert other["prob_abs_diff_max"] > 1e-2
