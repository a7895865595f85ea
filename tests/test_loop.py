"""`legorl loop`: rollout → verify → align → train with the embedded engine, weights reloaded into
the running proxy, held-out evaluation before and after, resumable; bad options named.

Everything real: the embedded engine serving the random tiny model, the built-in `mini` agent in
`local` (bubblewrap) sandboxes, grading in fresh sandboxes, the trainer. The tiny model never
solves a task, so every reward is 0 and every group has one reward: the trainer would rightly
skip such groups. To exercise save → reload → new policy version, the mechanics runs keep them
(`drop_zero_variance_groups=false`) and add an entropy bonus (`entropy_coef=0.01`): a batch whose
advantages are all 0 then still has a gradient, from the entropy term alone. The kill test runs
with the trainer's defaults, so it also covers the iteration that is not trained.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT

from legorl.loop import (
    EvalResult,
    IterationResult,
    LoopConfig,
    LoopConfigError,
    LoopResult,
    LoopState,
    groups_with_signal,
    iteration_tasks,
    loop_metrics,
    run_loop,
)
from legorl.loop_config import LOOP_LR, LOOP_LR_ALL, LOOP_LR_SCALE, LOOP_TRAIN_PARAMS
from legorl.records import Metric, Trajectory, Turn, read_jsonl

TASKS = ROOT / "fixtures" / "tasks"
MODEL = ROOT / "fixtures" / "models" / "tiny-qwen3"
MECHANICS = ["drop_zero_variance_groups=false", "entropy_coef=0.01"]


def _config(out: Path, **changes: object) -> LoopConfig:
    fields: dict = dict(
        model=MODEL,
        tasks_dir=TASKS,
        out=out,
        iterations=1,
        group_size=2,
        tasks_per_iteration=2,
        eval_samples=1,
        eval_limit=2,
        max_turns=2,
        max_tokens=24,
        concurrency=2,
        timeout=120.0,
        lr=1e-3,
        train_overrides=list(MECHANICS),
        device="cpu",
    )
    fields.update(changes)
    return LoopConfig(**fields)


def _versions(folder: Path) -> set[int]:
    return {
        t.policy_version for p in (folder / "turns").glob("*.jsonl") for t in read_jsonl(p, Turn)
    }


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


@pytest.fixture(scope="module")
def one_iteration(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LoopResult, list[str]]:
    out = tmp_path_factory.mktemp("loop") / "run"
    lines: list[str] = []
    result = run_loop(_config(out), log=lines.append)
    return out, result, lines


def test_one_iteration_trains_reloads_the_proxy_and_evaluates(
    one_iteration: tuple[Path, LoopResult, list[str]],
) -> None:
    out, result, lines = one_iteration
    it = out / "iter-001"
    for name in ("trajectories.jsonl", "graded.jsonl", "samples.jsonl", "metrics.jsonl"):
        assert (it / name).is_file(), name
    graded = list(read_jsonl(it / "graded.jsonl", Trajectory))
    assert len(graded) == 4 and all(t.verdict is not None for t in graded)
    # The trained weights are new, and the engine serves them: version 0 → 1.
    start, trained = _weights(MODEL), _weights(it / "checkpoint")
    assert start.keys() == trained.keys()
    assert any(not (start[k] == trained[k]).all() for k in start)
    assert result.state.policy_version == 1 and result.state.iterations[0].trained
    # Turns sampled before the reload carry the old version, those after it the new one.
    assert _versions(out / "eval-before") == {0}
    assert _versions(it) == {0}
    assert _versions(out / "eval-after") == {1}
    # Trainer metrics: rollout and trainer agree on the sampled tokens.
    trainer = list(read_jsonl(it / "metrics.jsonl", Metric))
    corr = [m.value for m in trainer if m.name == "rollout_trainer_pearson"]
    assert corr and corr[0] is not None and corr[0] >= 0.99
    # Loop metrics: per iteration, plus held-out success before (0) and after (1).
    loop = list(read_jsonl(out / "metrics.jsonl", Metric))
    assert {m.source for m in loop} == {"loop"}
    names = {(m.step, m.name) for m in loop}
    for name in ("reward_mean", "solved_fraction", "rollout_trainer_pearson", "crashes"):
        assert (1, name) in names
    for name in ("hack_flags", "policy_version", "seconds"):
        assert (1, name) in names
    assert (0, "heldout_success") in names and (1, "heldout_success") in names
    version = next(m.value for m in loop if m.name == "policy_version")
    assert version == 1.0
    assert next(m.value for m in loop if m.name == "rollout_trainer_pearson") >= 0.99
    assert (out / "loop.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    state = json.loads((out / "state.json").read_text())
    assert state["finished"] == 1 and state["checkpoint"] == "iter-001/checkpoint"
    assert state["policy_version"] == 1
    assert [(e["step"], e["policy_version"], e["runs"]) for e in state["evals"]] == [
        (0, 0, 2),
        (1, 1, 2),
    ]
    train_ids = {t.instance_id for t in read_jsonl(TASKS / "train.jsonl")}
    assert set(state["iterations"][0]["tasks"]) <= train_ids
    assert result.before is not None and result.after is not None
    assert result.before.success == 0.0 and result.after.crashes == 0
    assert any("weights reloaded into the proxy: policy version 1" in line for line in lines)


def test_inspect_reads_a_loop_folder(one_iteration: tuple[Path, LoopResult, list[str]]) -> None:
    out, _, _ = one_iteration
    result = subprocess.run(
        [sys.executable, "-m", "legorl.cli.main", "inspect", "--summary", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "trajector" in result.stdout.lower(), result.stdout[:2000]
    assert "reward_mean" in result.stdout or "heldout_success" in result.stdout
    # Every run is its own row: the evaluations before and after run the same tasks with the
    # same seeds, and their ids still differ (2 + 2 held-out runs, 4 train runs).
    assert "trajectories (8)" in result.stdout, result.stdout[:2000]
    ids = {
        folder: {t.trajectory_id for t in read_jsonl(out / folder / "graded.jsonl", Trajectory)}
        for folder in ("eval-before", "eval-after", "iter-001")
    }
    assert [len(ids[f]) for f in ("eval-before", "eval-after", "iter-001")] == [2, 2, 4]
    assert all(i.startswith("eval000-") for i in ids["eval-before"])
    assert all(i.startswith("eval001-") for i in ids["eval-after"])
    assert all(i.startswith("it001-") for i in ids["iter-001"])


def test_more_iterations_continue_a_finished_loop_without_redoing_it(
    one_iteration: tuple[Path, LoopResult, list[str]], tmp_path: Path
) -> None:
    out = tmp_path / "run"
    shutil.copytree(one_iteration[0], out)
    first = (out / "iter-001" / "trajectories.jsonl").read_bytes()
    before = (out / "eval-before" / "graded.jsonl").read_bytes()
    lines: list[str] = []
    result = run_loop(_config(out, iterations=2), log=lines.append)
    assert result.resumed_from == 1 and not result.already_finished
    assert (out / "iter-001" / "trajectories.jsonl").read_bytes() == first
    assert (out / "eval-before" / "graded.jsonl").read_bytes() == before
    assert not any("iteration 1/" in line for line in lines)
    # Iteration 2 starts from iteration 1's checkpoint at its version, on other tasks.
    assert _versions(out / "iter-002") == {1}
    assert _versions(out / "eval-after") == {2}
    s = result.state
    assert s.finished == 2 and s.policy_version == 2 and s.checkpoint == "iter-002/checkpoint"
    assert set(s.iterations[0].tasks).isdisjoint(s.iterations[1].tasks)
    # The evaluation after iteration 1 is kept aside; before/after compare 0 with 2.
    assert json.loads((out / "eval-at-001" / "eval.json").read_text())["step"] == 1
    assert [e.step for e in s.evals] == [0, 1, 2]
    assert result.after is not None and result.after.step == 2
    steps = [m.step for m in read_jsonl(out / "metrics.jsonl", Metric) if m.name == "reward_mean"]
    assert steps == [1, 2]
    # A finished loop only reports.
    again = run_loop(_config(out, iterations=2))
    assert again.already_finished and again.state.finished == 2


def _cli(
    *args: str, cwd: Path, timeout: int = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "legorl.cli.main", "loop", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
    )


def _lines(path: Path) -> int:
    return len(path.read_bytes().splitlines()) if path.exists() else 0


def test_a_killed_loop_continues_mid_iteration(tmp_path: Path) -> None:
    # The trainer's defaults: all-zero rewards give no usable group, so no iteration trains.
    args = [
        "--model",
        str(MODEL),
        "--tasks-dir",
        str(TASKS),
        "--out",
        "run",
        "--iterations",
        "2",
        "--group-size",
        "2",
        "--tasks-per-iteration",
        "2",
        "--eval-samples",
        "1",
        "--eval-limit",
        "1",
        "--max-turns",
        "2",
        "--max-tokens",
        "24",
        "--device",
        "cpu",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "legorl.cli.main", "loop", *args],
        cwd=tmp_path,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    out = tmp_path / "run"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and _lines(out / "iter-002" / "trajectories.jsonl") < 1:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert json.loads((out / "state.json").read_text())["finished"] == 1
    kept = [t.trajectory_id for t in read_jsonl(out / "iter-002" / "trajectories.jsonl")]
    assert kept
    first = (out / "iter-001" / "trajectories.jsonl").read_bytes()

    resumed = _cli(*args, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "continuing after iteration 1" in resumed.stderr
    assert "already in" in resumed.stderr  # the runs finished before the kill were kept
    assert "iteration 1/" not in resumed.stderr
    assert (out / "iter-001" / "trajectories.jsonl").read_bytes() == first
    ids = [t.trajectory_id for t in read_jsonl(out / "iter-002" / "trajectories.jsonl")]
    assert ids[: len(kept)] == kept and len(ids) == len(set(ids)) == 4
    state = json.loads((out / "state.json").read_text())
    assert state["finished"] == 2 and state["policy_version"] == 0
    assert state["checkpoint"] is None
    assert [i["trained"] for i in state["iterations"]] == [False, False]
    # Not trained, but the dry run still measured rollout/trainer agreement.
    assert all(i["rollout_trainer_pearson"] >= 0.99 for i in state["iterations"])
    assert not (out / "iter-002" / "checkpoint").exists()
    assert "training skipped" in resumed.stderr
    assert "held-out success: 0.0% → 0.0% (+0.0 points)" in resumed.stderr
    assert "Pearson over 2 iteration(s)" in resumed.stderr
    assert f"weights: {MODEL} (no iteration trained)" in resumed.stderr
    trained = [m.value for m in read_jsonl(out / "metrics.jsonl", Metric) if m.name == "trained"]
    assert trained == [0.0, 0.0]

    finished = _cli(*args, cwd=tmp_path, timeout=60)
    assert finished.returncode == 0
    assert "all 2 iteration(s) finished; nothing to run" in finished.stderr
    assert "held-out success" in finished.stderr


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--iterations", "0"], "--iterations"),
        (["--group-size", "-1"], "--group-size"),
        (["--eval-limit", "0"], "--eval-limit"),
        (["--timeout", "0"], "--timeout"),
        (["--sandbox", "nope"], "--sandbox"),
        (["--algorithm", "ppo"], "--algorithm"),
        (["--tasks-per-iteration", "101"], "--tasks-per-iteration"),
        (["nosuchkey=1"], "nosuchkey"),
        (["steps=3"], "--steps-per-iteration"),
        (["--model", "no/such/model"], "--model: no/such/model: not a model folder"),
        (["--train-params", "norm("], "train_params: not a regular expression"),
        (["--lr-groups", "norm=fast"], "lr_groups: the lr of 'norm=fast' must be a number > 0"),
        (["--train-params", "no_such_layer"], "train_params: 'no_such_layer' matches no param"),
        (["--lr-groups", "lm_head=1e-3"], "lr_groups: 'lm_head' takes no trained parameter"),
        (["--scale-only", "norm["], "scale_only: not a regular expression"),
        (["--scale-only", "lm_head"], "scale_only: 'lm_head' finds none of the parameters"),
        (
            ["--ray", "auto", "--engine", "vllm", "--engine-opt", "base_url=http://127.0.0.1:9"],
            "--ray: each node's worker serves the policy itself",
        ),
    ],
)
def test_bad_values_exit_2_naming_the_flag(tmp_path: Path, args: list[str], named: str) -> None:
    base = ["--model", str(MODEL), "--tasks-dir", str(TASKS), "--out", "run"]
    result = _cli(*base, *args, cwd=tmp_path, timeout=60)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("legorl loop: error: "), result.stderr
    assert named in lines[0]
    assert not (tmp_path / "run").exists()


def test_a_missing_task_file_is_named(tmp_path: Path) -> None:
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    shutil.copy(TASKS / "train.jsonl", tasks / "train.jsonl")
    result = _cli("--model", str(MODEL), "--tasks-dir", str(tasks), cwd=tmp_path, timeout=60)
    assert result.returncode == 2
    assert f"--tasks-dir: {tasks / 'heldout.jsonl'}: no such task file" in result.stderr


def test_a_harness_missing_here_fails_before_any_sandbox_in_one_line(tmp_path: Path) -> None:
    import socket

    from legorl.loop.runner import preflight

    # this host's PATH without python3, the interpreter the built-in `mini` agent runs with
    farm = tmp_path / "bin"
    farm.mkdir()
    for exe in Path("/usr/bin").iterdir():
        if exe.name != "python3":
            (farm / exe.name).symlink_to(exe)
    base = ["--model", str(MODEL), "--tasks-dir", str(TASKS), "--out", "run"]
    result = _cli(*base, cwd=tmp_path, timeout=120, env={"PATH": f"{farm}:/usr/local/bin"})
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines == [
        f"legorl loop: error: harness mini is not installed on node {socket.gethostname()} "
        "(python3 is not on PATH); install: install python3 (the built-in agent runs with it)"
    ], result.stderr
    assert not (tmp_path / "run").exists()  # nothing started, nothing written
    preflight(_config(tmp_path / "run"))  # the control: with python3 on PATH it passes


def test_a_changed_option_is_refused_when_continuing(
    one_iteration: tuple[Path, LoopResult, list[str]],
) -> None:
    with pytest.raises(LoopConfigError) as err:
        run_loop(_config(one_iteration[0], group_size=3))
    assert err.value.field == "group_size" and "differs from 2" in err.value.problem


# ---- pure parts ---------------------------------------------------------------------------


def test_iterations_take_tasks_round_robin_from_one_seeded_shuffle() -> None:
    tasks = list(range(10))
    its = [iteration_tasks(tasks, 4, k, seed=3) for k in (1, 2, 3)]
    assert its[0] == iteration_tasks(tasks, 4, 1, seed=3)  # deterministic: resumable
    assert set(its[0]).isdisjoint(its[1])
    assert sorted(its[0] + its[1] + its[2][:2]) == tasks  # every task before any repeats
    assert its[2][2:] == its[0][:2]
    assert iteration_tasks(tasks, 4, 1, seed=4) != its[0]


def test_config_validation_names_the_field(tmp_path: Path) -> None:
    for field, value in [("concurrency", 0), ("max_tokens", 0), ("temperature", 0.0)]:
        with pytest.raises(LoopConfigError) as err:
            _config(tmp_path, **{field: value}).validate()
        assert err.value.field == field
    with pytest.raises(LoopConfigError) as err:
        _config(tmp_path, train_overrides=["kl_coef=-1"]).validate()
    assert err.value.field == "train" and "kl_coef" in err.value.problem
    with pytest.raises(LoopConfigError) as err:
        _config(tmp_path, train_overrides=["lr=1e-5"]).validate()  # and lr=1e-3 as --lr
    assert err.value.problem == "override 'lr=1e-5': --lr is given too"
    assert _config(tmp_path).train_config().drop_zero_variance_groups is False


def test_learning_rate_comes_from_the_flag_an_override_or_the_loop() -> None:
    assert LoopConfig().train_config().lr == LOOP_LR_SCALE  # not the trainer's own default
    assert LoopConfig(scale_only="").train_config().lr == LOOP_LR  # the gains one by one
    assert LoopConfig(train_params="").train_config().lr == LOOP_LR_ALL  # every parameter
    assert LoopConfig(train_params="lm_head").train_config().lr == LOOP_LR_ALL
    assert LoopConfig(lr=3e-4).train_config().lr == 3e-4
    assert LoopConfig(train_overrides=["lr=2e-6"]).train_config().lr == 2e-6
    # The CLI states the default without importing the loop (start-up stays light): it must
    # say the loop's own number.
    import typing

    from legorl.cli import loop as cli_loop

    (option,) = typing.get_type_hints(cli_loop.loop, include_extras=True)["lr"].__metadata__
    stated = re.search(r"default: ([0-9.e+-]+)", option.help)
    assert stated is not None and float(stated.group(1)) == LOOP_LR_SCALE, option.help
    one_by_one = re.search(
        r"([0-9.e+-]+) with the default --train-params and --scale-only ''", option.help
    )
    assert one_by_one is not None and float(one_by_one.group(1)) == LOOP_LR, option.help
    otherwise = re.search(r"else ([0-9.e+-]+);", option.help)
    assert otherwise is not None and float(otherwise.group(1)) == LOOP_LR_ALL, option.help


def test_the_trained_parameters_come_from_the_loop() -> None:
    assert LoopConfig().train_config().train_params == LOOP_TRAIN_PARAMS
    assert LoopConfig(train_params="").train_config().train_params == ""
    with pytest.raises(LoopConfigError) as err:
        LoopConfig(train_overrides=["train_params=lm_head"]).train_config()
    assert err.value.problem == (
        "override 'train_params=lm_head': the loop sets train_params; use --train-params"
    )
    with pytest.raises(LoopConfigError) as err:
        LoopConfig(train_params="norm(").train_config()
    assert err.value.field == "train" and "train_params: not a regular expression" in str(err.value)


def test_the_final_norm_is_trained_as_one_factor_unless_told_otherwise() -> None:
    assert LoopConfig().train_config().scale_only == LOOP_TRAIN_PARAMS
    assert LoopConfig(scale_only="").train_config().scale_only == ""
    assert LoopConfig(train_params="").train_config().scale_only == ""  # every parameter
    assert LoopConfig(train_params="", scale_only="norm").train_config().scale_only == "norm"
    with pytest.raises(LoopConfigError) as err:
        LoopConfig(train_overrides=["scale_only=lm_head"]).train_config()
    assert err.value.problem == (
        "override 'scale_only=lm_head': the loop sets scale_only; use --scale-only"
    )


def test_the_lr_groups_come_from_the_flag() -> None:
    assert LoopConfig().train_config().lr_groups == ""
    config = LoopConfig(train_params="", lr=3e-5, lr_groups=r"^model\.norm\.=0.4").train_config()
    assert config.lr_group_entries() == [(r"^model\.norm\.", 0.4)] and config.lr == 3e-5
    with pytest.raises(LoopConfigError) as err:
        LoopConfig(train_overrides=["lr_groups=lm_head=1"]).train_config()
    assert err.value.problem == (
        "override 'lr_groups=lm_head=1': the loop sets lr_groups; use --lr-groups"
    )


def test_the_cli_defaults_are_the_loop_config_defaults() -> None:
    """Each LoopConfig field with a default is a `legorl loop` flag with that default, and
    `--help` shows it: the CLI restates none of them."""
    import typer.main
    from legorl.cli.main import app

    params = {p.name: p for p in typer.main.get_command(app).commands["loop"].params}  # type: ignore[attr-defined]
    fields = [f for f in dataclasses.fields(LoopConfig) if f.default is not dataclasses.MISSING]
    assert len(fields) > 20
    for f in fields:
        assert f.name in params, f"LoopConfig.{f.name} has no flag"
        assert params[f.name].default == f.default, f.name
    # What the user reads: the flag and its default on one line of the help.
    help_text = subprocess.run(
        [sys.executable, "-m", "legorl.cli.main", "loop", "--help"],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1"},
        timeout=120,
    ).stdout
    shown = {
        "--iterations": LoopConfig.iterations,
        "--group-size": LoopConfig.group_size,
        "--timeout": LoopConfig.timeout,
        "--model": LoopConfig.model,
    }
    for flag, value in shown.items():
        line = next(ln for ln in help_text.splitlines() if f"{flag} " in ln)
        assert f"[default: {value}]" in line, line


def _traj(tid: str, group: str, reward: float | None, status: str = "ok") -> Trajectory:
    return Trajectory(
        trajectory_id=tid,
        task_id=group,
        group_id=group,
        sample_index=0,
        harness="mini",
        status=status,  # type: ignore[arg-type]
        reward=reward,
    )


def test_only_groups_with_differing_rewards_carry_a_signal() -> None:
    graded = [
        _traj("a.0", "a", 0.0),
        _traj("a.1", "a", 1.0),
        _traj("b.0", "b", 0.0),
        _traj("b.1", "b", 0.0),
        _traj("c.0", "c", 1.0),
        _traj("c.1", "c", None, "harness_crash"),  # environment failure: not a reward
    ]
    assert groups_with_signal(graded) == 1


def test_loop_metrics_come_from_the_state() -> None:
    state = LoopState(
        config={},
        finished=1,
        evals=[
            EvalResult(
                step=0,
                policy_version=0,
                runs=4,
                graded=3,
                solved=1,
                crashes=1,
                hack_flags=0,
                seconds=1.0,
            )
        ],
        iterations=[
            IterationResult(
                iteration=1,
                tasks=["t"],
                runs=2,
                graded=2,
                reward_mean=0.5,
                solved_fraction=1.0,
                crashes=0,
                hack_flags=1,
                groups_with_signal=1,
                samples=2,
                trained=True,
                rollout_trainer_pearson=0.999,
                policy_version=1,
                checkpoint="iter-001/checkpoint",
                seconds=3.0,
                phase_seconds={"rollout": 2.0},
            )
        ],
    )
    values = {(m.step, m.name): m.value for m in loop_metrics(state)}
    assert values[(0, "heldout_success")] == pytest.approx(1 / 3)
    assert values[(0, "heldout_crashes")] == 1.0
    assert values[(1, "reward_mean")] == 0.5 and values[(1, "hack_flags")] == 1.0
    assert values[(1, "rollout_seconds")] == 2.0 and values[(1, "trained")] == 1.0
