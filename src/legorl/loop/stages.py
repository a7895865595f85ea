"""The loop's stages as functions over records, shared by the synchronous and the asynchronous
driver: which runs a group is, rollout and grading through an executor into a phase folder,
align, train, and what an iteration's result says. The drivers only decide when each runs.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from legorl.loop.state import IterationResult, LoopError, atomic_write, crashed
from legorl.loop_config import LoopConfig
from legorl.protocols import ConfigError, Executor, GradeWork, RolloutWork
from legorl.records import JsonlWriter, Metric, Sample, Trajectory, write_jsonl

#: The harness the loop's runs use: the built-in minimal agent.
LOOP_HARNESS = "mini"


def group_prefix(batch: int) -> str:
    """The id prefix of the runs a batch (1-based; an iteration of the sync loop) admits."""
    return f"it{batch:03d}-"


def group_runs(task: Any, group_size: int, prefix: str) -> list[Any]:
    """The ``group_size`` runs of one task's group."""
    from legorl.rollout import plan_runs

    return plan_runs([task], group_size, None, set(), prefix=prefix)


def rollout_work(config: LoopConfig, runs: list[Any], folder: Path, model: str) -> RolloutWork:
    """Training runs as plain data: the loop's ``mini`` harness, sandbox and limits."""
    return RolloutWork(
        runs=runs,
        harness=LOOP_HARNESS,
        harness_options=harness_options(config),
        sandbox=config.sandbox,
        model=model,
        tasks_dir=str(config.tasks_dir),
        folder=str(folder),
        timeout=config.timeout,
        concurrency=config.concurrency,
        run_id=f"legorl-loop-{uuid.uuid4().hex[:8]}",
    )


def run_seed(config: LoopConfig, run: Any) -> int | None:
    """A training run's sampling seed with ``seeded_rollouts`` (its batch and sample index
    fix it, so a rerun of the loop replays the same draws); None: unseeded."""
    if not config.seeded_rollouts:
        return None
    batch = int(run.prefix[2:5]) if run.prefix.startswith("it") else 0
    return config.seed + 100_000 * batch + 100 * run.sample_index  # a call adds its index


def harness_options(config: LoopConfig, seed: int | None = None) -> dict[str, Any]:
    options: dict[str, Any] = {
        "max_turns": config.max_turns,
        "max_tokens": config.max_tokens,
        "temperature": config.temperature,
    }
    if seed is not None:
        options["seed"] = seed
    return options


def grade_work(
    config: LoopConfig, trajectories: list[Trajectory], tasks: list[Any], folder: Path
) -> GradeWork:
    return GradeWork(
        trajectories=trajectories,
        tasks=tasks,
        sandbox=config.sandbox,
        tasks_dir=str(config.tasks_dir),
        folder=str(folder),
        concurrency=config.concurrency,
        run_id=f"legorl-loop-verify-{uuid.uuid4().hex[:8]}",
    )


async def rollout_into(
    executor: Executor,
    work: RolloutWork,
    out: Path,
    each: Callable[[Trajectory], None] | None = None,
) -> None:
    """``work`` through ``executor``, each Trajectory appended to ``out`` as it ends."""
    with JsonlWriter(out) as writer:
        async for traj in executor.rollout(work):
            writer.write(traj)
            if each is not None:
                each(traj)


async def grade_into(
    executor: Executor,
    work: GradeWork,
    out: Path,
    each: Callable[[Trajectory], None] | None = None,
) -> None:
    """``work`` through ``executor``, each graded Trajectory appended to ``out``."""
    with JsonlWriter(out) as writer:
        async for graded in executor.grade(work):
            writer.write(graded)
            if each is not None:
                each(graded)


def read_by_id(path: Path) -> dict[str, Trajectory]:
    """The trajectories in ``path`` by id (a truncated last line from a kill is ignored)."""
    from legorl.records import read_jsonl

    if not path.exists():
        return {}
    return {t.trajectory_id: t for t in read_jsonl(path, Trajectory, skip_bad=True)}


def status_counts(counts: Counter[str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))


# ---- align ---------------------------------------------------------------------------------


def align_samples(
    graded: Sequence[Trajectory], folder_of: Callable[[Trajectory], Path]
) -> tuple[list[Sample], list[str]]:
    """Samples of ``graded`` in their order (each trajectory's Turns relative to its folder),
    and the errors of episodes that could not be aligned (dropped)."""
    from legorl.align import AlignStats, align

    samples: list[Sample] = []
    errors: list[str] = []
    for traj in graded:
        stats = AlignStats()
        samples += align([traj], base_dir=folder_of(traj), stats=stats, skip_bad=True)
        errors += stats.errors
    return samples, errors


def write_samples(path: Path, samples: Sequence[Sample]) -> None:
    from legorl.records import to_json

    atomic_write(path, b"".join(to_json(s) + b"\n" for s in samples))


def groups_with_signal(graded: Sequence[Trajectory]) -> int:
    """Groups whose graded rewards are not all equal: the only ones with a policy gradient."""
    rewards: dict[str, set[float]] = {}
    for t in graded:
        if t.reward is not None:
            rewards.setdefault(t.group_id, set()).add(t.reward)
    return sum(len(r) > 1 for r in rewards.values())


def zero_variance(graded: Sequence[Trajectory]) -> bool:
    """A group's graded rewards are all equal (or none was graded): no gradient."""
    return len({t.reward for t in graded if t.reward is not None}) <= 1


# ---- train ---------------------------------------------------------------------------------


@dataclass(slots=True)
class TrainOutcome:
    trained: bool = False  # the weights changed and were saved to the checkpoint
    pearson: float | None = None  # rollout/trainer, the first step
    metrics: list[Metric] = field(default_factory=list)


def train_samples(
    config: LoopConfig,
    samples: list[Sample],
    *,
    step: int,
    model: Path,
    folder: Path,
    out: Path,
    signal: int,
    monitor: Any,
    log: Callable[[str], None],
) -> TrainOutcome:
    """One iteration's training on ``samples`` (blocking: the async driver runs it in a
    thread): ``folder/checkpoint`` when the weights changed, ``folder/metrics.jsonl`` and
    ``folder/trainer_logprobs.jsonl``; a dry run when no group carries a gradient."""
    from legorl.train.checkpoint import TrainError
    from legorl.train.data import SampleError
    from legorl.train.trainer import train

    cfg = config.train_config()
    # Zero-variance groups carry no gradient: training them is only useful when the config
    # keeps them (or brings its own advantages).
    trainable = bool(samples) and (
        signal > 0 or not cfg.drop_zero_variance_groups or cfg.advantage == "sample"
    )
    metrics_path = folder / "metrics.jsonl"
    metrics_path.unlink(missing_ok=True)  # a half-finished earlier try's lines
    logprobs_path = folder / "trainer_logprobs.jsonl"
    logprobs_path.unlink(missing_ok=True)
    ckpt = folder / "checkpoint"
    outcome = TrainOutcome()
    folder.mkdir(parents=True, exist_ok=True)
    with JsonlWriter(metrics_path) as writer:

        def emit(m: Metric) -> None:
            writer.write(m)
            outcome.metrics.append(m)
            monitor.observe_metric(m)
            if m.name == "rollout_trainer_pearson" and outcome.pearson is None:
                outcome.pearson = m.value

        def run_train(target: Path | None) -> Any:
            result = train(
                samples,
                model=model,
                out=target,
                config=cfg,
                dry_run=target is None,
                skip_bad=True,  # an unusable episode (say, past the context) is dropped, said
                emit=emit,
                log=lambda msg: log(f"iteration {step}: train: {msg}"),
                run={"loop_iteration": step, "loop_out": str(out)},
            )
            write_jsonl(logprobs_path, result.logprobs)  # for legorl inspect's token view
            return result

        try:
            if trainable:
                outcome.trained = run_train(ckpt).updated
            elif samples:
                log(
                    f"iteration {step}: no group with differing rewards: training skipped, "
                    "weights unchanged (a dry run gives the fidelity figures)"
                )
                run_train(None)
            else:
                log(f"iteration {step}: no samples (every run failed): training skipped")
        except (SampleError, TrainError, ConfigError) as exc:
            raise LoopError(f"iteration {step}: train: {exc}") from None
    return outcome


# ---- what an iteration says ----------------------------------------------------------------


def staleness_histogram(samples: Sequence[Sample], version: int) -> dict[str, int]:
    """Samples by staleness (the trainer's version minus the oldest span's), keys as text."""
    counts = Counter(str(max(0, version - s.oldest_version)) for s in samples)
    return dict(sorted(counts.items(), key=lambda kv: int(kv[0])))


def spanning_fraction(samples: Sequence[Sample]) -> float | None:
    """The fraction of samples whose spans came from more than one policy version."""
    if not samples:
        return None
    return sum(len(set(s.span_versions)) > 1 for s in samples) / len(samples)


def iteration_result(
    *,
    iteration: int,
    tasks: list[str],
    graded: Sequence[Trajectory],
    samples: Sequence[Sample],
    signal: int,
    outcome: TrainOutcome,
    policy_version: int,
    checkpoint: str | None,
    trained_version: int,
    seconds: float,
    phases: dict[str, float],
    extra: dict[str, Any] | None = None,
) -> IterationResult:
    ok = [t for t in graded if not crashed(t)]
    by_task: dict[str, list[float]] = {}
    for t in ok:
        by_task.setdefault(t.task_id, []).append(t.reward or 0.0)
    return IterationResult(
        iteration=iteration,
        tasks=tasks,
        runs=len(graded),
        graded=len(ok),
        reward_mean=sum(t.reward or 0.0 for t in ok) / len(ok) if ok else None,
        solved_fraction=(
            sum(max(r) == 1.0 for r in by_task.values()) / len(by_task) if by_task else None
        ),
        crashes=len(graded) - len(ok),
        hack_flags=sum(bool(t.hack_flags) for t in graded),
        groups_with_signal=signal,
        samples=len(samples),
        trained=outcome.trained,
        rollout_trainer_pearson=outcome.pearson,
        policy_version=policy_version,
        checkpoint=checkpoint,
        seconds=round(seconds, 3),
        phase_seconds=phases,
        finished_at=time.time(),
        staleness=staleness_histogram(samples, trained_version),
        spanning_fraction=spanning_fraction(samples),
        **(extra or {}),
    )


# ---- utilisation ---------------------------------------------------------------------------


class BusyMeter:
    """Wall time during which at least one of something is going on (calls of an engine in
    flight, a trainer step): ``start()``/``stop()`` around each, ``busy()`` the seconds."""

    def __init__(self) -> None:
        self.active = 0
        self.total = 0.0
        self.since = 0.0

    def start(self) -> None:
        if self.active == 0:
            self.since = time.monotonic()
        self.active += 1

    def stop(self) -> None:
        self.active -= 1
        if self.active == 0:
            self.total += time.monotonic() - self.since

    def busy(self) -> float:
        now = time.monotonic()
        return self.total + (now - self.since if self.active else 0.0)


class MeteredEngine:
    """An engine whose ``generate`` calls are timed by a ``BusyMeter`` (everything else is the
    engine's own): the engine's busy fraction is its meter's busy time over the wall time."""

    def __init__(self, engine: Any, meter: BusyMeter) -> None:
        self._engine = engine
        self.meter = meter

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    @property
    def policy_version(self) -> int:
        version: int = self._engine.policy_version
        return version

    @policy_version.setter
    def policy_version(self, value: int) -> None:
        self._engine.policy_version = value

    async def generate(self, request: Any) -> Any:
        self.meter.start()
        try:
            async for chunk in self._engine.generate(request):
                yield chunk
        finally:
            self.meter.stop()

    async def load_weights(self, path: str) -> int:
        version: int = await self._engine.load_weights(path)
        return version

    async def close(self) -> None:
        await self._engine.close()
