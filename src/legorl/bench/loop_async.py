"""The asynchronous loop against the synchronous one on a simulated long-tail workload, at equal
trained episodes: wall time, the engine's busy fraction, the staleness histogram and the
dropped and filtered fractions at K = 1, 2, 4.

What is simulated: the engine, the harness, the grader and the trainer. An episode is a number
of model calls drawn log-normal (a few episodes 10× longer), each call holding the engine for
``call_s`` (the engine's meter is running meanwhile, so several episodes at once count once);
its reward is a coin flip, so some groups tie and are filtered; a trainer step sleeps
``step_s``, about one batch's median rollout time (a realistic relative cost), and a weight
sync sleeps ``sync_s``. What is real: the loop's drivers themselves (the synchronous
iteration, the asynchronous admission control, batching, staleness checks, the state), the
alignment of the episodes' Turns into samples and the records written, in a scratch folder.
"""

from __future__ import annotations

import asyncio
import math
import random
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, ClassVar

from legorl.loop.driver_async import AsyncRunner
from legorl.loop.runner import Runner
from legorl.loop.stages import TrainOutcome
from legorl.loop.state import LoopState
from legorl.loop_config import LoopConfig
from legorl.protocols import GradeWork, RolloutWork
from legorl.records import Task, Trajectory, Turn


class _Engine:
    def __init__(self) -> None:
        self.policy_version = 0


class _Core:
    """What the drivers ask of the proxy core: its engine's version, a weight sync."""

    served_name = "sim"

    def __init__(self, sync_s: float) -> None:
        self.engine = _Engine()
        self.sync_s = sync_s

    async def load_weights(self, path: str) -> int:
        await asyncio.sleep(self.sync_s)
        self.engine.policy_version += 1
        return self.engine.policy_version


class _Executor:
    """Episodes of log-normal length, each call stamped with the version serving it."""

    name: ClassVar[str] = "simulated"

    def __init__(
        self, runner: Runner, core: _Core, call_s: float, seed: int, old: tuple[str, ...] = ()
    ) -> None:
        self.runner, self.core, self.call_s = runner, core, call_s
        self.rng = random.Random(seed)
        # runs whose ids start so report version 0: episodes kept from before a resume
        self.old = old

    def _calls(self, tid: str) -> int:
        rng = random.Random(f"{tid}")  # the same episode is as long in every mode
        n = max(1, round(rng.lognormvariate(math.log(4), 0.6)))
        return n * 10 if rng.random() < 0.05 else n

    async def prepare(self, sandbox: str, sandbox_options: dict[str, Any], tasks: list) -> None:
        return None

    async def rollout(self, work: RolloutWork) -> AsyncIterator[Trajectory]:
        gate = asyncio.Semaphore(work.concurrency)

        async def one(run: Any) -> Trajectory:
            async with gate:
                tid = run.trajectory_id
                turns = []
                for call in range(self._calls(tid)):
                    version = self.core.engine.policy_version
                    if tid.startswith(self.old):
                        version = 0
                    meter = self.runner.engine_meter
                    assert meter is not None  # the simulated engine is this process's
                    meter.start()
                    try:
                        await asyncio.sleep(self.call_s)
                    finally:
                        meter.stop()
                    turns.append(
                        Turn(
                            session=tid,
                            turn=call,
                            segment=0,
                            api="openai_chat",
                            model="sim",
                            policy_version=version,
                            prompt_offset=3 * call,  # the segment so far: 3 tokens a call
                            prompt_delta=[1] if call == 0 else [2],
                            completion_ids=[3, 4],
                            completion_logprobs=[-0.5, -0.5],
                            finish_reason="stop",
                        )
                    )
                reward = float(random.Random(f"{tid}/reward").random() < 0.4)
                return Trajectory(
                    trajectory_id=tid,
                    task_id=run.task.instance_id,
                    group_id=run.task.instance_id,
                    sample_index=run.sample_index,
                    harness="sim",
                    status="ok",
                    turns=turns,
                    evidence={"reward": reward},
                )

        tasks = [asyncio.ensure_future(one(r)) for r in work.runs]
        try:
            for fut in asyncio.as_completed(tasks):
                yield await fut
        finally:
            for t in tasks:
                t.cancel()

    async def grade(self, work: GradeWork) -> AsyncIterator[Trajectory]:
        import dataclasses

        for t in work.trajectories:
            yield dataclasses.replace(
                t, reward=t.evidence["reward"], verdict={"resolved": t.evidence["reward"] == 1}
            )

    async def close(self) -> None:
        return None


class _Simulated:
    """A driver with the simulated parts in place of the engine, grader and trainer."""

    step_s: float

    def _train(self, k: int, samples: list[Any], folder: Path, signal: int) -> Any:
        time.sleep(self.step_s)
        return TrainOutcome(trained=bool(samples))

    async def reload(self, k: int, folder: Path, trained: bool) -> tuple[float, float]:
        t0 = time.monotonic()
        if trained:
            runner: Any = self
            runner.state.policy_version = await runner.core.load_weights(str(folder))
        took = time.monotonic() - t0
        return took, took  # the simulated sync's sleep, not a drain


class _SyncSim(_Simulated, Runner):
    pass


class _AsyncSim(_Simulated, AsyncRunner):
    pass


def _tasks(n: int) -> list[Task]:
    return [
        Task(
            instance_id=f"sim__task-{i}",
            repo="sim/sim",
            base_commit="0" * 40,
            problem_statement="simulated",
            test_patch="",
            FAIL_TO_PASS=["t"],
            PASS_TO_PASS=[],
            version="1",
            environment_setup_commit="0" * 40,
        )
        for i in range(n)
    ]


def _run(
    config: LoopConfig,
    *,
    call_s: float,
    step_s: float,
    sync_s: float,
    old: tuple[str, ...] = (),
    keep: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One simulated loop; ``keep`` receives its final state (tests read it)."""
    with tempfile.TemporaryDirectory() as tmp:
        config.out = Path(tmp)
        state = LoopState(config=config.to_dict())
        splits = {"train": _tasks(32), "heldout": []}
        cls = _AsyncSim if config.use_async else _SyncSim
        runner: Any = cls(config, state, splits, lambda _m: None, None)
        runner.step_s = step_s
        runner.core = _Core(sync_s)
        runner.executor = _Executor(runner, runner.core, call_s, config.seed, old)
        t0 = time.monotonic()
        asyncio.run(runner.train_iterations())
        wall = time.monotonic() - t0
        busy = runner.engine_meter.busy()
    if keep is not None:
        keep["state"] = state
    its = state.iterations
    hist: Counter[str] = Counter()
    for it in its:
        hist.update(it.staleness)
    groups = sum(len(it.groups) for it in its) or 1
    trained = sum(it.samples for it in its)
    return {
        "wall_s": round(wall, 3),
        "trained_episodes": trained,
        "trained_episodes_per_s": round(trained / wall, 3),
        "engine_busy_fraction": round(busy / wall, 4),
        "staleness_histogram": dict(sorted(hist.items(), key=lambda kv: int(kv[0]))),
        "dropped_fraction": round(sum(len(it.dropped) for it in its) / groups, 4),
        "filtered_fraction": round(sum(len(it.filtered) for it in its) / groups, 4),
        "spanning_fraction": round(
            sum((it.spanning_fraction or 0) * it.samples for it in its) / max(trained, 1), 4
        ),
        "drain_s_per_sync": round(sum(it.drain_seconds for it in its) / max(len(its), 1), 4),
    }


def bench_loop_async(*, quick: bool = False) -> dict[str, Any]:
    call_s = 0.004 if quick else 0.01
    iterations = 4 if quick else 10
    base = dict(
        iterations=iterations,
        group_size=4,
        tasks_per_iteration=4,
        concurrency=16,
        seed=0,
        train_overrides=["drop_zero_variance_groups=false"],
    )
    # a trainer step costs about a batch's median rollout: 16 episodes, ~4 calls each, 16 at once
    step_s = 6 * call_s
    sync_s = call_s / 2
    cfg_sync = LoopConfig(**base)  # type: ignore[arg-type]
    result: dict[str, Any] = {
        "simulated": "engine, harness (log-normal calls per episode, 5% 10x longer), grader "
        "(coin-flip rewards), trainer (a sleep per step); the loop's drivers are real",
        "call_s": call_s,
        "step_s": step_s,
        "sync_s": sync_s,
        "sync": _run(cfg_sync, call_s=call_s, step_s=step_s, sync_s=sync_s),
    }
    for k in (1, 2, 4):
        cfg = LoopConfig(**base, use_async=True, max_staleness=k)  # type: ignore[arg-type]
        result[f"async_k{k}"] = _run(cfg, call_s=call_s, step_s=step_s, sync_s=sync_s)
    # the filter at work: the trainer's default drops groups whose rewards tie
    cfg = LoopConfig(**{**base, "train_overrides": []}, use_async=True, max_staleness=2)  # type: ignore[arg-type]
    result["async_k2_filtered"] = _run(cfg, call_s=call_s, step_s=step_s, sync_s=sync_s)
    # at equal trained episodes: the ratio of trained episodes per second
    sync_rate = result["sync"]["trained_episodes_per_s"]
    for k in (1, 2, 4):
        result[f"speedup_k{k}"] = round(
            result[f"async_k{k}"]["trained_episodes_per_s"] / sync_rate, 3
        )
    result["target_speedup"] = 1.8
    return result
