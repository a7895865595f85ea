"""Advantage and loss math as pure tensor functions (CPU-testable, no model, no I/O).

Shapes: ``E`` episodes, ``N`` loss tokens (flattened over every segment of every episode in the
call), ``episode[N]`` the episode index of each token. Every loss returns the *sum* of its terms
divided by normalisers passed in (``ep_tokens``, ``n_episodes``, ``norm_tokens``), so a batch
split over micro-batches and processes adds up to the same gradient as one pass over all of it.

- Advantages: GRPO ``(r - mean) / (std + eps)`` per group (unbiased std), Dr.GRPO ``r - mean``;
  groups whose rewards are all equal get 0 and are reported.
- GSPO (Zheng et al. 2025): sequence ratio ``s_i = exp(mean over the episode's loss tokens of
  (log π_θ - log π_old))``, objective ``(1/G) Σ_i min(s_i A_i, clip(s_i, 1-ε_low, 1+ε_high) A_i)``.
  ``gspo_token_loss`` is the GSPO-token (stop-gradient) form the trainer uses: per token,
  ``r_t = sg(s_i) · π_θ(t) / sg(π_θ(t))`` with a per-token advantage; with one advantage per
  episode its value and gradient equal ``gspo_sequence_loss`` (tested), and unlike the sequence
  form it takes per-token weights (TIS) and splits across micro-batches given the part of the
  episode's log-ratio that lies outside (``rest``).
- GRPO: token PPO clip, ``(1/G) Σ_i (1/|o_i|) Σ_t``. Dr.GRPO: the same per-token term, summed
  and divided by a constant token count instead of each episode's length.
- Optional per-token k3 KL to a reference and an entropy bonus.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Tensor = torch.Tensor

# --------------------------------------------------------------------------------------------
# Advantages
# --------------------------------------------------------------------------------------------


@dataclass
class Advantages:
    advantage: Tensor  # [E]
    zero_variance: Tensor  # [G] bool: every reward of the group is equal (or it has one episode)


def group_advantages(
    rewards: Tensor,  # [E]
    group: Tensor,  # [E] long, group index 0..G-1 of each episode
    *,
    mode: Literal["grpo", "drgrpo"],
    eps: float = 1e-6,
    n_groups: int | None = None,
) -> Advantages:
    """Episode rewards → advantages, normalised within each group."""
    rewards = rewards.double()
    G = int(group.max()) + 1 if n_groups is None else n_groups
    count = torch.zeros(G, dtype=torch.float64).index_add_(0, group, torch.ones_like(rewards))
    mean = torch.zeros(G, dtype=torch.float64).index_add_(0, group, rewards) / count.clamp(min=1)
    centred = rewards - mean[group]
    # equal rewards, not a std threshold: a group of 0.3 and 0.3000001 still has a direction
    r_max = torch.full((G,), -torch.inf, dtype=torch.float64).scatter_reduce(
        0, group, rewards, "amax"
    )
    r_min = torch.full((G,), torch.inf, dtype=torch.float64).scatter_reduce(
        0, group, rewards, "amin"
    )
    zero_var = (r_max == r_min) | (count < 2)
    if mode == "grpo":
        sq = torch.zeros(G, dtype=torch.float64).index_add_(0, group, centred**2)
        std = (sq / (count - 1).clamp(min=1)).sqrt()  # unbiased, as GRPO
        adv = centred / (std[group] + eps)
    elif mode == "drgrpo":
        adv = centred
    else:
        raise ValueError(f"unknown advantage mode {mode!r}")
    adv = torch.where(zero_var[group], torch.zeros_like(adv), adv)
    return Advantages(adv.float(), zero_var)


# --------------------------------------------------------------------------------------------
# Per-token policy terms
# --------------------------------------------------------------------------------------------


@dataclass
class TokenTerms:
    loss: Tensor  # [N] per-token loss (with grad), before weights and normalisation
    ratio: Tensor  # [N] the ratio each token was clipped on (s_i for GSPO), detached
    clipped: Tensor  # [N] bool: the clipped branch won, so the token gives no gradient


def episode_sums(values: Tensor, episode: Tensor, n_episodes: int) -> Tensor:
    """Σ of ``values[N]`` per episode → [E]."""
    return torch.zeros(n_episodes, dtype=values.dtype, device=values.device).index_add_(
        0, episode, values
    )


def sequence_log_ratio(
    logp: Tensor,  # [N]
    old: Tensor,  # [N]
    episode: Tensor,  # [N]
    keep: Tensor,  # [N] bool: token takes part in the loss
    ep_tokens: Tensor,  # [E] kept tokens of each episode, over all its segments
    rest: Tensor | None = None,  # [E] Σ (log π_θ - log π_old) of kept tokens not in ``logp``
) -> Tensor:
    """Mean over each episode's kept tokens of ``logp - old`` → [E]."""
    diff = torch.where(keep, logp - old, torch.zeros_like(logp))
    total = episode_sums(diff, episode, ep_tokens.numel())
    if rest is not None:
        total = total + rest
    return total / ep_tokens.clamp(min=1)


def _clipped_objective(
    ratio: Tensor, adv: Tensor, low: float, high: float
) -> tuple[Tensor, Tensor]:
    """-min(ratio·A, clip(ratio)·A) and whether the clipped branch won."""
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - low, 1.0 + high) * adv
    return -torch.minimum(unclipped, clipped), clipped < unclipped


def gspo_token_loss(
    logp: Tensor,  # [N] log π_θ, with grad
    old: Tensor,  # [N] log π_old
    adv: Tensor,  # [N] per-token advantage
    episode: Tensor,  # [N]
    keep: Tensor,  # [N] bool
    ep_tokens: Tensor,  # [E]
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    rest: Tensor | None = None,  # [E]
) -> TokenTerms:
    """GSPO-token: ``r_t = sg(s_i) · exp(logp_t - sg(logp_t))``, clipped on ``s_i``."""
    s = sequence_log_ratio(logp.detach(), old, episode, keep, ep_tokens, rest).exp()  # [E]
    ratio = s[episode] * (logp - logp.detach()).exp()  # value s_i, gradient s_i ∇logp_t
    loss, clipped = _clipped_objective(ratio, adv, clip_low, clip_high)
    return TokenTerms(loss, ratio.detach(), clipped & keep)


def ppo_token_loss(
    logp: Tensor,  # [N]
    old: Tensor,  # [N]
    adv: Tensor,  # [N]
    keep: Tensor,  # [N] bool
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
) -> TokenTerms:
    """GRPO / Dr.GRPO token term: ``-min(r_t A, clip(r_t, 1-ε, 1+ε) A)``, ``r_t = π_θ / π_old``."""
    ratio = (logp - old).exp()
    loss, clipped = _clipped_objective(ratio, adv, clip_low, clip_high)
    return TokenTerms(loss, ratio.detach(), clipped & keep)


def k3_kl(logp: Tensor, ref: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(π_θ ‖ π_ref) on tokens sampled from π: e^x - x - 1, x = ref - logp."""
    x = ref - logp
    return x.exp() - x - 1.0


# --------------------------------------------------------------------------------------------
# Aggregation and the full loss
# --------------------------------------------------------------------------------------------

Aggregation = Literal["seq_mean_token_mean", "token_sum_norm"]


def aggregate(
    token_loss: Tensor,  # [N]
    weight: Tensor,  # [N] 0 for dropped tokens, else the token's weight (TIS, sample weight)
    episode: Tensor,  # [N]
    *,
    mode: Aggregation,
    ep_tokens: Tensor,  # [E] kept tokens per episode (seq_mean_token_mean)
    n_episodes: float,  # G: episodes the mean runs over
    norm_tokens: float = 1.0,  # the constant of token_sum_norm (Dr.GRPO)
) -> Tensor:
    """``(1/G) Σ_i (1/|o_i|) Σ_t w_t l_t`` or ``(1/G) Σ_i (1/L) Σ_t w_t l_t``."""
    weighted = torch.where(weight > 0, token_loss * weight, torch.zeros_like(token_loss))
    if mode == "seq_mean_token_mean":
        per_token = weighted / ep_tokens.clamp(min=1)[episode]
    elif mode == "token_sum_norm":
        per_token = weighted / norm_tokens
    else:
        raise ValueError(f"unknown aggregation {mode!r}")
    return per_token.sum() / n_episodes


AGGREGATION: dict[str, Aggregation] = {
    "gspo": "seq_mean_token_mean",
    "grpo": "seq_mean_token_mean",
    "drgrpo": "token_sum_norm",
}


@dataclass
class LossOut:
    loss: Tensor  # [] the scalar to backward
    policy: Tensor  # [] the policy-gradient part alone, detached
    terms: TokenTerms
    kl: Tensor | None  # [N] per-token k3 KL to the reference, detached


def policy_loss(
    algorithm: Literal["gspo", "grpo", "drgrpo"],
    logp: Tensor,  # [N] log π_θ with grad
    old: Tensor,  # [N] log π_old
    adv: Tensor,  # [N] the token's episode advantage
    episode: Tensor,  # [N] episode index, 0..E-1
    weight: Tensor,  # [N] 0 = dropped (mask, zero-weight sample), else the IS / sample weight
    ep_tokens: Tensor,  # [E] kept tokens of each episode over the whole step
    n_episodes: float,  # G over the whole step
    *,
    clip_low: float,
    clip_high: float,
    norm_tokens: float = 1.0,
    rest: Tensor | None = None,  # [E] GSPO: log-ratio sum of the episode's tokens elsewhere
    ref: Tensor | None = None,  # [N] log π_ref, when kl_coef > 0
    kl_coef: float = 0.0,
    entropy: Tensor | None = None,  # [N] with grad, when entropy_coef > 0
    entropy_coef: float = 0.0,
) -> LossOut:
    keep = weight > 0
    if algorithm == "gspo":
        terms = gspo_token_loss(
            logp,
            old,
            adv,
            episode,
            keep,
            ep_tokens,
            clip_low=clip_low,
            clip_high=clip_high,
            rest=rest,
        )
    elif algorithm in ("grpo", "drgrpo"):
        terms = ppo_token_loss(logp, old, adv, keep, clip_low=clip_low, clip_high=clip_high)
    else:
        raise ValueError(f"unknown algorithm {algorithm!r}")
    mode = AGGREGATION[algorithm]

    def agg(x: Tensor) -> Tensor:
        return aggregate(
            x,
            weight,
            episode,
            mode=mode,
            ep_tokens=ep_tokens,
            n_episodes=n_episodes,
            norm_tokens=norm_tokens,
        )

    policy = agg(terms.loss)
    loss = policy
    kl = None
    if ref is not None and kl_coef > 0:
        kl_t = k3_kl(logp, ref)
        loss = loss + kl_coef * agg(kl_t)
        kl = kl_t.detach()
    if entropy is not None and entropy_coef > 0:
        loss = loss - entropy_coef * agg(entropy)
    return LossOut(loss, policy.detach(), terms, kl)


# --------------------------------------------------------------------------------------------
# Reference form, for tests and for reading
# --------------------------------------------------------------------------------------------


def gspo_sequence_loss(
    logp: Tensor,  # [N] with grad
    old: Tensor,  # [N]
    adv: Tensor,  # [E] one advantage per episode
    episode: Tensor,  # [N]
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> Tensor:
    """GSPO exactly as written: ``-(1/G) Σ_i min(s_i A_i, clip(s_i) A_i)``, gradient through s_i."""
    E = adv.numel()
    count = episode_sums(torch.ones_like(logp), episode, E)
    s = (episode_sums(logp - old, episode, E) / count).exp()
    loss, _ = _clipped_objective(s, adv, clip_low, clip_high)
    return loss.mean()
