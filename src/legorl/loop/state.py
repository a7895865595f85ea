"""What the loop remembers and reports: its state file (``state.json``), the per-iteration and
per-evaluation results, the Metric records of ``metrics.jsonl`` and the plot. Shared by the
synchronous and the asynchronous driver, so that both resume from the same state.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from legorl.loop_config import LoopConfig, LoopConfigError
from legorl.records import ENVIRONMENT_FAILURES, Metric, Trajectory

STATE_FILE = "state.json"
METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loop.png"
EVAL_FILE = "eval.json"

#: Options that may change between a run and its continuation; the others must not.
_MAY_CHANGE = {
    "out", "iterations", "sandbox", "concurrency", "timeout", "device", "engine_options",
    "ray", "eval_base",
}  # fmt: skip
_PATHS = {"model", "tasks_dir"}

Log = Callable[[str], None]
#: (phase, done, total): called as runs and gradings finish.
ProgressFn = Callable[[str, int, int], None]


class LoopError(RuntimeError):
    """A stage failed in a way the loop cannot go on from; the message says which."""


# --------------------------------------------------------------------------------------------
# What the loop remembers (state.json)
# --------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class EvalResult:
    step: int  # iterations finished when it ran: 0 before the first
    policy_version: int
    runs: int
    graded: int  # runs with a reward (environment failures have none)
    solved: int  # runs with reward 1
    crashes: int  # environment failures, of the run or of its grading
    hack_flags: int  # runs with at least one hack flag
    seconds: float
    finished_at: float = 0.0  # Unix time
    # the adapter its sessions sampled with: None, the policy; BASE_ADAPTER, the base model
    # beside the policy's adapter in the same engine (--eval-base)
    adapter: str | None = None

    @property
    def success(self) -> float | None:
        return self.solved / self.graded if self.graded else None


@dataclass(kw_only=True)
class IterationResult:
    iteration: int
    tasks: list[str]
    runs: int
    graded: int
    reward_mean: float | None  # over graded runs
    solved_fraction: float | None  # tasks with at least one solved sample, of those graded
    crashes: int
    hack_flags: int
    groups_with_signal: int  # groups whose rewards differ
    samples: int
    trained: bool  # False: no group carried a gradient, the weights stayed
    rollout_trainer_pearson: float | None
    policy_version: int  # after this iteration's weight reload
    checkpoint: str | None  # relative to out; None: the starting model
    seconds: float
    phase_seconds: dict[str, float] = field(default_factory=dict)
    finished_at: float = 0.0  # Unix time
    # Trained samples by staleness (the trainer's policy version minus the oldest span's; the
    # keys are the staleness as text), and the fraction whose spans came from several versions.
    staleness: dict[str, int] = field(default_factory=dict)
    spanning_fraction: float | None = None
    # The asynchronous driver's: the groups this step consumed (trained, filtered or dropped;
    # by their runs' id prefix and task), groups dropped for staleness, filtered for equal
    # rewards, re-rolled; and utilisation over the step's wall time.
    groups: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    filtered: list[str] = field(default_factory=list)
    rerun: int = 0
    drain_seconds: float = 0.0  # the weight sync's wait for calls in flight
    engine_busy_fraction: float | None = None  # time with a model call in flight
    trainer_idle_fraction: float | None = None  # time the trainer waited for a batch


@dataclass(kw_only=True)
class LoopState:
    config: dict[str, Any]
    finished: int = 0  # iterations finished
    checkpoint: str | None = None  # the current weights, relative to out; None: config.model
    policy_version: int = 0
    seconds: float = 0.0  # wall time of every call that worked on this loop, up to its last save
    evals: list[EvalResult] = field(default_factory=list)
    iterations: list[IterationResult] = field(default_factory=list)

    def eval_at(self, step: int, adapter: str | None = None) -> EvalResult | None:
        """The held-out evaluation after ``step`` iterations (of the policy, or of ``adapter``)."""
        return next((e for e in self.evals if e.step == step and e.adapter == adapter), None)

    def save(self, path: Path) -> None:
        atomic_write(path, (json.dumps(dataclasses.asdict(self), indent=2) + "\n").encode())

    @classmethod
    def load(cls, path: Path) -> LoopState:
        try:
            data = json.loads(path.read_text())
            return cls(
                config=data["config"],
                finished=data["finished"],
                checkpoint=data["checkpoint"],
                policy_version=data["policy_version"],
                seconds=data.get("seconds", 0.0),
                evals=[EvalResult(**e) for e in data["evals"]],
                iterations=[IterationResult(**i) for i in data["iterations"]],
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise LoopError(f"{path}: not a loop state file ({exc})") from None


@dataclass(kw_only=True)
class LoopResult:
    config: LoopConfig
    state: LoopState
    metrics_path: Path
    plot_path: Path | None  # None: matplotlib is not installed
    state_path: Path
    already_finished: bool  # nothing was left to run
    resumed_from: int  # iterations that were finished when this call started
    seconds: float  # this call

    @property
    def before(self) -> EvalResult | None:
        return self.state.eval_at(0)

    @property
    def after(self) -> EvalResult | None:
        return self.state.eval_at(self.state.finished) if self.state.finished else None

    @property
    def total_seconds(self) -> float:
        """Wall time of every call that worked on this loop (a killed one up to its last save)."""
        return self.state.seconds


# --------------------------------------------------------------------------------------------
# Small pure helpers
# --------------------------------------------------------------------------------------------


def iteration_tasks(tasks: Sequence[Any], per_iteration: int, iteration: int, seed: int) -> list:
    """The tasks of ``iteration`` (1-based): round-robin through one seeded shuffle."""
    order = list(tasks)
    random.Random(seed).shuffle(order)
    start = (iteration - 1) * per_iteration
    return [order[(start + i) % len(order)] for i in range(per_iteration)]


def crashed(t: Trajectory) -> bool:
    return t.status in ENVIRONMENT_FAILURES or t.reward is None


def eval_result(step: int, version: int, graded: Sequence[Trajectory], s: float) -> EvalResult:
    ok = [t for t in graded if not crashed(t)]
    return EvalResult(
        step=step,
        policy_version=version,
        runs=len(graded),
        graded=len(ok),
        solved=sum(t.reward == 1.0 for t in ok),
        crashes=len(graded) - len(ok),
        hack_flags=sum(bool(t.hack_flags) for t in graded),
        seconds=round(s, 3),
        finished_at=time.time(),
    )


def loop_metrics(state: LoopState) -> list[Metric]:
    """The loop's Metric records (source ``loop``): per iteration, and per held-out evaluation."""
    out: list[Metric] = []
    for e in sorted(state.evals, key=lambda e: e.step):
        tail = "" if e.adapter is None else "_base"
        for name, value in (("heldout_success", e.success), ("heldout_crashes", e.crashes)):
            name += tail
            out.append(
                Metric(
                    step=e.step,
                    name=name,
                    value=None if value is None else float(value),
                    time=e.finished_at,
                    source="loop",
                )
            )
    for it in state.iterations:
        values: dict[str, float | None] = {
            "reward_mean": it.reward_mean,
            "solved_fraction": it.solved_fraction,
            "rollout_trainer_pearson": it.rollout_trainer_pearson,
            "crashes": float(it.crashes),
            "hack_flags": float(it.hack_flags),
            "policy_version": float(it.policy_version),
            "trained": 1.0 if it.trained else 0.0,
            "seconds": it.seconds,
            **{f"{k}_seconds": v for k, v in it.phase_seconds.items()},
            "dropped_stale": float(len(it.dropped)),
            "filtered_groups": float(len(it.filtered)),
            "rerun_groups": float(it.rerun),
            "spanning_fraction": it.spanning_fraction,
            "drain_seconds": it.drain_seconds,
            "engine_busy_fraction": it.engine_busy_fraction,
            "trainer_idle_fraction": it.trainer_idle_fraction,
            **{f"staleness_{k}": float(v) for k, v in it.staleness.items()},
        }
        out += [
            Metric(step=it.iteration, name=k, value=v, time=it.finished_at, source="loop")
            for k, v in values.items()
        ]
    return out


def atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_metrics(state: LoopState, path: Path) -> None:
    # Rewritten whole from the state: a kill between the two never leaves lines twice.
    from legorl.records import to_json

    atomic_write(path, b"".join(to_json(m) + b"\n" for m in loop_metrics(state)))


def write_plot(state: LoopState, path: Path) -> bool:
    """Reward, held-out success and rollout/trainer Pearson per iteration, as a PNG; False when
    matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    its = state.iterations
    x = [i.iteration for i in its]
    nan = float("nan")

    def values(name: str) -> list[float]:
        return [nan if getattr(i, name) is None else getattr(i, name) for i in its]

    fig, axes = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
    ax = axes[0]
    ax.plot(x, values("reward_mean"), "o-", label="reward mean")
    ax.plot(x, values("solved_fraction"), "s--", label="tasks solved (any sample)")
    skipped = [i.iteration for i in its if not i.trained]
    if skipped:
        ax.plot(skipped, [0.0] * len(skipped), "x", color="grey", label="not trained")
    ax.set_ylabel("train split")
    ax.set_ylim(-0.05, 1.05)
    ax.legend(loc="best", fontsize="small")
    ax = axes[1]
    evals = sorted((e for e in state.evals if e.adapter is None), key=lambda e: e.step)
    ax.plot(
        [e.step for e in evals],
        [nan if e.success is None else e.success for e in evals],
        "o-",
        color="tab:green",
    )
    ax.set_ylabel("held-out success")
    ax.set_ylim(-0.05, 1.05)
    ax = axes[2]
    corr = values("rollout_trainer_pearson")
    ax.plot(x, corr, "o-", color="tab:purple")
    ax.axhline(0.99, color="grey", linestyle=":", linewidth=1)
    known = [v for v in corr if not math.isnan(v)]
    ax.set_ylim(min([0.98, *[v - 0.005 for v in known]]), 1.002)
    ax.set_ylabel("rollout/trainer Pearson")
    ax.set_xlabel("iteration")
    ax.set_xticks(sorted({0, *x}))
    fig.suptitle(f"legorl loop: {Path(state.config.get('model', '')).name}")
    fig.tight_layout()
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)
    return True


def check_same_run(config: LoopConfig, saved: dict[str, Any], where: Path) -> None:
    now = config.to_dict()
    for name, value in now.items():
        if name in _MAY_CHANGE or name not in saved:
            continue
        old = saved[name]
        same = Path(old).resolve() == Path(value).resolve() if name in _PATHS else old == value
        if not same:
            raise LoopConfigError(
                name,
                f"{value!r} differs from {old!r}, which the loop in {where} ran with: "
                "give the same value to continue it, or another --out",
            )
