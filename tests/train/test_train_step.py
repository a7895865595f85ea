"""The step's named pieces on CPU: the micro-batch loss, the statistics container, the step
metrics, resume validation; and the trainer's log-probs reaching ``legorl inspect``."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from train_helpers import MODEL, legorl, make_samples

from legorl.engines.models import load_model, token_logprobs
from legorl.records import TrainerLogprobs, read_jsonl, write_jsonl
from legorl.train.checkpoint import OPTIMIZER_FILE, TrainError, resume_optimizer
from legorl.train.config import TrainConfig
from legorl.train.data import prepare_batch
from legorl.train.losses import policy_loss
from legorl.train.model import TokenScorer, load_policy
from legorl.train.trainer import (
    StepStats,
    StepTiming,
    Tokens,
    micro_batch_loss,
    plan_step,
    step_inputs,
    step_metrics,
    train,
)


@pytest.fixture(scope="module")
def mismatched() -> list:
    # rollout log-probs scored at T = 0.7, the trainer scores at T = 1: the two differ
    return make_samples(groups=2, group_size=4, segments=2, n_new=6, temperature=0.7)


def _tokens(samples: list, config: TrainConfig) -> Tokens:
    batch = prepare_batch(samples, config, vocab_size=3000, max_len=4096)
    return Tokens(
        batch,
        config,
        old=torch.full((batch.n_tokens,), math.nan),
        adv=batch.advantage[batch.token_episode],
    )


def test_micro_batch_loss_of_a_fresh_step_fills_pi_old_and_equals_the_loss_function(
    mismatched,
) -> None:
    config = TrainConfig(micro_batch_tokens=100_000)
    tokens = _tokens(mismatched, config)
    plan = plan_step(tokens.batch, tokens.batch.trainable, config, 0, 1, 0)
    assert len(plan.mine) == 1
    mb = plan.mine[0]
    lm = load_policy(MODEL, attention=config.attention)
    scorer = TokenScorer(lm, temperature=1.0, chunk=config.logprob_chunk)
    logp, _ = scorer(
        mb.input_ids,
        mb.position_ids,
        mb.logit_index,
        mb.targets,
        **mb.attention_kwargs(config.attention),
    )  # [n]
    inputs = step_inputs(tokens, plan, True, None)
    res, keep = micro_batch_loss(mb, logp, None, tokens, inputs, None, "cpu")
    # π_old of a fresh step is the forward's own output, for the whole call and for the gather
    assert torch.equal(tokens.old[mb.token_index], logp.detach())
    assert torch.equal(inputs.fresh_old[mb.token_index], logp.detach())
    direct = policy_loss(
        "gspo",
        logp,
        logp.detach(),
        tokens.adv[mb.token_index],
        tokens.batch.token_episode[mb.token_index],
        tokens.weights(mb.token_index),  # the correction's weights, now that π_old is known
        inputs.ep_tokens,
        float(len(plan.episodes)),
        clip_low=config.gspo_clip_low,
        clip_high=config.gspo_clip_high,
    )
    assert float(res.loss.detach()) == pytest.approx(float(direct.loss.detach()), abs=1e-7)
    assert abs(float(res.loss.detach())) > 1e-4
    assert bool(keep.all())
    # a ratio of 1 (θ = θ_old) clips nothing
    assert int(res.terms.clipped.sum()) == 0


def test_step_stats_sum_by_name_and_reduce_to_the_same_on_one_process() -> None:
    from accelerate import Accelerator

    logp = torch.tensor([-1.0, -2.0, -0.5, -0.1], requires_grad=True)
    old = torch.tensor([-1.5, -2.0, -0.5, -0.9])
    ep = torch.tensor([0, 0, 1, 1])
    w = torch.tensor([1.0, 0.0, 1.0, 1.0])
    res = policy_loss(
        "grpo",
        logp,
        old,
        torch.tensor([1.0, 1.0, -1.0, -1.0]),
        ep,
        w,
        torch.tensor([1.0, 2.0]),
        2.0,
        clip_low=0.2,
        clip_high=0.2,
    )
    entropy = torch.tensor([0.5, 9.0, 0.25, 1.0])
    stats = StepStats()
    stats.add(res, w > 0, entropy)
    stats.add(res, w > 0, None)
    assert stats.kept == 6.0  # three kept tokens, twice
    assert stats.entropy == 1.75  # the dropped token's 9.0 is not counted, the second add has none
    assert stats.loss == 2 * float(res.loss.detach())
    assert stats.clipped == 2 * float(res.terms.clipped.sum()) and stats.clipped > 0
    assert stats.reduce(Accelerator(cpu=True)) == stats


def test_step_metrics_are_ratios_of_the_stats(mismatched) -> None:
    config = TrainConfig()
    tokens = _tokens(mismatched, config)
    tokens.old = tokens.batch.mu.clone()  # π_old = μ: fidelity is perfect
    plan = plan_step(tokens.batch, tokens.batch.trainable, config, 0, 1, 0)
    stats = StepStats(loss=0.5, pg_loss=0.25, clipped=3.0, kept=12.0, entropy=6.0, kl=1.2)
    values = step_metrics(
        stats,
        plan,
        tokens,
        grad_norm=2.0,
        timing=StepTiming(step_s=0.5, step_cpu_s=0.25, old_logprob_s=0.0),
        has_ref=False,
        updated=True,
    )
    assert values["clip_fraction"] == 0.25 and values["entropy"] == 0.5
    assert values["kl_ref"] is None  # no reference model: undefined, not 0
    assert values["rollout_trainer_pearson"] == pytest.approx(1.0)
    assert values["tokens_per_s"] == plan.real_tokens / 0.5
    assert values["loss_tokens"] == tokens.batch.n_tokens and values["updated"] == 1.0


def test_resume_refuses_moments_saved_for_other_tensors_and_takes_this_calls_lr(
    tmp_path: Path,
) -> None:
    weight = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([weight], lr=0.1)
    weight.grad = torch.ones(3)
    opt.step()
    torch.save(opt.state_dict(), tmp_path / OPTIMIZER_FILE)
    saved = {"train_params": "norm", "scale_only": "", "lr_group_patterns": []}
    fresh = torch.optim.AdamW([weight], lr=0.1)
    groups = [{"params": [weight], "lr": 0.02}]
    with pytest.raises(TrainError, match=rf"{OPTIMIZER_FILE}: saved for train_params 'norm'"):
        resume_optimizer(fresh, groups, saved, tmp_path, TrainConfig(train_params="mlp"))
    with pytest.raises(TrainError, match="saved for scale_only"):
        resume_optimizer(
            fresh, groups, saved, tmp_path, TrainConfig(train_params="norm", scale_only="norm")
        )
    config = TrainConfig(train_params="norm", lr=0.02, adam_beta1=0.5)
    assert resume_optimizer(fresh, groups, saved, tmp_path, config)
    assert fresh.state_dict()["state"][0]["step"] == 1  # Adam's moments came back
    assert fresh.param_groups[0]["lr"] == 0.02 and fresh.param_groups[0]["betas"][0] == 0.5
    assert not resume_optimizer(fresh, groups, saved, tmp_path / "none", config)


def test_train_returns_pi_old_per_sample_and_not_the_rollouts(mismatched) -> None:
    result = train(mismatched, model=MODEL, out=None, config=TrainConfig(), dry_run=True)
    by_id = {r.sample_id: r for r in result.logprobs}
    assert sorted(by_id) == sorted(s.sample_id for s in mismatched)
    lm = load_model(MODEL)
    for s in mismatched:
        start = s.loss_mask.index(1)
        expect = token_logprobs(lm, s.input_ids, start=start, temperature=1.0)  # as trained
        got = by_id[s.sample_id].logprobs
        assert got == pytest.approx(expect, abs=1e-5)
        assert max(abs(a - b) for a, b in zip(got, s.rollout_logprobs, strict=True)) > 1e-3


def test_a_train_run_shows_its_logprobs_in_inspect(mismatched, tmp_path: Path) -> None:
    from legorl.inspect.render import token_stats
    from legorl.inspect.summary import load

    write_jsonl(tmp_path / "samples.jsonl", mismatched)
    run = legorl(
        "train", str(tmp_path / "samples.jsonl"), "--model", str(MODEL), "--dry-run",
        "--metrics", str(tmp_path / "metrics.jsonl"),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr.decode()
    written = list(read_jsonl(tmp_path / "trainer_logprobs.jsonl", TrainerLogprobs))
    assert len(written) == len(mismatched) and all(r.step == 1 for r in written)
    store = load([tmp_path])
    assert set(store.trainer_logprobs) == set(store.samples) and len(store.samples) == 16
    sample = store.samples["g0-e0/0"].sample
    shown = token_stats(sample, store.trainer_logprobs["g0-e0/0"].logprobs).plain
    assert "trainer: Pearson(prob) " in shown and "(ignored)" not in shown
