"""Overfit: the tiny model samples its own completions, a fixed toy reward scores them (1 when the
completion contains one given token), and a few on-policy GSPO steps raise the mean reward."""

from __future__ import annotations

from pathlib import Path

import torch
from train_helpers import MODEL, make_samples, prompt_ids, sample_completions

from legorl.engines.models import load_model
from legorl.train.config import TrainConfig
from legorl.train.trainer import train

TARGET = 2961  # in about a quarter of the base model's 8-token completions


def reward(completion: list[int]) -> float:
    return float(TARGET in completion)


def mean_reward(model_dir: Path, seed: int = 123) -> float:
    model = load_model(model_dir)
    gen = torch.Generator().manual_seed(seed)
    scores = [
        reward(c)
        for p in range(4)
        for c in sample_completions(model, prompt_ids(MODEL, p), 64, 8, gen)
    ]
    return sum(scores) / len(scores)


def test_a_few_gspo_steps_raise_the_reward(tmp_path: Path) -> None:
    before = mean_reward(MODEL)
    policy = MODEL
    pearsons = []
    for it in range(4):
        # rollouts from the current policy: 4 prompts × 8 samples, log-probs from real forwards
        samples = make_samples(policy, groups=4, group_size=8, n_new=8, seed=it, reward=reward)
        out = tmp_path / f"step{it}"
        result = train(samples, model=policy, out=out, config=TrainConfig(lr=2e-2))
        pearsons += [m.value for m in result.metrics if m.name == "rollout_trainer_pearson"]
        policy = out
    after = mean_reward(policy)
    assert 0.1 < before < 0.4
    assert after > before + 0.25, (before, after)
    assert min(pearsons) > 0.999  # each step trained on its own policy's samples
