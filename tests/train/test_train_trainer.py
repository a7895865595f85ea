"""The trainer on the tiny models: checkpoints, resume, equivalences (micro-batching, gradient
accumulation, fused π_old), dry run, zero-variance groups, corrections, KL/entropy, MoE."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from train_helpers import MODEL, MOE, load_weights, make_samples

from legorl.records import Metric
from legorl.train.checkpoint import TrainError
from legorl.train.config import TrainConfig
from legorl.train.params import check_parameter_choice
from legorl.train.trainer import TrainResult, train

REQUIRED = {
    "rollout_trainer_pearson",
    "prob_abs_diff_mean",
    "prob_abs_diff_max",
    "kl_k3_rollout_old",
    "is_ess",
    "masked_fraction",
    "clip_fraction",
    "entropy",
    "grad_norm",
    "reward_mean",
    "reward_std",
    "advantage_std",
    "tokens_per_s",
    "peak_memory_mb",
    "zero_variance_groups",
    "loss",
}


@pytest.fixture(scope="module")
def samples() -> list:
    # 2 groups × 4 episodes × 2 segments, sampled and scored by the tiny model
    return make_samples(groups=2, group_size=4, segments=2, n_new=6)


# Adam with a huge eps is plain SGD (update = lr·g / eps): weights then differ exactly as the
# gradients do, where real Adam would blow float noise in near-zero gradients up to ±lr.
LINEAR = {"lr": 5.0, "adam_eps": 1e3}


def run(samples, out: Path | None, model: Path = MODEL, **config) -> TrainResult:
    """One call; ``out=None`` is a dry run."""
    return train(samples, model=model, out=out, config=TrainConfig(**config), dry_run=out is None)


def values(result: TrainResult, name: str) -> list[float | None]:
    return [m.value for m in result.metrics if m.name == name]


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_a_step_writes_a_checkpoint_that_loads(samples, tmp_path: Path) -> None:
    from legorl.engines.models import load_model

    result = run(samples, tmp_path / "ckpt", lr=1e-3)
    ckpt = tmp_path / "ckpt"
    assert result.updated and result.step == 1 and result.checkpoint == ckpt
    for name in ("config.json", "model.safetensors", "tokenizer.json", "optimizer.pt"):
        assert (ckpt / name).is_file(), name
    assert "algorithm: gspo" in (ckpt / "train_config.yaml").read_text()
    assert json.loads((ckpt / "trainer_state.json").read_text())["global_step"] == 1
    assert max_diff(load_weights(ckpt), load_weights(MODEL)) > 1e-4
    load_model(ckpt)  # the engines load it as they load any model folder
    names = {m.name for m in result.metrics}
    assert names >= REQUIRED
    assert all(isinstance(m, Metric) and m.step == 1 for m in result.metrics)
    assert values(result, "rollout_trainer_pearson")[0] > 0.999
    assert values(result, "grad_norm")[0] > 0


def test_resume_continues_steps_and_optimizer_state(samples, tmp_path: Path) -> None:
    run(samples, tmp_path / "a", lr=1e-3)
    second = run(samples, tmp_path / "b", model=tmp_path / "a", lr=1e-3)
    assert second.step == 2
    assert {m.step for m in second.metrics} == {2}
    state = torch.load(tmp_path / "b" / "optimizer.pt", weights_only=True)
    assert {int(s["step"]) for s in state["state"].values()} == {2}  # Adam moments carried on


def test_writing_into_the_model_folder_itself(samples, tmp_path: Path) -> None:
    import shutil

    folder = tmp_path / "policy"
    shutil.copytree(MODEL, folder)
    before = load_weights(folder)
    run(samples, folder, model=folder, lr=1e-3)
    assert max_diff(load_weights(folder), before) > 1e-4
    assert not [p for p in folder.iterdir() if p.name.startswith(".saving")]


@pytest.mark.parametrize("algorithm", ["gspo", "grpo", "drgrpo"])
def test_micro_batches_and_accumulation_give_the_same_update(
    samples, tmp_path: Path, algorithm: str
) -> None:
    # one micro-batch for everything vs every segment alone (episodes split across micro-batches,
    # gradients accumulated); two steps, so the second one clips against π_old and, for GSPO,
    # needs the log-ratio of each episode's other half
    common = dict(algorithm=algorithm, steps=2, **LINEAR, gspo_clip_low=0.05, gspo_clip_high=0.05)
    whole = run(samples, tmp_path / "whole", micro_batch_tokens=8192, **common)
    split = run(samples, tmp_path / "split", micro_batch_tokens=20, **common)
    assert values(whole, "micro_batches")[0] == 1
    assert values(split, "micro_batches")[0] == len(samples)
    assert 0 < values(whole, "clip_fraction")[1] < 1  # some episodes clipped, some not
    assert max_diff(load_weights(tmp_path / "whole"), load_weights(tmp_path / "split")) < 1e-6
    for name in ("loss", "clip_fraction", "grad_norm"):
        assert values(whole, name) == pytest.approx(values(split, name), rel=1e-4, abs=1e-7)


def test_fused_and_separate_old_logprobs_agree(samples, tmp_path: Path) -> None:
    fused = run(samples, tmp_path / "f", steps=2, fuse_old_logprobs=True, **LINEAR)
    separate = run(samples, tmp_path / "s", steps=2, fuse_old_logprobs=False, **LINEAR)
    assert max_diff(load_weights(tmp_path / "f"), load_weights(tmp_path / "s")) < 1e-6
    # the separate no-grad pass costs time; the fused one has none to run
    assert values(fused, "old_logprob_s")[0] < 0.1 * values(separate, "old_logprob_s")[0]


def test_mini_batches_take_one_step_each(samples, tmp_path: Path) -> None:
    result = run(samples, tmp_path / "m", lr=1e-3, steps=2, mini_batch_episodes=4)
    assert values(result, "episodes") == [4, 4]
    assert result.step == 2


def test_dry_run_computes_metrics_and_changes_nothing(samples) -> None:
    result = run(samples, None, lr=1.0)
    assert not result.updated and result.checkpoint is None and result.step == 0
    assert values(result, "updated") == [0.0]
    assert values(result, "grad_norm")[0] > 0
    assert {m.name for m in result.metrics} >= REQUIRED


def test_negative_advantage_scale_scales_only_the_negative_advantages(
    samples, tmp_path: Path
) -> None:
    # episode k of each group has reward (k % 2) + its group's offset: GRPO advantages ∓√3/2;
    # scaled by 0.5 below zero they are -√3/4 and +√3/2, given here by hand as per-sample
    # advantages for the same update
    scaled = run(samples, tmp_path / "scaled", negative_advantage_scale=0.5, **LINEAR)
    a = math.sqrt(3) / 2
    by_hand = [
        dataclasses.replace(s, advantage=a if int(s.episode_id[-1]) % 2 else -a / 2)
        for s in samples
    ]
    given = run(by_hand, tmp_path / "given", advantage="sample", **LINEAR)
    full = run(samples, tmp_path / "full", **LINEAR)
    assert values(scaled, "updated") == values(given, "updated") == values(full, "updated") == [1.0]
    assert max_diff(load_weights(tmp_path / "scaled"), load_weights(tmp_path / "given")) < 1e-6
    moved = max_diff(load_weights(tmp_path / "full"), load_weights(MODEL))
    assert max_diff(load_weights(tmp_path / "scaled"), load_weights(tmp_path / "full")) > moved / 10


def test_train_params_trains_only_the_matching_parameters(samples, tmp_path: Path) -> None:
    before = load_weights(MODEL)
    run(samples, tmp_path / "norm", lr=1e-2, train_params=r"^model\.norm\.")
    after = load_weights(tmp_path / "norm")
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert moved == {"model.norm.weight"}
    state = torch.load(tmp_path / "norm" / "optimizer.pt", weights_only=True)
    assert len(state["state"]) == 1  # Adam moments for the one trained tensor only
    # continuing with the same parameters resumes; with others the saved moments cannot fit
    again = run(
        samples, tmp_path / "again", model=tmp_path / "norm", train_params=r"^model\.norm\."
    )
    assert again.step == 2
    with pytest.raises(TrainError, match=r"optimizer\.pt: saved for train_params '\^model"):
        run(samples, tmp_path / "all", model=tmp_path / "norm", lr=1e-2)
    # the same count and shape of tensors (one [V, H] matrix each) is refused just as well
    run(samples, tmp_path / "head", lr=1e-2, train_params="lm_head")
    with pytest.raises(TrainError, match="saved for train_params 'lm_head', not 'embed_tokens'"):
        run(samples, tmp_path / "embed", model=tmp_path / "head", train_params="embed_tokens")
    run(samples, tmp_path / "fresh", model=tmp_path / "head", train_params="embed", resume=False)


def test_train_params_that_match_nothing_are_an_error(samples, tmp_path: Path) -> None:
    with pytest.raises(TrainError, match="train_params: 'no_such_layer' matches no parameter"):
        run(samples, tmp_path / "none", train_params="no_such_layer")
    assert not (tmp_path / "none").exists()


def test_lr_groups_give_their_parameters_another_lr(samples, tmp_path: Path) -> None:
    # Adam's first step moves each element by about its group's lr, whatever its gradient
    before = load_weights(MODEL)
    run(samples, tmp_path / "g", lr=1e-5, lr_groups=r"^model\.norm\.=1e-2")
    after = load_weights(tmp_path / "g")
    norm = (after["model.norm.weight"] - before["model.norm.weight"]).abs().max().item()
    head = (after["lm_head.weight"] - before["lm_head.weight"]).abs().max().item()
    assert 5e-3 < norm <= 1.01e-2
    assert 0 < head <= 1.01e-5
    state = torch.load(tmp_path / "g" / "optimizer.pt", weights_only=True)
    assert [g["lr"] for g in state["param_groups"]] == [1e-2, 1e-5]
    # the groups sort the saved moments: resuming with other groups is refused
    again = run(samples, tmp_path / "again", model=tmp_path / "g", lr_groups=r"^model\.norm\.=3e-3")
    assert again.step == 2  # the same entries with another lr resume
    with pytest.raises(TrainError, match=r"optimizer\.pt: saved for lr_groups regexes \['\^model"):
        run(samples, tmp_path / "other", model=tmp_path / "g", lr_groups="lm_head=1e-2")


def test_an_lr_group_that_takes_nothing_is_an_error(samples, tmp_path: Path) -> None:
    with pytest.raises(TrainError, match="lr_groups: 'lm_head' takes no trained parameter"):
        run(samples, tmp_path / "none", train_params=r"^model\.norm\.", lr_groups="lm_head=1")
    assert not (tmp_path / "none").exists()


def test_scale_only_trains_a_tensor_through_one_factor(samples, tmp_path: Path) -> None:
    before = load_weights(MODEL)
    norm = r"^model\.norm\."
    result = run(samples, tmp_path / "s", lr=0.1, train_params=norm, scale_only=norm)
    after = load_weights(tmp_path / "s")
    assert set(after) == set(before)  # saved as plain tensors, no parametrization left over
    assert {k for k in before if not torch.equal(before[k], after[k])} == {"model.norm.weight"}
    ratio = after["model.norm.weight"] / before["model.norm.weight"]
    # one factor for the whole tensor; Adam's first step moves it by about lr
    assert float(ratio.max() - ratio.min()) < 1e-5
    assert 0.05 < abs(float(ratio.mean()) - 1) <= 0.1 + 1e-5
    assert values(result, "grad_norm")[0] > 0
    state = torch.load(tmp_path / "s" / "optimizer.pt", weights_only=True)
    assert [v["exp_avg"].shape for v in state["state"].values()] == [torch.Size([])]
    # the next call starts its factor at 1 on the saved product and resumes the moments
    again = run(
        samples, tmp_path / "again", model=tmp_path / "s", train_params=norm, scale_only=norm
    )
    assert again.step == 2
    twice = load_weights(tmp_path / "again")["model.norm.weight"] / before["model.norm.weight"]
    assert float(twice.max() - twice.min()) < 1e-5
    with pytest.raises(TrainError, match=r"optimizer\.pt: saved for scale_only '\^model"):
        run(samples, tmp_path / "elementwise", model=tmp_path / "s", train_params=norm)
    # the rest of the trained tensors are trained element-wise beside it (plain SGD steps, so
    # that each element moves as its own gradient says)
    run(samples, tmp_path / "mixed", **LINEAR, train_params=r"norm", scale_only=norm)
    mixed = load_weights(tmp_path / "mixed")
    layer = (
        mixed["model.layers.0.input_layernorm.weight"]
        / before["model.layers.0.input_layernorm.weight"]
    )
    final = mixed["model.norm.weight"] / before["model.norm.weight"]
    assert float(layer.max() - layer.min()) > 1e-4  # not one common factor there
    assert float(final.max() - final.min()) < 1e-5 and float((final - 1).abs().max()) > 0


def test_scale_only_that_finds_no_trained_parameter_is_an_error(samples, tmp_path: Path) -> None:
    with pytest.raises(TrainError, match="scale_only: 'lm_head' finds none of the parameters"):
        run(samples, tmp_path / "none", train_params=r"^model\.norm\.", scale_only="lm_head")
    assert not (tmp_path / "none").exists()
    with pytest.raises(TrainError, match="scale_only: 'lm_head' finds none"):
        check_parameter_choice(
            MODEL, TrainConfig(train_params=r"^model\.norm\.", scale_only="lm_head")
        )


def test_the_parameter_choice_is_checked_on_the_names_alone(tmp_path: Path) -> None:
    fine = TrainConfig(train_params=r"^model\.norm\.|lm_head", lr_groups="norm=1")
    assert check_parameter_choice(MODEL, fine) is None
    with pytest.raises(TrainError, match="train_params: 'nope' matches no parameter"):
        check_parameter_choice(MODEL, TrainConfig(train_params="nope"))
    with pytest.raises(TrainError, match="lr_groups: 'embed' takes no trained parameter"):
        check_parameter_choice(MODEL, TrainConfig(train_params="lm_head", lr_groups="embed=1"))
    # a model these names cannot be built for is left to train, which says what is wrong
    (tmp_path / "config.json").write_text('{"model_type": "no-such-architecture"}')
    assert check_parameter_choice(tmp_path, TrainConfig(train_params="nope")) is None


def test_equal_rewards_give_no_gradient_and_are_counted(samples, tmp_path: Path) -> None:
    flat = [dataclasses.replace(s, reward=1.0) for s in samples]
    result = run(flat, tmp_path / "z", lr=1.0)
    assert values(result, "zero_variance_groups") == [2.0]
    assert values(result, "updated") == [0.0]
    assert max_diff(load_weights(tmp_path / "z"), load_weights(MODEL)) == 0.0


@pytest.fixture(scope="module")
def mismatched() -> list:
    # rollout log-probs scored at T = 0.7 while the trainer scores at T = 1: a real mismatch
    return make_samples(groups=2, group_size=4, segments=2, n_new=6, temperature=0.7)


@pytest.mark.parametrize("mode", ["none", "tis", "token_mask", "seq_mask"])
def test_correction_modes_on_a_real_mismatch(mismatched, mode: str) -> None:
    result = run(mismatched, None, correction=mode)
    pearson = values(result, "rollout_trainer_pearson")[0]
    masked = values(result, "masked_fraction")[0]
    assert pearson is not None and pearson < 0.999
    assert values(result, "kl_k3_rollout_old")[0] > 1e-3
    assert 0 < values(result, "is_ess")[0] < 1
    if mode in ("none", "tis"):
        assert masked == 0.0
    else:
        assert masked > 0.0
    if mode == "seq_mask":
        assert masked > values(run(mismatched, None, correction="token_mask"), "masked_fraction")[0]


def test_kl_to_the_reference_and_entropy_bonus(samples, tmp_path: Path) -> None:
    result = run(samples, tmp_path / "k", lr=3e-3, steps=2, kl_coef=0.1, entropy_coef=0.01)
    kl = values(result, "kl_ref")
    assert kl[0] == pytest.approx(0.0, abs=1e-6)  # the reference is the starting model
    assert kl[1] > 0
    assert all(math.isfinite(v) for v in values(result, "loss"))


def test_moe_model_trains(tmp_path: Path) -> None:
    samples = make_samples(MOE, groups=2, group_size=4, n_new=6)
    result = run(samples, tmp_path / "moe", model=MOE, lr=1e-3, micro_batch_tokens=24)
    assert result.updated
    assert values(result, "rollout_trainer_pearson")[0] > 0.999
    before, after = load_weights(MOE), load_weights(tmp_path / "moe")
    changed = {k for k in before if float((before[k] - after[k]).abs().max()) > 0}
    assert any("experts" in k for k in changed)
    assert any("gate" in k for k in changed)  # the router learns too
