"""Run monitors: each alert rule on a stream of records, the alerts file and stderr line, and
strict mode stopping the run."""

from __future__ import annotations

import io
import math
from pathlib import Path

import pytest

from legorl.monitors import (
    Monitor,
    MonitorConfig,
    MonitorStop,
    monitor_files,
    pearson,
    prob_pearson,
)
from legorl.records import (
    Alert,
    FieldError,
    Metric,
    TrainerLogprobs,
    Trajectory,
    from_dict,
    read_jsonl,
    write_jsonl,
)


def traj(i: int, status: str = "ok", flags: list[str] | None = None) -> Trajectory:
    return Trajectory(
        trajectory_id=f"t{i}",
        task_id=f"task-{i % 3}",
        group_id=f"task-{i % 3}",
        sample_index=i,
        harness="mini",
        status=status,  # type: ignore[arg-type]
        hack_flags=flags or [],
    )


def metrics(name: str, values: list[float]) -> list[Metric]:
    return [Metric(step=i, name=name, value=v) for i, v in enumerate(values)]


def test_a_correlation_drop_alerts_once_on_stderr_and_in_the_file(tmp_path: Path) -> None:
    err = io.StringIO()
    alerts = tmp_path / "run" / "alerts.jsonl"
    monitor = Monitor(alerts_path=alerts, stream=err)
    stream = [0.9997, 0.9995, 0.9991, 0.97, 0.95, 0.96, 0.999, 0.98]
    fired = [monitor.observe_metric(m) for m in metrics("rollout_trainer_pearson", stream)]
    # Alerts when the drop starts (step 3), stays quiet while it lasts, re-arms after recovery.
    assert [i for i, a in enumerate(fired) if a] == [3, 7]
    first = monitor.alerts[0]
    assert first.kind == "correlation" and first.step == 3 and first.value == 0.97
    assert first.threshold == 0.99
    lines = err.getvalue().splitlines()
    assert lines[0] == (
        "legorl monitor: ALERT [correlation] step 3: rollout/trainer probability correlation "
        "0.9700 < 0.99 (rollout_trainer_pearson): the trainer is not scoring what was sampled"
    )
    written = list(read_jsonl(alerts, Alert))
    assert [(a.kind, a.step) for a in written] == [("correlation", 3), ("correlation", 7)]
    assert all(isinstance(a, Alert) and a.time > 0 for a in written)


def test_strict_mode_stops_with_a_clear_message(tmp_path: Path) -> None:
    alerts = tmp_path / "alerts.jsonl"
    monitor = Monitor(alerts_path=alerts, strict=True, stream=None)
    stream = metrics("rollout_trainer_pearson", [0.999, 0.9993, 0.91])
    monitor.observe_metric(stream[0])
    monitor.observe_metric(stream[1])
    with pytest.raises(MonitorStop) as stop:
        monitor.observe_metric(stream[2])
    assert str(stop.value).startswith(
        "stopped by the monitor (--strict): [correlation] rollout/trainer probability "
        "correlation 0.9100 < 0.99"
    )
    assert stop.value.alert.step == 2
    assert alerts.read_bytes().count(b"legorl/alert@1") == 1  # written before stopping


def test_crash_rate_over_twenty_percent() -> None:
    monitor = Monitor(stream=None)
    statuses = ["ok"] * 8 + ["sandbox_error", "agent_error"]  # 1 env failure in 10: fine
    for i, s in enumerate(statuses):
        monitor.observe_trajectory(traj(i, s))
    assert monitor.alerts == [] and monitor.crash_rate == pytest.approx(0.1)
    # agent_error and timeout are the agent's own failures: they never count as crashes.
    for i, s in enumerate(["timeout", "harness_crash", "proxy_error"], start=10):
        monitor.observe_trajectory(traj(i, s))
    (alert,) = monitor.alerts
    assert alert.kind == "crash_rate" and alert.trajectory_id == "t12"
    assert alert.value == pytest.approx(3 / 13)
    assert "3 of the last 13 runs failed in the environment (23% > 20%)" in alert.message


def test_no_crash_rate_alert_before_enough_runs() -> None:
    monitor = Monitor(stream=None)
    for i in range(5):
        monitor.observe_trajectory(traj(i, "sandbox_error"))
    assert [a.kind for a in monitor.alerts] == []
    monitor = Monitor(MonitorConfig(crash_min_runs=3), stream=None)
    for i in range(3):
        monitor.observe_trajectory(traj(i, "sandbox_error"))
    assert [a.kind for a in monitor.alerts] == ["crash_rate"]


def test_every_hack_flag_alerts_once_per_trajectory() -> None:
    monitor = Monitor(stream=None)
    monitor.observe_trajectory(traj(0))
    monitor.observe_trajectory(traj(1, flags=["git_history_read"]))
    monitor.observe_trajectory(traj(1, flags=["git_history_read"]))  # verify re-emits it
    monitor.observe_trajectory(traj(0, flags=["test_file_edited", "conftest_hook"]))  # graded
    assert [(a.kind, a.trajectory_id) for a in monitor.alerts] == [("hack", "t1"), ("hack", "t0")]
    assert "test_file_edited, conftest_hook on task task-0" in monitor.alerts[1].message
    assert monitor.trajectories == 2


def test_reward_collapse() -> None:
    monitor = Monitor(stream=None)
    rewards = [0.2, 0.3, 0.5, 0.6, 0.7, 0.7, 0.65, 0.6, 0.4, 0.3, 0.2, 0.1, 0.1]
    fired = [monitor.observe_metric(m) for m in metrics("reward", rewards)]
    (alert,) = monitor.alerts
    assert alert.kind == "reward_collapse"
    step = next(i for i, a in enumerate(fired) if a)
    # The 5-step mean peaked at 0.65 (steps 3-7) and first fell 0.3 below it at step 11.
    assert step == 11 and alert.value == pytest.approx(0.32)
    assert "fell to 0.320 from a best of 0.650" in alert.message


def test_clip_fraction_spike() -> None:
    monitor = Monitor(stream=None)
    values = [0.02, 0.03, 0.02, 0.025, 0.12, 0.03, 0.02, 0.5]
    fired = [monitor.observe_metric(m) for m in metrics("clip_fraction", values)]
    assert [i for i, a in enumerate(fired) if a] == [4, 7]
    assert "> 3x the recent median" in monitor.alerts[0].message
    assert "0.500 > 0.3" in monitor.alerts[1].message


def test_engine_error_bursts() -> None:
    monitor = Monitor(stream=None)
    monitor.observe_metric(Metric(step=0, name="engine_errors", value=2))
    monitor.observe_metric(Metric(step=1, name="engine_errors", value=7))
    assert [a.kind for a in monitor.alerts] == ["engine_errors"]
    runs = Monitor(MonitorConfig(crash_min_runs=1000), stream=None)
    for i in range(30):
        runs.observe_trajectory(traj(i, "proxy_error" if 10 <= i < 15 else "ok"))
    (alert,) = runs.alerts
    assert alert.kind == "engine_errors" and alert.trajectory_id == "t14"
    assert "5 proxy/engine errors in the last 15 runs" in alert.message


def test_other_metrics_and_null_values_are_ignored() -> None:
    monitor = Monitor(stream=None)
    assert monitor.observe_metric(Metric(step=0, name="kl", value=99.0)) == []
    assert monitor.observe_metric(Metric(step=0, name="correlation", value=None)) == []
    assert monitor.observe_metric(Metric(step=0, name="correlation", value=math.nan)) == []
    assert monitor.observe(object()) == []


def test_metric_names_are_configurable() -> None:
    monitor = Monitor(MonitorConfig(correlation_names=("actor/pearson",)), stream=None)
    monitor.observe_metric(Metric(step=0, name="rollout_trainer_pearson", value=0.5))
    monitor.observe_metric(Metric(step=0, name="actor/pearson", value=0.5))
    assert len(monitor.alerts) == 1


def test_monitor_files(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    write_jsonl(path, metrics("rollout_trainer_pearson", [0.999, 0.5]) + [traj(0, flags=["x"])])
    with open(path, "ab") as fh:
        fh.write(b"not json\n")
    assert [a.kind for a in monitor_files([path])] == ["correlation", "hack"]


def test_pearson() -> None:
    assert pearson([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0)
    assert pearson([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert pearson([1, 1, 1], [1, 2, 3]) is None
    assert pearson([1], [1]) is None
    with pytest.raises(ValueError):
        pearson([1, 2], [1])
    assert prob_pearson([-0.1, -1.0, -3.0], [-0.1, -1.0, -3.0]) == pytest.approx(1.0)


def test_alert_and_trainer_logprobs_records_round_trip_and_reject_bad_lines(
    tmp_path: Path,
) -> None:
    path = tmp_path / "trainer.jsonl"
    rec = TrainerLogprobs(sample_id="s/0", logprobs=[-0.5, -1.0], step=3, policy_version=2)
    write_jsonl(path, [rec])
    assert list(read_jsonl(path, TrainerLogprobs)) == [rec]
    with pytest.raises(FieldError, match=r"logprobs\[0\]"):
        from_dict({"schema": "legorl/trainer_logprobs@1", "sample_id": "s", "logprobs": ["x"]})
    with pytest.raises(FieldError, match="unknown field"):
        from_dict({"schema": "legorl/alert@1", "kind": "hack", "message": "m", "colour": 1})
    with pytest.raises(FieldError, match="schema"):
        from_dict({"schema": "legorl/turn@1", "kind": "hack", "message": "m"}, Alert)


def test_routing_mismatch_alerts_once_while_it_lasts() -> None:
    monitor = Monitor(stream=None)
    values = [0.0, 0.004, 0.03, 0.05, 0.0, 0.02]
    fired = [monitor.observe_metric(m) for m in metrics("routing_mismatch", values)]
    assert [i for i, a in enumerate(fired) if a] == [2, 5]
    assert monitor.alerts[0].kind == "routing"
    assert "3.0% of MoE tokens ran other experts" in monitor.alerts[0].message
    assert "router_replay=r3" in monitor.alerts[0].message
