"""Advantages and losses against hand-computed values; GSPO-token vs sequence GSPO; the gradient
of GSPO at π_θ = π_old is the advantage-weighted log-likelihood gradient (real tiny model)."""

from __future__ import annotations

import math

import pytest
import torch
from train_helpers import MODEL

from legorl.train.losses import (
    aggregate,
    group_advantages,
    gspo_sequence_loss,
    gspo_token_loss,
    k3_kl,
    policy_loss,
    ppo_token_loss,
)

L = torch.log
t = torch.tensor


def test_grpo_advantages_by_hand() -> None:
    rewards = t([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 3.0, 0.0, 1.0, 2.0])
    group = t([0, 0, 0, 0, 1, 1, 2, 3, 3, 3])
    out = group_advantages(rewards, group, mode="grpo", eps=1e-6)
    # group 0: mean 0.5, unbiased std sqrt(1/3); group 3: mean 1, std 1
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    b = 1.0 / (1.0 + 1e-6)
    expected = [a, -a, -a, a, 0.0, 0.0, 0.0, -b, 0.0, b]
    assert out.advantage.tolist() == pytest.approx(expected, abs=1e-6)
    # equal rewards (group 1) and a group of one (group 2) carry no direction, and are counted
    assert out.zero_variance.tolist() == [False, True, True, False]


def test_drgrpo_advantages_by_hand() -> None:
    rewards = t([1.0, 0.0, 0.0, 1.0, 0.5, 0.5])
    group = t([0, 0, 0, 0, 1, 1])
    out = group_advantages(rewards, group, mode="drgrpo")
    assert out.advantage.tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5, 0.0, 0.0])
    assert out.zero_variance.tolist() == [False, True]


def test_std_guard_keeps_tiny_variance_finite() -> None:
    out = group_advantages(t([0.3, 0.3 + 1e-7]), t([0, 0]), mode="grpo", eps=1e-6)
    assert torch.isfinite(out.advantage).all()
    assert not out.zero_variance.any()
    assert out.advantage.abs().max() < 1.0  # the guard bounds it: 5e-8 / (7e-8 + 1e-6)


def test_ppo_token_loss_by_hand() -> None:
    logp = L(t([0.5, 0.25, 0.125, 0.125]))
    old = L(t([0.25, 0.25, 0.25, 0.25]))  # ratios 2, 1, 0.5, 0.5
    adv = t([1.0, -1.0, -1.0, 1.0])
    keep = torch.ones(4, dtype=torch.bool)
    out = ppo_token_loss(logp, old, adv, keep, clip_low=0.2, clip_high=0.2)
    # min(2·1, 1.2·1) = 1.2 (clipped); min(-1, -1) = -1; min(-0.5, -0.8) = -0.8 (clipped);
    # min(0.5, 0.8) = 0.5
    assert out.loss.tolist() == pytest.approx([-1.2, 1.0, 0.8, -0.5])
    assert out.clipped.tolist() == [True, False, True, False]
    assert out.ratio.tolist() == pytest.approx([2.0, 1.0, 0.5, 0.5])


def test_aggregations_by_hand() -> None:
    loss = t([1.0, 2.0, 3.0])
    episode = t([0, 0, 1])
    ones = torch.ones(3)
    seq = aggregate(
        loss, ones, episode, mode="seq_mean_token_mean", ep_tokens=t([2.0, 1.0]), n_episodes=2
    )
    assert float(seq) == pytest.approx(((1 + 2) / 2 + 3) / 2)
    masked = aggregate(
        loss,
        t([1.0, 0.0, 1.0]),
        episode,
        mode="seq_mean_token_mean",
        ep_tokens=t([1.0, 1.0]),
        n_episodes=2,
    )
    assert float(masked) == pytest.approx((1 + 3) / 2)
    weighted = aggregate(
        loss,
        t([2.0, 1.0, 0.5]),
        episode,
        mode="seq_mean_token_mean",
        ep_tokens=t([2.0, 1.0]),
        n_episodes=2,
    )
    assert float(weighted) == pytest.approx(((2 + 2) / 2 + 1.5) / 2)
    dr = aggregate(
        loss,
        ones,
        episode,
        mode="token_sum_norm",
        ep_tokens=t([2.0, 1.0]),
        n_episodes=2,
        norm_tokens=4,
    )
    assert float(dr) == pytest.approx((1 + 2 + 3) / 4 / 2)


def _gspo_case() -> tuple[torch.Tensor, ...]:
    old = L(t([0.5, 0.5, 0.25]))
    logp = old + t([0.1, -0.3, 0.2])  # episode 0: mean -0.1; episode 1: 0.2
    episode = t([0, 0, 1])
    return logp, old, episode


def test_gspo_by_hand() -> None:
    logp, old, episode = _gspo_case()
    adv = t([1.0, 1.0, 1.0])
    keep = torch.ones(3, dtype=torch.bool)
    out = gspo_token_loss(logp, old, adv, episode, keep, t([2.0, 1.0]))
    s0, s1 = math.exp(-0.1), math.exp(0.2)
    # episode 0: min(0.9048, clip→0.9997) = 0.9048, not clipped
    # episode 1: min(1.2214, clip→1.0004) = 1.0004, clipped
    assert out.ratio.tolist() == pytest.approx([s0, s0, s1], rel=1e-6)
    assert out.loss.tolist() == pytest.approx([-s0, -s0, -(1 + 4e-4)], rel=1e-6)
    assert out.clipped.tolist() == [False, False, True]
    total = policy_loss(
        "gspo",
        logp,
        old,
        adv,
        episode,
        torch.ones(3),
        t([2.0, 1.0]),
        2,
        clip_low=3e-4,
        clip_high=4e-4,
    )
    assert float(total.loss) == pytest.approx(-(s0 + 1 + 4e-4) / 2, rel=1e-6)
    reference = gspo_sequence_loss(logp, old, t([1.0, 1.0]), episode)
    assert float(reference) == pytest.approx(float(total.loss), rel=1e-6)


def test_gspo_negative_advantage_clips_low() -> None:
    logp, old, episode = _gspo_case()
    out = gspo_token_loss(
        logp, old, t([-1.0, -1.0, -1.0]), episode, torch.ones(3, dtype=torch.bool), t([2.0, 1.0])
    )
    # A < 0: min(-0.9048, -0.9997) = -0.9997 (clipped); min(-1.2214, -1.0004) = -1.2214
    assert out.loss.tolist() == pytest.approx([1 - 3e-4, 1 - 3e-4, math.exp(0.2)], rel=1e-6)
    assert out.clipped.tolist() == [True, True, False]


def test_gspo_token_form_has_the_sequence_gradient() -> None:
    torch.manual_seed(0)
    old = torch.randn(12).clamp(max=-0.1)
    episode = t([0] * 5 + [1] * 4 + [2] * 3)
    adv = t([0.7, -1.2, 0.4])
    # a spread of ratios: some inside the clip range, some out on either side
    for scale in (1e-5, 1e-4, 3e-3):
        delta = torch.randn(12) * scale
        a = (old + delta).requires_grad_()
        b = (old + delta).requires_grad_()
        seq = gspo_sequence_loss(a, old, adv, episode)
        tok = policy_loss(
            "gspo",
            b,
            old,
            adv[episode],
            episode,
            torch.ones(12),
            t([5.0, 4.0, 3.0]),
            3,
            clip_low=3e-4,
            clip_high=4e-4,
        ).loss
        seq.backward()
        tok.backward()
        assert float(tok.detach()) == pytest.approx(float(seq.detach()), rel=1e-6)
        assert torch.allclose(a.grad, b.grad, atol=1e-7)


def test_gspo_split_over_micro_batches_adds_up() -> None:
    # an episode split in two parts, each scored with the other part's log-ratio as `rest`
    torch.manual_seed(1)
    old = torch.randn(6).clamp(max=-0.1)
    logp = old + torch.randn(6) * 2e-4
    episode = torch.zeros(6, dtype=torch.long)
    adv = torch.full((6,), 0.8)
    keep = torch.ones(6, dtype=torch.bool)
    ep_tokens = t([6.0])
    whole = logp.clone().requires_grad_()
    policy_loss(
        "gspo", whole, old, adv, episode, torch.ones(6), ep_tokens, 1, clip_low=3e-4, clip_high=4e-4
    ).loss.backward()
    parts = logp.clone().requires_grad_()
    for lo, hi in ((0, 2), (2, 6)):
        inside = torch.zeros(6, dtype=torch.bool)
        inside[lo:hi] = True
        rest = ((logp - old) * ~inside).sum().reshape(1)
        policy_loss(
            "gspo",
            parts[lo:hi],
            old[lo:hi],
            adv[lo:hi],
            episode[lo:hi],
            torch.ones(hi - lo),
            ep_tokens,
            1,
            clip_low=3e-4,
            clip_high=4e-4,
            rest=rest,
        ).loss.backward()
    assert keep.all()
    assert torch.allclose(whole.grad, parts.grad, atol=1e-8)


def test_grpo_and_drgrpo_totals_by_hand() -> None:
    logp = L(t([0.5, 0.25, 0.25]))
    old = L(t([0.25, 0.25, 0.25]))  # ratios 2, 1, 1
    adv = t([1.0, 1.0, -0.5])
    episode = t([0, 0, 1])
    w = torch.ones(3)
    grpo = policy_loss(
        "grpo", logp, old, adv, episode, w, t([2.0, 1.0]), 2, clip_low=0.2, clip_high=0.2
    )
    # tokens: -1.2 (clipped), -1, +0.5 → ((-1.2 - 1) / 2 + 0.5) / 2
    assert float(grpo.loss) == pytest.approx(((-1.2 - 1) / 2 + 0.5) / 2)
    dr = policy_loss(
        "drgrpo",
        logp,
        old,
        adv,
        episode,
        w,
        t([2.0, 1.0]),
        2,
        clip_low=0.2,
        clip_high=0.2,
        norm_tokens=8,
    )
    assert float(dr.loss) == pytest.approx((-1.2 - 1 + 0.5) / 8 / 2)
    assert dr.terms.clipped.tolist() == [True, False, False]


def test_kl_and_entropy_terms_by_hand() -> None:
    logp = L(t([0.5, 0.5]))
    ref = L(t([0.25, 0.5]))
    assert k3_kl(logp, ref).tolist() == pytest.approx([0.5 + math.log(2) - 1, 0.0], abs=1e-7)
    old = logp.clone()
    adv = t([0.0, 0.0])  # no policy term: only the KL and entropy terms remain
    entropy = t([1.0, 3.0])
    out = policy_loss(
        "grpo",
        logp,
        old,
        adv,
        t([0, 0]),
        torch.ones(2),
        t([2.0]),
        1,
        clip_low=0.2,
        clip_high=0.2,
        ref=ref,
        kl_coef=0.1,
        entropy=entropy,
        entropy_coef=0.01,
    )
    kl_mean = (0.5 + math.log(2) - 1) / 2
    assert float(out.loss) == pytest.approx(0.1 * kl_mean - 0.01 * 2.0, abs=1e-7)
    assert float(out.policy) == pytest.approx(0.0, abs=1e-7)


def test_gspo_gradient_at_old_policy_is_the_weighted_log_likelihood_gradient() -> None:
    """With π_θ = π_old every s_i = 1, so ∇L = -(1/G) Σ_i A_i (1/|o_i|) Σ_t ∇ log π_θ(t)."""
    from legorl.train.model import TokenScorer, load_policy
    from legorl.train.packing import build_micro_batch

    torch.manual_seed(0)
    lm = load_policy(MODEL)
    scorer = TokenScorer(lm)
    seqs = [torch.randint(3, 3000, (n,)).tolist() for n in (9, 12, 7)]
    masks = [[0] * 4 + [1] * (len(s) - 4) for s in seqs]
    offsets = [0, 5, 13]
    mb = build_micro_batch(seqs, masks, offsets)
    episode = t([0] * 5 + [1] * 8 + [2] * 3)
    adv_ep = t([1.3, -0.4, 0.9])
    ep_tokens = t([5.0, 8.0, 3.0])
    kw = mb.attention_kwargs("varlen_sdpa")

    logp, _ = scorer(mb.input_ids, mb.position_ids, mb.logit_index, mb.targets, **kw)
    loss = policy_loss(
        "gspo",
        logp,
        logp.detach(),
        adv_ep[episode],
        episode,
        torch.ones(16),
        ep_tokens,
        3,
        clip_low=3e-4,
        clip_high=4e-4,
    ).loss
    grads = torch.autograd.grad(loss, list(lm.parameters()))

    logp2, _ = scorer(mb.input_ids, mb.position_ids, mb.logit_index, mb.targets, **kw)
    surrogate = -((adv_ep[episode] * logp2) / ep_tokens[episode]).sum() / 3
    expected = torch.autograd.grad(surrogate, list(lm.parameters()))

    g = torch.cat([x.flatten() for x in grads])
    e = torch.cat([x.flatten() for x in expected])
    assert float(e.norm()) > 0
    assert float(torch.nn.functional.cosine_similarity(g, e, dim=0)) > 1 - 1e-6
    assert torch.allclose(g, e, rtol=1e-4, atol=1e-7)
