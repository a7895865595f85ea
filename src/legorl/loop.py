"""The RL loop: K iterations of rollout → verify → align → train on a task split, the new weights
reloaded into the running in-process proxy after each training step, with a held-out evaluation
before the first iteration and after the last.

    legorl loop --model fixtures/models/tiny-agent --tasks-dir fixtures/tasks-generated --out runs/loop

One engine and one proxy live for the whole loop; each phase (an iteration's rollouts, an
evaluation) sends its Turns to its own folder. Iteration k trains on ``tasks_per_iteration`` tasks
of ``train.jsonl``, taken round-robin from a seeded shuffle, ``group_size`` samples each. The
held-out evaluation samples ``eval_samples`` runs per ``heldout.jsonl`` task with fixed seeds
(``seed`` + sample index), the same before and after, so the two are comparable; its success is
the fraction of graded runs with reward 1 (environment failures are counted, not graded).
By default the trainer updates only the final norm's gains (``train_params``, see
``LOOP_TRAIN_PARAMS`` in ``legorl.loop_config``, where the options and their defaults live), and
those through one common factor (``scale_only``, a learned inverse temperature);
``--scale-only ''`` trains the gains one by one, ``--train-params ''`` trains every parameter,
and ``--lr-groups`` gives some of them another lr.

Layout under ``out``::

    iter-001/  trajectories.jsonl graded.jsonl samples.jsonl turns/ metrics.jsonl checkpoint/
               trainer_logprobs.jsonl
    eval-before/  eval-after/  (trajectories.jsonl graded.jsonl turns/ eval.json)
    metrics.jsonl  loop.png  state.json  alerts.jsonl (with the first monitor alert)

The top-level ``metrics.jsonl`` holds Metric records of source ``loop``, step = iteration:
``reward_mean`` (graded runs), ``solved_fraction`` (tasks with a solved sample),
``rollout_trainer_pearson`` (the trainer's first step), ``crashes`` (environment failures of the
run or its grading), ``hack_flags`` (flagged runs), ``policy_version`` (after the reload),
``trained``, ``seconds`` and ``{rollout,verify,align,train,reload}_seconds``; and
``heldout_success`` / ``heldout_crashes`` at step 0 (before) and K (after).

``state.json`` is replaced whole after each finished iteration and evaluation. Running again with
the same ``out`` continues where it stopped: finished iterations are kept, the engine starts from
the last checkpoint at its policy version, and inside a half-finished phase finished trajectories
and gradings are kept. A finished loop only reports. Asking for more iterations than a finished
loop ran continues it; its old ``eval-after/`` is kept as ``eval-at-NNN/``.

A group whose samples all have one reward carries no gradient: when no group of an iteration
differs, the weights stay as they are and the trainer only runs dry (for the rollout/trainer
fidelity figures).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import os
import random
import shutil
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from legorl.loop_config import LoopConfig, LoopConfigError
from legorl.protocols import ConfigError, SandboxError
from legorl.records import (
    ENVIRONMENT_FAILURES,
    JsonlWriter,
    Metric,
    Trajectory,
    read_jsonl,
    write_jsonl,
)

STATE_FILE = "state.json"
METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loop.png"
EVAL_FILE = "eval.json"

#: Options that may change between a run and its continuation; the others must not.
_MAY_CHANGE = {"out", "iterations", "sandbox", "concurrency", "timeout", "device", "engine_options"}
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


@dataclass(kw_only=True)
class LoopState:
    config: dict[str, Any]
    finished: int = 0  # iterations finished
    checkpoint: str | None = None  # the current weights, relative to out; None: config.model
    policy_version: int = 0
    seconds: float = 0.0  # wall time of every call that worked on this loop, up to its last save
    evals: list[EvalResult] = field(default_factory=list)
    iterations: list[IterationResult] = field(default_factory=list)

    def eval_at(self, step: int) -> EvalResult | None:
        return next((e for e in self.evals if e.step == step), None)

    def save(self, path: Path) -> None:
        _atomic_write(path, (json.dumps(dataclasses.asdict(self), indent=2) + "\n").encode())

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


def groups_with_signal(graded: Sequence[Trajectory]) -> int:
    """Groups whose graded rewards are not all equal: the only ones with a policy gradient."""
    rewards: dict[str, set[float]] = {}
    for t in graded:
        if t.reward is not None:
            rewards.setdefault(t.group_id, set()).add(t.reward)
    return sum(len(r) > 1 for r in rewards.values())


def _crashed(t: Trajectory) -> bool:
    return t.status in ENVIRONMENT_FAILURES or t.reward is None


def _eval_result(step: int, version: int, graded: Sequence[Trajectory], s: float) -> EvalResult:
    ok = [t for t in graded if not _crashed(t)]
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
        for name, value in (("heldout_success", e.success), ("heldout_crashes", e.crashes)):
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
        }
        out += [
            Metric(step=it.iteration, name=k, value=v, time=it.finished_at, source="loop")
            for k, v in values.items()
        ]
    return out


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _write_metrics(state: LoopState, path: Path) -> None:
    # Rewritten whole from the state: a kill between the two never leaves lines twice.
    from legorl.records import to_json

    _atomic_write(path, b"".join(to_json(m) + b"\n" for m in loop_metrics(state)))


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
    evals = sorted(state.evals, key=lambda e: e.step)
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


def _check_same_run(config: LoopConfig, saved: dict[str, Any], where: Path) -> None:
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


# --------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------


def run_loop(
    config: LoopConfig, *, log: Log | None = None, progress: ProgressFn | None = None
) -> LoopResult:
    """Run (or continue) the loop that ``config`` describes; see the module docstring.

    Raises ``LoopConfigError`` for a bad option (before any work) and ``LoopError`` when a stage
    fails in a way the loop cannot go on from.
    """
    from legorl.tasks import TaskError, load_tasks

    say = log or (lambda _msg: None)
    started = time.monotonic()
    config.validate()
    splits = {}
    for split in ("train", "heldout"):
        try:
            splits[split] = load_tasks(
                Path(config.tasks_dir) / f"{split}.jsonl", task_format=config.task_format
            )
        except TaskError as exc:
            raise LoopConfigError("tasks_dir", str(exc)) from None
        if not splits[split]:
            raise LoopConfigError(
                "tasks_dir", f"{Path(config.tasks_dir) / f'{split}.jsonl'}: no tasks"
            )
    if config.tasks_per_iteration > len(splits["train"]):
        raise LoopConfigError(
            "tasks_per_iteration",
            f"{config.tasks_per_iteration} is more than the {len(splits['train'])} tasks of "
            f"{Path(config.tasks_dir) / 'train.jsonl'}",
        )
    from legorl.train.trainer import TrainError, check_parameter_choice

    try:  # a pattern that takes no parameter fails now, not after the first rollout
        check_parameter_choice(config.model, config.train_config())
    except TrainError as exc:
        raise LoopConfigError("train", str(exc)) from None
    out = Path(config.out)
    state_path = out / STATE_FILE
    if state_path.is_file():
        state = LoopState.load(state_path)
        _check_same_run(config, state.config, out)
        state.config = config.to_dict()
    else:
        state = LoopState(config=config.to_dict())
    resumed_from = state.finished
    done = state.finished >= config.iterations and state.eval_at(state.finished) is not None
    if done:
        say(f"{out}: all {state.finished} iteration(s) finished; nothing to run")
    else:
        if state.finished or state.evals:
            say(f"{out}: continuing after iteration {state.finished}")
        out.mkdir(parents=True, exist_ok=True)
        runner = _Runner(config, state, splits, say, progress)
        asyncio.run(runner.run())
    metrics_path = out / METRICS_FILE
    _write_metrics(state, metrics_path)
    plot_path: Path | None = out / PLOT_FILE
    if not write_plot(state, out / PLOT_FILE):
        say("matplotlib is not installed: no plot (pip install 'legorl[demo]')")
        plot_path = None
    return LoopResult(
        config=config,
        state=state,
        seconds=time.monotonic() - started,
        already_finished=done,
        resumed_from=resumed_from,
        metrics_path=metrics_path,
        plot_path=plot_path,
        state_path=state_path,
    )


class _Runner:
    """The loop's moving parts while it runs: one engine and one proxy for every phase."""

    def __init__(
        self,
        config: LoopConfig,
        state: LoopState,
        splits: dict[str, list[Any]],
        log: Log,
        progress: ProgressFn | None,
    ) -> None:
        from legorl.monitors import Monitor

        self.config = config
        self.state = state
        self.splits = splits
        self.by_id = {t.instance_id: t for ts in splits.values() for t in ts}
        self.log = log
        self.progress = progress or (lambda _phase, _done, _total: None)
        self.out = Path(config.out)
        self.monitor = Monitor(alerts_path=self.out / "alerts.jsonl")
        self.started = time.monotonic()
        self.base_seconds = state.seconds
        self.core: Any = None
        self.endpoint: Any = None
        self.backend: Any = None

    def save(self) -> None:
        self.state.seconds = round(self.base_seconds + time.monotonic() - self.started, 3)
        self.state.save(self.out / STATE_FILE)

    @property
    def model_path(self) -> Path:
        """The weights the engine serves now."""
        ckpt = self.state.checkpoint
        return self.out / ckpt if ckpt is not None else Path(self.config.model)

    async def run(self) -> None:
        from legorl.rollout import EngineSpec, serve_engine
        from legorl.sandbox import make_backend

        c, state = self.config, self.state
        options = dict(c.engine_options)  # vllm: reloads go through its weight-reload endpoints
        if c.engine == "embedded":
            device = c.device
            if device == "auto":
                import torch

                device = "cuda" if torch.cuda.is_available() else "cpu"
            options = {"device": device, **c.engine_options}  # and its dtype, when given
        # A continued loop starts the engine on the last checkpoint: its version is the one
        # those weights had, not 0.
        engine = EngineSpec(
            name=c.engine,
            weights=self.model_path,
            options=options,
            policy_version=state.policy_version,
            log_dir=self.out,
        )
        try:
            self.backend = make_backend(c.sandbox)
            ensure = getattr(self.backend, "ensure_images", None)
            if ensure is not None:  # a prebuilt image that cannot be had stops it now
                await asyncio.to_thread(ensure, [t for ts in self.splits.values() for t in ts])
        except SandboxError as exc:
            raise LoopError(f"sandbox {c.sandbox}: {exc}") from None
        async with contextlib.AsyncExitStack() as stack:
            try:
                self.endpoint, self.core = await stack.enter_async_context(
                    serve_engine(c.model, engine, self.out / "eval-before" / "turns")
                )
            except Exception as exc:
                raise LoopError(f"engine: cannot load {self.model_path}: {exc}") from None
            if state.eval_at(0) is None:
                await self._evaluate(0, self.out / "eval-before")
            for k in range(state.finished + 1, c.iterations + 1):
                await self._iteration(k)
            if state.eval_at(state.finished) is None:
                await self._evaluate(state.finished, self.out / "eval-after")

    # ---- one phase: rollout and grading, resumable ---------------------------------------

    async def _rollout_and_grade(
        self, phase: str, folder: Path, batches: list[tuple[Any, list[Any]]]
    ) -> tuple[list[Trajectory], dict[str, float]]:
        """Run every (harness, runs) batch into ``folder``, then grade; trajectories and
        gradings already there are kept. Graded trajectories in plan order, and timings."""
        from legorl.align import AlignError, turns_of
        from legorl.records import RecordError
        from legorl.rollout import Progress, RunContext, finished_ids, rollout_into
        from legorl.verify import verify

        c = self.config
        turns = folder / "turns"
        folder.mkdir(parents=True, exist_ok=True)
        self.core.redirect_turns(turns)
        endpoint = dataclasses.replace(self.endpoint, turns_dir=turns)
        traj_path, graded_path = folder / "trajectories.jsonl", folder / "graded.jsonl"
        done = finished_ids(traj_path)
        plan = [r.trajectory_id for _, runs in batches for r in runs]
        total = len(plan)
        t0 = time.monotonic()
        kept = sum(1 for tid in plan if tid in done)
        if kept:
            self.log(f"{phase}: {kept} of {total} run(s) already in {traj_path}, kept")
        counts: Counter[str] = Counter()
        finished = kept

        def count(traj: Trajectory) -> None:
            nonlocal finished
            counts[traj.status] += 1
            finished += 1
            self.progress(f"{phase}: rollout", finished, total)

        for harness, runs in batches:
            todo = [r for r in runs if r.trajectory_id not in done]
            if not todo:
                continue
            self.progress(f"{phase}: rollout", finished, total)
            ctx = RunContext(
                harness=harness,
                backend=self.backend,
                proxy=endpoint,
                model=self.core.served_name,
                tasks_dir=Path(c.tasks_dir),
                timeout=c.timeout,
                run_id=f"legorl-loop-{uuid.uuid4().hex[:8]}",
                refs_relative_to=folder,
            )
            await rollout_into(
                traj_path,
                todo,
                ctx,
                concurrency=c.concurrency,
                progress=Progress(total=len(todo)),
                each=count,
            )
        rollout_s = time.monotonic() - t0
        by_id = {t.trajectory_id: t for t in read_jsonl(traj_path, Trajectory, skip_bad=True)}
        missing = [tid for tid in plan if tid not in by_id]
        if missing:
            raise LoopError(f"{phase}: no trajectory for run(s) {', '.join(missing[:5])}")
        if counts:
            statuses = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
            self.log(f"{phase}: {sum(counts.values())} run(s) in {rollout_s:.1f}s ({statuses})")

        t1 = time.monotonic()
        graded: dict[str, Trajectory] = {}
        if graded_path.exists():
            graded = {
                t.trajectory_id: t for t in read_jsonl(graded_path, Trajectory, skip_bad=True)
            }
        todo_grade = [by_id[tid] for tid in plan if tid not in graded]

        def load(traj: Trajectory) -> list:
            # turns only feed hack flags: a run without readable turns is still graded
            try:
                return list(turns_of(traj, folder))
            except (AlignError, RecordError):
                return []

        if todo_grade:
            n = len(graded)
            with JsonlWriter(graded_path) as writer:
                async for g in verify(
                    todo_grade,
                    self.by_id,
                    backend=self.backend,
                    tasks_dir=str(c.tasks_dir),
                    run_id=f"legorl-loop-verify-{uuid.uuid4().hex[:8]}",
                    load_turns=load,
                    concurrency=c.concurrency,
                ):
                    writer.write(g)
                    graded[g.trajectory_id] = g
                    n += 1
                    self.progress(f"{phase}: verify", n, total)
        verify_s = time.monotonic() - t1
        result = [graded[tid] for tid in plan]
        for traj in result:
            self.monitor.observe_trajectory(traj)
        return result, {"rollout": round(rollout_s, 3), "verify": round(verify_s, 3)}

    # ---- held-out evaluation ---------------------------------------------------------------

    async def _evaluate(self, step: int, folder: Path) -> None:
        from legorl.harnesses import make_harness
        from legorl.rollout import plan_runs

        c, state = self.config, self.state
        marker = folder / EVAL_FILE
        if marker.is_file():
            earlier = json.loads(marker.read_text()).get("step")
            if earlier != step:  # an evaluation after fewer iterations: kept aside
                aside = folder.with_name(f"eval-at-{int(earlier):03d}")
                shutil.rmtree(aside, ignore_errors=True)
                folder.rename(aside)
        folder.mkdir(parents=True, exist_ok=True)
        version = self.core.engine.policy_version
        marker.write_text(json.dumps({"step": step, "policy_version": version}) + "\n")
        what = "before the first iteration" if step == 0 else f"after iteration {step}"
        tasks = self.splits["heldout"][: c.eval_limit]
        self.log(
            f"held-out evaluation {what}: {len(tasks)} task(s) × {c.eval_samples} seeded "
            f"sample(s), policy version {version}"
        )
        t0 = time.monotonic()
        # One harness per sample index, each with its own fixed seed: sample k of every task
        # draws the same way before and after training.
        batches = []
        for k in range(c.eval_samples):
            harness = make_harness(
                "mini",
                max_turns=c.max_turns,
                max_tokens=c.max_tokens,
                temperature=c.temperature,
                seed=c.seed + k,
            )
            runs = [
                r
                for r in plan_runs(tasks, c.eval_samples, None, set(), prefix=f"eval{step:03d}-")
                if r.sample_index == k
            ]
            batches.append((harness, runs))
        graded, _ = await self._rollout_and_grade(folder.name, folder, batches)
        result = _eval_result(step, version, graded, time.monotonic() - t0)
        marker.write_text(json.dumps({**dataclasses.asdict(result), "success": result.success}))
        state.evals = [e for e in state.evals if e.step != step] + [result]
        self.save()
        shown = "n/a" if result.success is None else f"{result.success:.1%}"
        self.log(
            f"held-out success {what}: {shown} ({result.solved} of {result.graded} graded; "
            f"{result.crashes} environment failure(s)) in {result.seconds:.1f}s"
        )

    # ---- one training iteration ------------------------------------------------------------

    async def _iteration(self, k: int) -> None:
        from legorl.align import AlignStats, align
        from legorl.harnesses import make_harness
        from legorl.records import to_json
        from legorl.rollout import plan_runs
        from legorl.train.data import SampleError
        from legorl.train.trainer import TrainError, train

        c, state = self.config, self.state
        folder = self.out / f"iter-{k:03d}"
        t0 = time.monotonic()
        tasks = iteration_tasks(self.splits["train"], c.tasks_per_iteration, k, c.seed)
        version = state.policy_version
        self.log(
            f"iteration {k}/{c.iterations}: {len(tasks)} task(s) × {c.group_size} sample(s), "
            f"policy version {version}"
        )
        harness = make_harness(
            "mini", max_turns=c.max_turns, max_tokens=c.max_tokens, temperature=c.temperature
        )
        runs = plan_runs(tasks, c.group_size, None, set(), prefix=f"it{k:03d}-")
        graded, phases = await self._rollout_and_grade(f"iteration {k}", folder, [(harness, runs)])

        t1 = time.monotonic()
        stats = AlignStats()
        samples = list(align(graded, base_dir=folder, stats=stats, skip_bad=True))
        _atomic_write(folder / "samples.jsonl", b"".join(to_json(s) + b"\n" for s in samples))
        phases["align"] = round(time.monotonic() - t1, 3)
        if stats.errors:
            self.log(f"iteration {k}: align skipped {len(stats.errors)}: {stats.errors[0]}")

        t2 = time.monotonic()
        cfg = c.train_config()
        signal = groups_with_signal(graded)
        # Zero-variance groups carry no gradient: training them is only useful when the config
        # keeps them (or brings its own advantages).
        trainable = bool(samples) and (
            signal > 0 or not cfg.drop_zero_variance_groups or cfg.advantage == "sample"
        )
        metrics_path = folder / METRICS_FILE
        metrics_path.unlink(missing_ok=True)  # a half-finished earlier try's lines
        logprobs_path = folder / "trainer_logprobs.jsonl"
        logprobs_path.unlink(missing_ok=True)
        ckpt = folder / "checkpoint"
        pearson: float | None = None
        trained = False
        with JsonlWriter(metrics_path) as writer:

            def emit(m: Metric) -> None:
                nonlocal pearson
                writer.write(m)
                self.monitor.observe_metric(m)
                if m.name == "rollout_trainer_pearson" and pearson is None:
                    pearson = m.value

            def run_train(out: Path | None) -> Any:
                result = train(
                    samples,
                    model=self.model_path,
                    out=out,
                    config=cfg,
                    dry_run=out is None,
                    skip_bad=True,  # an unusable episode (say, past the context) is dropped, said
                    emit=emit,
                    log=lambda msg: self.log(f"iteration {k}: train: {msg}"),
                    run={"loop_iteration": k, "loop_out": str(self.out)},
                )
                write_jsonl(logprobs_path, result.logprobs)  # for legorl inspect's token view
                return result

            try:
                if trainable:
                    trained = run_train(ckpt).updated
                elif samples:
                    self.log(
                        f"iteration {k}: no group with differing rewards: training skipped, "
                        "weights unchanged (a dry run gives the fidelity figures)"
                    )
                    run_train(None)
                else:
                    self.log(f"iteration {k}: no samples (every run failed): training skipped")
            except (SampleError, TrainError, ConfigError) as exc:
                raise LoopError(f"iteration {k}: train: {exc}") from None
        phases["train"] = round(time.monotonic() - t2, 3)

        t3 = time.monotonic()
        if trained:
            version = await self.core.load_weights(str(ckpt.resolve()))
            state.checkpoint = str(ckpt.relative_to(self.out))
            state.policy_version = version
            self.log(f"iteration {k}: weights reloaded into the proxy: policy version {version}")
        elif ckpt.exists():  # the trainer saved unchanged weights: not a new policy
            shutil.rmtree(ckpt)
        phases["reload"] = round(time.monotonic() - t3, 3)

        ok = [t for t in graded if not _crashed(t)]
        by_task: dict[str, list[float]] = {}
        for t in ok:
            by_task.setdefault(t.task_id, []).append(t.reward or 0.0)
        result_k = IterationResult(
            iteration=k,
            tasks=[t.instance_id for t in tasks],
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
            trained=trained,
            rollout_trainer_pearson=pearson,
            policy_version=state.policy_version,
            checkpoint=state.checkpoint,
            seconds=round(time.monotonic() - t0, 3),
            phase_seconds=phases,
            finished_at=time.time(),
        )
        state.iterations = [i for i in state.iterations if i.iteration != k] + [result_k]
        state.finished = k
        self.save()
        _write_metrics(state, self.out / METRICS_FILE)
        reward = "n/a" if result_k.reward_mean is None else f"{result_k.reward_mean:.3f}"
        corr = "n/a" if pearson is None else f"{pearson:.4f}"
        self.log(
            f"iteration {k} done in {result_k.seconds:.1f}s: reward {reward}, pearson {corr}, "
            f"{result_k.crashes} crash(es), {result_k.hack_flags} flagged, "
            + ", ".join(f"{p} {s:.1f}s" for p, s in phases.items())
        )
