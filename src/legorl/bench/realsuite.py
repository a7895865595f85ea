"""Grading time per task on the real-repository suite (fixtures/tasks-real/), in Docker and in
bubblewrap, beside the bare test command on a host checkout in the same run
(`python -m legorl.bench --only realsuite`).

Each task is graded on its gold patch one at a time (concurrency 1), after a warm-up pass that
builds its images, so a figure is one grading: fresh sandbox, patch judged, test_patch applied,
tests run and re-run. Projects whose log parser is not registered are left out and named.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BACKENDS = ("docker", "local")


def _gold(task: Any) -> Any:
    from legorl.records import Trajectory

    return Trajectory(
        trajectory_id=f"{task.instance_id}.gold",
        task_id=task.instance_id,
        group_id=task.instance_id,
        sample_index=0,
        harness="gold",
        status="ok",
        patch=task.patch,
    )


async def _grade_one(task: Any, backend: Any, tasks_dir: Path, run_id: str) -> tuple[float, bool]:
    from legorl.verify import verify

    start = time.perf_counter()
    resolved = False
    async for graded in verify(
        [_gold(task)],
        {task.instance_id: task},
        backend=backend,
        tasks_dir=str(tasks_dir),
        run_id=run_id,
        load_turns=lambda t: [],
        concurrency=1,
    ):
        resolved = graded.reward == 1.0
    return time.perf_counter() - start, resolved


def _bare(task: Any, tasks_dir: Path) -> float:
    """Seconds of the task's own test command on a host checkout with both patches applied."""
    from legorl.tasks import apply_patch, checkout

    with tempfile.TemporaryDirectory(prefix="legorl-bench-real-") as tmp:
        repo = checkout(task, tasks_dir, Path(tmp) / "repo")
        apply_patch(repo, task.test_patch)
        apply_patch(repo, task.patch)
        argv = shlex.split(task.test_cmd)
        argv[0] = sys.executable if argv[0] == "python" else argv[0]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PYTHON"))}
        env.update(PYTHONPATH=str(repo), PYTHONDONTWRITEBYTECODE="1")
        env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
        start = time.perf_counter()
        subprocess.run(argv, cwd=repo, env=env, capture_output=True, timeout=600, check=False)
        return time.perf_counter() - start


def _summary(seconds: list[float]) -> dict[str, float]:
    return {
        "median_s": round(statistics.median(seconds), 2),
        "mean_s": round(statistics.fmean(seconds), 2),
        "max_s": round(max(seconds), 2),
    }


def bench_realsuite(quick: bool = False) -> dict[str, Any]:
    from legorl.records import Task, read_jsonl
    from legorl.sandbox import make_backend
    from legorl.verify.parsers import PARSERS

    root = Path(__file__).resolve().parents[3]
    tasks_dir = root / "fixtures" / "tasks-real"
    every = list(read_jsonl(tasks_dir / "tasks.jsonl", Task))
    tasks = [t for t in every if t.log_parser in PARSERS]
    left_out = sorted({t.meta["project"] for t in every if t.log_parser not in PARSERS})
    if quick:
        tasks = tasks[:2]
    report: dict[str, Any] = {"tasks": len(tasks), "left_out_projects": left_out}
    report["bare_test_cmd"] = _summary([_bare(t, tasks_dir) for t in tasks])
    for name in BACKENDS:
        backend = make_backend(name)
        run_id = f"legorl-bench-real-{name}"
        for task in tasks:  # warm-up: builds the env and instance images
            asyncio.run(_grade_one(task, backend, tasks_dir, run_id))
        seconds, resolved = [], 0
        for task in tasks:
            took, ok = asyncio.run(_grade_one(task, backend, tasks_dir, run_id))
            seconds.append(took)
            resolved += ok
        figures = {**_summary(seconds), "resolved": resolved}
        figures["overhead_vs_bare"] = round(
            figures["median_s"] / max(report["bare_test_cmd"]["median_s"], 1e-3), 1
        )
        report[name] = figures
    return report
