"""Packing: the plan, the row layout, log-probs of a packed row equal those of each sample alone
(every attention path, dense and MoE), and padding waste on toy-like lengths."""

from __future__ import annotations

import random

import pytest
import torch
from train_helpers import MODEL, MOE

from legorl.engines.models import load_model, token_logprobs
from legorl.train.packing import build_micro_batch, pack_lengths, padding_waste


def test_pack_keeps_episodes_together_first_fit_decreasing() -> None:
    # episode sizes 8, 8, 2 into a budget of 10: [ep0, ep2], [ep1]
    assert pack_lengths([5, 3, 8, 2], [[0, 1], [2], [3]], 10) == [[0, 1, 3], [2]]


def test_pack_splits_only_episodes_longer_than_the_budget() -> None:
    assert pack_lengths([6, 6, 3], [[0, 1], [2]], 8) == [[0], [1], [2]]
    assert pack_lengths([6, 6, 3], [[0, 1], [2]], 12) == [[0, 1], [2]]
    # a sample longer than the budget gets a micro-batch of its own
    assert pack_lengths([20, 2, 2], [[0], [1], [2]], 8) == [[0], [1, 2]]


def test_micro_batch_layout() -> None:
    mb = build_micro_batch(
        [[10, 11, 12, 13], [20, 21, 22]],
        [[0, 0, 1, 1], [0, 1, 0]],
        [5, 9],
        pad_to_multiple_of=8,
    )
    assert mb.input_ids.tolist() == [[10, 11, 12, 13, 20, 21, 22, 0]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0]]
    assert mb.bounds == [0, 4, 7, 8]
    assert mb.logit_index.tolist() == [1, 2, 4]  # the position before each loss token
    assert mb.targets.tolist() == [12, 13, 21]
    assert mb.token_index.tolist() == [5, 6, 9]
    assert (mb.real_tokens, mb.pad_tokens) == (7, 1)


@pytest.mark.parametrize("attention", ["varlen_sdpa", "sdpa", "eager"])
@pytest.mark.parametrize("model_dir", [MODEL, MOE], ids=["dense", "moe"])
def test_packed_logprobs_equal_each_sample_alone(attention: str, model_dir) -> None:
    from legorl.train.model import TokenScorer, load_policy

    rng = random.Random(0)
    seqs = [[rng.randrange(3, 3000) for _ in range(n)] for n in (23, 1, 40, 9, 17)]
    masks = [[0] * min(3, len(s)) + [1] * max(0, len(s) - 3) for s in seqs]
    masks[1] = [0]  # a one-token sample with nothing to score, between others
    offsets, n = [], 0
    for m in masks:
        offsets.append(n)
        n += sum(m)
    mb = build_micro_batch(seqs, masks, offsets, pad_to_multiple_of=16)
    scorer = TokenScorer(load_policy(model_dir, attention=attention), chunk=7)
    with torch.no_grad():
        packed, _ = scorer(
            mb.input_ids,
            mb.position_ids,
            mb.logit_index,
            mb.targets,
            **mb.attention_kwargs(attention),
        )
    # the reference: each sample alone, through the engines' scorer (no packing, no position ids)
    ref_model = load_model(model_dir)
    alone = []
    for s, m in zip(seqs, masks, strict=True):
        if sum(m):
            lps = token_logprobs(ref_model, s, start=m.index(1), temperature=1.0)
            alone += [lp for lp, keep in zip(lps, m[m.index(1) :], strict=True) if keep]
    assert packed.shape == (n,)
    assert torch.allclose(packed, torch.tensor(alone), atol=2e-5)


def test_padding_waste_on_toy_like_samples() -> None:
    # toy trajectories: a 1-2k-token system prompt and task, then turns; 200 tokens to 4k
    rng = random.Random(0)
    lengths = [rng.randint(200, 4000) for _ in range(64)]
    episodes = [[i] for i in range(len(lengths))]
    bins = pack_lengths(lengths, episodes, 8192)
    batches = [
        build_micro_batch(
            [[1] * lengths[i] for i in b],
            [[0] * lengths[i] for i in b],
            [0] * len(b),
            pad_to_multiple_of=64,
        )
        for b in bins
    ]
    assert sorted(i for b in bins for i in b) == list(range(64))
    assert all(b.real_tokens <= 8192 for b in batches)
    assert padding_waste(batches) < 0.10
    fill = sum(lengths) / (len(bins) * 8192)
    assert fill > 0.85  # first-fit decreasing leaves little of the budget unused
