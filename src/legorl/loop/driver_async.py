"""The asynchronous driver (``legorl loop --async``): rollout workers run on while the trainer
trains, and admission control is the staleness bound.

Groups are drawn in one seeded stream: batch b (1-based) holds the ``batch_groups`` tasks that
iteration b of the synchronous loop would take, its runs are ``it{b:03d}-…`` and its rollouts
go to ``iter-{b:03d}/``, as the synchronous loop's. A group is admitted only while fewer than
``(max_staleness + steps done + 1) · batch_groups`` groups hold a slot; its runs then start as
``--concurrency`` allows, each graded as soon as it ends, the group aligned once whole. The
trainer steps (in a thread: the event loop, and so the rollouts, run on) whenever it holds
``batch_groups`` resolved groups, taken in admission order, and every group admitted
``max_staleness`` or more steps before is among them (the step waits for such a group rather
than let later ones overtake it and train it too old); the new weights go to the engine
while other episodes run (the engine lets calls in flight finish under the old weights: the
drain). Step k writes ``iter-{k:03d}/`` samples, metrics and checkpoint, as the sync loop does.

With ``max_staleness`` 0 nothing is admitted while the trainer trains, and the trainer takes
exactly batch k at step k: the synchronous loop's work in the synchronous loop's order.

A group whose samples are older than the bound when its turn comes (kept from before a
resume; a rerun) is dropped and counted (``--on-stale rerun``: its task is rolled out again in its
slot and place, once, and the next step waits for it). Groups whose rewards are all equal carry no gradient: with the trainer's
``drop_zero_variance_groups`` (its default) they are filtered when they resolve, counted, and
either take their batch slot empty or, with ``refill_filtered``, free it for another group.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from legorl.loop import stages
from legorl.loop.runner import Runner
from legorl.loop.state import LoopError, iteration_tasks
from legorl.loop_config import LoopConfig, LoopConfigError
from legorl.records import JsonlWriter, Sample, Trajectory


def check_live_reload(config: LoopConfig) -> None:
    """Refuse ``--async`` with an engine that cannot take new weights while it serves: a vLLM
    server at ``base_url`` that is not in dev mode (nor said to reload by ``weight_reload``)."""
    if config.engine != "vllm" or "base_url" not in config.engine_options:
        return
    reload = config.engine_options.get("weight_reload")
    if reload == "collective_rpc":
        return
    base = str(config.engine_options["base_url"]).rstrip("/")
    dev = False
    if reload is None:
        import httpx

        try:
            dev = httpx.get(f"{base}/server_info", timeout=10).status_code == 200
        except httpx.HTTPError:
            dev = False
    if not dev:
        raise LoopConfigError(
            "async",
            f"the vLLM server at {base} cannot reload weights while it serves (it is not in "
            "dev mode): start it with VLLM_SERVER_DEV_MODE=1, or run the loop without --async",
        )


@dataclass(slots=True)
class _Group:
    index: int  # admission order (the g-th group drawn; a rerun takes its group's)
    batch: int  # the batch it was drawn for: its folder and id prefix
    task: Any
    prefix: str
    admit_step: int = 0  # trainer steps done when it was admitted
    graded: list[Trajectory] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    filtered: bool = False
    resolved: bool = False

    @property
    def key(self) -> str:
        return f"{self.prefix}{self.task.instance_id}"


class AsyncRunner(Runner):
    """``Runner`` with the asynchronous driver (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.changed = asyncio.Condition()
        self.groups: dict[int, _Group] = {}  # admitted, not yet consumed
        self.slots = 0
        self.steps = 0
        self.next_draw = 0  # the next group of the seeded stream to consider
        self.next_index = 0
        self.carry_filtered: list[str] = []  # filtered with refill, reported with the next step
        self.writers: dict[Path, tuple[JsonlWriter, JsonlWriter]] = {}
        self.run_gate: asyncio.Semaphore | None = None
        self.grade_gate: asyncio.Semaphore | None = None
        self.failure: BaseException | None = None
        self.workers: set[asyncio.Task[None]] = set()
        self.consumed: set[str] = set()
        # groups of the seeded stream drawn at most: each once; with refill_filtered twice as
        # many, so that a policy whose groups all tie cannot draw forever
        factor = 2 if self.config.refill_filtered else 1
        self.draw_cap = factor * self.config.iterations * self.config.groups_per_batch

    # ---- the stream of groups --------------------------------------------------------------

    def _draw(self, g: int) -> tuple[int, Any]:
        b = self.config.groups_per_batch
        batch = g // b + 1
        return batch, iteration_tasks(self.splits["train"], b, batch, self.config.seed)[g % b]

    def _limit(self) -> int:
        c = self.config
        bound = (c.max_staleness + self.steps + 1) * c.groups_per_batch
        return min(bound, c.iterations * c.groups_per_batch)

    def _folder(self, batch: int) -> Path:
        return self.out / f"iter-{batch:03d}"

    def _writer(self, folder: Path) -> tuple[JsonlWriter, JsonlWriter]:
        if folder not in self.writers:
            folder.mkdir(parents=True, exist_ok=True)
            self.writers[folder] = (
                JsonlWriter(folder / "trajectories.jsonl").__enter__(),
                JsonlWriter(folder / "graded.jsonl").__enter__(),
            )
        return self.writers[folder]

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    # ---- the driver ---------------------------------------------------------------------------

    async def train_iterations(self) -> None:
        c, state = self.config, self.state
        self.event_loop = asyncio.get_running_loop()
        self.steps = state.finished
        consumed: set[str] = set()
        for it in state.iterations:
            consumed.update(it.groups)
            self.slots += len(it.groups) - (len(it.filtered) if c.refill_filtered else 0)
            self.carry_filtered = []
        self.consumed = consumed
        self.run_gate = asyncio.Semaphore(c.concurrency)
        self.grade_gate = asyncio.Semaphore(c.concurrency)
        if self.steps >= c.iterations:
            return
        self.log(
            f"asynchronous: {c.groups_per_batch} group(s) per step, max staleness "
            f"{c.max_staleness}, on stale: {c.on_stale}, policy version {state.policy_version}"
        )
        admit = asyncio.create_task(self._admit())
        try:
            await self._trainer()
        finally:
            admit.cancel()
            workers = [admit, *self.workers]
            for task in workers:
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            for traj_w, graded_w in self.writers.values():
                traj_w.__exit__(None, None, None)
                graded_w.__exit__(None, None, None)
            self.writers.clear()

    def _can_admit(self) -> bool:
        return self.slots < self._limit() and self.next_draw < self.draw_cap

    async def _admit(self) -> None:
        while True:
            async with self.changed:
                await self.changed.wait_for(self._can_admit)
            batch, task = self._draw(self.next_draw)
            self.next_draw += 1
            group = _Group(
                index=self.next_index,
                batch=batch,
                task=task,
                prefix=stages.group_prefix(batch),
                admit_step=self.steps,
            )
            if group.key in self.consumed:  # trained (or dropped) before a resume
                continue
            self.next_index += 1
            self.slots += 1
            self._start(group)

    def _start(self, group: _Group) -> None:
        self.groups[group.index] = group
        task = asyncio.create_task(self._run_group(group))
        self.workers.add(task)
        task.add_done_callback(self.workers.discard)

    async def _run_group(self, group: _Group) -> None:
        try:
            c = self.config
            folder = self._folder(group.batch)
            runs = stages.group_runs(group.task, c.group_size, group.prefix)
            done = stages.read_by_id(folder / "trajectories.jsonl")
            graded = stages.read_by_id(folder / "graded.jsonl")
            results = await asyncio.gather(
                *(self._run_one(r, folder, done.get(r.trajectory_id), graded) for r in runs)
            )
            group.graded = list(results)
            for traj in group.graded:
                self.monitor.observe_trajectory(traj)
            group.samples, errors = stages.align_samples(group.graded, lambda _t: folder)
            if errors:
                self.log(f"group {group.key}: align skipped {len(errors)}: {errors[0]}")
            cfg = c.train_config()
            filtering = cfg.drop_zero_variance_groups and cfg.advantage != "sample"
            group.filtered = filtering and stages.zero_variance(group.graded)
            group.resolved = True
            if group.filtered and c.refill_filtered:
                del self.groups[group.index]
                self.slots -= 1
                self.carry_filtered.append(group.key)
            await self._notify()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # the trainer stops on it, with the reason
            self.failure = exc
            await self._notify()

    async def _run_one(
        self, run: Any, folder: Path, traj: Trajectory | None, graded: dict[str, Trajectory]
    ) -> Trajectory:
        assert self.run_gate is not None and self.grade_gate is not None
        traj_w, graded_w = self._writer(folder)
        if traj is None:
            work = stages.rollout_work(self.config, [run], folder, self.served_name)
            work.harness_options = stages.harness_options(
                self.config, seed=stages.run_seed(self.config, run)
            )
            work.concurrency = 1
            async with self.run_gate:
                async for t in self.executor.rollout(work):
                    traj = t
            if traj is None:
                raise LoopError(f"no trajectory for run {run.trajectory_id}")
            traj_w.write(traj)
        kept = graded.get(traj.trajectory_id)
        if kept is not None:
            return kept
        work_g = stages.grade_work(self.config, [traj], [run.task], folder)
        work_g.concurrency = 1
        result: Trajectory | None = None
        async with self.grade_gate:
            async for g in self.executor.grade(work_g):
                result = g
        if result is None:
            raise LoopError(f"no grading for run {run.trajectory_id}")
        graded_w.write(result)
        return result

    # ---- the trainer ----------------------------------------------------------------------------

    def _ready(self) -> list[_Group] | None:
        """The next step's groups in admission order, once it holds a batch (or once nothing
        more can come)."""
        c = self.config
        # A group admitted K or more steps ago must be in this step, or it would be trained
        # older than K: the step waits for it rather than let later groups overtake it.
        due = self.steps - c.max_staleness
        if any(not g.resolved and g.admit_step <= due for g in self.groups.values()):
            return None
        resolved = sorted((g for g in self.groups.values() if g.resolved), key=lambda g: g.index)
        taken: list[_Group] = []
        for g in resolved:
            taken.append(g)
            if len(taken) == c.groups_per_batch:
                return taken
        no_more = self.slots >= c.iterations * c.groups_per_batch or self.next_draw >= self.draw_cap
        exhausted = no_more and all(g.resolved for g in self.groups.values())
        return taken if exhausted and (taken or self.carry_filtered) else None

    async def _trainer(self) -> None:
        c, state = self.config, self.state
        last = time.monotonic()
        busy0 = self.engine_busy()
        idle = 0.0
        rerun_keys: list[str] = []  # dropped for staleness and re-rolled, for this step
        while self.steps < c.iterations:
            wait0 = time.monotonic()
            async with self.changed:
                await self.changed.wait_for(
                    lambda: self.failure is not None or self._ready() is not None
                )
            if self.failure is not None:
                exc = self.failure
                if isinstance(exc, LoopError):
                    raise exc
                raise LoopError(f"rollout: {type(exc).__name__}: {exc}") from exc
            idle += time.monotonic() - wait0
            taken = self._ready()
            assert taken is not None
            k = self.steps + 1
            version = state.policy_version

            def stale(g: _Group, version: int = version) -> bool:
                oldest = max((version - s.oldest_version for s in g.samples), default=0)
                return not g.filtered and oldest > c.max_staleness

            again = [g for g in taken if stale(g) and "r" not in g.prefix[2:]]
            if c.on_stale == "rerun" and again:
                # re-rolled in its place: this step waits for the fresh group
                for g in again:
                    del self.groups[g.index]
                    rerun_keys.append(g.key)
                    self._rerun(g)
                continue
            folder = self._folder(k)
            folder.mkdir(parents=True, exist_ok=True)
            for g in taken:
                del self.groups[g.index]
            carried, self.carry_filtered = self.carry_filtered, []
            trained_groups: list[_Group] = []
            dropped = list(rerun_keys)
            rerun = len(rerun_keys)
            filtered = list(carried)
            for g in taken:
                if g.filtered:
                    filtered.append(g.key)
                elif stale(g):
                    dropped.append(g.key)
                else:
                    trained_groups.append(g)
            graded = [t for g in trained_groups for t in g.graded]
            samples = [s for g in trained_groups for s in g.samples]
            # two groups of one task in one step (from different batches) stay apart
            seen: dict[str, int] = {}
            for g in trained_groups:
                seen[g.task.instance_id] = seen.get(g.task.instance_id, 0) + 1
            for g in trained_groups:
                if seen[g.task.instance_id] > 1:
                    for s in g.samples:
                        s.group_id = g.key
            t1 = time.monotonic()
            stages.write_samples(folder / "samples.jsonl", samples)
            phases = {"align": 0.0}
            signal = stages.groups_with_signal(
                [dataclasses.replace(t, group_id=g.key) for g in trained_groups for t in g.graded]
            )
            self.log(
                f"step {k}/{c.iterations}: {len(trained_groups)} group(s), {len(samples)} "
                f"sample(s), policy version {version}"
                + (f", {len(dropped)} stale dropped" if dropped else "")
                + (f", {len(filtered)} filtered" if filtered else "")
            )
            try:
                outcome = await asyncio.to_thread(self._train, k, samples, folder, signal)
            except LoopError:
                raise
            except Exception as exc:  # the loop stops with the reason; the rollouts stop too
                raise LoopError(f"iteration {k}: train: {type(exc).__name__}: {exc}") from exc
            phases["train"] = round(time.monotonic() - t1, 3)
            sync, drain = await self.reload(k, folder, outcome.trained)
            phases["reload"] = round(sync, 3)
            now = time.monotonic()
            seconds = now - last
            busy = self.engine_busy()
            result = stages.iteration_result(
                iteration=k,
                tasks=[g.task.instance_id for g in trained_groups],
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
                    "groups": [*rerun_keys, *(g.key for g in taken), *carried],
                    "dropped": dropped,
                    "filtered": filtered,
                    "rerun": rerun,
                    "drain_seconds": round(drain, 3),
                    "engine_busy_fraction": (
                        round((busy - busy0) / seconds, 4)
                        if seconds and self.engine_meter is not None
                        else None
                    ),
                    "trainer_idle_fraction": round(idle / seconds, 4) if seconds else None,
                },
            )
            last, busy0, idle, rerun_keys = now, busy, 0.0, []
            self.steps = k
            self.finish_iteration(result)
            await self._notify()

    def _rerun(self, old: _Group) -> None:
        """A fresh group of ``old``'s task in its slot and its place in the order (the next
        step waits for it); a rerun that is stale again is dropped, not re-rolled again."""
        if "r" in old.prefix[2:]:
            return
        group = _Group(
            index=old.index,
            batch=old.batch,
            task=old.task,
            prefix=f"{old.prefix[:-1]}r1-",
            admit_step=old.admit_step,
        )
        self.consumed.add(group.key)
        self._start(group)
