"""The Ray executor: rollout and grading spread over the nodes of a Ray cluster, one worker per
node (a Ray actor) holding that node's sandbox backend and its proxy front.

    ray start --head --port 6379                      # on the first node
    ray start --address HEAD:6379                     # on each other node
    legorl rollout --ray auto --tasks … --harness mini --engine vllm \\
        --engine-opt base_url=http://GPU-HOST:8000 --model MODEL --out runs/traj.jsonl

Each worker runs the same code as an in-process rollout (``legorl.rollout.run_one``,
``legorl.verify.grade``) with its own proxy on 127.0.0.1 of its node, so the sandbox-to-proxy
relay stays a local socket; the engine the proxy serves may be anywhere (a vLLM server by
``base_url``, or loaded on the node). The driver hands out runs within each node's slots (the
node's ``legorl_runs`` resource, ``ray start --resources '{"legorl_runs": 8}'``, else its CPU
count) and writes each Trajectory to its own ``--out`` as it comes back, with its Turns: they
travel with the result and are written beside the driver's output, so nothing depends on a path
of another machine. Resume is the in-process one: finished ids in ``--out`` are not planned.

Before any run, every worker checks its node: the driver's legorl version, the sandbox backend
(bubblewrap or Docker) and the harness (``harness_preflight``). A node that fails one is left
out, with its reason on stderr; with none left the command fails in one line.

The loop (``legorl loop --ray``) keeps its workers for the whole run (``serve``): each node's
engine starts once, every phase's rollouts and gradings run there, and after each training step
``load_weights`` ships the checkpoint's files to every node through the object store, where the
node's engine loads them as an in-process engine would (calls in flight finish first).

Faults: a run whose worker dies (its node lost) goes back to the queue and runs elsewhere, so
every run ends in the output exactly once; a worker that raises on a run gives that run a
``sandbox_error`` naming the node (``evidence.executor``), and the others go on; ``RayStats``
counts both by node. Ray is imported here only, when an executor starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import socket
import tempfile
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import legorl
from legorl.protocols import ExecutorError
from legorl.records import Trajectory, Turn

__all__ = ["ExecutorError", "NodeWorker", "RayExecutor", "RayStats", "WorkerSetup"]

#: A node's declared slots: runs it takes at once (else its CPU count).
SLOTS_RESOURCE = "legorl_runs"


@dataclass(slots=True, kw_only=True)
class WorkerSetup:
    """What a node's worker builds its sandbox backend and proxy front from: plain data."""

    version: str  # the driver's legorl version
    sandbox: str = "local"
    sandbox_options: dict[str, Any] = field(default_factory=dict)
    harness: str | None = None  # None: a grading worker (no harness, no engine)
    harness_options: dict[str, Any] = field(default_factory=dict)
    engine: Any = None  # legorl.rollout.EngineSpec
    model: str = ""  # the model folder the proxy takes its tokenizer from
    served_model: str = ""  # the name harnesses ask for ("" : the proxy's)
    budget: Any = None  # legorl.proxy.core.Budget
    tasks_dir: str = ""
    timeout: float = 600.0
    run_id: str = "legorl-ray"
    verify_config: Any = None  # legorl.verify.VerifyConfig


@dataclass(slots=True)
class RayStats:
    """What happened on the cluster, by node."""

    nodes: dict[str, int] = field(default_factory=dict)  # node -> slots, of those that took work
    refused: dict[str, str] = field(default_factory=dict)  # node -> why
    runs: Counter[str] = field(default_factory=Counter)  # node -> results returned
    crashes: Counter[str] = field(default_factory=Counter)  # node -> runs whose worker raised
    lost: Counter[str] = field(default_factory=Counter)  # node -> runs re-queued (worker died)
    rescheduled_s: list[float] = field(default_factory=list)  # death seen -> run restarted

    def summary(self) -> str:
        parts = [f"{len(self.nodes)} node(s)"]
        if self.crashes:
            parts.append(
                "crashes " + ", ".join(f"{n} {c}" for n, c in sorted(self.crashes.items()))
            )
        if self.lost:
            parts.append(
                "re-run after a lost node "
                + ", ".join(f"{n} {c}" for n, c in sorted(self.lost.items()))
            )
        return "; ".join(parts)


def node_label(info: dict[str, Any]) -> str:
    """A node as people name it: its address and its raylet's port (several nodes may share a
    host)."""
    return f"{info.get('NodeManagerAddress', '?')}:{info.get('NodeManagerPort', '?')}"


class NodeWorker:
    """One node's worker (a Ray actor): checks the node, then runs rollouts or gradings there
    with the node's own sandbox backend and proxy, as the in-process stage does."""

    def __init__(self, setup: WorkerSetup, node: str) -> None:
        self.setup = setup
        self.node = node
        self.refusal = self._check()
        self._stack: contextlib.AsyncExitStack | None = None
        self._ctx: Any = None
        self._core: Any = None
        self._backend: Any = None
        self._harnesses: dict[str, Any] = {}
        self._lock = asyncio.Lock()
        self._turns = Path(tempfile.mkdtemp(prefix="legorl-ray-turns-"))
        self._weights: Path | None = None  # the last checkpoint shipped here

    def _check(self) -> str | None:
        setup = self.setup
        if legorl.__version__ != setup.version:
            return (
                f"node {self.node} has legorl {legorl.__version__}, the driver legorl "
                f"{setup.version}: install the driver's version there"
            )
        from legorl.check import check_sandbox

        if setup.sandbox in ("local", "docker"):
            found = check_sandbox(setup.sandbox)
            if not found.ok:
                return f"node {self.node}: sandbox {setup.sandbox}: {found.reason} ({found.fix})"
        if setup.harness is not None:
            from legorl.harnesses import make_harness
            from legorl.sandbox.runtime import PreflightError, harness_preflight

            try:
                harness_preflight(
                    make_harness(setup.harness, **setup.harness_options),
                    setup.sandbox,
                    node=self.node,
                )
            except PreflightError as exc:
                return str(exc)
        return None

    async def info(self) -> dict[str, Any]:
        return {"node": self.node, "refused": self.refusal, "pid": os.getpid()}

    async def _start(self) -> Any:
        async with self._lock:
            if self._backend is not None:
                return self._ctx
            from legorl.sandbox import make_backend

            setup = self.setup
            self._backend = make_backend(setup.sandbox, **setup.sandbox_options)
            if setup.harness is None:
                return None
            from legorl.harnesses import make_harness
            from legorl.rollout import RunContext, serve_engine

            # a vLLM server it launches logs on this node, not in a folder of the driver's
            engine = replace(setup.engine, log_dir=self._turns)
            if engine.options.get("device") == "auto":  # this node's accelerator, if any
                import torch

                device = "cuda" if torch.cuda.is_available() else "cpu"
                engine = replace(engine, options={**engine.options, "device": device})
            self._stack = contextlib.AsyncExitStack()
            endpoint, core = await self._stack.enter_async_context(
                serve_engine(setup.model, engine, self._turns, setup.budget)
            )
            self._core = core
            self._ctx = RunContext(
                harness=make_harness(setup.harness, **setup.harness_options),
                backend=self._backend,
                proxy=endpoint,
                model=setup.served_model or core.served_name,
                tasks_dir=Path(setup.tasks_dir),
                timeout=setup.timeout,
                run_id=setup.run_id,
                refs_relative_to=self._turns,
            )
            return self._ctx

    async def serve(self) -> dict[str, Any]:
        """Start the node's engine and proxy now (a long-lived worker: the loop's); what the
        harnesses ask for and the policy version it serves."""
        await self._start()
        return {"served_name": self._core.served_name, "version": self._policy_version()}

    def _policy_version(self) -> int:
        version: int = self._core.engine.policy_version
        return version

    async def load_weights(self, files: dict[str, bytes]) -> int:
        """Swap the node's engine to the checkpoint whose files (relative path -> bytes) the
        driver shipped: written to a folder of this node, loaded as the driver's own engine
        loads a checkpoint (calls in flight finish under the old weights); the new version."""
        await self._start()
        folder = Path(tempfile.mkdtemp(prefix="legorl-ray-weights-"))
        for name, data in files.items():
            path = folder / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        try:
            version: int = await self._core.load_weights(str(folder))
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        if self._weights is not None:
            shutil.rmtree(self._weights, ignore_errors=True)
        self._weights = folder
        return version

    def _harness(self, options: dict[str, Any]) -> Any:
        from legorl.harnesses import make_harness

        key = json.dumps(options, sort_keys=True, default=str)
        if key not in self._harnesses:
            self._harnesses[key] = make_harness(self.setup.harness or "", **options)
        return self._harnesses[key]

    async def rollout(self, run: Any, harness_options: dict[str, Any] | None = None) -> Trajectory:
        """One run (``legorl.rollout.Run``) here, its harness with ``harness_options`` (None:
        the setup's); its Turns come back inline."""
        from legorl.records import read_jsonl
        from legorl.rollout import run_one

        ctx = await self._start()
        if harness_options is not None and harness_options != self.setup.harness_options:
            ctx = replace(ctx, harness=self._harness(harness_options))
        traj = await run_one(run, ctx)
        path = self._turns / f"{run.trajectory_id}.jsonl"
        turns = list(read_jsonl(path, Turn, skip_bad=True)) if path.exists() else []
        path.unlink(missing_ok=True)
        evidence = {**traj.evidence, "node": self.node}
        return replace(traj, turns=turns or None, turns_ref=None, evidence=evidence)

    async def grade(self, traj: Trajectory, task: Any) -> Trajectory:
        """One grading here; the Turns it scans come inline from the driver."""
        from legorl.verify import VerifyConfig, grade

        await self._start()
        return await grade(
            replace(traj, turns=None),
            task,
            backend=self._backend,
            tasks_dir=self.setup.tasks_dir,
            run_id=self.setup.run_id,
            turns=list(traj.turns or []),
            config=self.setup.verify_config or VerifyConfig(),
        )

    async def close(self) -> None:
        if self._stack is not None:
            await self._stack.aclose()
            self._stack = None
        if self._weights is not None:
            shutil.rmtree(self._weights, ignore_errors=True)
            self._weights = None


def connect(address: str) -> Any:
    """``ray`` connected to the cluster at ``address`` ("auto": the one running here);
    ``ExecutorError`` when there is none."""
    try:
        import ray
    except ImportError:
        raise ExecutorError("--ray needs Ray: pip install 'legorl[ray]'") from None
    if ray.is_initialized():
        return ray
    gcs = _gcs_address(address)
    host, _, port = gcs.rpartition(":")
    try:  # ray.init retries a dead address for minutes: ask the port first
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=5).close()
    except (OSError, ValueError) as exc:
        raise ExecutorError(f"no Ray cluster at {address} ({gcs}): {exc}") from None
    try:
        ray.init(
            address=gcs,
            log_to_driver=False,
            logging_level=logging.ERROR,
            configure_logging=False,
            include_dashboard=False,
        )
    except (ConnectionError, RuntimeError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ExecutorError(f"no Ray cluster at {address}: {first}") from None
    return ray


def _gcs_address(address: str) -> str:
    """The head's host:port for ``address``: "auto" is ``$RAY_ADDRESS`` or the cluster that
    ``ray start`` recorded on this machine."""
    if address != "auto":
        return address
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"]
    from ray._common.utils import get_ray_address_file

    path = Path(get_ray_address_file(None))
    recorded = path.read_text().strip() if path.is_file() else ""
    if not recorded:
        raise ExecutorError(
            "no Ray cluster is running here (start one with `ray start --head`, or give its "
            "address)"
        )
    return recorded


@dataclass(slots=True)
class _Worker:
    node: str
    node_id: str
    slots: int
    handle: Any
    busy: int = 0
    alive: bool = True


def start_workers(ray: Any, setup: WorkerSetup, stats: RayStats) -> list[_Worker]:
    """One worker per alive node, pinned to it; the nodes that refuse are left out (their
    reasons in ``stats.refused``); ``ExecutorError`` when none is left."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    actor = ray.remote(NodeWorker)
    workers: list[_Worker] = []
    for info in ray.nodes():
        if not info.get("Alive"):
            continue
        resources = info.get("Resources", {})
        slots = max(int(resources.get(SLOTS_RESOURCE) or resources.get("CPU") or 1), 1)
        node = node_label(info)
        handle = actor.options(
            num_cpus=0,
            max_restarts=0,
            max_concurrency=slots + 8,
            scheduling_strategy=NodeAffinitySchedulingStrategy(info["NodeID"], soft=False),
        ).remote(setup, node)
        workers.append(_Worker(node, info["NodeID"], slots, handle))
    infos: list[dict[str, Any]] = []
    for w in workers:
        try:
            infos.append(ray.get(w.handle.info.remote(), timeout=300))
        except Exception as exc:  # a node that died or could not start the actor
            infos.append({"refused": f"node {w.node}: its worker did not start: {exc}"})
    usable = []
    for w, got in zip(workers, infos, strict=True):
        if got.get("refused"):
            stats.refused[w.node] = got["refused"]
            with contextlib.suppress(Exception):
                ray.kill(w.handle)
        else:
            stats.nodes[w.node] = w.slots
            usable.append(w)
    if not usable:
        why = "; ".join(stats.refused.values()) or "the cluster has no alive node"
        raise ExecutorError(f"no node of the cluster can take the work: {why}")
    return usable


#: How many workers an item may take down (dying while it ran there) before it is given up.
LOSSES = 2


async def schedule(
    ray: Any,
    workers: list[_Worker],
    items: list[Any],
    submit: Callable[[_Worker, Any], Any],
    crashed: Callable[[Any, str, BaseException], Trajectory],
    stats: RayStats,
    *,
    concurrency: int | None = None,
) -> AsyncIterator[Trajectory]:
    """Hand ``items`` to the workers within their slots (and ``concurrency`` over all), yield
    each result as it comes. A worker that dies gives its items back to the queue, to run
    elsewhere, each at most ``LOSSES`` times: an item whose run took down that many workers
    yields ``crashed(item, node, exc)`` instead, so that one item cannot take down every node
    in turn. A worker that raises on an item yields ``crashed`` too and keeps taking others."""
    from ray.exceptions import (
        ActorDiedError,
        ActorUnavailableError,
        RayActorError,
        RayTaskError,
        WorkerCrashedError,
    )

    lost_types = (ActorDiedError, ActorUnavailableError, RayActorError, WorkerCrashedError)
    queue: deque[tuple[Any, float | None]] = deque((item, None) for item in items)
    flight: dict[asyncio.Future[Any], tuple[_Worker, Any]] = {}
    cap = concurrency if concurrency and concurrency > 0 else None

    losses: Counter[int] = Counter()  # id(item) -> workers lost while it ran there

    def lose(worker: _Worker, item: Any, exc: BaseException) -> Trajectory | None:
        worker.alive = False
        stats.lost[worker.node] += 1
        losses[id(item)] += 1
        if losses[id(item)] >= LOSSES:
            why = ExecutorError(f"{LOSSES} workers were lost while it ran (the last: {exc})")
            return crashed(item, worker.node, why)
        queue.appendleft((item, time.monotonic()))
        return None

    try:
        while queue or flight:
            while queue and (cap is None or len(flight) < cap):
                free = [w for w in workers if w.alive and w.busy < w.slots]
                if not free:
                    break
                worker = min(free, key=lambda w: w.busy / w.slots)
                item, lost_at = queue.popleft()
                if lost_at is not None:
                    stats.rescheduled_s.append(time.monotonic() - lost_at)
                fut = asyncio.wrap_future(submit(worker, item).future())
                flight[fut] = (worker, item)
                worker.busy += 1
            if not flight:
                if queue and any(w.alive for w in workers):  # slots held by other work
                    await asyncio.sleep(0.05)
                    continue
                raise ExecutorError(
                    f"every node of the cluster is gone; {len(queue)} run(s) not done"
                )
            done, _ = await asyncio.wait(flight, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                worker, item = flight.pop(fut)
                worker.busy -= 1
                try:
                    result = fut.result()
                except lost_types as exc:
                    if (given_up := lose(worker, item, exc)) is not None:
                        yield given_up
                    continue
                except RayTaskError as exc:
                    cause = exc.cause if isinstance(exc.cause, BaseException) else exc
                    if isinstance(cause, lost_types):
                        if (given_up := lose(worker, item, cause)) is not None:
                            yield given_up
                        continue
                    stats.crashes[worker.node] += 1
                    yield crashed(item, worker.node, cause)
                    continue
                stats.runs[worker.node] += 1
                yield result
    finally:
        for fut in flight:
            fut.cancel()


def _crashed_run(run: Any, node: str, exc: BaseException, harness: str) -> Trajectory:
    return Trajectory(
        trajectory_id=run.trajectory_id,
        task_id=run.task.instance_id,
        group_id=run.task.instance_id,
        sample_index=run.sample_index,
        harness=harness,
        status="sandbox_error",
        evidence={
            "error": f"executor: the worker on node {node} raised {type(exc).__name__}: {exc}",
            "executor": {"node": node, "raised": type(exc).__name__},
            "node": node,
        },
    )


def write_turns(traj: Trajectory, turns_dir: Path, refs_relative_to: Path) -> Trajectory:
    """The Turns that came back inline, written to ``turns_dir`` here (whole, then renamed),
    and the Trajectory pointing at them as an in-process run's does."""
    from legorl.records import write_jsonl

    if not traj.turns:
        return replace(traj, turns=None, turns_ref=None)
    path = turns_dir / f"{traj.trajectory_id}.jsonl"
    tmp = path.with_name(f".{path.name}.partial")
    write_jsonl(tmp, traj.turns)
    os.replace(tmp, path)
    return replace(traj, turns=None, turns_ref=[os.path.relpath(path, refs_relative_to)])


class RayExecutor:
    """Rollout and grading on the cluster at ``address``: ``start`` connects and puts one
    worker on each node that can take the work (``ExecutorError`` when none can), then
    ``rollout`` or ``grade`` stream results back, and ``close`` stops the workers.

        executor = RayExecutor("auto", setup)
        stats = await executor.start()
        async for traj in executor.rollout_runs(runs, turns_dir=…, refs_relative_to=…):
            …
        await executor.close()

    It is also a ``legorl.protocols.Executor``: ``rollout(work)`` and ``grade(work)`` take the
    work as plain data and start the workers for that work (its harness, sandbox and run id)
    over the engine ``setup`` names, and stop them when it is done.
    """

    name = "ray"

    def __init__(self, address: str, setup: WorkerSetup) -> None:
        self.address = address
        self.setup = setup
        self.stats = RayStats()
        self._ray: Any = None
        self._workers: list[_Worker] = []
        self._serving = False

    async def start(self) -> RayStats:
        self._ray = connect(self.address)
        self._workers = await asyncio.to_thread(start_workers, self._ray, self.setup, self.stats)
        return self.stats

    async def serve(self) -> str:
        """``start``, then each worker's engine and proxy now, for work that comes piece after
        piece over one policy (the loop's phases): every ``rollout`` and ``grade`` then runs
        on these workers, and ``load_weights`` moves every node's engine to a new checkpoint.
        Returns the model name the harnesses ask for."""
        await self.start()
        got = await asyncio.gather(
            *(_result(w.handle.serve.remote()) for w in self._workers), return_exceptions=True
        )
        names: set[str] = set()
        for w, info in zip(self._workers, got, strict=True):
            if isinstance(info, BaseException):
                raise ExecutorError(f"node {w.node}: its engine did not start: {_first(info)}")
            names.add(info["served_name"])
        self._serving = True
        return sorted(names)[0]

    async def load_weights(self, path: str) -> int:
        """The checkpoint folder ``path`` (on this machine) shipped to every worker through
        the object store and loaded by each node's engine; the new policy version, the same on
        every node. A node lost meanwhile is left out; an engine that refuses raises
        ``EngineError`` naming its node."""
        from legorl.protocols import EngineError

        root = Path(path)
        files = {
            str(f.relative_to(root)): f.read_bytes() for f in sorted(root.rglob("*")) if f.is_file()
        }
        ref = self._ray.put(files)
        alive = [w for w in self._workers if w.alive]
        got = await asyncio.gather(
            *(_result(w.handle.load_weights.remote(ref)) for w in alive), return_exceptions=True
        )
        versions: dict[str, int] = {}
        for w, version in zip(alive, got, strict=True):
            if isinstance(version, BaseException):
                if _lost(version):
                    w.alive = False
                    continue
                raise EngineError(f"node {w.node}: weight sync: {_first(version)}")
            versions[w.node] = version
        if not versions:
            raise EngineError("weight sync: every node of the cluster is gone")
        if len(set(versions.values())) > 1:
            raise EngineError(f"weight sync: the nodes serve different versions: {versions}")
        return next(iter(versions.values()))

    async def rollout_runs(
        self,
        runs: list[Any],
        *,
        turns_dir: Path,
        refs_relative_to: Path,
        concurrency: int | None = None,
    ) -> AsyncIterator[Trajectory]:
        """``runs`` (``legorl.rollout.Run``) on the cluster; yields each Trajectory as it ends,
        its Turns written to ``turns_dir``."""
        harness = self.setup.harness or "?"
        async for traj in schedule(
            self._ray,
            self._workers,
            runs,
            lambda w, run: w.handle.rollout.remote(run),
            lambda run, node, exc: _crashed_run(run, node, exc, harness),
            self.stats,
            concurrency=concurrency,
        ):
            yield write_turns(traj, turns_dir, refs_relative_to)

    async def grade_all(
        self,
        trajectories: list[Trajectory],
        tasks: dict[str, Any],
        *,
        load_turns: Callable[[Trajectory], list[Turn]],
        concurrency: int | None = None,
    ) -> AsyncIterator[Trajectory]:
        """Grade ``trajectories`` on the cluster; yields each graded one as it ends
        (environment failures pass through ungraded, as in-process)."""
        from legorl.records import ENVIRONMENT_FAILURES

        todo = []
        for traj in trajectories:
            if traj.status in ENVIRONMENT_FAILURES:
                yield replace(
                    traj,
                    reward=None,
                    verdict={"resolved": None, "reason": f"not graded: status {traj.status}"},
                )
            else:
                todo.append(traj)

        def submit(w: _Worker, traj: Trajectory) -> Any:
            turns = load_turns(traj)
            return w.handle.grade.remote(replace(traj, turns=turns), tasks[traj.task_id])

        def crashed(traj: Trajectory, node: str, exc: BaseException) -> Trajectory:
            if isinstance(exc, ExecutorError):  # its grading took down `LOSSES` workers
                why = f"executor: grading it took down workers, the last on node {node}: {exc}"
                verdict = {"resolved": False, "reason": why, "node": node}
                flags = sorted({*traj.hack_flags, "grading_failed"})
                return replace(traj, reward=0.0, verdict=verdict, hack_flags=flags)
            why = f"executor: the worker on node {node} raised {type(exc).__name__}: {exc}"
            verdict = {"resolved": None, "reason": why, "node": node}
            return replace(traj, reward=None, verdict=verdict)

        async for graded in schedule(
            self._ray, self._workers, todo, submit, crashed, self.stats, concurrency=concurrency
        ):
            yield graded

    # ---- legorl.protocols.Executor ---------------------------------------------------------

    async def prepare(self, sandbox: str, sandbox_options: dict[str, Any], tasks: list) -> None:
        """Connect now (no cluster: ``ExecutorError`` before any work); each node's backend
        builds or pulls its own images when its worker starts."""
        self._ray = connect(self.address)

    def _for(self, **fields: Any) -> RayExecutor:
        return RayExecutor(self.address, replace(self.setup, **fields))

    def _merge(self, other: RayStats) -> None:
        self.stats.nodes.update(other.nodes)
        self.stats.refused.update(other.refused)
        for mine, theirs in (
            (self.stats.runs, other.runs),
            (self.stats.crashes, other.crashes),
            (self.stats.lost, other.lost),
        ):
            mine.update(theirs)
        self.stats.rescheduled_s += other.rescheduled_s

    async def rollout(self, work: Any) -> AsyncIterator[Trajectory]:
        """A ``RolloutWork`` on the cluster; Turns land in ``{work.folder}/turns``."""
        if work.adapter is not None:  # each node's proxy opens its sessions on the policy
            raise ExecutorError(
                f"adapter {work.adapter!r}: the Ray executor's sessions sample with the policy "
                "only; run an evaluation on a named adapter in-process"
            )
        if self._serving:  # on the workers already serving the policy
            if (work.harness, work.sandbox) != (self.setup.harness, self.setup.sandbox):
                raise ExecutorError(
                    f"the workers run harness {self.setup.harness} in {self.setup.sandbox} "
                    f"sandboxes, not {work.harness} in {work.sandbox}"
                )
            folder = Path(work.folder).resolve()
            (folder / "turns").mkdir(parents=True, exist_ok=True)
            options = dict(work.harness_options)
            async for traj in schedule(
                self._ray,
                self._workers,
                work.runs,
                lambda w, run: w.handle.rollout.remote(run, options),
                lambda run, node, exc: _crashed_run(run, node, exc, work.harness),
                self.stats,
                concurrency=work.concurrency,
            ):
                yield write_turns(traj, folder / "turns", folder)
            return
        sub = self._for(
            harness=work.harness,
            harness_options=dict(work.harness_options),
            sandbox=work.sandbox,
            sandbox_options=dict(work.sandbox_options),
            served_model=work.model,
            tasks_dir=str(Path(work.tasks_dir).resolve()),
            timeout=work.timeout,
            run_id=work.run_id,
        )
        folder = Path(work.folder).resolve()
        (folder / "turns").mkdir(parents=True, exist_ok=True)
        try:
            await sub.start()
            async for traj in sub.rollout_runs(
                work.runs,
                turns_dir=folder / "turns",
                refs_relative_to=folder,
                concurrency=work.concurrency,
            ):
                yield traj
        finally:
            await sub.close()
            self._merge(sub.stats)

    async def grade(self, work: Any) -> AsyncIterator[Trajectory]:
        """A ``GradeWork`` on the cluster; the Turns its hack scans read are sent along."""
        from legorl.executors.inprocess import load_turns

        if self._serving:
            async for graded in self.grade_all(
                work.trajectories,
                {t.instance_id: t for t in work.tasks},
                load_turns=lambda traj: load_turns(traj, Path(work.folder)),
                concurrency=work.concurrency,
            ):
                yield graded
            return
        sub = self._for(
            harness=None,
            sandbox=work.sandbox,
            sandbox_options=dict(work.sandbox_options),
            tasks_dir=str(Path(work.tasks_dir).resolve()),
            run_id=work.run_id,
        )
        folder = Path(work.folder)
        try:
            await sub.start()
            async for graded in sub.grade_all(
                work.trajectories,
                {t.instance_id: t for t in work.tasks},
                load_turns=lambda traj: load_turns(traj, folder),
                concurrency=work.concurrency,
            ):
                yield graded
        finally:
            await sub.close()
            self._merge(sub.stats)

    async def close(self) -> None:
        if self._ray is None:
            return
        closing = [w.handle.close.remote() for w in self._workers if w.alive]
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.gather(*closing, return_exceptions=True), timeout=60)
        for w in self._workers:
            with contextlib.suppress(Exception):
                self._ray.kill(w.handle)
        self._workers = []
        self._serving = False


def _result(ref: Any) -> asyncio.Future[Any]:
    return asyncio.wrap_future(ref.future())


def _first(exc: BaseException) -> str:
    """An exception's first line, the cause's when Ray wrapped it."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        exc = cause
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _lost(exc: BaseException) -> bool:
    """The worker died (its node lost), rather than raised."""
    from ray.exceptions import (
        ActorDiedError,
        ActorUnavailableError,
        RayActorError,
        WorkerCrashedError,
    )

    lost = (ActorDiedError, ActorUnavailableError, RayActorError, WorkerCrashedError)
    return isinstance(exc, lost)
