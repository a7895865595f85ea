"""`legorl verify`: grade trajectories' patches in fresh sandboxes.

legorl verify runs/traj.jsonl --tasks fixtures/tasks/train.jsonl --sandbox docker --out runs/graded.jsonl
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from pathlib import Path
from typing import Annotated

import typer

from ._common import (
    Inputs,
    Out,
    SkipBad,
    TaskFormat,
    choices,
    console,
    fail,
    iter_inputs,
    on_ray,
    require_images,
)

HELP = "Grade trajectories' patches in a fresh sandbox; adds reward, verdict and hack flags."


def verify(
    tasks: Annotated[
        Path, typer.Option("--tasks", "-t", help="The task file the trajectories ran on.")
    ],
    task_format: TaskFormat = None,
    inputs: Inputs = None,
    sandbox: Annotated[str, typer.Option(help=choices("sandbox"))] = "docker",
    concurrency: Annotated[int, typer.Option("--concurrency", "-c", help="Gradings at once.")] = 4,
    test_timeout: Annotated[float, typer.Option(help="Seconds for the test run.")] = 300.0,
    out: Out = None,
    skip_bad: SkipBad = False,
    strict: Annotated[
        bool, typer.Option(help="Stop at the first monitor alert (e.g. a hack flag).")
    ] = False,
    ray: Annotated[
        str | None,
        typer.Option(
            "--ray",
            metavar="ADDRESS",
            help="Grade on the Ray cluster at ADDRESS (auto: the one running here), one worker "
            "per node with its own sandboxes.",
        ),
    ] = None,
) -> None:
    """Grade each trajectory: reward 1/0, per-test verdict, hack flags; env failures pass through."""
    from legorl.align import AlignError, turns_of
    from legorl.monitors import Monitor, MonitorStop
    from legorl.protocols import SandboxError
    from legorl.records import JsonlWriter, RecordError, Trajectory
    from legorl.sandbox import make_backend
    from legorl.tasks import TaskError, load_tasks
    from legorl.verify import VerifyConfig
    from legorl.verify import verify as grade_all

    try:
        by_id = {t.instance_id: t for t in load_tasks(tasks, task_format=task_format)}
    except TaskError as exc:
        fail("verify", str(exc), 2)
    try:
        backend = make_backend(sandbox)
    except (ValueError, TypeError, SandboxError) as exc:
        fail("verify", str(exc), 2)
    sources = list(inputs) if inputs else []
    base = sources[0].parent if len(sources) == 1 and str(sources[0]) != "-" else Path.cwd()
    trajectories = list(iter_inputs("verify", inputs, Trajectory, skip_bad))
    unknown = sorted({t.task_id for t in trajectories} - set(by_id))
    if unknown:
        fail("verify", f"trajectory task(s) not in {tasks}: {', '.join(unknown[:5])}")
    if ray is None:  # on a cluster, each node's backend builds or pulls its own
        require_images("verify", backend, [by_id[t.task_id] for t in trajectories])
    counts: Counter[str] = Counter()
    monitor = Monitor(
        alerts_path=(out.parent if out else Path.cwd()) / "alerts.jsonl", strict=strict
    )

    def load(traj: Trajectory) -> list:
        # Turns only feed hack flags: a run without readable turns is still graded.
        try:
            return list(turns_of(traj, base))
        except (AlignError, RecordError):
            return []

    run_id = f"legorl-verify-{uuid.uuid4().hex[:8]}"
    config = VerifyConfig(test_timeout=test_timeout)

    async def main() -> None:
        from legorl import __version__
        from legorl.executors.ray import WorkerSetup

        if ray is None:
            with JsonlWriter(out) as writer:
                async for graded in grade_all(
                    trajectories,
                    by_id,
                    backend=backend,
                    tasks_dir=str(tasks.parent),
                    run_id=run_id,
                    load_turns=load,
                    concurrency=concurrency,
                    config=config,
                ):
                    take(writer, graded)
            return
        setup = WorkerSetup(
            version=__version__,
            sandbox=sandbox,
            tasks_dir=str(tasks.parent.resolve()),
            run_id=run_id,
            verify_config=config,
        )
        async with on_ray("verify", ray, setup) as executor:
            with JsonlWriter(out) as writer:
                async for graded in executor.grade_all(trajectories, by_id, load_turns=load):
                    take(writer, graded)

    def take(writer: JsonlWriter, graded: Trajectory) -> None:
        writer.write(graded)
        monitor.observe_trajectory(graded)
        counts["graded" if graded.reward is not None else "not graded"] += 1
        counts["resolved"] += graded.reward == 1.0
        counts["flagged"] += bool(graded.hack_flags)

    try:
        asyncio.run(main())
    except MonitorStop as stop:
        fail("verify", str(stop))
    console.print(
        f"legorl verify: {counts['graded']} graded, {counts['resolved']} resolved, "
        f"{counts['not graded']} not graded, {counts['flagged']} with hack flags",
        markup=False,
    )
