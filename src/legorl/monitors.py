"""Run monitors: alerts while ``rollout`` and ``train`` run, on stderr and in ``alerts.jsonl``.

    from legorl.monitors import Monitor
    monitor = Monitor(alerts_path="runs/alerts.jsonl", strict=strict)
    monitor.observe_metric(metric)          # each Metric the trainer logs
    monitor.observe_trajectory(trajectory)  # each Trajectory rollout or verify yields
    monitor.alerts                          # every Alert raised so far

A monitor watches for: rollout/trainer correlation below 0.99, environment-failure (crash) rate
above 20%, any hack flag, reward collapse, a clip-fraction spike, a burst of engine errors, and
on a mixture-of-experts model a routing mismatch above 1% (tokens whose experts in the trainer
differ from the rollout's in some layer: ``routing_mismatch``, 0 under ``router_replay=r3``);
the thresholds live in ``MonitorConfig``. Each alert is one stderr line and one ``legorl/alert@1``
line in ``alerts.jsonl``. Conditions that persist (a low correlation, a high crash rate) alert
once when they start and again only after they have cleared. With ``strict=True`` the observe
call that raised an alert then raises ``MonitorStop``, whose message says what stopped the run.

``legorl inspect`` runs a monitor over the files it shows; ``monitor_files`` does the same once.

``Alert`` (the ``legorl/alert@1`` record) lives in ``legorl.records`` with the other records.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal

from legorl.records import ENVIRONMENT_FAILURES, Alert, Metric, Record, Trajectory, write_jsonl

AlertKind = Literal[
    "correlation",
    "crash_rate",
    "hack",
    "reward_collapse",
    "clip_spike",
    "engine_errors",
    "routing",
]

# --------------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------------


def pearson(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Pearson correlation of two equal-length sequences; None when undefined (n < 2 or a
    constant sequence)."""
    if len(xs) != len(ys):
        raise ValueError(f"pearson: {len(xs)} values against {len(ys)}")
    n = len(xs)
    if n < 2:
        return None
    mx, my = math.fsum(xs) / n, math.fsum(ys) / n
    sxy = math.fsum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    sxx = math.fsum((x - mx) ** 2 for x in xs)
    syy = math.fsum((y - my) ** 2 for y in ys)
    if sxx <= 0 or syy <= 0:
        return None
    return max(-1.0, min(1.0, sxy / math.sqrt(sxx * syy)))


def prob_pearson(rollout: Sequence[float], trainer: Sequence[float]) -> float | None:
    """The health figure: Pearson of token probabilities (exp of the log-probs)."""
    return pearson([math.exp(x) for x in rollout], [math.exp(y) for y in trainer])


# --------------------------------------------------------------------------------------------
# The monitor
# --------------------------------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class MonitorConfig:
    """Thresholds. Metric names are matched against the tuples below (first one present wins)."""

    min_correlation: float = 0.99
    max_crash_rate: float = 0.20
    crash_window: int = 50  # trajectories the crash rate is taken over
    crash_min_runs: int = 10  # no crash-rate alert before this many trajectories
    collapse_window: int = 5  # reward values averaged per window
    collapse_drop: float = 0.3  # alert when the mean falls this far below its best window
    clip_max: float = 0.3  # a clip fraction above this is always a spike
    clip_spike_factor: float = 3.0  # …or above this many times the recent median
    clip_min: float = 0.05  # …and above this floor
    clip_history: int = 20
    engine_error_burst: int = 5  # engine errors in one step, or proxy errors in the window
    engine_window: int = 20  # trajectories
    max_routing_mismatch: float = 0.01  # MoE tokens routed unlike the rollout (replay off)
    correlation_names: tuple[str, ...] = (
        "rollout_trainer_pearson",
        "correlation",
        "rollout_actor_probs_pearson_corr",
    )
    reward_names: tuple[str, ...] = ("reward", "reward_mean", "reward/mean")
    clip_names: tuple[str, ...] = ("clip_fraction", "clipfrac", "pg_clipfrac")
    crash_names: tuple[str, ...] = ("crash_rate",)
    engine_error_names: tuple[str, ...] = ("engine_errors",)
    routing_names: tuple[str, ...] = ("routing_mismatch",)


class MonitorStop(RuntimeError):
    """Raised under ``strict`` by the observe call that raised an alert; stages turn it into an
    exit with this message."""

    def __init__(self, alert: Alert) -> None:
        super().__init__(f"stopped by the monitor (--strict): [{alert.kind}] {alert.message}")
        self.alert = alert


class Monitor:
    """Feed it Metric records and Trajectories; read ``alerts``. See the module docstring."""

    def __init__(
        self,
        config: MonitorConfig | None = None,
        *,
        alerts_path: str | os.PathLike[str] | None = None,
        strict: bool = False,
        stream: IO[str] | None = sys.stderr,
    ) -> None:
        self.config = config or MonitorConfig()
        # Created with the first alert only: a run that fails early leaves nothing behind.
        self.alerts_path = Path(alerts_path) if alerts_path is not None else None
        self.strict = strict
        self.stream = stream
        self.alerts: list[Alert] = []
        c = self.config
        self._active: set[str] = set()  # persistent conditions currently alerted
        self._rewards: list[float] = []
        self._best_reward_mean: float | None = None
        self._clips: deque[float] = deque(maxlen=c.clip_history)
        self._runs: deque[bool] = deque(maxlen=c.crash_window)  # True: environment failure
        self._proxy_errors: deque[bool] = deque(maxlen=c.engine_window)
        self.trajectories = 0  # distinct trajectory ids observed
        self._seen: dict[str, bool] = {}  # trajectory id -> hack alert raised

    # ---- entry points -------------------------------------------------------------------

    def observe(self, record: Record | Any) -> list[Alert]:
        """Dispatch a Metric or a Trajectory; anything else is ignored."""
        if isinstance(record, Metric):
            return self.observe_metric(record)
        if isinstance(record, Trajectory):
            return self.observe_trajectory(record)
        return []

    def observe_metric(self, metric: Metric) -> list[Alert]:
        c, v, step = self.config, metric.value, metric.step
        if v is None or not math.isfinite(v):
            return []
        new: list[Alert] = []
        name = metric.name
        if name in c.correlation_names:
            new += self._edge(
                "correlation",
                v < c.min_correlation,
                lambda: Alert(
                    kind="correlation",
                    message=f"rollout/trainer probability correlation {v:.4f} < "
                    f"{c.min_correlation} ({name}): the trainer is not scoring what was sampled",
                    step=step,
                    value=v,
                    threshold=c.min_correlation,
                ),
            )
        elif name in c.reward_names:
            new += self._reward(v, step)
        elif name in c.clip_names:
            new += self._clip(v, step)
        elif name in c.crash_names:
            new += self._edge(
                "crash_rate_metric",
                v > c.max_crash_rate,
                lambda: Alert(
                    kind="crash_rate",
                    message=f"crash rate {v:.0%} > {c.max_crash_rate:.0%} ({name})",
                    step=step,
                    value=v,
                    threshold=c.max_crash_rate,
                ),
            )
        elif name in c.routing_names:
            new += self._edge(
                "routing",
                v > c.max_routing_mismatch,
                lambda: Alert(
                    kind="routing",
                    message=f"{v:.1%} of MoE tokens ran other experts in the trainer than in "
                    f"the rollout (> {c.max_routing_mismatch:.0%}, {name}): their log-probs "
                    "disagree; train with router_replay=r3",
                    step=step,
                    value=v,
                    threshold=c.max_routing_mismatch,
                ),
            )
        elif name in c.engine_error_names:
            new += self._edge(
                "engine_errors_metric",
                v >= c.engine_error_burst,
                lambda: Alert(
                    kind="engine_errors",
                    message=f"{v:g} engine errors in one step (burst threshold "
                    f"{c.engine_error_burst})",
                    step=step,
                    value=v,
                    threshold=float(c.engine_error_burst),
                ),
            )
        return self._emit(new)

    def observe_trajectory(self, traj: Trajectory) -> list[Alert]:
        """A trajectory seen again (verify re-emits rollout's, graded) only adds hack alerts:
        each run counts once towards the rates."""
        c = self.config
        seen = traj.trajectory_id in self._seen
        new: list[Alert] = []
        if traj.hack_flags and not self._seen.get(traj.trajectory_id):
            new.append(
                Alert(
                    kind="hack",
                    message=f"hack flag(s) {', '.join(traj.hack_flags)} on task {traj.task_id} "
                    f"({traj.harness})",
                    trajectory_id=traj.trajectory_id,
                )
            )
        self._seen[traj.trajectory_id] = bool(traj.hack_flags) or self._seen.get(
            traj.trajectory_id, False
        )
        if seen:
            return self._emit(new)
        self.trajectories += 1
        self._runs.append(traj.status in ENVIRONMENT_FAILURES)
        n = len(self._runs)
        rate = sum(self._runs) / n
        if n >= c.crash_min_runs:
            new += self._edge(
                "crash_rate",
                rate > c.max_crash_rate,
                lambda: Alert(
                    kind="crash_rate",
                    message=f"{sum(self._runs)} of the last {n} runs failed in the environment "
                    f"({rate:.0%} > {c.max_crash_rate:.0%}); latest: {traj.status}",
                    trajectory_id=traj.trajectory_id,
                    value=rate,
                    threshold=c.max_crash_rate,
                ),
            )
        self._proxy_errors.append(traj.status == "proxy_error")
        errors = sum(self._proxy_errors)
        new += self._edge(
            "engine_errors",
            errors >= c.engine_error_burst,
            lambda: Alert(
                kind="engine_errors",
                message=f"{errors} proxy/engine errors in the last {len(self._proxy_errors)} runs",
                trajectory_id=traj.trajectory_id,
                value=float(errors),
                threshold=float(c.engine_error_burst),
            ),
        )
        return self._emit(new)

    @property
    def crash_rate(self) -> float | None:
        """Environment-failure rate over the last ``crash_window`` trajectories."""
        return sum(self._runs) / len(self._runs) if self._runs else None

    def close(self) -> None:
        """Nothing is held open between alerts; kept so callers can treat it as a resource."""

    # ---- rules --------------------------------------------------------------------------

    def _edge(self, key: str, bad: bool, make: Any) -> list[Alert]:
        # Alert when a condition starts; stay quiet while it lasts; re-arm once it clears.
        if bad and key not in self._active:
            self._active.add(key)
            return [make()]
        if not bad:
            self._active.discard(key)
        return []

    def _reward(self, v: float, step: int) -> list[Alert]:
        c = self.config
        self._rewards.append(v)
        w = c.collapse_window
        if len(self._rewards) < w:
            return []
        mean = math.fsum(self._rewards[-w:]) / w
        best = self._best_reward_mean
        out = []
        if best is not None:
            out = self._edge(
                "reward_collapse",
                best - mean >= c.collapse_drop,
                lambda: Alert(
                    kind="reward_collapse",
                    message=f"mean reward over the last {w} steps fell to {mean:.3f} from a best "
                    f"of {best:.3f} (drop >= {c.collapse_drop})",
                    step=step,
                    value=mean,
                    threshold=best - c.collapse_drop,
                ),
            )
        self._best_reward_mean = mean if best is None else max(best, mean)
        return out

    def _clip(self, v: float, step: int) -> list[Alert]:
        c = self.config
        history = list(self._clips)
        self._clips.append(v)
        median = statistics.median(history) if len(history) >= 3 else None
        spike = v > c.clip_max or (
            median is not None and v > c.clip_min and v > c.clip_spike_factor * median
        )
        if not spike:
            why = ""
        elif v > c.clip_max:
            why = f"> {c.clip_max}"
        else:
            why = f"> {c.clip_spike_factor:g}x the recent median {median:.3f}"
        return self._edge(
            "clip_spike",
            spike,
            lambda: Alert(
                kind="clip_spike",
                message=f"clip fraction {v:.3f} {why}: the policy moved far from the rollout policy",
                step=step,
                value=v,
                threshold=c.clip_max,
            ),
        )

    # ---- output -------------------------------------------------------------------------

    def _emit(self, new: list[Alert]) -> list[Alert]:
        if not new:
            return new
        now = time.time()
        for alert in new:
            alert.time = now
            self.alerts.append(alert)
            if self.stream is not None:
                print(alert.line(), file=self.stream, flush=True)
        if self.alerts_path is not None:
            self.alerts_path.parent.mkdir(parents=True, exist_ok=True)
            write_jsonl(self.alerts_path, new)
        if self.strict:
            raise MonitorStop(new[0])
        return new


def monitor_files(
    paths: Iterable[str | os.PathLike[str]], config: MonitorConfig | None = None
) -> list[Alert]:
    """Run a silent, non-strict monitor once over the Metric and Trajectory records of JSONL
    files (bad lines and other records skipped); returns its alerts."""
    from legorl.records import read_jsonl

    monitor = Monitor(config, stream=None)
    for path in paths:
        for record in read_jsonl(path, (Metric, Trajectory), skip_bad=True):
            monitor.observe(record)
    return monitor.alerts


__all__ = [
    "Alert",
    "Monitor",
    "MonitorConfig",
    "MonitorStop",
    "monitor_files",
    "pearson",
    "prob_pearson",
]
