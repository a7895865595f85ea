"""The one config mechanism: class defaults, YAML, key=value overrides, flags; validated; unknown
keys rejected by name; the resolved config reloads to the same values."""

from __future__ import annotations

from pathlib import Path

import pytest

from legorl.train.config import ConfigError, TrainConfig, build_config, dump_config


def test_defaults_live_in_the_class() -> None:
    c = build_config()
    assert c == TrainConfig()
    assert (c.algorithm, c.gspo_clip_low, c.gspo_clip_high, c.ppo_clip_low) == (
        "gspo",
        3e-4,
        4e-4,
        0.2,
    )
    assert (c.correction, c.tis_cap, c.kl_coef, c.entropy_coef, c.steps) == ("tis", 2.0, 0, 0, 1)
    assert c.advantage_mode == "grpo"
    assert TrainConfig(algorithm="drgrpo").advantage_mode == "drgrpo"


def test_yaml_then_overrides_then_flags(tmp_path: Path) -> None:
    run = tmp_path / "run.yaml"
    run.write_text("algorithm: grpo\nlr: 3e-6\nsteps: 4\ncorrection: seq_mask\n")
    c = build_config(run, ["lr=1e-5", "train_aux=true", "ppo_clip_high=0.28"], steps=2)
    assert c.algorithm == "grpo"
    assert c.lr == 1e-5  # the override beats the file; "3e-6" (YAML text) was read as a number
    assert c.train_aux is True
    assert c.ppo_clip_high == 0.28
    assert c.steps == 2  # the flag beats both
    assert c.correction == "seq_mask"


def test_unknown_keys_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown config key 'lrr' \\(did you mean 'lr'\\?\\)"):
        build_config(overrides=["lrr=1e-5"])
    run = tmp_path / "run.yaml"
    run.write_text("algorithm: gspo\nclip_eps: 0.2\n")
    with pytest.raises(ConfigError, match=r"run.yaml: unknown config key 'clip_eps'"):
        build_config(run)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("algorithm=ppo", "algorithm: must be one of gspo, grpo, drgrpo"),
        ("steps=1.5", "steps: expected an integer"),
        ("steps=0", "steps: must be >= 1"),
        ("lr=fast", "lr: expected a number"),
        ("train_aux=maybe", "train_aux: expected true or false"),
        ("gspo_clip_low=1.5", "gspo_clip_low: must be in (0, 1)"),
        ("seq_mask_low=1.2", "seq_mask_low, seq_mask_high"),
        ("negative_advantage_scale=-0.5", "negative_advantage_scale: must be in [0, 1]"),
        ("train_params=norm(", "train_params: not a regular expression"),
        ("scale_only=norm[", "scale_only: not a regular expression"),
        ("lr_groups=norm(=0.1", "lr_groups: 'norm(' is not a regular expression"),
        ("lr_groups=norm", "lr_groups: expected REGEX=LR, got 'norm'"),
        ("lr_groups=norm=fast", "lr_groups: the lr of 'norm=fast' must be a number > 0"),
        ("lr_groups='head=1e-3 norm=0'", "lr_groups: the lr of 'norm=0' must be a number > 0"),
        ("lr", "expected key=value"),
    ],
)
def test_bad_values_are_rejected_with_the_key(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_config(overrides=[override])
    assert message in str(info.value)


def test_lr_groups_are_read_in_order() -> None:
    config = build_config(overrides=[r"lr_groups=^model\.norm\.=0.4  lm_head=3e-5"])
    assert config.lr_group_entries() == [(r"^model\.norm\.", 0.4), ("lm_head", 3e-5)]
    assert build_config().lr_group_entries() == []


def test_negative_advantage_scale_needs_group_advantages() -> None:
    with pytest.raises(ConfigError, match="negative_advantage_scale: scales group advantages"):
        build_config(overrides=["advantage=sample", "negative_advantage_scale=0.5"])


def test_resolved_config_reloads(tmp_path: Path) -> None:
    c = build_config(overrides=["algorithm=drgrpo", "lr=2e-6", "micro_batch_tokens=4096"])
    path = tmp_path / "train_config.yaml"
    dump_config(c, path, extra={"model": "m", "processes": 2})
    assert build_config(path) == c
