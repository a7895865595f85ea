"""``run_loop``: the checks before any work, the state, and the runner every driver shares (one
engine, one proxy, one executor for every phase; the held-out evaluations) with the
synchronous driver's iteration: roll out a batch, grade it, align, train, reload.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import shutil
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from legorl.loop import stages
from legorl.loop.state import (
    EVAL_FILE,
    METRICS_FILE,
    PLOT_FILE,
    STATE_FILE,
    Log,
    LoopError,
    LoopResult,
    LoopState,
    ProgressFn,
    check_same_run,
    eval_result,
    iteration_tasks,
    write_metrics,
    write_plot,
)
from legorl.loop_config import LoopConfig, LoopConfigError
from legorl.protocols import BASE_ADAPTER as BASE
from legorl.protocols import ExecutorError, RolloutWork, SandboxError
from legorl.records import Trajectory


def load_splits(config: LoopConfig) -> dict[str, list[Any]]:
    """The train and held-out tasks; a ``LoopConfigError`` names what is wrong with them."""
    from legorl.tasks import TaskError, load_tasks

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
    if config.groups_per_batch > len(splits["train"]):
        name = "batch_groups" if config.batch_groups is not None else "tasks_per_iteration"
        raise LoopConfigError(
            name,
            f"{config.groups_per_batch} is more than the {len(splits['train'])} tasks of "
            f"{Path(config.tasks_dir) / 'train.jsonl'}",
        )
    return splits


def preflight(config: LoopConfig) -> None:
    """The loop's harness can run here, before any engine or sandbox starts; a ``LoopError``
    naming the harness, this node and the install line when it cannot."""
    from legorl.harnesses import make_harness
    from legorl.sandbox.runtime import PreflightError, harness_preflight

    harness = make_harness(stages.LOOP_HARNESS, **stages.harness_options(config))
    try:
        harness_preflight(harness, config.sandbox)
    except PreflightError as exc:
        raise LoopError(str(exc)) from None


def run_loop(
    config: LoopConfig, *, log: Log | None = None, progress: ProgressFn | None = None
) -> LoopResult:
    """Run (or continue) the loop that ``config`` describes; see ``legorl.loop``.

    Raises ``LoopConfigError`` for a bad option (before any work) and ``LoopError`` when a stage
    fails in a way the loop cannot go on from.
    """
    say = log or (lambda _msg: None)
    started = time.monotonic()
    config.validate()
    splits = load_splits(config)
    if config.ray is None:  # on a cluster, each node's worker checks its own
        preflight(config)
    from legorl.train.checkpoint import TrainError
    from legorl.train.params import check_parameter_choice

    try:  # a pattern that takes no parameter fails now, not after the first rollout
        check_parameter_choice(config.model, config.train_config())
    except TrainError as exc:
        raise LoopConfigError("train", str(exc)) from None
    if config.use_async:
        from legorl.loop.driver_async import check_live_reload

        check_live_reload(config)
    out = Path(config.out)
    state_path = out / STATE_FILE
    if state_path.is_file():
        state = LoopState.load(state_path)
        check_same_run(config, state.config, out)
        state.config = config.to_dict()
    else:
        state = LoopState(config=config.to_dict())
    resumed_from = state.finished
    done = (
        state.finished >= config.iterations
        and state.eval_at(state.finished) is not None
        and (not config.eval_base or state.eval_at(state.finished, BASE) is not None)
    )
    if done:
        say(f"{out}: all {state.finished} iteration(s) finished; nothing to run")
    else:
        if state.finished or state.evals:
            say(f"{out}: continuing after iteration {state.finished}")
        out.mkdir(parents=True, exist_ok=True)
        runner: Runner
        if config.use_async:
            from legorl.loop.driver_async import AsyncRunner

            runner = AsyncRunner(config, state, splits, say, progress)
        else:
            runner = Runner(config, state, splits, say, progress)
        asyncio.run(runner.run())
    metrics_path = out / METRICS_FILE
    write_metrics(state, metrics_path)
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


class Runner:
    """The loop's moving parts while it runs: one engine, one proxy and one executor for every
    phase; ``train_iterations`` is the driver (here the synchronous one)."""

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
        self.core: Any = None  # the in-process proxy's core (None on Ray: each node has its own)
        self.executor: Any = None
        self._served_name = ""
        # calls of the engine in flight (None: not measured here, each Ray node has its own)
        self.engine_meter: stages.BusyMeter | None = stages.BusyMeter()

    def engine_busy(self) -> float:
        """Seconds the engine has had a call in flight (0 when not measured here)."""
        return self.engine_meter.busy() if self.engine_meter is not None else 0.0

    def save(self) -> None:
        self.state.seconds = round(self.base_seconds + time.monotonic() - self.started, 3)
        self.state.save(self.out / STATE_FILE)

    @property
    def model_path(self) -> Path:
        """The weights the engine serves now."""
        ckpt = self.state.checkpoint
        return self.out / ckpt if ckpt is not None else Path(self.config.model)

    def engine_spec(self) -> Any:
        """The engine the loop serves, on the weights it serves now (a continued loop: the last
        checkpoint, at the policy version those weights had, not 0)."""
        from legorl.rollout import EngineSpec

        c = self.config
        options = dict(c.engine_options)  # vllm: reloads go through its weight-reload endpoints
        if c.engine == "embedded":
            options = {"device": c.device, **c.engine_options}  # and its dtype, when given
        return EngineSpec(
            name=c.engine,
            weights=self.model_path,
            options=options,
            policy_version=self.state.policy_version,
            log_dir=self.out,
        )

    async def run(self) -> None:
        c, state = self.config, self.state
        async with contextlib.AsyncExitStack() as stack:
            try:
                if c.ray is None:
                    await self._serve_here(stack)
                else:
                    await self._serve_on_ray(stack, c.ray)
                if state.eval_at(0) is None:
                    await self._evaluate(0, self.out / "eval-before")
                await self.train_iterations()
                if state.eval_at(state.finished) is None:
                    await self._evaluate(state.finished, self.out / "eval-after")
                if c.eval_base and state.finished and state.eval_at(state.finished, BASE) is None:
                    # the same seeded held-out runs on the base model, beside the adapter
                    await self._evaluate(state.finished, self.out / "eval-base", adapter=BASE)
            except ExecutorError as exc:  # e.g. every node of the cluster gone
                where = f"--ray {c.ray}" if c.ray is not None else f"executor {self.executor.name}"
                raise LoopError(f"{where}: {exc}") from None

    async def _serve_here(self, stack: contextlib.AsyncExitStack) -> None:
        """One engine behind one proxy in this process, and the in-process executor over it."""
        from legorl.executors import InProcessExecutor
        from legorl.rollout import serve_engine

        c = self.config
        engine = self.engine_spec()
        if engine.options.get("device") == "auto":
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
            engine = dataclasses.replace(engine, options={**engine.options, "device": device})
        try:
            endpoint, self.core = await stack.enter_async_context(
                serve_engine(c.model, engine, self.out / "eval-before" / "turns")
            )
        except Exception as exc:
            raise LoopError(f"engine: cannot load {self.model_path}: {exc}") from None
        self.engine_meter = stages.BusyMeter()
        self.core.engine = stages.MeteredEngine(self.core.engine, self.engine_meter)
        self._served_name = self.core.served_name
        self.executor = InProcessExecutor(self.core, endpoint.url)
        stack.push_async_callback(self.executor.close)
        try:
            tasks = [t for ts in self.splits.values() for t in ts]
            await self.executor.prepare(c.sandbox, {}, tasks)
        except SandboxError as exc:
            raise LoopError(f"sandbox {c.sandbox}: {exc}") from None

    async def _serve_on_ray(self, stack: contextlib.AsyncExitStack, address: str) -> None:
        """A worker on each node of the Ray cluster at ``address``, each with its own engine
        (on the loop's base model, then its last checkpoint, shipped), proxy and sandboxes; the
        phases run there and the weight syncs reach every node. Each node's engine calls are
        its own: the engine's busy fraction is not measured here."""
        from legorl import __version__
        from legorl.executors.ray import RayExecutor, WorkerSetup

        c, state = self.config, self.state
        # The model folder is at the same path on every node, as the tasks are; a checkpoint
        # is shipped below, and loading it makes the version the loop is at.
        engine = dataclasses.replace(
            self.engine_spec(),
            weights=Path(c.model).resolve(),
            policy_version=state.policy_version - (state.checkpoint is not None),
        )
        setup = WorkerSetup(
            version=__version__,
            sandbox=c.sandbox,
            harness=stages.LOOP_HARNESS,
            harness_options=stages.harness_options(c),
            engine=engine,
            model=str(Path(c.model).resolve()),
            tasks_dir=str(Path(c.tasks_dir).resolve()),
            timeout=c.timeout,
            run_id=f"legorl-loop-{uuid.uuid4().hex[:8]}",
        )
        executor = RayExecutor(address, setup)
        self.executor = executor
        self.engine_meter = None
        stack.push_async_callback(self._close_ray, executor)
        self._served_name = await executor.serve()
        for why in executor.stats.refused.values():
            self.log(f"on Ray: left out: {why}")
        self.log(f"on Ray: {executor.stats.summary()}")
        if state.checkpoint is not None:
            from legorl.protocols import EngineError

            try:
                version = await executor.load_weights(str((self.out / state.checkpoint).resolve()))
            except EngineError as exc:
                raise LoopError(f"--ray {address}: {exc}") from None
            if version != state.policy_version:
                raise LoopError(
                    f"--ray {address}: the nodes serve policy version {version}, the loop is at "
                    f"{state.policy_version}"
                )

    async def _close_ray(self, executor: Any) -> None:
        await executor.close()
        if executor.stats.nodes:
            self.log(f"on Ray: {executor.stats.summary()}")

    async def train_iterations(self) -> None:
        for k in range(self.state.finished + 1, self.config.iterations + 1):
            await self._iteration(k)

    @property
    def served_name(self) -> str:
        """The model name the harnesses ask the proxy for."""
        return self._served_name or self.core.served_name

    # ---- one phase: rollout and grading, resumable ---------------------------------------

    async def _rollout_and_grade(
        self, phase: str, folder: Path, works: list[RolloutWork]
    ) -> tuple[list[Trajectory], dict[str, float]]:
        """Run every work into ``folder``, then grade; trajectories and gradings already there
        are kept. Graded trajectories in plan order, and timings."""
        c = self.config
        folder.mkdir(parents=True, exist_ok=True)
        traj_path, graded_path = folder / "trajectories.jsonl", folder / "graded.jsonl"
        done = stages.read_by_id(traj_path)
        plan = [r.trajectory_id for w in works for r in w.runs]
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

        for work in works:
            todo = [r for r in work.runs if r.trajectory_id not in done]
            if not todo:
                continue
            self.progress(f"{phase}: rollout", finished, total)
            await stages.rollout_into(
                self.executor, dataclasses.replace(work, runs=todo), traj_path, count
            )
        rollout_s = time.monotonic() - t0
        by_id = stages.read_by_id(traj_path)
        missing = [tid for tid in plan if tid not in by_id]
        if missing:
            raise LoopError(f"{phase}: no trajectory for run(s) {', '.join(missing[:5])}")
        if counts:
            self.log(
                f"{phase}: {sum(counts.values())} run(s) in {rollout_s:.1f}s "
                f"({stages.status_counts(counts)})"
            )

        t1 = time.monotonic()
        graded = stages.read_by_id(graded_path)
        todo_grade = [by_id[tid] for tid in plan if tid not in graded]
        if todo_grade:
            n = len(graded)

            def took(g: Trajectory) -> None:
                nonlocal n
                graded[g.trajectory_id] = g
                n += 1
                self.progress(f"{phase}: verify", n, total)

            tasks = list({t.task_id: self.by_id[t.task_id] for t in todo_grade}.values())
            grading = stages.grade_work(c, todo_grade, tasks, folder)
            await stages.grade_into(self.executor, grading, graded_path, took)
        verify_s = time.monotonic() - t1
        result = [graded[tid] for tid in plan]
        for traj in result:
            self.monitor.observe_trajectory(traj)
        return result, {"rollout": round(rollout_s, 3), "verify": round(verify_s, 3)}

    # ---- held-out evaluation ---------------------------------------------------------------

    async def _evaluate(self, step: int, folder: Path, adapter: str | None = None) -> None:
        """The held-out evaluation after ``step`` iterations into ``folder``: of the policy, or
        with every session on ``adapter`` (``BASE_ADAPTER``: the base model)."""
        from legorl.rollout import plan_runs

        c, state = self.config, self.state
        marker = folder / EVAL_FILE
        if marker.is_file():
            earlier = json.loads(marker.read_text()).get("step")
            if earlier != step:  # an evaluation after fewer iterations: kept aside
                stem = "eval" if adapter is None else folder.name
                aside = folder.with_name(f"{stem}-at-{int(earlier):03d}")
                shutil.rmtree(aside, ignore_errors=True)
                folder.rename(aside)
        folder.mkdir(parents=True, exist_ok=True)
        version = self.state.policy_version if adapter is None else 0
        marker.write_text(json.dumps({"step": step, "policy_version": version}) + "\n")
        what = "before the first iteration" if step == 0 else f"after iteration {step}"
        if adapter == BASE:
            what += ", on the base model"
        tasks = self.splits["heldout"][: c.eval_limit]
        self.log(
            f"held-out evaluation {what}: {len(tasks)} task(s) × {c.eval_samples} seeded "
            f"sample(s), policy version {version}"
        )
        t0 = time.monotonic()
        # One harness per sample index, each with its own fixed seed: sample k of every task
        # draws the same way before and after training.
        works = []
        for k in range(c.eval_samples):
            runs = [
                r
                for r in plan_runs(tasks, c.eval_samples, None, set(), prefix=f"eval{step:03d}-")
                if r.sample_index == k
            ]
            work = stages.rollout_work(c, runs, folder, self.served_name)
            work.harness_options = stages.harness_options(c, seed=c.seed + k)
            work.adapter = adapter
            works.append(work)
        graded, _ = await self._rollout_and_grade(folder.name, folder, works)
        result = eval_result(step, version, graded, time.monotonic() - t0)
        result.adapter = adapter
        marker.write_text(json.dumps({**dataclasses.asdict(result), "success": result.success}))
        state.evals = [e for e in state.evals if (e.step, e.adapter) != (step, adapter)] + [result]
        self.save()
        shown = "n/a" if result.success is None else f"{result.success:.1%}"
        self.log(
            f"held-out success {what}: {shown} ({result.solved} of {result.graded} graded; "
            f"{result.crashes} environment failure(s)) in {result.seconds:.1f}s"
        )

    def _train(self, k: int, samples: list[Any], folder: Path, signal: int) -> Any:
        """Step ``k``'s training (blocking); see ``stages.train_samples``."""
        return stages.train_samples(
            self.config,
            samples,
            step=k,
            model=self.model_path,
            folder=folder,
            out=self.out,
            signal=signal,
            monitor=self.monitor,
            log=self.log,
        )

    # ---- weights -----------------------------------------------------------------------------

    async def reload(self, k: int, folder: Path, trained: bool) -> tuple[float, float]:
        """Sync a trained checkpoint into the engine (its calls in flight finish first: the
        drain). Returns the seconds the sync took and those of its drain, as the engine
        measured it (``last_drain_s``; an engine that does not say: the whole sync)."""
        t0 = time.monotonic()
        drain: float | None = 0.0
        ckpt = folder / "checkpoint"
        if trained:
            from legorl.protocols import EngineError

            try:
                version = await self.executor.load_weights(str(ckpt.resolve()))
            except (EngineError, NotImplementedError) as exc:
                raise LoopError(f"iteration {k}: weight sync: {exc}") from None
            # On Ray each node's engine drains on its own: the whole sync stands for it.
            core = self.core
            drain = getattr(core.engine, "last_drain_s", None) if core is not None else None
            self.state.checkpoint = str(ckpt.relative_to(self.out))
            self.state.policy_version = version
            self.log(f"iteration {k}: weights reloaded into the proxy: policy version {version}")
        elif ckpt.exists():  # the trainer saved unchanged weights: not a new policy
            shutil.rmtree(ckpt)
        total = time.monotonic() - t0
        return total, total if drain is None else drain

    def finish_iteration(self, result: Any) -> None:
        state = self.state
        state.iterations = [i for i in state.iterations if i.iteration != result.iteration]
        state.iterations.append(result)
        state.finished = result.iteration
        self.save()
        write_metrics(state, self.out / METRICS_FILE)
        reward = "n/a" if result.reward_mean is None else f"{result.reward_mean:.3f}"
        corr = (
            "n/a"
            if result.rollout_trainer_pearson is None
            else f"{result.rollout_trainer_pearson:.4f}"
        )
        self.log(
            f"iteration {result.iteration} done in {result.seconds:.1f}s: reward {reward}, "
            f"pearson {corr}, {result.crashes} crash(es), {result.hack_flags} flagged, "
            + ", ".join(f"{p} {s:.1f}s" for p, s in result.phase_seconds.items())
        )

    # ---- one synchronous training iteration ------------------------------------------------

    async def _iteration(self, k: int) -> None:
        c, state = self.config, self.state
        folder = self.out / f"iter-{k:03d}"
        t0 = time.monotonic()
        busy0 = self.engine_busy()
        tasks = iteration_tasks(self.splits["train"], c.groups_per_batch, k, c.seed)
        version = state.policy_version
        self.log(
            f"iteration {k}/{c.iterations}: {len(tasks)} task(s) × {c.group_size} sample(s), "
            f"policy version {version}"
        )
        runs = [
            r for t in tasks for r in stages.group_runs(t, c.group_size, stages.group_prefix(k))
        ]
        works = [stages.rollout_work(c, runs, folder, self.served_name)]
        if c.seeded_rollouts:  # a harness per sample index, each run with its own seed
            works = []
            for s in range(c.group_size):
                mine = [r for r in runs if r.sample_index == s]
                work = stages.rollout_work(c, mine, folder, self.served_name)
                work.harness_options = stages.harness_options(c, seed=stages.run_seed(c, mine[0]))
                works.append(work)
        graded, phases = await self._rollout_and_grade(f"iteration {k}", folder, works)
        order = {r.trajectory_id: i for i, r in enumerate(runs)}  # task by task, as planned
        graded.sort(key=lambda t: order[t.trajectory_id])

        t1 = time.monotonic()
        samples, errors = stages.align_samples(graded, lambda _t: folder)
        stages.write_samples(folder / "samples.jsonl", samples)
        phases["align"] = round(time.monotonic() - t1, 3)
        if errors:
            self.log(f"iteration {k}: align skipped {len(errors)}: {errors[0]}")

        t2 = time.monotonic()
        signal = stages.groups_with_signal(graded)
        outcome = self._train(k, samples, folder, signal)
        phases["train"] = round(time.monotonic() - t2, 3)
        sync, drain = await self.reload(k, folder, outcome.trained)
        phases["reload"] = round(sync, 3)
        seconds = time.monotonic() - t0
        result = stages.iteration_result(
            iteration=k,
            tasks=[t.instance_id for t in tasks],
            graded=graded,
            samples=samples,
            signal=signal,
            outcome=outcome,
            policy_version=state.policy_version,
            checkpoint=state.checkpoint,
            trained_version=version,
            seconds=seconds,
            phases=phases,
            extra={
                "groups": [f"{stages.group_prefix(k)}{t.instance_id}" for t in tasks],
                "drain_seconds": round(drain, 3),
                "engine_busy_fraction": (
                    round((self.engine_busy() - busy0) / seconds, 4)
                    if seconds and self.engine_meter is not None
                    else None
                ),
                "trainer_idle_fraction": (
                    round(1 - phases["train"] / seconds, 4) if seconds else None
                ),
            },
        )
        self.finish_iteration(result)
