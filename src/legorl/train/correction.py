"""Rollout / trainer mismatch: correction weights and the fidelity metrics, as pure functions.

μ is the rollout policy (log-probs recorded by the proxy, in the samples); π_old is the trainer's
recomputation on exactly those tokens with the same weights. They differ by kernels, precision
and batching (verl #6240); the ratio ρ_t = π_old(t) / μ(t) measures it. Modes:

- ``none``: no correction (bypass), weight 1.
- ``tis``: truncated importance sampling, weight ``min(ρ_t, C)`` (C = 2).
- ``token_mask``: drop tokens with ρ_t outside [0.5, 2].
- ``seq_mask``: drop whole episodes whose geometric-mean ratio ``exp(mean_t log ρ_t)`` over all
  their loss tokens (every segment) is outside [0.99, 1.01].

The health figure is the Pearson correlation of the probabilities exp(μ) and exp(π_old) on loss
tokens; it should stay above 0.99.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from legorl.train.losses import episode_sums

Tensor = torch.Tensor
Mode = Literal["none", "tis", "token_mask", "seq_mask"]


def correction_weights(
    old: Tensor,  # [N] log π_old
    mu: Tensor,  # [N] log μ (rollout)
    episode: Tensor,  # [N]
    n_episodes: int,
    mode: Mode,
    *,
    tis_cap: float = 2.0,
    token_low: float = 0.5,
    token_high: float = 2.0,
    seq_low: float = 0.99,
    seq_high: float = 1.01,
) -> Tensor:
    """Per-token weight [N]: 0 drops the token, otherwise it multiplies the token's loss."""
    log_rho = (old - mu).double()
    if mode == "none":
        w = torch.ones_like(log_rho)
    elif mode == "tis":
        w = log_rho.exp().clamp(max=tis_cap)
    elif mode == "token_mask":
        keep = (log_rho >= math.log(token_low)) & (log_rho <= math.log(token_high))
        w = keep.double()
    elif mode == "seq_mask":
        count = episode_sums(torch.ones_like(log_rho), episode, n_episodes)
        geo = episode_sums(log_rho, episode, n_episodes) / count.clamp(min=1)  # [E] log
        keep_ep = (geo >= math.log(seq_low)) & (geo <= math.log(seq_high))
        w = keep_ep[episode].double()
    else:
        raise ValueError(f"unknown correction mode {mode!r}")
    return w.to(old.dtype)


def pearson(x: Tensor, y: Tensor) -> float | None:
    """Pearson correlation, or None when it is undefined (fewer than 2 values, a constant)."""
    if x.numel() < 2:
        return None
    x = x.double() - x.double().mean()
    y = y.double() - y.double().mean()
    den = (x.square().sum() * y.square().sum()).sqrt()
    if den == 0:
        return None
    return float((x * y).sum() / den)


def mismatch_metrics(old: Tensor, mu: Tensor, weight: Tensor) -> dict[str, float | None]:
    """Fidelity of rollout vs trainer log-probs on loss tokens (all [N])."""
    if old.numel() == 0:
        names = [
            "rollout_trainer_pearson",
            "prob_abs_diff_mean",
            "prob_abs_diff_max",
            "kl_k3_rollout_old",
            "is_ess",
            "masked_fraction",
            "logprob_diff_over_0.1",
        ]
        return dict.fromkeys(names)
    old, mu = old.double(), mu.double()
    p_old, p_mu = old.exp(), mu.exp()
    diff = (p_old - p_mu).abs()
    log_rho = old - mu
    rho = log_rho.exp()
    return {
        "rollout_trainer_pearson": pearson(p_mu, p_old),
        "prob_abs_diff_mean": float(diff.mean()),
        "prob_abs_diff_max": float(diff.max()),
        # KL(μ ‖ π_old) from tokens sampled by μ: E_μ[ρ - 1 - log ρ], ρ = π_old / μ
        "kl_k3_rollout_old": float((rho - 1.0 - log_rho).mean()),
        # effective sample size of the raw IS weights, as a fraction of the tokens
        "is_ess": float(rho.sum().square() / (rho.square().sum() * rho.numel())),
        "masked_fraction": float((weight <= 0).double().mean()),
        # share of tokens whose log-probs differ by more than 0.1 (MoE routing flips do this)
        "logprob_diff_over_0.1": float((log_rho.abs() > 0.1).double().mean()),
    }
