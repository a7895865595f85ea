"""Grading throughput on the toy set at concurrency 4, tasks per minute, in Docker, beside
concurrency 1 in the same run (`python -m legorl.bench --only verify`). Each task is graded on
its gold patch, so every grading runs the full test command."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Any


async def _grade_all(
    trajs: list[Any], tasks: dict[str, Any], tasks_dir: Path, concurrency: int
) -> tuple[float, int]:
    from legorl.sandbox import make_backend
    from legorl.verify import verify

    backend = make_backend("docker")
    start = time.perf_counter()
    resolved = 0
    async for graded in verify(
        trajs,
        tasks,
        backend=backend,
        tasks_dir=str(tasks_dir),
        run_id=f"legorl-bench-verify-{concurrency}",
        load_turns=lambda t: [],
        concurrency=concurrency,
    ):
        resolved += graded.reward == 1.0
    return time.perf_counter() - start, resolved


def bench_verify(quick: bool = False) -> dict[str, Any]:
    from legorl.records import Task, Trajectory, read_jsonl

    root = Path(__file__).resolve().parents[3]
    tasks_file = root / "fixtures" / "tasks" / "train.jsonl"
    tasks = list(read_jsonl(tasks_file, Task))[: 8 if quick else 24]
    trajs = [
        Trajectory(
            trajectory_id=f"{t.instance_id}.gold",
            task_id=t.instance_id,
            group_id=t.instance_id,
            sample_index=0,
            harness="gold",
            status="ok",
            patch=t.patch,
        )
        for t in tasks
    ]
    by_id = {t.instance_id: t for t in tasks}
    # Build the instance images first, so the figure is grading, not image building.
    asyncio.run(_grade_all(trajs, by_id, tasks_file.parent, 4))
    report: dict[str, Any] = {"tasks": len(trajs)}
    for c in (1, 4):
        seconds, resolved = asyncio.run(
            _grade_all([dataclasses.replace(t) for t in trajs], by_id, tasks_file.parent, c)
        )
        report[f"concurrency_{c}"] = {
            "seconds": round(seconds, 2),
            "resolved": resolved,
            "tasks_per_min": round(len(trajs) / seconds * 60, 1),
        }
    report["speedup_4_vs_1"] = round(
        report["concurrency_4"]["tasks_per_min"] / report["concurrency_1"]["tasks_per_min"], 2
    )
    return report
