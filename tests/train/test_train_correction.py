"""Mismatch correction modes and fidelity metrics against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from legorl.train.correction import correction_weights, mismatch_metrics, pearson

L = torch.log
t = torch.tensor


def _ratios(values: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    mu = L(torch.full((len(values),), 0.2))
    return mu + L(t(values)), mu  # old / mu = values


def test_none_and_tis() -> None:
    old, mu = _ratios([3.0, 1.5, 0.4, 0.25, 2.0])
    ep = torch.zeros(5, dtype=torch.long)
    assert correction_weights(old, mu, ep, 1, "none").tolist() == [1.0] * 5
    tis = correction_weights(old, mu, ep, 1, "tis", tis_cap=2.0)
    assert tis.tolist() == pytest.approx([2.0, 1.5, 0.4, 0.25, 2.0], rel=1e-5)


def test_token_mask() -> None:
    old, mu = _ratios([3.0, 1.5, 0.4, 0.25, 1.999, 0.501, 2.001, 0.499])
    w = correction_weights(old, mu, torch.zeros(8, dtype=torch.long), 1, "token_mask")
    assert w.tolist() == [0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0]  # keep ρ in [0.5, 2]


def test_geometric_sequence_mask_spans_segments() -> None:
    # episode 0: log ratios 0.005, 0.005 → 1.005 (kept); episode 1: 0.02, 0.0 → exp(0.01) (dropped)
    mu = L(t([0.3, 0.3, 0.3, 0.3]))
    old = mu + t([0.005, 0.005, 0.02, 0.0])
    ep = t([0, 0, 1, 1])
    w = correction_weights(old, mu, ep, 2, "seq_mask", seq_low=0.99, seq_high=1.01)
    assert w.tolist() == [1.0, 1.0, 0.0, 0.0]
    # interleaved tokens of two episodes (segments packed apart) give the same per-episode answer
    w2 = correction_weights(old[[0, 2, 1, 3]], mu[[0, 2, 1, 3]], ep[[0, 2, 1, 3]], 2, "seq_mask")
    assert w2.tolist() == [1.0, 0.0, 1.0, 0.0]


def test_mismatch_metrics_by_hand() -> None:
    mu = L(t([0.5, 0.25]))
    old = L(t([0.25, 0.5]))
    m = mismatch_metrics(old, mu, t([0.0, 1.0]))
    assert m["rollout_trainer_pearson"] == pytest.approx(-1.0)
    assert m["prob_abs_diff_mean"] == pytest.approx(0.25)
    assert m["prob_abs_diff_max"] == pytest.approx(0.25)
    # ρ = 0.5, 2: mean(ρ - 1 - log ρ)
    k3 = ((0.5 - 1 - math.log(0.5)) + (2 - 1 - math.log(2))) / 2
    assert m["kl_k3_rollout_old"] == pytest.approx(k3, rel=1e-6)
    assert m["is_ess"] == pytest.approx(2.5**2 / (2 * (0.25 + 4)), rel=1e-6)
    assert m["masked_fraction"] == pytest.approx(0.5)


def test_identical_policies_are_perfect_and_empty_is_undefined() -> None:
    lp = L(t([0.9, 0.5, 0.1, 0.3]))
    m = mismatch_metrics(lp, lp.clone(), torch.ones(4))
    assert m["rollout_trainer_pearson"] == pytest.approx(1.0)
    assert m["kl_k3_rollout_old"] == pytest.approx(0.0, abs=1e-12)
    assert m["is_ess"] == pytest.approx(1.0)
    assert m["prob_abs_diff_max"] == 0.0
    empty = mismatch_metrics(torch.zeros(0), torch.zeros(0), torch.zeros(0))
    assert all(v is None for v in empty.values())
    assert pearson(t([1.0, 1.0]), t([0.2, 0.4])) is None  # a constant: undefined, not 0
